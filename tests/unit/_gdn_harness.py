"""Run our vLLM Gated DeltaNet layer alone on prefills of 1 and 5 tokens, the way the CPU runner does.

The layer comes out of the real ``tiny`` model built by vLLM's loader (``load_model``, so the conv
weights are packed exactly as on this host), gets a fresh conv/SSM state, and runs under a forward context
holding hand-built ``GDNAttentionMetadata`` for one prefill. Which CPU conv implementation ran is
recorded by wrapping the two functions vLLM's CPU op chooses between (``_causal_conv1d_fwd_cpu``,
vLLM's C++ kernel, taken on AVX512-BF16 hosts; ``causal_conv1d_torch`` elsewhere), and the
tensor handed to the op is checked against the C++ kernel's stride contract on every host.

Usage: ``python -m tests.unit._gdn_harness <checkpoint> <dist-init-url>``; prints ``RESULT <json>``.
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    import torch
    from transformers import AutoModelForCausalLM
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention as cpu_gdn
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.utils.torch_utils import set_default_torch_dtype
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata
    from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop

    path, dist_url = sys.argv[1], sys.argv[2]
    _set_torch_accelerator_to_noop()
    cfg = EngineArgs(
        model=path, dtype="bfloat16", enforce_eager=True, max_model_len=512
    ).create_engine_config()
    ran: list[str] = []
    handed: list[dict] = []

    def spy(name, fn):
        def wrapper(*args, **kwargs):
            ran.append(name)
            return fn(*args, **kwargs)

        return wrapper

    cpu_gdn._causal_conv1d_fwd_cpu = spy("cpp", cpu_gdn._causal_conv1d_fwd_cpu)
    cpu_gdn.causal_conv1d_torch = spy("torch", cpu_gdn.causal_conv1d_torch)
    nonspec = cpu_gdn._cpu_gdn_attention_nonspec

    def record_input(layer, md, mixed_qkv, *rest):
        handed.append({"shape": list(mixed_qkv.shape), "stride": list(mixed_qkv.stride())})
        return nonspec(layer, md, mixed_qkv, *rest)

    cpu_gdn._cpu_gdn_attention_nonspec = record_input

    with set_current_vllm_config(cfg):
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, distributed_init_method=dist_url, backend="gloo"
        )
        initialize_model_parallel(1, 1)
        with set_default_torch_dtype(torch.bfloat16):
            model = get_model_loader(cfg.load_config).load_model(
                vllm_config=cfg, model_config=cfg.model_config
            )
        layer = model.model.layers[0].linear_attn
        reference = (
            AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).model.layers[0].linear_attn
        )

        hidden = torch.randn(
            5, cfg.model_config.hf_text_config.hidden_size, generator=torch.Generator().manual_seed(0)
        )
        hidden = hidden.to(torch.bfloat16)
        results = {}
        for tokens in (1, 5):
            conv_shape, ssm_shape = layer.get_state_shape()
            conv_dtype, ssm_dtype = layer.get_state_dtype()
            layer.kv_cache = (
                torch.zeros(2, *conv_shape, dtype=conv_dtype),
                torch.zeros(2, *ssm_shape, dtype=ssm_dtype),
            )
            md = GDNAttentionMetadata(
                num_prefills=1,
                num_prefill_tokens=tokens,
                num_decodes=0,
                num_decode_tokens=0,
                num_spec_decodes=0,
                num_spec_decode_tokens=0,
                num_actual_tokens=tokens,
                has_initial_state=torch.tensor([False]),
                non_spec_query_start_loc=torch.tensor([0, tokens], dtype=torch.int32),
                non_spec_state_indices_tensor=torch.tensor([1], dtype=torch.int32),
            )
            ran.clear()
            handed.clear()
            try:
                with set_forward_context({layer.prefix: md}, cfg), torch.no_grad():
                    out = layer(hidden[:tokens])
                    want = reference(hidden[:tokens].unsqueeze(0))[0]
                results[tokens] = {
                    "ok": True,
                    "paths": list(ran),
                    "handed": list(handed),
                    "max_abs_diff": float((out.float() - want.float()).abs().max()),
                    "ref_scale": float(want.float().abs().max()),
                    "out": out.float().tolist(),
                }
            except Exception as e:  # the message is what the test reports
                results[tokens] = {
                    "ok": False,
                    "paths": list(ran),
                    "handed": list(handed),
                    "error": f"{type(e).__name__}: {e}",
                }
    print(
        "RESULT " + json.dumps({"avx512_bf16": torch.cpu._is_avx512_bf16_supported(), "runs": results}),
        flush=True,
    )


if __name__ == "__main__":
    main()
