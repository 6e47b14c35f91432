"""The chart's scale-out: replicas spread one per node, vllm-router in front, an HPA example.

Rendered with the real Helm (``scripts/ci-tools.sh``) at ``replicaCount=3, router.enabled=true``;
built-in kinds validated with kubernetes-validate (strict), the ServiceMonitors with the CRD
schema subset the deployment tests use, the values by Helm against ``values.schema.json``.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT
from tests.deploy.tools import CHART, python_module_or_fail, run, tool

from .cluster import ROUTER_VERSION

K8S_VERSION = "1.33.0"
SCHEMAS = json.loads((ROOT / "tests" / "deploy" / "schemas" / "monitoring.coreos.com_v1.json").read_text())
REQUIRED = [
    "--set", "model.existingClaim=qwen4exp-checkpoint",
    "--set", "apiKeys.existingSecret=qwen4exp-api-keys",
    "--set", "sidecar.existingConfigMap=qwen4exp-kv-scales",
]  # fmt: skip
# Router mode renders only with the API server pinned for the router's egress (networkPolicy.apiServerCIDRs).
SCALED = [
    "--set",
    "replicaCount=3",
    "--set",
    "router.enabled=true",
    "--set",
    "networkPolicy.apiServerCIDRs={10.0.0.10/32}",
]
CRDS = ["--api-versions", "monitoring.coreos.com/v1/ServiceMonitor"]
REPLICA_SELECTOR = {"app.kubernetes.io/name": "qwen4exp", "app.kubernetes.io/instance": "qwen4exp"}


def render(*args: str) -> tuple[int, str]:
    proc = run([tool("helm"), "template", "qwen4exp", str(CHART), "--namespace", "llm", *args])
    return proc.returncode, proc.stdout + proc.stderr


def docs(*args: str) -> list[dict]:
    code, out = render(*args)
    assert code == 0, out
    return [d for d in yaml.safe_load_all(out) if d]


def named(manifests: list[dict]) -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for d in manifests}


@pytest.fixture(scope="module")
def scaled() -> dict[tuple[str, str], dict]:
    return named(docs(*REQUIRED, *SCALED, *CRDS))


def test_lint_is_clean_with_three_replicas_and_the_router():
    proc = run([tool("helm"), "lint", "--strict", str(CHART), *REQUIRED, *SCALED])
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_scaled_manifests_validate(scaled):
    python_module_or_fail("kubernetes_validate")
    python_module_or_fail("jsonschema")
    import jsonschema
    import kubernetes_validate

    kinds = {kind for kind, _ in scaled}
    assert {"Deployment", "Service", "ServiceAccount", "Role", "RoleBinding", "PodDisruptionBudget"} <= kinds
    for (kind, _), d in scaled.items():
        if d["apiVersion"].startswith("monitoring.coreos.com/"):
            jsonschema.validate(d, SCHEMAS[kind])
        else:
            kubernetes_validate.validate(d, K8S_VERSION, strict=True)


def test_replicas_spread_one_per_node(scaled):
    spec = scaled["Deployment", "qwen4exp"]["spec"]
    assert spec["replicas"] == 3
    assert spec["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1},
    }
    (term,) = spec["template"]["spec"]["affinity"]["podAntiAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    assert term == {
        "labelSelector": {"matchLabels": REPLICA_SELECTOR},
        "topologyKey": "kubernetes.io/hostname",
    }
    preferred = named(docs(*REQUIRED, *SCALED, "--set", "podAntiAffinity.mode=preferred"))
    anti = preferred["Deployment", "qwen4exp"]["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    assert anti["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"] == term


def router_container(scaled) -> dict:
    (container,) = scaled["Deployment", "qwen4exp-router"]["spec"]["template"]["spec"]["containers"]
    return container


def flag(args: list[str], name: str) -> str:
    (value,) = [a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")]
    return value


def test_router_discovers_exactly_the_replicas(scaled):
    args = router_container(scaled)["args"]
    assert "--service-discovery" in args and flag(args, "service-discovery-namespace") == "llm"
    selector = args[args.index("--selector") + 1 : args.index("--selector") + 3]
    assert dict(s.split("=", 1) for s in selector) == REPLICA_SELECTOR
    assert flag(args, "service-discovery-port") == "8000"
    assert flag(args, "policy") == "cache_aware" and flag(args, "health-check-endpoint") == "/ready"
    # The router's pods do not carry the replicas' labels: it cannot discover itself, and the
    # replicas' Service, PDB and NetworkPolicy do not select it.
    router_pod = scaled["Deployment", "qwen4exp-router"]["spec"]["template"]["metadata"]["labels"]
    assert not REPLICA_SELECTOR.items() <= router_pod.items()
    assert scaled["Service", "qwen4exp"]["spec"]["selector"] == REPLICA_SELECTOR
    # Discovery reads pods through the API: a namespaced read-only Role bound to its account.
    (rule,) = scaled["Role", "qwen4exp-router"]["rules"]
    assert rule == {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    binding = scaled["RoleBinding", "qwen4exp-router"]
    pod = scaled["Deployment", "qwen4exp-router"]["spec"]["template"]["spec"]
    assert binding["subjects"][0]["name"] == pod["serviceAccountName"] == "qwen4exp-router"


def test_router_readiness_resources_pdb_and_metrics(scaled):
    container = router_container(scaled)
    assert container["readinessProbe"]["httpGet"]["path"] == "/readiness"
    assert container["livenessProbe"]["httpGet"]["path"] == "/liveness"
    assert container["resources"]["requests"] and container["resources"]["limits"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    pod_labels = scaled["Deployment", "qwen4exp-router"]["spec"]["template"]["metadata"]["labels"]
    pdb = scaled["PodDisruptionBudget", "qwen4exp-router"]["spec"]
    assert pdb["maxUnavailable"] == 1 and pdb["selector"]["matchLabels"].items() <= pod_labels.items()
    service = scaled["Service", "qwen4exp-router"]["spec"]
    assert service["sessionAffinity"] == "ClientIP"  # each router pod has its own prefix tree
    ports = {p["name"]: p for p in service["ports"]}
    metrics_port = int(flag(container["args"], "prometheus-port"))
    assert (
        ports["metrics"]["port"] == metrics_port and flag(container["args"], "prometheus-host") == "0.0.0.0"
    )
    monitor = scaled["ServiceMonitor", "qwen4exp-router"]["spec"]
    assert (
        monitor["selector"]["matchLabels"].items()
        <= scaled["Service", "qwen4exp-router"]["metadata"]["labels"].items()
    )
    assert monitor["endpoints"][0]["port"] == "metrics"
    # Without the Prometheus Operator's API, no ServiceMonitor (as for the replicas').
    assert "ServiceMonitor" not in {d["kind"] for d in docs(*REQUIRED, *SCALED)}


def test_router_version_is_pinned_in_one_value_and_checked_at_start(scaled):
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["router"]["version"] == ROUTER_VERSION
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    assert f"vllm-router=={ROUTER_VERSION}" in extra
    container = router_container(scaled)
    script = container["command"][2]
    assert f'!= "{ROUTER_VERSION}"' in script and 'exec vllm-router "$@"' in script
    assert container["image"] == "qwen4exp-serve:0.1.0"  # the service image, which carries the wheel
    own = ["--set", "router.image.repository=registry.example/router"]
    code, out = render(*REQUIRED, *SCALED, *own)
    assert code != 0 and "router.image.tag is required" in out, out
    pinned = named(docs(*REQUIRED, *SCALED, *own, "--set", f"router.image.tag={ROUTER_VERSION}"))
    assert router_container(pinned)["image"] == f"registry.example/router:{ROUTER_VERSION}"


def test_router_off_by_default_keeps_one_recreated_replica():
    manifests = named(docs(*REQUIRED, *CRDS))
    assert not [name for _, name in manifests if name.endswith("-router")]
    spec = manifests["Deployment", "qwen4exp"]["spec"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    assert ("HorizontalPodAutoscaler", "qwen4exp") not in manifests


def test_hpa_example_on_queue_depth():
    python_module_or_fail("kubernetes_validate")
    import kubernetes_validate

    manifests = named(docs(*REQUIRED, *SCALED, "--set", "autoscaling.enabled=true"))
    hpa = manifests["HorizontalPodAutoscaler", "qwen4exp"]
    kubernetes_validate.validate(hpa, K8S_VERSION, strict=True)
    (metric,) = hpa["spec"]["metrics"]
    assert metric["pods"]["metric"]["name"] == "vllm_num_requests_waiting"
    assert hpa["spec"]["scaleTargetRef"]["name"] == "qwen4exp"
    assert "replicas" not in manifests["Deployment", "qwen4exp"]["spec"]  # the HPA owns the count


@pytest.mark.parametrize(
    "args, message",
    [
        (["--set", "router.policy=least_busy"], "/router/policy"),
        (["--set", "router.version=latest"], "/router/version"),
        (["--set", "podAntiAffinity.mode=always"], "/podAntiAffinity/mode"),
        (["--set", "router.metricsPort=8000"], "/router/metricsPort"),
        (["--set", "router.healthCheck.endpoint=/metrics"], "/router/healthCheck/endpoint"),
        (["--set", "autoscaling.targetAverageValue=many"], "/autoscaling/targetAverageValue"),
        (
            ["--set-json", 'affinity={"podAntiAffinity":{}}'],
            "set podAntiAffinity.mode=none to use your own rule",
        ),
    ],
)
def test_bad_scale_out_values_fail_with_the_field(args, message):
    code, out = render(*REQUIRED, *SCALED, *args)
    assert code != 0 and message in out, out


def test_docs_name_the_pinned_version():
    text = (ROOT / "docs" / "scale-out.md").read_text()
    assert f"vllm-router=={ROUTER_VERSION}" in text
    assert re.search(r"\| *concurrency", text, re.IGNORECASE), "the benchmark table is missing"


def test_readme_rows_exist_for_the_new_values():
    table = Path(CHART / "README.md").read_text()
    for key in ("replicaCount", "podAntiAffinity", "router.", "autoscaling."):
        assert f"`{key}" in table, key


def test_network_policies_let_only_the_router_and_clients_in():
    python_module_or_fail("kubernetes_validate")
    import kubernetes_validate

    peer = '[{"podSelector":{"matchLabels":{"app":"gateway"}}}]'
    manifests = named(
        docs(
            *REQUIRED,
            *SCALED,
            "--set",
            "networkPolicy.enabled=true",
            "--set-json",
            f"networkPolicy.ingressFrom={peer}",
        )
    )
    replicas, router = manifests["NetworkPolicy", "qwen4exp"], manifests["NetworkPolicy", "qwen4exp-router"]
    for policy in (replicas, router):
        kubernetes_validate.validate(policy, K8S_VERSION, strict=True)
    router_pod = manifests["Deployment", "qwen4exp-router"]["spec"]["template"]["metadata"]["labels"]
    (rule,) = replicas["spec"]["ingress"]
    peers = [p["podSelector"]["matchLabels"] for p in rule["from"]]
    assert {"app": "gateway"} in peers and any(p.items() <= router_pod.items() for p in peers)
    (rule,) = router["spec"]["ingress"]
    assert [p["podSelector"]["matchLabels"] for p in rule["from"]] == [{"app": "gateway"}]
    to_replicas = router["spec"]["egress"][0]
    assert to_replicas["to"][0]["podSelector"]["matchLabels"] == REPLICA_SELECTOR
