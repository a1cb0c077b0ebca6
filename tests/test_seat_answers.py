"""What a control plane among several answers an agent's hello before any TLS
(Seat._answer_agent, called by its port's gate): an agent that lost its leader is sent
only to a leader of a newer epoch than it has seen (this one, when it leads), and told
to come back soon while there is none; any other agent is sent to the leader a standby
names, else served here. Fed the election's standing, no store, no socket."""

from __future__ import annotations

import attrs

from llmgw_core.agent_lane import come_back_s, not_leader_url
from llmgw_core.config import parse_config
from llmgw_server.control_shell.election import Member, Standing
from llmgw_server.control_shell.seat import Seat

HERE = "ws://127.0.0.1:2"
OTHER = "ws://127.0.0.1:3"


@attrs.define
class StandingOnly:
    standing: Standing


def seat_standing(*, leading: bool, leader: str | None, epoch: int, store_ok: bool = True) -> Seat:
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
    return seat


def said(line: bytes | None) -> tuple[str | None, float | None]:
    if line is None:
        return None, None
    return not_leader_url(line), come_back_s(line)


async def test_an_agent_that_lost_its_leader_is_sent_only_to_a_newer_one() -> None:
    newer = seat_standing(leading=False, leader=OTHER, epoch=8)
    assert said(newer._answer_agent(7)) == (OTHER + "/v1/agent", None)
    assert said(newer._answer_agent(None)) == (OTHER + "/v1/agent", None)
    # The store still names the leadership the agent lost (its lease lives): come back.
    same = seat_standing(leading=False, leader=OTHER, epoch=8)
    url, wait = said(same._answer_agent(8))
    assert url is None and wait is not None and 0 < wait <= 0.5
    # An election without a leader yet: come back soon; an agent that lost none is served
    # (and held through the election, StandbyAnswers).
    nobody = seat_standing(leading=False, leader=None, epoch=8)
    url, wait = said(nobody._answer_agent(8))
    assert url is None and wait is not None and 0 < wait <= 0.5
    assert nobody._answer_agent(None) is None
    # A store this control plane cannot read now names nobody it can vouch for.
    unsure = seat_standing(leading=False, leader=OTHER, epoch=9, store_ok=False)
    assert said(unsure._answer_agent(8))[1] is not None


async def test_the_leader_sends_an_agent_that_lost_its_leader_to_itself() -> None:
    """Named, the agent dials it again with a leader's patience and no lost-leader name,
    and waits for its one handshake in the leader's queue, as in a restart storm."""
    leading = seat_standing(leading=True, leader=HERE, epoch=9)
    assert said(leading._answer_agent(8)) == (HERE + "/v1/agent", None)
    assert leading._answer_agent(None) is None  # served here


async def test_hellos_of_agents_that_lost_their_leader_make_a_standby_campaign_first() -> None:
    seat = seat_standing(leading=False, leader=None, epoch=3)
    assert seat._campaign_delay_s() > 0
    seat._answer_agent(3)
    assert seat._campaign_delay_s() == 0
