"""``model.upstream.hc_mix``: the served path's hyper-connection gate mix rounds exactly where
transformers' Qwen4-Exp rounds, where upstream's own kernel does not, and :func:`install` routes
upstream's hyper-connection module through it (upstream's modules imported on the CPU build).

The kernel runs under Triton's interpreter in a child process (``TRITON_INTERPRET`` must be set
before Triton is first imported, and this pytest process may have imported it compiled).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from model.upstream import hc_mix
from tests.conftest import ROOT, pythonpath_with
from tests.upstream.importer import import_upstream

HC = import_upstream("vllm.models.qwen4_exp.nvidia.hyperconnection")

CHILD = r"""
import json, os, sys
os.environ["TRITON_INTERPRET"] = "1"
import torch
from transformers import Qwen4ExpTextConfig
from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextGatedResidual

from model.upstream.hc_mix import gate_mix

results = []
for hc, hidden, rows, seed in [(3, 384, 7, 0), (2, 600, 3, 1), (4, 128, 1, 2), (3, 520, 2, 3)]:
    torch.manual_seed(seed)
    config = Qwen4ExpTextConfig(hidden_size=hidden, hc_count=hc, hc_lowrank=24, initializer_range=0.5)
    module = Qwen4ExpTextGatedResidual(config).to(torch.bfloat16).eval()
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.5 if p.dim() > 1 else 0.2)
    streams = (torch.randn(rows, hc * hidden) * 3).to(torch.bfloat16)
    with torch.no_grad():
        want = module(streams)[0]  # transformers' block input, its own bf16 roundings
        xn = module.hc_norm(streams)
        lora = torch.nn.functional.silu(module.input_mix_weight_down(xn) / hc)
        gate = module.input_mix_weight_up(lora)
        ours = gate_mix(xn, gate, hc)
        # upstream's _hc_gate_mix_kernel (nvidia/ops/hc.py): float32 throughout, one rounding
        upstream = ((torch.sigmoid(gate.float()) * xn.float()).unflatten(-1, (hc, -1)).sum(-2) / hc)
        upstream = upstream.bfloat16()
    results.append(dict(
        shape=[hc, hidden, rows],
        ours_differ=int((ours != want).sum()),
        upstream_differ=int((upstream != want).sum()),
        elements=want.numel(),
    ))
empty = torch.empty(0, 3 * 520, dtype=torch.bfloat16)
results.append(dict(shape=list(gate_mix(empty, empty, 3).shape), ours_differ=0, upstream_differ=0, elements=0))
json.dump(results, open(sys.argv[1], "w"))
"""


def test_gate_mix_rounds_exactly_as_transformers_and_upstreams_kernel_does_not(tmp_path):
    out = tmp_path / "result.json"
    env = {**os.environ, "PYTHONPATH": pythonpath_with(ROOT)}
    run = subprocess.run(
        [sys.executable, "-c", CHILD, str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(out.read_text())
    print(results)
    *mixed, empty = results
    assert empty["shape"] == [0, 520], empty  # no rows: no launch, an empty block input
    for r in mixed:
        assert r["ours_differ"] == 0, r  # bit for bit transformers' block input
    # The check can fail: upstream's order (one rounding at the end) gives other bf16 values.
    assert sum(r["upstream_differ"] for r in mixed) > sum(r["elements"] for r in mixed) // 10, results


def test_other_dtypes_take_transformers_ops_themselves():
    x = torch.randn(3, 2 * 40, dtype=torch.float16)
    gate = torch.randn(3, 2 * 40, dtype=torch.float16)
    expected = (torch.sigmoid(gate).unflatten(-1, (2, 40)) * x.unflatten(-1, (2, 40))).mean(-2)
    assert torch.equal(hc_mix.gate_mix(x, gate, 2), expected)


def test_install_routes_upstreams_gate_mix_through_ours(monkeypatch):
    monkeypatch.setattr(HC, "hc_gate_mix", HC.hc_gate_mix)  # restored after the test
    hc_mix.install()
    assert HC.hc_gate_mix is hc_mix._gate_mix_op
    hc_mix.install()  # idempotent
    assert HC.hc_gate_mix is hc_mix._gate_mix_op
    assert hasattr(torch.ops.vllm, hc_mix.OP_NAME)
