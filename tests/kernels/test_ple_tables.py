"""CPU tests for the PLE table formats, reference lookup, storage backends and Triton kernel.

The kernel is checked under Triton's interpreter in a subprocess: ``TRITON_INTERPRET`` must be
set before the kernel module is imported, which a shared pytest process cannot guarantee.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from model.ple import uva as ple_uva
from model.ple.codes import E4M3_MAX, NVFP4_BLOCK, decode_e2m1, decode_e4m3
from model.ple.quantizers import quantize_fp8_rows, quantize_nvfp4_rows
from model.ple.storage import (
    DevicePleStorage,
    PinnedHostPleStorage,
    make_storage,
    storage_from_table,
)
from model.ple.tables import (
    FORMATS,
    PleTable,
    dequantize_rows,
    lookup_raw_ref,
    lookup_ref,
    make_table,
    shard_bounds,
    slice_table,
)
from tests.conftest import pythonpath_with

REPO = Path(__file__).resolve().parents[2]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern of a tensor, so comparisons distinguish -0.0 from +0.0."""
    return t.contiguous().view(torch.int16) if t.element_size() == 2 else t.contiguous().view(torch.uint8)


def _weights(rows: int, dim: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, dim, generator=g) * 0.05
    # Vary the magnitude per row so block scales differ and some values go subnormal in fp8.
    w *= torch.logspace(-3, 0, rows)[:, None]
    return w.to(torch.bfloat16)


# --------------------------------------------------------------------------------------------
# Formats and quantizers
# --------------------------------------------------------------------------------------------


def test_e4m3_decode_matches_float8_view() -> None:
    codes = torch.arange(256, dtype=torch.uint8)
    finite = (codes & 0x7F) != 0x7F
    ref = codes.view(torch.float8_e4m3fn).float()
    assert torch.equal(decode_e4m3(codes)[finite], ref[finite])


def test_e2m1_decode_values() -> None:
    got = decode_e2m1(torch.arange(16, dtype=torch.uint8))
    mags = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    assert torch.equal(got, torch.cat([mags, -mags]))
    assert torch.signbit(got[8])  # code 8 is -0.0


def test_fp8_quantizer_roundtrip() -> None:
    w = _weights(300, 64)
    codes, scale = quantize_fp8_rows(w)
    assert codes.dtype == torch.uint8 and codes.shape == w.shape
    assert not ((codes & 0x7F) == 0x7F).any(), "no NaN codes"
    assert scale == pytest.approx(w.float().abs().max().item() / E4M3_MAX, rel=1e-6)
    deq = dequantize_rows("fp8_e4m3", codes, None, scale, torch.float32)
    err = (deq - w.float()).abs()
    # E4M3: half an ulp is 2**-4 relative for normals, 2**-10 * scale absolute for subnormals.
    bound = w.float().abs() * 2**-4 + scale * 2**-10
    assert (err <= bound * 1.001).all()
    assert (err.square().mean().sqrt() / w.float().square().mean().sqrt()) < 0.04
    # Re-quantizing exactly representable values is lossless.
    codes2, scale2 = quantize_fp8_rows(deq)
    assert scale2 == scale and torch.equal(codes2, codes)


def test_nvfp4_quantizer_roundtrip() -> None:
    w = _weights(300, 64)
    packed, bscales, gscale = quantize_nvfp4_rows(w)
    assert packed.shape == (300, 32) and bscales.shape == (300, 64 // NVFP4_BLOCK)
    assert gscale == pytest.approx(w.float().abs().max().item() / (E4M3_MAX * 6.0), rel=1e-6)
    deq = dequantize_rows("nvfp4", packed, bscales, gscale, torch.float32)
    s_eff = (decode_e4m3(bscales) * gscale).repeat_interleave(NVFP4_BLOCK, dim=1)
    err = (deq - w.float()).abs()
    # Largest E2M1 gap is 2 (between 4 and 6), so rounding is off by at most one block scale;
    # saturation at 6 after the block scale rounds down costs less than that.
    assert (err <= s_eff * 1.001 + 1e-30).all()
    rel = err.square().mean().sqrt() / w.float().square().mean().sqrt()
    assert rel < 0.12
    # Low nibble first, value = (e2m1 * block_scale) * global_scale: decode by hand and compare.
    lo = decode_e2m1(packed & 0xF)
    hi = decode_e2m1(packed >> 4)
    bs = decode_e4m3(bscales).repeat_interleave(NVFP4_BLOCK, dim=1)
    manual = (torch.stack([lo, hi], -1).flatten(1) * bs) * torch.tensor(gscale)
    assert torch.equal(manual, deq)


def test_nvfp4_quantizer_exact_on_representable_table() -> None:
    """A table built from E2M1 codes and E4M3 block scales quantizes back to the same codes."""
    g = torch.Generator().manual_seed(3)
    rows, dim = 40, 64
    codes = torch.randint(0, 16, (rows, dim), generator=g, dtype=torch.uint8)
    codes[codes == 8] = 0  # the quantizer never emits -0
    codes[:, ::NVFP4_BLOCK] = 7  # every block holds a 6 so its absmax pins the block scale
    s_codes = torch.randint(0x08, 0x7F, (rows, dim // NVFP4_BLOCK), generator=g, dtype=torch.uint8)
    s_codes[0, 0] = 0x7E  # 448: pins the global scale to 2**-10
    gscale = 2.0**-10
    bs = decode_e4m3(s_codes).repeat_interleave(NVFP4_BLOCK, dim=1)
    w = (decode_e2m1(codes) * bs * gscale).to(torch.bfloat16)
    packed, bscales, gs = quantize_nvfp4_rows(w)
    assert gs == gscale
    assert torch.equal(bscales, s_codes)
    assert torch.equal(packed, codes[:, 0::2] | (codes[:, 1::2] << 4))
    assert torch.equal(dequantize_rows("nvfp4", packed, bscales, gs, torch.float32), w.float())


def test_nvfp4_never_emits_negative_zero_and_keeps_zero_blocks() -> None:
    w = torch.zeros(4, 32)
    w[1, :16] = -1e-9  # tiny negative values in an otherwise large table round to zero
    w[2] = torch.linspace(-3, 3, 32)
    packed, bscales, _ = quantize_nvfp4_rows(w.to(torch.bfloat16))
    nibbles = torch.stack([packed & 0xF, packed >> 4], -1).flatten(1)
    assert not (nibbles == 8).any()
    assert (packed[0] == 0).all() and (bscales[0] == 0).all()


def test_make_table_validates_shapes() -> None:
    with pytest.raises(ValueError):
        PleTable("fp8_e4m3", torch.zeros(4, 8, dtype=torch.bfloat16), None, 1.0, 0, 4, 8)
    with pytest.raises(ValueError):
        PleTable("nvfp4", torch.zeros(4, 8, dtype=torch.uint8), None, 1.0, 0, 4, 16)
    with pytest.raises(ValueError):
        make_table("int4", torch.zeros(4, 16))


# --------------------------------------------------------------------------------------------
# Reference lookup and ETP
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_lookup_ref_zero_outside_shard(fmt: str) -> None:
    full = make_table(fmt, _weights(100, 32), vocab_start=0)
    shard = slice_table(full, 40, 70)
    ids = torch.tensor([[-5, 0, 39, 40], [55, 69, 70, 1000]])
    out = lookup_ref(shard, ids, 40, 70)
    assert out.shape == (2, 4, 32) and out.dtype == torch.bfloat16
    owned = (ids >= 40) & (ids < 70)
    assert torch.equal(_bits(out[~owned]), torch.zeros_like(_bits(out[~owned])))
    assert torch.equal(_bits(out[owned]), _bits(lookup_ref(full, ids[owned])))
    data, scales = lookup_raw_ref(shard, ids)
    assert (data[~owned].view(torch.uint8) == 0).all()
    if scales is not None:
        assert (scales[~owned] == 0).all()
    with pytest.raises(ValueError):
        lookup_ref(shard, ids, 40, 71)


def test_shard_bounds_cover_evenly() -> None:
    for total in (0, 1, 7, 100, 101, 10**9 + 3):
        for tp in (1, 2, 3, 4, 8):
            bounds = [shard_bounds(total, r, tp) for r in range(tp)]
            assert bounds[0][0] == 0 and bounds[-1][1] == total
            assert all(bounds[i][1] == bounds[i + 1][0] for i in range(tp - 1))
            sizes = [e - s for s, e in bounds]
            assert max(sizes) - min(sizes) <= 1
    with pytest.raises(ValueError):
        shard_bounds(10, 4, 4)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("tp", [2, 3, 4])
def test_etp_sum_equals_full_lookup(fmt: str, tp: int) -> None:
    rows = 101
    full = make_table(fmt, _weights(rows, 48 if fmt != "nvfp4" else 64, seed=tp), vocab_start=0)
    ids = torch.randint(-3, rows + 3, (5, 13), generator=torch.Generator().manual_seed(1))
    ref = lookup_ref(full, ids)
    shards = [slice_table(full, *shard_bounds(rows, r, tp)) for r in range(tp)]

    # Dequantized partials: a float sum over ranks reproduces the full lookup. (Only the owner is
    # non-zero; comparing values rather than bits because -0.0 + +0.0 is +0.0.)
    total = torch.zeros_like(ref)
    for s in shards:
        total = total + lookup_ref(s, ids)
    if fmt == "bf16":
        assert torch.equal(_bits(total), _bits(ref))
    else:
        assert torch.equal(total, ref)

    # Raw partials ("keep storage dtype"): an integer byte sum reproduces the owner's bytes.
    raw_full, scales_full = lookup_raw_ref(full, ids)
    acc = torch.zeros(raw_full.numel() * raw_full.element_size(), dtype=torch.int32)
    acc_s = None if scales_full is None else torch.zeros(scales_full.numel(), dtype=torch.int32)
    for s in shards:
        d, sc = lookup_raw_ref(s, ids)
        acc += d.contiguous().view(torch.uint8).reshape(-1).int()
        if acc_s is not None:
            acc_s += sc.reshape(-1).int()
    assert acc.max() <= 255
    assert torch.equal(acc.to(torch.uint8), raw_full.contiguous().view(torch.uint8).reshape(-1))
    if acc_s is not None:
        assert torch.equal(acc_s.to(torch.uint8), scales_full.reshape(-1))
        deq = dequantize_rows(
            fmt,
            acc.to(torch.uint8).view(raw_full.shape),
            acc_s.to(torch.uint8).view(scales_full.shape),
            full.global_scale,
        )
        assert torch.equal(_bits(deq), _bits(ref))


# --------------------------------------------------------------------------------------------
# Storage backends (CPU)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["device", "pinned", "pinned-separate-scales"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_storage_equals_lookup_ref(mode: str, fmt: str) -> None:
    full = make_table(fmt, _weights(200, 64), vocab_start=0)
    a, b = shard_bounds(200, 1, 3)
    kw = {"interleave_scales": False} if mode == "pinned-separate-scales" else {}
    mode = mode.split("-")[0]
    st = storage_from_table(mode, full, a, b, device="cpu", **kw)
    if fmt == "nvfp4" and mode == "pinned":
        interleaved = not kw
        assert (st.data.stride(0) == 32 + 4) == interleaved  # D/2 + D/16 bytes per fused row
    assert isinstance(st, DevicePleStorage if mode == "device" else PinnedHostPleStorage)
    assert st.fully_loaded and st.pinned_bytes() == 0
    assert st.table_bytes() == slice_table(full, a, b).nbytes()
    shard = slice_table(full, a, b)
    ids = torch.randint(-2, 202, (3, 7), generator=torch.Generator().manual_seed(2))

    got = st.lookup(ids)
    assert got.shape == (3, 7, 64)
    assert torch.equal(_bits(got), _bits(lookup_ref(shard, ids)))
    out = torch.full((3, 7, 64), 7.0, dtype=torch.bfloat16)
    assert st.lookup(ids, out=out) is out
    assert torch.equal(_bits(out), _bits(got))
    out32 = torch.empty((21, 64), dtype=torch.float32)
    st.lookup(ids, out=out32)
    assert torch.equal(out32.view(3, 7, 64), lookup_ref(shard, ids, out_dtype=torch.float32))

    raw, raw_s = st.lookup_raw(ids)
    ref_raw, ref_s = lookup_raw_ref(shard, ids)
    assert torch.equal(_bits(raw), _bits(ref_raw))
    assert (raw_s is None) == (ref_s is None)
    if ref_s is not None:
        assert torch.equal(raw_s, ref_s)

    st.reserve_prefetch(64)
    st.start_prefetch(ids)
    with pytest.raises(RuntimeError):
        st.start_prefetch(ids)
    pf = st.wait_prefetch()
    assert torch.equal(_bits(pf), _bits(got))
    with pytest.raises(RuntimeError):
        st.wait_prefetch()


@pytest.mark.parametrize("fmt", FORMATS)
def test_load_shard_by_shard_equals_load_at_once(fmt: str) -> None:
    full = make_table(fmt, _weights(500, 32), vocab_start=1000)
    lo, hi = 1123, 1377  # this rank's range, unaligned with the checkpoint pieces
    once = storage_from_table("pinned", full, lo, hi, device="cpu")

    pieces = PinnedHostPleStorage.allocate(fmt, lo, hi, 32, global_scale=full.global_scale, device="cpu")
    assert not pieces.fully_loaded and pieces.missing_rows() == hi - lo
    cuts = [1000, 1050, 1200, 1201, 1290, 1400, 1500]  # some pieces miss the range entirely
    stored = 0
    for a, b in reversed(list(zip(cuts[:-1], cuts[1:], strict=True))):
        part = slice_table(full, a, b)
        stored += pieces.load_rows(a, part.data, part.block_scales, global_scale=part.global_scale)
    assert stored == hi - lo and pieces.fully_loaded
    assert torch.equal(_bits(pieces.data), _bits(once.data))
    if full.block_scales is not None:
        assert torch.equal(pieces.block_scales, once.block_scales)
    ids = torch.arange(990, 1510)
    assert torch.equal(_bits(pieces.lookup(ids)), _bits(once.lookup(ids)))

    if fmt != "bf16":
        with pytest.raises(ValueError):
            pieces.load_rows(
                lo,
                full.data[:3],
                full.block_scales[:3] if full.block_scales is not None else None,
                global_scale=full.global_scale * 2,
            )
    with pytest.raises(ValueError):
        pieces.load_rows(lo, torch.zeros(3, 7, dtype=full.data.dtype))


def test_make_storage_rejects_bad_mode() -> None:
    with pytest.raises(ValueError, match="unknown PLE storage mode"):
        make_storage("mmap", "bf16", 0, 10, 16, device="cpu")  # type: ignore[arg-type]


def test_pinned_on_cuda_without_uva_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA platform whose GPU fails the UVA probe must get a ValueError, not a fallback."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ple_uva, "_UVA_OK", {})
    monkeypatch.setattr(ple_uva, "_probe_uva", lambda index: "fake GPU: no unified addressing")
    with pytest.raises(ValueError, match="no unified addressing"):
        make_storage("pinned", "fp8_e4m3", 0, 10, 16, device="cuda:0")


def test_kernel_module_imports_without_gpu() -> None:
    from model.ple import gather_kernel as ple_gather

    assert ple_gather.is_supported("cuda:0") is False or torch.cuda.is_available()
    if os.environ.get("TRITON_INTERPRET") != "1":
        assert ple_gather.is_supported("cpu") is False


def test_modules_import_and_work_without_triton() -> None:
    """vLLM's CPU build may lack a usable Triton: imports and the CPU storage path must still work."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from model.ple.gather_kernel import is_supported\n"
        "from model.ple.storage import make_storage\n"
        "assert not is_supported('cpu') and not is_supported('cuda:0')\n"
        "st = make_storage('pinned', 'bf16', 0, 4, 16, device='cpu')\n"
        "st.load_rows(0, torch.ones(4, 16, dtype=torch.bfloat16))\n"
        "assert st.lookup(torch.tensor([1, 9])).sum().item() == 16\n"
    )
    env = dict(os.environ, PYTHONPATH=pythonpath_with(REPO))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


# --------------------------------------------------------------------------------------------
# Triton kernel under the interpreter (subprocess)
# --------------------------------------------------------------------------------------------

_INTERP_SCRIPT = r"""
import json, os, sys, time
os.environ["TRITON_INTERPRET"] = "1"
t0 = time.time()
import torch
from model.ple.gather_kernel import is_supported, ple_gather
from model.ple.tables import lookup_raw_ref, lookup_ref, make_table, slice_table

assert is_supported("cpu"), "kernel not interpreted"
results = {}
g = torch.Generator().manual_seed(0)
for fmt in ("bf16", "fp8_e4m3", "nvfp4"):
    for dim in ((64, 48) if fmt != "nvfp4" else (64, 96)):
        w = (torch.randn(150, dim, generator=g) * 0.05 * torch.logspace(-3, 0, 150)[:, None]).bfloat16()
        full = make_table(fmt, w, vocab_start=500)
        shard = slice_table(full, 530, 610)
        ids = torch.randint(480, 660, (3, 11), generator=g)
        ids[0, 0], ids[0, 1], ids[0, 2] = -1, 529, 609
        if fmt == "nvfp4":
            # Scales interleaved into each row: row-strided views of one [rows, D/2 + D/16] buffer.
            fused = torch.cat([shard.data, shard.block_scales], dim=1)
            shard = type(shard)(fmt, fused[:, : dim // 2], fused[:, dim // 2 :], shard.global_scale,
                                shard.vocab_start, shard.vocab_end, dim)
        for cfg_name, cfg in (("default", {}), ("r4cap3", dict(rows_per_program=4, max_programs=3)),
                              ("chunk5", dict(rows_per_program=2, max_rows_per_launch=5))):
            key = f"{fmt}-{dim}-{cfg_name}"
            out = torch.full((3, 11, dim), 3.0, dtype=torch.bfloat16)
            ple_gather(fmt, shard.data, ids, 530, out, block_scales=shard.block_scales,
                       global_scale=shard.global_scale, **cfg)
            ref = lookup_ref(shard, ids)
            ok_deq = torch.equal(out.view(torch.int16), ref.view(torch.int16))
            out32 = torch.empty((33, dim), dtype=torch.float32)
            ple_gather(fmt, shard.data, ids, 530, out32, block_scales=shard.block_scales,
                       global_scale=shard.global_scale, **cfg)
            ok_f32 = torch.equal(out32.view(torch.int32),
                                 lookup_ref(shard, ids, out_dtype=torch.float32).reshape(33, dim).view(torch.int32))
            rd, rs = lookup_raw_ref(shard, ids)
            od = torch.full_like(rd, 3)
            os_ = None if rs is None else torch.full_like(rs, 3)
            ple_gather(fmt, shard.data, ids, 530, od, block_scales=shard.block_scales,
                       global_scale=shard.global_scale, raw=True, out_scales=os_, **cfg)
            ok_raw = torch.equal(od.view(torch.uint8), rd.view(torch.uint8)) and (
                rs is None or torch.equal(os_, rs))
            results[key] = dict(dequant=ok_deq, f32=ok_f32, raw=ok_raw)
print("imports+run seconds", time.time() - t0, file=sys.stderr)
print("RESULTS " + json.dumps(results))
"""


@pytest.fixture(scope="module")
def interp_results() -> dict[str, dict[str, bool]]:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=pythonpath_with(REPO))
    proc = subprocess.run(
        [sys.executable, "-c", _INTERP_SCRIPT], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS "))
    return json.loads(line[len("RESULTS ") :])


_CASES = [
    f"{fmt}-{dim}-{cfg}"
    for fmt in FORMATS
    for dim in ((64, 48) if fmt != "nvfp4" else (64, 96))
    for cfg in ("default", "r4cap3", "chunk5")
]


@pytest.mark.parametrize("case", _CASES)
def test_triton_kernel_interpreted_bit_exact(interp_results: dict[str, dict[str, bool]], case: str) -> None:
    assert interp_results[case] == {"dequant": True, "f32": True, "raw": True}


# --------------------------------------------------------------------------------------------
# Checkpoint-style loading and raw prefetch
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["device", "pinned"])
@pytest.mark.parametrize("fmt", ["fp8_e4m3", "nvfp4"])
def test_deferred_global_scale_and_separate_scale_loading(mode: str, fmt: str) -> None:
    """Checkpoints deliver rows, block scales and the global scale as separate tensors, in any order."""
    full = make_table(fmt, _weights(120, 32), vocab_start=0)
    lo, hi = 30, 100
    st = make_storage(mode, fmt, lo, hi, 32, global_scale=None, device="cpu")
    assert not st.global_scale_known and not st.fully_loaded
    with pytest.raises(RuntimeError, match="global scale was never loaded"):
        st.lookup(torch.tensor([40]))
    for a, b in ((60, 120), (0, 60)):
        part = slice_table(full, a, b)
        if part.block_scales is not None:
            st.load_block_scale_rows(a, part.block_scales)
            assert st.missing_scale_rows() == (60 - lo if a == 60 else 0)
        st.load_data_rows(a, part.data)
    assert st.missing_rows() == 0 and st.missing_scale_rows() == 0 and not st.fully_loaded
    st.set_global_scale(full.global_scale)
    st.set_global_scale(full.global_scale)  # the same value again (every shard carries it) is fine
    with pytest.raises(ValueError, match="differs"):
        st.set_global_scale(full.global_scale * 2)
    with pytest.raises(ValueError, match="finite positive"):
        make_storage(mode, fmt, 0, 1, 32, global_scale=None, device="cpu").set_global_scale(float("nan"))
    assert st.fully_loaded
    ids = torch.arange(-2, 125)
    assert torch.equal(_bits(st.lookup(ids)), _bits(lookup_ref(slice_table(full, lo, hi), ids)))


@pytest.mark.parametrize("fmt", FORMATS)
def test_raw_prefetch_equals_lookup_raw(fmt: str) -> None:
    full = make_table(fmt, _weights(80, 32), vocab_start=0)
    st = storage_from_table("pinned", full, 10, 70, device="cpu")
    ids = torch.randint(-1, 82, (6, 4), generator=torch.Generator().manual_seed(5))
    st.reserve_prefetch(24, raw=True)
    st.start_prefetch(ids, raw=True)
    assert st.prefetch_pending
    with pytest.raises(RuntimeError, match="wait_prefetch_raw"):
        st.wait_prefetch()
    data, scales = st.wait_prefetch_raw()
    want_d, want_s = st.lookup_raw(ids)
    assert data.shape == want_d.shape and torch.equal(_bits(data), _bits(want_d))
    assert (scales is None) == (want_s is None)
    if want_s is not None:
        assert torch.equal(scales, want_s)
    assert not st.prefetch_pending
    st.start_prefetch(ids)  # a dequantized prefetch after a raw one uses its own buffer
    assert torch.equal(_bits(st.wait_prefetch()), _bits(st.lookup(ids)))


def test_storage_location_labels() -> None:
    assert make_storage("device", "bf16", 0, 4, 16, device="cpu").location == "cpu"
    assert make_storage("pinned", "bf16", 0, 4, 16, device="cpu").location == "cpu"
