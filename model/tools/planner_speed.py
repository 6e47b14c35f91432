"""Decode speed on RTX 3090s, estimated from one GPU's measurement of one rank's shape.

Why an estimate: where no four RTX 3090s are available to measure, an H200 can run exactly what one
rank of TP=4 computes (``bench/bench_real_shape.py``, the ``real-rank`` preset). Its step is split
into what a 3090 does differently and what it does the same, and each part is priced on its own:

* **memory**: the weight bytes the step reads (:func:`decode_bytes_per_step`) at a fraction of the
  card's peak bandwidth (``memory_efficiency``, the same for both cards). On the H200 this part is
  small: at batch 1 the measured step reads 2.2 GB in 4.4 ms, 10% of its bandwidth.
* **overhead**: the rest of the measured step (kernel launches and gaps inside the CUDA graph,
  small latency-bound kernels, the host between steps). Fitted per layer as ``a + c x d`` with ``d``
  the distinct routed experts a batch selects per layer (the MoE kernels' work grows with them),
  from every batch measured; carried to the target by its layer count and multiplied by
  ``overhead_scale``: 1 if the overhead is fixed latency a 3090 pays alike, the ratio of the two
  cards' SM throughput (:data:`SM_THROUGHPUT_RATIO`, 1.88) if it is GPU work that runs slower on
  a card with fewer, slower SMs. Which share is which is not measured, so estimates are given at
  both ends.
* **collectives**: what TP adds (:func:`collectives_per_step`), each call ``latency + bus bytes /
  bus bandwidth`` with nccl-tests' convention, for the link given (:data:`LINKS`: PCIe with or
  without peer-to-peer).

Bytes one decode step reads: every non-expert weight the rank holds
(:func:`model.tools.planner.weights_per_rank`), the LM head's vocabulary shard (not the embedding: a
lookup reads a few rows), the shared expert, and of the routed experts only those the batch's tokens
select (expected distinct experts under uniform routing). With expert parallelism a rank holds
``E / tp`` whole experts and the slowest rank decides: at batch 1 the expected largest number of
the ``k`` chosen experts that land on one rank, at larger batches the mean per rank. KV-cache and
state reads are left out (small next to the weights at the bench's short contexts); PLE tables live
in host memory. Compute is not modelled: at batch 64 a 3090's ~71 dense bf16 TFLOPS may bound a step
before its bandwidth does.

Sources of the defaults: the 3090's 936 GB/s, 82 SMs and 1,695 MHz boost clock, NVIDIA's GA102
whitepaper, Appendix A
(https://images.nvidia.com/aem-dam/en-zz/Solutions/geforce/ampere/pdf/NVIDIA-ampere-GA102-GPU-Architecture-Whitepaper-V1.pdf);
the H200's 4.8 TB/s, 132 SMs and 1,980 MHz, NVIDIA's H200 and H100 SXM5 specifications. The link
figures are inputs, each with its source in :data:`LINKS`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from model.runtime.expert_format import ExpertFormat

GB = 10**9
RTX3090_GBPS = 936.0  # GA102 whitepaper, Appendix A (URL in the module docstring)
H200_GBPS = 4800.0  # NVIDIA H200 product page: 4.8 TB/s HBM3e
RTX3090_SMS, RTX3090_MHZ = 82, 1695  # GA102 whitepaper, Appendix A
H200_SMS, H200_MHZ = 132, 1980  # NVIDIA H100/H200 SXM5
SM_THROUGHPUT_RATIO = (H200_SMS * H200_MHZ) / (RTX3090_SMS * RTX3090_MHZ)  # 1.88
MEMORY_EFFICIENCY = 0.85  # attainable fraction of peak bandwidth for streaming reads (assumed, both cards)
PREFERRED = (("served", "int4"), ("served", "bf16"))  # what a 3090 serves, then the served path


@dataclass(frozen=True)
class Link:
    """How the ranks' collectives travel: per-call latency and nccl-tests bus bandwidth."""

    name: str
    latency_us: float
    busbw_gbps: float
    source: str


LINKS: dict[str, Link] = {
    "no-p2p": Link(
        "PCIe without peer-to-peer (NCCL through host memory)",
        30.0,
        8.0,
        "assumed between published RTX 4090 figures without P2P: 8 GPUs ~40 us for an 8-byte "
        "all-reduce (https://github.com/NVIDIA/nccl/issues/1530), 2 GPUs ~12 us per small alltoall "
        "message (https://github.com/tinygrad/open-gpu-kernel-modules/issues/17); 8 GB/s, under the "
        "12-25 GB/s host-staged Gen4 x16 copies reach",
    ),
    "p2p": Link(
        "PCIe with peer-to-peer (patched open driver, NCCL P2P transport)",
        12.0,
        20.0,
        "assumed: direct GPU-to-GPU writes remove the host hop, leaving NCCL's per-call cost over "
        "three ring steps; vLLM's custom all-reduce stays off on more than two PCIe GPUs, so NCCL "
        "carries it either way",
    ),
}


class _Part(Protocol):
    name: str
    bytes_per_rank: int


# ``model.tools.planner.weights_per_rank``, passed in by the caller: the planner imports this module for
# ``--speed``, and ``model/`` has no import cycles (tests/unit/test_import_graph.py), so this module
# cannot import the planner back.
WeightsPerRank = Callable[..., Sequence[_Part]]


@dataclass
class StepBytes:
    """Bytes one decode step reads on one rank, by part (only what scales with the weights)."""

    parts: dict[str, int]
    experts_read: float  # routed experts read per layer on the slowest rank (whole experts with EP)

    @property
    def total(self) -> int:
        return sum(self.parts.values())


def expected_distinct_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Distinct experts a batch of ``tokens`` selects per layer, routing uniform and independent.

    Each expert is missed by one token with probability ``1 - k/E``; random weights route close to
    uniformly, so this is what the bench's batches read. Batch 1 reads exactly ``k``.
    """
    if tokens <= 1:
        return float(min(top_k, num_experts))
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def expected_max_experts_on_a_rank(num_experts: int, top_k: int, ranks: int) -> float:
    """The expected largest number of one token's ``top_k`` experts held by one of ``ranks`` equal
    groups (expert parallelism at batch 1: that rank reads the most and the others wait for it).

    Exact: the ``k`` experts are a uniform draw without replacement from ``E``, so the counts per
    group are multivariate hypergeometric; P(max <= m) counts the draws with at most ``m`` per group.
    """
    per = num_experts // ranks
    total = math.comb(num_experts, top_k)

    def at_most(m: int) -> float:
        ways = [1] + [0] * top_k  # ways[j]: draws of j experts so far with <= m in each group
        for _ in range(ranks):
            ways = [
                sum(ways[j - i] * math.comb(per, i) for i in range(min(m, j) + 1)) for j in range(top_k + 1)
            ]
        return ways[top_k] / total

    return sum(1.0 - at_most(m) for m in range(top_k))


def decode_bytes_per_step(
    config,
    tp: int,
    expert_format: str | ExpertFormat = "bf16",
    *,
    weights_per_rank: WeightsPerRank,
    batch: int = 1,
    expert_parallel: bool = False,
) -> StepBytes:
    """Weight bytes one rank reads for one decode step of ``batch`` tokens (see the module doc).

    Built on ``weights_per_rank`` (:func:`model.tools.planner.weights_per_rank`; see
    :data:`WeightsPerRank` for why it is an argument), so sharding and the expert formats' bytes are
    the planner's: the routed experts' part is scaled from the experts the rank holds to those it
    reads, and the embedding half of "embed_tokens + lm_head" is dropped (a tied table is the LM head).
    """
    parts: dict[str, int] = {}
    e, k = config.num_experts, config.num_experts_per_tok
    if expert_parallel and tp > 1:
        held = e // tp
        read = (
            expected_max_experts_on_a_rank(e, k, tp)
            if batch <= 1
            else expected_distinct_experts(e, k, batch) / tp
        )
    else:
        held, read = e, expected_distinct_experts(e, k, batch)
    for p in weights_per_rank(config, tp, expert_format, expert_parallel=expert_parallel):
        if p.name.startswith("routed experts"):
            parts[p.name] = round(p.bytes_per_rank * read / held)
        elif p.name.startswith("embed_tokens"):
            parts["lm_head (vocab shard)"] = (
                p.bytes_per_rank if config.tie_word_embeddings else p.bytes_per_rank // 2
            )
        else:
            parts[p.name] = p.bytes_per_rank
    return StepBytes(parts, read)


@dataclass
class Collective:
    name: str
    calls: int
    bytes_per_call: int  # message size (the all-reduced tensor, or the gathered whole)
    bus_factor: float  # bytes each rank moves per message byte (nccl-tests' busbw convention)


def collectives_per_step(config, tp: int, batch: int) -> list[Collective]:
    """The collectives TP adds to one decode step of ``batch`` tokens (none at TP=1).

    Expert parallelism within the TP group adds none and removes none: every rank holds every
    token's hidden state, runs the experts it holds, and the MoE's partial outputs are all-reduced
    as with TP-sharded experts (vLLM dispatches tokens all-to-all only across data-parallel ranks).
    """
    if tp <= 1:
        return []
    ring = 2 * (tp - 1) / tp
    layers = len(config.layer_types)
    h = config.hidden_size
    out = [
        Collective("all-reduce after mixer and MoE (2 per layer)", 2 * layers, h * batch * 2, ring),
        Collective("all-reduce of the vocab-parallel embedding", 1, h * batch * 2, ring),
    ]
    if config.ple_layer_ids:
        out.append(
            Collective(
                "all-reduce of the row-sharded PLE lookup",
                len(config.ple_layer_ids),
                config.ple_embed_dim * batch * 2,
                ring,
            )
        )
    out.append(Collective("gather of the LM head's logits", 1, config.vocab_size * batch * 2, (tp - 1) / tp))
    return out


def collective_seconds(c: Collective, latency_us: float, busbw_gbps: float) -> float:
    return c.calls * (latency_us * 1e-6 + c.bytes_per_call * c.bus_factor / (busbw_gbps * GB))


@dataclass
class Overhead:
    """The measured steps' time beyond their memory time, per layer: ``a + c x d`` seconds, ``d`` the
    distinct routed experts per layer. Fitted by least squares over the measured batches (a single
    batch gives ``c = 0``)."""

    per_layer_s: float  # a
    per_expert_s: float  # c
    layers: int  # the measured shape's
    points: dict[int, float]  # batch -> measured overhead per layer (s)

    def per_layer(self, distinct_experts: float) -> float:
        return max(self.per_layer_s + self.per_expert_s * distinct_experts, 0.0)


def fit_overhead(
    row: dict[str, Any],
    config,
    tp: int,
    *,
    weights_per_rank: WeightsPerRank,
    hbm_gbps: float,
    efficiency: float,
) -> Overhead:
    """:class:`Overhead` of a measured row of ``bench/bench_real_shape.py`` (one rank of ``config`` at
    ``tp``): each batch's step ``b / tok_s`` less its bytes at ``efficiency`` of ``hbm_gbps``."""
    layers = len(config.layer_types)
    xs: list[float] = []
    ys: list[float] = []
    points: dict[int, float] = {}
    for b_str, tps in row["tps"].items():
        b = int(b_str)
        if not tps or tps <= 0:
            continue
        sb = decode_bytes_per_step(config, tp, row["experts"], weights_per_rank=weights_per_rank, batch=b)
        over = max(b / tps - sb.total / (efficiency * hbm_gbps * GB), 0.0) / layers
        points[b] = over
        xs.append(expected_distinct_experts(config.num_experts, config.num_experts_per_tok, b))
        ys.append(over)
    if not xs:
        raise ValueError("the measured row has no batch with a positive tok/s")
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    c = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx > 0 else 0.0
    return Overhead(my - c * mx, c, layers, points)


@dataclass
class Inputs:
    """Every input of the estimate beyond the measurement and the config; each is printed with it."""

    rtx3090_gbps: float = RTX3090_GBPS
    memory_efficiency: float = MEMORY_EFFICIENCY
    overhead_scale: float = 1.0
    link: Link = LINKS["no-p2p"]


@dataclass
class EstimateRow:
    batch: int
    bytes_per_step: int  # the slowest rank, this batch
    memory_ms: float
    overhead_ms: float
    comm_ms: float
    step_ms: float
    tok_s: float
    bound_tok_s: float  # bytes at the 3090's full bandwidth plus the same collectives, no overhead


@dataclass
class Estimate:
    source: str  # which measured row
    gpu: str
    hbm_gbps: float
    tp: int
    expert_parallel: bool
    layers: int
    expert_format: str
    inputs: Inputs
    overhead: Overhead
    rows: list[EstimateRow]
    collectives: list[Collective]
    assumptions: list[str] = field(default_factory=list)


def pick_measurement(measured: dict[str, Any], expert_format: str | None = None) -> dict[str, Any]:
    """The row of the bench's JSON to scale: ``expert_format`` on the served path if measured,
    else the served path's int4, then bf16, then the first row that ran."""
    ok = [r for r in measured.get("results", []) if r.get("ok")]
    if not ok:
        raise ValueError("the measurement has no variant that ran (every row has ok=false)")
    wanted = ([("served", expert_format)] if expert_format else []) + list(PREFERRED)
    for variant, experts in wanted:
        for r in ok:
            if r["variant"] == variant and r["experts"] == experts:
                return r
    return ok[0]


def estimate_rtx3090(
    measured: dict[str, Any],
    measured_config,
    config,
    *,
    weights_per_rank: WeightsPerRank,
    tp: int = 4,
    expert_parallel: bool = False,
    expert_format: str | None = None,
    batches: Sequence[int] | None = None,
    inputs: Inputs | None = None,
    measured_tp: int = 4,
) -> Estimate:
    """Tok/s of ``tp`` RTX 3090s serving ``config``, from ``bench/bench_real_shape.py``'s JSON.

    ``measured_config`` is the model whose one rank at ``measured_tp`` the bench ran (the planner's
    config for ``real-rank``); ``config`` is the model estimated (the same, or another of the family:
    its layer count carries the overhead over, its bytes and collectives are its own). ``batches``:
    default, those measured.
    """
    inputs = inputs or Inputs()
    row = pick_measurement(measured, expert_format)
    hbm = float(measured.get("hbm_gbps", H200_GBPS))
    over = fit_overhead(
        row, measured_config, measured_tp, weights_per_rank=weights_per_rank, hbm_gbps=hbm,
        efficiency=inputs.memory_efficiency,
    )  # fmt: skip
    layers = len(config.layer_types)
    link = inputs.link
    wanted = sorted(set(batches or (int(b) for b, t in row["tps"].items() if t and t > 0)))
    rows: list[EstimateRow] = []
    for b in wanted:
        sb = decode_bytes_per_step(
            config,
            tp,
            row["experts"],
            weights_per_rank=weights_per_rank,
            batch=b,
            expert_parallel=expert_parallel,
        )
        memory = sb.total / (inputs.memory_efficiency * inputs.rtx3090_gbps * GB)
        distinct = expected_distinct_experts(config.num_experts, config.num_experts_per_tok, b)
        overhead = layers * over.per_layer(distinct) * inputs.overhead_scale
        comm = sum(
            collective_seconds(c, link.latency_us, link.busbw_gbps)
            for c in collectives_per_step(config, tp, b)
        )
        step = memory + overhead + comm
        rows.append(
            EstimateRow(
                batch=b,
                bytes_per_step=sb.total,
                memory_ms=memory * 1e3,
                overhead_ms=overhead * 1e3,
                comm_ms=comm * 1e3,
                step_ms=step * 1e3,
                tok_s=b / step,
                bound_tok_s=b / (sb.total / (inputs.rtx3090_gbps * GB) + comm),
            )
        )
    return Estimate(
        source=f"{row['variant']}/{row['experts']}",
        gpu=str(measured.get("gpu", "unknown")),
        hbm_gbps=hbm,
        tp=tp,
        expert_parallel=expert_parallel,
        layers=layers,
        expert_format=row["experts"],
        inputs=inputs,
        overhead=over,
        rows=rows,
        collectives=collectives_per_step(config, tp, 1),
        assumptions=_assumptions(row, measured, hbm, inputs, over, tp),
    )


def _assumptions(row, measured, hbm: float, inputs: Inputs, over: Overhead, tp: int) -> list[str]:
    pts = ", ".join(f"b{b} {s * 1e6:.0f} us" for b, s in sorted(over.points.items()))
    link = inputs.link
    return [
        f"measured: {row['variant']} path, {row['experts']} experts, on {measured.get('gpu', 'unknown GPU')} "
        f"({hbm:,.0f} GB/s), one rank's shape of {over.layers} layers",
        f"memory: bytes at {inputs.memory_efficiency:.0%} of peak on both cards (--memory-efficiency; "
        f"RTX 3090 peak {inputs.rtx3090_gbps:,.0f} GB/s, NVIDIA GA102 whitepaper)",
        f"overhead per layer beyond memory time, measured: {pts}; fitted {over.per_layer_s * 1e6:.1f} us "
        f"+ {over.per_expert_s * 1e9:.1f} ns per distinct expert, x{inputs.overhead_scale:.2f} on the 3090 "
        f"(--overhead-scale: 1 = fixed latency, {SM_THROUGHPUT_RATIO:.2f} = GPU work at the SM-throughput ratio)",
        f"TP={tp} collectives over {link.name}: {link.latency_us:g} us per call + bus bytes at "
        f"{link.busbw_gbps:g} GB/s (--link, --allreduce-latency-us, --allreduce-busbw-gbps; {link.source})",
        "bytes per step: the rank's weights without the embedding, routed experts only those read "
        "(uniform routing; with expert parallelism the busiest rank), no KV cache or state reads, PLE "
        "tables in host memory; compute is not modelled",
    ]


def render_estimate(est: Estimate, title: str | None = None) -> str:
    """The estimate as markdown: one row per batch, the collectives, and every input."""
    ep = " + expert parallel" if est.expert_parallel else ""
    head = title or (
        f"Decode speed estimate: {est.tp}x RTX 3090, TP={est.tp}{ep}, {est.layers} layers "
        f"(from {est.source} on {est.gpu})"
    )
    out = [
        f"## {head}",
        "",
        "| batch | bytes/step (GB) | memory (ms) | overhead (ms) | collectives (ms) | step (ms) | **tok/s** "
        "| bound at peak bandwidth (tok/s) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in est.rows:
        out.append(
            f"| {r.batch} | {r.bytes_per_step / GB:.2f} | {r.memory_ms:.2f} | {r.overhead_ms:.2f} | "
            f"{r.comm_ms:.2f} | {r.step_ms:.2f} | **{r.tok_s:,.1f}** | {r.bound_tok_s:,.1f} |"
        )
    out += ["", "Collectives per step (batch 1):", ""]
    for c in est.collectives:
        out.append(f"- {c.name}: {c.calls} x {c.bytes_per_call:,} bytes")
    out += ["", "Inputs:", ""]
    out += [f"- {a}" for a in est.assumptions]
    return "\n".join(out) + "\n"
