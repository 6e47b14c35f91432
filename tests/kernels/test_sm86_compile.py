"""Every Triton kernel the served path launches on an RTX 3090, compiled for sm_86 (no GPU): QSA,
hyper-connections, Gated DeltaNet (vLLM's FLA port, causal conv, gated RMSNorm), the fused-MoE
kernel for bf16 experts and the PLE kernels.

At the real model's shapes per rank for TP 1, 2 and 4 (the experts also as expert parallelism places
them at 2 and 4: whole experts, a share of them per rank) and with the tiles the product picks there
(``tests.kernels.sm86_compile.product_launches`` and ``served_extra``): shared memory within the
3090's 101,376 bytes per block, no register spills reported by ptxas, and no float8 type in any
kernel (sm_86 has no FP8 instructions; the FP8 cache is read by bit manipulation). An
``@triton.autotune`` kernel passes when at least one config of its list fits (the autotuner on a
3090 drops configs that raise OutOfResources); the others are printed, not failed. A kernel that is
not Triton is listed with the reason it is not compiled. Runs in a child process because the
compiler needs vLLM's ``triton_utils`` to hand out the real Triton. Prints the table.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT, pythonpath_with

# Spills ptxas reports for upstream's own launch choices on sm_86 at head dim 256: its default config
# table (tuned on GB300, used below sm_90) runs the sparse attention with one warp and 32 key columns
# for most decode batch sizes and long prefills, and its split merge with 64 splits. Correct, but
# through local memory; not changed until a 3090 measures a better tile. Any other spill fails.
KNOWN_UPSTREAM_SPILLS = {
    ("sparse attention TP=1", "BLOCK_M=8 BLOCK_N=32 NUM_SPLITS=4 stages=2 warps=1"): 372,
    ("sparse attention TP=2", "BLOCK_M=8 BLOCK_N=32 NUM_SPLITS=4 stages=2 warps=1"): 372,
    ("sparse attention TP=4", "BLOCK_M=4 BLOCK_N=32 NUM_SPLITS=4 stages=2 warps=1"): 308,
    ("_qsa_merge_splitk_kernel", "BLOCK_SPLITS=64 stages=1 warps=2"): 96,
}


def test_served_kernels_fit_an_rtx_3090():
    triton = pytest.importorskip("triton")
    from pathlib import Path

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("Triton's wheel carries no ptxas here: nothing can compile for sm_86")
    done = subprocess.run(
        [sys.executable, "-m", "tests.kernels.sm86_compile", "--product"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**__import__("os").environ, "PYTHONPATH": pythonpath_with(ROOT)},
        timeout=1200,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    print(
        "\n| kernel | shape | cache | tile / config | shared bytes | registers | spill bytes | FP8 types | note |"
    )
    for r in rows:
        note = r["skipped"] or (
            ("autotune: fits" if r["fits"] else "autotune: does not fit") if r["autotune"] else ""
        )
        cells = (
            r["kernel"],
            r["shape"],
            r["cache"],
            r["tile"],
            r["shared"],
            r["registers"],
            r["spill_bytes"],
        )
        print("| " + " | ".join(str(c) for c in (*cells, r["fp8_types"], note)) + " |")
    kernels = {r["kernel"].split(" TP=")[0] for r in rows}
    assert {
        "indexer prefill",
        "indexer decode",
        "sparse attention",
        "our reader",
        "_qsa_prepare_kernel",
        "hc combine+norm",
        "gdn causal_conv1d_fn",
        "gdn chunk_gated_delta_rule_fwd_h",
        "gdn chunk_fwd_o",
        "gdn fused_recurrent_packed_decode",
        "gdn gated RMSNorm (layer_norm_fwd_kernel)",
        "fused_moe_kernel w13",
        "fused_moe_kernel w2",
        "ple conv (prefill)",
        "our ple_gather (nvfp4)",
    } <= kernels
    tuned: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        assert r["fp8_types"] == [], r
        if r["skipped"]:
            assert r["tile"] == "-", r
        elif r["autotune"]:
            tuned.setdefault((r["kernel"], r["shape"]), []).append(r)
        else:
            assert r["shared"] <= 101376, r
            assert r["spill_bytes"] == KNOWN_UPSTREAM_SPILLS.get((r["kernel"], r["tile"]), 0), r
    assert tuned, "no autotuned kernel was compiled"
    for (kernel, shape), configs in tuned.items():
        assert any(r["fits"] for r in configs), (kernel, shape, configs)
