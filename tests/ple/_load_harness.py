"""Build the vLLM model for several checkpoints in ONE process, through vLLM's own loader.

Why not an engine per checkpoint: an engine start costs 35-60 s here, and a broken checkpoint
fails inside ``create_model``/``load_weights`` anyway; this runs exactly that code (vLLM's
``DefaultModelLoader``, its safetensors iterator, our ``load_weights``) in ~1 s per checkpoint.
Each case may set environment variables (read at model construction) and may check that every
PLE table's lookups equal a reference table's dequantized rows bit for bit.

Usage: ``python -m tests.ple._load_harness cases.json``; prints ``RESULT <json>``.
"""

from __future__ import annotations

import json
import os
import sys


def run_case(case: dict, torch, loader_api) -> dict:
    from model.ple.tables import lookup_ref
    from model.tools.ple_quantize import read_tables

    EngineArgs, set_current_vllm_config, get_model_loader, set_default_torch_dtype = loader_api
    saved = {k: os.environ.get(k) for k in case.get("env", {})}
    os.environ.update(case.get("env", {}))
    try:
        cfg = EngineArgs(
            model=case["path"], dtype="bfloat16", enforce_eager=True, max_model_len=512
        ).create_engine_config()
        with set_current_vllm_config(cfg):
            try:
                loader = get_model_loader(cfg.load_config)
                with set_default_torch_dtype(cfg.model_config.dtype), torch.device(cfg.device_config.device):
                    model = loader.create_model(vllm_config=cfg, model_config=cfg.model_config)
                loader.load_weights(model, cfg.model_config)
            except Exception as e:  # the message is what the tests check
                return {"ok": False, "error": f"{type(e).__name__}: {e}"}
            result: dict = {"ok": True, "tables": {}}
            reference = read_tables(case["reference"]) if case.get("reference") else {}
            gen = torch.Generator().manual_seed(0)
            for i, layer in enumerate(model.model.layers):
                if layer.ple is None:
                    continue
                owner = f"model.layers.{i}.ple.ple_embedding"
                table = layer.ple.ple_embedding
                info = {
                    "format": table.format,
                    "mode": table.storage.mode,
                    "location": table.storage.location,
                    "table_bytes": table.storage.table_bytes(),
                    "storage_class": type(table.storage).__name__,
                }
                if owner in reference:
                    ref = reference[owner]
                    rows = torch.randint(-3, table.total_rows + 3, (257, table.heads), generator=gen)
                    rows[0] = torch.arange(table.heads) + table.total_rows - table.heads  # last rows
                    got = table.lookup(rows)
                    want = lookup_ref(ref, rows).flatten(-2)
                    info["lookup_equal"] = bool(torch.equal(got.view(torch.int16), want.view(torch.int16)))
                    info["lookup_nonzero"] = bool(got.abs().sum() > 0)
                result["tables"][owner] = info
            return result
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main() -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    cases = json.loads(open(sys.argv[1]).read())
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.utils.torch_utils import set_default_torch_dtype
    from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop

    _set_torch_accelerator_to_noop()  # as vLLM's CPU runner does: no accelerator calls on CPU
    api = (EngineArgs, set_current_vllm_config, get_model_loader, set_default_torch_dtype)
    first = EngineArgs(model=cases[0]["path"], dtype="bfloat16", max_model_len=512).create_engine_config()
    with set_current_vllm_config(first):
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, distributed_init_method=sys.argv[2], backend="gloo"
        )
        initialize_model_parallel(1, 1)
    results = {case["name"]: run_case(case, torch, api) for case in cases}
    print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
