"""Short GDN prefills in one recurrent kernel launch, on the Triton path an RTX 3090 takes.

Why: with ``gdn_prefill_backend=triton`` (the only GDN prefill an sm_86 card has) upstream runs every
prefill of its Gated DeltaNet layers through FLA's chunked algorithm, about eight Triton launches a
layer whatever the length. A prefix-cache hit computes only the few tokens after the cached block
boundary (48 with the ``real-compute`` preset's 272-token blocks), and there those launches are the
cost: the torch profile of such a hit on the H200 (seventh H200 run, 2026-12-02, 30 GDN layers) spent
15 ms of its 45 ms host time in ``ChunkGatedDeltaRuleFunction`` against 0.9 ms of GPU time, and the
hit cost as much as a cold request of the same 48 tokens: the step's fixed cost, not the cache,
decided the prefix-cache speedup.

Below one FLA chunk (64 tokens in the whole prefill batch) the chunked algorithm works on a single
chunk anyway, so such batches go to FLA's fused recurrent kernel instead: one launch, the same
recurrence (state decayed by ``exp(g)``, delta-rule update with ``beta``, output ``h @ q * scale``)
stepped token by token in fp32, reading and writing vLLM's state slots exactly as the chunked call
does (the caller still gathers the initial states and stores the final ones). Longer prefills, and
upstream's start-up warm-up (exactly one chunk, so the chunked kernels are autotuned before the KV
cache takes the memory), keep the chunked path.

Measured (eighth H200 run, 2026-12-02): against the chunked kernel and an fp32 recurrence with real
head sizes, the recurrent kernel's outputs are as close or closer (state error 1e-7 against 4e-3);
upstream's prefix-cache parity test passes with it (eager and CUDA graphs, 3/3 tokens of a cold
engine); a cache hit's 48-token step fell from 71-81 ms to 33-50 ms of floor on that host. On by
default (``QWEN4EXP_GDN_SHORT_PREFILL``); :func:`set_enabled` switches it at run time, so a benchmark
can time both paths in one engine.
"""

from __future__ import annotations

import functools
import logging

import torch

# Under vLLM's logger namespace, so the engine's log says whether the patch is in.
logger = logging.getLogger("vllm.qwen4exp.upstream_gdn")

_PATCHED = "_qwen4exp_short_prefill_recurrent"
_enabled = True  # read at every call of the patched method; see set_enabled


def set_enabled(on: bool) -> bool:
    """Route short prefills to the recurrent kernel (``True``) or leave every prefill to upstream's
    chunked kernel, once installed; returns the previous setting. For benchmarks that time both
    paths in one engine (the GDN core runs outside CUDA graphs, so a switch takes effect at the next
    step). The recurrent kernel is compiled at start-up either way."""
    global _enabled
    previous, _enabled = _enabled, bool(on)
    return previous


def short_prefill_limit() -> int:
    """Largest prefill batch (tokens) that takes the recurrent kernel: one FLA chunk less one."""
    from vllm.third_party.flash_linear_attention.ops.utils import FLA_CHUNK_SIZE

    return FLA_CHUNK_SIZE - 1


@functools.lru_cache(maxsize=1024)
def _slot_table(num_seqs: int, num_tokens: int, device: torch.device) -> torch.Tensor:
    """``[num_seqs, num_tokens]`` int32, row ``i`` all ``i + 1``: built once per shape (at most 63
    tokens by a few sequences), since the kernel only reads it."""
    slots = torch.arange(1, num_seqs + 1, device=device, dtype=torch.int32)
    return slots[:, None].expand(num_seqs, num_tokens).contiguous()


def recurrent_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked prefill's result from FLA's fused recurrent kernel: ``(o, final_state)``.

    Shapes as upstream passes them to its chunked call: ``q, k`` ``[1, T, H, K]`` (already
    L2-normalised), ``v`` ``[1, T, HV, V]``, ``g`` (log decay) and ``beta`` ``[1, T, HV]``,
    ``initial_state`` ``[N, HV, V, K]`` (zeros where a sequence has no state yet), ``cu_seqlens``
    ``[N + 1]``. Returns ``o`` ``[1, T, HV, V]`` in ``q``'s dtype and the ``[N, HV, V, K]`` final
    states in ``initial_state``'s dtype. No host synchronisation: every size comes from shapes.
    """
    # FLA's forward itself, not its autograd wrapper (``fused_recurrent_gated_delta_rule``): the
    # engine never takes gradients, and at ~30 layers a step the wrapper's host time adds up.
    from vllm.third_party.flash_linear_attention.ops.fused_recurrent import (
        fused_recurrent_gated_delta_rule_fwd,
    )

    num_seqs, num_tokens = cu_seqlens.shape[0] - 1, q.shape[1]
    # The kernel reads and updates states in place through a slot table, one slot per (sequence,
    # token) since it was written for speculative decoding; every token of a sequence names the
    # sequence's slot. Slot 0 means vLLM's null block there (neither read nor written), hence one
    # spare leading row, left uninitialised. The step is host-bound (ninth H200 run: 12 ms of GPU
    # time in a 40 ms cache-hit step), so this costs one allocation and one copy per layer.
    states = initial_state.new_empty((num_seqs + 1, *initial_state.shape[1:]))
    states[1:].copy_(initial_state)
    o, states = fused_recurrent_gated_delta_rule_fwd(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        g.contiguous(),
        beta.contiguous(),
        scale=k.shape[-1] ** -0.5,  # what the wrapper defaults to, as the chunked call does
        initial_state=states,
        inplace_final_state=True,
        cu_seqlens=cu_seqlens,
        ssm_state_indices=_slot_table(num_seqs, num_tokens, q.device),
        num_accepted_tokens=None,
        use_qk_l2norm_in_kernel=False,
    )
    return o, states[1:]


def install() -> bool:
    """Route upstream's short Triton-path GDN prefills to :func:`recurrent_prefill`; idempotent.

    Patches ``ChunkGatedDeltaRule.forward_native`` (the method its constructor binds for the Triton
    backend), so it must run before the model is built. Returns whether it patched now. Fails closed
    if upstream's method no longer has the parameters this relies on."""
    import inspect

    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import ChunkGatedDeltaRule

    cls = ChunkGatedDeltaRule
    if getattr(cls, _PATCHED, False):
        return False
    original = cls.forward_native
    limit = short_prefill_limit()
    warmed = False

    def forward_native(
        self,
        q,
        k,
        v,
        g,
        beta,
        initial_state,
        output_final_state,
        cu_seqlens=None,
        chunk_indices=None,
        chunk_offsets=None,
        use_qk_l2norm_in_kernel=True,
        core_attn_out=None,
        aiter_prefill_metadata=None,
    ):
        nonlocal warmed
        fits = (
            q.shape[0] == 1 and cu_seqlens is not None and output_final_state and not use_qk_l2norm_in_kernel
        )
        if fits and _enabled and q.shape[1] <= limit:
            o, final_state = recurrent_prefill(q, k, v, g, beta, initial_state, cu_seqlens)
            if core_attn_out is not None:  # the chunked call's optional output buffer
                core_attn_out.reshape(-1)[: o.numel()].copy_(o.reshape(-1))
            return o, final_state
        if fits and not warmed:  # upstream's warm-up (one chunk): compile the recurrent kernel too
            warmed = True
            head = torch.tensor([0, 8], device=q.device, dtype=torch.int32)
            recurrent_prefill(q[:, :8], k[:, :8], v[:, :8], g[:, :8], beta[:, :8], initial_state[:1], head)
        return original(
            self, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens, chunk_indices,
            chunk_offsets, use_qk_l2norm_in_kernel, core_attn_out, aiter_prefill_metadata,
        )  # fmt: skip

    # The wrapper takes upstream's parameters by name and passes them on in order: refuse to patch
    # a method whose parameters are no longer exactly these.
    if inspect.signature(original).parameters.keys() != inspect.signature(forward_native).parameters.keys():
        raise RuntimeError(
            "vLLM's ChunkGatedDeltaRule.forward_native changed its parameters; re-check "
            "model/vllm_adapter/upstream_gdn.py against vllm/model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py"
        )

    cls.forward_native = forward_native
    setattr(cls, _PATCHED, True)
    logger.info(
        "GDN prefills of up to %d tokens run FLA's fused recurrent kernel (model/vllm_adapter/upstream_gdn.py)",
        limit,
    )
    return True
