"""Multi-turn conversations whose turns share a per-conversation prefix, sent through a router.

Each conversation has its own system prompt (~450 tokens of the ``tiny`` tokenizer) and every
turn appends a user message of ~290 tokens plus the previous short answer, so turn 5 is ~1,600
tokens (under the replicas' 2,048). The hybrid model's prefix cache works in whole blocks (the
block size is the engine's: 256 tokens on AVX512-BF16 CPUs, which keep GDN states in float32, 128
on AVX2 CPUs), so each turn can reuse about one more block than the one before, on the replica that
served it.

Requests are sent one at a time, turn by turn, and the order of the conversations rotates each
turn. Sent one at a time, every request is attributed to a replica exactly: the replica whose
answered-chat counter went up. Rotating keeps round robin from landing, by the period of the
order alone, on the same replica for every turn of a conversation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import openai

from .cluster import KEY, Replica

WORDS = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa"
).split()
CONVERSATIONS = 4
TURNS = 5
SYSTEM_WORDS = 40
USER_WORDS = 60
MAX_TOKENS = 4


def words(seed: int, n: int) -> str:
    """Deterministic filler text; a different seed gives a different sequence from the first word."""
    return " ".join(WORDS[(seed * 7 + i * 3 + i * i) % len(WORDS)] for i in range(n))


def client(base_url: str, key: str = KEY, timeout: float = 60.0) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key=key, max_retries=0, timeout=timeout)


@dataclass
class Request:
    """One chat request of a pass, in the order sent."""

    conversation: int
    replica: int
    prompt_tokens: int
    hits: float  # prompt tokens the replica's prefix cache served (its vLLM counter's rise)


@dataclass
class Run:
    """What one pass of the conversations did, per replica and per request."""

    queries: float = 0.0  # the replicas' prefix-cache counters over the whole pass
    hits: float = 0.0
    requests: list[Request] = field(default_factory=list)

    @property
    def placement(self) -> dict[int, list[int]]:
        """Conversation -> the replica of each of its turns."""
        out: dict[int, list[int]] = {}
        for r in self.requests:
            out.setdefault(r.conversation, []).append(r.replica)
        return out

    @property
    def prompt_tokens(self) -> list[int]:
        return [r.prompt_tokens for r in self.requests]

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def expected_hits(self, block: int) -> list[int]:
        """Per request, the prompt tokens a prefix cache of ``block``-token blocks can serve on the
        replica that got it: the whole blocks of the longest earlier prompt of the same conversation
        on that replica (every turn's prompt starts with each earlier turn's whole prompt, and no
        two conversations share a block). What placement alone decides."""
        out = []
        for i, r in enumerate(self.requests):
            earlier = [
                e.prompt_tokens
                for e in self.requests[:i]
                if e.conversation == r.conversation and e.replica == r.replica
            ]
            out.append(max(earlier, default=0) // block * block)
        return out


def answered_by(replicas: list[Replica], before: list[float]) -> int:
    """The replicas whose answered-chat counter rose since ``before``. A replica counts a request
    after its last byte is sent, so the count may lag the client by a moment: poll briefly."""
    for _ in range(50):
        after = [r.counters()["chat"] for r in replicas]
        served = [i for i, (a, b) in enumerate(zip(after, before, strict=True)) if a > b]
        if served:
            assert len(served) == 1 and sum(after) - sum(before) == 1, (before, after)
            return served[0]
        time.sleep(0.05)
    raise AssertionError(f"no replica counted the request (counters {before})")


def run_conversations(base_url: str, replicas: list[Replica], tag: str) -> Run:
    """Send CONVERSATIONS x TURNS chat requests through ``base_url`` (a router). ``tag`` (one
    character) opens every prompt, so no earlier pass's cache can serve this one, while the token
    counts stay those of any other pass: two passes are the same workload."""
    assert len(tag) == 1, tag
    api = client(base_url)
    seed = 0
    messages = [
        [{"role": "system", "content": f"{tag} conversation {c}: {words(seed + c, SYSTEM_WORDS)}"}]
        for c in range(CONVERSATIONS)
    ]
    run = Run()
    start = [r.counters() for r in replicas]
    for turn in range(TURNS):
        for k in range(CONVERSATIONS):
            c = (k + turn) % CONVERSATIONS
            messages[c].append(
                {"role": "user", "content": f"turn {turn}: {words(seed + 10 * c + turn, USER_WORDS)}"}
            )
            counted = [r.counters() for r in replicas]
            answer = api.chat.completions.create(
                model="tiny", messages=messages[c], max_tokens=MAX_TOKENS, temperature=0
            )
            served = answered_by(replicas, [n["chat"] for n in counted])
            hits = replicas[served].counters()["hits"] - counted[served]["hits"]
            run.requests.append(Request(c, served, answer.usage.prompt_tokens, hits))
            messages[c].append({"role": "assistant", "content": answer.choices[0].message.content or ""})
    end = [r.counters() for r in replicas]
    run.queries = sum(e["queries"] - s["queries"] for s, e in zip(start, end, strict=True))
    run.hits = sum(e["hits"] - s["hits"] for s, e in zip(start, end, strict=True))
    return run
