"""CPU tests of QSA sparse paged attention: the torch reference against a naive loop, and the Triton
kernel under Triton's interpreter against the reference.

Triton decides at decoration time whether a ``@triton.jit`` function is interpreted, and that
includes its own standard library (``tl.cdiv``, ``tl.sum``...), decorated when ``triton`` is first
imported. So ``TRITON_INTERPRET=1`` is set before importing Triton here. When another test module
of the same pytest process imported Triton first (compiled mode), the kernel tests cannot run in
this process: they are then run once in a child pytest process on this file, and each kernel test
here passes or fails with its counterpart there (never skipped).
"""

from __future__ import annotations

import os

_PREVIOUS_INTERPRET = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"

import importlib  # noqa: E402
import math  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import xml.etree.ElementTree as ET  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import triton.language as tl  # noqa: E402

import model.kernels.qsa_sparse_attention as qsa_kernels  # noqa: E402
from model.ops.fp8_e4m3 import decode_e4m3, decode_e5m2, encode_e4m3, encode_e5m2  # noqa: E402
from model.ops.qsa_sparse_attention import sparse_paged_attention_ref  # noqa: E402
from tests.conftest import pythonpath_with  # noqa: E402

IN_PROCESS = type(tl.standard.cdiv).__name__ == "InterpretedFunction"
if IN_PROCESS and not qsa_kernels._interpreting():
    qsa_kernels = importlib.reload(qsa_kernels)
# Leave the process environment as found: later-collected modules must not inherit interpretation;
# the ``interpreted`` fixture sets it again around each kernel test.
if _PREVIOUS_INTERPRET is None:
    del os.environ["TRITON_INTERPRET"]
else:
    os.environ["TRITON_INTERPRET"] = _PREVIOUS_INTERPRET

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def child_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str | None]:
    """Run this file's kernel tests in a fresh interpreter-mode pytest; name -> failure text or None."""
    report = tmp_path_factory.mktemp("qsa_child") / "report.xml"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": pythonpath_with(REPO_ROOT)}
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        str(Path(__file__).resolve()),
        "-q",
        "-p",
        "no:cacheprovider",
        "-k",
        "kernel or triton",
        f"--junitxml={report}",
    ]
    res = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    if not report.exists():
        raise AssertionError(
            f"child pytest produced no report (rc={res.returncode}):\n{res.stdout}\n{res.stderr}"
        )
    results: dict[str, str | None] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        bad = [el for el in case if el.tag in ("failure", "error", "skipped")]
        results[case.get("name", "")] = None if not bad else (bad[0].get("message") or bad[0].tag)
    return results


@pytest.fixture
def interpreted(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """True when the test may run here; otherwise asserts on the child's outcome and returns False."""
    if IN_PROCESS:
        # Triton reads the knob again at launch (e.g. when it lazily imports gluon).
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        return True
    results = request.getfixturevalue("child_results")
    name = request.node.name
    assert name in results, f"{name} did not run in the interpreter child process"
    assert results[name] is None, f"{name} failed under the interpreter: {results[name]}"
    return False


@dataclass
class Case:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    token_req_idx: torch.Tensor
    selected: torch.Tensor
    num_selected: torch.Tensor
    scale: float


def make_case(
    *,
    num_tokens: int = 4,
    num_q_heads: int = 4,
    num_kv_heads: int = 1,
    head_dim: int = 64,
    block_size: int = 16,
    num_reqs: int = 2,
    blocks_per_req: int = 4,
    width: int = 40,
    counts: list[int] | None = None,
    first_page: int = 1000,
    q_dtype: torch.dtype = torch.bfloat16,
    cache_dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> Case:
    """Random case whose block table only points at pages >= ``first_page``, in shuffled order."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = first_page + num_reqs * blocks_per_req + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(cache_dtype)
    v_cache = torch.randn(shape, generator=g).to(cache_dtype)
    pages = first_page + torch.randperm(num_blocks - first_page, generator=g)[: num_reqs * blocks_per_req]
    block_table = pages.view(num_reqs, blocks_per_req).to(torch.int32)
    token_req_idx = torch.randint(0, num_reqs, (num_tokens,), generator=g, dtype=torch.int32)
    if counts is None:
        counts = [int(x) for x in torch.randint(1, width + 1, (num_tokens,), generator=g)]
    selected = torch.full((num_tokens, width), -1, dtype=torch.int32)
    for t, n in enumerate(counts):
        selected[t, :n] = torch.randperm(blocks_per_req * block_size, generator=g)[:n].to(torch.int32)
    q = torch.randn((num_tokens, num_q_heads, head_dim), generator=g).to(q_dtype)
    return Case(
        q,
        k_cache,
        v_cache,
        block_table,
        token_req_idx,
        selected,
        torch.tensor(counts, dtype=torch.int32),
        1.0 / math.sqrt(head_dim),
    )


def naive_attention(
    c: Case, k_scale: float = 1.0, v_scale: float = 1.0, kv_format: str = "fp8_e4m3"
) -> torch.Tensor:
    """Token-by-token, head-by-head loop straight from the definition (fp64)."""
    num_tokens, num_q_heads, head_dim = c.q.shape
    block_size, num_kv_heads = c.k_cache.shape[1], c.k_cache.shape[2]
    out = torch.zeros((num_tokens, num_q_heads, head_dim), dtype=torch.float64)

    def value(cache: torch.Tensor, page: int, slot: int, h: int) -> torch.Tensor:
        row = cache[page, slot, h]
        if row.dtype == torch.uint8:
            row = (
                decode_e5m2(row, torch.float32)
                if kv_format == "fp8_e5m2"
                else decode_e4m3(row, torch.float32)
            )
        return row.double()

    for t in range(num_tokens):
        r = int(c.token_req_idx[t])
        positions = [int(p) for p in c.selected[t, : int(c.num_selected[t])] if int(p) >= 0]
        if not positions:
            continue
        for h in range(num_q_heads):
            hk = h // (num_q_heads // num_kv_heads)
            ks, vs = [], []
            for p in positions:
                page = int(c.block_table[r, p // block_size])
                ks.append(value(c.k_cache, page, p % block_size, hk))
                vs.append(value(c.v_cache, page, p % block_size, hk))
            logits = torch.stack(ks) @ c.q[t, h].double() * c.scale * k_scale
            out[t, h] = torch.softmax(logits, dim=0) @ torch.stack(vs) * v_scale
    return out


# ------------------------------------------------------------------------------------------ reference


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("cache", ["bf16", "fp8_e4m3", "fp8_e5m2"])
def test_reference_matches_naive_loop(group: int, cache: str) -> None:
    c = make_case(num_q_heads=2 * group, num_kv_heads=2, q_dtype=torch.float32, counts=[40, 7, 0, 1])
    k_scale, v_scale = 1.0, 1.0
    if cache != "bf16":
        k_scale, v_scale = 0.5, 0.125
        enc = encode_e4m3 if cache == "fp8_e4m3" else encode_e5m2
        c.k_cache, c.v_cache = enc(c.k_cache, k_scale), enc(c.v_cache, v_scale)
    fmt = "fp8_e5m2" if cache == "fp8_e5m2" else None
    ref = sparse_paged_attention_ref(
        c.q,
        c.k_cache,
        c.v_cache,
        c.block_table,
        c.token_req_idx,
        c.selected,
        c.num_selected,
        c.scale,
        k_scale,
        v_scale,
        kv_format=fmt,
    )
    naive = naive_attention(c, k_scale, v_scale, kv_format=cache)
    assert ref.dtype == c.q.dtype
    torch.testing.assert_close(ref.double(), naive, atol=1e-5, rtol=1e-5)
    assert torch.count_nonzero(ref[2]) == 0  # the empty row


def test_reference_ignores_entries_past_num_selected_and_negative_ones() -> None:
    c = make_case(counts=[10, 10, 10, 10])
    base = sparse_paged_attention_ref(
        c.q, c.k_cache, c.v_cache, c.block_table, c.token_req_idx, c.selected, c.num_selected, c.scale
    )
    junk = c.selected.clone()
    junk[:, 10:] = 5  # garbage past num_selected must not count
    extended = torch.cat([c.selected[:, :10], torch.full((4, 3), -1, dtype=torch.int32)], dim=1)
    n_ext = torch.full((4,), 13, dtype=torch.int32)  # -1 inside num_selected must not count either
    for sel, n in ((junk, c.num_selected), (extended, n_ext)):
        out = sparse_paged_attention_ref(
            c.q, c.k_cache, c.v_cache, c.block_table, c.token_req_idx, sel, n, c.scale
        )
        assert torch.equal(out, base)


# --------------------------------------------------------------------------------------------- kernel


def _run_both(
    c: Case,
    kv_format: str,
    num_splits: int | None,
    k_scale: float | torch.Tensor = 1.0,
    v_scale: float | torch.Tensor = 1.0,
    block_n: int = 16,
) -> tuple[torch.Tensor, torch.Tensor]:
    args = (c.q, c.k_cache, c.v_cache, c.block_table, c.token_req_idx, c.selected, c.num_selected, c.scale)
    out = qsa_kernels.sparse_paged_attention(
        *args, k_scale, v_scale, num_splits=num_splits, kv_format=kv_format, block_n=block_n
    )
    ref = sparse_paged_attention_ref(*args, k_scale, v_scale, kv_format=kv_format)
    return out, ref


def _encode_case(c: Case, kv_format: str, k_scale: float, v_scale: float) -> None:
    if kv_format == "fp8_e4m3":
        c.k_cache, c.v_cache = encode_e4m3(c.k_cache, k_scale), encode_e4m3(c.v_cache, v_scale)
    elif kv_format == "fp8_e5m2":
        c.k_cache, c.v_cache = encode_e5m2(c.k_cache, k_scale), encode_e5m2(c.v_cache, v_scale)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("kv_format", ["bf16", "fp8_e4m3"])
def test_kernel_matches_reference(kv_format: str, group: int, num_splits: int, interpreted: bool) -> None:
    if not interpreted:
        return
    # Ragged rows, one empty row, rows spanning several 16-token tiles per split, pages >= 1000.
    c = make_case(
        num_tokens=5,
        num_q_heads=2 * group,
        num_kv_heads=2,
        blocks_per_req=5,
        width=72,
        counts=[72, 17, 0, 5, 50],
        seed=group,
    )
    k_scale, v_scale = (0.5, 0.25) if kv_format != "bf16" else (1.0, 1.0)
    _encode_case(c, kv_format, k_scale, v_scale)
    assert int(c.block_table.min()) >= 1000
    out, ref = _run_both(c, kv_format, num_splits, k_scale, v_scale)
    assert out.shape == ref.shape and out.dtype == c.q.dtype
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    assert torch.count_nonzero(out[2]) == 0


def test_kernel_reads_upstream_cache_layout_and_packed_selection(interpreted: bool) -> None:
    """vLLM's own Qwen4-Exp binds ``[blocks, kv_heads, page, 2*D]`` (K then V in the last dim) and
    packs the count as a trailing selection column; our subclass hands the kernel strided views of
    both (``model.upstream.qsa_glue``). The kernel must read them as the loop over the definition does."""
    if not interpreted:
        return
    from model.upstream.qsa_glue import cache_halves, split_packed_selection

    c = make_case(num_tokens=4, num_q_heads=4, num_kv_heads=2, width=24, counts=[24, 3, 0, 11], seed=5)
    _encode_case(c, "fp8_e4m3", 0.5, 0.25)
    blocks, page, heads, dim = c.k_cache.shape
    bound = torch.zeros((blocks, heads, page, 2 * dim), dtype=torch.uint8)
    key_view, value_view = cache_halves(bound, dim)
    key_view.copy_(c.k_cache)
    value_view.copy_(c.v_cache)
    assert not key_view.is_contiguous()
    packed = torch.cat([c.selected, c.num_selected.unsqueeze(1)], dim=1)
    selected, counts = split_packed_selection(packed)
    out = qsa_kernels.sparse_paged_attention(
        c.q, key_view, value_view, c.block_table, c.token_req_idx, selected, counts, c.scale,
        torch.tensor([0.5]), torch.tensor([0.25]), num_splits=None, kv_format="fp8_e4m3", block_n=16,
    )  # fmt: skip
    want = naive_attention(c, 0.5, 0.25)
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)
    assert torch.count_nonzero(out[2]) == 0


def test_kernel_group8_headdim128_e5m2_tensor_scales_auto_splits(interpreted: bool) -> None:
    if not interpreted:
        return
    c = make_case(num_tokens=3, num_q_heads=8, num_kv_heads=1, head_dim=128, counts=[40, 0, 21], seed=7)
    _encode_case(c, "fp8_e5m2", 2.0, 0.5)
    out, ref = _run_both(c, "fp8_e5m2", None, torch.tensor([2.0]), torch.tensor(0.5), block_n=16)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_kernel_fp32_query_and_fp16_cache(num_splits: int, interpreted: bool) -> None:
    if not interpreted:
        return
    c = make_case(
        num_tokens=3,
        num_q_heads=4,
        num_kv_heads=2,
        q_dtype=torch.float32,
        cache_dtype=torch.float32,
        counts=[40, 3, 12],
        seed=3,
    )
    out, ref = _run_both(c, "bf16", num_splits)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    c = make_case(
        num_tokens=3,
        num_q_heads=4,
        num_kv_heads=2,
        q_dtype=torch.float16,
        cache_dtype=torch.float16,
        counts=[40, 3, 12],
        seed=4,
    )
    out, ref = _run_both(c, "bf16", num_splits)
    torch.testing.assert_close(out.float(), ref.float(), atol=5e-3, rtol=5e-3)


def test_kernel_block_size_64_and_more_splits_than_tokens(interpreted: bool) -> None:
    if not interpreted:
        return
    # Splits larger than a row's count leave empty splits, which the merge must ignore.
    c = make_case(
        num_tokens=3,
        num_q_heads=4,
        num_kv_heads=2,
        block_size=64,
        blocks_per_req=2,
        width=70,
        counts=[70, 2, 1],
        seed=5,
    )
    _encode_case(c, "fp8_e4m3", 1.0, 1.0)
    out, ref = _run_both(c, "fp8_e4m3", 8)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_kernel_detects_wrong_inputs(interpreted: bool) -> None:
    if not interpreted:
        return
    """Sanity check of the tolerance: a different selection must not pass as equal."""
    c = make_case(num_tokens=2, num_q_heads=4, num_kv_heads=2, counts=[30, 30], seed=9)
    out, _ = _run_both(c, "bf16", 1)
    c.selected = torch.roll(c.selected, 1, dims=1)
    c.selected[:, 0] = 63
    _, ref_other = _run_both(c, "bf16", 1)
    assert (out.float() - ref_other.float()).abs().max() > 0.05


def test_triton_decode_helper_is_bit_exact(interpreted: bool) -> None:
    if not interpreted:
        return
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    ours = qsa_kernels.decode_e4m3_triton(codes)
    expected = codes.view(torch.float8_e4m3fn).float()
    finite = ~torch.isnan(expected)
    assert torch.equal(ours[finite], expected[finite])
    assert torch.equal(torch.signbit(ours[finite]), torch.signbit(expected[finite]))
    assert ours[0x7F].item() == 480.0 and ours[0xFF].item() == -480.0


def test_kernel_rejects_mismatched_format(interpreted: bool) -> None:
    if not interpreted:
        return
    c = make_case(num_tokens=1, counts=[4])
    with pytest.raises(TypeError):
        _run_both(c, "fp8_e4m3", 1)


def test_is_supported_false_on_cpu() -> None:
    ok, reason = qsa_kernels.is_supported("cpu")
    assert not ok and "CUDA" in reason


def test_module_imports_without_triton() -> None:
    code = (
        "import sys; sys.modules['triton'] = None; sys.modules['triton.language'] = None\n"
        "import model.kernels.qsa_sparse_attention as m\n"
        "ok, why = m.is_supported('cuda')\n"
        "assert not ok and 'triton' in why, why\n"
        "print('ok')\n"
    )
    env = {**os.environ, "PYTHONPATH": pythonpath_with(REPO_ROOT)}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr
