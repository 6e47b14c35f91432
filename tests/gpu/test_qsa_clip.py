"""FP8 QSA cache clip counters on a CUDA device: eager vs CUDA-graph replay, and the reader thread."""

from __future__ import annotations

import argparse
import json

import torch

from . import qsa_clip_cases as C


def test_clip_counters_equal_under_graph_replay_and_reader(tmp_path):
    args = argparse.Namespace(
        hq=16, hkv=2, head_dim=256, index_dim=128, block_size=16, reqs=12, ctx=700, tokens=10,
        width=515, steps=6, num_splits=None, replays=500, poll_s=0.002, smoke=False,
    )  # fmt: skip
    ks, vs = 0.0123, 0.0047
    sidecar = tmp_path / "scales.json"
    sidecar.write_text(json.dumps({C.LAYER: {"k_scale": ks, "v_scale": vs}}))
    world = C.World(args, torch.device("cuda"), sidecar)
    world.state.k_scale.fill_(world.state.k_scale_value)
    world.state.v_scale.fill_(world.state.v_scale_value)
    ok, graph = C.part1(world, args, world.state.k_scale_value, world.state.v_scale_value)
    assert ok, "eager/graph clip-counter checks failed (see the [check] lines above)"
    assert graph is not None
    assert C.part2(world, graph, args), "reader-thread checks failed (see the [check] lines above)"
