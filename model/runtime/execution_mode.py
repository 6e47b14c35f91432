"""Whether vLLM runs the model's forward eagerly, read from its configuration.

Why it matters to us: the calibration collector keeps a running absmax with host reads that a CUDA
graph or a torch.compile'd forward would not replay, so calibration is refused unless the forward
runs eagerly; both implementations ask the same question here.
"""

from __future__ import annotations

from typing import Any


def runs_eagerly(vllm_config: Any) -> bool:
    """Whether the forward runs eagerly: no CUDA graphs and no torch.compile of the model."""
    from vllm.config.compilation import CompilationMode, CUDAGraphMode

    if vllm_config.model_config.enforce_eager:
        return True
    cc = vllm_config.compilation_config
    return cc.mode in (None, CompilationMode.NONE) and cc.cudagraph_mode in (None, CUDAGraphMode.NONE)
