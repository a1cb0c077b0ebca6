"""The agent's reconnect delay: full jitter under an exponential cap."""

from __future__ import annotations

import random

from llmgw_agent.agent import backoff_delay


def test_full_jitter_stays_under_the_exponential_cap_and_spreads() -> None:
    rng = random.Random(1)
    for attempt, ceiling in [(0, 0.5), (1, 1.0), (3, 4.0), (6, 30.0), (60, 30.0)]:
        delays = [backoff_delay(attempt, 0.5, 30.0, rng) for _ in range(2000)]
        assert all(0 <= d <= ceiling for d in delays)
        # Spread over the whole window, so a fleet does not come back in lockstep.
        assert min(delays) < ceiling * 0.05 and max(delays) > ceiling * 0.95
