"""PLE n-gram hashing: which table rows a token's n-grams read.

Every PLE layer hashes the n-grams (orders 2..ngram_size) that end at each token into
``heads_per_ngram`` independent tables per order. The hash of an n-gram is the XOR of each
token times a per-layer odd multiplier (derived from ``seed`` with splitmix64), taken modulo a
distinct prime vocabulary size per head. Documents are separated by EOS: an n-gram never reaches
back across an EOS token; positions before the segment start read as EOS.

Only the last ``ngram_size - 1`` tokens of a request are needed to continue hashing in the next
step, so serving carries them as per-request state (``context``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
_LAYER_SEED_STRIDE = 10007


def _splitmix64(value: int) -> int:
    value = (value + _GAMMA) & _MASK64
    value = ((value ^ (value >> 30)) * _MIX1) & _MASK64
    value = ((value ^ (value >> 27)) * _MIX2) & _MASK64
    return (value ^ (value >> 31)) & _MASK64


def layer_multipliers(vocab_size: int, ngram_size: int, ple_layer_index: int, seed: int) -> list[int]:
    """Odd multipliers, small enough that ``token * multiplier`` never overflows int64."""
    bound = max(1, (((1 << 63) - 1) // max(vocab_size, 1)) // 2)
    layer_seed = seed + _LAYER_SEED_STRIDE * ple_layer_index
    return [
        2 * (_splitmix64((layer_seed + _GAMMA * (i + 1)) & _MASK64) % bound) + 1 for i in range(ngram_size)
    ]


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


def primes_after(start: int, count: int) -> list[int]:
    """The first ``count`` primes strictly greater than ``start``."""
    out: list[int] = []
    candidate = start
    while len(out) < count:
        candidate += 1
        if _is_prime(candidate):
            out.append(candidate)
    return out


@dataclass(frozen=True)
class NgramLayout:
    """Hash parameters and table geometry of one PLE layer, derived from the config alone."""

    ngram_size: int
    heads_per_ngram: int
    eos_token_id: int
    multipliers: tuple[int, ...]
    head_vocab_sizes: tuple[int, ...]
    head_offsets: tuple[int, ...]
    padded_rows: int

    @property
    def num_heads(self) -> int:
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def context_len(self) -> int:
        return self.ngram_size - 1


def ngram_layout(
    *,
    vocab_size: int,
    ngram_size: int,
    heads_per_ngram: int,
    ngram_vocab_size_base: int,
    vocab_divisor: int,
    seed: int,
    eos_token_id: int,
    ple_layer_index: int,
) -> NgramLayout:
    num_heads = (ngram_size - 1) * heads_per_ngram
    # Head vocabularies are consecutive primes above the base, numbered across all PLE layers.
    all_primes = primes_after(ngram_vocab_size_base - 1, (ple_layer_index + 1) * num_heads)
    sizes = all_primes[ple_layer_index * num_heads :]
    offsets = [sum(sizes[:i]) for i in range(num_heads)]
    total = sum(sizes)
    padded = math.ceil(total / vocab_divisor) * vocab_divisor
    return NgramLayout(
        ngram_size=ngram_size,
        heads_per_ngram=heads_per_ngram,
        eos_token_id=eos_token_id,
        multipliers=tuple(layer_multipliers(vocab_size, ngram_size, ple_layer_index, seed)),
        head_vocab_sizes=tuple(sizes),
        head_offsets=tuple(offsets),
        padded_rows=padded,
    )


def layout_from_config(config, ple_layer_index: int) -> NgramLayout:
    """The layout of PLE layer number ``ple_layer_index`` (0-based among PLE layers) of a HF config."""
    eos = config.eos_token_id
    return ngram_layout(
        vocab_size=config.vocab_size,
        ngram_size=config.ngram_size,
        heads_per_ngram=config.heads_per_ngram,
        ngram_vocab_size_base=config.ngram_vocab_size_base,
        vocab_divisor=config.make_ngram_vocab_size_divisible_by,
        seed=config.seed,
        eos_token_id=int(eos[0] if isinstance(eos, list) else eos),
        ple_layer_index=ple_layer_index,
    )


def token_windows(tokens: torch.Tensor, context: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
    """``windows[t, j]`` = the token ``j`` places before token ``t`` (``j = 0`` is ``t`` itself).

    ``tokens`` is the flattened batch ``[T]``, ``context`` the ``ngram_size - 1`` tokens preceding
    each request's first token ``[R, n-1]`` (EOS where the request has no history), and
    ``query_start_loc`` ``[R+1]`` the request boundaries.
    """
    n_ctx = context.shape[1]
    num_reqs = context.shape[0]
    lens = query_start_loc[1:] - query_start_loc[:-1]
    req_of_token = torch.repeat_interleave(torch.arange(num_reqs, device=tokens.device), lens)
    local = torch.arange(tokens.shape[0], device=tokens.device) - query_start_loc[:-1][req_of_token]
    # Position of each token inside its request's [context | tokens] row.
    extended = torch.cat(
        [context.long(), tokens.new_zeros((num_reqs, int(lens.max()) if num_reqs else 0))], 1
    )
    extended[req_of_token, n_ctx + local] = tokens.long()
    back = torch.arange(n_ctx + 1, device=tokens.device)
    cols = (n_ctx + local).unsqueeze(1) - back.unsqueeze(0)
    return extended[req_of_token.unsqueeze(1), cols]


def ngram_row_ids(windows: torch.Tensor, layout: NgramLayout) -> torch.Tensor:
    """Global table rows ``[T, num_heads]`` for token windows ``[T, ngram_size]``."""
    eos = layout.eos_token_id
    # A window position is valid only if no EOS lies between it and the current token.
    seen_eos = torch.cumsum((windows[:, 1:] == eos).long(), dim=1) > 0
    shifted = torch.cat([windows[:, :1], torch.where(seen_eos, eos, windows[:, 1:])], dim=1)
    mult = torch.tensor(layout.multipliers, dtype=torch.long, device=windows.device)
    sizes = torch.tensor(layout.head_vocab_sizes, dtype=torch.long, device=windows.device)
    offsets = torch.tensor(layout.head_offsets, dtype=torch.long, device=windows.device)
    products = shifted * mult
    blocks = []
    mixed = products[:, 0]
    h = layout.heads_per_ngram
    for order in range(2, layout.ngram_size + 1):
        mixed = torch.bitwise_xor(mixed, products[:, order - 1])
        lo = (order - 2) * h
        blocks.append(torch.remainder(mixed.unsqueeze(-1), sizes[lo : lo + h]) + offsets[lo : lo + h])
    return torch.cat(blocks, dim=-1)


def next_context(windows: torch.Tensor, query_start_loc: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
    """The ``n-1`` most recent tokens of each request after this step (for its next step)."""
    n_ctx = context.shape[1]
    lens = query_start_loc[1:] - query_start_loc[:-1]
    out = context.clone()
    has = lens > 0
    last = query_start_loc[1:] - 1
    # windows[last, 0..n_ctx-1] are the last token and the ones before it, newest first.
    recent = windows[last.clamp_min(0)][:, :n_ctx].flip(1)
    out[has] = recent[has]
    return out
