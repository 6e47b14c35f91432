"""Short GDN prefills in one recurrent kernel launch, on the Triton path an RTX 3090 takes.

Why: with ``gdn_prefill_backend=triton`` (the only GDN prefill an sm_86 card has) upstream runs every
prefill of its Gated DeltaNet layers through FLA's chunked algorithm, about eight Triton launches a
layer whatever the length. A prefix-cache hit computes only the few tokens after the cached block
boundary (48 with the ``real-compute`` preset's 272-token blocks), and there those launches are the
cost: the torch profile of such a hit on the H200 (30 GDN layers) spent
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

Measured on an H200: against the chunked kernel and an fp32 recurrence with real
head sizes, the recurrent kernel's outputs are as close or closer (state error 1e-7 against 4e-3);
upstream's prefix-cache parity test passes with it (eager and CUDA graphs, 3/3 tokens of a cold
engine); a cache hit's 48-token step fell from 71-81 ms to 33-50 ms of floor on that host. On by
default (``QWEN4EXP_GDN_SHORT_PREFILL``); :func:`set_enabled` switches it at run time, so a benchmark
can time both paths in one engine.

A batch of prefills only (a cache hit's step) goes one step further, in the layer's
``_forward_core``: after upstream's causal convolution, FLA's fused *gating* recurrent kernel (the
one upstream runs for decodes) computes the gates and L2 norms itself and reads and writes the
sequences' state slots in place, so the separate gating launch, the gather of the initial states,
zeroing new sequences' states and the scatter of the final ones (four to six launches and their
host time per layer, 30 layers) collapse into one index fill and one launch (the H200 profile's
profile of a hit put about a third of each GDN layer's ~1 ms host time in those steps). Measured in
an H200 (``bench_prefix_cache.py --gdn-ab``, one engine): a repeated 8k prefix 5.3x faster on
the wall clock (5.6x in the engine), 4.0x with the short path off. Mixed batches (decodes
with prefills, speculative decoding) keep upstream's method with the recurrent call above.
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
    # spare leading row, left uninitialised. The step is host-bound (on an H200: 12 ms of GPU
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


_TABLES = "_qwen4exp_slot_tables"  # attribute of a step's GDN metadata object holding its tables


def build_tables(
    state_indices: torch.Tensor, has_initial_state: torch.Tensor, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The slot table (``[N, num_tokens]`` int32, row ``i`` all sequence ``i``'s state slot) and the
    slots to zero first (a new sequence's slot; ``0``, vLLM's null block, for the others)."""
    slots = state_indices.to(torch.int32)
    table = slots[:, None].expand(-1, num_tokens).contiguous()
    fresh = torch.where(has_initial_state, 0, state_indices).long()  # index_fill_ wants int64
    return table, fresh


def _tables(metadata, state_indices, has_initial_state, num_tokens) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`build_tables`, kept on the step's metadata object so that the GDN layers sharing it
    build them once (vLLM's GDN builder makes a new object every step and never changes one). The
    an H200 profile built them in all 30 layers (~0.13-0.26 ms of host time each under the
    profiler) with a one-entry cache: consecutive GDN layers do not share one metadata object
    (presumably one per KV-cache group, the layers alternating between the groups; not verified).
    Without metadata (a direct call) nothing is kept."""
    if metadata is None:
        return build_tables(state_indices, has_initial_state, num_tokens)
    tables = getattr(metadata, _TABLES, None)
    if tables is None:
        tables = build_tables(state_indices, has_initial_state, num_tokens)
        setattr(metadata, _TABLES, tables)
    return tables


def gated_delta_in_place(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_state: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    metadata: object = None,
) -> torch.Tensor:
    """A short prefill batch's gated delta rule straight on vLLM's state cache; returns ``o``.

    ``q, k`` ``[1, T, H, K]`` (not yet normalised), ``v`` ``[1, T, HV, V]`` as
    ``rearrange_mixed_qkv`` gives them after the convolution; ``a, b`` ``[T, HV]`` the raw gate
    inputs; ``ssm_state`` the layer's ``[slots, HV, V, K]`` cache, updated in place at
    ``state_indices`` (one slot per sequence, ``cu_seqlens`` ``[N + 1]``); a sequence without
    ``has_initial_state`` starts from zeros, as upstream's chunked call does. The kernel computes
    ``g = -exp(A_log) softplus(a + dt_bias)``, ``beta = sigmoid(b)`` and the L2 norms in fp32 (upstream's
    separate gating launch rounds q and k to bf16 first) and steps the recurrence token by token,
    storing each token's state in its sequence's slot, so the last one stays. ``metadata``: the step's
    metadata object, to build the slot tables once for the layers sharing it (:func:`_tables`). No
    host sync.
    """
    from vllm.third_party.flash_linear_attention.ops.fused_sigmoid_gating import (
        fused_sigmoid_gating_delta_rule_update,
    )

    num_tokens = q.shape[1]
    table, fresh = _tables(metadata, state_indices, has_initial_state, num_tokens)
    ssm_state.index_fill_(0, fresh, 0)  # slot 0 is vLLM's null block: no sequence reads it
    o, _ = fused_sigmoid_gating_delta_rule_update(
        A_log=A_log,
        a=a,
        b=b,
        dt_bias=dt_bias,
        q=q,
        k=k,
        v=v,
        initial_state=ssm_state,
        inplace_final_state=True,
        cu_seqlens=cu_seqlens,
        ssm_state_indices=table,
        use_qk_l2norm_in_kernel=True,
    )
    return o


def takes_in_place_path(layer: object, metadata: object) -> bool:
    """Whether a GDN layer's step is a batch of short prefills only, on the Triton prefill backend,
    that :func:`short_prefill_core` computes; everything else keeps upstream's ``_forward_core``.
    Host-side fields only (no sync); a field upstream renamed fails here, loudly."""
    return (
        _enabled
        and metadata is not None
        and layer.gdn_prefill_backend == "triton"
        and metadata.spec_sequence_masks is None
        and metadata.num_decodes == 0
        and metadata.num_prefills > 0
        and metadata.num_prefill_tokens == metadata.num_actual_tokens <= short_prefill_limit()
        and metadata.prefill_state_indices is not None
        and metadata.prefill_has_initial_state is not None
        and metadata.prefill_query_start_loc is not None
    )


def short_prefill_core(layer, mixed_qkv, b, a, core_attn_out, metadata) -> None:
    """What upstream's ``_forward_core`` does for a batch of short prefills, in fewer launches:
    its causal convolution (the same call), then :func:`gated_delta_in_place` instead of its gating
    launch, state gather, chunked kernel and state scatter."""
    from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn as gdn
    from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_fn

    conv_state, ssm_state = layer.kv_cache[0], layer.kv_cache[1]
    if not gdn.is_conv_state_dim_first():
        conv_state = conv_state.transpose(-1, -2)  # the conv kernel wants (..., dim, width - 1)
    num_tokens = metadata.num_actual_tokens
    weight = layer.conv1d.weight
    conv_out = causal_conv1d_fn(
        mixed_qkv[:num_tokens].transpose(0, 1),
        weight.view(weight.size(0), weight.size(2)),
        layer.conv1d.bias,
        activation=layer.activation,
        conv_states=conv_state,
        has_initial_state=metadata.has_initial_state,
        cache_indices=metadata.non_spec_state_indices_tensor,
        query_start_loc=metadata.non_spec_query_start_loc,
        metadata=metadata,
    ).transpose(0, 1)
    q, k, v = layer.rearrange_mixed_qkv(conv_out)
    o = gated_delta_in_place(
        q,
        k,
        v,
        a[:num_tokens],
        b[:num_tokens],
        layer.A_log,
        layer.dt_bias,
        ssm_state,
        metadata.prefill_state_indices,
        metadata.prefill_has_initial_state,
        metadata.prefill_query_start_loc,
        metadata=metadata,
    )
    core_attn_out[:num_tokens] = o.squeeze(0)


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
            "model/upstream/gdn.py against vllm/model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py"
        )

    _install_core()  # first: it may refuse, and then nothing is patched
    cls.forward_native = forward_native
    setattr(cls, _PATCHED, True)
    logger.info(
        "GDN prefills of up to %d tokens run FLA's recurrent kernels, steps of prefills only in place on "
        "the state cache (model/upstream/gdn.py)",
        limit,
    )
    return True


def _install_core() -> None:
    """Route upstream's ``QwenGatedDeltaNetAttention._forward_core`` to :func:`short_prefill_core`
    for the batches :func:`takes_in_place_path` accepts. Fails closed on a changed signature."""
    import inspect

    from vllm.forward_context import get_forward_context
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention

    cls = QwenGatedDeltaNetAttention
    original = cls._forward_core
    warmed = False

    def _forward_core(self, mixed_qkv, b, a, core_attn_out):
        nonlocal warmed
        raw = get_forward_context().attn_metadata
        metadata = raw.get(self.prefix) if isinstance(raw, dict) else None
        if takes_in_place_path(self, metadata):
            return short_prefill_core(self, mixed_qkv, b, a, core_attn_out, metadata)
        if (
            metadata is None
            and not warmed
            and self.gdn_prefill_backend == "triton"
            and mixed_qkv.shape[0] >= 8
        ):
            # Upstream's start-up run (no metadata) compiles its prefill kernels: compile this
            # path's kernel too, on a scratch state, so a first cache hit does not wait for it.
            warmed = True
            _warm_up(self, mixed_qkv, b, a)
        return original(self, mixed_qkv, b, a, core_attn_out)

    if list(inspect.signature(original).parameters) != ["self", "mixed_qkv", "b", "a", "core_attn_out"]:
        raise RuntimeError(
            "vLLM's QwenGatedDeltaNetAttention._forward_core changed its parameters; re-check "
            "model/upstream/gdn.py against vllm/model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py"
        )
    cls._forward_core = _forward_core


def _warm_up(layer, mixed_qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor) -> None:
    """One :func:`gated_delta_in_place` call of 8 tokens on a zeroed two-slot state of the layer's
    state shape and dtype (slot 1 used, slot 0 the null block)."""
    _, state_shape = layer.get_state_shape()[:2]
    state = torch.zeros((2, *state_shape), dtype=layer.get_state_dtype()[1], device=mixed_qkv.device)
    q, k, v = layer.rearrange_mixed_qkv(mixed_qkv[:8])
    one = torch.ones(1, dtype=torch.int32, device=mixed_qkv.device)
    gated_delta_in_place(
        q, k, v, a[:8], b[:8], layer.A_log, layer.dt_bias, state,
        one, one.bool(), torch.tensor([0, 8], dtype=torch.int32, device=mixed_qkv.device),
    )  # fmt: skip
