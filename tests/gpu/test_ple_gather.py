"""The PLE UVA gather kernel and the PLE storage paths on a CUDA device, bit for bit."""

from __future__ import annotations

from . import ple_gather_cases as C


def test_ple_gather_bit_exact_and_graph_replay():
    C.FAILURES.clear()
    C.PASSED.clear()
    C.correctness()
    print(f"{len(C.PASSED)} checks passed")
    assert not C.FAILURES, "failed checks:\n" + "\n".join(C.FAILURES)
    assert len(C.PASSED) > 50
