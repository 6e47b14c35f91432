"""Build vLLM's own Qwen4-Exp MTP drafter (``Qwen4ExpMTP``) on vLLM's CPU build and load a checkpoint
into it: ``python -m tests.mtp_layout_probe CHECKPOINT`` prints one JSON object.

Why a child process: it starts vLLM's distributed state and replaces two module globals of
upstream's code, which must not leak into the test process. Why the replacements: upstream's
package imports torchvision (absent from the CPU wheel; ``tests.upstream.importer`` stands it in),
vLLM inspects registered architectures in a fresh subprocess without that stand-in (so the class
is registered here as an object, inspected in this process), and the QSA attention's constructor
refuses to run without FlashAttention, which only decides the forward, not the parameters. Nothing
runs forward: what this proves is the parameter layout and that ``load_weights`` places every
checkpoint tensor.

Output: ``params`` (name -> shape of every parameter of the drafter), ``not_loaded`` (parameters
``load_weights`` did not report), ``mismatched`` (parameters whose loaded value differs from the
checkpoint tensors they are built from), ``checked`` (how many were compared).
"""

from __future__ import annotations

import json
import socket
import sys

import torch


def expected_values(name: str, ckpt: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The value parameter ``name`` of the drafter must hold, assembled from the checkpoint as its
    loader packs it (q/k/v plus the indexer's projection, gate/up, per-expert stacks, down + inject);
    None for a parameter this does not know. The main model's own ``model.layers.*`` and
    ``model.hyper_connection_mixer.*`` are never a source: the drafter's come from ``mtp.*``."""
    if name in ("model.embed_tokens.weight", "lm_head.weight"):  # the main model's, shared
        return ckpt[name]
    if not name.startswith("model."):
        return None
    src = "mtp." + name.removeprefix("model.")
    if src in ckpt:
        return ckpt[src]
    base, _, leaf = src.rpartition(".")
    if leaf == "weight" and base.endswith(".qkv_proj"):
        attn = base.removesuffix(".qkv_proj")
        parts = [f"{attn}.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "indexer.index_qk_proj")]
        return torch.cat([ckpt[p] for p in parts])
    if base.endswith(".shared_expert.gate_up_proj"):
        mlp = base.removesuffix(".gate_up_proj")
        return torch.cat([ckpt[f"{mlp}.gate_proj.weight"], ckpt[f"{mlp}.up_proj.weight"]])
    if base.endswith(".experts.routed_experts") and leaf in ("w13_weight", "w2_weight"):
        experts = base.removesuffix(".routed_experts")
        count = sum(1 for k in ckpt if k.startswith(f"{experts}.") and k.endswith(".down_proj.weight"))
        if leaf == "w2_weight":
            return torch.stack([ckpt[f"{experts}.{e}.down_proj.weight"] for e in range(count)])
        return torch.stack(
            [
                torch.cat([ckpt[f"{experts}.{e}.gate_proj.weight"], ckpt[f"{experts}.{e}.up_proj.weight"]])
                for e in range(count)
            ]
        )
    if base.endswith(".input_mix_weight_down_block_inject"):
        hc = base.removesuffix(".input_mix_weight_down_block_inject")
        return torch.cat(
            [ckpt[f"{hc}.input_mix_weight_down.weight"], ckpt[f"{hc}.block_inject_weight.weight"]]
        )
    return None


def main(checkpoint: str) -> None:
    from safetensors.torch import load_file

    from tests.upstream.importer import import_upstream

    mtp = import_upstream("vllm.models.qwen4_exp.nvidia.mtp")
    qsa = import_upstream("vllm.models.qwen4_exp.nvidia.qsa")
    qsa.is_flash_attn_varlen_func_available = lambda: True
    from vllm import ModelRegistry
    from vllm.config import replace, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs

    ModelRegistry.register_model("Qwen4ExpMTP", mtp.Qwen4ExpMTP)
    engine = EngineArgs(
        model=checkpoint,
        speculative_config={"method": "mtp", "num_speculative_tokens": 1},
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=256,
    ).create_engine_config()
    draft = replace(engine, model_config=engine.speculative_config.draft_model_config)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(draft):
        init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, "gloo")
        initialize_model_parallel(1, 1)
        model = mtp.Qwen4ExpMTP(vllm_config=draft, prefix="")
    ckpt = load_file(f"{checkpoint}/model.safetensors")
    loaded = model.load_weights(iter(ckpt.items()))
    params = dict(model.named_parameters())
    mismatched, checked = [], 0
    for name, param in params.items():
        want = expected_values(name, ckpt)
        if want is None:
            continue
        checked += 1
        # The merged down + inject projection has padding rows past the checkpoint's (16-row
        # alignment) whose content is never read: compare the rows the checkpoint fills.
        have = param.data[: want.shape[0]] if name.endswith("_block_inject.weight") else param.data
        if tuple(want.shape) != tuple(have.shape) or not torch.equal(want.to(have.dtype), have):
            mismatched.append(name)
    print(
        json.dumps(
            {
                "architectures": draft.model_config.hf_config.architectures,
                "params": {n: list(p.shape) for n, p in params.items()},
                "not_loaded": sorted(set(params) - loaded),
                "mismatched": mismatched,
                "checked": checked,
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1])
