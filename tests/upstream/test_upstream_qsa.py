"""Our FP8 QSA path on upstream's QSA layer (``model.upstream.qsa``), on the CPU.

What runs here: the glue between upstream's cache layout / packed selection and our encoder, scales,
statistics and reference reader, against loops written from the definition; our impl's two methods
and the owner's post-load hook on objects built without upstream's CUDA constructors; and the
rebinding ``install()`` does. What needs the GPU (``tests/gpu/test_upstream_cuda.py``): the whole
engine with vLLM's CUDA build, our Triton kernel inside it (its reading of this layout is checked
under Triton's interpreter in ``tests/kernels/test_qsa_sparse_attention.py``).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from model.ops.fp8_e4m3 import decode_e4m3, encode_e4m3
from model.qsa_kv import state as state_mod
from model.qsa_kv.runtime import QSAKVRuntime
from model.qsa_kv.settings import FP8_E4M3, QSAKVSettings
from model.qsa_kv.state import QSAKVState
from model.upstream import qsa_glue as glue
from tests.upstream.importer import import_upstream

LAYER = "model.layers.3.self_attn"
HEADS, PAGE, DIM, BLOCKS = 2, 8, 16, 5
GEN = torch.Generator().manual_seed(0)


@pytest.fixture
def runtime(monkeypatch):
    """A private QSA KV runtime (metrics, readers) instead of the process-wide one."""
    rt = QSAKVRuntime()
    monkeypatch.setattr(state_mod, "get_runtime", lambda: rt)
    yield rt
    rt.stop()


def fp8_state(tmp_path, k_scale=0.05, v_scale=0.02, clip=True, layer=LAYER) -> QSAKVState:
    sidecar = tmp_path / "scales.json"
    sidecar.write_text(json.dumps({layer: {"k_scale": k_scale, "v_scale": v_scale}}))
    settings = QSAKVSettings(scales_path=sidecar, clip_interval_s=3600.0 if clip else None)
    st = QSAKVState(
        layer_name=layer, kv_format=FP8_E4M3, settings=settings, expected_layers=[layer], eager=True
    )
    st.apply()
    return st


def upstream_cache() -> torch.Tensor:
    """Upstream's bound QSA cache: ``[blocks, kv_heads, page, 2*D]`` uint8, random old content."""
    return torch.randint(0, 255, (BLOCKS, HEADS, PAGE, 2 * DIM), generator=GEN, dtype=torch.uint8)


def test_write_stores_our_codes_in_upstream_layout_and_skips_padding(tmp_path, runtime):
    st = fp8_state(tmp_path)
    cache = upstream_cache()
    before = cache.clone()
    key = torch.randn(6, HEADS, DIM, generator=GEN) * 2  # 6 padded rows
    value = torch.randn(6, HEADS, DIM, generator=GEN) * 2
    key[0, 0, 0] = 100.0  # clips: 100 / 0.05 > 448
    slots = torch.tensor([9, 17, -1, 39, 8])  # 5 real rows (one of them padding), the 6th row has no slot
    glue.write_kv(st, key.bfloat16(), value.bfloat16(), cache, slots)

    written = set()
    for row, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        block, off = divmod(slot, PAGE)
        written.add((block, off))
        for h in range(HEADS):
            want_k = encode_e4m3(key[row, h].bfloat16(), st.k_scale)
            want_v = encode_e4m3(value[row, h].bfloat16(), st.v_scale)
            assert torch.equal(cache[block, h, off, :DIM], want_k), (row, h)
            assert torch.equal(cache[block, h, off, DIM:], want_v), (row, h)
    for block in range(BLOCKS):
        for off in range(PAGE):
            if (block, off) not in written:
                assert torch.equal(cache[block, :, off], before[block, :, off]), (block, off)
    # Statistics: the kept rows only (rows 0, 1, 3, 4), with the layer's scales.
    kept = key[[0, 1, 3, 4]].bfloat16().float()
    want_clips = int(((kept / 0.05).abs() > 448).sum())
    assert want_clips >= 1
    assert st.clip_counts.tolist()[0] == want_clips


def test_attend_matches_the_definition_with_packed_selection_and_gate(tmp_path, runtime):
    st = fp8_state(tmp_path, k_scale=0.5, v_scale=0.25)
    cache = upstream_cache()
    block_table = torch.tensor([[3, 1, 4], [2, 0, 0]], dtype=torch.int32)
    token_to_req = torch.tensor([0, 1, 0], dtype=torch.int32)
    width = 10
    selected = torch.full((3, width), -1, dtype=torch.int32)
    selected[0, :7] = torch.tensor([0, 5, 9, 12, 17, 20, 23])
    selected[1, :3] = torch.tensor([1, 2, 7])
    counts = torch.tensor([7, 3, 0], dtype=torch.int32)
    packed = torch.cat([selected, counts.unsqueeze(1)], dim=1)
    q = torch.randn(3, 2 * HEADS, DIM, generator=GEN).bfloat16()
    gate = torch.randn(3, 2 * HEADS * DIM, generator=GEN).bfloat16()
    scale = DIM**-0.5
    out = glue.attend_fp8(st, q, cache, block_table, token_to_req, packed, scale, gate)

    want = torch.zeros(3, 2 * HEADS, DIM, dtype=torch.float64)
    for t in range(3):
        req = int(token_to_req[t])
        positions = selected[t, : int(counts[t])].tolist()
        for h in range(2 * HEADS):
            hk = h // 2
            ks, vs = [], []
            for p in positions:
                page = int(block_table[req, p // PAGE])
                row = cache[page, hk, p % PAGE]
                ks.append(decode_e4m3(row[:DIM], torch.float64) * 0.5)
                vs.append(decode_e4m3(row[DIM:], torch.float64) * 0.25)
            if ks:
                logits = torch.stack(ks) @ q[t, h].double() * scale
                want[t, h] = torch.softmax(logits, 0) @ torch.stack(vs)
    want = want.to(torch.bfloat16).double() * torch.sigmoid(gate.view(3, 2 * HEADS, DIM).double())
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)
    assert torch.count_nonzero(out[2]) == 0


def test_gate_rounds_attention_to_bf16_before_gating():
    attention = torch.tensor([[1.00390625 + 2**-12]], dtype=torch.float32)  # not a bf16 value
    gate = torch.zeros(1, 1)
    got = glue.gate_attention_output(attention, gate)
    assert got.item() == (attention.to(torch.bfloat16).float() * 0.5).to(torch.bfloat16).item()


def test_unfused_prepare_only_where_k_and_v_must_be_tensors(tmp_path, runtime):
    assert glue.needs_unfused_prepare(fp8_state(tmp_path, clip=False))
    plain = QSAKVState(
        layer_name=LAYER, kv_format="bf16", settings=QSAKVSettings(), expected_layers=[LAYER], eager=True
    )
    assert not glue.needs_unfused_prepare(plain)
    collecting = QSAKVState(
        layer_name=LAYER,
        kv_format="bf16",
        settings=QSAKVSettings(collect_dir=tmp_path / "dumps"),
        expected_layers=[LAYER],
        eager=True,
    )
    assert glue.needs_unfused_prepare(collecting)


def test_checkpoint_scales_must_agree_with_the_served_ones(tmp_path, runtime):
    st = fp8_state(tmp_path, k_scale=0.05, v_scale=0.02)
    glue.reconcile_checkpoint_scales(LAYER, 1.0, 1.0, st)  # no checkpoint scales
    glue.reconcile_checkpoint_scales(LAYER, 0.05, 0.02, st)  # the same numbers
    with pytest.raises(
        ValueError, match=r"model.layers.3.self_attn: the checkpoint's K/V cache scales .*VLLM_QSA_KV_SCALES"
    ):
        glue.reconcile_checkpoint_scales(LAYER, 0.1, 0.02, st)
    plain = QSAKVState(
        layer_name=LAYER, kv_format="bf16", settings=QSAKVSettings(), expected_layers=[LAYER], eager=True
    )
    with pytest.raises(ValueError, match="the KV cache is not FP8; fix: --kv-cache-dtype fp8"):
        glue.reconcile_checkpoint_scales(LAYER, 0.1, 0.1, plain)
    # vLLM's dummy loader draws every parameter at random, these scales too: no checkpoint to reconcile.
    glue.reconcile_checkpoint_scales(LAYER, -0.0007, -0.0007, plain, dummy_weights=True)
    glue.reconcile_checkpoint_scales(LAYER, -0.0007, 0.3, st, dummy_weights=True)


# ---- the classes, on upstream's real base classes --------------------------------------------------


@pytest.fixture(scope="module")
def upstream_qsa():
    return import_upstream("model.upstream.qsa")


def test_impl_methods_write_and_read_through_our_fp8_path(tmp_path, runtime, upstream_qsa):
    st = fp8_state(tmp_path, k_scale=0.5, v_scale=0.25)
    # Upstream's constructor probes FlashAttention (CUDA); the two methods use only these attributes.
    impl = object.__new__(upstream_qsa.Sm86FP8QSAImpl)
    impl.kv_state, impl.head_size, impl.scale = st, DIM, DIM**-0.5
    cache = torch.zeros(BLOCKS, HEADS, PAGE, 2 * DIM, dtype=torch.uint8)
    key = torch.randn(4, HEADS, DIM, generator=GEN).bfloat16()
    value = torch.randn(4, HEADS, DIM, generator=GEN).bfloat16()
    impl.do_kv_cache_update(None, key, value, cache, torch.tensor([8, 9, 10, 11]))
    assert torch.equal(cache[1, 0, :4, :DIM], encode_e4m3(key[:, 0], st.k_scale))

    packed = torch.full((4, 5), -1, dtype=torch.int32)
    packed[:, 0], packed[:, 1], packed[:, 4] = 0, 1, 2  # every token reads positions 0 and 1
    layer = SimpleNamespace(topk_indices_buffer=torch.cat([packed, packed]))  # longer than the batch
    metadata = SimpleNamespace(num_actual_tokens=3, block_table=torch.tensor([[1, 2]], dtype=torch.int32))
    query = torch.randn(4, 2 * HEADS, DIM, generator=GEN).bfloat16()
    gate = torch.randn(4, 2 * HEADS * DIM, generator=GEN).bfloat16()
    output = torch.full((4, 2 * HEADS, DIM), 7.0, dtype=torch.bfloat16)
    token_to_req = torch.zeros(4, dtype=torch.int32)
    impl.forward_qsa(layer, query, None, None, cache, metadata, output, token_to_req, False, gate)
    want = glue.attend_fp8(
        st, query[:3], cache, metadata.block_table, token_to_req[:3], packed[:3], DIM**-0.5, gate[:3]
    )
    assert torch.equal(output[:3], want)
    assert torch.count_nonzero(output[3]) == 0  # rows past the batch are zeroed, as upstream does
    with pytest.raises(NotImplementedError, match="fused output quantization"):
        impl.forward_qsa(
            layer, query, None, None, cache, metadata, output, token_to_req, False, gate, torch.ones(1)
        )


def test_owner_post_load_hook_gives_every_reader_the_sidecar_scales(tmp_path, runtime, upstream_qsa):
    from vllm.model_executor.layers.attention.attention import set_default_quant_scales

    st = fp8_state(tmp_path, k_scale=0.05, v_scale=0.02)
    owner = object.__new__(upstream_qsa.Qwen4ExpQSAAttentionSm86)
    nn.Module.__init__(owner)
    set_default_quant_scales(owner, register_buffer=True)
    owner.kv_state = st
    owner.process_weights_after_loading(torch.bfloat16)
    assert owner._k_scale.item() == pytest.approx(0.05) and owner._v_scale.item() == pytest.approx(0.02)
    assert (owner._k_scale_float, owner._v_scale_float) == (0.05, 0.02)
    assert owner._k_scale_cpu.item() == pytest.approx(0.05) and owner._v_scale_cpu.item() == pytest.approx(
        0.02
    )
    assert st.k_scale.item() == pytest.approx(0.05)

    other = object.__new__(upstream_qsa.Qwen4ExpQSAAttentionSm86)
    nn.Module.__init__(other)
    set_default_quant_scales(other, register_buffer=True)
    other._k_scale.fill_(0.3)  # as if the checkpoint carried k_scale
    other.kv_state = st
    with pytest.raises(ValueError, match="differ from the served ones"):
        other.process_weights_after_loading(torch.bfloat16)
    other.dummy_weights = True  # load_format=dummy: the 0.3 is a random draw, the sidecar's scales serve
    other.process_weights_after_loading(torch.bfloat16)
    assert other._k_scale.item() == pytest.approx(0.05)


def test_install_rebinds_the_owner_and_guards_the_fp8_warmup(upstream_qsa):
    import vllm.models.qwen4_exp.nvidia.model as upstream_model
    import vllm.models.qwen4_exp.nvidia.ops.qsa as upstream_ops

    upstream_qsa.install()
    upstream_qsa.install()  # idempotent: one wrapper, not two
    assert upstream_model.Qwen4ExpQSAAttention is upstream_qsa.Qwen4ExpQSAAttentionSm86
    warmup = upstream_ops.warmup_qsa_sparse_paged_attention
    assert warmup.qwen4exp_sm86 and not getattr(warmup.__wrapped__, "qwen4exp_sm86", False)
    calls = []
    guarded = upstream_qsa._skip_warmup_for_uint8(
        lambda cache, *a, **k: calls.append(cache.dtype) or ("ran",)
    )
    assert guarded(torch.zeros(1, dtype=torch.uint8), None, num_query_heads=1, selection_width=1) == ()
    assert guarded(torch.zeros(1, dtype=torch.bfloat16), None, num_query_heads=1, selection_width=1) == (
        "ran",
    )
    assert calls == [torch.bfloat16]


def test_mapping_keeps_the_indexer_out_of_qkv_and_the_subclass_says_so(upstream_qsa):
    import vllm.models.qwen4_exp.nvidia.model as upstream_model

    ours = upstream_qsa.unfused_qkv_mapping(upstream_model.Qwen4ExpForCausalLM.packed_modules_mapping)
    assert ours["qkv_proj"] == ["q_proj", "k_proj", "v_proj"]
    assert "indexer.index_qk_proj" in upstream_model.Qwen4ExpForCausalLM.packed_modules_mapping["qkv_proj"]
    assert {k: v for k, v in ours.items() if k != "qkv_proj"} == {
        k: v for k, v in upstream_model.Qwen4ExpForCausalLM.packed_modules_mapping.items() if k != "qkv_proj"
    }
    # While the owner's constructor runs, "fusing" returns the plain projection; afterwards upstream's class is back.
    fused = upstream_qsa.upstream_qsa.Qwen4ExpQSAQKVIndexerLinear
    with upstream_qsa._indexer_projection_kept_separate():
        sentinel = object()
        assert upstream_qsa.upstream_qsa.Qwen4ExpQSAQKVIndexerLinear(sentinel, 8, None) is sentinel
    assert upstream_qsa.upstream_qsa.Qwen4ExpQSAQKVIndexerLinear is fused


def test_indexer_projection_separate_with_quantization_or_when_asked(upstream_qsa, monkeypatch):
    """A bf16 twin of a quantized checkpoint gets the quantized one's layer structure on request."""
    import vllm.models.qwen4_exp.nvidia.model as upstream_model

    monkeypatch.delenv("QWEN4EXP_SEPARATE_INDEXER_PROJECTION", raising=False)
    assert not upstream_qsa.keeps_indexer_projection_separate(None)
    quant = SimpleNamespace(get_name=lambda: "compressed-tensors")
    assert upstream_model.without_modelopt_fp4(quant) is quant
    assert upstream_qsa.keeps_indexer_projection_separate(quant)
    assert not upstream_qsa.keeps_indexer_projection_separate(
        SimpleNamespace(get_name=lambda: "modelopt_fp4")
    )
    monkeypatch.setenv("QWEN4EXP_SEPARATE_INDEXER_PROJECTION", "1")
    assert upstream_qsa.keeps_indexer_projection_separate(None)
    monkeypatch.setenv("QWEN4EXP_SEPARATE_INDEXER_PROJECTION", "0")
    assert not upstream_qsa.keeps_indexer_projection_separate(None)


def test_the_subclass_reads_every_ple_format_ours_reads():
    """What lets ``problems_for_upstream`` accept every well-formed PLE table format."""
    from model.ple import format as ple_format

    upstream_ple = import_upstream("model.upstream.ple")
    assert tuple(upstream_ple.supported_ple_formats()) == ple_format.FORMATS == ("bf16", "fp8_e4m3", "nvfp4")


def test_cuda_branch_of_the_upstream_module_imports_and_installs(monkeypatch):
    """What vLLM's CUDA build imports for QWEN4EXP_CUDA_MODEL=upstream, imported here with the build
    check answered "CUDA": the subclasses exist with our mapping; importing installs nothing, and
    the patches their construction applies replace upstream's QSA attention and PLE table classes."""
    import importlib
    import sys

    import model.deployment.implementation as choice

    import_upstream("vllm.models.qwen4_exp.nvidia.model")
    import vllm.models.qwen4_exp.nvidia.model as upstream_model
    import vllm.models.qwen4_exp.nvidia.ple_layer as upstream_ple_layer

    monkeypatch.setattr(choice, "vllm_is_cpu_build", lambda: False)
    monkeypatch.delitem(sys.modules, "model.upstream.model", raising=False)
    # Stand-ins for upstream's own classes (an earlier test may have installed ours already).
    monkeypatch.setattr(upstream_model, "Qwen4ExpQSAAttention", type("UpstreamQSA", (), {}))
    import vllm.models.qwen4_exp.nvidia.ngram_embedding as upstream_ngram

    monkeypatch.setattr(upstream_ple_layer, "Qwen4ExpNGramEmbedding", upstream_ngram.Qwen4ExpNGramEmbedding)
    cuda_module = importlib.import_module("model.upstream.model")
    try:
        assert issubclass(cuda_module.Qwen4ExpForCausalLM, upstream_model.Qwen4ExpForCausalLM)
        for cls in (cuda_module.Qwen4ExpForCausalLM, cuda_module.Qwen4ExpForConditionalGeneration):
            assert cls.packed_modules_mapping["qkv_proj"] == ["q_proj", "k_proj", "v_proj"]
        assert upstream_model.Qwen4ExpQSAAttention.__name__ == "UpstreamQSA"  # importing installed nothing
        assert upstream_ple_layer.Qwen4ExpNGramEmbedding is upstream_ngram.Qwen4ExpNGramEmbedding
        from model.deployment.resolve import resolve
        from model.upstream import patches

        patches.apply(resolve({}, cpu_build=False))
        assert upstream_model.Qwen4ExpQSAAttention.__name__ == "Qwen4ExpQSAAttentionSm86"
        assert upstream_ple_layer.Qwen4ExpNGramEmbedding.__module__ == "model.upstream.ple"
    finally:
        sys.modules.pop("model.upstream.model", None)


def test_indexer_gemma_norm_runs_on_vllms_op_while_the_indexer_runs(upstream_qsa, monkeypatch):
    """Upstream's unfused indexer path imports ``flashinfer.norm.gemma_rmsnorm`` at call time (a
    FlashInfer JIT kernel, which our nvcc-free runtime image cannot build); inside the wrapped
    indexer forward that name is vLLM's compiled Gemma RMS norm, and outside it is FlashInfer's again."""
    import sys
    import types

    from vllm.model_executor.layers.layernorm import GemmaRMSNorm

    x = torch.randn(5, 128, generator=GEN).bfloat16()
    # GemmaRMSNorm's own forward on a stand-in (constructing the CustomOp needs a vLLM config).
    norm = SimpleNamespace(weight=nn.Parameter(torch.randn(128, generator=GEN) * 0.1), variance_epsilon=1e-6)
    want = GemmaRMSNorm.forward_native(norm, x)
    got = upstream_qsa.gemma_rmsnorm_vllm(x, norm.weight.data, 1e-6)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    out = torch.empty_like(x)
    assert upstream_qsa.gemma_rmsnorm_vllm(x, norm.weight.data, 1e-6, out=out) is out and torch.equal(
        out, want
    )
    formula = (
        x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + norm.weight.float())
    )
    torch.testing.assert_close(got.float(), formula, atol=2e-2, rtol=1e-2)

    def flashinfer_jit(*args, **kwargs):
        raise AssertionError("FlashInfer's JIT norm was called")

    fake = types.ModuleType("flashinfer.norm")
    fake.gemma_rmsnorm = flashinfer_jit
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
    monkeypatch.setitem(sys.modules, "flashinfer.norm", fake)
    sys.modules["flashinfer"].norm = fake

    def indexer_forward(q, weight):
        from flashinfer.norm import gemma_rmsnorm  # as upstream's unfused path does

        return gemma_rmsnorm(q, weight, 1e-6)

    wrapped = upstream_qsa._with_vllm_gemma_rmsnorm(indexer_forward)
    assert torch.equal(wrapped(x, norm.weight.data), want)
    assert fake.gemma_rmsnorm is flashinfer_jit  # restored
    with pytest.raises(AssertionError, match="JIT norm was called"):
        indexer_forward(x, norm.weight.data)
