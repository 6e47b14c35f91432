"""Cases for ``model.upstream.gdn``: a plain-torch gated delta rule and the batches the
short-prefill path meets, shared by the CPU test (FLA's recurrent kernel under Triton's interpreter,
in a child process: this file's ``__main__``) and the GPU judge (recurrent vs FLA's chunked kernel).

Run as ``python -m tests.upstream.gdn_short_prefill_cases``: prints one JSON line of findings.
vLLM's CPU build hands FLA a placeholder ``triton`` (its wheel has no CPU backend), so the child puts
the real ``triton`` (interpreted) behind ``vllm.triton_utils`` before FLA is imported, and gives FLA's
kernel an ``exp`` the interpreter can resolve (FLA binds ``tl.exp`` to a module global at import,
which the interpreter does not patch).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
import types

import torch


def reference(q, k, v, g, beta, initial_state, cu_seqlens) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence token by token in fp32: ``h <- h * exp(g)``, ``h <- h + beta (v - h k) k^T``,
    ``o = h q / sqrt(K)``; query/key head ``i`` serves value heads ``i * HV/H ...``."""
    num_tokens, heads, dim_k = q.shape[1:]
    value_heads, dim_v = v.shape[2:]
    out = torch.zeros(1, num_tokens, value_heads, dim_v, dtype=torch.float32, device=q.device)
    finals = []
    bounds = cu_seqlens.tolist()
    for n in range(len(bounds) - 1):
        h = initial_state[n].float().clone()
        for t in range(bounds[n], bounds[n + 1]):
            for hv in range(value_heads):
                hk = hv // (value_heads // heads)
                qt, kt = q[0, t, hk].float(), k[0, t, hk].float()
                h[hv] *= torch.exp(g[0, t, hv].float())
                delta = (v[0, t, hv].float() - h[hv] @ kt) * beta[0, t, hv].float()
                h[hv] += torch.outer(delta, kt)
                out[0, t, hv] = h[hv] @ qt * dim_k**-0.5
        finals.append(h)
    return out, torch.stack(finals)


def batch(lengths: list[int], device, dtype=torch.float32, heads=2, value_heads=4, dim=16, seed=0):
    """Inputs as upstream hands them to its chunked call: L2-normalised q/k, log-sigmoid decays,
    sigmoid betas, and initial states that are zero for a sequence without state (the first one
    with more than one token gets zeros, as a fresh request would)."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    q = torch.nn.functional.normalize(rand(1, total, heads, dim), dim=-1)
    k = torch.nn.functional.normalize(rand(1, total, heads, dim), dim=-1)
    v = rand(1, total, value_heads, dim)
    g = torch.nn.functional.logsigmoid(rand(1, total, value_heads) + 2)
    beta = torch.sigmoid(rand(1, total, value_heads))
    state = rand(len(lengths), value_heads, dim, dim) * 0.1
    state[0] = 0
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    tensors = [q.to(dtype), k.to(dtype), v.to(dtype), g, beta.to(dtype)]
    return [t.to(device) for t in tensors] + [state.to(device), cu.to(device)]


# (name, sequence lengths): one request's hit tail, a 1-token prefill, mixed batches, the limit.
CASES = [("hit_tail", [48]), ("one_token", [1]), ("mixed", [5, 1, 9]), ("limit", [40, 23])]

# For the in-place path: (name, lengths, whether each sequence has a state); a trailing 0-length
# sequence is a padded row on vLLM's null block (slot 0).
IN_PLACE_CASES = [
    ("hit_tail", [48], [True]),
    ("cold_short", [20], [False]),
    ("mixed", [5, 1, 9, 0], [True, False, True, False]),
    ("limit", [40, 23], [True, True]),
]


def raw_batch(lengths, has_state, device, dtype=torch.float32, heads=2, value_heads=4, dim=16, seed=0):
    """What upstream's ``_forward_core`` holds after its convolution, for :func:`gated_delta_in_place`:
    q/k/v as ``rearrange_mixed_qkv`` gives them (not normalised), the raw gate inputs ``a, b``
    ``[T, HV]``, ``A_log``/``dt_bias`` ``[HV]``, a state cache of ``len(lengths) + 3`` slots with
    random contents (slot 0 the null block), each real sequence on its own slot in a shuffled order
    (a padded sequence on slot 0), ``has_initial_state`` and ``cu_seqlens``."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    slots = len(lengths) + 3
    order = (torch.randperm(slots - 1, generator=gen) + 1)[: len(lengths)]
    indices = torch.tensor([int(order[i]) if n else 0 for i, n in enumerate(lengths)], dtype=torch.int32)
    batch_ = dict(
        q=rand(1, total, heads, dim).to(dtype),
        k=rand(1, total, heads, dim).to(dtype),
        v=rand(1, total, value_heads, dim).to(dtype),
        a=rand(total, value_heads).to(dtype),
        b=rand(total, value_heads).to(dtype),
        A_log=torch.log(torch.rand(value_heads, generator=gen) * 4 + 1),
        dt_bias=rand(value_heads),
        ssm_state=rand(slots, value_heads, dim, dim) * 0.1,
        state_indices=indices,
        has_initial_state=torch.tensor(has_state),
        cu_seqlens=torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32),
    )
    return {name: t.to(device) for name, t in batch_.items()}


def gates(inputs) -> tuple[torch.Tensor, ...]:
    """The post-convolution prep in fp32: L2-normalised q/k (eps 1e-6 inside the root, as both of
    upstream's kernels), ``g = -exp(A_log) softplus(a + dt_bias)``, ``beta = sigmoid(b)``."""

    def norm(x):
        x = x.float()
        return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)

    g = -torch.exp(inputs["A_log"].float()) * torch.nn.functional.softplus(
        inputs["a"].float() + inputs["dt_bias"].float()
    )
    beta = torch.sigmoid(inputs["b"].float())
    return norm(inputs["q"]), norm(inputs["k"]), inputs["v"].float(), g[None], beta[None]


def in_place_reference(inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o, state cache after)`` in fp32: each sequence from its slot's state (zeros without one),
    its final state written back to its slot; other slots as they were (slot 0 excepted: the path
    may write there, no one reads it)."""
    q, k, v, g, beta = gates(inputs)
    slots, has = inputs["state_indices"].long(), inputs["has_initial_state"]
    initial = inputs["ssm_state"][slots].float() * has[:, None, None, None]
    o, finals = reference(q, k, v, g, beta, initial, inputs["cu_seqlens"])
    after = inputs["ssm_state"].float().clone()
    lengths = inputs["cu_seqlens"].diff().tolist()
    for n, slot in enumerate(slots.tolist()):
        if lengths[n]:
            after[slot] = finals[n]
    return o, after


def _interpreted_fla():
    """FLA's recurrent kernel module (and its fused gating one) with the real Triton, interpreted (see the module docstring).
    vLLM itself is imported first with its own ``triton_utils``; only FLA's modules are re-imported
    behind the shim, which is then taken away again."""
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton is first imported
    import triton
    import triton.language as tl
    import triton.language.extra.libdevice as tldevice
    import vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn  # noqa: F401

    fla = "vllm.third_party.flash_linear_attention.ops"
    for name in [m for m in sys.modules if m.startswith(fla + ".")]:
        del sys.modules[name]
    shim = types.ModuleType("vllm.triton_utils")
    shim.triton, shim.tl, shim.tldevice, shim.HAS_TRITON = triton, tl, tldevice, True
    shim.LOG2E, shim.LOGE2 = 1.4426950408889634, 0.6931471805599453
    real = sys.modules["vllm.triton_utils"]
    sys.modules["vllm.triton_utils"] = shim
    try:
        import vllm.third_party.flash_linear_attention.ops.fused_recurrent as fused_recurrent
        import vllm.third_party.flash_linear_attention.ops.fused_sigmoid_gating  # noqa: F401
    finally:
        sys.modules["vllm.triton_utils"] = real
    fused_recurrent.exp = lambda x: tl.exp(x)
    return fused_recurrent


def _child() -> dict:
    _interpreted_fla()
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import ChunkGatedDeltaRule

    from model.upstream import gdn as upstream_gdn

    found: dict = {"cases": {}}
    for name, lengths in CASES:
        q, k, v, g, beta, state, cu = batch(lengths, "cpu")
        before = state.clone()
        o, final = upstream_gdn.recurrent_prefill(q, k, v, g, beta, state, cu)
        o_ref, final_ref = reference(q, k, v, g, beta, state, cu)
        found["cases"][name] = {
            "out_err": (o.float() - o_ref).abs().max().item(),
            "state_err": (final.float() - final_ref).abs().max().item(),
            "shapes": [list(o.shape), list(final.shape)],
            "initial_untouched": bool(torch.equal(state, before)),
        }
    # A shape met before, with other values (what every layer after the first sends): the slot
    # table built for that shape and the uninitialised spare state row change nothing.
    q, k, v, g, beta, state, cu = batch([5, 1, 9], "cpu", seed=7)
    o, final = upstream_gdn.recurrent_prefill(q, k, v, g, beta, state, cu)
    o_ref, final_ref = reference(q, k, v, g, beta, state, cu)
    found["repeat_shape_err"] = max((o - o_ref).abs().max().item(), (final - final_ref).abs().max().item())
    found["in_place"] = _in_place_findings(upstream_gdn)
    found["installed"] = upstream_gdn.install()
    found["installed_again"] = upstream_gdn.install()
    # Through the patched method, as upstream's layer calls it (positional, then keywords).
    q, k, v, g, beta, state, cu = batch([30, 12], "cpu")
    o, final = ChunkGatedDeltaRule.forward_native(
        None, q, k, v, g, beta, state, True, cu, None, None, use_qk_l2norm_in_kernel=False
    )
    o_ref, final_ref = reference(q, k, v, g, beta, state, cu)
    found["patched_short_err"] = max((o - o_ref).abs().max().item(), (final - final_ref).abs().max().item())
    # One FLA chunk or more keeps the chunked kernel.
    found["long_path"] = _path_taken(ChunkGatedDeltaRule, [64])
    # Switched off at run time (as the A/B benchmark does), a short batch takes the chunked kernel too.
    found["was_enabled"] = upstream_gdn.set_enabled(False)
    found["disabled_short_path"] = _path_taken(ChunkGatedDeltaRule, [30, 12])
    upstream_gdn.set_enabled(True)
    return found


def _in_place_findings(upstream_gdn) -> dict:
    """``gated_delta_in_place`` (FLA's fused gating kernel, interpreted) against the fp32 rule."""
    found = {}
    for name, lengths, has_state in IN_PLACE_CASES:
        inputs = raw_batch(lengths, has_state, "cpu")
        o_ref, after_ref = in_place_reference(inputs)
        state = inputs["ssm_state"]
        o = upstream_gdn.gated_delta_in_place(**inputs)
        found[name] = {
            "out_err": (o.float() - o_ref).abs().max().item(),
            "state_err": (state[1:].float() - after_ref[1:]).abs().max().item(),
            "out_shape": list(o.shape),
        }
    # Layers of one step alternating between two metadata objects (two KV-cache groups with other
    # slots), then a new step (vLLM builds new metadata objects every step) whose group A has other
    # slots: each layer must get its own group's tables, built once per object.
    built = []
    real_build = upstream_gdn.build_tables

    def counting(*args):
        built.append(args[2])
        return real_build(*args)

    results = []
    upstream_gdn.build_tables = counting
    try:
        for slots in ({"A": [4, 2, 5, 0], "B": [1, 6, 3, 0]}, {"A": [2, 5, 4, 0], "B": [1, 6, 3, 0]}):
            groups = {
                name: types.SimpleNamespace(
                    state_indices=torch.tensor(ids, dtype=torch.int32),
                    has_initial_state=torch.tensor([True, False, True, False]),
                )
                for name, ids in slots.items()
            }
            for layer, name in enumerate("ABAB" if slots["A"][0] == 4 else "BA"):
                inputs = raw_batch([5, 1, 9, 0], [True, False, True, False], "cpu", seed=layer)
                inputs["state_indices"] = groups[name].state_indices
                inputs["has_initial_state"] = groups[name].has_initial_state
                o_ref, after_ref = in_place_reference(inputs)
                state = inputs["ssm_state"]
                o = upstream_gdn.gated_delta_in_place(**inputs, metadata=groups[name])
                results.append(
                    max((o - o_ref).abs().max().item(), (state[1:] - after_ref[1:]).abs().max().item())
                )
    finally:
        upstream_gdn.build_tables = real_build
    found["shared_step_err"] = max(results)
    found["tables_built"] = len(built)
    return found


def _path_taken(chunk_rule, lengths: list[int]) -> str | list[str]:
    """The source files on the stack where a patched call failed, or "ran". The chunked kernel
    cannot run on this CPU, so where it failed says which path the call took."""
    q, k, v, g, beta, state, cu = batch(lengths, "cpu", dtype=torch.bfloat16)
    try:
        chunk_rule.forward_native(None, q, k, v, g, beta, state, True, cu, use_qk_l2norm_in_kernel=False)
        return "ran"
    except Exception:
        frames = traceback.extract_tb(sys.exc_info()[2])
        return [os.path.basename(f.filename) for f in frames]


if __name__ == "__main__":
    print(json.dumps(_child()))
