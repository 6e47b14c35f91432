"""The hyper-connection gate mix's rounding order, alone, on the repetitive case (CPU, transformers).

``python -m tests.fidelity.gate_mix_order [--prompts short,chat,p600,salted-1,salted-2]``

Prompt names are the case's own (``short``, ``chat``, ``p600``, ``p2500``...) or ``salted-<seed>``:
600 tokens of the checkpoint tokenizer's text of the project corpus, shuffled and salted with random
tokens (``measure.prompts_of_lengths``), text that does not repeat.

Builds ``tests.fidelity.repetitive_case`` and measures, teacher-forced against transformers in
float32, transformers' own bf16 run twice: as it is (``sigmoid(g)`` and each product rounded to bf16
before the mean, as our implementation and ``model/upstream/hc_mix.py`` compute it) and with only
the gate mix changed to vLLM's own kernel's order (float32 throughout, one rounding:
``qwen4_exp/nvidia/ops/hc.py``, ``_hc_gate_mix_kernel``). Everything else stays transformers' bf16.
Both orders are equally exact per operation; the table shows what the order alone does to a
checkpoint whose MoE routers sit near ties on text that repeats.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from transformers.models.qwen4_exp import modeling_qwen4_exp as reference

from tests.fidelity import measure
from tests.fidelity.repetitive_case import build_checkpoint, prompts

_transformers_forward = reference.Qwen4ExpTextGatedResidual.forward


def _upstream_order_forward(self, hyper_input: torch.Tensor):
    """transformers' gated residual with the gate mix in upstream's order (the rest unchanged)."""
    hc, hidden = self.hc_count, self.hidden_size
    normed = self.hc_norm(hyper_input)
    gate = self.input_mix_weight_up(torch.nn.functional.silu(self.input_mix_weight_down(normed) / hc))
    mixed = (torch.sigmoid(gate.float()) * normed.float()).unflatten(-1, (hc, hidden)).sum(-2) / hc
    mixed = mixed.to(normed.dtype)
    if self.block_inject_weight is None:
        return mixed
    return mixed, hyper_input, 2 * torch.sigmoid(self.block_inject_weight(normed) / hc)


def measure_orders(names: list[str]) -> dict[str, measure.Fidelity]:
    with tempfile.TemporaryDirectory() as tmp:
        path = build_checkpoint(f"{tmp}/case")
        case = prompts(path)
        chosen = [
            measure.prompts_of_lengths(path, [600], seed=int(n.split("-")[1]))[0]
            if n.startswith("salted-")
            else case[n]
            for n in names
        ]
        ref32 = measure.transformers_token_logprobs(path, chosen, torch.float32)
        out = {}
        for label, forward in (
            ("transformers-bf16 (its own gate mix order)", _transformers_forward),
            ("transformers-bf16, gate mix in upstream's order", _upstream_order_forward),
        ):
            reference.Qwen4ExpTextGatedResidual.forward = forward
            try:
                got = measure.transformers_token_logprobs(path, chosen, torch.bfloat16)
            finally:
                reference.Qwen4ExpTextGatedResidual.forward = _transformers_forward
            out[label] = {
                n: measure.fidelity([r], measure.as_observed([g]))
                for n, r, g in zip(names, ref32, got, strict=True)
            }
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", default="short,chat,p600,salted-1,salted-2,salted-3")
    names = parser.parse_args().prompts.split(",")
    results = measure_orders(names)
    print("mean |delta| nats / p99 / top-1 agreement on decisive positions, vs transformers float32 (CPU)\n")
    print("| run | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for label, per in results.items():
        print(f"| {label} | " + " | ".join(per[n].as_row() for n in names) + " |")


if __name__ == "__main__":
    main()
