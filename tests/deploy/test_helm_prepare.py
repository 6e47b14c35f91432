"""The chart's prepare Job (download, convert, calibrate) and its volumes, rendered by a real Helm.

The steps must be compose's one-shot profiles in Kubernetes form: the same entry points (read from
``compose.yaml`` with its defaults), the Hub token as a file, the calibrate step with the service's
environment as the Deployment renders it plus compose's calibrate overrides, and the GPUs the
Deployment requests. Rendering must refuse what cannot work: several replicas on a chart-managed
ReadWriteOnce model claim, the Job writing the model while replicas run. Every rendered object is
validated with kubernetes-validate (strict), as in ``test_helm.py``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT

from .test_helm import K8S_VERSION, REQUIRED, by_kind, docs, render, validate_all
from .tools import CHART, python_module_or_fail, run, tool

COMPOSE = ROOT / "compose.yaml"
PROMPTS = ROOT / "deploy" / "calibration" / "prompts.txt"
PREPARE_ALL = Path(__file__).parent / "values-prepare-all-options.yaml"
# Prepare mode: no replica while the Job writes the model; the scales come from the model volume.
PREPARE = [
    "--set", "model.persistence.create=true", "--set", "apiKeys.existingSecret=qwen4exp-api-keys",
    "--set", "sidecar.source=modelVolume", "--set", "replicaCount=0",
    "--set", "prepare.source.persistence.create=true",
]  # fmt: skip
ALL_STEPS = [
    "--set", "prepare.download.enabled=true", "--set", "prepare.convert.enabled=true",
    "--set", "prepare.calibrate.enabled=true", "--set", "prepare.download.hfToken.existingSecret=hf-token",
]  # fmt: skip
TOKEN_PATH = "/run/secrets/hf-token"


def compose_defaults(value):
    """``${NAME:-default}`` / ``${NAME-default}`` -> default (what compose uses without a .env)."""
    if isinstance(value, str):
        return re.sub(r"\$\{[A-Z0-9_]+:?[-?]([^}]*)\}", r"\1", value)
    if isinstance(value, list):
        return [compose_defaults(v) for v in value]
    if isinstance(value, dict):
        return {k: compose_defaults(v) for k, v in value.items()}
    return value


@pytest.fixture(scope="module")
def compose() -> dict:
    return compose_defaults(yaml.safe_load(COMPOSE.read_text())["services"])


@pytest.fixture(scope="module")
def prepared() -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for d in docs(*PREPARE, *ALL_STEPS)}


def job_pod(rendered) -> dict:
    (job,) = [d for (kind, _), d in rendered.items() if kind == "Job"]
    return job["spec"]["template"]["spec"]


def steps(pod: dict) -> dict[str, dict]:
    return {c["name"]: c for c in [*pod.get("initContainers", []), *pod["containers"]]}


def env_of(container: dict) -> dict[str, str | None]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


# ------------------------------------------------------------------------------------------------
# Defaults: nothing new renders
# ------------------------------------------------------------------------------------------------


def test_defaults_render_no_job_no_claim_and_the_same_deployment():
    rendered = docs(*REQUIRED)
    kinds = {d["kind"] for d in rendered}
    assert not {"Job", "PersistentVolumeClaim"} & kinds, kinds
    names = {d["metadata"]["name"] for d in rendered}
    assert not any("prepare" in n for n in names), names
    dep = by_kind(rendered)["Deployment"]
    pod = dep["spec"]["template"]["spec"]
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["model"] == {
        "name": "model",
        "persistentVolumeClaim": {"claimName": "qwen4exp-checkpoint", "readOnly": True},
    }
    assert env_of(pod["containers"][0])["VLLM_QSA_KV_SCALES"] == "/sidecar/qsa-kv-scales.json"
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["model"]["persistence"]["create"] is False
    assert not any(values["prepare"][s]["enabled"] for s in ("download", "convert", "calibrate"))
    assert values["prepare"]["download"]["repo"] == "Qwen/Qwen4-Exp"
    assert values["prepare"]["download"]["revision"] == "main"


# ------------------------------------------------------------------------------------------------
# The steps: compose's entry points, in order, one pod
# ------------------------------------------------------------------------------------------------


def test_steps_run_in_order_in_one_pod(prepared):
    pod = job_pod(prepared)
    assert [c["name"] for c in pod["initContainers"]] == ["download", "convert"]
    assert [c["name"] for c in pod["containers"]] == ["calibrate"]
    assert pod["restartPolicy"] == "OnFailure"
    # Only the calibrate step alone: one container, no source volume, still the GPUs.
    alone = job_pod({(d["kind"], d["metadata"]["name"]): d for d in docs(
        *[a for a in PREPARE if a != "prepare.source.persistence.create=true"][:-1],
        "--set", "prepare.calibrate.enabled=true")})  # fmt: skip
    assert "initContainers" not in alone and [c["name"] for c in alone["containers"]] == ["calibrate"]
    assert "source" not in {v["name"] for v in alone["volumes"]}
    # download + convert: no GPU anywhere, no NVIDIA runtime class.
    cpu = job_pod({(d["kind"], d["metadata"]["name"]): d for d in docs(
        *PREPARE, "--set", "prepare.download.enabled=true", "--set", "prepare.convert.enabled=true")})  # fmt: skip
    assert [c["name"] for c in cpu["initContainers"]] == ["download"]
    assert [c["name"] for c in cpu["containers"]] == ["convert"]
    assert "runtimeClassName" not in cpu
    for c in steps(cpu).values():
        assert "nvidia.com/gpu" not in str(c["resources"])


def test_download_and_convert_are_compose_entry_points(prepared, compose):
    s = steps(job_pod(prepared))
    for name in ("download", "convert"):
        assert s[name]["command"] == compose[name]["entrypoint"], name
        assert "args" not in s[name]
    assert compose["download"]["entrypoint"][3] == "Qwen/Qwen4-Exp"
    # download's environment is compose's (the token path included, with the Secret given).
    assert env_of(s["download"]) == {k: str(v) for k, v in compose["download"]["environment"].items()}
    # Values reach the arguments.
    custom = steps(job_pod({(d["kind"], d["metadata"]["name"]): d for d in docs(
        *PREPARE, *ALL_STEPS, "--set", "prepare.download.repo=org/other", "--set",
        "prepare.download.revision=0123abc", "--set", "prepare.convert.pleFormat=nvfp4")}))  # fmt: skip
    assert custom["download"]["command"][3:6] == ["org/other", "--revision", "0123abc"]
    assert custom["convert"]["command"][custom["convert"]["command"].index("--ple-format") + 1] == "nvfp4"


def test_calibrate_is_compose_calibrate_writing_next_to_the_checkpoint(prepared, compose):
    pod = job_pod(prepared)
    cal = steps(pod)["calibrate"]
    expected = list(compose["calibrate"]["entrypoint"])
    out = expected.index("--out") + 1
    assert expected[out] == "/sidecar/qsa-kv-scales.json"
    expected[out] = "/models/qwen4-exp/qsa-kv-scales.json"  # the chart's one difference: the model volume
    assert cal["command"] == expected
    # The replicas read exactly that file (sidecar.source=modelVolume), from the same volume.
    dep = prepared["Deployment", "qwen4exp"]["spec"]["template"]["spec"]
    (svc,) = dep["containers"]
    assert env_of(svc)["VLLM_QSA_KV_SCALES"] == expected[out]
    assert "sidecar" not in {v["name"] for v in dep["volumes"]}
    model_mount = {m["name"]: m for m in cal["volumeMounts"]}["model"]
    assert model_mount["mountPath"] == "/models/qwen4-exp" and not model_mount.get("readOnly")
    assert {m["name"]: m for m in svc["volumeMounts"]}["model"]["readOnly"] is True
    job_claim = {v["name"]: v for v in pod["volumes"]}["model"]["persistentVolumeClaim"]["claimName"]
    dep_claim = {v["name"]: v for v in dep["volumes"]}["model"]["persistentVolumeClaim"]["claimName"]
    assert job_claim == dep_claim == "qwen4exp-model"
    prompts = {m["name"]: m for m in cal["volumeMounts"]}["prompts"]
    assert prompts["mountPath"] + "/prompts.txt" == expected[expected.index("--prompts") + 1]


def test_calibrate_environment_is_the_deployments_with_composes_overrides(prepared, compose):
    cal = steps(job_pod(prepared))["calibrate"]
    (svc,) = prepared["Deployment", "qwen4exp"]["spec"]["template"]["spec"]["containers"]
    overrides = {k: str(v) for k, v in compose["calibrate"]["environment"].items()}
    base = {k: str(v) for k, v in compose["qwen4exp"]["environment"].items()}
    # compose's calibrate overrides: those it sets to a value, and those it empties ("" = unset).
    changed = {k: v for k, v in overrides.items() if base.get(k) != v and "<<" not in k}
    assert changed, "compose's calibrate sets its own environment"
    env = env_of(cal)
    for name, value in changed.items():
        if value == "":
            assert name not in env, name
        else:
            assert env[name] == value, name
    service = {e["name"]: e for e in svc["env"]}
    expected = {k: v for k, v in service.items() if k not in changed}
    assert {e["name"]: e for e in cal["env"] if e["name"] not in changed} == expected
    # ... and follows the Deployment's values (no second copy to drift).
    tuned = env_of(steps(job_pod({(d["kind"], d["metadata"]["name"]): d for d in docs(
        *PREPARE, *ALL_STEPS, "--set", "engine.maxModelLen=16384", "--set-string", "nccl.NCCL_P2P_DISABLE=0")}))["calibrate"])  # fmt: skip
    assert tuned["QWEN4EXP_MAX_MODEL_LEN"] == "16384" and tuned["NCCL_P2P_DISABLE"] == "0"


def test_calibrate_requests_the_gpus_like_the_deployment(prepared):
    pod = job_pod(prepared)
    cal = steps(pod)["calibrate"]
    (svc,) = prepared["Deployment", "qwen4exp"]["spec"]["template"]["spec"]["containers"]
    assert cal["resources"] == svc["resources"]
    assert cal["resources"]["limits"]["nvidia.com/gpu"] == 4 == cal["resources"]["requests"]["nvidia.com/gpu"]
    assert pod["runtimeClassName"] == "nvidia"
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["dshm"]["emptyDir"]["medium"] == "Memory"
    for name in ("download", "convert"):
        assert "nvidia.com/gpu" not in str(steps(pod)[name]["resources"])


def test_hf_token_is_a_file_from_the_secret_never_an_env_var(prepared):
    pod = job_pod(prepared)
    dl = steps(pod)["download"]
    mount = {m["name"]: m for m in dl["volumeMounts"]}["hf-token"]
    assert mount["mountPath"] == TOKEN_PATH and mount["subPath"] == "hf-token" and mount["readOnly"]
    secret = {v["name"]: v for v in pod["volumes"]}["hf-token"]["secret"]
    assert secret["secretName"] == "hf-token" and secret["items"] == [{"key": "hf-token", "path": "hf-token"}]
    assert secret["defaultMode"] == 0o440
    assert env_of(dl)["HF_TOKEN_PATH"] == TOKEN_PATH
    for c in steps(pod).values():
        for e in c.get("env", []):
            assert "valueFrom" not in e, e
            assert e["name"] not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"), e
    # Without a Secret (a public repository): no token path, no volume.
    public = job_pod({(d["kind"], d["metadata"]["name"]): d for d in docs(
        *PREPARE, "--set", "prepare.download.enabled=true")})  # fmt: skip
    assert "HF_TOKEN_PATH" not in env_of(steps(public)["download"])
    assert "hf-token" not in {v["name"] for v in public["volumes"]}


def test_job_hardening_and_limits(prepared):
    (job,) = [d for (kind, _), d in prepared.items() if kind == "Job"]
    spec = job["spec"]
    assert spec["backoffLimit"] == 3
    assert 6 * 3600 <= spec["activeDeadlineSeconds"] <= 48 * 3600  # hours of download and conversion
    assert spec["ttlSecondsAfterFinished"] > 0
    pod = spec["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    sc = pod["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] == 10001 and sc["fsGroup"] == 10001
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    dep_sc = prepared["Deployment", "qwen4exp"]["spec"]["template"]["spec"]["containers"][0][
        "securityContext"
    ]
    for name, c in steps(pod).items():
        assert c["securityContext"] == dep_sc, name
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
        # A read-only root: every path written is a volume.
        assert "/tmp" in {m["mountPath"] for m in c["volumeMounts"]}, name
    # The pod is not one of the replicas: their Service, PDB and NetworkPolicy do not select it.
    labels = spec["template"]["metadata"]["labels"]
    selector = prepared["Service", "qwen4exp"]["spec"]["selector"]
    assert not selector.items() <= labels.items()


def test_volumes_scratch_and_claims(prepared):
    pod = job_pod(prepared)
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["source"]["persistentVolumeClaim"]["claimName"] == "qwen4exp-source"
    assert vols["scratch"]["emptyDir"]["sizeLimit"] == "200Gi"
    convert = steps(pod)["convert"]
    assert convert["resources"]["requests"]["ephemeral-storage"] == "200Gi"
    assert {m["name"]: m for m in convert["volumeMounts"]}["source"]["readOnly"] is True
    claims = {name: d for (kind, name), d in prepared.items() if kind == "PersistentVolumeClaim"}
    assert set(claims) == {"qwen4exp-model", "qwen4exp-source"}
    for claim in claims.values():
        assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
        assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
        assert "storageClassName" not in claim["spec"]  # the cluster's default class
    # Sizes cover the example config's 225 GB source and 84 GB checkpoint (GiB = 1.074 GB).
    assert claims["qwen4exp-source"]["spec"]["resources"]["requests"]["storage"] == "250Gi"
    assert claims["qwen4exp-model"]["spec"]["resources"]["requests"]["storage"] == "100Gi"
    on_claim = job_pod({(d["kind"], d["metadata"]["name"]): d for d in docs(
        *PREPARE, *ALL_STEPS, "--set", "prepare.scratch.existingClaim=scratch")})  # fmt: skip
    assert {v["name"]: v for v in on_claim["volumes"]}["scratch"]["persistentVolumeClaim"] == {
        "claimName": "scratch"
    }
    assert "ephemeral-storage" not in steps(on_claim)["convert"]["resources"]["requests"]


def test_calibration_prompts_default_to_composes_sample():
    assert (CHART / "calibration" / "prompts.txt").read_text() == PROMPTS.read_text()
    rendered = {(d["kind"], d["metadata"]["name"]): d for d in docs(*PREPARE, *ALL_STEPS)}
    cm = rendered["ConfigMap", "qwen4exp-prepare-prompts"]
    assert cm["data"]["prompts.txt"].splitlines() == PROMPTS.read_text().splitlines()
    custom = {(d["kind"], d["metadata"]["name"]): d for d in docs(
        *PREPARE, *ALL_STEPS, "--set", "prepare.calibrate.prompts={one prompt,another prompt}")}  # fmt: skip
    assert custom["ConfigMap", "qwen4exp-prepare-prompts"]["data"]["prompts.txt"].splitlines() == [
        "one prompt", "another prompt",
    ]  # fmt: skip
    existing = {(d["kind"], d["metadata"]["name"]): d for d in docs(
        *PREPARE, *ALL_STEPS, "--set", "prepare.calibrate.existingConfigMap=my-prompts")}  # fmt: skip
    assert ("ConfigMap", "qwen4exp-prepare-prompts") not in existing
    vols = {v["name"]: v for v in job_pod(existing)["volumes"]}
    assert vols["prompts"]["configMap"]["name"] == "my-prompts"


def test_prepare_network_policy_lets_out_dns_and_https_only_for_download(prepared):
    policy = prepared["NetworkPolicy", "qwen4exp-prepare"]
    pod_labels = [d for (k, _), d in prepared.items() if k == "Job"][0]["spec"]["template"]["metadata"][
        "labels"
    ]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"] and "ingress" not in policy["spec"]
    dns, https = policy["spec"]["egress"]
    assert {p["port"] for p in dns["ports"]} == {53}
    assert https == {"ports": [{"port": 443, "protocol": "TCP"}]}
    no_download = {(d["kind"], d["metadata"]["name"]): d for d in docs(
        *PREPARE, "--set", "prepare.calibrate.enabled=true")}  # fmt: skip
    assert len(no_download["NetworkPolicy", "qwen4exp-prepare"]["spec"]["egress"]) == 1


# ------------------------------------------------------------------------------------------------
# Refusals: several nodes on a ReadWriteOnce claim, the Job beside running replicas
# ------------------------------------------------------------------------------------------------

MULTI = {
    "replicas": ["--set", "replicaCount=3"],
    "router": ["--set", "router.enabled=true", "--set", "networkPolicy.apiServerCIDRs={10.0.0.10/32}"],
    "hpa": ["--set", "autoscaling.enabled=true"],
}
SERVE_ON_CLAIM = [
    "--set", "model.persistence.create=true", "--set", "apiKeys.existingSecret=k",
    "--set", "sidecar.existingConfigMap=s",
]  # fmt: skip


@pytest.mark.parametrize("shape", sorted(MULTI))
def test_several_replicas_on_a_read_write_once_claim_fail_naming_the_value(shape):
    code, out = render(*SERVE_ON_CLAIM, *MULTI[shape])
    assert code != 0, out
    assert "model.persistence.accessModes={ReadWriteMany}" in out and "ReadWriteOnce" in out
    assert "NFS, CephFS" in out
    rwx = ["--set", "model.persistence.accessModes={ReadWriteMany}"]
    ok = {(d["kind"], d["metadata"]["name"]): d for d in docs(*SERVE_ON_CLAIM, *MULTI[shape], *rwx)}
    assert ok["PersistentVolumeClaim", "qwen4exp-model"]["spec"]["accessModes"] == ["ReadWriteMany"]
    assert ok["Deployment", "qwen4exp"]["spec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"] == {
        "claimName": "qwen4exp-model", "readOnly": True,
    }  # fmt: skip
    # One replica: ReadWriteOnce is fine. An existing claim the chart cannot check (docs say what it needs).
    assert docs(*SERVE_ON_CLAIM)
    assert docs(*REQUIRED, *MULTI[shape])


@pytest.mark.parametrize(
    "args, message",
    [
        (["--set", "replicaCount=1", "--set", "prepare.convert.enabled=true"], "replicaCount=0"),
        (["--set", "prepare.calibrate.enabled=true", "--set", "sidecar.source=configMap",
          "--set", "sidecar.existingConfigMap=s"], "set sidecar.source=modelVolume"),
        (["--set", "prepare.source.persistence.create=false", "--set", "prepare.download.enabled=true"],
         "prepare.source.existingClaim"),
        (["--set", "model.existingClaim=other", "--set", "prepare.convert.enabled=true"],
         "model.existingClaim and model.persistence.create=true both"),
        (["--set", "model.persistence.accessModes={ReadOnlyMany}", "--set", "prepare.convert.enabled=true"],
         "write the model volume"),
        (["--set", "prepare.convert.pleFormat=fp16"], "/prepare/convert/pleFormat"),
        (["--set", "model.persistence.accessModes={ReadWriteSometimes}"], "/model/persistence/accessModes/0"),
        (["--set", "prepare.download.repo=no-slash"], "/prepare/download/repo"),
        (["--set", "prepare.donwload.enabled=true"], "additional properties 'donwload' not allowed"),
    ],
)  # fmt: skip
def test_prepare_refusals(args, message):
    code, out = render(*PREPARE, *args)
    assert code != 0, out
    assert message in out, out


# ------------------------------------------------------------------------------------------------
# Lint and validate; the documented commands match what renders
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("values", [[], ["-f", str(Path(__file__).parent / "values-all-options.yaml")],
                                    ["-f", str(PREPARE_ALL)]])  # fmt: skip
def test_helm_lint_is_clean(values):
    args = values or REQUIRED
    proc = run([tool("helm"), "lint", "--strict", str(CHART), *args])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[WARNING]" not in proc.stdout and "[ERROR]" not in proc.stdout, proc.stdout


def test_prepare_all_options_render_and_validate():
    python_module_or_fail("kubernetes_validate")
    import kubernetes_validate

    rendered = docs("-f", str(PREPARE_ALL))
    kinds = {d["kind"] for d in rendered}
    assert {"Job", "PersistentVolumeClaim", "NetworkPolicy", "ConfigMap", "Deployment"} <= kinds
    validate_all(rendered)
    named = {(d["kind"], d["metadata"]["name"]): d for d in rendered}
    pod = job_pod(named)
    s = steps(pod)
    assert {m["name"]: m for m in s["convert"]["volumeMounts"]}["model"]["subPath"] == "qwen4-exp"
    assert env_of(s["download"])["HF_ENDPOINT"] == "https://hf-mirror.example.com"
    assert pod["nodeSelector"] == {"kubernetes.io/hostname": "gpu-node-1"}
    assert named["PersistentVolumeClaim", "qwen4exp-model"]["spec"]["storageClassName"] == "cephfs"
    # The validator is not vacuous for the new kinds.
    (job,) = [d for d in rendered if d["kind"] == "Job"]
    broken = yaml.safe_load(yaml.safe_dump(job))
    broken["spec"]["backofLimit"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def test_docs_commands_render_and_name_the_job():
    text = (ROOT / "docs" / "deployment.md").read_text()
    section = text.split("### Kubernetes: produce the model", 1)[1].split("\n### ", 1)[0]
    install = section.split("helm install qwen4exp k8s/qwen4exp", 1)[1].split("\nkubectl wait", 1)[0]
    sets = re.findall(r"--set (\S+)", install.replace("<commit>", "0123abc"))
    rendered = docs(*[a for s in sets for a in ("--set", s)])
    (job,) = [d for d in rendered if d["kind"] == "Job"]
    assert f"job/{job['metadata']['name']}" in section
    assert "ReadWriteMany" in section and "ReadOnlyMany" in section
    serve = section.split("helm upgrade qwen4exp k8s/qwen4exp --reuse-values", 1)[1].split("\nkubectl", 1)[0]
    upgrade = sets + re.findall(r"--set (\S+)", serve)
    served = docs(*[a for s in upgrade for a in ("--set", s)])
    assert "Job" not in {d["kind"] for d in served}
    assert {d["metadata"]["name"] for d in served if d["kind"] == "PersistentVolumeClaim"} == {
        "qwen4exp-model", "qwen4exp-source",
    }  # fmt: skip
    readme = (CHART / "README.md").read_text().split("## Producing the model", 1)[1].split("\n## ", 1)[0]
    assert "Why one Job, not three" in readme and "sidecar.source=modelVolume" in readme
