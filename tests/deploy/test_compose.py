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

from tests.conftest import ROOT, ensure_checkpoint

from .tools import DASHBOARDS, PROMETHEUS_CONFIG, run, tool

SERVICES = {
    "preflight",
    "qwen4exp",
    "qwen4exp-a",  # the scale profile: two replicas and vllm-router
    "qwen4exp-b",
    "router",
    "router-gate",  # TLS and the client-route allow-list in front of the router
    "gate",  # the tls profile: the same in front of the single service
    "download",
    "convert",
    "calibrate",
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


def example_env_text(**overrides: str) -> str:
    """.env.example as a user has it after ``deploy/init-secrets.sh`` (which writes the Grafana
    password), with ``overrides`` applied (NAME= lines replaced, or appended)."""
    text = (ROOT / ".env.example").read_text()
    for name, value in {"GRAFANA_ADMIN_PASSWORD": "generated-by-init-secrets", **overrides}.items():
        if re.search(rf"^{name}=", text, re.M):
            text = re.sub(rf"^{name}=.*$", f"{name}={value}", text, flags=re.M)
        else:
            text += f"\n{name}={value}\n"
    return text


def _config_with(tmp_dir: Path, *extra: str, **overrides: str) -> tuple[int, str]:
    env = tmp_dir / "compose.env"
    env.write_text(example_env_text(**overrides))
    return _config("--env-file", str(env), *extra)


def _resolved(*extra: str, **overrides: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        code, out = _config_with(Path(tmp), *extra, **overrides)
    assert code == 0, out
    return yaml.safe_load(out)


def test_env_example_alone_is_refused_until_init_secrets_sets_the_grafana_password():
    code, out = _config("--env-file", str(ROOT / ".env.example"))
    assert code != 0 and "GRAFANA_ADMIN_PASSWORD" in out and "init-secrets.sh" in out


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
    example = example_env_text()
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
    scale = _resolved("--profile", "scale")["services"]  # the scale profile's replicas and router
    for job in prom["scrape_configs"]:
        for target in job.get("static_configs", [{}])[0].get("targets", []):
            host = target.split(":")[0]
            assert host == "localhost" or host in services, (job["job_name"], target)
        for dns in job.get("dns_sd_configs", []):
            assert set(dns["names"]) <= set(scale), (job["job_name"], dns["names"])
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
    shutil.copy(ROOT / ".env.example", workdir / ".env.example")
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
    # No webhook: alerting is optional, the stack starts and the message says how to send alerts.
    unsent = _init_secrets(work)
    assert unsent.returncode == 0 and "not sent anywhere" in unsent.stderr, unsent.stdout + unsent.stderr
    secrets = work / "secrets"
    assert (secrets / "alertmanager-webhook-url").read_text() == ""
    ok = _init_secrets(work, "https://hooks.example.invalid/services/T0/B0/x")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert (secrets / "alertmanager-webhook-url").read_text().strip().endswith("/B0/x")
    assert secrets.stat().st_mode & 0o777 == 0o700
    for name in ("api-keys", "alertmanager-webhook-url", "tls.crt", "tls.key"):
        assert (secrets / name).stat().st_mode & 0o777 == 0o644, name
    # The gate's self-signed pair: a certificate openssl reads, with this host in its names.
    cert = run([tool("openssl"), "x509", "-in", str(secrets / "tls.crt"), "-noout", "-ext", "subjectAltName"])
    assert cert.returncode == 0 and "localhost" in cert.stdout, cert.stdout + cert.stderr
    pem = (secrets / "tls.crt").read_text()
    assert (secrets / "hf-token").stat().st_mode & 0o777 == 0o644 and (secrets / "hf-token").read_text() == ""
    dot_env = work / ".env"
    assert dot_env.stat().st_mode & 0o777 == 0o600
    password = re.search(r"^GRAFANA_ADMIN_PASSWORD=(\S+)$", dot_env.read_text(), re.M).group(1)
    assert len(password) >= 24 and password != "change-me"
    key = (secrets / "api-keys").read_text()
    assert len(key.strip()) >= 32 and _init_secrets(work).returncode == 0
    assert (secrets / "api-keys").read_text() == key, "an existing key must be kept"
    assert (secrets / "tls.crt").read_text() == pem, "an existing certificate must be kept"
    assert f"GRAFANA_ADMIN_PASSWORD={password}\n" in dot_env.read_text(), "an existing password must be kept"
    # The old example's placeholder is replaced; compose accepts the generated .env as it is.
    dot_env.write_text(dot_env.read_text().replace(password, "change-me"))
    assert _init_secrets(work).returncode == 0 and "change-me" not in dot_env.read_text()
    code, out = _config("--env-file", str(dot_env))
    assert code == 0, out

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
    code, out = _config_with(tmp_path, VLLM_QSA_KV_SCALES="", QWEN4EXP_KV_CACHE_DTYPE="auto")
    assert code == 0, out
    services = yaml.safe_load(out)["services"]
    assert services["qwen4exp"]["environment"]["VLLM_QSA_KV_SCALES"] in ("", None)
    argv = services["preflight"]["entrypoint"]
    skipped = run([sys.executable, "-m", "service.cuda_preflight", *argv[3:]], cwd=ROOT)
    # Here neither mount exists: exactly the two real paths are reported, the empty one is skipped.
    assert argv.count("--readable") == 3 and skipped.stderr.count("cannot read") == 2, skipped.stderr


# ---- every variable from .env ------------------------------------------------------------------

# Fixed by compose's layout (container paths, the 4 reserved GPUs) or read only by the test suite.
FIXED = {
    "QWEN4EXP_MODEL",
    "QWEN4EXP_API_KEYS_FILE",
    "QWEN4EXP_HOST",
    "QWEN4EXP_PORT",
    "QWEN4EXP_DEVICE",
    "QWEN4EXP_TENSOR_PARALLEL_SIZE",
    # Auth stays on in compose: the keys file is mounted (the calibration container, on loopback, turns it off).
    "QWEN4EXP_AUTH",
    # A secret in the environment: use the keys file (QWEN4EXP_API_KEYS_FILE_HOST).
    "QWEN4EXP_API_KEYS",
    # Fault injection, the engine-death marker and the 3090 emulation on newer GPUs are testing aids.
    "QWEN4EXP_FORCE_SM86",
    "QWEN4EXP_ENGINE_FATAL_FILE",
    "QWEN4EXP_FAULT_INJECT_TOKEN",
    "QWEN4EXP_FAULT_INJECT_FATAL_TOKEN",
}


def service_variables() -> set[str]:
    from model.runtime import envs
    from service.settings import ServiceSettings

    return {"QWEN4EXP_" + f.upper() for f in ServiceSettings.model_fields} | set(envs.BY_NAME)


def test_every_service_variable_is_set_from_dot_env():
    """Each variable of the service is interpolated from .env (documented in .env.example), and the
    rest of the environment comes from QWEN4EXP_ENV_FILE, read by every model container."""
    raw = yaml.safe_load((ROOT / "compose.yaml").read_text())
    env = raw["x-qwen4exp-env"]
    documented = {
        ln.split("=", 1)[0] for ln in (ROOT / ".env.example").read_text().splitlines() if ln and ln[0] != "#"
    }
    missing = sorted(
        name
        for name in service_variables() - FIXED
        if not str(env.get(name, "")).startswith("${" + name) or name not in documented
    )
    # A variable added to the service shows up here with its name until compose.yaml and .env.example list it.
    assert not missing, missing
    for name in (
        "NCCL_P2P_DISABLE",
        "NCCL_IB_DISABLE",
        "NCCL_SHM_DISABLE",
        "NCCL_CUMEM_ENABLE",
        "NCCL_DEBUG",
    ):
        assert str(env[name]).startswith("${" + name) and name in documented, name


def test_values_from_dot_env_and_the_env_file_reach_every_model_container(tmp_path):
    extra = tmp_path / "qwen4exp.env"
    extra.write_text("NCCL_P2P_LEVEL=NVL\nVLLM_LOGGING_LEVEL=DEBUG\n")
    services = _resolved(
        QWEN4EXP_CUDA_MODEL="ours",
        QWEN4EXP_ENFORCE_EAGER="true",
        QWEN4EXP_MAX_NUM_SEQS="24",
        NCCL_P2P_DISABLE="0",
        VLLM_QSA_KV_COLLECT="/home/app/.cache/kv",
        QWEN4EXP_ENV_FILE=str(extra),
    )["services"]
    svc = services["qwen4exp"]["environment"]
    assert (svc["QWEN4EXP_CUDA_MODEL"], svc["QWEN4EXP_ENFORCE_EAGER"], svc["QWEN4EXP_MAX_NUM_SEQS"]) == (
        "ours",
        "true",
        "24",
    )
    assert svc["NCCL_P2P_DISABLE"] == "0" and svc["VLLM_QSA_KV_COLLECT"] == "/home/app/.cache/kv"
    for name in ("preflight", "qwen4exp", "calibrate", "download", "convert"):
        env = services[name]["environment"]
        assert env["NCCL_P2P_LEVEL"] == "NVL" and env["VLLM_LOGGING_LEVEL"] == "DEBUG", name
    # The preflight sees exactly the service's configuration (it checks it).
    pre = services["preflight"]["environment"]
    assert {k: v for k, v in pre.items()} == svc


# ---- hardening ---------------------------------------------------------------------------------


def test_every_container_is_hardened_and_prometheus_lifecycle_is_off():
    services = _resolved()["services"]
    for name, svc in services.items():
        assert svc.get("cap_drop") == ["ALL"], name
        assert "no-new-privileges:true" in svc.get("security_opt", []), name
        assert svc.get("read_only") is True, name
        assert any(t.startswith("/tmp:") for t in svc.get("tmpfs", [])), name
    for name in ("preflight", "qwen4exp", "calibrate"):
        (tmp,) = services[name]["tmpfs"]
        assert ",exec" in tmp, "Triton loads launcher stubs it builds under /tmp"
    assert not any("lifecycle" in arg for arg in services["prometheus"]["command"])
    assert "web.enable-admin-api" not in " ".join(services["prometheus"]["command"])


# ---- the one-shot profiles ---------------------------------------------------------------------


@pytest.mark.parametrize("profile", ["download", "convert", "calibrate"])
def test_each_profile_parses_and_stays_out_of_a_plain_up(profile):
    services = _resolved("--profile", profile)["services"]
    assert services[profile]["profiles"] == [profile]
    assert services[profile]["restart"] == "no"
    serving = {
        "preflight",
        "qwen4exp",
        "prometheus",
        "alertmanager",
        "grafana",
        "dcgm-exporter",
        "node-exporter",
    }
    assert not any("profiles" in services[s] for s in serving)


def _argv(svc: dict, paths: dict[str, str]) -> list[str]:
    """The service's entrypoint with container paths replaced by local ones, run with this Python."""
    argv = [sys.executable if a == "python" else a for a in svc["entrypoint"]]
    out = []
    for a in argv:
        for container, local in paths.items():
            if a == container or a.startswith(container + "/"):
                a = local + a[len(container) :]
        out.append(a)
    return out


def test_download_profile_against_a_local_hub_mirror_resumes(tmp_path):
    from .hub_mirror import HubMirror

    repo = "acme/qwen4-exp-tiny"
    tiny = ensure_checkpoint("tiny")
    shutil.copytree(tiny, tmp_path / "hub" / repo)
    token = tmp_path / "hf-token"
    token.write_text("")  # a public repository: the secret file is empty
    with HubMirror(tmp_path / "hub") as hub:
        resolved = _resolved("--profile", "download", QWEN4EXP_HF_REPO=repo, HF_ENDPOINT=hub.url)
        svc = resolved["services"]["download"]
        # The token is a file secret (mounted at /run/secrets/hf-token), not an environment variable.
        assert svc["secrets"] == [{"source": "hf-token"}]
        assert resolved["secrets"]["hf-token"]["file"] == str(ROOT / "secrets" / "hf-token")
        assert not any("TOKEN" in k and k != "HF_TOKEN_PATH" for k in svc["environment"])
        env = dict(svc["environment"])
        assert env["HF_HUB_OFFLINE"] == "0" and env["HF_TOKEN_PATH"] == "/run/secrets/hf-token"
        env.update(HF_TOKEN_PATH=str(token), HF_HOME=str(tmp_path / "hf-home"))
        source = tmp_path / "source"
        argv = _argv(svc, {"/source": str(source)})
        first = run(argv, cwd=ROOT, env=env, timeout=300)
        assert first.returncode == 0, first.stdout + first.stderr
        assert "files" in first.stdout and "free at" in first.stdout  # size vs free space, first
        for f in tiny.iterdir():
            assert (source / f.name).read_bytes() == f.read_bytes(), f.name
        fetched = sum(hub.gets.values())
        # Interrupted download: one file gone, one cut short. Only those two are fetched again.
        (source / "config.json").unlink()
        weights = source / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:1000])
        again = run(argv, cwd=ROOT, env=env, timeout=300)
        assert again.returncode == 0, again.stdout + again.stderr
        assert sum(hub.gets.values()) - fetched == 2, dict(hub.gets)
        assert weights.read_bytes() == (tiny / "model.safetensors").read_bytes()
    empty = run(
        _argv(svc, {"/source": str(source)})[:3] + ["", "--local-dir", str(source)], cwd=ROOT, env=env
    )
    assert empty.returncode == 2 and "QWEN4EXP_HF_REPO" in empty.stderr


def test_convert_profile_prints_its_disk_estimate_first_and_converts_tiny(tmp_path):
    svc = _resolved("--profile", "convert")["services"]["convert"]
    mounts = {v["target"]: v for v in svc["volumes"]}
    assert mounts["/source"]["read_only"] is True and not mounts["/models/qwen4-exp"].get("read_only")
    paths = {"/source": str(ensure_checkpoint("tiny")), "/models/qwen4-exp": str(tmp_path / "out")}
    paths["/scratch"] = str(tmp_path / "scratch")
    argv = _argv(svc, paths)
    # tiny's experts (intermediate 64) do not tile 4 ranks with an int4 group of 32: TP 2 here.
    assert argv[argv.index("--tp") + 1] == "4"
    argv[argv.index("--tp") + 1] = "2"
    proc = run(argv, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert (
        out.index("disk estimate") < out.index("model.tools.ple_quantize") < out.index("model.tools.quantize")
    )
    estimate = re.search(r"\| output: servable checkpoint \| ([\d.,]+) (MB|GB) \|", out)
    assert estimate, out
    actual = sum(f.stat().st_size for f in (tmp_path / "out").iterdir())
    scale = 1e6 if estimate.group(2) == "MB" else 1e9
    assert abs(float(estimate.group(1).replace(",", "")) * scale - actual) / actual < 0.1, (estimate, actual)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["quantization_config"]
    assert not any((tmp_path / "scratch").iterdir())  # the intermediate is gone
    assert all(f.stat().st_mode & 0o444 == 0o444 for f in (tmp_path / "out").iterdir())  # uid 10001 reads


def _dump(directory: Path, model: str, layers: list[str], tp_rank: int, tp_size: int, absmax: float) -> None:
    """One rank's collector dump, in the format the collector writes (model/qsa_kv/runtime.py)."""
    from model.qsa_kv.runtime import DUMP_FORMAT

    doc = {
        "format": DUMP_FORMAT,
        "dp_rank": 0,
        "pp_rank": 0,
        "tp_rank": tp_rank,
        "pp_size": 1,
        "tp_size": tp_size,
        "model": model,
        "kv_cache_dtype": "auto",
        "expected_layers": layers,
        "layers": {n: {"k_absmax": absmax, "v_absmax": absmax / 2, "tokens": 181} for n in layers},
        "final": True,
    }
    (directory / f"qsa_kv_absmax_dp0_pp0_tp{tp_rank}.json").write_text(json.dumps(doc))


def test_calibrate_profile_writes_the_sidecar_the_serving_preflight_accepts(tmp_path):
    """The calibrate service: eager, bf16 cache, the collector in the cache volume, the sidecar into
    the directory the service mounts at /sidecar. Its merge step runs here on dumps of two ranks
    (a real collecting run of tiny takes minutes on this CPU), and the serving preflight, the check
    `docker compose up` runs first, accepts the result; a sidecar of another model it refuses."""
    services = _resolved("--profile", "calibrate")["services"]
    cal, svc = services["calibrate"], services["qwen4exp"]
    env = cal["environment"]
    assert env["QWEN4EXP_ENFORCE_EAGER"] == "true" and env["QWEN4EXP_KV_CACHE_DTYPE"] == "auto"
    assert env["VLLM_QSA_KV_SCALES"] == "" and env["QWEN4EXP_HOST"] == "127.0.0.1"
    argv = cal["entrypoint"]
    dumps_in, out = argv[argv.index("--dumps") + 1], argv[argv.index("--out") + 1]
    mounts = {v["target"]: v for v in cal["volumes"]}
    assert (
        dumps_in.startswith("/home/app/.cache/") and mounts["/home/app/.cache"]["source"] == "qwen4exp-cache"
    )
    assert out == svc["environment"]["VLLM_QSA_KV_SCALES"]  # what the serving profile reads
    assert not mounts["/sidecar"].get("read_only")
    assert mounts["/sidecar"]["source"] == {v["target"]: v for v in svc["volumes"]}["/sidecar"]["source"]
    assert cal["deploy"] == svc["deploy"]

    tiny = ensure_checkpoint("tiny")
    layers = [
        f"model.layers.{i}.self_attn"
        for i, t in enumerate(json.loads((tiny / "config.json").read_text())["layer_types"])
        if t != "linear_attention"
    ]
    dumps, sidecar = tmp_path / "dumps", tmp_path / "sidecar"
    dumps.mkdir()
    for rank, absmax in ((0, 4.0), (1, 5.0625)):
        _dump(dumps, str(tiny), layers, rank, 2, absmax)
    paths = {"/home/app/.cache/qsa-kv-dumps": str(dumps), "/sidecar": str(sidecar)}
    merge = _argv(cal, paths)
    merge = [a for a in merge if a != "/calibration/prompts.txt" and a != "--prompts"] + ["--merge-only"]
    proc = run(merge, cwd=ROOT, env={"QWEN4EXP_MODEL": str(tiny)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    written = sidecar / "qsa-kv-scales.json"
    scales = json.loads(written.read_text())
    assert set(scales) == set(layers)
    assert abs(scales[layers[0]]["k_scale"] - 5.0625 / 448 * 1.1) < 1e-9  # max over ranks, margin 1.1

    def serving_preflight(scales_path: Path) -> subprocess.CompletedProcess:
        env = {"QWEN4EXP_KV_CACHE_DTYPE": "fp8", "VLLM_QSA_KV_SCALES": str(scales_path)}
        return run([sys.executable, "-m", "service.cuda_preflight", "--gpus", "1", "--checkpoint", str(tiny)],
                   cwd=ROOT, env=env)  # fmt: skip

    ok = serving_preflight(written)
    assert ok.returncode == 0 and re.search(r"\| KV scales \| ok \|", ok.stdout), ok.stdout + ok.stderr
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"model.layers.99.self_attn": {"k_scale": 0.01, "v_scale": 0.01}}))
    refused = serving_preflight(other)
    assert refused.returncode == 3 and re.search(r"\| KV scales \| fail \|", refused.stdout), refused.stdout
