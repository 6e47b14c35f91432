"""The hyper-connection gate mix on the served path, rounded where transformers (and ours) round.

The gate mix turns the normalised streams ``xn [T, hc * H]`` and the gate logits ``g [T, hc * H]``
into the block input ``mean over streams of sigmoid(g) * xn`` ``[T, H]``. transformers' Qwen4-Exp
computes it as three bf16 tensor ops, so ``sigmoid(g)`` and each product are rounded to bf16 before
the mean (which sums in float32 and rounds once). vLLM's own kernel (``qwen4_exp.nvidia.ops.hc``)
keeps everything in float32 and rounds once at the end. Neither is more precise on average, but
they round differently, and the block input feeds every MoE router: where a router sits at a
near-tie, the two orders pick different experts. On text that repeats, the same near-tie recurs
at every repeat, so one flipped choice becomes a systematic error: on such prompts the served path
sat twice as far from float32 as transformers-bf16 and ours (docs/fidelity.md has the case and the
measurements). In the reference's order the served path makes the reference's choices there.

The kernel is one launch per call, as upstream's: only the two intermediate roundings are added.
It replaces upstream's ``hc_gate_mix`` in its hyper-connection module (:func:`install`), registered
as a vLLM custom op so that torch.compile treats it as opaque and CUDA graphs capture it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

OP_NAME = "qwen4exp_hc_gate_mix_reference_order"
BLOCK_SIZE = 512


@triton.jit
def _round_to_bf16(v):
    """float32 ``v`` rounded to the nearest bf16 value (ties to even), kept as float32. Done on the
    bits so that every backend rounds alike (Triton's CPU interpreter truncates on ``.to``)."""
    bits = v.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _gate_mix_kernel(
    x_ptr,
    g_ptr,
    y_ptr,
    stride_x,
    stride_g,
    stride_y,
    HC_DIM: tl.constexpr,
    HC: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < HC_DIM
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for stream in tl.static_range(HC):
        offsets = stream * HC_DIM + cols
        g = tl.load(g_ptr + row * stride_g + offsets, mask=mask, other=0.0)
        x = tl.load(x_ptr + row * stride_x + offsets, mask=mask, other=0.0)
        gate = _round_to_bf16(tl.sigmoid(g.to(tl.float32)))  # torch.sigmoid on a bf16 tensor
        acc += _round_to_bf16(gate * x.to(tl.float32))  # bf16 * bf16
    # mean(-2) of a bf16 tensor: float32 sum times 1/n, rounded once
    mean = _round_to_bf16(acc * (1.0 / HC))
    tl.store(y_ptr + row * stride_y + cols, mean.to(y_ptr.dtype.element_ty), mask=mask)


def gate_mix(x: torch.Tensor, gate: torch.Tensor, hc_count: int) -> torch.Tensor:
    """``(sigmoid(gate) * x).unflatten(-1, (hc_count, -1)).mean(-2)`` with torch's roundings: one
    kernel for bf16 (the served dtype), the torch ops themselves for float16 and float32."""
    if x.dtype != torch.bfloat16 or gate.dtype != torch.bfloat16:
        return gate_mix_reference(x, gate, hc_count)
    rows, dim = gate.shape
    if x.shape != gate.shape or dim % hc_count or x.stride(1) != 1 or gate.stride(1) != 1:
        raise ValueError(
            f"gate mix needs row-major x and gate of one shape [T, hc * H]: got {tuple(x.shape)}, "
            f"{tuple(gate.shape)}, hc_count {hc_count}"
        )
    hc_dim = dim // hc_count
    out = x.new_empty(rows, hc_dim)
    if rows:
        grid = (rows, triton.cdiv(hc_dim, BLOCK_SIZE))
        _gate_mix_kernel[grid](
            x, gate, out, x.stride(0), gate.stride(0), out.stride(0), hc_dim, hc_count, BLOCK_SIZE
        )
    return out


def gate_mix_reference(x: torch.Tensor, gate: torch.Tensor, hc_count: int) -> torch.Tensor:
    """The same in torch ops, as transformers' ``Qwen4ExpTextGatedResidual`` writes it."""
    mixed = torch.sigmoid(gate).unflatten(-1, (hc_count, -1)) * x.unflatten(-1, (hc_count, -1))
    return mixed.mean(dim=-2)


def _gate_mix_fake(x: torch.Tensor, gate: torch.Tensor, hc_count: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], x.shape[1] // hc_count))


def _register_op() -> None:
    from vllm.utils.torch_utils import direct_register_custom_op

    if not hasattr(torch.ops.vllm, OP_NAME):
        direct_register_custom_op(op_name=OP_NAME, op_func=gate_mix, fake_impl=_gate_mix_fake)


def _gate_mix_op(x: torch.Tensor, gate: torch.Tensor, hc_count: int) -> torch.Tensor:
    return getattr(torch.ops.vllm, OP_NAME)(x, gate, hc_count)


def install() -> None:
    """Route upstream's hyper-connection gate mix through :func:`gate_mix`; idempotent. Fails
    closed if upstream's module no longer calls ``hc_gate_mix`` by that name."""
    from vllm.models.qwen4_exp.nvidia import hyperconnection

    if getattr(hyperconnection, "hc_gate_mix", None) is _gate_mix_op:
        return
    if not hasattr(hyperconnection, "hc_gate_mix"):
        raise RuntimeError(
            "vLLM's qwen4_exp hyperconnection module no longer imports hc_gate_mix, so its gate mix "
            "cannot be given the reference's rounding: re-check model/upstream/hc_mix.py"
        )
    _register_op()
    hyperconnection.hc_gate_mix = _gate_mix_op
