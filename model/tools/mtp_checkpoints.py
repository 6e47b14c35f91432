"""Generated test checkpoints with MTP (multi-token prediction) layers, for ``QWEN4EXP_SPECULATIVE=mtp``.

A preset of :mod:`model.tools.checkpoints` plus ``N`` MTP layers in the layout vLLM 0.32's
``Qwen4ExpMTP`` (``vllm/models/qwen4_exp/nvidia/mtp.py``) loads, trained together with the main
model so its drafts are accepted at a realistic rate. A module of its own rather than an option of
``checkpoints.py``: ``tests/agent_checkpoint.py`` fingerprints that file's bytes and
``tests/unit/test_pinned_checkpoints.py`` pins the fingerprint, so any edit there would make the
pinned agent checkpoint stale. With ``--mtp-layers 0`` this writes what ``checkpoints.py`` writes.

The layout, read from vLLM's loader (``Qwen4ExpMTP.load_weights`` maps ``mtp.X`` to ``model.X``
and keeps only ``mtp.*``, ``model.embed_tokens.*`` and ``lm_head.*``):

* config.json: ``mtp_num_hidden_layers: N`` (vLLM's speculative config reads it as ``n_predict``;
  ``model.deployment.speculative`` reads it too);
* ``mtp.pre_fc_norm_embedding.weight`` [H] and ``mtp.pre_fc_norm_hidden.weight`` [hc*H]
  (Gemma RMSNorms, ``(1 + w)``; the hidden one over all hc*H features at once);
* ``mtp.fc_embedding.weight`` and ``mtp.fc_hidden.weight`` [H, H] (``fc_hidden`` applied to each of
  the hc streams);
* ``mtp.layers.{i}.*`` for i < N: one QSA decoder layer each (attention with its indexer, MoE,
  both hyper-connections; never PLE), the same tensors as a main-model QSA layer under
  ``model.layers.{k}.*``;
* ``mtp.hyper_connection_mixer.{hc_norm,input_mix_weight_down,input_mix_weight_up}.weight``: the
  MTP's own final mixer (no ``block_inject_weight``);
* embeddings and LM head are the main model's (``model.embed_tokens.weight``, ``lm_head.weight``).

The composition vLLM's forward computes, and the one trained here (:class:`MTPHead`): for draft step
``k`` at position ``t``, with ``S`` the main model's multi-stream state before its final mixer
([hc*H], step 0) or the previous step's MTP output (later steps), layer ``k % N``::

    e = fc_embedding(norm_e(embed(x[t+k+1])))             # [H]
    s = fc_hidden(norm_h(S).view(hc, H)) + e              # e added to every stream (unit weight)
    S' = decoder_layer(s)                                 # [hc*H], attention over earlier positions
    logits(x[t+k+2]) = lm_head(hyper_connection_mixer(S'))

Usage: ``python -m model.tools.mtp_checkpoints --preset tiny --mtp-layers 1 --out checkpoints/tiny-mtp1``
(the other options as in ``model.tools.checkpoints``, plus ``--mtp-weight``, the MTP loss's weight).
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from model.tools import checkpoints

MTP_FIELD = "mtp_num_hidden_layers"
QSA_LAYER_TYPES = ("indexed_attention", "qwen_sparse_attention")  # transformers >= 5.18 and before
# DeepSeek-V3's MTP loss weight for most of its training: enough for drafts to be useful without
# pulling the main model's own next-token loss far off what the option-off checkpoint reaches.
DEFAULT_MTP_WEIGHT = 0.3


def _qsa_layer_index(config) -> int:
    """A main-model layer of QSA type: the MTP layer is built like it and reuses its mask inputs."""
    for index, kind in enumerate(config.layer_types):
        if kind in QSA_LAYER_TYPES:
            return index
    raise ValueError("the preset has no QSA layer: vLLM's MTP layer is a QSA layer")


class MTPHead(nn.Module):
    """vLLM's Qwen4-Exp MTP module written with transformers' own Qwen4-Exp classes.

    Attribute names are the checkpoint's ``mtp.*`` names (the module is saved as the main model's
    ``mtp`` attribute), so ``save_pretrained`` writes them, per-expert weights included, exactly as
    it writes the main model's layers."""

    def __init__(self, config, layers: int) -> None:
        super().__init__()
        from transformers.models.qwen4_exp import modeling_qwen4_exp as reference

        hidden, streams = config.hidden_size, config.hc_count
        # One QSA decoder layer per MTP layer, without PLE (vLLM's MTP layers never have it: their
        # index lies past num_hidden_layers, outside ple_layer_ids).
        layer_config = copy.deepcopy(config)
        layer_config.layer_types = [config.layer_types[_qsa_layer_index(config)]]
        layer_config.ple_layer_ids = []
        self.pre_fc_norm_embedding = reference.Qwen4ExpTextRMSNorm(hidden, eps=config.rms_norm_eps)
        self.pre_fc_norm_hidden = reference.Qwen4ExpTextRMSNorm(hidden * streams, eps=config.rms_norm_eps)
        self.fc_embedding = nn.Linear(hidden, hidden, bias=False)
        self.fc_hidden = nn.Linear(hidden, hidden, bias=False)
        self.layers = nn.ModuleList(
            reference.Qwen4ExpTextDecoderLayer(layer_config, 0) for _ in range(layers)
        )
        self.hyper_connection_mixer = reference.Qwen4ExpTextGatedResidual(config, use_combine=False)
        self.hc_count, self.hidden_size = streams, hidden

    def step(
        self,
        index: int,
        streams: torch.Tensor,
        next_embeds: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step with layer ``index % N``: (single stream [B, T, H] for the LM head, the
        multi-stream output [B, T, hc*H] the next step starts from)."""
        e = self.fc_embedding(self.pre_fc_norm_embedding(next_embeds))
        s = self.pre_fc_norm_hidden(streams).unflatten(-1, (self.hc_count, self.hidden_size))
        s = (self.fc_hidden(s) + e.unsqueeze(-2)).flatten(-2)
        out = self.layers[index % len(self.layers)](
            s, position_embeddings=position_embeddings, attention_mask=attention_mask
        )
        return self.hyper_connection_mixer(out), out


class JointModel(nn.Module):
    """The main model and its MTP head under one loss, in the shape ``checkpoints.adam_steps``
    trains (``forward(input_ids, labels).loss``): next-token loss plus ``mtp_weight`` times the
    mean over the N draft steps of the step-k loss (token t+k+2 from position t, teacher-forced).
    The MTP gradient reaches the main model through its hidden states, embedding and LM head, as in
    joint MTP training; ``last`` keeps the latest step's parts for the log."""

    def __init__(self, main: nn.Module, head: MTPHead, mtp_weight: float) -> None:
        super().__init__()
        self.main, self.head, self.mtp_weight = main, head, mtp_weight
        self.last: dict[str, float] = {}
        self._captured: dict[str, Any] = {}
        decoder = main.model.layers[_qsa_layer_index(main.config)]
        decoder.register_forward_pre_hook(self._capture_mask, with_kwargs=True)
        main.model.hyper_connection_mixer.register_forward_pre_hook(self._capture_streams)

    def _capture_mask(self, module, args, kwargs) -> None:
        self._captured["position_embeddings"] = kwargs["position_embeddings"]
        self._captured["attention_mask"] = kwargs["attention_mask"]

    def _capture_streams(self, module, args) -> None:
        self._captured["streams"] = args[0]

    def draft_logits(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(main logits [B, T, V], per draft step k the MTP logits [B, T, V] at position t for
        token t+k+2, from the true tokens up to t+k+1; rows past the window are padding)."""
        output = self.main(input_ids=input_ids)
        streams = self._captured["streams"]
        embed, lm_head = self.main.model.embed_tokens, self.main.lm_head
        drafts = []
        for k in range(len(self.head.layers)):
            shifted = torch.roll(input_ids, -(k + 1), dims=1)  # x[t+k+1]; wrapped rows are masked
            single, streams = self.head.step(
                k,
                streams,
                embed(shifted),
                self._captured["position_embeddings"],
                self._captured["attention_mask"],
            )
            drafts.append(lm_head(single))
        return output.logits, drafts

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> SimpleNamespace:
        logits, drafts = self.draft_logits(input_ids)
        main_loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())
        mtp_losses = [
            F.cross_entropy(d[:, : -(k + 2)].flatten(0, 1).float(), labels[:, k + 2 :].flatten())
            for k, d in enumerate(drafts)
        ]
        mtp_loss = torch.stack(mtp_losses).mean()
        self.last = {"main": main_loss.item(), "mtp": mtp_loss.item()}
        return SimpleNamespace(loss=main_loss + self.mtp_weight * mtp_loss)


@torch.no_grad()
def acceptance(joint: JointModel, input_ids: torch.Tensor) -> list[float]:
    """Per draft step k, the share of positions where the MTP's greedy draft equals the main
    model's greedy token there: what greedy speculative decoding accepts for drafts from the true
    prefix (each step's drafts counted alone; a real run accepts draft k only after every earlier
    draft of that step). Measured on the training corpus, so an upper bound for other text."""
    logits, drafts = joint.draft_logits(input_ids)
    target = logits.argmax(-1)  # main model's choice for token t+1 at position t
    rates = []
    for k, d in enumerate(drafts):
        draft = d[:, : -(k + 2)].argmax(-1)  # for token t+k+2 at position t
        rates.append((draft == target[:, k + 1 : -1]).float().mean().item())
    return rates


def make_mtp_checkpoint(
    preset: str,
    out: str | Path,
    mtp_layers: int = 1,
    seed: int = 0,
    train_steps: int = 80,
    device: str = "cpu",
    init: str = "random",
    mtp_weight: float = DEFAULT_MTP_WEIGHT,
) -> Path:
    """``checkpoints.make_checkpoint`` with ``mtp_layers`` MTP layers (0: exactly that function).

    The main model is drawn as there (same seed, same generator), the MTP head from its own
    generator (``seed + 1``) so it does not shift the main model's draw; training is joint
    (:class:`JointModel`) on ``checkpoints.train_briefly``'s windows."""
    if mtp_layers < 0:
        raise ValueError(f"mtp_layers {mtp_layers}: use 0 or more")
    if not mtp_layers:
        return checkpoints.make_checkpoint(preset, out, seed, train_steps, device, init)
    if init not in checkpoints.INITS:
        raise ValueError(f"init {init!r}: use one of {checkpoints.INITS}")
    if train_steps and device != "cpu":
        raise ValueError(f"--train-steps {train_steps} with --device {device}: training runs on the CPU only")
    from transformers import AutoTokenizer, Qwen4ExpForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config, generation = checkpoints.text_config(checkpoints.preset_spec(preset), out)
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen4ExpForCausalLM(config)
        head = MTPHead(config, mtp_layers)
    if init == "random":
        checkpoints._randomize(model, torch.Generator(device=device).manual_seed(seed))
        checkpoints._randomize(head, torch.Generator(device=device).manual_seed(seed + 1))
    joint = JointModel(model, head, mtp_weight)
    rates: list[float] = []
    if train_steps:
        tokenizer = AutoTokenizer.from_pretrained(out)
        seq_len = min(config.indexer_budget, checkpoints.MAX_TRAIN_SEQ_LEN)
        losses = checkpoints.train_briefly(joint, tokenizer, train_steps, seq_len, seed)
        print(
            f"trained {train_steps} steps: loss {losses[0]:.2f} -> {sum(losses[-10:]) / len(losses[-10:]):.2f} "
            f"(last step: main {joint.last['main']:.2f}, mtp {joint.last['mtp']:.2f})"
        )
        rates = _corpus_acceptance(joint, tokenizer, seq_len)
        print("greedy draft acceptance on the corpus, per step: " + ", ".join(f"{r:.2f}" for r in rates))
    model = model.to(torch.bfloat16)
    model.mtp = head.to(torch.bfloat16)  # saved as mtp.*; transformers ignores ^mtp.* on loading
    model.config.mtp_num_hidden_layers = mtp_layers
    model.generation_config = generation
    model.save_pretrained(out)
    stamp = {"preset": preset, "seed": seed, "train_steps": train_steps, "device": device, "init": init}
    stamp.update(mtp_layers=mtp_layers, mtp_weight=mtp_weight, mtp_acceptance=[round(r, 3) for r in rates])
    (out / "PRESET").write_text(json.dumps(stamp) + "\n")
    return out


def _corpus_acceptance(joint: JointModel, tokenizer, seq_len: int) -> list[float]:
    """:func:`acceptance` over the corpus in windows of ``seq_len`` (float32, dense indexer as in
    training: every window fits the QSA budget)."""
    from transformers.models.qwen4_exp import modeling_qwen4_exp as reference

    ids = torch.tensor(tokenizer(checkpoints.CORPUS)["input_ids"])
    windows = torch.stack([ids[s : s + seq_len] for s in range(0, ids.numel() - seq_len + 1, seq_len)])
    original = reference.Qwen4ExpTextQSAIndexer.forward
    reference.Qwen4ExpTextQSAIndexer.forward = checkpoints._dense_indexer_forward
    try:
        return acceptance(joint, windows)
    finally:
        reference.Qwen4ExpTextQSAIndexer.forward = original


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--preset",
        default="tiny",
        help=f"one of {sorted(checkpoints.PRESETS)} or {checkpoints.DRAWN_PREFIX}<seed>",
    )
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--mtp-layers", type=int, default=1, help="MTP layers to write (0: checkpoints.py's output)"
    )
    parser.add_argument("--mtp-weight", type=float, default=DEFAULT_MTP_WEIGHT, help="the MTP loss's weight")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train-steps", type=int, default=80)
    parser.add_argument("--device", default="cpu", help="where random weights are drawn (0 train steps)")
    parser.add_argument("--init", default="random", choices=checkpoints.INITS, help="see make_checkpoint")
    args = parser.parse_args()
    print(
        make_mtp_checkpoint(
            args.preset,
            args.out,
            args.mtp_layers,
            args.seed,
            args.train_steps,
            args.device,
            args.init,
            args.mtp_weight,
        )
    )


if __name__ == "__main__":
    main()
