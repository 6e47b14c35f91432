"""Build a vLLM engine on the CPU for a checkpoint and print, as JSON, what vLLM itself reports.

vLLM's start-up log lines (e.g. "KV cache size: N tokens, Maximum concurrency ...") go to this
process's output, where the test reads them.

Run by ``test_planner_vs_vllm.py`` in a subprocess (one engine, isolated from the test process):
the KV-cache config the engine core allocated (blocks, groups, per-layer specs), and the
bytes of the parameters and PLE tables the worker holds.

Usage: python -m tests.deploy.vllm_probe CHECKPOINT MAX_MODEL_LEN KV_CACHE_DTYPE [MAMBA_SSM_CACHE_DTYPE]
"""

from __future__ import annotations

import json
import os
import sys


def repacked_linear_weights(model) -> tuple[int, int]:
    """(elements, bytes) of linear weights that vLLM's CPU build moved out of ``parameters()``.

    On CPUs with AVX512/AMX kernels (sgl-kernel or oneDNN GEMMs) vLLM packs each linear weight into
    its kernel's own buffer and replaces ``weight`` by an empty parameter
    (``vllm/model_executor/layers/utils.py: dispatch_cpu_unquantized_gemm``, ``remove_weight``), so
    ``parameters()`` no longer holds them (seen on an Intel Xeon with AMX: 712920 of 1365720
    elements counted). The logical size is the layer's per-rank input x output size.
    """
    count = nbytes = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (
            hasattr(module, "cpu_linear")
            and hasattr(module, "output_size")
            and weight is not None
            and weight.numel() == 0
        ):
            # Parallel linears know their per-rank shape; ReplicatedLinear (and vLLM's GateLinear, the
            # MoE router) have only the full one, which is also theirs per rank. Missing this cost
            # 27136 elements on the Xeon: routers, shared-expert gates and the QSA indexer projection.
            n = getattr(module, "input_size_per_partition", module.input_size) * getattr(
                module, "output_size_per_partition", module.output_size
            )
            count += n
            nbytes += n * module.params_dtype.itemsize
    return count, nbytes


def main() -> None:
    checkpoint, max_len, kv_dtype = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    ssm_dtype = sys.argv[4] if len(sys.argv) > 4 else "auto"
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in this process: inspectable
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=checkpoint,
        dtype="bfloat16",
        kv_cache_dtype=kv_dtype,
        mamba_ssm_cache_dtype=ssm_dtype,
        max_model_len=max_len,
        max_num_seqs=8,
        enforce_eager=True,
    )
    out = llm.generate(["Hello! How are you today?"], SamplingParams(max_tokens=4, temperature=0))
    core = llm.llm_engine.engine_core.engine_core
    cfg = core.scheduler.kv_cache_config
    worker = core.model_executor.driver_worker
    worker = getattr(worker, "worker", worker)
    model = worker.model_runner.model
    tables = [
        layer.ple.ple_embedding.storage.table_bytes()
        for layer in model.model.layers
        if getattr(layer, "ple", None) is not None
    ]
    packed_count, packed_bytes = repacked_linear_weights(model)
    groups = []
    for g in cfg.kv_cache_groups:
        s = g.kv_cache_spec
        groups.append(
            {
                "type": type(s).__name__,
                "layers": list(g.layer_names),
                "block_size": s.block_size,
                "page_size_bytes": s.page_size_bytes,
                "real_page_size_bytes": getattr(s, "real_page_size_bytes", None),
                "head_size": getattr(s, "head_size", None),
                "dtype": str(getattr(s, "dtype", getattr(s, "dtypes", ""))),
            }
        )
    print(
        "PROBE_JSON="
        + json.dumps(
            {
                "generated": out[0].outputs[0].text,
                "num_blocks": cfg.num_blocks,
                "groups": groups,
                "param_bytes": packed_bytes + sum(p.numel() * p.element_size() for p in model.parameters()),
                "param_count": packed_count + sum(p.numel() for p in model.parameters()),
                "repacked_linear_count": packed_count,
                "ple_table_bytes": tables,
            }
        )
    )


if __name__ == "__main__":
    main()
