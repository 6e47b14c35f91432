"""compose's ``scale`` profile: two replicas on halves of the GPUs behind vllm-router, scraped by
Prometheus. ``docker-compose config`` resolves the file with ``.env.example`` (as the deployment
tests do); the router's flags are parsed by the installed vllm-router's own argument parser."""

from __future__ import annotations

import yaml

from tests.deploy.test_compose import _resolved
from tests.deploy.tools import PROMETHEUS_CONFIG

from .cluster import ROUTER_VERSION


def test_scale_profile_two_replicas_on_disjoint_gpus():
    services = _resolved("--profile", "scale")["services"]
    gpus = []
    for name in ("qwen4exp-a", "qwen4exp-b"):
        svc = services[name]
        assert svc["profiles"] == ["scale"]
        assert svc["environment"]["QWEN4EXP_TENSOR_PARALLEL_SIZE"] == "2"
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        gpus.append(set(device["device_ids"]))
        assert "/ready" in " ".join(svc["healthcheck"]["test"])
        assert svc["read_only"] is True and svc["cap_drop"] == ["ALL"]
        # The same checkpoint, keys and settings as the single service.
        assert svc["volumes"] == services["qwen4exp"]["volumes"]
        single = services["qwen4exp"]["environment"]
        assert {k: v for k, v in svc["environment"].items() if k != "QWEN4EXP_TENSOR_PARALLEL_SIZE"} == {
            k: v for k, v in single.items() if k != "QWEN4EXP_TENSOR_PARALLEL_SIZE"
        }
    assert gpus == [{"0", "1"}, {"2", "3"}]


def test_scale_profile_router_flags_parse_and_match_prometheus():
    from vllm_router.launch_router import parse_router_args

    router = _resolved("--profile", "scale")["services"]["router"]
    assert router["profiles"] == ["scale"]
    script = router["entrypoint"][2]
    # `config` prints compose syntax: `$$` is a literal `$` for the shell.
    assert f'!= "{ROUTER_VERSION}"' in script and 'exec vllm-router "$$@"' in script
    args = parse_router_args(router["command"])
    args._validate_router_args()
    assert args.worker_urls == ["http://qwen4exp-a:8000", "http://qwen4exp-b:8000"]
    assert args.policy == "cache_aware" and args.health_check_endpoint == "/ready"
    assert args.port == 8000 and args.prometheus_host == "0.0.0.0"
    # Bounds of its own instead of vllm-router's 512 MiB bodies and 32,768 requests at once.
    assert args.max_payload_size == 32 << 20 and args.max_concurrent_requests == 64 and args.queue_size == 128
    # The router's port serves its worker admin routes without auth: it is never published; clients
    # reach it through router-gate (TLS, client routes only), on loopback by default.
    assert "ports" not in router
    services = _resolved("--profile", "scale")["services"]
    gate = services["router-gate"]
    assert gate["profiles"] == ["scale"] and gate["environment"]["GATE_UPSTREAM"] == "http://router:8000"
    (port,) = gate["ports"]
    assert port.removesuffix("/tcp") == "127.0.0.1:8443:8443"

    jobs = {j["job_name"]: j for j in yaml.safe_load(PROMETHEUS_CONFIG.read_text())["scrape_configs"]}
    (replicas,) = jobs["qwen4exp-replicas"]["dns_sd_configs"]
    assert replicas["names"] == ["qwen4exp-a", "qwen4exp-b"] and replicas["port"] == 8000
    (routers,) = jobs["vllm-router"]["dns_sd_configs"]
    assert routers["names"] == ["router"] and routers["port"] == args.prometheus_port
