"""Preemption parity on CUDA, on the served path: vLLM's own Qwen4-Exp through our subclass
(``QWEN4EXP_CUDA_MODEL=upstream``, Model Runner V2, what the service picks on CUDA), with CUDA
graphs and prefix caching on (the service's defaults), BF16 and FP8 QSA caches.

The CPU test (``tests/pressure/test_preemption_parity.py``) explains the method: a KV pool so
small (``num_gpu_blocks_override``) that requests whose prompts end just short of a block
boundary must be preempted once decoding crosses it; every request runs alone first, then all
together; vLLM's preemption counter must move. On ``qsa512`` bf16 alone moves a recomputed
request's log-probabilities by tenths of a nat (the child measures it: each lone run's tokens
recomputed as one prefill, no preemption), so the batch is judged against transformers in float32
(``tests.pressure.fp32_judge``): as close to it as the lone runs are, or as transformers-bf16 is;
the comparison with the lone runs is printed beside it. On CUDA the scheduler block and the
number of state groups depend on the kernels vLLM picks, so the child reads the block size from
the engine and tries a few pool sizes, from the smallest, until one holds a request of
``max_model_len`` (smaller pools fail at start-up with vLLM's "to serve at least one request").

One engine per child process (upstream is registered when vLLM loads the plugin and needs V2,
where this directory's conftest pins V1 for ours). ``qsa512``: the smallest preset upstream's
top-k kernels take. Skipped without CUDA and vLLM's CUDA build.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ensure_checkpoint
from tests.pressure.fp32_judge import judge
from tests.pressure.parity import compare, summary

pytestmark = pytest.mark.vllm_cuda

ROOT = Path(__file__).resolve().parents[2]
REQUESTS = 16
MAX_NEW_TOKENS = 64
MAX_MODEL_LEN = 2048
POOL_SIZES = (16, 24, 32, 48, 64, 96, 128)

CHILD = r"""
import json, sys

from tests.gpu.engine import cuda_engine_args
from tests.pressure.parity import TOP, plain, prompts_near_block_end, recompute_drift

path, out_file, engine_json = sys.argv[1], sys.argv[2], sys.argv[3]
requests, max_new, max_len, pools = int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]), json.loads(sys.argv[7])
result = {"tried": []}
try:
    from vllm import LLM, SamplingParams

    llm = None
    for blocks in pools:
        args = dict(max_model_len=max_len, enable_prefix_caching=True, num_gpu_blocks_override=blocks,
                    max_num_seqs=min(blocks, 16), disable_log_stats=False, **json.loads(engine_json))
        try:
            llm = LLM(model=path, **cuda_engine_args(graphs=True, **args))
        except Exception as exc:
            result["tried"].append([blocks, f"{type(exc).__name__}: {str(exc)[:300]}"])
            continue
        result["blocks"] = blocks
        break
    if llm is None:
        raise RuntimeError(f"no pool size started: {result['tried']}")
    config = llm.llm_engine.vllm_config
    block = config.cache_config.block_size
    result["block_size"] = block
    if block + max_new > max_len:
        raise RuntimeError(f"scheduler block {block} + {max_new} new tokens exceed max_model_len {max_len}: raise MAX_MODEL_LEN")
    prompts = prompts_near_block_end(block, config.model_config.get_vocab_size(), requests)
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True, logprobs=TOP)
    preempt = lambda: sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")
    alone = [plain(llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0]) for p in prompts]
    before = preempt()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    result["preemptions"] = preempt() - before
    result["cached"] = sum(o.num_cached_tokens or 0 for o in outs)
    to_json = lambda run: [run[0], [{str(t): lp for t, lp in step.items()} for step in run[1]]]
    result["prompts"] = prompts
    result["alone"] = [to_json(r) for r in alone]
    result["together"] = [to_json(plain(o.outputs[0])) for o in outs]
    # Control: each lone run's tokens recomputed as one prefill, without any preemption.
    result["recompute_drift"] = recompute_drift(llm, prompts, alone)
    result["model_class"] = llm.apply_model(lambda m: f"{type(m).__module__}.{type(m).__qualname__}")[0]
except Exception as exc:
    result["error"] = f"{type(exc).__name__}: {exc}"
json.dump(result, open(out_file, "w"))
"""


def run_child(tmp: Path, engine: dict) -> dict:
    out, log = tmp / "result.json", tmp / "child.log"
    env = {
        **os.environ,
        "QWEN4EXP_CUDA_MODEL": "upstream",
        "VLLM_USE_V2_MODEL_RUNNER": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # a start-up failure arrives as the real exception
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # apply_model
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    for name in ("VLLM_QSA_KV_SCALES", "VLLM_QSA_KV_COLLECT", "VLLM_QSA_KV_CLIP_COUNT"):
        env.pop(name, None)  # FP8: scales 1.0, nothing collected
    argv = [
        str(ensure_checkpoint("qsa512")),
        str(out),
        json.dumps(engine),
        str(REQUESTS),
        str(MAX_NEW_TOKENS),
        str(MAX_MODEL_LEN),
        json.dumps(POOL_SIZES),
    ]
    with log.open("w") as fh:
        rc = subprocess.run(
            [sys.executable, "-c", CHILD, *argv],
            cwd=ROOT,
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
            timeout=1200,
        ).returncode
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
    assert out.exists(), f"child rc {rc} wrote no result; log tail:\n{tail}"
    result = json.loads(out.read_text())
    assert "error" not in result, f"{result['error']}\n{tail}"
    return result


def from_json(run: list) -> tuple[list[int], list[dict[int, float]]]:
    return run[0], [{int(t): lp for t, lp in step.items()} for step in run[1]]


@pytest.mark.parametrize("cache", ["bf16", "fp8"])
def test_preempted_requests_match_their_lone_runs_served_path(cache: str, tmp_path: Path) -> None:
    got = run_child(tmp_path, {"kv_cache_dtype": "fp8"} if cache == "fp8" else {})
    alone = [from_json(a) for a in got["alone"]]
    together = [from_json(t) for t in got["together"]]
    verdicts = [compare(a, t) for a, t in zip(alone, together, strict=True)]
    verdict = judge(ensure_checkpoint("qsa512"), got["prompts"], alone, together, device="cuda")
    print(
        f"preemption parity CUDA {cache} ({got['model_class']}, graphs, prefix caching): {REQUESTS} "
        f"requests x {MAX_NEW_TOKENS} tokens, {got['blocks']} KV blocks of {got['block_size']} tokens "
        f"(pools tried first: {[b for b, _ in got['tried']]}), {got['preemptions']:.0f} preemptions, "
        f"{got['cached']} cached prompt tokens; batch vs lone: {summary(verdicts)}"
    )
    control = got["recompute_drift"]
    print(f"recomputing each lone run as one prefill, no preemption: drift {[round(d, 3) for d in control]}")
    print(verdict.line())
    assert got["model_class"] == "model.upstream.model.Qwen4ExpForCausalLM"
    assert got["preemptions"] > 0, "the batch never ran out of KV blocks: the test exercised nothing"
    # bf16 moves a recomputed request's log-probabilities by tenths of a nat on this checkpoint
    # (the control above; tests/pressure/fp32_judge.py): the judge is float32, pooled.
    assert not verdict.problems, verdict.problems
