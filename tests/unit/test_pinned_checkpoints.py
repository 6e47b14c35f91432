"""The checkpoints pinned as test data are the ones their generators would build now.

Why: a pinned copy saves the suite its training time, but one that no longer matches its generator
would be skipped in favour of a fresh build (the saving silently lost) or, worse, kept while the
generator's intent changed. This says which pin to renew and how.
"""

from __future__ import annotations

from tests import agent_checkpoint
from tests.conftest import PINNED


def test_the_pinned_agent_checkpoint_matches_its_generator():
    stamp = (PINNED / "agent" / "FINGERPRINT").read_text().strip()
    assert stamp == agent_checkpoint.fingerprint(), (
        "tests/data/checkpoints/agent is stale: renew it with "
        "python -m tests.agent_checkpoint tests/data/checkpoints/agent"
    )
