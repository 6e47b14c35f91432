"""compose.yaml parses with Debian's docker-compose and says what the deployment needs."""

from __future__ import annotations

import yaml

from tests.conftest import ROOT

from .tools import run, tool


def _config(*extra: str) -> tuple[int, str]:
    proc = run(
        [
            tool("docker-compose"),
            "--project-directory",
            str(ROOT),
            "-f",
            str(ROOT / "compose.yaml"),
            *extra,
            "config",
        ],
        cwd=ROOT,
    )
    return proc.returncode, proc.stdout + proc.stderr


def _resolved() -> dict:
    code, out = _config("--env-file", str(ROOT / ".env.example"))
    assert code == 0, out
    return yaml.safe_load(out)


def test_compose_config_parses_with_env_example():
    cfg = _resolved()
    assert set(cfg["services"]) == {"qwen4exp", "prometheus", "grafana"}


def test_required_variables_fail_without_env_file(tmp_path):
    empty = tmp_path / "empty.env"
    empty.write_text("")
    code, out = _config("--env-file", str(empty))
    assert code != 0
    assert "QWEN4EXP_MODEL_DIR" in out


def test_service_gpus_shm_memlock_and_mounts():
    svc = _resolved()["services"]["qwen4exp"]
    devices = svc["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 4, "capabilities": ["gpu"]}]
    assert svc["shm_size"] in ("8gb", "8589934592", 8589934592)
    assert svc["ulimits"]["memlock"] == {"soft": -1, "hard": -1}
    mounts = {v["target"]: v for v in svc["volumes"]}
    for target in ("/models/qwen4-exp", "/sidecar", "/run/secrets/qwen4exp-api-keys"):
        assert mounts[target].get("read_only") is True, target
    env = svc["environment"]
    assert env["QWEN4EXP_MODEL"] == "/models/qwen4-exp"
    assert env["QWEN4EXP_TENSOR_PARALLEL_SIZE"] == "4"
    assert env["QWEN4EXP_API_KEYS_FILE"] == "/run/secrets/qwen4exp-api-keys"
    assert env["VLLM_QSA_KV_SCALES"].startswith("/sidecar/")
    assert env["NCCL_P2P_DISABLE"] == "1" and env["NCCL_IB_DISABLE"] == "1"
    # Drain must finish before compose's SIGKILL.
    grace = int(svc["stop_grace_period"].rstrip("s"))
    assert grace > float(env["QWEN4EXP_DRAIN_SECONDS"])
    assert "/ready" in " ".join(svc["healthcheck"]["test"])


def test_env_example_covers_every_compose_variable():
    """Every ${VAR} compose.yaml reads is documented in .env.example."""
    import re

    used = set(re.findall(r"\$\{([A-Z0-9_]+)", (ROOT / "compose.yaml").read_text()))
    documented = {
        line.split("=", 1)[0]
        for line in (ROOT / ".env.example").read_text().splitlines()
        if line and not line.startswith("#")
    }
    assert used <= documented, sorted(used - documented)


def test_monitoring_mounts_the_single_copies():
    services = _resolved()["services"]
    prom = {v.split(":")[1]: v.split(":")[0] for v in services["prometheus"]["volumes"] if v.startswith("/")}
    graf = {v.split(":")[1]: v.split(":")[0] for v in services["grafana"]["volumes"] if v.startswith("/")}
    assert prom["/etc/prometheus/rules"] == str(ROOT / "k8s" / "qwen4exp" / "rules")
    assert prom["/etc/prometheus/prometheus.yml"] == str(ROOT / "deploy" / "prometheus" / "prometheus.yml")
    assert graf["/var/lib/grafana/dashboards/qwen4exp"] == str(ROOT / "k8s" / "qwen4exp" / "dashboards")
    assert graf["/etc/grafana/provisioning"] == str(ROOT / "deploy" / "grafana" / "provisioning")
