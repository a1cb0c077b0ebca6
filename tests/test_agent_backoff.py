"""The agent's reconnect delay: full jitter under an exponential cap, started over only
after a session on which the control plane answered for a while."""

from __future__ import annotations

import random
from typing import cast

import attrs
import trio_websocket
from hypothesis import given
from hypothesis import strategies as st

from llmgw_agent.agent import (
    CONNECT_TIMEOUT_S,
    RESTART_JITTER_S,
    Session,
    backoff_delay,
    next_attempt,
    reconnect_delay,
    restart_redial_delay,
)
from llmgw_agent.config import AgentConfig
from llmgw_core.agent_lane import MAX_COME_BACK_S
from llmgw_core.dial import retry_after
from llmgw_core.ws_frames import Heard, SilenceBound, silence_bound
from llmgw_http.server import ServerLimits
from llmgw_http.tls_admission import AdmissionLimits


def test_full_jitter_stays_under_the_exponential_cap_and_spreads() -> None:
    rng = random.Random(1)
    for attempt, ceiling in [(0, 0.5), (1, 1.0), (3, 4.0), (6, 30.0), (60, 30.0)]:
        delays = [backoff_delay(attempt, 0.5, 30.0, rng) for _ in range(2000)]
        assert all(0 <= d <= ceiling for d in delays)
        # Spread over the whole window, so a fleet does not come back in lockstep.
        assert min(delays) < ceiling * 0.05 and max(delays) > ceiling * 0.95


# attrs types a field's default as optional (a field may have none); these have one.
DEFAULT_BASE = cast(float, attrs.fields(AgentConfig).reconnect_base_s.default)
DEFAULT_CAP = cast(float, attrs.fields(AgentConfig).reconnect_cap_s.default)


@given(
    attempt=st.integers(min_value=0, max_value=10_000),
    base=st.floats(min_value=0.01, max_value=100),
    extra=st.floats(min_value=0, max_value=1000),
    seed=st.integers(min_value=0, max_value=2**32),
)
def test_a_delay_is_never_negative_nor_past_the_window(
    attempt: int, base: float, extra: float, seed: int
) -> None:
    cap = base + extra
    delay = backoff_delay(attempt, base, cap, random.Random(seed))
    assert 0 <= delay <= min(cap, base * 2 ** min(attempt, 30))


def test_by_default_a_refused_fleet_comes_back_slower_than_a_busy_control_plane_admits() -> None:
    """Finding 12: with a 0.5 s base, 10,000 agents refused at once came back at 10,000 a
    second, each retry before the queue drained (9.5 attempts a node). The defaults
    spread a refused fleet over 2 * base seconds, twice as long after each refusal, and
    agents refused together never fall into step: no second of any round is crowded."""
    assert (DEFAULT_BASE, DEFAULT_CAP) == (2.0, 60.0)
    n = 10_000
    agents = [random.Random(k) for k in range(n)]  # each agent its own generator
    at = [0.0] * n  # all refused at the same instant
    for failures in range(1, 6):
        at = [t + backoff_delay(failures, DEFAULT_BASE, DEFAULT_CAP, rng) for t, rng in zip(at, agents, strict=True)]
        busiest = max(_per_second(at).values())
        # The mean rate of this round is n / (base * 2^failures), halved each round;
        # no second sees a crowd far above it, and the first round's stays at 2,500/s.
        mean = n / min(DEFAULT_CAP, DEFAULT_BASE * 2**failures)
        assert busiest <= 1.15 * mean, (failures, busiest, mean)
        assert busiest <= 2_750


def test_an_agent_waits_as_long_as_the_control_port_may_queue_it() -> None:
    """Finding 12: agents gave up after 10 s, so a control plane that a storm kept busy
    longer handshook with clients that had left, and each agent dialled 4 to 9 times,
    at the back of the queue each time. The agent's dial waits for what the control
    port may make it wait: its queue deadline for agents, then the handshake's own
    deadline, then the websocket's answer (sent within the server's header timeout)."""
    limits = AdmissionLimits()
    assert limits.agents_queue_s >= 30.0
    server_side = limits.agents_queue_s + limits.deadline_s + ServerLimits().header_timeout_s
    assert server_side <= CONNECT_TIMEOUT_S


def _per_second(times: list[float]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for t in times:
        counts[int(t)] = counts.get(int(t), 0) + 1
    return counts


# -- when the backoff starts over --------------------------------------------------

BOUND = silence_bound(5.0)  # the control plane's default heartbeat: a ping after 10 s


def session(answered_for_s: float | None, bound: SilenceBound = BOUND) -> Session:
    """A session welcomed at t=100 on which the control plane was last heard
    `answered_for_s` later (None: it never registered)."""
    if answered_for_s is None:
        return Session()
    return Session(welcomed_at=100.0, heard=Heard(100.0 + answered_for_s), bound=bound)


def test_a_session_that_never_registered_is_one_more_failure() -> None:
    assert next_attempt(0, session(None)) == 1
    assert next_attempt(7, session(None)) == 8


def test_a_session_that_ended_right_after_the_welcome_is_one_more_failure() -> None:
    # A bad frame or a close just after registering, or silence from the welcome on
    # (a stalled control plane, cut by the agent after the bound): the backoff grows,
    # so agents that a control plane admits and then fails spread out instead of all
    # registering again within base_s, over and over.
    for answered_for in (0.0, 0.2, 5.0, BOUND.probe_after_s - 0.01):
        assert next_attempt(0, session(answered_for)) == 1
        assert next_attempt(5, session(answered_for)) == 6


def test_a_session_the_control_plane_answered_for_a_while_starts_the_backoff_over() -> None:
    # On a quiet stream the first sign after the welcome is the pong to the ping sent
    # after half the bound: that much is enough, however the session then ended.
    for answered_for in (BOUND.probe_after_s, BOUND.probe_after_s + 0.003, 3600.0):
        assert next_attempt(0, session(answered_for)) == 0
        assert next_attempt(30, session(answered_for)) == 0
    short = silence_bound(0.5)  # a ping after 1 s
    assert next_attempt(4, session(1.0, short)) == 0
    assert next_attempt(4, session(0.9, short)) == 5


def test_a_black_holed_healthy_stream_is_redialled_within_the_30_s_promise() -> None:
    """Silence that begins at any moment after the control plane answered for half the
    bound: cut at the bound after the last sign, then a redial within base_s."""
    base, cap = DEFAULT_BASE, DEFAULT_CAP
    rng = random.Random(2)
    for interval in (0.05, 0.5, 5.0):  # a paced fleet's longer ones: test_silence
        bound = silence_bound(interval)
        for answered_for in (bound.probe_after_s, 42.0, 86400.0):
            attempt = next_attempt(rng.randrange(40), session(answered_for, bound))
            redial = backoff_delay(attempt, base, cap, rng)
            # The silence began at the last sign at the latest; the cut follows it by the bound.
            assert bound.cut_after_s + redial <= 25


# -- when the control plane said when to come back ------------------------------------


def test_an_agent_told_when_to_come_back_waits_that_long_plus_its_own_jitter() -> None:
    """Finding 12: a refused agent redialled within its full-jitter window, into a queue
    still full. Told when to come back, it waits that long, spread by up to base_s of
    its own (a control port whose turns were all alike must not get them at once)."""
    rng = random.Random(7)
    waits = [reconnect_delay(5, 12.5, 2.0, 60.0, rng) for _ in range(2000)]
    assert all(12.5 <= w <= 14.5 for w in waits)
    assert min(waits) < 12.6 and max(waits) > 14.4
    # Past the agent's own cap when the control plane asks (its turns may be far off),
    # never past MAX_COME_BACK_S, and never negative.
    assert reconnect_delay(0, 1e9, 2.0, 60.0, rng) <= MAX_COME_BACK_S + 2.0
    assert reconnect_delay(0, 100.0, 2.0, 60.0, rng) >= 100.0
    assert 0.0 <= reconnect_delay(0, -5.0, 2.0, 60.0, rng) <= 2.0
    # Without a word from the control plane: the full-jitter backoff, as before.
    assert reconnect_delay(3, None, 2.0, 60.0, random.Random(1)) == backoff_delay(
        3, 2.0, 60.0, random.Random(1)
    )


def test_a_refusals_retry_after_is_read_within_the_cap() -> None:
    def rejected(*headers: tuple[bytes, bytes]) -> trio_websocket.ConnectionRejected:
        return trio_websocket.ConnectionRejected(503, headers, b"busy")

    assert retry_after(rejected((b"Retry-After", b" 12 "))) == 12.0
    assert retry_after(rejected((b"content-type", b"text/plain"))) is None
    assert retry_after(rejected((b"retry-after", b"Wed, 21 Oct 2026 07:28:00 GMT"))) is None
    assert retry_after(rejected((b"retry-after", b"99999"))) == MAX_COME_BACK_S


def test_an_agent_told_of_a_restart_redials_within_the_jitter_until_its_window_ends() -> None:
    rng = random.Random(3)
    delays = [restart_redial_delay(5.0, 30.0, None, rng) for _ in range(200)]
    assert all(d is not None and 0 <= d <= RESTART_JITTER_S for d in delays)
    assert max(d for d in delays if d is not None) > RESTART_JITTER_S / 2  # spread, not fixed
    # No restart, or its window over: the backoff decides.
    assert restart_redial_delay(5.0, None, None, rng) is None
    assert restart_redial_delay(30.0, 30.0, None, rng) is None
    # The busy new control plane's turn is kept, with the restart's jitter, not base_s's.
    turns = [restart_redial_delay(5.0, 30.0, 2.0, rng) for _ in range(100)]
    assert all(t is not None and 2.0 <= t <= 2.0 + RESTART_JITTER_S for t in turns)
