"""Our FP8/NVFP4 PLE tables on upstream's Qwen4-Exp classes (``model.upstream.ple``), on CPU.

Rows come from our converter (``model.tools.ple_quantize.convert_checkpoint`` on the pinned ``wide``
checkpoint); every lookup is compared bit for bit with ``model.ple.tables.lookup_ref`` on the
same converted tables. Distributed groups are stand-ins (one process plays each ETP rank, the
all-reduce is the byte sum NCCL would do); the pinned table's Triton copy kernel is replaced by a
torch copy with the kernel's semantics, so its row geometry is checked, not the kernel (tests/gpu).
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch

from tests.upstream.importer import import_upstream

# No skip: upstream must import on both builds (tests/upstream/importer.py); if it does not, these
# tests fail rather than hide it.
C = import_upstream("vllm.models.qwen4_exp.common.ngram_embedding")
N = import_upstream("vllm.models.qwen4_exp.nvidia.ngram_embedding")
L = import_upstream("vllm.models.qwen4_exp.nvidia.ple_layer")

from safetensors import safe_open  # noqa: E402
from vllm.model_executor.layers.quantization import get_quantization_config  # noqa: E402

from model.ple.tables import lookup_ref  # noqa: E402
from model.tools.ple_quantize import convert_checkpoint, read_tables  # noqa: E402
from model.upstream import ple as UP  # noqa: E402
from tests.conftest import ensure_checkpoint  # noqa: E402

OWNER = "model.layers.{i}.ple.ple_embedding"
LAYERS = ((0, 0), (4, 2))  # (checkpoint layer index, dense PLE layer id): ple_layer_ids [1, 2, 5]


class FakeGroup:
    """A process group of which this process is rank ``rank``; all_reduce records and returns its input."""

    def __init__(self, rank: int = 0, world: int = 1) -> None:
        self.rank_in_group, self.world_size = rank, world
        self.reduced: list[torch.Tensor] = []

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        self.reduced.append(t.clone())
        return t


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, Path]:
    src = ensure_checkpoint("wide")
    root = tmp_path_factory.mktemp("ple")
    return {fmt: convert_checkpoint(src, root / fmt, fmt) for fmt in ("fp8_e4m3", "nvfp4")}


def text_config(path: Path) -> types.SimpleNamespace:
    cfg = json.loads((path / "config.json").read_text())
    return types.SimpleNamespace(**cfg.get("text_config", cfg))


def ple_tensors(path: Path, layer: int) -> list[tuple[str, torch.Tensor]]:
    """Checkpoint tensors of one PLE layer, named as upstream's AutoWeightsLoader hands them on."""
    prefix = OWNER.format(i=layer) + "."
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return [(k[len(prefix) :], f.get_tensor(k)) for k in f.keys() if k.startswith(prefix)]  # noqa: SIM118


@pytest.fixture
def groups(monkeypatch, installed):
    """Install stand-in TP/ETP groups and vLLM config; returns a setter for (rank, world, cpu_offload)."""
    state = {}

    def use(rank: int = 0, world: int = 1, cpu_offload: bool = False) -> FakeGroup:
        group = FakeGroup(rank, world)
        for mod in (C, N):
            monkeypatch.setattr(mod, "get_etp_group", lambda: group)
            monkeypatch.setattr(mod, "get_tp_group", lambda: group)
        engram = types.SimpleNamespace(cpu_offload=cpu_offload)
        monkeypatch.setattr(N, "get_current_vllm_config", lambda: types.SimpleNamespace(engram_config=engram))
        state["group"] = group
        return group

    use()
    return use


@pytest.fixture
def installed(monkeypatch):
    """``model.upstream.ple.install()`` for one test; monkeypatch puts upstream's originals back afterwards."""
    method_cls = C.Qwen4ExpPLEEmbeddingMethod
    monkeypatch.setattr(method_cls, "from_quant_config", method_cls.__dict__["from_quant_config"])
    monkeypatch.setattr(L, "Qwen4ExpNGramEmbedding", L.Qwen4ExpNGramEmbedding)
    UP.install()
    return UP


def build(config, dense_id: int, cls=None, quant_config=None):
    cls = cls or UP.Qwen4ExpNGramEmbeddingOurFormats
    return cls(
        config,
        int(config.ple_embed_dim),
        dense_id,
        64,
        data_parallel_rank=0,
        prefix="model.layers.X.ple.ple_embedding",
        quant_config=quant_config,
        params_dtype=torch.bfloat16,
    )


def load(ngram, tensors) -> set[str]:
    loaded = ngram.load_weights(tensors)
    ngram.ngram_embedding.quant_method.process_weights_after_loading(ngram.ngram_embedding)
    return loaded


def random_rows(ngram, n: int = 300, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, ngram.ngram_embedding.org_vocab_size, (n, ngram.ngram_heads), generator=gen)
    rows[0] = torch.arange(ngram.ngram_heads) + ngram.ngram_embedding.org_vocab_size - ngram.ngram_heads
    return rows


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


# ------------------------------------------------------------------------------------------------


def test_supported_formats_and_row_bytes():
    assert UP.supported_ple_formats() == ("bf16", "fp8_e4m3", "nvfp4")
    assert UP.row_bytes("fp8_e4m3", 32) == 32
    assert UP.row_bytes("nvfp4", 32) == 16 + 2


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "nvfp4"])
@pytest.mark.parametrize(("layer", "dense_id"), LAYERS)
def test_device_table_lookup_is_bit_exact(fmt, layer, dense_id, converted, groups):
    path = converted[fmt]
    config = text_config(path)
    ngram = build(config, dense_id)
    table = ngram.ngram_embedding
    method_cls = UP.Qwen4ExpPLEOursNvfp4Method if fmt == "nvfp4" else UP.Qwen4ExpPLEOursFp8Method
    assert type(table.quant_method) is method_cls
    assert type(table) is C.Qwen4ExpPLEDeviceEmbedding
    dim = ngram.head_dim
    assert table.weight.dtype == torch.uint8 and table.weight.shape[1] == UP.row_bytes(fmt, dim)
    loaded = load(ngram, ple_tensors(path, layer))
    assert {"ngram_embedding.weight", "ngram_embedding.weight_global_scale"} <= loaded
    assert {"layer_multipliers", "ngram_heads_offsets", "ngram_heads_vocab_sizes"} <= loaded

    ref = read_tables(path)[OWNER.format(i=layer)]
    assert table.org_vocab_size == ref.num_rows
    rows = random_rows(ngram)
    raw = table(rows)  # upstream's VocabParallelEmbedding.forward -> our method's F.embedding
    assert raw.dtype == torch.uint8
    got = table.dequantize(raw.flatten(-2), torch.bfloat16)  # as Qwen4ExpPLELayer.forward does
    want = lookup_ref(ref, rows).flatten(-2)
    assert got.abs().sum() > 0
    assert same_bits(got, want)
    if fmt == "fp8_e4m3":
        # Upstream's own FP8 decode (bf16 multiply) rounds differently: the bit-exact check has teeth.
        codes = raw.flatten(-2).view(torch.float8_e4m3fn)
        upstream_way = codes.to(torch.bfloat16) * torch.tensor(ref.global_scale).to(torch.bfloat16)
        assert not same_bits(upstream_way, want)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "nvfp4"])
def test_ngram_forward_then_dequantize_matches_reference(fmt, converted, groups):
    """Upstream's full lookup chain (n-gram ids -> table -> flatten), then the layer's dequantize."""
    path = converted[fmt]
    ngram = build(text_config(path), 0)
    load(ngram, ple_tensors(path, 0))
    gen = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, 512, (23,), generator=gen)
    query_start_loc = torch.tensor([0, 9, 23])
    context = torch.randint(0, 512, (2, ngram.ngram_size - 1), generator=gen)
    embeddings = ngram(torch.empty(23, 8), input_ids, query_start_loc, context)
    got = ngram.ngram_embedding.dequantize(embeddings, torch.bfloat16)
    ids = ngram.compute_ngram_ids(input_ids, query_start_loc, context)
    want = lookup_ref(read_tables(path)[OWNER.format(i=0)], ids).flatten(-2)
    assert got.shape == (23, int(ngram.embedding_dim))
    assert same_bits(got, want)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "nvfp4"])
def test_etp_byte_sum_is_bit_exact(fmt, converted, groups):
    """Two ETP ranks each hold half the rows; the byte sum of their partials decodes to the full lookup."""
    path = converted[fmt]
    config, tensors = text_config(path), ple_tensors(path, 0)
    partials, rows = [], None
    for rank in (0, 1):
        group = groups(rank=rank, world=2)
        ngram = build(config, 0)
        load(ngram, tensors)
        table = ngram.ngram_embedding
        assert (
            table.tp_size == 2
            and table.shard_indices.org_vocab_start_index == rank * table.org_vocab_size // 2
        )
        rows = random_rows(ngram) if rows is None else rows
        table(rows)
        (partial,) = group.reduced  # what upstream hands the all-reduce: this rank's uint8 rows
        assert partial.dtype == torch.uint8
        partials.append(partial)
    assert all(p.any() for p in partials)
    assert not torch.logical_and(partials[0] != 0, partials[1] != 0).any(), "one owner per row"
    summed = (partials[0].to(torch.int16) + partials[1].to(torch.int16)).remainder(256).to(torch.uint8)
    got = table.dequantize(summed.flatten(-2), torch.bfloat16)
    assert same_bits(got, lookup_ref(read_tables(path)[OWNER.format(i=0)], rows).flatten(-2))


class _CpuPinnedTable(C.Qwen4ExpPLEPinnedHostEmbedding):
    """Upstream's pinned table with plain CPU memory (no CUDA here to pin with)."""

    def allocate_embedding_weight(self, num_embeddings, embedding_dim, dtype):
        return torch.empty(num_embeddings, embedding_dim, dtype=dtype)


class _KernelStandIn:
    """``kernel[grid](...)`` with the semantics of upstream's raw-byte UVA copy kernel, in torch."""

    def __getitem__(self, grid):
        def run(weight, ids, output, row_bytes, start, end, BLOCK_D):  # noqa: N803 - kernel's names
            assert BLOCK_D >= row_bytes
            src = weight.reshape(-1).view(torch.uint8)
            out = output.reshape(-1).view(torch.uint8)
            for i, g in enumerate(ids.tolist()):
                row = src[(g - start) * row_bytes : (g - start + 1) * row_bytes] if start <= g < end else 0
                out[i * row_bytes : (i + 1) * row_bytes] = row

        return run


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "nvfp4"])
def test_pinned_table_geometry_for_packed_rows(fmt, converted, groups, monkeypatch):
    groups(cpu_offload=True)
    monkeypatch.setattr(C, "is_uva_available", lambda: True)
    monkeypatch.setattr(C, "get_accelerator_view_from_cpu_tensor", lambda t: t)
    monkeypatch.setattr(
        C, "triton", types.SimpleNamespace(next_power_of_2=lambda n: 1 << (n - 1).bit_length())
    )
    monkeypatch.setattr(C, "_lookup_ple_embedding_from_pinned_kernel", _KernelStandIn())
    monkeypatch.setattr(N, "Qwen4ExpPLEPinnedHostEmbedding", _CpuPinnedTable)
    path = converted[fmt]
    ngram = build(text_config(path), 0)
    table = ngram.ngram_embedding
    assert type(table) is _CpuPinnedTable and table.supports_prefetch
    width = UP.row_bytes(fmt, ngram.head_dim)
    assert (table._row_bytes, table._output_dim, table.embedding_dim) == (
        width,
        ngram.ngram_heads * width,
        width,
    )
    load(ngram, ple_tensors(path, 0))
    rows = random_rows(ngram)
    looked = table._lookup(rows)  # what start_prefetch runs on its side stream
    output = looked.new_empty((rows.shape[0], table._output_dim))  # finalize_prefetch's output
    output.copy_(looked.flatten(-2))
    got = table.dequantize(output, torch.bfloat16)
    assert same_bits(got, lookup_ref(read_tables(path)[OWNER.format(i=0)], rows).flatten(-2))


def test_geometry_check_refuses_a_differently_sized_pinned_table(converted, groups):
    ngram = build(text_config(converted["nvfp4"]), 0)
    table = ngram.ngram_embedding
    table._row_bytes, table._output_dim = ngram.head_dim, ngram.ngram_heads * ngram.head_dim
    with pytest.raises(RuntimeError, match="upstream changed how it sizes pinned rows"):
        UP._check_table_geometry(table, ngram.ngram_heads)


# ------------------------------------------------------------------------------------------------
# Format selection


def awq():
    return get_quantization_config("awq").from_config(
        {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
    )


def gptq():
    return get_quantization_config("gptq").from_config(
        {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
    )


def compressed_tensors(targets):
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}
    return get_quantization_config("compressed-tensors").from_config(
        {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "ignore": ["lm_head"],
            "config_groups": {"g": {"targets": targets, "weights": weights, "input_activations": None}},
        }
    )


W4A16 = {
    "awq": awq,
    "gptq": gptq,
    "ct-linear": lambda: compressed_tensors(["Linear"]),
    "ct-regex": lambda: compressed_tensors(["re:.*"]),
}
PREFIX = "model.layers.0.ple.ple_embedding.ngram_embedding"


@pytest.mark.parametrize("name", sorted(W4A16))
@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        (None, "Qwen4ExpPLEUnquantizedEmbeddingMethod"),
        ("nvfp4", "Qwen4ExpPLEOursNvfp4Method"),
        ("fp8_e4m3", "Qwen4ExpPLEOursFp8Method"),
        ("float8_e4m3fn", "Qwen4ExpPLEOursFp8Method"),
    ],
)
def test_selector_serves_w4a16_configs(name, dtype, expected, installed):
    quant_config = W4A16[name]()
    method = C.Qwen4ExpPLEEmbeddingMethod.from_quant_config(quant_config, PREFIX, dtype)
    assert type(method).__name__ == expected


@pytest.mark.parametrize("name", ["awq", "gptq", "ct-regex"])
def test_upstream_selector_refuses_what_ours_serves(name):
    """The premise of the wrapper: upstream's own selector raises for these configs."""
    original = C.Qwen4ExpPLEEmbeddingMethod.__dict__.get(UP._SAVED_SELECTOR)
    original = original or C.Qwen4ExpPLEEmbeddingMethod.__dict__["from_quant_config"]
    with pytest.raises(NotImplementedError):
        original.__func__(W4A16[name](), PREFIX, None)


def test_selector_leaves_upstream_configs_to_upstream(installed):
    assert type(C.Qwen4ExpPLEEmbeddingMethod.from_quant_config(None, PREFIX, None)).__name__ == (
        "Qwen4ExpPLEUnquantizedEmbeddingMethod"
    )
    # A serialized FP8 config quantizes the table in upstream's own FP8 convention: upstream decides.
    fp8 = get_quantization_config("fp8").from_config({"quant_method": "fp8", "activation_scheme": "dynamic"})
    assert fp8.is_checkpoint_fp8_serialized
    method = C.Qwen4ExpPLEEmbeddingMethod.from_quant_config(fp8, PREFIX, None)
    assert type(method) is C.Qwen4ExpPLEFp8EmbeddingMethod
    with pytest.raises(ValueError, match="not a PLE table format"):
        C.Qwen4ExpPLEEmbeddingMethod.from_quant_config(None, PREFIX, "fp8")


def test_install_is_idempotent_and_rebinds_the_layer_global(installed, converted, groups):
    assert UP.installed()
    UP.install()
    assert C.Qwen4ExpPLEEmbeddingMethod.__dict__["from_quant_config"].__func__ is UP.choose_ple_method
    assert L.Qwen4ExpNGramEmbedding is UP.Qwen4ExpNGramEmbeddingOurFormats
    # Built the way Qwen4ExpPLELayer builds it, under an AWQ checkpoint's quant config.
    ngram = build(text_config(converted["nvfp4"]), 0, cls=L.Qwen4ExpNGramEmbedding, quant_config=awq())
    assert type(ngram.ngram_embedding.quant_method) is UP.Qwen4ExpPLEOursNvfp4Method


def test_format_in_quantization_config_is_honoured(converted, groups):
    config = text_config(converted["nvfp4"])
    del config.ple_embedding_dtype
    config.quantization_config = {"ple_embedding_dtype": "nvfp4"}
    ngram = build(config, 0, quant_config=awq())
    assert type(ngram.ngram_embedding.quant_method) is UP.Qwen4ExpPLEOursNvfp4Method


def test_check_upstream_assumptions_passes_on_this_vllm():
    UP.check_upstream_assumptions()


# ------------------------------------------------------------------------------------------------
# Loader failures


def test_mismatched_global_scale_fails_naming_the_tensor(converted, groups):
    path = converted["nvfp4"]
    ngram = build(text_config(path), 0)
    tensors = [
        (n, t * 2 if n == "ngram_embedding.shard_1.weight_global_scale" else t)
        for n, t in ple_tensors(path, 0)
    ]
    with pytest.raises(ValueError) as err:
        ngram.load_weights(tensors)
    msg = str(err.value)
    assert "model.layers.X.ple.ple_embedding.ngram_embedding.shard_1.weight_global_scale" in msg
    assert "model.layers.X.ple.ple_embedding.ngram_embedding.shard_0.weight_global_scale" in msg


def test_missing_block_scales_fail_after_loading(converted, groups):
    path = converted["nvfp4"]
    ngram = build(text_config(path), 0)
    ngram.load_weights(
        [(n, t) for n, t in ple_tensors(path, 0) if n != "ngram_embedding.shard_2.weight_scale"]
    )
    with pytest.raises(ValueError, match=r"ngram_embedding\.shard_2\.weight_scale"):
        ngram.ngram_embedding.quant_method.process_weights_after_loading(ngram.ngram_embedding)


def test_unpacked_nvfp4_rows_fail_with_a_hint(converted, groups):
    path = converted["nvfp4"]
    ngram = build(text_config(path), 0)
    rows = torch.zeros(3072, 32, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"shard_0\.weight .*packed"):
        ngram.load_weights([("ngram_embedding.shard_0.weight", rows)])


def test_quantized_codes_in_a_bf16_table_fail(converted, groups):
    config = text_config(converted["fp8_e4m3"])
    del config.ple_embedding_dtype
    ngram = build(config, 0)
    assert type(ngram.ngram_embedding.quant_method).__name__ == "Qwen4ExpPLEUnquantizedEmbeddingMethod"
    with pytest.raises(ValueError, match=r"shard_0\.weight is torch\.uint8"):
        ngram.load_weights(ple_tensors(converted["fp8_e4m3"], 0))


def test_upstream_fp8_table_scale_name_is_accepted(converted, groups):
    """Upstream's FP8 convention (one ``ngram_embedding.weight_scale``) decodes the same way."""
    path = converted["fp8_e4m3"]
    tensors = [(n, t) for n, t in ple_tensors(path, 0) if not n.endswith("weight_global_scale")]
    ref = read_tables(path)[OWNER.format(i=0)]
    tensors.append(("ngram_embedding.weight_scale", torch.tensor([ref.global_scale], dtype=torch.float32)))
    ngram = build(text_config(path), 0)
    load(ngram, tensors)
    rows = random_rows(ngram)
    got = ngram.ngram_embedding.dequantize(ngram.ngram_embedding(rows).flatten(-2), torch.bfloat16)
    assert same_bits(got, lookup_ref(ref, rows).flatten(-2))


@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3", "nvfp4"])
def test_loaded_table_exports_ours_ple_gauges(fmt, converted, groups):
    """After loading, upstream's table reports the gauges ours does (Grafana's PLE panels)."""
    from prometheus_client import REGISTRY

    path = ensure_checkpoint("wide") if fmt == "bf16" else converted[fmt]
    ngram = build(text_config(path), 0)
    load(ngram, ple_tensors(path, 0))
    weight = ngram.ngram_embedding.weight
    layer = {"layer": "model.layers.X.ple", "rank": "0"}  # ours' label for the same layer
    value = REGISTRY.get_sample_value
    assert (
        value("qwen4exp_ple_table_bytes", {**layer, "storage": "cpu"})
        == weight.numel() * weight.element_size()
    )
    assert value("qwen4exp_ple_pinned_bytes", layer) == 0.0  # no page-locked memory without CUDA
    assert value("qwen4exp_ple_storage_info", {**layer, "mode": "device", "format": fmt}) == 1.0
