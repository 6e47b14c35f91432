"""Prompts for the parity tests, as token ids; defined in :mod:`model.tools.cases`, which the benchmarks share."""

from __future__ import annotations

from model.tools.cases import SENTENCES, parity_prompts

__all__ = ["SENTENCES", "parity_prompts"]
