"""The upstream pool against an engine that closes keep-alive connections its own way.

The engine is reached through the pool's connect seam over memory streams (trio's
autojump clock where time matters); over real TCP only where the socket is the point:
seeing an idle connection's close before sending, and a body bigger than the socket's
buffer.
"""

from __future__ import annotations

import h11
import pytest
import trio
import trio.testing

from llmgw_core.catalog import Endpoint
from llmgw_http.coarse_timeouts import TICK_S
from llmgw_http.h1 import keep_alive_timeout
from llmgw_http.transport import Connector, Transport, memory_pair
from llmgw_server.router.upstream import Pool, UpstreamError


class Engine:
    """A raw HTTP/1.1 server whose closing behaviour the test sets per request.

    `plan` says, for the Nth request on a connection, what to do: "answer" (keep alive),
    or "vanish" (close without a byte, as uvicorn does when its idle timer fires while
    the request is on its way).
    """

    def __init__(self, plan: list[str], keep_alive_header: bytes = b"") -> None:
        self.plan = plan
        self.keep_alive_header = keep_alive_header
        self.connections = 0
        self.answered = 0
        self.port = 0
        self.auth: list[bytes] = []

    async def serve(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started()
        await trio.serve_listeners(self._connection, listeners)

    def connector(self, nursery: trio.Nursery) -> Connector:
        """Connects the pool to this engine through memory streams, no socket."""

        async def connect(host: str, port: int) -> Transport:
            ours, theirs = memory_pair()
            nursery.start_soon(self._connection, theirs)
            return ours

        return connect

    def pool(self, nursery: trio.Nursery, reuse_idle_s: float = 4.0, api_key: str = "") -> Pool:
        endpoint = Endpoint("127.0.0.1", 1, api_key=api_key)
        return Pool(endpoint, 3.0, reuse_idle_s=reuse_idle_s, connect=self.connector(nursery))

    async def _connection(self, stream: trio.abc.Stream) -> None:
        self.connections += 1
        conn = h11.Connection(h11.SERVER)
        nth = 0
        async with stream:
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    data = await stream.receive_some(65536)
                    if not data:
                        return
                    conn.receive_data(bytes(data))
                    continue
                if isinstance(event, h11.Request):
                    self.auth += [v for k, v in event.headers if k == b"authorization"]
                if not isinstance(event, h11.EndOfMessage):
                    continue
                action = self.plan[nth] if nth < len(self.plan) else "answer"
                nth += 1
                if action == "vanish":
                    return
                if action == "vanish-late":  # as if the engine died while working on it
                    await trio.sleep(1.5)
                    return
                if action == "stall":  # reads the request and never answers
                    await trio.sleep_forever()
                headers = [(b"content-length", b"2")]
                if self.keep_alive_header:
                    headers.append((b"keep-alive", self.keep_alive_header))
                out = conn.send(h11.Response(status_code=200, headers=headers))
                out += conn.send(h11.Data(data=b"ok")) + conn.send(h11.EndOfMessage())
                self.answered += 1
                await stream.send_all(out)
                conn.start_next_cycle()


async def get(pool: Pool) -> bytes:
    exchange = await pool.open(b"POST", b"/v1/completions", [], b"{}")
    try:
        return await exchange.read_body(1024)
    finally:
        exchange.release()


async def test_a_reused_connection_closed_under_the_request_is_retried_on_a_fresh_one() -> None:
    engine = Engine(plan=["answer", "vanish"])
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            pool = engine.pool(nursery, reuse_idle_s=60)
            assert await get(pool) == b"ok"
            assert await get(pool) == b"ok"  # the pooled connection vanished: sent again
            assert (engine.connections, engine.answered, pool.stale_retries) == (2, 2, 1)
            pool.close()
            nursery.cancel_scope.cancel()


async def test_a_failure_on_a_fresh_connection_reaches_the_caller() -> None:
    engine = Engine(plan=["vanish"])
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            pool = engine.pool(nursery)
            with pytest.raises(UpstreamError, match=r"closed the connection|garbage"):
                await get(pool)
            assert engine.connections == 1  # never retried by the pool itself
            nursery.cancel_scope.cancel()


async def test_a_connection_idle_past_the_limit_is_not_reused(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = Engine(plan=[])
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            pool = engine.pool(nursery, reuse_idle_s=4.0)
            await get(pool)
            await get(pool)
            assert engine.connections == 1  # reused while fresh
            await trio.sleep(5.0)  # idle past reuse_idle_s
            await get(pool)
            assert (engine.connections, pool.stale_retries) == (2, 0)
            pool.close()
            nursery.cancel_scope.cancel()


async def test_a_connection_the_engine_closed_is_noticed_before_sending() -> None:
    engine = Engine(plan=[])
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.serve)
            pool = Pool(Endpoint("127.0.0.1", engine.port), 3.0, reuse_idle_s=60)
            await get(pool)
            nursery.cancel_scope.cancel()  # the engine goes away: its connections close
        async with trio.open_nursery() as nursery:
            # Wait for the close to arrive, as an idle pause would.
            while not pool._idle[0].closed_by_peer():
                await trio.sleep(0.01)
            await nursery.start(engine.serve)
            pool.endpoint = Endpoint("127.0.0.1", engine.port)
            assert await get(pool) == b"ok"
            assert pool.stale_retries == 0  # dropped, never written to
            pool.close()
            nursery.cancel_scope.cancel()


async def test_the_engine_keep_alive_header_lowers_the_reuse_limit() -> None:
    engine = Engine(plan=[], keep_alive_header=b"timeout=3, max=100")
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            pool = engine.pool(nursery, reuse_idle_s=4.0)
            await get(pool)
            assert pool.reuse_idle_s == 2.0  # a second inside the engine's 3 s
            pool.close()
            nursery.cancel_scope.cancel()


async def test_the_engine_key_is_sent_on_every_request() -> None:
    engine = Engine(plan=[])
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            pool = engine.pool(nursery, api_key="k-123")
            await get(pool)
            await get(pool)
            assert engine.auth == [b"Bearer k-123", b"Bearer k-123"]
            pool.close()
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (b"timeout=5, max=100", 5.0),
        (b"max=100, Timeout = 7", 7.0),
        (b"timeout=abc", None),
        (b"timeout=-1", None),
        (b"max=3", None),
    ],
)
def test_keep_alive_header_parsing(value: bytes, expected: float | None) -> None:
    assert keep_alive_timeout([(b"keep-alive", value)]) == expected
    assert keep_alive_timeout([]) is None


async def test_after_one_stale_connection_the_request_goes_to_a_fresh_one() -> None:
    engine = Engine(plan=["answer", "vanish"])
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            pool = engine.pool(nursery, reuse_idle_s=60)
            first = [await pool.open(b"POST", b"/", [], b"") for _ in range(3)]
            for exchange in first:
                await exchange.read_body(1024)
                exchange.release()
            assert pool.idle_connections == 3 and engine.connections == 3
            # The newest pooled connection vanishes under the next request; the older
            # ones are given up with it, and the request is sent on a new connection.
            assert await get(pool) == b"ok"
            assert (engine.connections, pool.stale_retries, pool.idle_connections) == (4, 1, 1)
            pool.close()
            nursery.cancel_scope.cancel()


async def test_a_reused_connection_closed_long_after_the_request_is_a_failure(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = Engine(plan=["answer", "vanish-late"])
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            pool = engine.pool(nursery, reuse_idle_s=60)
            assert await get(pool) == b"ok"
            with pytest.raises(UpstreamError):
                await get(pool)  # the engine may have done the work: not sent again
            assert (engine.connections, pool.stale_retries) == (1, 0)
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize("reused", [False, True])
async def test_an_engine_silent_past_the_first_byte_limit_times_out(
    reused: bool, autojump_clock: trio.testing.MockClock
) -> None:
    engine = Engine(plan=["answer", "stall"] if reused else ["stall"])
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            pool = engine.pool(nursery, reuse_idle_s=60)
            if reused:
                assert await get(pool) == b"ok"
            started = trio.current_time()
            with pytest.raises(UpstreamError, match=r"sent no answer within 0.3 s") as caught:
                await pool.open(b"POST", b"/v1/completions", [], b"{}", first_byte_s=0.3)
            waited = trio.current_time() - started
            assert caught.value.timed_out and not caught.value.silent
            assert 0.3 <= waited <= 0.3 + 2 * TICK_S, waited  # never early; late by a tick
            assert (engine.connections, pool.stale_retries) == (1, 0)  # not sent again
            assert not pool.idle_connections  # the timed-out connection is closed, not pooled
            engine.plan = []  # answers from now on
            assert await get(pool) == b"ok"  # the pool goes on with a new connection
            assert engine.connections == 2
            pool.close()
            nursery.cancel_scope.cancel()


async def test_a_big_request_on_a_vanished_connection_is_sent_again_on_a_fresh_one() -> None:
    """A body bigger than the socket's buffer is sent while the answer is read: a pooled
    connection the engine closes under it is still the pool's race, not a failure."""
    engine = Engine(plan=["answer", "vanish"])
    body = b"x" * (8 << 20)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.serve)
            pool = Pool(Endpoint("127.0.0.1", engine.port), 3.0, reuse_idle_s=60)
            for _ in range(2):
                exchange = await pool.open(b"POST", b"/v1/completions", [], body)
                assert await exchange.read_body(1024) == b"ok"
                exchange.release()
            assert (engine.connections, engine.answered, pool.stale_retries) == (2, 2, 1)
            pool.close()
            nursery.cancel_scope.cancel()
