"""What a control plane among several answers an agent's hello before any TLS
(Seat._answer_agent, called by its port's gate): an agent that lost its leader is sent
only to a leader of a newer epoch than it has seen (this one, when it leads); while there
is none its hello waits for the election, and is told to come back soon if it does not
end in time; any other agent is sent to the leader a standby names, else served here.
Fed the election's standing, no store, no socket, on trio's autojump clock."""

from __future__ import annotations

import attrs
import trio
import trio.testing

from llmgw_core.agent_lane import come_back_s, not_leader_url
from llmgw_core.config import parse_config
from llmgw_server.control.hello_answer import (
    HANDSHAKES_PER_LOST_LEADER,
    HANDSHAKES_PER_SOURCE,
    HandshakeBudget,
)
from llmgw_server.control_shell.election import Member, Standing
from llmgw_server.control_shell.seat import Seat

HERE = "ws://127.0.0.1:2"
OTHER = "ws://127.0.0.1:3"
NODE = "10.1.0.1"  # the address an agent's hello came from (the port's source_key)


def node_address(n: int) -> str:
    return f"10.2.{n // 256}.{n % 256}"


@attrs.define
class StandingOnly:
    standing: Standing


def seat_standing(
    *, leading: bool, leader: str | None, epoch: int, store_ok: bool = True, plane: bool = False
) -> Seat:
    data = {
        "control": {"store": {"endpoints": ["http://127.0.0.1:9"], "lease_ttl_s": 2}},
        "agents": {"insecure": True},
        "models": [{"name": "m", "endpoints": ["http://127.0.0.1:9"]}],
    }
    seat = Seat(parse_config(data, "server.toml"), None)
    seat.url = HERE
    member = None if leader is None else Member(id="x", url=leader, catalog_digest="", started_at=0)
    standing = Standing(leading, epoch, member, None, "", store_ok)
    seat.election = StandingOnly(standing)  # type: ignore[assignment]  # standing is all it reads
    if plane:
        seat.plane = object()  # type: ignore[assignment]  # its term has begun: all it reads
    spend(seat)
    return seat


def spend(seat: Seat, lost: int = 8) -> None:
    """The handshakes at once for agents that lost epoch `lost` are spent (the first
    hellos get theirs: a test below)."""
    seat.handshakes = HandshakeBudget(spent={lost: HANDSHAKES_PER_LOST_LEADER})


def stand(seat: Seat, *, leading: bool, leader: str | None, epoch: int) -> None:
    """The election changed: the seat is told, as its election follower tells it."""
    member = None if leader is None else Member(id="y", url=leader, catalog_digest="", started_at=0)
    seat.election = StandingOnly(Standing(leading, epoch, member, None, "", True))  # type: ignore[assignment]
    seat._signal()


def said(line: bytes | None) -> tuple[str | None, float | None]:
    if line is None:
        return None, None
    return not_leader_url(line), come_back_s(line)


async def test_an_agent_that_lost_its_leader_is_sent_only_to_a_newer_one(
    autojump_clock: trio.testing.MockClock,
) -> None:
    newer = seat_standing(leading=False, leader=OTHER, epoch=8)
    assert said(await newer._answer_agent(7, NODE)) == (OTHER + "/v1/agent", None)
    assert said(await newer._answer_agent(None, NODE)) == (OTHER + "/v1/agent", None)
    # The store still names the leadership the agent lost (its lease lives): come back.
    same = seat_standing(leading=False, leader=OTHER, epoch=8)
    url, wait = said(await same._answer_agent(8, NODE))
    assert url is None and wait is not None and 0 < wait <= 0.5
    # An election without a leader yet: come back soon; an agent that lost none is served
    # (and held through the election, StandbyAnswers).
    nobody = seat_standing(leading=False, leader=None, epoch=8)
    url, wait = said(await nobody._answer_agent(8, NODE))
    assert url is None and wait is not None and 0 < wait <= 0.5
    assert await nobody._answer_agent(None, NODE) is None
    # A store this control plane cannot read now names nobody it can vouch for.
    unsure = seat_standing(leading=False, leader=OTHER, epoch=9, store_ok=False)
    assert said(await unsure._answer_agent(8, NODE))[1] is not None


async def test_the_leader_sends_an_agent_that_lost_its_leader_to_itself() -> None:
    """Named, the agent dials it again with a leader's patience and no lost-leader name,
    and waits for its one handshake in the leader's queue, as in a restart storm."""
    leading = seat_standing(leading=True, leader=HERE, epoch=9, plane=True)
    assert said(await leading._answer_agent(8, NODE)) == (HERE + "/v1/agent", None)
    assert await leading._answer_agent(None, NODE) is None  # served here


async def test_hellos_of_agents_that_lost_their_leader_make_a_standby_campaign_first(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Within 2 s of such a hello, and while one waits here for the election."""
    seat = seat_standing(leading=False, leader=None, epoch=3)
    spend(seat, 3)
    assert seat._campaign_delay_s() > 0
    seat._lost_hello_at = trio.current_time()  # as its gate's answer was asked for
    await trio.sleep(1.9)
    assert seat._campaign_delay_s() == 0
    await trio.sleep(0.2)
    assert seat._campaign_delay_s() > 0
    async with trio.open_nursery() as nursery:
        nursery.start_soon(seat._answer_agent, 3, NODE)
        await trio.sleep(1.99)
        seat._lost_hello_at = float("-inf")
        assert seat._answers_held == 1 and seat._campaign_delay_s() == 0
    assert seat._answers_held == 0 and seat._campaign_delay_s() > 0


async def test_a_hello_waits_for_the_election_and_goes_to_its_winner_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """No leader: the hello waits (a socket, no TLS) and is answered the moment one is
    elected, the winner's name, where it was told to come back before; one that waits
    out the bound is told to come back. A winner whose term has not begun yet is not
    named by itself: its hellos wait for the term."""
    seat = seat_standing(leading=False, leader=None, epoch=8)
    answers: list[tuple[float, bytes | None]] = []

    async def ask() -> None:
        line = await seat._answer_agent(8, NODE)
        answers.append((trio.current_time(), line))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ask)
        await trio.sleep(0.3)
        assert answers == []
        stand(seat, leading=True, leader=HERE, epoch=9)  # elected, its term not begun
        await trio.sleep(0.3)
        assert answers == []
        seat.plane = object()  # type: ignore[assignment]
        stand(seat, leading=True, leader=HERE, epoch=9)
    ((at, line),) = answers
    assert at == 0.6 and said(line) == (HERE + "/v1/agent", None)
    assert seat.metrics.hellos_answered["this_leader"] == 1
    assert seat.metrics.hellos_answered["come_back"] == 0

    nobody = seat_standing(leading=False, leader=None, epoch=8)
    start = trio.current_time()
    url, wait = said(await nobody._answer_agent(8, NODE))
    assert url is None and wait is not None and trio.current_time() - start == 2.0
    assert nobody.metrics.hellos_answered["come_back"] == 1


async def test_the_first_agents_that_lost_a_leader_get_their_handshake_at_once() -> None:
    """During the election (their streams held, and served by this control plane's term
    if it wins), or at the leader after it: a handshake done during the election is done
    when it ends, and one at the leader needs no second dial. Past the budget, the hellos
    wait for the election without one, or are sent to the leader. Agents that lost a
    later leadership have a budget of their own. (Each from an address of its own: one
    address has a share of the budget, a test below.)"""
    seat = seat_standing(leading=False, leader=None, epoch=8)
    seat.handshakes = HandshakeBudget()
    for n in range(HANDSHAKES_PER_LOST_LEADER - 1):
        assert await seat._answer_agent(8, node_address(n)) is None
    assert seat.metrics.hellos_answered["handshake"] == HANDSHAKES_PER_LOST_LEADER - 1
    stand(seat, leading=True, leader=HERE, epoch=9)
    seat.plane = object()  # type: ignore[assignment]  # its term has begun
    assert await seat._answer_agent(8, NODE) is None  # at the leader, the last of the budget
    assert said(await seat._answer_agent(8, NODE)) == (HERE + "/v1/agent", None)
    assert seat.metrics.hellos_answered["this_leader"] == 1
    assert await seat._answer_agent(9, NODE) is None  # another leadership's agents
    standby = seat_standing(leading=False, leader=None, epoch=8)
    with trio.move_on_after(0.1) as waited:
        await standby._answer_agent(8, NODE)
    assert waited.cancelled_caught  # past the budget: waits for the election, no handshake


async def test_a_hello_that_waits_asks_for_the_lost_leaders_check_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The store still names the leader the agent lost: its process is checked (at most
    once a second per leadership, leader_gone), asked by the hello's first answer only,
    not again each time the standing is read while the hello waits."""
    seat = seat_standing(leading=False, leader=OTHER, epoch=8)
    checked: list[tuple[str, int, float]] = []

    async def check(election: object, leader: Member, epoch: int) -> None:
        checked.append((leader.url, epoch, trio.current_time()))

    seat._check_leader = check  # type: ignore[method-assign]  # no process to probe
    answers: list[bytes | None] = []

    async def ask() -> None:
        answers.append(await seat._answer_agent(8, NODE))

    async with trio.open_nursery() as nursery:
        seat._nursery = nursery
        nursery.start_soon(ask)
        for _ in range(3):
            await trio.sleep(0.6)
            stand(seat, leading=False, leader=OTHER, epoch=8)  # read again: nothing newer
    assert checked == [(OTHER, 8, 0.0)]
    (line,) = answers
    url, wait = said(line)
    assert url is None and wait is not None and 0 < wait <= 0.5


async def test_one_address_takes_its_share_of_the_handshakes_and_no_more(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Hellos from one address (anonymous ones, all saying they lost a leader) take
    HANDSHAKES_PER_SOURCE of the budget; past that, that address's hellos wait for the
    election without TLS, and every other address still gets its handshake at once."""
    seat = seat_standing(leading=False, leader=None, epoch=8)
    seat.handshakes = HandshakeBudget()
    for _ in range(HANDSHAKES_PER_SOURCE):
        assert await seat._answer_agent(8, NODE) is None
    with trio.move_on_after(0.1) as waited:
        await seat._answer_agent(8, NODE)
    assert waited.cancelled_caught  # its share spent: it waits for the election
    assert await seat._answer_agent(8, node_address(1)) is None
    assert seat.metrics.hellos_answered["handshake"] == HANDSHAKES_PER_SOURCE + 1
    # Elected, its term begun: that address's agents are sent to it, to dial it again.
    stand(seat, leading=True, leader=HERE, epoch=9)
    seat.plane = object()  # type: ignore[assignment]
    assert said(await seat._answer_agent(8, NODE)) == (HERE + "/v1/agent", None)
    assert await seat._answer_agent(8, node_address(2)) is None
