"""Tensor parallelism on CUDA: two and four GPUs against one and against float32 (GPU judge).

Runs ``tests.gpu.fidelity_run`` with ``+tp2``/``+tp4`` modes (the 3090's paths forced with
``QWEN4EXP_FORCE_SM86=1``) on checkpoints whose heads, experts and PLE tables split over four ranks:
the served path (upstream with CUDA graphs, BF16 and FP8 QSA caches) and ours, each with peer-to-peer
transfers on and off (``NCCL_P2P_DISABLE=1``, what 3090s without a P2P-capable board see) and vLLM's
custom all-reduce on and off. Every run's teacher-forced log-probabilities must be as close to
float32 as transformers-bf16 (``tests.fidelity.measure.tolerance``), and its top-1 agreement on
decisive positions at least one GPU's less ``TOP1_SLACK``: the all-reduce's summation order may move
the last bits, never the model. Speed per TP size: ``bench/bench_engine_gpu.py --tp``.

Needs as many GPUs as the largest TP size asked for; a case for more GPUs than the host has is
skipped, naming how many it needs.
"""

from __future__ import annotations

import pytest

from tests.gpu.test_fidelity_cuda import output_dir, problems, run_fidelity

pytestmark = pytest.mark.vllm_cuda

TOP1_SLACK = 0.01
LENGTHS = "4,600,2500,6000"


def gpus() -> int:
    import torch

    return torch.cuda.device_count()


def runs(tp: int) -> str:
    served = [f"upstream:graphs+tp{tp}", f"upstream:graphs+fp8+tp{tp}", f"ours:eager+tp{tp}"]
    links = [
        f"upstream:graphs+tp{tp}+nop2p",
        f"upstream:graphs+tp{tp}+noar",
        f"upstream:graphs+tp{tp}+nop2p+noar",
    ]
    return ",".join(["upstream:graphs", "ours:eager", *served, *links])


@pytest.mark.parametrize("shape", ["real-4layer", "holdout"])
@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_runs_are_as_close_to_float32_as_one_gpu(shape, tp, tmp_path):
    if gpus() < tp:
        pytest.skip(f"TP={tp} needs {tp} GPUs; this host has {gpus()}")
    got = run_fidelity(
        output_dir(f"tp{tp}-{shape}", tmp_path), "--shapes", shape, "--lengths", LENGTHS, "--runs", runs(tp)
    )
    entry = got["shapes"][shape]
    single = min(entry["runs"][run]["all"]["top1_agreement"] for run in ("upstream:graphs", "ours:eager"))
    failed = problems(entry, top1_floor=single - TOP1_SLACK)
    assert not failed, failed
