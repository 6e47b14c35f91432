"""Speculative decoding: which method runs, decided from the request, the checkpoint and the implementation.

vLLM does the drafting and verifying (``--speculative-config``); this module only decides what to
ask it for. Why each rule:

* ``mtp`` needs the checkpoint's multi-token-prediction layers (``mtp_num_hidden_layers`` in
  config.json and their ``mtp.*`` weights): asked for without them it is a configuration error, not
  a silent ``off``.
* ``auto`` takes ``mtp`` where the checkpoint has it: public 4x RTX 3090 recipes of this
  architecture measure about 2.1x at batch 1 with 3 MTP drafts. It does not take ``ngram``, which
  pays only where the output copies earlier text and costs a verify step's extra work elsewhere.
* Our implementation (the CPU build's, and CUDA's with ``QWEN4EXP_CUDA_MODEL=ours``) keeps PLE
  state that it cannot roll back over rejected drafts, so it never speculates; an explicit request
  there is served without speculation and the start-up log says why: a deployment that serves
  slower is better than one that does not start.
* ``mtp`` there has two more reasons, named in that log line: vLLM's MTP drafter starts from the
  target's pre-final-mixer multi-stream state (``get_mtp_target_hidden_states``), which our
  implementation does not provide (nor does it load the ``mtp.*`` weights), and vLLM's own
  Qwen4-Exp drafter (``Qwen4ExpMTP``, ``vllm/models/qwen4_exp/nvidia/mtp.py``) does not load on
  vLLM's CPU build: its import needs torchvision, which the CPU wheel lacks, so vLLM's
  speculative config fails to inspect the architecture; past that, its QSA layer refuses to be
  built without FlashAttention, and its hyper-connection ops are Triton kernels.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from model.runtime import envs


class SpeculativeError(ValueError):
    """The speculative request cannot be served by this checkpoint; the message names the fix."""


@dataclass(frozen=True)
class Speculative:
    """What vLLM is asked to run: ``method`` ("mtp" or "ngram"), drafts per step, the n-gram window."""

    method: str
    draft_tokens: int
    ngram_min: int | None = None
    ngram_max: int | None = None

    def vllm_config(self) -> dict[str, Any]:
        """vLLM's ``--speculative-config``."""
        out: dict[str, Any] = {"method": self.method, "num_speculative_tokens": self.draft_tokens}
        if self.method == "ngram":
            out.update(prompt_lookup_min=self.ngram_min, prompt_lookup_max=self.ngram_max)
        return out


def mtp_layers(config: Mapping[str, Any] | None) -> int:
    """MTP layers config.json declares (top level or in ``text_config``); 0 if none or unknown."""
    if not config:
        return 0
    for section in (config, config.get("text_config") or {}):
        value = section.get("mtp_num_hidden_layers")
        if isinstance(value, int) and value > 0:
            return value
    return 0


def mtp_tensors_present(checkpoint: str | Path) -> bool | None:
    """Whether a local checkpoint's safetensors hold ``mtp.*`` tensors (``model.mtp.*`` too), read
    from the index or the files' headers without loading a tensor; None where it is not a local
    directory of safetensors (a hub name, another format)."""
    root = Path(checkpoint)
    index = root / "model.safetensors.index.json"
    try:
        if index.is_file():
            names = list(json.loads(index.read_text())["weight_map"])
        else:
            files = sorted(root.glob("*.safetensors"))
            if not files:
                return None
            names = [name for path in files for name in _header_names(path)]
    except (OSError, ValueError, KeyError):
        return None
    return any(name.startswith(("mtp.", "model.mtp.")) for name in names)


def _header_names(path: Path) -> list[str]:
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    return [name for name in header if name != "__metadata__"]


def declined(requested: str, chosen: Speculative | None) -> bool:
    """A method asked for by name that will not run (our implementation): worth a warning."""
    return requested in ("ngram", "mtp") and chosen is None


def choose(
    requested: str,
    draft_tokens: int,
    ngram_window: tuple[int, int],
    *,
    implementation: str,
    config: Mapping[str, Any] | None,
    has_mtp_weights: bool | None = None,
) -> tuple[Speculative | None, str]:
    """(what to run or None, one line saying why) for ``QWEN4EXP_SPECULATIVE=requested``.

    ``config``: config.json (None: not readable here, then ``auto`` is off and ``mtp`` is left to
    vLLM's own check); ``has_mtp_weights``: whether the checkpoint's tensors include ``mtp.*``
    (None: not known here)."""
    layers = mtp_layers(config)
    has_mtp = bool(layers) and has_mtp_weights is not False
    if requested == "off":
        return None, "speculative decoding: off (QWEN4EXP_SPECULATIVE=off)"
    if requested == "mtp" and config is not None and not has_mtp:
        missing = (
            "no mtp_num_hidden_layers in config.json" if not layers else "no mtp.* tensors in its weights"
        )
        raise SpeculativeError(
            f"{envs.SPECULATIVE}=mtp: this checkpoint has {missing}; fix: use "
            f"{envs.SPECULATIVE}=ngram or off, or a checkpoint with MTP layers"
        )
    if implementation != "upstream":
        if requested == "auto":
            return None, "speculative decoding: off (our implementation does not speculate)"
        why_not_mtp = (
            " and does not give vLLM's MTP drafter the multi-stream hidden state it starts from; on "
            "vLLM's CPU build vLLM's own Qwen4-Exp MTP drafter does not load either"
            if requested == "mtp"
            else ""
        )
        return None, (
            f"speculative decoding: off although {envs.SPECULATIVE}={requested}: our implementation "
            "(vLLM's CPU build, or QWEN4EXP_CUDA_MODEL=ours) cannot roll its PLE state back over rejected "
            f"drafts{why_not_mtp}; serving without it"
        )
    if requested == "auto":
        if not has_mtp:
            return None, "speculative decoding: off (auto: the checkpoint has no MTP layers)"
        requested = "mtp"
    if requested == "mtp":
        return Speculative("mtp", draft_tokens), (
            f"speculative decoding: mtp, {draft_tokens} draft tokens a step ({layers or '?'} MTP layer(s))"
        )
    lo, hi = ngram_window
    return Speculative("ngram", draft_tokens, lo, hi), (
        f"speculative decoding: ngram, {draft_tokens} draft tokens a step, prompt lookup of {lo} to {hi} tokens"
    )
