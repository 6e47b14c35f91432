"""Reference modules from transformers with non-trivial random weights, for component tests."""

from __future__ import annotations

import torch

from model.tools.checkpoints import PRESETS


def preset_config(name: str):
    from transformers import Qwen4ExpTextConfig

    return Qwen4ExpTextConfig(**PRESETS[name], eos_token_id=2, pad_token_id=0)


def randomize(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in module.named_parameters():
            if p.ndim == 1:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return module.eval()


def tokens_with_eos(length: int, vocab: int, eos: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (length,), generator=gen)
    ids[torch.rand(length, generator=gen) < 0.08] = eos
    return ids
