"""The Helm chart renders with a real Helm (v4, from ci-tools.sh) and validates against schemas.

Built-in kinds are validated with kubernetes-validate's bundled Kubernetes JSON schemas (strict:
unknown fields fail); the Prometheus Operator kinds against ``schemas/monitoring.coreos.com_v1.json``
(a subset of the CRD schemas), and the PrometheusRule's groups additionally with ``promtool``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from model.planner import Machine, Options, make_plan

from .tools import CHART, DASHBOARDS, EXAMPLE_CONFIG, RULES, python_module_or_fail, run, tool

K8S_VERSION = "1.33.0"
SCHEMAS = json.loads((Path(__file__).parent / "schemas" / "monitoring.coreos.com_v1.json").read_text())
REQUIRED = [
    "--set", "model.existingClaim=qwen4exp-checkpoint",
    "--set", "apiKeys.existingSecret=qwen4exp-api-keys",
    "--set", "sidecar.existingConfigMap=qwen4exp-kv-scales",
]  # fmt: skip


def render(*args: str) -> tuple[int, str]:
    proc = run([tool("helm"), "template", "qwen4exp", str(CHART), "--namespace", "llm", *args])
    return proc.returncode, proc.stdout + proc.stderr


def docs(*args: str) -> list[dict]:
    code, out = render(*args)
    assert code == 0, out
    return [d for d in yaml.safe_load_all(out) if d]


def by_kind(manifests: list[dict]) -> dict[str, dict]:
    return {d["kind"]: d for d in manifests}


@pytest.fixture(scope="module")
def manifests() -> list[dict]:
    return docs(*REQUIRED)


def test_helm_lint():
    proc = run([tool("helm"), "lint", str(CHART), *REQUIRED])
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "missing, message",
    [
        ("model.existingClaim", "model.existingClaim is required"),
        ("apiKeys.existingSecret", "apiKeys.existingSecret or apiKeys.keys is required"),
        ("sidecar.existingConfigMap", "sidecar.kvScales (or sidecar.existingConfigMap) is required"),
    ],
)
def test_rendering_fails_without_required_value(missing, message):
    args = []
    for i in range(0, len(REQUIRED), 2):
        if not REQUIRED[i + 1].startswith(missing + "="):
            args += REQUIRED[i : i + 2]
    code, out = render(*args)
    assert code != 0
    assert message in out


def test_grace_period_must_cover_drain():
    code, out = render(*REQUIRED, "--set", "engine.drainSeconds=200")
    assert code != 0 and "terminationGracePeriodSeconds" in out


def test_chart_managed_secret_and_sidecar_configmap():
    scales = {"model.layers.3.self_attn": {"k_scale": 0.01, "v_scale": 0.02}}
    out = by_kind(
        docs(
            "--set",
            "model.existingClaim=ckpt",
            "--set",
            "apiKeys.keys={key-one,key-two}",
            "--set-json",
            f"sidecar.kvScales={json.dumps(scales)}",
        )  # fmt: skip
    )
    assert out["Secret"]["stringData"]["api-keys"].split() == ["key-one", "key-two"]
    cms = [d for d in docs("--set", "model.hostPath=/srv/m", "--set", "apiKeys.keys={k}", "--set-json",
                           f"sidecar.kvScales={json.dumps(scales)}") if d["kind"] == "ConfigMap"]  # fmt: skip
    sidecar = [c for c in cms if "qsa-kv-scales.json" in c["data"]][0]
    assert json.loads(sidecar["data"]["qsa-kv-scales.json"]) == scales


def test_builtin_kinds_validate_against_kubernetes_schemas(manifests):
    python_module_or_fail("kubernetes_validate")
    import kubernetes_validate

    builtin = [d for d in manifests if not d["apiVersion"].startswith("monitoring.coreos.com/")]
    assert {d["kind"] for d in builtin} == {"Deployment", "Service", "ConfigMap"}
    for d in builtin:
        kubernetes_validate.validate(d, K8S_VERSION, strict=True)
    # The validator is not vacuous: a misspelt field fails.
    broken = json.loads(json.dumps(by_kind(manifests)["Deployment"]))
    broken["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def test_crd_kinds_validate_against_their_schemas(manifests, tmp_path):
    python_module_or_fail("jsonschema")
    import jsonschema

    crds = [d for d in manifests if d["apiVersion"].startswith("monitoring.coreos.com/")]
    assert {d["kind"] for d in crds} == {"ServiceMonitor", "PrometheusRule"}
    for d in crds:
        jsonschema.validate(d, SCHEMAS[d["kind"]])
    rule = by_kind(manifests)["PrometheusRule"]
    assert rule["spec"] == yaml.safe_load(RULES.read_text()), "PrometheusRule must be the shared rules file"
    extracted = tmp_path / "rules.yml"
    extracted.write_text(yaml.safe_dump(rule["spec"]))
    proc = run([tool("promtool"), "check", "rules", str(extracted)])
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_deployment_for_one_4x3090_node(manifests):
    dep = by_kind(manifests)["Deployment"]
    spec = dep["spec"]
    pod = spec["template"]["spec"]
    (c,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert spec["strategy"]["type"] == "Recreate" and spec["replicas"] == 1
    assert env["QWEN4EXP_TENSOR_PARALLEL_SIZE"] == "4"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert c["resources"]["requests"]["nvidia.com/gpu"] == 4
    for name, value in {"NCCL_P2P_DISABLE": "1", "NCCL_IB_DISABLE": "1", "NCCL_SHM_DISABLE": "0"}.items():
        assert env[name] == value
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["dshm"]["emptyDir"]["medium"] == "Memory"
    assert vols["model"]["persistentVolumeClaim"] == {"claimName": "qwen4exp-checkpoint", "readOnly": True}
    assert vols["sidecar"]["configMap"]["name"] == "qwen4exp-kv-scales"
    assert vols["api-keys"]["secret"]["secretName"] == "qwen4exp-api-keys"
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts["dshm"]["mountPath"] == "/dev/shm"
    assert mounts["model"]["readOnly"] and mounts["sidecar"]["readOnly"] and mounts["api-keys"]["readOnly"]
    assert env["VLLM_QSA_KV_SCALES"] == "/sidecar/qsa-kv-scales.json"
    assert env["QWEN4EXP_API_KEYS_FILE"] == "/run/secrets/qwen4exp/api-keys"
    assert c["startupProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    pre_stop = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert pod["terminationGracePeriodSeconds"] > pre_stop + float(env["QWEN4EXP_DRAIN_SECONDS"])
    assert pod["securityContext"]["runAsNonRoot"] is True


def test_memory_request_covers_the_planners_host_memory(manifests):
    """requests.memory + /dev/shm come from the planner (PLE format fp8_e4m3, 4x3090, 128 GiB)."""
    plan = make_plan(EXAMPLE_CONFIG, Machine(), Options(ple_format="fp8_e4m3"))
    c = by_kind(manifests)["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    request = c["resources"]["requests"]["memory"]
    assert request.endswith("Gi") and int(request[:-2]) >= plan.memory_request_gib
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["engine"]["maxNumSeqs"] <= plan.capacity.sequences_fit
    assert values["engine"]["maxModelLen"] == plan.seq_len


def test_dashboards_configmap_is_the_same_json(manifests):
    cm = [d for d in manifests if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-dashboards")][
        0
    ]
    files = sorted(DASHBOARDS.glob("*.json"))
    assert sorted(cm["data"]) == [f.name for f in files]
    for f in files:
        assert json.loads(cm["data"][f.name]) == json.loads(f.read_text())
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"


def test_servicemonitor_scrapes_the_service_port(manifests):
    kinds = by_kind(manifests)
    (endpoint,) = kinds["ServiceMonitor"]["spec"]["endpoints"]
    assert endpoint["port"] == kinds["Service"]["spec"]["ports"][0]["name"] and endpoint["path"] == "/metrics"
    closed = by_kind(docs(*REQUIRED, "--set", "metrics.open=false"))["ServiceMonitor"]
    assert closed["spec"]["endpoints"][0]["authorization"]["credentials"]["name"] == "qwen4exp-api-keys"
