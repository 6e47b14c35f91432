"""PLE tables in the vLLM layer, without an engine: formats, env switches, ETP, prefetch plumbing, metrics.

``NgramTable`` (the layer's storage seam) is built for simulated tensor-parallel ranks and fed the
converted checkpoints' tensors through ``load_tensor``, the same routine vLLM's loader calls.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from model.ple.quantizers import fp8_global_scale, nvfp4_global_scale, table_amax
from model.ple.tables import (
    dequantize_rows,
    lookup_ref,
    raw_row_bytes,
    shard_bounds,
    split_row_bytes,
)
from model.runtime.envs import parse_flag
from model.runtime.envs import ple_prefetch as prefetch_from_env
from model.runtime.envs import ple_storage_mode as storage_mode_from_env
from model.tools.ple_quantize import convert_checkpoint, read_tables, table_format

REPO = Path(__file__).resolve().parents[2]
FORMATS = ("bf16", "fp8_e4m3", "nvfp4")
OWNER = "model.layers.{}.ple.ple_embedding"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16) if t.element_size() == 2 else t.contiguous().view(torch.uint8)


# ------------------------------------------------------------------------------------------------
# Environment switches and format selection
# ------------------------------------------------------------------------------------------------


def test_offload_env_values():
    assert storage_mode_from_env({}) == "pinned"  # default: tables in host memory
    assert storage_mode_from_env({"VLLM_PLE_CPU_OFFLOAD": ""}) == "pinned"
    for on in ("1", "true", "YES", " on "):
        assert storage_mode_from_env({"VLLM_PLE_CPU_OFFLOAD": on}) == "pinned"
    for off in ("0", "False", "no", "OFF"):
        assert storage_mode_from_env({"VLLM_PLE_CPU_OFFLOAD": off}) == "device"
    for bad in ("2", "maybe", "of", "pinned"):
        with pytest.raises(ValueError, match=f"VLLM_PLE_CPU_OFFLOAD='{bad}' is not a valid value"):
            storage_mode_from_env({"VLLM_PLE_CPU_OFFLOAD": bad})


def test_prefetch_env_defaults_to_cuda_only():
    assert prefetch_from_env(cuda=True, env={}) is True
    assert prefetch_from_env(cuda=False, env={}) is False
    assert prefetch_from_env(cuda=False, env={"VLLM_PLE_PREFETCH": "1"}) is True
    assert prefetch_from_env(cuda=True, env={"VLLM_PLE_PREFETCH": "0"}) is False
    with pytest.raises(ValueError, match="VLLM_PLE_PREFETCH"):
        parse_flag("VLLM_PLE_PREFETCH", "sometimes")


def test_table_format_from_config():
    from model.ple.format import table_format_of as resolve_table_format

    assert resolve_table_format(SimpleNamespace()) == "bf16"
    assert resolve_table_format(SimpleNamespace(ple_embedding_dtype="nvfp4")) == "nvfp4"
    assert resolve_table_format(SimpleNamespace(ple_embedding_dtype="float8_e4m3fn")) == "fp8_e4m3"
    qc = {"quant_method": "modelopt", "ple_embedding_dtype": "fp8_e4m3"}
    assert resolve_table_format(SimpleNamespace(quantization_config=qc)) == "fp8_e4m3"
    with pytest.raises(ValueError, match="contradicts"):
        resolve_table_format(SimpleNamespace(ple_embedding_dtype="nvfp4", quantization_config=qc))
    with pytest.raises(ValueError, match="'fp8' is not a PLE table format"):
        resolve_table_format(SimpleNamespace(ple_embedding_dtype="fp8"))  # E4M3 or E5M2?


# ------------------------------------------------------------------------------------------------
# Conversion tool
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "nvfp4"])
def test_converted_checkpoint_follows_convention(ple_checkpoints, fmt):
    src, dst = ple_checkpoints["bf16"], ple_checkpoints[fmt]
    assert table_format(dst) == fmt and table_format(ple_checkpoints[f"{fmt}-deq"]) == "bf16"
    before, after = load_file(src / "model.safetensors"), load_file(dst / "model.safetensors")
    deq = load_file(ple_checkpoints[f"{fmt}-deq"] / "model.safetensors")
    for layer in (0, 1):
        owner = OWNER.format(layer)
        shards = [before[f"{owner}.ngram_embedding.shard_{i}.weight"] for i in range(4)]
        # One global scale per table, from the absmax of ALL its shards, repeated in every shard.
        want = (fp8_global_scale if fmt == "fp8_e4m3" else nvfp4_global_scale)(table_amax(shards))
        for i, shard in enumerate(shards):
            p = f"{owner}.ngram_embedding.shard_{i}"
            gs = after[f"{p}.weight_global_scale"]
            assert gs.dtype == torch.float32 and gs.shape == () and gs.item() == want
            codes = after[f"{p}.weight"]
            assert codes.dtype == torch.uint8
            assert codes.shape == (shard.shape[0], 32 if fmt == "fp8_e4m3" else 16)
            scales = after.get(f"{p}.weight_scale")
            assert (scales is None) == (fmt == "fp8_e4m3")
            if scales is not None:
                assert scales.dtype == torch.uint8 and scales.shape == (shard.shape[0], 2)
            values = dequantize_rows(fmt, codes, scales, want)
            assert torch.equal(_bits(values), _bits(deq[f"{p}.weight"]))
            assert not torch.equal(values, shard)  # the tables really were quantized
    untouched = [k for k in before if "ngram_embedding" not in k]
    assert all(torch.equal(before[k], after[k]) and torch.equal(before[k], deq[k]) for k in untouched)
    assert (dst / "tokenizer.json").exists()


def test_conversion_refuses_bad_input(ple_checkpoints, tmp_path):
    with pytest.raises(ValueError, match="already fp8_e4m3"):
        convert_checkpoint(ple_checkpoints["fp8_e4m3"], tmp_path / "x", "nvfp4")
    with pytest.raises(ValueError, match="--format"):
        convert_checkpoint(ple_checkpoints["bf16"], tmp_path / "y", "bf16")


def test_conversion_cli(ple_checkpoints, tmp_path):
    out = tmp_path / "cli"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "model.tools.ple_quantize",
            "--format",
            "nvfp4",
            "--src",
            str(ple_checkpoints["bf16"]),
        ]
        + ["--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert (
        load_file(out / "model.safetensors").keys()
        == load_file(ple_checkpoints["nvfp4"] / "model.safetensors").keys()
    )
    assert json.loads((out / "config.json").read_text())["ple_embedding_dtype"] == "nvfp4"


# ------------------------------------------------------------------------------------------------
# NgramTable on simulated tensor-parallel ranks (ETP)
# ------------------------------------------------------------------------------------------------


def _config(path: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def _table(path: Path, fmt: str, rank: int, world: int, mode: str, layer: int = 1, **kw):
    """An NgramTable for ``rank`` of ``world`` loaded from checkpoint ``path`` via ``load_tensor``."""
    from model.ours.ple_layer import NgramTable

    owner = OWNER.format(layer)
    table = NgramTable(
        _config(path),
        layer,
        f"model.layers.{layer}.ple",
        mode=mode,
        device="cpu",
        tp_rank=rank,
        tp_size=world,
        **kw,
    )
    assert table.format == fmt
    tensors = load_file(path / "model.safetensors")
    # Scales after rows for some shards and before for others: arrival order must not matter.
    names = sorted((n for n in tensors if n.startswith(owner + ".")), key=lambda n: (n.endswith("weight"), n))
    for name in names:
        rest = name[len(owner) + 1 :]
        if not table.load_tensor(rest, tensors[name], name):
            table.check_buffer(rest, tensors[name], name)
    table.finish_loading(owner)
    return table


def _rows(table, n: int = 97, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(-2, table.total_rows + 2, (n, table.heads), generator=g)
    rows[0] = torch.tensor([0, table.total_rows - 1, -1, table.total_rows])  # edges and non-rows
    return rows


@pytest.mark.parametrize("mode", ["pinned", "device"])
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("fmt", FORMATS)
def test_etp_ranks_sum_to_dequantized_reference(ple_checkpoints, fmt, world, mode):
    path = ple_checkpoints[fmt]
    ref_path = ple_checkpoints["bf16" if fmt == "bf16" else f"{fmt}-deq"]
    reference = read_tables(ref_path)[OWNER.format(1)]
    tables = [_table(path, fmt, r, world, mode) for r in range(world)]
    rows = _rows(tables[0])
    want = lookup_ref(reference, rows).flatten(-2)  # bf16 values of the dequantized reference

    partials = [t.partial_lookup(rows) for t in tables]
    # Quantized tables travel between ranks as raw bytes when sharded; bf16 as values.
    assert all(p.dtype == (torch.uint8 if world > 1 and fmt != "bf16" else torch.bfloat16) for p in partials)
    if partials[0].dtype == torch.uint8:
        stacked = torch.stack([p.int() for p in partials])
        assert ((stacked != 0).sum(0) <= 1).all(), "a row byte came from two ranks"
    for rank, table in enumerate(tables):
        # The rank's own all-reduce is simulated by adding the other ranks' partials.
        others = [p for r, p in enumerate(partials) if r != rank]
        table.all_reduce = table.all_reduce_bytes = lambda t, o=others: sum(o, t)  # noqa: B023
        got = table.lookup(rows)
        assert got.shape == (rows.shape[0], 4 * 32) and got.dtype == torch.bfloat16
        assert torch.equal(got.float(), want.float()), f"rank {rank}"
        if world == 1:
            assert torch.equal(_bits(got), _bits(want))
        lo, hi = table.row_start, table.row_end
        assert (lo, hi) == shard_bounds(table.total_rows, rank, world)
        own = table.partial_lookup(rows)
        if own.dtype == torch.uint8:
            data, scales = split_row_bytes(fmt, own, 32)
            own = dequantize_rows(fmt, data, scales, table.storage.global_scale).flatten(-2)
        owned = ((rows >= lo) & (rows < hi)).repeat_interleave(32, dim=1)
        assert torch.equal(own[owned].float(), want[owned].float()) and not own[~owned].any()

        # Prefetch path (synchronous on CPU) gives the same embeddings, raw or dequantized.
        table.storage.reserve_prefetch(rows.numel(), raw=table.raw_reduce)
        table.start_prefetch(rows)
        assert torch.equal(table.wait_prefetch().float(), want.float())


def test_table_reserves_prefetch_buffer_at_construction(ple_checkpoints):
    """The prefetch output exists before any forward (CUDA graphs cannot allocate while capturing)."""
    t = _table(ple_checkpoints["nvfp4"], "nvfp4", 0, 2, "pinned", prefetch=True, max_tokens=64)
    assert t.storage.prefetch._raw is not None and t.storage.prefetch._raw[0].shape == (64 * 4, 16)
    assert t.storage.prefetch._raw[1].shape == (64 * 4, 2)
    t1 = _table(ple_checkpoints["nvfp4"], "nvfp4", 0, 1, "pinned", prefetch=True, max_tokens=64)
    assert t1.storage.prefetch._buf is not None and t1.storage.prefetch._buf.shape == (64 * 4, 32)


def test_lookup_before_global_scale_fails(ple_checkpoints):
    from model.ours.ple_layer import NgramTable

    t = NgramTable(
        _config(ple_checkpoints["fp8_e4m3"]), 0, "l0", mode="pinned", device="cpu", tp_rank=0, tp_size=1
    )
    with pytest.raises(RuntimeError, match="global scale was never loaded"):
        t.lookup(torch.zeros(3, 4, dtype=torch.long))


def test_pinned_mode_error_names_the_switch(monkeypatch, ple_checkpoints):
    """On a GPU without unified addressing, start-up fails and says how to keep tables on the GPU."""
    from model.ours.ple_layer import NgramTable
    from model.ple import uva as ple_uva

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ple_uva, "_UVA_OK", {})
    monkeypatch.setattr(ple_uva, "_probe_uva", lambda index: "fake GPU: no unified addressing")
    with pytest.raises(ValueError, match="no unified addressing.*VLLM_PLE_CPU_OFFLOAD=0"):
        NgramTable(
            _config(ple_checkpoints["bf16"]), 0, "l0", mode="pinned", device="cuda:0", tp_rank=0, tp_size=1
        )


def test_metrics_export(ple_checkpoints):
    from prometheus_client import REGISTRY

    _table(ple_checkpoints["nvfp4"], "nvfp4", 1, 2, "pinned", layer=0)
    layer = {"layer": "model.layers.0.ple", "rank": "1"}
    value = REGISTRY.get_sample_value
    assert value("qwen4exp_ple_storage_info", {**layer, "mode": "pinned", "format": "nvfp4"}) == 1.0
    assert value("qwen4exp_ple_table_bytes", {**layer, "storage": "cpu"}) == 2032 * 18  # half of 4,064 rows
    assert value("qwen4exp_ple_pinned_bytes", layer) == 0.0  # no page-locked memory without CUDA


# ------------------------------------------------------------------------------------------------
# Prefetch schedule across decoder layers
# ------------------------------------------------------------------------------------------------


class _FakePLE:
    def __init__(self, index: int, log: list[str], prefetch: bool = True) -> None:
        self.index, self.log, self.prefetch = index, log, prefetch

    def prepare(self, input_ids):
        self.log.append(f"prepare{self.index}")
        return f"step{self.index}"

    def start_lookup(self, step):
        self.log.append(f"start{self.index}:{step}")

    def drop_pending(self):
        pass


def test_prefetcher_starts_each_lookup_one_layer_early():
    from model.ours.ple_layer import PLEPrefetcher

    log: list[str] = []
    ples = [_FakePLE(0, log), None, _FakePLE(2, log), _FakePLE(3, log, prefetch=False), _FakePLE(4, log)]
    layers = [SimpleNamespace(ple=p) for p in ples]
    pf = PLEPrefetcher(layers)
    pf.begin(torch.zeros(3))
    for i in range(len(layers)):
        pf.before_layer(i)
        log.append(f"layer{i}")
    # Rows of every prefetching PLE layer are computed up front; layer 0's gather starts at once,
    # every other one just before the decoder layer preceding it; layer 3 looks up synchronously.
    assert log == [
        "prepare0",
        "prepare2",
        "prepare4",
        "start0:step0",
        "layer0",
        "start2:step2",
        "layer1",
        "layer2",
        "start4:step4",
        "layer3",
        "layer4",
    ]
    assert not PLEPrefetcher([SimpleNamespace(ple=_FakePLE(0, [], prefetch=False))]).enabled


def test_raw_row_bytes_roundtrip():
    data = torch.randint(0, 256, (5, 4, 16), dtype=torch.uint8)
    scales = torch.randint(0, 256, (5, 4, 2), dtype=torch.uint8)
    packed = raw_row_bytes(data, scales)
    assert packed.shape == (5, 4, 18)
    d, s = split_row_bytes("nvfp4", packed, 32)
    assert torch.equal(d, data) and torch.equal(s, scales)
    bf = torch.randn(5, 4, 32).bfloat16()
    d, s = split_row_bytes("bf16", raw_row_bytes(bf, None), 32)
    assert s is None and torch.equal(_bits(d), _bits(bf))
