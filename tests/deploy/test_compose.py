"""compose.yaml parses with Debian's docker-compose and says what the deployment needs.

Also: the preflight runs before the service with the same image, mounts and GPUs; the Alertmanager
config is valid (``amtool``) and reachable from Prometheus; the exporters feed the hardware
dashboard; secrets are git-ignored and ``deploy/init-secrets.sh`` makes files the containers' users
can read (checked by switching to uid 10001 for real).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT

from .tools import DASHBOARDS, PROMETHEUS_CONFIG, run, tool

SERVICES = {
    "preflight",
    "qwen4exp",
    "prometheus",
    "alertmanager",
    "grafana",
    "dcgm-exporter",
    "node-exporter",
}
ALERTMANAGER_CONFIG = ROOT / "deploy" / "alertmanager" / "alertmanager.yml"
DCGM_COUNTERS = ROOT / "deploy" / "dcgm" / "counters.csv"


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
    assert set(cfg["services"]) == SERVICES


def test_required_variables_fail_without_env_file(tmp_path):
    empty = tmp_path / "empty.env"
    empty.write_text("")
    code, out = _config("--env-file", str(empty))
    assert code != 0
    assert "QWEN4EXP_MODEL_DIR" in out
    # Each required file is named when it alone is missing (no silent default for a secret).
    example = (ROOT / ".env.example").read_text()
    for var in (
        "QWEN4EXP_API_KEYS_FILE_HOST",
        "ALERTMANAGER_WEBHOOK_URL_FILE_HOST",
        "GRAFANA_ADMIN_PASSWORD",
    ):
        partial = tmp_path / f"no-{var}.env"
        partial.write_text(re.sub(rf"^{var}=.*$", "", example, flags=re.M))
        code, out = _config("--env-file", str(partial))
        assert code != 0 and var in out, (var, out)


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


def test_preflight_runs_first_with_the_services_image_mounts_and_gpus():
    services = _resolved()["services"]
    pre, svc = services["preflight"], services["qwen4exp"]
    assert pre["image"] == svc["image"] and pre["build"] == svc["build"]  # built, never pulled
    assert pre["volumes"] == svc["volumes"] and pre["deploy"] == svc["deploy"]
    assert svc["depends_on"] == {"preflight": {"condition": "service_completed_successfully"}}
    assert pre["restart"] == "no"
    argv = pre["entrypoint"]
    assert argv[:3] == ["python", "-m", "service.cuda_preflight"]
    assert argv[argv.index("--gpus") + 1] == svc["environment"]["QWEN4EXP_TENSOR_PARALLEL_SIZE"]
    readable = {argv[i + 1] for i, a in enumerate(argv) if a == "--readable"}
    env = svc["environment"]
    assert readable == {
        env["QWEN4EXP_MODEL"] + "/config.json",
        env["QWEN4EXP_API_KEYS_FILE"],
        env["VLLM_QSA_KV_SCALES"],
    }
    targets = [v["target"] for v in svc["volumes"]]
    assert all(any(path.startswith(t + "/") or path == t for t in targets) for path in readable)
    # Prometheus and Alertmanager must run while the service is down, to send the Down alert.
    assert "qwen4exp" not in services["prometheus"].get("depends_on", {})


def test_alertmanager_config_is_valid_and_wired():
    proc = run([tool("amtool"), "check-config", str(ALERTMANAGER_CONFIG)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    services = _resolved()["services"]
    am = services["alertmanager"]
    mounts = {v["target"]: v for v in am["volumes"] if isinstance(v, dict)}
    config = yaml.safe_load(ALERTMANAGER_CONFIG.read_text())
    (receiver,) = config["receivers"]
    url_file = receiver["slack_configs"][0]["api_url_file"]
    assert mounts[url_file]["read_only"] is True and mounts[url_file]["type"] == "bind"
    assert config["route"]["receiver"] == receiver["name"]
    prom = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    (target,) = prom["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"]
    assert target == "alertmanager:9093" and "alertmanager" in services


def test_scrape_targets_are_compose_services_and_exporters_feed_the_dashboard():
    services = _resolved()["services"]
    prom = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    for job in prom["scrape_configs"]:
        for target in job["static_configs"][0]["targets"]:
            host = target.split(":")[0]
            assert host == "localhost" or host in services, (job["job_name"], target)
    dcgm = services["dcgm-exporter"]
    assert dcgm["deploy"] == services["qwen4exp"]["deploy"]  # sees the same GPUs
    counters_in = dcgm["command"][dcgm["command"].index("-f") + 1]
    assert any(str(DCGM_COUNTERS) + ":" + counters_in in v for v in dcgm["volumes"] if isinstance(v, str))
    exported = {
        ln.split(",")[0].strip() for ln in DCGM_COUNTERS.read_text().splitlines() if ln.startswith("DCGM_")
    }
    hardware = json.loads((DASHBOARDS / "qwen4exp-hardware.json").read_text())
    charted = {
        m
        for p in hardware["panels"]
        for t in p.get("targets", [])
        for m in re.findall(r"DCGM_FI_\w+", t["expr"])
    }
    assert charted and charted <= exported, charted - exported
    node = services["node-exporter"]
    assert "--path.rootfs=/host" in node["command"]


def test_secrets_and_env_are_git_ignored():
    proc = run(
        ["git", "check-ignore", "secrets/api-keys", "secrets/alertmanager-webhook-url", ".env"], cwd=ROOT
    )
    assert proc.returncode == 0 and len(proc.stdout.split()) == 3, proc.stdout + proc.stderr
    assert run(["git", "check-ignore", ".env.example"], cwd=ROOT).returncode == 1


def _init_secrets(workdir, *args: str) -> subprocess.CompletedProcess:
    (workdir / "deploy").mkdir(exist_ok=True)
    shutil.copy(ROOT / "deploy" / "init-secrets.sh", workdir / "deploy" / "init-secrets.sh")
    return run(["bash", str(workdir / "deploy" / "init-secrets.sh"), *args])


def _as_service_user(path) -> subprocess.CompletedProcess:
    """The service's own readability check, run as the image's uid/gid 10001."""
    setpriv = tool("setpriv")
    cmd = [setpriv, "--reuid", "10001", "--regid", "10001", "--clear-groups", sys.executable]
    return run([*cmd, "-m", "service.cuda_preflight", "--readable", str(path)], cwd=ROOT)


def test_init_secrets_makes_files_the_service_user_can_read(tmp_path):
    work = tmp_path / "checkout"
    work.mkdir()
    assert _init_secrets(work, "not-a-url").returncode == 2
    missing = _init_secrets(work)
    assert missing.returncode == 2 and "webhook URL" in missing.stderr
    ok = _init_secrets(work, "https://hooks.example.invalid/services/T0/B0/x")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    secrets = work / "secrets"
    assert secrets.stat().st_mode & 0o777 == 0o700
    for name in ("api-keys", "alertmanager-webhook-url"):
        assert (secrets / name).stat().st_mode & 0o777 == 0o644, name
    key = (secrets / "api-keys").read_text()
    assert len(key.strip()) >= 32 and _init_secrets(work).returncode == 0
    assert (secrets / "api-keys").read_text() == key, "an existing key must be kept"

    if os.geteuid() != 0:
        pytest.skip("switching to uid 10001 needs root")
    # Inside the container the file is bind-mounted on its own, so only its own mode matters:
    # check with a copy in a directory uid 10001 may enter (pytest's tmp_path is 0700).
    with tempfile.TemporaryDirectory(prefix="qwen4exp-mount-") as where:
        mounted = Path(where)
        mounted.chmod(0o755)
        shutil.copy2(secrets / "api-keys", mounted / "api-keys")
        readable = _as_service_user(mounted / "api-keys")
        assert readable.returncode == 0, readable.stdout + readable.stderr
        (mounted / "api-keys").chmod(0o600)  # the usual host file: unreadable, and the message says why
        denied = _as_service_user(mounted / "api-keys")
        assert denied.returncode == 3 and "uid 10001 cannot read" in denied.stderr, denied.stderr
        assert "chmod 0644" in denied.stderr


def test_kv_scales_can_be_turned_off_for_the_bf16_cache(tmp_path):
    """VLLM_QSA_KV_SCALES= (empty) reaches the service empty (= unset for the model code); the
    preflight then skips that path (an empty --readable)."""
    env = tmp_path / "bf16.env"
    text = (ROOT / ".env.example").read_text()
    text = re.sub(r"^VLLM_QSA_KV_SCALES=.*$", "VLLM_QSA_KV_SCALES=", text, flags=re.M)
    env.write_text(re.sub(r"^QWEN4EXP_KV_CACHE_DTYPE=.*$", "QWEN4EXP_KV_CACHE_DTYPE=auto", text, flags=re.M))
    code, out = _config("--env-file", str(env))
    assert code == 0, out
    services = yaml.safe_load(out)["services"]
    assert services["qwen4exp"]["environment"]["VLLM_QSA_KV_SCALES"] in ("", None)
    argv = services["preflight"]["entrypoint"]
    skipped = run([sys.executable, "-m", "service.cuda_preflight", *argv[3:]], cwd=ROOT)
    # Here neither mount exists: exactly the two real paths are reported, the empty one is skipped.
    assert argv.count("--readable") == 3 and skipped.stderr.count("cannot read") == 2, skipped.stderr
