"""A request refused by its process's share of a shared limit waits for the hub's next
grant (router.front.Router._borrow), within its bounds."""

from __future__ import annotations

import hashlib

import trio
import trio.testing

from llmgw_core.config import parse_config
from llmgw_server.route_feed.messages import Shares
from llmgw_server.router import front
from llmgw_server.router.front import Router
from llmgw_server.router.tenancy import Admitted, Refused


def router() -> Router:
    digest = "sha256:" + hashlib.sha256(b"sk-a").hexdigest()
    data = {
        "server": {"access_log": False},
        "auth": {"keys": [{"digest": digest, "tenant": "team"}]},
        "tenants": [{"name": "team", "requests_per_minute": 10}],
        "models": [{"name": "m", "endpoints": ["http://127.0.0.1:9"]}],
    }
    return Router(parse_config(data, "router.toml"))


def refused_by_share(app: Router) -> Refused:
    """The tenant's one-request share used: its next request refused by the share."""
    app.apply_shares(Shares(1, {"team/requests": 1.0}, full=True))
    limiters = app.tenancy.limiters("team", "m")
    assert isinstance(app.tenancy.admit("team", limiters, 1, trio.current_time()), Admitted)
    refused = app.tenancy.admit("team", limiters, 1, trio.current_time())
    assert isinstance(refused, Refused) and app.tenancy.shared(limiters, refused.which)
    return refused


async def test_a_raised_share_admits_the_request_that_waited() -> None:
    app = router()
    refused = refused_by_share(app)
    limiters = app.tenancy.limiters("team", "m")
    got: list[Admitted | Refused] = []
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:

            async def waiting() -> None:
                got.append(await app._borrow("team", limiters, 1, refused, 100))

            nursery.start_soon(waiting)
            await trio.testing.wait_all_tasks_blocked()
            assert app._borrowing == 1 and app._borrowed_bytes == 100
            app.apply_shares(Shares(2, {"team/requests": 5.0}, full=True))
    assert isinstance(got[0], Admitted)
    assert (app._borrowing, app._borrowed_bytes) == (0, 0)


async def test_no_grant_within_the_wait_is_the_refusal(autojump_clock: trio.abc.Clock) -> None:
    app = router()
    refused = refused_by_share(app)
    started = trio.current_time()
    got = await app._borrow("team", app.tenancy.limiters("team", "m"), 1, refused, 100)
    assert isinstance(got, Refused)
    assert trio.current_time() - started == front.BORROW_WAIT_S


async def test_past_its_bounds_a_refusal_is_answered_at_once() -> None:
    app = router()
    refused = refused_by_share(app)
    limiters = app.tenancy.limiters("team", "m")
    app._borrowing = front.BORROW_MAX
    assert await app._borrow("team", limiters, 1, refused, 100) is refused
    app._borrowing = 0
    too_big = front.BORROW_MAX_BYTES + 1
    assert await app._borrow("team", limiters, 1, refused, too_big) is refused
    assert (app._borrowing, app._borrowed_bytes) == (0, 0)
