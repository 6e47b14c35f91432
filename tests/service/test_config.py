"""Start-up validation: a wrong variable stops ``python -m service`` at once with exit code 2 and
one line naming the variable and the fix, without a traceback and without loading the model."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from model.runtime import envs
from service import settings as settings_mod
from tests.conftest import ROOT
from tests.net import free_port

from .conftest import service_env


def run_service(env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "service"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def assert_config_error(proc: subprocess.CompletedProcess, *names: str) -> str:
    err = proc.stderr
    assert proc.returncode == 2, (proc.returncode, err[-3000:])
    assert "Traceback" not in err, err
    assert "invalid configuration" in err
    for name in names:
        lines = [line for line in err.splitlines() if line.startswith(name)]
        assert lines, f"{name} not named in:\n{err}"
        assert all("fix:" in line for line in lines), lines
    return err


@pytest.fixture(scope="module")
def model_dir() -> str:
    # A directory with a config.json is enough: these runs stop before anything loads it.
    return str(ROOT / "checkpoints" / "tiny") if (ROOT / "checkpoints/tiny/config.json").exists() else ""


def test_model_is_required() -> None:
    assert_config_error(run_service(service_env()), "QWEN4EXP_MODEL")


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    a_file = tmp_path / "not-a-dir"
    a_file.write_text("x")
    env = service_env(
        QWEN4EXP_MODEL=str(tmp_path / "missing"),
        QWEN4EXP_PORT="http",
        QWEN4EXP_MAX_CONCURRENT_REQUESTS="0",
        QWEN4EXP_GPU_MEMORY_UTILIZATION="1.5",
        QWEN4EXP_DTYPE="int8",
        QWEN4EXP_DEVICE="tpu",
        QWEN4EXP_API_KEYS_FILE=str(tmp_path / "no-keys"),
        VLLM_QSA_KV_SCALES=str(tmp_path / "no-scales.json"),
        VLLM_QSA_KV_COLLECT=str(a_file),
        VLLM_QSA_KV_CLIP_COUNT="-5",
        VLLM_PLE_CPU_OFFLOAD="perhaps",
    )
    err = assert_config_error(
        run_service(env),
        "QWEN4EXP_MODEL",
        "QWEN4EXP_PORT",
        "QWEN4EXP_MAX_CONCURRENT_REQUESTS",
        "QWEN4EXP_GPU_MEMORY_UTILIZATION",
        "QWEN4EXP_DTYPE",
        "QWEN4EXP_DEVICE",
        "QWEN4EXP_API_KEYS_FILE",
        "VLLM_QSA_KV_SCALES",
        "VLLM_QSA_KV_COLLECT",
        "VLLM_QSA_KV_CLIP_COUNT",
        "VLLM_PLE_CPU_OFFLOAD",
    )
    assert "'http'" in err  # the offending value is shown


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("QWEN4EXP_PORT", "70000"),
        ("QWEN4EXP_MAX_BODY_BYTES", "10"),
        ("QWEN4EXP_DRAIN_SECONDS", "-1"),
        ("QWEN4EXP_KV_CACHE_DTYPE", "int4"),
        ("QWEN4EXP_METRICS_OPEN", "sometimes"),
        ("VLLM_QSA_KV_CLIP_COUNT", "soon"),
        ("VLLM_QSA_KV_COLLECT_INTERVAL", "0"),
        ("VLLM_PLE_PREFETCH", "y"),
        ("QWEN4EXP_KV_CACHE_DTYPE", "fp8_e5m2"),
    ],
)
def test_single_bad_value(model_dir: str, name: str, value: str) -> None:
    assert model_dir, "checkpoints/tiny missing"
    assert_config_error(run_service(service_env(QWEN4EXP_MODEL=model_dir, **{name: value})), name)


def test_busy_port_is_a_config_error(model_dir: str) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = run_service(
            service_env(QWEN4EXP_MODEL=model_dir, QWEN4EXP_HOST="127.0.0.1", QWEN4EXP_PORT=str(port))
        )
    assert_config_error(proc, "QWEN4EXP_HOST")
    assert "QWEN4EXP_PORT" in proc.stderr


def test_fresh_metrics_dir_is_removed_on_exit(tmp_path: Path) -> None:
    """An operator-given PROMETHEUS_MULTIPROC_DIR is a parent: each start gets a new subdirectory,
    removed when the process exits (here: at a configuration error)."""
    env = service_env()
    env["PROMETHEUS_MULTIPROC_DIR"] = str(tmp_path / "prom")
    assert_config_error(run_service(env), "QWEN4EXP_MODEL")
    assert (tmp_path / "prom").is_dir()
    assert list((tmp_path / "prom").iterdir()) == []


def test_valid_model_variables_pass(monkeypatch, tmp_path: Path) -> None:
    scales = tmp_path / "scales.json"
    scales.write_text("{}")
    for name, value in {
        "QWEN4EXP_MODEL": str(ROOT / "checkpoints" / "tiny"),
        "QWEN4EXP_API_KEYS": "a,b",
        "VLLM_QSA_KV_SCALES": str(scales),
        "VLLM_QSA_KV_COLLECT": str(tmp_path),
        "VLLM_QSA_KV_CLIP_COUNT": "2.5",
        "VLLM_PLE_CPU_OFFLOAD": "yes",
    }.items():
        monkeypatch.setenv(name, value)
    if not (ROOT / "checkpoints/tiny/config.json").exists():
        pytest.skip("checkpoints/tiny missing")
    service, model_env = settings_mod.load()
    assert service.keys() == ["a", "b"]
    assert service.model_name == "tiny"
    assert model_env.VLLM_PLE_CPU_OFFLOAD is True
    assert model_env.VLLM_QSA_KV_CLIP_COUNT == 2.5


def test_readme_table_lists_every_variable() -> None:
    table = settings_mod.markdown_table()
    for name in settings_mod.ServiceSettings.model_fields:
        assert f"`QWEN4EXP_{name.upper()}`" in table
    for var in envs.VARIABLES:
        assert f"`{var.name}`" in table


def test_readme_table_equals_the_generated_one() -> None:
    readme = (ROOT / "docs" / "configuration.md").read_text()
    start, end = "<!-- env-table:start", "<!-- env-table:end -->"
    assert start in readme and end in readme, "docs/configuration.md lost its env-table markers"
    body = readme.split(start, 1)[1].split("\n", 1)[1].split(end, 1)[0].strip()
    assert body == settings_mod.markdown_table(), (
        "docs/configuration.md env table is stale: paste `python -m service.settings`"
    )


def test_model_variables_are_validated_by_the_model_parsers(monkeypatch, tmp_path: Path) -> None:
    """The service's verdict on a model variable is the model's own: same parser, same message."""
    monkeypatch.setenv("VLLM_PLE_PREFETCH", "y")
    monkeypatch.setenv("VLLM_QSA_KV_COLLECT_INTERVAL", "0")
    _, problems = envs.validate()
    for name, raw in (("VLLM_PLE_PREFETCH", "y"), ("VLLM_QSA_KV_COLLECT_INTERVAL", "0")):
        with pytest.raises(envs.EnvError) as model_error:
            envs.read(name)
        (line,) = [p for p in problems if p.startswith(name)]
        assert line.startswith(str(model_error.value) + "; fix: "), (line, raw)


def test_collect_dir_missing_but_creatable_is_accepted_uncreatable_refused(
    monkeypatch, tmp_path: Path
) -> None:
    """Service and model agree on VLLM_QSA_KV_COLLECT: a creatable directory passes (the worker
    creates it), an uncreatable one is refused by both with the same message."""
    creatable = tmp_path / "a" / "b"
    monkeypatch.setenv("VLLM_QSA_KV_COLLECT", str(creatable))
    values, problems = envs.validate()
    assert not [p for p in problems if p.startswith("VLLM_QSA_KV_COLLECT")]
    assert values.VLLM_QSA_KV_COLLECT == creatable and not creatable.exists()  # checked, not created
    envs.prepare_collect_dir(creatable)
    assert creatable.is_dir()

    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("VLLM_QSA_KV_COLLECT", str(blocker / "sub"))
    _, problems = envs.validate()
    (line,) = [p for p in problems if p.startswith("VLLM_QSA_KV_COLLECT")]
    assert "cannot create directory" in line and "fix:" in line
    with pytest.raises(envs.EnvError) as model_error:
        envs.prepare_collect_dir(blocker / "sub")
    assert str(model_error.value) == line


def test_device_and_engine_configuration_are_checked_before_serving(model_dir: str) -> None:
    """This suite runs vLLM's CPU build: asking for CUDA is refused; and vLLM's own engine-config
    checks run before the model loads, their verdict naming our variable. Both in one report."""
    env = service_env(
        QWEN4EXP_MODEL=model_dir,
        QWEN4EXP_HOST="127.0.0.1",
        QWEN4EXP_PORT=str(free_port()),
        QWEN4EXP_DEVICE="cuda",
        QWEN4EXP_MAX_MODEL_LEN="100000",  # the tiny model's maximum is 4096
    )
    proc = run_service(env)
    assert_config_error(proc, "QWEN4EXP_DEVICE", "QWEN4EXP_MAX_MODEL_LEN")
    assert "'cpu'" in proc.stderr and "4096" in proc.stderr


def test_upstream_cuda_model_is_refused_before_serving_with_every_reason(model_dir: str) -> None:
    """``QWEN4EXP_CUDA_MODEL=upstream`` on this CPU build with the tiny checkpoint: the service stops
    with exit 2 naming the variable, the build and the checkpoint's fields upstream cannot take."""
    env = service_env(
        QWEN4EXP_MODEL=model_dir,
        QWEN4EXP_HOST="127.0.0.1",
        QWEN4EXP_PORT=str(free_port()),
        QWEN4EXP_CUDA_MODEL="upstream",
    )
    err = assert_config_error(run_service(env), "QWEN4EXP_CUDA_MODEL")
    assert "needs vLLM's CUDA build" in err
    assert "top-k of k = 4 blocks" in err
    assert "output_gate_type" not in err  # null is hidden_act, as transformers reads it


@pytest.mark.parametrize("keys", [None, ""])
def test_without_a_key_the_service_refuses_to_start_unless_auth_is_switched_off(model_dir, keys) -> None:
    """Auth is on by default: no key (unset, or an empty variable as a failed secret mount leaves
    it) stops start-up naming the way out, instead of opening the API on every interface."""
    env = service_env(QWEN4EXP_MODEL=model_dir, QWEN4EXP_HOST="0.0.0.0")
    env.pop("QWEN4EXP_AUTH")
    if keys is not None:
        env["QWEN4EXP_API_KEYS"] = keys
    err = assert_config_error(run_service(env), "QWEN4EXP_API_KEYS")
    assert "set QWEN4EXP_AUTH=off to serve without keys" in err


def test_auth_off_with_keys_configured_is_a_contradiction(model_dir) -> None:
    env = service_env(QWEN4EXP_MODEL=model_dir, QWEN4EXP_API_KEYS="k", QWEN4EXP_AUTH="off")
    assert "fix: unset QWEN4EXP_AUTH" in assert_config_error(run_service(env), "QWEN4EXP_AUTH")


def test_a_keys_file_that_is_not_text_stops_start_up_naming_it(model_dir, tmp_path: Path) -> None:
    keys = tmp_path / "api-keys"
    keys.write_bytes(b"good-key\n\xff\xfe-not-utf8\n")
    err = assert_config_error(
        run_service(service_env(QWEN4EXP_MODEL=model_dir, QWEN4EXP_API_KEYS_FILE=str(keys))),
        "QWEN4EXP_API_KEYS_FILE",
    )
    assert f"QWEN4EXP_API_KEYS_FILE='{keys}': not UTF-8 text" in err
