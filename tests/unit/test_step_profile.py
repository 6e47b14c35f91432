"""The batch-1 step profile's arithmetic (bench/step_profile.py): kernels sorted into components by
name, GPU busy time as the union of kernel intervals (overlaps counted once), host gaps as the rest
of the span, and the per-step split as the difference of two request lengths, which cancels the
prefill and each request's fixed costs."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

PROFILE = Path(__file__).resolve().parents[2] / "bench" / "step_profile.py"


@pytest.fixture(scope="module")
def step_profile():
    spec = importlib.util.spec_from_file_location("step_profile", PROFILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("kernel", "component"),
    [
        ("fused_moe_kernel", "moe"),
        ("marlin_moe_wna16::Marlin<...>", "moe"),
        ("topk_softmax_kernel", "moe"),
        ("chunk_gated_delta_rule_fwd_kernel_h", "gdn"),
        ("fused_recurrent_gated_delta_rule_fwd_kernel", "gdn"),
        ("_causal_conv1d_update_kernel", "gdn"),
        ("qsa_fp8_sparse_attention_kernel", "qsa"),
        ("flash_fwd_splitkv_kernel", "qsa"),
        ("reshape_and_cache_flash_kernel", "qsa"),
        ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "collectives"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32", "gemm"),
        ("nvjet_tst_64x8_64x16_4x1_v_bz_TNT", "gemm"),
        ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "norm"),
        ("_topk_topp_kernel", "sampler"),
        ("triton_poi_fused_add_mul_0", "other"),
    ],
)
def test_kernels_sorted_into_components(step_profile, kernel: str, component: str) -> None:
    assert step_profile.component(kernel) == component


def test_busy_time_counts_overlaps_once(step_profile) -> None:
    assert step_profile.busy_time([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17


def kernel(name: str, ts: float, dur: float) -> dict:
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur}


def test_per_step_is_the_difference_of_two_lengths(step_profile) -> None:
    launch = {"cat": "cuda_runtime", "name": "cudaGraphLaunch"}

    # both requests: a 100 us prefill; then 2 or 4 decode steps of a 30 us MoE kernel, a 10 us GEMM
    # and a 10 us gap before the next step
    def request(steps: int) -> list[dict]:
        events, t = [kernel("chunk_gated_delta_rule_fwd", 0, 100)], 100.0
        for _ in range(steps):
            events += [kernel("fused_moe_kernel", t + 10, 30), kernel("sm90_xmma_gemm", t + 40, 10), launch]
            t += 50
        return events

    short, long = step_profile.summarize(request(2)), step_profile.summarize(request(4))
    step = step_profile.per_step(short, long, 2)
    assert step["step_us"] == 50
    assert step["busy_us"] == 40
    assert step["gap_us"] == 10
    assert step["graph_launches"] == 1
    assert step["components_us"] == {"moe": 30, "gemm": 10, "gdn": 0}
