"""The Helm chart renders with a real Helm (v4, from ci-tools.sh) and validates against schemas.

Built-in kinds are validated with kubernetes-validate's bundled Kubernetes JSON schemas (strict:
unknown fields fail); the Prometheus Operator kinds against ``schemas/monitoring.coreos.com_v1.json``
(a subset of the CRD schemas), and the PrometheusRule's groups additionally with ``promtool``. The
values are validated by Helm itself against the chart's ``values.schema.json``.

Three cluster shapes are rendered: no Prometheus Operator CRDs (``helm template`` without
``--api-versions``, what ``helm install`` sees on such a cluster), the CRDs served (``CRDS``), and
kube-prometheus-stack, whose Prometheus selects objects labelled ``release=<its release>``. Three
value sets are linted, rendered and validated: the defaults, router mode (``ROUTER``) and
``values-all-options.yaml`` (every optional object at once).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from model.tools.planner import Machine, Options, make_plan

from .tools import CHART, DASHBOARDS, EXAMPLE_CONFIG, RULES, python_module_or_fail, run, tool

PROMTOOL_TESTS = Path(__file__).parent / "promtool" / "qwen4exp-alerts.test.yml"

K8S_VERSION = "1.33.0"
SCHEMAS = json.loads((Path(__file__).parent / "schemas" / "monitoring.coreos.com_v1.json").read_text())
REQUIRED = [
    "--set", "model.existingClaim=qwen4exp-checkpoint",
    "--set", "apiKeys.existingSecret=qwen4exp-api-keys",
    "--set", "sidecar.existingConfigMap=qwen4exp-kv-scales",
]  # fmt: skip
# The cluster serves the Prometheus Operator's API (what `helm install` finds with its CRDs installed).
CRDS = [
    "--api-versions", "monitoring.coreos.com/v1/ServiceMonitor",
    "--api-versions", "monitoring.coreos.com/v1/PrometheusRule",
]  # fmt: skip
MONITORING = {"ServiceMonitor", "PrometheusRule"}
# Router mode: the router's NetworkPolicy needs the API server's endpoint addresses.
ROUTER = [
    "--set", "replicaCount=3", "--set", "router.enabled=true",
    "--set", "networkPolicy.apiServerCIDRs={10.0.0.10/32}",
]  # fmt: skip
ALL_OPTIONS = Path(__file__).parent / "values-all-options.yaml"
INGRESS = ["--set", "ingress.enabled=true", "--set", "ingress.hosts={llm.example.com}"]
# vllm-router's worker-management routes, answered without auth on its client port.
ADMIN_ROUTES = ["/add_worker", "/remove_worker", "/workers", "/list_workers", "/flush_cache", "/get_loads"]


def render(*args: str, release: str = "qwen4exp") -> tuple[int, str]:
    proc = run([tool("helm"), "template", release, str(CHART), "--namespace", "llm", *args])
    return proc.returncode, proc.stdout + proc.stderr


def docs(*args: str, release: str = "qwen4exp") -> list[dict]:
    code, out = render(*args, release=release)
    assert code == 0, out
    return [d for d in yaml.safe_load_all(out) if d]


def notes(*args: str) -> str:
    """NOTES.txt as `helm install` prints it (client-side dry run: no cluster)."""
    proc = run(
        [tool("helm"), "install", "qwen4exp", str(CHART), "--namespace", "llm", "--dry-run=client", *args]
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.split("NOTES:", 1)[1]


def by_kind(manifests: list[dict]) -> dict[str, dict]:
    return {d["kind"]: d for d in manifests}


@pytest.fixture(scope="module")
def manifests() -> list[dict]:
    return docs(*REQUIRED, *CRDS)


def test_helm_lint():
    proc = run([tool("helm"), "lint", "--strict", str(CHART), *REQUIRED])
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
    assert {d["kind"] for d in builtin} == {
        "Deployment",
        "Service",
        "ConfigMap",
        "NetworkPolicy",
        "PodDisruptionBudget",
    }
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


def test_media_domains_reach_the_service_and_none_is_the_default(manifests):
    (c,) = by_kind(manifests)["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert "QWEN4EXP_ALLOWED_MEDIA_DOMAINS" not in {e["name"] for e in c["env"]}
    args = ["--set", "engine.allowedMediaDomains={images.example.com,cdn.example.org}"]
    (dep,) = [d for d in docs(*REQUIRED, *args) if d["kind"] == "Deployment"]
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["QWEN4EXP_ALLOWED_MEDIA_DOMAINS"] == "images.example.com,cdn.example.org"


def test_guaranteed_qos_sized_from_the_planner(manifests):
    """Requests == limits (Guaranteed QoS) and the memory covers the planner's container memory
    (pinned PLE tables fp8_e4m3 + workers + front end + /dev/shm, 4x3090, 128 GiB) without taking
    the node's OS share."""
    plan = make_plan(EXAMPLE_CONFIG, Machine(), Options(ple_format="fp8_e4m3"))
    pod = by_kind(manifests)["Deployment"]["spec"]["template"]["spec"]
    for c in pod["containers"]:  # Guaranteed: every container, cpu and memory, limits == requests
        res = c["resources"]
        assert res["requests"] == res["limits"], res
        assert {"cpu", "memory"} <= set(res["limits"])
    res = pod["containers"][0]["resources"]["limits"]
    memory = res["memory"]
    assert memory.endswith("Gi")
    assert (
        plan.memory_request_gib <= int(memory[:-2]) <= plan.machine.host_ram_gib - plan.options.os_reserve_gib
    )
    shm = pod["volumes"][[v["name"] for v in pod["volumes"]].index("dshm")]["emptyDir"]["sizeLimit"]
    assert shm == f"{plan.options.shm_gib:g}Gi", "the planner's /dev/shm is part of its memory figure"
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
    closed = by_kind(docs(*REQUIRED, *CRDS, "--set", "metrics.open=false"))["ServiceMonitor"]
    assert closed["spec"]["endpoints"][0]["authorization"]["credentials"]["name"] == "qwen4exp-api-keys"


# ------------------------------------------------------------------------------------------------
# Cluster shapes: no CRDs, kube-prometheus-stack, another release name
# ------------------------------------------------------------------------------------------------


def test_without_prometheus_operator_crds_no_monitoring_objects_and_a_warning():
    """helm install on a cluster without the CRDs must not fail: the objects are skipped, NOTES say so."""
    python_module_or_fail("kubernetes_validate")
    import kubernetes_validate

    rendered = docs(*REQUIRED)
    assert not MONITORING & {d["kind"] for d in rendered}
    for d in rendered:  # everything left is a built-in kind the API server accepts
        kubernetes_validate.validate(d, K8S_VERSION, strict=True)
    text = notes(*REQUIRED)
    assert "no ServiceMonitor was created" in text and "no PrometheusRule was created" in text
    # Explicit choices win: true renders without the API (offline rendering), false never renders.
    assert MONITORING <= {d["kind"] for d in docs(*REQUIRED, "--set", "serviceMonitor.enabled=true",
                                                  "--set", "prometheusRule.enabled=true")}  # fmt: skip
    off = docs(
        *REQUIRED, *CRDS, "--set", "serviceMonitor.enabled=false", "--set", "prometheusRule.enabled=false"
    )
    assert not MONITORING & {d["kind"] for d in off}


def test_kube_prometheus_stack_selects_the_objects_by_release_label():
    """kube-prometheus-stack (release "kps") selects ServiceMonitors and PrometheusRules with
    matchLabels {release: kps} (serviceMonitorSelectorNilUsesHelmValues / ruleSelectorNilUsesHelmValues)."""
    selector = {"release": "kps"}
    unlabelled = by_kind(docs(*REQUIRED, *CRDS))
    for kind in MONITORING:
        assert not selector.items() <= unlabelled[kind]["metadata"]["labels"].items()
    # helm install has no --api-versions: the CRDs' effect is forced with enabled=true.
    forced = ["--set", "serviceMonitor.enabled=true", "--set", "prometheusRule.enabled=true"]
    assert 'has no "release" label' in notes(*REQUIRED, *forced)

    args = [
        *REQUIRED,
        *CRDS,
        "--set",
        "serviceMonitor.labels.release=kps",
        "--set",
        "prometheusRule.labels.release=kps",
    ]
    labelled = by_kind(docs(*args))
    for kind in MONITORING:
        assert selector.items() <= labelled[kind]["metadata"]["labels"].items(), kind
        jsonschema_validate(labelled[kind])
    assert "WARNING" not in notes(*[a for a in args if a not in CRDS], *forced)
    # The dashboards ConfigMap carries the label kube-prometheus-stack's Grafana sidecar watches.
    cm = [
        d for d in docs(*args) if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-dashboards")
    ]
    assert cm[0]["metadata"]["labels"]["grafana_dashboard"] == "1"


def jsonschema_validate(doc: dict) -> None:
    python_module_or_fail("jsonschema")
    import jsonschema

    jsonschema.validate(doc, SCHEMAS[doc["kind"]])


def test_custom_release_name_and_the_job_label_the_alerts_are_tested_with():
    """Release "prod": every object is prod-qwen4exp, selectors still connect, and the Prometheus
    Operator's job label (the Service name) is the one the promtool unit tests use."""
    kinds = by_kind(docs(*REQUIRED, *CRDS, release="prod"))
    for kind in ("Deployment", "Service", "ServiceMonitor", "PrometheusRule"):
        assert kinds[kind]["metadata"]["name"] == "prod-qwen4exp", kind
    pod_labels = kinds["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert kinds["Service"]["spec"]["selector"].items() <= pod_labels.items()
    monitor = kinds["ServiceMonitor"]["spec"]["selector"]["matchLabels"]
    assert monitor.items() <= kinds["Service"]["metadata"]["labels"].items()
    assert "jobLabel" not in kinds["ServiceMonitor"]["spec"]  # so job = the Service's name
    assert f'job="{kinds["Service"]["metadata"]["name"]}"' in PROMTOOL_TESTS.read_text()
    assert kinds["PrometheusRule"]["spec"] == yaml.safe_load(RULES.read_text())


# ------------------------------------------------------------------------------------------------
# values.schema.json, image, runtime class, PodDisruptionBudget
# ------------------------------------------------------------------------------------------------


def test_values_schema_is_valid_and_accepts_the_defaults():
    python_module_or_fail("jsonschema")
    import jsonschema

    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.validate(yaml.safe_load((CHART / "values.yaml").read_text()), schema)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--set", "engine.kvCacheDtype=fp16"], "/engine/kvCacheDtype"),
        (["--set", "resources.memory=lots"], "/resources/memory"),
        (["--set", "serviceMonitor.enabeld=true"], "additional properties 'enabeld' not allowed"),
        (["--set", "serviceMonitor.enabled=yes"], "/serviceMonitor/enabled"),
        (["--set", "image.digest=latest"], "/image/digest"),
        (["--set", "image.pullPolicy=Sometimes"], "/image/pullPolicy"),
        (["--set", "engine.gpuMemoryUtilization=1.5"], "/engine/gpuMemoryUtilization"),
        (["--set", "apiKeys.keys={has space}"], "/apiKeys/keys/0"),
    ],
)
def test_values_schema_rejects_bad_values(args, message):
    code, out = render(*REQUIRED, *args)
    assert code != 0 and message in out, out


def test_gpus_must_match_tensor_parallel_size():
    code, out = render(*REQUIRED, "--set", "resources.gpus=2")
    assert code != 0 and "resources.gpus (2) must equal engine.tensorParallelSize (4)" in out


def test_image_by_digest_runtime_class_and_secret_mode(manifests):
    pod = by_kind(manifests)["Deployment"]["spec"]["template"]["spec"]
    assert pod["containers"][0]["image"] == "qwen4exp-serve:0.1.0"
    assert pod["runtimeClassName"] == "nvidia"
    keys = [v for v in pod["volumes"] if v["name"] == "api-keys"][0]["secret"]
    assert keys["defaultMode"] == 0o440 and pod["securityContext"]["fsGroup"] == 10001
    digest = "sha256:" + "ab" * 32
    pinned = by_kind(
        docs(*REQUIRED, "--set", f"image.digest={digest}", "--set", "image.repository=reg.example/llm/q")
    )
    assert (
        pinned["Deployment"]["spec"]["template"]["spec"]["containers"][0]["image"]
        == f"reg.example/llm/q@{digest}"
    )
    no_class = by_kind(docs(*REQUIRED, "--set", "runtimeClassName="))["Deployment"]["spec"]["template"][
        "spec"
    ]
    assert "runtimeClassName" not in no_class


@pytest.mark.parametrize("replicas", [1, 3])
def test_pod_disruption_budget_lets_a_drain_through_at_any_replica_count(replicas):
    """On by default with maxUnavailable 1: one replica a drain evicts (README "Disruptions"), N > 1
    one at a time. 0 would block every voluntary eviction and is refused."""
    python_module_or_fail("kubernetes_validate")
    import kubernetes_validate

    args = [*REQUIRED, "--set", f"replicaCount={replicas}"]
    if replicas > 1:
        args = [*REQUIRED, *ROUTER]
    rendered = {(d["kind"], d["metadata"]["name"]): d for d in docs(*args)}
    pdb = rendered["PodDisruptionBudget", "qwen4exp"]
    kubernetes_validate.validate(pdb, K8S_VERSION, strict=True)
    assert pdb["spec"]["maxUnavailable"] == 1
    dep = rendered["Deployment", "qwen4exp"]
    assert dep["spec"]["replicas"] == replicas
    assert (
        pdb["spec"]["selector"]["matchLabels"].items()
        <= dep["spec"]["template"]["metadata"]["labels"].items()
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--set", "podDisruptionBudget.maxUnavailable=0"], "/podDisruptionBudget/maxUnavailable"),
        (["--set", "podDisruptionBudget.maxUnavailable=0%"], "/podDisruptionBudget/maxUnavailable"),
        (
            [*ROUTER, "--set", "router.podDisruptionBudget.maxUnavailable=0"],
            "/router/podDisruptionBudget/maxUnavailable",
        ),
    ],
)
def test_pod_disruption_budget_refuses_zero(args, message):
    code, out = render(*REQUIRED, *args)
    assert code != 0 and message in out, out


def test_pod_disruption_budget_readme_says_what_a_drain_does_to_one_replica():
    text = (CHART / "README.md").read_text()
    section = text.split("### Disruptions", 1)[1].split("\n## ", 1)[0]
    assert "`replicaCount: 1` a drain evicts the only replica" in section
    values = (CHART / "values.yaml").read_text()
    assert "With\n# replicaCount 1 a drain evicts the only replica" in values


def test_every_value_is_in_the_readme_table():
    """README kept current: each leaf of values.yaml is named in the chart README's values table
    (``a.b`` itself, ``a.*``, or ``a.b`` / ``.c`` shorthand rows)."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    table = "\n".join(ln for ln in (CHART / "README.md").read_text().splitlines() if ln.startswith("| `"))
    opaque = {"nccl", "labels", "kvScales", "annotations"}  # maps whose keys are user data

    def leaves(d: dict, prefix: str = ""):
        for key, value in d.items():
            path = f"{prefix}.{key}" if prefix else key
            if isinstance(value, dict) and value and key not in opaque:
                yield from leaves(value, path)
            else:
                yield path

    missing = []
    for path in leaves(values):
        parts = path.split(".")
        covered = (
            f"`{path}`" in table
            or f"`{path}.*`" in table
            or any(f"`{'.'.join(parts[:i])}.*`" in table for i in range(1, len(parts)))
            or (len(parts) > 1 and f"`{'.'.join(parts[:-1])}." in table and f".{parts[-1]}`" in table)
        )
        if not covered:
            missing.append(path)
    assert not missing, f"values not in k8s/qwen4exp/README.md's table: {missing}"


def test_group_version_api_versions_render_the_monitors():
    """`--api-versions monitoring.coreos.com/v1` (group-version only, what most CI tools pass) counts
    as the Prometheus Operator's API being served: both objects render, and NOTES warn of neither."""
    gv = ["--api-versions", "monitoring.coreos.com/v1"]
    kinds = {d["kind"] for d in docs(*REQUIRED, *gv)}
    assert MONITORING <= kinds, kinds
    # NOTES.txt decides its warnings with the same helper (helm install has no --api-versions to try).
    assert (CHART / "templates" / "NOTES.txt").read_text().count('include "qwen4exp.wanted"') == 2
    # Another group's version does not count.
    assert not MONITORING & {
        d["kind"] for d in docs(*REQUIRED, "--api-versions", "monitoring.example.com/v1")
    }


def test_pod_hardening_read_only_root_and_no_service_account_token(manifests):
    pod = by_kind(manifests)["Deployment"]["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    (container,) = pod["containers"]
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    # Every path the service writes is a volume: the metrics dir, /tmp, the caches, /dev/shm.
    env = {e["name"]: e.get("value") for e in container["env"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    for path in (env["PROMETHEUS_MULTIPROC_DIR"], "/tmp", "/home/app/.cache", "/dev/shm"):
        assert path in mounts, path
        assert "emptyDir" in volumes[mounts[path]] or "persistentVolumeClaim" in volumes[mounts[path]]


def test_network_policy_is_on_by_default_and_pins_egress_to_dns(manifests):
    python_module_or_fail("kubernetes_validate")
    import kubernetes_validate

    assert by_kind(manifests)["NetworkPolicy"]["metadata"]["name"] == "qwen4exp"
    peer = '{"namespaceSelector":{"matchLabels":{"kubernetes.io/metadata.name":"monitoring"}}}'
    policy = by_kind(docs(*REQUIRED, "--set-json", f"networkPolicy.ingressFrom=[{peer}]"))["NetworkPolicy"]
    kubernetes_validate.validate(policy, K8S_VERSION, strict=True)
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"port": 8000, "protocol": "TCP"}]
    assert rule["from"][0]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "monitoring"
    }
    dep = by_kind(docs(*REQUIRED))["Deployment"]
    assert (
        policy["spec"]["podSelector"]["matchLabels"].items()
        <= dep["spec"]["template"]["metadata"]["labels"].items()
    )
    (dns,) = policy["spec"]["egress"]
    assert {p["port"] for p in dns["ports"]} == {53}
    assert dns["to"] == [
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
            "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
        }
    ]
    assert "NetworkPolicy" not in by_kind(docs(*REQUIRED, "--set", "networkPolicy.enabled=false"))


def test_router_egress_only_dns_replicas_and_the_api_server():
    """Every egress rule of the router names its peers: no rule open to any address on a port."""
    python_module_or_fail("kubernetes_validate")
    import kubernetes_validate

    rendered = {(d["kind"], d["metadata"]["name"]): d for d in docs(*REQUIRED, *ROUTER)}
    router = rendered["NetworkPolicy", "qwen4exp-router"]
    kubernetes_validate.validate(router, K8S_VERSION, strict=True)
    egress = router["spec"]["egress"]
    assert all(rule.get("to") for rule in egress), egress
    replicas, dns, api = egress
    assert replicas["to"][0]["podSelector"]["matchLabels"] == {
        "app.kubernetes.io/name": "qwen4exp",
        "app.kubernetes.io/instance": "qwen4exp",
    }
    assert {p["port"] for p in dns["ports"]} == {53}
    assert api["to"] == [{"ipBlock": {"cidr": "10.0.0.10/32"}}]
    assert {p["port"] for p in api["ports"]} == {443, 6443}


def test_router_mode_without_api_server_cidrs_fails_naming_the_lookup():
    code, out = render(*REQUIRED, "--set", "router.enabled=true")
    assert code != 0, out
    assert "networkPolicy.apiServerCIDRs is required" in out
    assert "kubectl get endpoints kubernetes" in out and "jsonpath=" in out
    # Without the policies the router's discovery is unrestricted and the value is not needed.
    assert docs(*REQUIRED, "--set", "router.enabled=true", "--set", "networkPolicy.enabled=false")


# ------------------------------------------------------------------------------------------------
# Router exposure: the Ingress routes client paths only, the router Service stays ClusterIP
# ------------------------------------------------------------------------------------------------


def served_probes() -> set[str]:
    """The service's probe routes, read from its FastAPI app."""
    app = (CHART.parents[1] / "service" / "app.py").read_text()
    return {path for path in ("/health", "/ready") if f'@app.get("{path}")' in app}


def ingress_paths(ingress: dict) -> dict[str, tuple[str, str, int]]:
    (rule,) = ingress["spec"]["rules"]
    return {
        p["path"]: (p["pathType"], p["backend"]["service"]["name"], p["backend"]["service"]["port"]["number"])
        for p in rule["http"]["paths"]
    }


def test_ingress_routes_only_the_api_and_the_model_services_probes():
    python_module_or_fail("kubernetes_validate")
    import kubernetes_validate

    assert "Ingress" not in {d["kind"] for d in docs(*REQUIRED)}
    tls = '[{"secretName":"llm-tls","hosts":["llm.example.com"]}]'
    ingress = by_kind(docs(*REQUIRED, *INGRESS, "--set-json", f"ingress.tls={tls}"))["Ingress"]
    kubernetes_validate.validate(ingress, K8S_VERSION, strict=True)
    assert ingress["spec"]["tls"] == [{"secretName": "llm-tls", "hosts": ["llm.example.com"]}]
    assert served_probes() == {"/health", "/ready"}
    assert ingress_paths(ingress) == {
        "/v1/": ("Prefix", "qwen4exp", 8000),
        **{probe: ("Exact", "qwen4exp", 8000) for probe in served_probes()},
    }


def test_ingress_in_router_mode_points_at_the_router_and_never_at_its_admin_routes():
    python_module_or_fail("kubernetes_validate")
    import kubernetes_validate

    rendered = {(d["kind"], d["metadata"]["name"]): d for d in docs(*REQUIRED, *ROUTER, *INGRESS)}
    ingress = rendered["Ingress", "qwen4exp"]
    kubernetes_validate.validate(ingress, K8S_VERSION, strict=True)
    (router,) = rendered["Deployment", "qwen4exp-router"]["spec"]["template"]["spec"]["containers"]
    router_probes = {router[p]["httpGet"]["path"] for p in ("livenessProbe", "readinessProbe")}
    paths = ingress_paths(ingress)
    assert paths == {
        "/v1/": ("Prefix", "qwen4exp-router", 8000),
        **{probe: ("Exact", "qwen4exp-router", 8000) for probe in router_probes},
    }
    for route in ADMIN_ROUTES:
        assert not any(route.startswith(path) for path, (kind, _, _) in paths.items() if kind == "Prefix")
        assert route not in paths
    assert rendered["Service", "qwen4exp-router"]["spec"]["type"] == "ClusterIP"


def test_ingress_needs_a_host():
    code, out = render(*REQUIRED, "--set", "ingress.enabled=true")
    assert code != 0 and "ingress.hosts is required" in out, out


@pytest.mark.parametrize("service_type", ["LoadBalancer", "NodePort"])
def test_router_service_outside_the_cluster_needs_the_explicit_opt_in(service_type):
    code, out = render(*REQUIRED, *ROUTER, "--set", f"router.service.type={service_type}")
    assert code != 0, out
    assert f"router.service.type={service_type}" in out
    assert "router.service.allowUnsafeAdminRoutes=true" in out and "ingress.enabled=true" in out
    opted_in = {
        (d["kind"], d["metadata"]["name"]): d
        for d in docs(
            *REQUIRED,
            *ROUTER,
            "--set",
            f"router.service.type={service_type}",
            "--set",
            "router.service.allowUnsafeAdminRoutes=true",
        )
    }
    assert opted_in["Service", "qwen4exp-router"]["spec"]["type"] == service_type


def test_readme_says_the_router_service_stays_cluster_ip_and_why():
    text = (CHART / "README.md").read_text()
    section = text.split("### Router exposure", 1)[1].split("\n### ", 1)[0]
    assert "must stay `ClusterIP`" in section and "without auth" in section
    assert "`Authorization` header" in section
    for route in ADMIN_ROUTES:
        assert f"`{route}`" in section, route


# ------------------------------------------------------------------------------------------------
# Router mode and every option at once: lint, render, validate
# ------------------------------------------------------------------------------------------------


def validate_all(manifests: list[dict]) -> None:
    python_module_or_fail("kubernetes_validate")
    import kubernetes_validate

    for d in manifests:
        if d["apiVersion"].startswith("monitoring.coreos.com/"):
            jsonschema_validate(d)
        else:
            kubernetes_validate.validate(d, K8S_VERSION, strict=True)


def test_router_mode_renders_lints_and_validates():
    proc = run([tool("helm"), "lint", "--strict", str(CHART), *REQUIRED, *ROUTER])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rendered = docs(*REQUIRED, *ROUTER, *CRDS)
    assert {"NetworkPolicy", "PodDisruptionBudget", "Role"} <= {d["kind"] for d in rendered}
    validate_all(rendered)


def test_all_options_render_lint_and_validate():
    proc = run([tool("helm"), "lint", "--strict", str(CHART), "-f", str(ALL_OPTIONS)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rendered = docs("-f", str(ALL_OPTIONS))
    kinds = {d["kind"] for d in rendered}
    assert kinds >= {
        "Deployment", "Service", "ConfigMap", "Secret", "NetworkPolicy", "PodDisruptionBudget",
        "Ingress", "HorizontalPodAutoscaler", "ServiceAccount", "Role", "RoleBinding", *MONITORING,
    }  # fmt: skip
    validate_all(rendered)  # Helm validated the merged values against values.schema.json


def test_packaged_chart_keeps_its_readme(tmp_path):
    proc = run([tool("helm"), "package", str(CHART), "--destination", str(tmp_path)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (archive,) = tmp_path.glob("qwen4exp-*.tgz")
    proc = run([tool("helm"), "show", "readme", str(archive)])
    assert proc.returncode == 0 and proc.stdout.startswith("# qwen4exp Helm chart"), proc.stdout + proc.stderr
