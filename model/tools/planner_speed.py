"""Decode speed on 4x RTX 3090 at TP=4, estimated from one GPU's measurement of one rank's shape.

Why an estimate: where no four RTX 3090s are available to measure, an H200 can run exactly what one rank of TP=4 computes
(``bench/bench_real_shape.py``, the ``real-rank`` preset). A decode step at small batch is bound by
the bytes it reads from GPU memory, so the measured step is turned into a 3090 step by the ratio of
the two memory bandwidths (the fraction of peak bandwidth the H200 achieved is assumed to be what a
3090 achieves too), and the collectives TP=4 adds over PCIe are priced separately. The result is
an inference, not a measurement; every assumption is printed with it.

Bytes one decode step reads (:func:`decode_bytes_per_step`): every non-expert weight the rank holds
(:func:`model.tools.planner.weights_per_rank`), the LM head's vocabulary shard (not the embedding: a
lookup reads a few rows), the shared expert, and of the routed experts only those the batch's
tokens select (``num_experts_per_tok`` per token; for a batch, the expected number of distinct
experts under uniform routing). KV-cache and state reads are left out: at the short contexts the
bench decodes they are small next to the weights. PLE tables live in host memory and are left out.

Collectives per step at TP>1: two all-reduces per layer (after the attention/GDN mixer and after
the MoE, both row-parallel outputs of ``hidden_size`` per token), one for the vocab-parallel
embedding, one per PLE layer (the row-sharded tables' lookup, ``ple_embed_dim`` per token), and the
LM head's logits gathered to one rank. Each costs ``latency + bus_bytes / bus_bandwidth`` with
nccl-tests' convention (ring all-reduce moves ``2 (n-1)/n`` of the message per rank).

The 3090's bandwidth: 936 GB/s, NVIDIA's GA102 whitepaper, Appendix A "GeForce RTX 3090"
(https://images.nvidia.com/aem-dam/en-zz/Solutions/geforce/ampere/pdf/NVIDIA-ampere-GA102-GPU-Architecture-Whitepaper-V1.pdf).

The PCIe all-reduce figures are inputs, not facts: no published nccl-tests ``all_reduce_perf``
table for four RTX 3090s without P2P was found. The nearest published figures are for RTX 4090s
(PCIe Gen4, no P2P, like a 3090 pair without an NVLink bridge): 8 GPUs, ~40 us for an 8-byte
all-reduce (https://github.com/NVIDIA/nccl/issues/1530), and 2 GPUs, ~12 us per small
``alltoall_perf`` message (https://github.com/tinygrad/open-gpu-kernel-modules/issues/17). The
defaults take 30 us per call (four GPUs lie between those) and 8 GB/s of bus bandwidth (under the
~12-25 GB/s that Gen4 x16 host-staged transfers reach, so the estimate errs slow); both are options
of ``python -m model.tools.planner --speed``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from model.tools.planner_quant import ExpertFormat

GB = 10**9
RTX3090_GBPS = 936.0  # GA102 whitepaper, Appendix A (URL in the module docstring)
H200_GBPS = 4800.0  # NVIDIA H200 product page: 4.8 TB/s HBM3e
ALLREDUCE_LATENCY_US = 30.0  # per call, 4 GPUs, PCIe without P2P (assumed; see the docstring)
ALLREDUCE_BUSBW_GBPS = 8.0  # nccl-tests busbw, PCIe Gen4 without P2P (assumed; see the docstring)
PREFERRED = (("served", "int4"), ("served", "bf16"))  # what a 3090 serves, then the served path


class _Part(Protocol):
    name: str
    bytes_per_rank: int


# ``model.tools.planner.weights_per_rank``, passed in by the caller: the planner imports this module for
# ``--speed``, and ``model/`` has no import cycles (tests/unit/test_import_graph.py), so this module
# cannot import the planner back.
WeightsPerRank = Callable[[Any, int, Any], Sequence[_Part]]


@dataclass
class StepBytes:
    """Bytes one decode step reads on one rank, by part (only what scales with the weights)."""

    parts: dict[str, int]
    experts_read: float  # routed experts read per layer

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


def decode_bytes_per_step(
    config,
    tp: int,
    expert_format: str | ExpertFormat = "bf16",
    *,
    weights_per_rank: WeightsPerRank,
    batch: int = 1,
) -> StepBytes:
    """Weight bytes one rank reads for one decode step of ``batch`` tokens (see the module doc).

    Built on ``weights_per_rank`` (:func:`model.tools.planner.weights_per_rank`; see
    :data:`WeightsPerRank` for why it is an argument), so sharding and the expert formats' bytes are
    the planner's: the routed experts' part is scaled from all ``num_experts`` to those read, and
    the embedding half of "embed_tokens + lm_head" is dropped (a tied table is the LM head itself).
    """
    parts: dict[str, int] = {}
    read = expected_distinct_experts(config.num_experts, config.num_experts_per_tok, batch)
    for p in weights_per_rank(config, tp, expert_format):
        if p.name.startswith("routed experts"):
            parts[p.name] = round(p.bytes_per_rank * read / config.num_experts)
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
    """The collectives TP adds to one decode step of ``batch`` tokens (none at TP=1)."""
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
class EstimateRow:
    batch: int
    measured_step_ms: float  # on the measuring GPU (one rank's shape, no collectives)
    bytes_per_step: int  # this rank, this batch
    achieved_fraction: float  # of the measuring GPU's bandwidth
    memory_ms: float  # the measured step scaled to the 3090's bandwidth
    comm_ms: float  # TP collectives over PCIe
    step_ms: float
    tok_s: float
    bound_tok_s: float  # at the 3090's full bandwidth with the same collectives: what no host can beat


@dataclass
class Estimate:
    source: str  # which measured row
    gpu: str
    hbm_gbps: float
    rtx3090_gbps: float
    tp: int
    latency_us: float
    busbw_gbps: float
    expert_format: str
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


def estimate_rtx3090_tp4(
    measured: dict[str, Any],
    config,
    *,
    weights_per_rank: WeightsPerRank,
    expert_format: str | None = None,
    tp: int = 4,
    rtx3090_gbps: float = RTX3090_GBPS,
    latency_us: float = ALLREDUCE_LATENCY_US,
    busbw_gbps: float = ALLREDUCE_BUSBW_GBPS,
) -> Estimate:
    """Tok/s of ``tp`` RTX 3090s for each batch measured, from ``bench/bench_real_shape.py``'s JSON.

    ``config`` is the full model's (the planner's): per-rank bytes and collectives come from it at
    ``tp``, so they match what the bench ran only when the bench ran this model's ``real-rank``
    shape. Per batch ``b``: measured step ``b / tok_s``; memory part = that step x (measuring GPU's
    bandwidth / the 3090's), i.e. the 3090 reaching the same fraction of its peak; plus the
    collectives of :func:`collectives_per_step`.
    """
    row = pick_measurement(measured, expert_format)
    hbm = float(measured.get("hbm_gbps", H200_GBPS))
    colls = collectives_per_step(config, tp, 1)
    rows: list[EstimateRow] = []
    for b_str, tps in sorted(row["tps"].items(), key=lambda kv: int(kv[0])):
        b = int(b_str)
        if not tps or tps <= 0:
            continue
        step = b / tps
        nbytes = decode_bytes_per_step(
            config, tp, row["experts"], weights_per_rank=weights_per_rank, batch=b
        ).total
        memory = step * hbm / rtx3090_gbps
        comm = sum(collective_seconds(c, latency_us, busbw_gbps) for c in collectives_per_step(config, tp, b))
        total = memory + comm
        rows.append(
            EstimateRow(
                batch=b,
                measured_step_ms=step * 1e3,
                bytes_per_step=nbytes,
                achieved_fraction=nbytes / step / (hbm * GB),
                memory_ms=memory * 1e3,
                comm_ms=comm * 1e3,
                step_ms=total * 1e3,
                tok_s=b / total,
                bound_tok_s=b / (nbytes / (rtx3090_gbps * GB) + comm),
            )
        )
    assumptions = [
        f"measured: {row['variant']} path, {row['experts']} experts, on {measured.get('gpu', 'unknown GPU')} "
        f"(bandwidth taken as {hbm:,.0f} GB/s), one rank's shape at TP=1",
        f"RTX 3090 bandwidth {rtx3090_gbps:,.0f} GB/s (NVIDIA GA102 whitepaper); the 3090 is assumed to reach "
        "the same fraction of its peak as the measuring GPU did, for the whole step (host and launch "
        "time included, which makes the estimate slow where the step is not memory-bound)",
        f"TP={tp} collectives over PCIe without P2P: {latency_us:g} us per call + bus bytes at "
        f"{busbw_gbps:g} GB/s (assumed, not measured on 3090s: python -m model.tools.planner --allreduce-latency-us / "
        "--allreduce-busbw-gbps)",
        "bytes per step: the rank's weights without the embedding, routed experts only those read "
        "(uniform routing), no KV cache or state reads, PLE tables in host memory",
        "'bound at peak bandwidth' reads the bytes at the 3090's full bandwidth plus the same collectives: "
        "an upper bound, where the estimate assumes the measured efficiency",
        "compute is not modelled: at batch 64 a 3090's ~71 dense bf16 TFLOPS may bound the step before "
        "its bandwidth does",
    ]
    return Estimate(
        source=f"{row['variant']}/{row['experts']}",
        gpu=str(measured.get("gpu", "unknown")),
        hbm_gbps=hbm,
        rtx3090_gbps=rtx3090_gbps,
        tp=tp,
        latency_us=latency_us,
        busbw_gbps=busbw_gbps,
        expert_format=row["experts"],
        rows=rows,
        collectives=colls,
        assumptions=assumptions,
    )


def render_estimate(est: Estimate) -> str:
    """The estimate as markdown: one row per batch, the collectives, and every assumption."""
    out = [
        f"## Decode speed estimate: {est.tp}x RTX 3090, TP={est.tp} (from {est.source} on {est.gpu})",
        "",
        "| batch | measured step (ms) | bytes/step (GB) | achieved fraction | 3090 memory (ms) | "
        "collectives (ms) | step (ms) | **tok/s** | bound at peak bandwidth (tok/s) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in est.rows:
        out.append(
            f"| {r.batch} | {r.measured_step_ms:.2f} | {r.bytes_per_step / GB:.2f} | {r.achieved_fraction:.0%} | "
            f"{r.memory_ms:.2f} | {r.comm_ms:.2f} | {r.step_ms:.2f} | **{r.tok_s:,.1f}** | {r.bound_tok_s:,.1f} |"
        )
    out += ["", "Collectives per step (batch 1):", ""]
    for c in est.collectives:
        out.append(f"- {c.name}: {c.calls} x {c.bytes_per_call:,} bytes")
    out += ["", "Assumptions:", ""]
    out += [f"- {a}" for a in est.assumptions]
    return "\n".join(out) + "\n"
