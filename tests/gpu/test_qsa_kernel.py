"""The QSA Triton kernel on a CUDA device: E4M3 decode bit-exact, kernel vs torch reference, graphs."""

from __future__ import annotations

import pytest
import torch

from . import qsa_kernel_cases as C

CASES = C.validation_cases()


@pytest.fixture(scope="module")
def device():
    return torch.device("cuda")


def test_e4m3_decode_bit_exact(device):
    ok, msg = C.check_decode(device)
    assert ok, msg


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_kernel_matches_reference(case, device):
    gen = torch.Generator().manual_seed(1234)
    ok, msg = C.run_val_case(case, device, gen)
    torch.cuda.empty_cache()
    print(msg)
    assert ok, msg


def test_all_rows_empty_give_zeros(device):
    ok, msg = C.all_empty_case(device, torch.Generator().manual_seed(1234))
    assert ok, msg
