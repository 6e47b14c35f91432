"""``model.upstream.gdn`` on the CPU: FLA's recurrent kernel (Triton, interpreted) gives
the plain-torch gated delta rule for the batches a prefix-cache hit sends, and the patched
``ChunkGatedDeltaRule`` sends only batches shorter than one FLA chunk there.

The kernel runs in a child process (``tests/upstream/gdn_short_prefill_cases.py``): it must import
FLA with an interpreted Triton, which a pytest process that already imported vLLM cannot do. The GPU
judge against FLA's chunked kernel is ``tests/gpu/test_gdn_short_prefill.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.fixture(scope="module")
def found() -> dict:
    run = subprocess.run(
        [sys.executable, "-m", "tests.upstream.gdn_short_prefill_cases"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", ["hit_tail", "one_token", "mixed", "limit"])
def test_recurrent_prefill_is_the_gated_delta_rule(found, case):
    result = found["cases"][case]
    print(case, result)
    assert result["out_err"] < 1e-5 and result["state_err"] < 1e-5, result
    assert result["initial_untouched"], "the caller's gathered states must not be written"


@pytest.mark.parametrize("case", ["hit_tail", "cold_short", "mixed", "limit"])
def test_in_place_path_is_the_gated_delta_rule_on_the_state_cache(found, case):
    """Gates and norms from the raw inputs, states read from and written to their slots (zeros for a
    sequence without one, a padded row on the null block left alone), other slots untouched."""
    result = found["in_place"][case]
    print(case, result)
    assert result["out_err"] < 1e-5 and result["state_err"] < 1e-5, result


def test_in_place_path_shares_one_steps_tables_between_layers(found):
    """Layers alternating between two KV-cache groups' metadata objects in one step, then a new
    step's objects: every layer gets the rule on its own group's slots, and the tables are built once
    per object (2 + 2), not once per layer (6)."""
    assert found["in_place"]["shared_step_err"] < 1e-5, found["in_place"]["shared_step_err"]
    assert found["in_place"]["tables_built"] == 4, found["in_place"]["tables_built"]


def test_gdn_metadata_can_keep_the_slot_tables():
    """The in-place path keeps a step's slot tables on vLLM's GDN metadata object: a frozen or
    slotted dataclass would refuse the attribute."""
    import dataclasses

    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

    assert dataclasses.is_dataclass(GDNAttentionMetadata)
    assert not GDNAttentionMetadata.__dataclass_params__.frozen
    assert "__slots__" not in GDNAttentionMetadata.__dict__


def test_in_place_path_takes_only_short_prefill_batches():
    """Host-side fields decide: prefills only, no speculative decoding, within one FLA chunk, on the
    Triton prefill backend, switched on."""
    from types import SimpleNamespace

    from model.upstream import gdn as upstream_gdn

    layer = SimpleNamespace(gdn_prefill_backend="triton")
    tensor = object()

    def metadata(**changes):
        fields = dict(
            spec_sequence_masks=None, num_decodes=0, num_prefills=1, num_prefill_tokens=48,
            num_actual_tokens=48, prefill_state_indices=tensor, prefill_has_initial_state=tensor,
            prefill_query_start_loc=tensor,
        )  # fmt: skip
        return SimpleNamespace(**{**fields, **changes})

    limit = upstream_gdn.short_prefill_limit()
    assert upstream_gdn.takes_in_place_path(layer, metadata())
    assert upstream_gdn.takes_in_place_path(
        layer, metadata(num_prefill_tokens=limit, num_actual_tokens=limit)
    )
    refused = [
        metadata(num_prefill_tokens=limit + 1, num_actual_tokens=limit + 1),
        metadata(num_decodes=1, num_actual_tokens=49),
        metadata(spec_sequence_masks=tensor),
        metadata(num_prefills=0),
        metadata(prefill_state_indices=None),
        None,
    ]
    for case in refused:
        assert not upstream_gdn.takes_in_place_path(layer, case), case
    assert not upstream_gdn.takes_in_place_path(SimpleNamespace(gdn_prefill_backend="flashinfer"), metadata())
    previous = upstream_gdn.set_enabled(False)
    try:
        assert not upstream_gdn.takes_in_place_path(layer, metadata())
    finally:
        upstream_gdn.set_enabled(previous)


def test_a_shape_seen_before_gives_the_rule_again(found):
    assert found["repeat_shape_err"] < 1e-5, found["repeat_shape_err"]


def test_shapes_are_the_chunked_calls(found):
    o_shape, state_shape = found["cases"]["mixed"]["shapes"]
    assert o_shape == [1, 15, 4, 16] and state_shape == [3, 4, 16, 16]


def test_install_routes_short_batches_and_is_idempotent(found):
    assert found["installed"] is True and found["installed_again"] is False
    assert found["patched_short_err"] < 1e-5


def test_a_full_chunk_keeps_the_chunked_kernel(found):
    frames = found["long_path"]
    assert frames != "ran", "the chunked kernel cannot run on a CPU: the call should have failed inside it"
    assert "chunk.py" in frames and "fused_recurrent.py" not in frames[frames.index("chunk.py") :], frames


def test_switched_off_at_run_time_short_batches_take_the_chunked_kernel(found):
    assert found["was_enabled"] is True
    frames = found["disabled_short_path"]
    assert frames != "ran", "the chunked kernel cannot run on a CPU: the call should have failed inside it"
    assert "chunk.py" in frames and "fused_recurrent.py" not in frames, frames


def test_on_by_default_and_switched_off_by_zero():
    """Measured on the H200 before it became the default (docs/benchmarks.md); ``0`` turns it off."""
    from model.runtime import envs

    assert envs.read(envs.GDN_SHORT_PREFILL, {}) is True
    assert envs.read(envs.GDN_SHORT_PREFILL, {envs.GDN_SHORT_PREFILL: "0"}) is False


def test_install_refuses_a_changed_upstream_signature(monkeypatch):
    """The wrapper passes upstream's parameters on by position: a method with other parameters (here
    one more) must stop the patch, not be called wrongly."""
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import ChunkGatedDeltaRule

    from model.upstream import gdn as upstream_gdn

    original = ChunkGatedDeltaRule.forward_native

    def changed(self, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens=None, extra=None):
        return original(self, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens)

    monkeypatch.setattr(ChunkGatedDeltaRule, "forward_native", changed)
    monkeypatch.delattr(ChunkGatedDeltaRule, upstream_gdn._PATCHED, raising=False)
    with pytest.raises(RuntimeError, match="forward_native changed its parameters"):
        upstream_gdn.install()
    assert ChunkGatedDeltaRule.forward_native is changed


def test_install_refuses_a_changed_forward_core_and_patches_nothing(monkeypatch):
    """The in-place path wraps ``QwenGatedDeltaNetAttention._forward_core`` and calls it positionally:
    another signature stops the install before either method is replaced."""
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
        ChunkGatedDeltaRule,
        QwenGatedDeltaNetAttention,
    )

    from model.upstream import gdn as upstream_gdn

    def changed(self, mixed_qkv, b, a, core_attn_out, extra=None):
        raise AssertionError("never called")

    monkeypatch.setattr(QwenGatedDeltaNetAttention, "_forward_core", changed)
    monkeypatch.delattr(ChunkGatedDeltaRule, upstream_gdn._PATCHED, raising=False)
    native = ChunkGatedDeltaRule.forward_native
    with pytest.raises(RuntimeError, match="_forward_core changed its parameters"):
        upstream_gdn.install()
    assert QwenGatedDeltaNetAttention._forward_core is changed
    assert ChunkGatedDeltaRule.forward_native is native
