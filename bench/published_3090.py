"""The 4x RTX 3090 speed estimate against what public 4x3090 setups of the sibling model measured.

    python3 bench/published_3090.py bench/results/real_shape_int4_h200.json [--markdown]

Why: the estimate (``model/tools/planner_speed.py``) turns an H200 measurement of one rank into a
3090 figure through inputs nobody measured on a 3090 here (the share of the step that is fixed
latency, the PCIe link). Public 4x3090 setups of the sibling architecture (Qwen3.8-Flash-Next,
vLLM's ``qwen4_exp``) measured batch-1 and batch-4 decode; predicting them with the same model and
the same inputs says how far the estimate can be trusted before it is applied to our model.

The sibling's text config (``bench/data/qwen38-flash-next-text-config.json``): 48 layers (36 Gated
DeltaNet, 12 QSA), hidden 2560, 512 experts of width 640, top-10, hyper-connections 4 x 320, one PLE
layer, as transcribed from the published config.json in public test suites. Its routed experts at
TP=4 would be 160 wide per rank, which Marlin's int4 tiles (group 128) cannot take: both public
setups serve with expert parallelism, and so is it predicted here.

Published points (decode tok/s, one stream unless noted; no speculative decoding):

* ``halt95/qwen38-flash-next-3090s``, the no-MTP entry of its bench card (commit e9d57454): TP=4
  + expert parallel, W4A16 experts (Marlin), FP8 QSA cache, full CUDA graphs, PCIe Gen4 x16 to each
  card, P2P through the patched open driver, cards capped at 220 W; 78.1 tok/s at a 3,967-token
  prompt (77.1-78.7 from 4K to 260K), 256.1 tok/s over 4 streams. Its GDN projections are INT8,
  which the prediction (bf16 dense layers) reads at twice the bytes.
* ``alesha-pro/qwen38-flash-next-4x3090``, README.md (commit 68528ecd): TP=4 + expert parallel,
  W4A16 experts, FP8 QSA cache, FULL_AND_PIECEWISE graphs, 220 W; 65.8 tok/s at 4K (65.5-69.2 to
  260K). Link not stated (another setup's notes call it PCIe Gen3): predicted with and without P2P.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from model.tools import planner_speed as ps  # noqa: E402
from model.tools.planner import load_config, weights_per_rank  # noqa: E402

SIBLING = ROOT / "bench" / "data" / "qwen38-flash-next-text-config.json"
OURS = ROOT / "deploy" / "qwen4-exp-config.example.json"


@dataclass(frozen=True)
class Published:
    setup: str
    link: str  # a key of planner_speed.LINKS, or "unknown"
    batch: int
    tok_s: float  # aggregate over the batch's streams


PUBLISHED = (
    Published("halt95 (TP4+EP, P2P, Gen4 x16)", "p2p", 1, 78.1),
    Published("halt95 (TP4+EP, P2P, Gen4 x16)", "p2p", 4, 256.1),
    Published("alesha-pro (TP4+EP, link not stated)", "unknown", 1, 65.8),
)


def predict(measured: dict, config, batch: int, link: str, scale: float) -> float:
    est = ps.estimate_rtx3090(
        measured, load_config(OURS), config, weights_per_rank=weights_per_rank, tp=4,
        expert_parallel=True, batches=[batch],
        inputs=ps.Inputs(overhead_scale=scale, link=ps.LINKS[link]),
    )  # fmt: skip
    return est.rows[0].tok_s


def comparison(measured: dict) -> str:
    sibling = load_config(SIBLING)
    scales = (1.0, ps.SM_THROUGHPUT_RATIO)
    out = [
        "| setup | batch | published (tok/s) | link predicted | predicted, overhead x1 | "
        f"predicted, overhead x{scales[1]:.2f} | published / predicted x{scales[1]:.2f} |",
        "|---|---:|---:|---|---:|---:|---:|",
    ]
    for p in PUBLISHED:
        for link in ("p2p", "no-p2p") if p.link == "unknown" else (p.link,):
            lo, hi = (predict(measured, sibling, p.batch, link, s) for s in scales)
            out.append(
                f"| {p.setup} | {p.batch} | {p.tok_s:.1f} | {link} | {lo:.1f} | {hi:.1f} | {p.tok_s / hi:.2f} |"
            )
    return "\n".join(out) + "\n"


def our_estimate(measured: dict) -> str:
    """Our model's 4x3090 estimate as ranges: overhead x1 to x1.88, each layout and link."""
    ours = load_config(OURS)
    out = [
        "| experts | link | b1 (tok/s) | b4 (tok/s) | b16 (tok/s) | b64 (tok/s) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for ep in (False, True):
        for link in ("p2p", "no-p2p"):
            cells = []
            for b in (1, 4, 16, 64):
                lo, hi = (
                    ps.estimate_rtx3090(
                        measured, ours, ours, weights_per_rank=weights_per_rank, tp=4, expert_parallel=ep,
                        batches=[b], inputs=replace(ps.Inputs(), overhead_scale=s, link=ps.LINKS[link]),
                    ).rows[0].tok_s
                    for s in (ps.SM_THROUGHPUT_RATIO, 1.0)
                )  # fmt: skip
                cells.append(f"{lo:,.0f}-{hi:,.0f}")
            layout = "expert-parallel" if ep else "TP-sharded"
            out.append(f"| {layout} | {link} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("measured", help="JSON of bench/bench_real_shape.py (the real-rank shape)")
    a = ap.parse_args(argv)
    measured = json.loads(Path(a.measured).read_text())
    print("## Predicted vs published: Qwen3.8-Flash-Next on 4x RTX 3090\n")
    print(comparison(measured))
    print("## Our model (deploy/qwen4-exp-config.example.json) on 4x RTX 3090, TP=4\n")
    print(our_estimate(measured))
    return 0


if __name__ == "__main__":
    sys.exit(main())
