"""``QWEN4EXP_CUDA_MODEL=upstream`` on vLLM's CUDA build: vLLM's own Qwen4-Exp serves through our
fail-closed subclass (``model.vllm_adapter.upstream_cuda``) with transformers' greedy tokens, and a
feature only ours has (``VLLM_QSA_KV_SCALES``) stops start-up naming it.

One engine per child process (a fresh interpreter): the implementation is registered when vLLM loads
the plugin, and upstream needs Model Runner V2 where this directory's conftest pins V1 for ours. The
child runs the engine core in its own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so a start-up
failure arrives as the real exception, as in ``bench/bench_ours_vs_upstream.py``, whose settings this
follows (Triton GDN prefill; upstream's CuTe-DSL HC kernel off where its packages are missing).
``qsa512``: the smallest preset whose top-k (2048 / 4 = 512 blocks) upstream's kernels take.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ensure_checkpoint
from tests.parity.prompts import SENTENCES, parity_prompts
from tests.parity.test_generation_parity import MAX_NEW_TOKENS, assert_same

from .test_engine_parity import REF_DEVICE, reference_greedy

pytestmark = pytest.mark.vllm_cuda

ROOT = Path(__file__).resolve().parents[2]
SUBCLASS = "model.vllm_adapter.upstream_cuda.Qwen4ExpForCausalLM"
CHILD = r"""
import json, sys

from bench.bench_ours_vs_upstream import _disable_upstream_cute_dsl_if_missing
from model.cuda_model_choice import vllm_is_cpu_build
from tests.gpu.engine import cuda_engine_args

path, prompts_file, out_file, max_new = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
result = {"notes": []}
try:
    if not vllm_is_cpu_build():  # upstream cannot be imported on the CPU build (a dry run)
        result["notes"] += [n for n in [_disable_upstream_cute_dsl_if_missing()] if n]
    from vllm import LLM, SamplingParams

    llm = LLM(model=path, dtype="bfloat16", max_model_len=4096, seed=0, enable_prefix_caching=False,
              **cuda_engine_args())
    result["model_class"] = llm.apply_model(lambda m: f"{type(m).__module__}.{type(m).__qualname__}")[0]
    prompts = json.load(open(prompts_file))
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts.values()], params, use_tqdm=False)
    result["tokens"] = {n: list(o.outputs[0].token_ids) for n, o in zip(prompts, outs, strict=True)}
except Exception as exc:
    result["error"] = f"{type(exc).__name__}: {exc}"
json.dump(result, open(out_file, "w"))
"""


def run_upstream(tmp_path: Path, path: Path, prompts: dict[str, list[int]], **env) -> dict:
    """One engine with ``QWEN4EXP_CUDA_MODEL=upstream`` in a child; its result (or its error)."""
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    out, log = tmp_path / "result.json", tmp_path / "child.log"
    child_env = {
        **os.environ,
        "QWEN4EXP_CUDA_MODEL": "upstream",
        "VLLM_USE_V2_MODEL_RUNNER": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        **env,
    }
    with log.open("w") as fh:
        rc = subprocess.run(
            [
                sys.executable,
                "-c",
                CHILD,
                str(path),
                str(tmp_path / "prompts.json"),
                str(out),
                str(MAX_NEW_TOKENS),
            ],
            cwd=ROOT,
            env=child_env,
            stdout=fh,
            stderr=subprocess.STDOUT,
            timeout=480,
        ).returncode
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
    assert out.exists(), f"child rc {rc} wrote no result; log tail:\n{tail}"
    result = json.loads(out.read_text())
    result["log_tail"] = tail
    return result


def test_upstream_serves_qsa512_through_our_subclass(tmp_path):
    from transformers import AutoTokenizer

    path = ensure_checkpoint("qsa512")
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = parity_prompts(tokenizer)
    # Past the 2048-token QSA budget, so upstream's sparse selection runs (the parity prompts are shorter).
    long_ids = tokenizer(" ".join(SENTENCES[(5 * i) % len(SENTENCES)] for i in range(160)))["input_ids"]
    prompts["beyond_budget"] = long_ids[:3000]
    assert len(prompts["beyond_budget"]) == 3000
    got = run_upstream(tmp_path, path, prompts)
    assert "error" not in got, f"{got['error']}\n{got['log_tail']}"
    print(f"loaded {got['model_class']}; notes {got['notes']}")
    assert got["model_class"] == SUBCLASS
    assert_same(got["tokens"], reference_greedy(path, prompts, REF_DEVICE))


def test_upstream_refuses_kv_scales_at_start_up(tmp_path):
    path = ensure_checkpoint("qsa512")
    got = run_upstream(tmp_path, path, {"one": [5]}, VLLM_QSA_KV_SCALES=str(tmp_path / "scales.json"))
    assert "model_class" not in got, "the engine started although VLLM_QSA_KV_SCALES was set"
    # The subclass's ValueError, whether vLLM re-raises it as is or wraps it (then it is in the log).
    text = f"{got['error']}\n{got['log_tail']}"
    assert "QWEN4EXP_CUDA_MODEL=upstream (vLLM's own CUDA Qwen4-Exp) cannot serve" in text, text
    assert "VLLM_QSA_KV_SCALES=" in text and "upstream has no static per-layer FP8" in text, text
