"""Bad input for the HTTP front (issue 5), against one real router process over raw sockets.

Every example ends with an HTTP answer or a clean close (a reset counts: the server may
close on a client that is still sending), within a bounded time; after each one the
server still answers GET /healthz and relays a real chat completion, and its log holds
no traceback.
"""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Callable, Iterator, Sequence

import attrs
import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from hypothesis_profiles import profile_times
from procs import Proc, Procs, models_toml

# The module's router and engines are one fixture: its tests run on one worker, together.
pytestmark = pytest.mark.xdist_group("fuzz-http")

HEADER_TIMEOUT_S = 0.4
BODY_TIMEOUT_S = 0.4
KEEPALIVE_TIMEOUT_S = 0.4
MAX_BODY_BYTES = 1024
MAX_HEADER_BYTES = 64 * 1024  # ServerLimits' default; the config does not set it
# Far above every timeout above: an exchange slower than this is a hang.
HANG_S = 5.0
# The latest a 408 may come: the 0.4 s header timer, and seconds more that a starved
# machine (CI's, with vLLM beside) may hold the router or this test back. The default
# timer (10 s), had the configured one been ignored, is far past it.
LATE_408_S = HEADER_TIMEOUT_S + 4

CHAT = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()


def settings_(n: int) -> settings:
    return settings(
        max_examples=profile_times(n / 100),
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )


@attrs.define
class Server:
    proc: Proc
    client: httpx.Client
    slow_engine: Proc  # the engine behind the model "slow"
    log_seen: int = 0

    @property
    def addr(self) -> tuple[str, int]:
        return ("127.0.0.1", self.proc.port)

    def still_serves(self) -> None:
        assert self.proc.popen.poll() is None, f"the router died:\n{self.proc.output()}"
        health = self._asked(lambda: self.client.get(self.proc.url + "/healthz"))
        assert health.status_code == 200, health.text
        chat = self._asked(
            lambda: self.client.post(self.proc.url + "/v1/chat/completions", content=CHAT)
        )
        assert chat.status_code == 200, chat.text
        assert chat.json()["choices"][0]["message"]["content"]
        log = self.proc.output()
        new, self.log_seen = log[self.log_seen :], len(log)
        for record in _RECORD.split(new):
            assert "Traceback" not in record and " ERROR " not in record, record


    @staticmethod
    def _asked(ask: Callable[[], httpx.Response]) -> httpx.Response:
        """A well-formed request's answer; a 408 is asked again (twice at most): httpx
        sends the head at once, so a 408 there is the 0.4 s header timer firing while a
        loaded machine (CI's, with vLLM beside) starved the router, not a fuzzed input's
        doing."""
        answer = ask()
        for _ in range(2):
            if answer.status_code != 408:
                break
            answer = ask()
        return answer


_RECORD = re.compile(r"\n(?=\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    procs = Procs(tmp_path_factory.mktemp("fuzz-http"))
    try:
        engine = procs.mock("m")
        slow = procs.mock("slow", "--mock-tokens-per-second", "10")  # 1.6 s an answer
        router = procs.router(
            models_toml({"m": [engine.url], "slow": [slow.url]}),
            server=(
                f"header_timeout_s = {HEADER_TIMEOUT_S}\n"
                f"body_timeout_s = {BODY_TIMEOUT_S}\n"
                f"keepalive_timeout_s = {KEEPALIVE_TIMEOUT_S}\n"
                f"max_body_bytes = {MAX_BODY_BYTES}\n"
            ),
        )
        # No keep-alive between checks: a pooled connection idle for about the 0.4 s
        # keep-alive limit (an example's length) races the server's close of it.
        limits = httpx.Limits(max_keepalive_connections=0)
        with httpx.Client(timeout=HANG_S, limits=limits) as client:
            yield Server(router, client, slow)
    finally:
        procs.stop_all()


# -- one exchange over a raw socket -------------------------------------------------

_STATUS = re.compile(rb"HTTP/1\.[01] (\d{3}) ")


@attrs.frozen
class Outcome:
    data: bytes
    reset: bool
    seconds: float

    @property
    def statuses(self) -> list[int]:
        """Status of each response, 1xx skipped; [] for a close without an answer."""
        out = []
        rest = self.data
        while rest:
            m = _STATUS.match(rest)
            assert m, f"not an HTTP response: {self.data[:200]!r}"
            status = int(m.group(1))
            head, sep, rest = rest.partition(b"\r\n\r\n")
            assert sep, f"a response head cut short: {self.data[:200]!r}"
            if status >= 200:
                out.append(status)
                length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
                if length is None:  # chunked or read-to-close: take the rest as its body
                    break
                after = rest[int(length.group(1)) :]
                if after and not after.startswith(b"HTTP/") and rest.startswith(b"HTTP/"):
                    after = rest  # the answer to a HEAD request: no body
                rest = after
        return out

    def check(self, allowed: set[int] | None = None) -> None:
        assert self.seconds < HANG_S, f"took {self.seconds:.1f} s"
        statuses = self.statuses
        for status in statuses:
            assert status != 500 and not 502 <= status <= 504, (status, self.data[:300])
            if allowed is not None:
                assert status in allowed, (status, self.data[:300])


def exchange(
    server: Server,
    payload: bytes,
    *,
    shut: bool = True,
    then: Sequence[tuple[float, bytes]] = (),
) -> Outcome:
    """Send `payload` (and `then`: pauses and more bytes), half-close when `shut`, read to EOF."""
    start = time.monotonic()
    data = b""
    reset = False
    with socket.create_connection(server.addr, timeout=HANG_S) as s:
        try:
            s.sendall(payload)
            for pause, more in then:
                time.sleep(pause)
                s.sendall(more)
            if shut:
                s.shutdown(socket.SHUT_WR)
        except TimeoutError:
            raise AssertionError(f"the server stopped reading: {payload[:200]!r}") from None
        except OSError:
            reset = True  # the server closed first: fine, read what it said
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                reset = True
                break
            except TimeoutError:
                raise AssertionError(
                    f"the server neither answered nor closed in {HANG_S} s: {payload[:200]!r}"
                ) from None
            if not chunk:
                break
            data += chunk
    return Outcome(data, reset, time.monotonic() - start)


# -- strategies ---------------------------------------------------------------------


def post(body: bytes, *extra: bytes, length: int | None = None) -> bytes:
    n = len(body) if length is None else length
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n" % n
    return head + b"".join(extra) + b"\r\n" + body


def chunked(body: bytes, sizes: list[int]) -> bytes:
    out, rest = b"", body
    for size in sizes:
        piece, rest = rest[:size], rest[size:]
        if piece:
            out += b"%x\r\n%s\r\n" % (len(piece), piece)
    if rest:
        out += b"%x\r\n%s\r\n" % (len(rest), rest)
    return out + b"0\r\n\r\n"


CHUNKED_HEAD = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
)

FRAGMENTS = [
    b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /v1/models HTTP/1.0\r\n\r\n",
    b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n",
    b"DELETE /healthz HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /v1/chat/completions HTTP/1.1\r\nHost: x\r\n\r\n",
    post(CHAT),
    post(b"{not json"),
    post(b'{"model": 5}'),
    post(b"[]"),
    CHUNKED_HEAD + chunked(CHAT, [3, 10]),
    b"GET / HTTP/1.1\r\n",
    b"Host: x\r\n",
    b"Content-Length: 5\r\n",
    b"Content-Length: -1\r\n",
    b"Content-Length: 99999999999999999999\r\n",
    b"Transfer-Encoding: chunked\r\n",
    b"Transfer-Encoding: gzip\r\n",
    b"Expect: 100-continue\r\n",
    b"Upgrade: websocket\r\nConnection: Upgrade\r\n",
    b"Connection: close\r\n",
    b" folded\r\n",
    b"Bad Header: x\r\n",
    b"X: \x00\x7f\xff\r\n",
    b"\r\n",
    b"\n",
    b"\r",
    b" ",
    b":",
    b"0\r\n\r\n",
    b"fffffffffffffffffff\r\n",
    b"zz\r\n",
    b"HTTP/1.1 200 OK\r\n",
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",  # a TLS ClientHello's start
]

garbage = st.one_of(
    st.binary(max_size=300),
    st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.binary(max_size=20)), max_size=8).map(
        b"".join
    ),
)

token = st.one_of(
    st.sampled_from([b"GET", b"POST", b"get", b"G E T", b"", b"\x00", b"GET\t", b"X" * 300]),
    st.binary(max_size=12),
)
target = st.one_of(
    st.sampled_from(
        [b"/healthz", b"/v1/chat/completions", b"*", b"", b"http://x/healthz", b"/\x00", b"/ /"]
    ),
    st.binary(max_size=30),
    st.integers(1, 20_000).map(lambda n: b"/" + b"a" * n),
)
version = st.one_of(
    st.sampled_from(
        [b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/0.9", b"http/1.1", b"HTTP/1.1 ", b""]
    ),
    st.binary(max_size=10),
)
separator = st.sampled_from([b" ", b"  ", b"\t", b"", b" \r "])
line_end = st.sampled_from([b"\r\n", b"\n", b"\r", b"\r\r\n", b""])


# -- the tests ----------------------------------------------------------------------


def test_a_valid_request_gets_an_answer(server: Server) -> None:
    out = exchange(server, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert out.statuses == [200] and not out.reset
    server.still_serves()


@settings_(150)
@given(garbage)
@example(b"")
@example(b"\r\n\r\n\r\n")
@example(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n" * 20)
@example(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03")
def test_arbitrary_bytes_get_an_answer_or_a_close(server: Server, payload: bytes) -> None:
    exchange(server, payload).check()
    server.still_serves()


@settings_(100)
@given(token, separator, target, separator, version, line_end, st.booleans())
@example(b"GET", b" ", b"/healthz", b" ", b"HTTP/2.0", b"\r\n", True)
@example(b"GET", b" ", b"/" + b"a" * 70_000, b" ", b"HTTP/1.1", b"\r\n", True)
def test_broken_request_lines_get_an_error_or_a_close(
    server: Server,
    method: bytes,
    sep1: bytes,
    path: bytes,
    sep2: bytes,
    ver: bytes,
    end: bytes,
    with_host: bool,
) -> None:
    head = method + sep1 + path + sep2 + ver + end + (b"Host: x\r\n" if with_host else b"")
    exchange(server, head + b"\r\n").check()
    server.still_serves()


@settings_(25)
@given(
    st.sampled_from(["one-long", "many", "long-name"]),
    st.integers(MAX_HEADER_BYTES // 2, 4 * MAX_HEADER_BYTES),
)
@example("one-long", 2 * MAX_HEADER_BYTES)
@example("many", 2 * MAX_HEADER_BYTES)
def test_huge_headers_get_431_or_400_or_a_close(server: Server, shape: str, size: int) -> None:
    head = b"GET /healthz HTTP/1.1\r\nHost: x\r\n"
    if shape == "one-long":
        head += b"X-Long: " + b"a" * size + b"\r\n"
    elif shape == "many":
        head += b"".join(b"X-%d: v\r\n" % i for i in range(size // 10))
    else:
        head += b"X" * size + b": v\r\n"
    out = exchange(server, head + b"\r\n")
    # h11 checks the limit only while a head is incomplete, after each read of up to
    # 64 KiB: a head that completes within the read that crosses the limit passes. On a
    # starved machine 256 KiB may take the server longer to read than this module's short
    # header timeout (0.62 s seen in CI): a 408 then, never the head served (200).
    late = {408} if out.seconds >= HEADER_TIMEOUT_S else set()
    if len(head) > 2 * MAX_HEADER_BYTES:
        out.check({400, 431} | late)
    else:
        out.check({200, 400, 431} | late)
    server.still_serves()


@pytest.mark.parametrize("line", [b"X-Long: " + b"a" * 1024, b"X-A: b"])
def test_endless_headers_are_cut_off(server: Server, line: bytes) -> None:
    """A client that never ends its head: the server answers 431 (or 400, or closes)
    long before it has read much more than the limit; or 408 when the head's deadline
    comes first (a starved client sends the limit slower: seen once in CI)."""
    start = time.monotonic()
    sent = 0
    closed = False
    data = b""
    with socket.create_connection(server.addr, timeout=HANG_S) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        try:
            while sent < 64 * MAX_HEADER_BYTES and time.monotonic() - start < HANG_S:
                s.sendall(line + b"\r\n")
                sent += len(line) + 2
        except (BrokenPipeError, ConnectionResetError):
            closed = True
        try:
            while chunk := s.recv(65536):
                data += chunk
            closed = True
        except ConnectionResetError:
            closed = True
        except TimeoutError:
            pass
    assert closed, f"still open after {sent} bytes of head"
    assert sent < 64 * MAX_HEADER_BYTES
    Outcome(data, True, time.monotonic() - start).check({400, 408, 431})
    server.still_serves()


@settings_(40)
@given(st.integers(-len(CHAT), 40), st.booleans())
@example(-1, True)
@example(1, True)
@example(-len(CHAT), True)
def test_wrong_content_length_gets_an_answer_or_a_close(
    server: Server, delta: int, shut: bool
) -> None:
    """Shorter than the body: the request is cut and the rest parsed as the next request.
    Longer: the server waits for the rest, which never comes: 408, or a close on EOF."""
    if delta > 0 and not shut:
        delta = min(delta, 5)
    out = exchange(server, post(CHAT, length=len(CHAT) + delta), shut=shut)
    out.check()
    if delta > 0 and not shut:
        assert out.statuses == [408], out.data[:300]
    if delta == 0 and not shut:
        # (Half-closed, the request is cancelled: the server takes EOF for a client gone.)
        assert out.statuses[:1] == [200]
    server.still_serves()


@pytest.mark.parametrize(
    "headers",
    [
        b"Content-Length: abc\r\n",
        b"Content-Length: -1\r\n",
        b"Content-Length: 1, 2\r\n",
        b"Content-Length: 5\r\nContent-Length: 6\r\n",
        b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n",
        b"Transfer-Encoding: gzip\r\n",
        b"Content-Length: 99999999999999999999999999\r\n",
        b"Content-Length: %d\r\n" % (MAX_BODY_BYTES + 1),
        b"Content-Length: %d\r\nExpect: 100-continue\r\n" % (MAX_BODY_BYTES + 1),
    ],
)
def test_bad_framing_headers_get_a_4xx(server: Server, headers: bytes) -> None:
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n"
    out = exchange(server, head + b"hello")
    out.check({400, 411, 413, 501})
    assert out.statuses, "no answer"
    server.still_serves()


def test_a_body_over_the_limit_gets_413(server: Server) -> None:
    out = exchange(server, CHUNKED_HEAD + chunked(b"x" * (2 * MAX_BODY_BYTES), [500] * 5))
    assert out.statuses == [413], out.data[:300]
    server.still_serves()


@settings_(40)
@given(st.data(), st.booleans())
def test_chunked_bodies_cut_short_get_an_answer_or_a_close(
    server: Server, data: st.DataObject, shut: bool
) -> None:
    sizes = data.draw(st.lists(st.integers(1, 40), max_size=5))
    body = chunked(CHAT, sizes)
    cut = data.draw(st.integers(0, len(body) - 1))
    if not shut:  # each of these waits out the body timeout: fewer of them
        cut = min(cut, 8)
    out = exchange(server, CHUNKED_HEAD + body[:cut], shut=shut)
    out.check({400, 408})
    if not shut:
        assert out.statuses == [408], out.data[:300]
    server.still_serves()


@settings_(40)
@given(st.binary(min_size=1, max_size=12), st.sampled_from([b"", b"\r\n"]))
@example(b"zz", b"\r\n")
@example(b"-1", b"\r\n")
@example(b"1;" + b"x" * 10, b"\r\n")
def test_malformed_chunks_get_400_or_a_close(server: Server, size: bytes, end: bytes) -> None:
    out = exchange(server, CHUNKED_HEAD + size + end + b"abc\r\n0\r\n\r\n")
    out.check({200, 400, 413})
    server.still_serves()


@settings_(8)
@given(st.integers(1, 30))
@example(1)
def test_a_few_bytes_then_silence_get_408_in_time(server: Server, n: int) -> None:
    request = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    out = exchange(server, request[: min(n, len(request) - 1)], shut=False)
    assert out.statuses == [408], out.data[:300]
    assert out.seconds < LATE_408_S
    server.still_serves()


def test_a_trickled_head_gets_408_though_bytes_keep_coming(server: Server) -> None:
    """The header timeout covers the whole head, not the gap between bytes."""
    start = time.monotonic()
    data = b""
    with socket.create_connection(server.addr, timeout=HANG_S) as s:
        s.settimeout(0.05)
        for byte in b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200:
            try:
                s.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                break
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                continue
            except ConnectionResetError:
                break
            data += chunk
            if not chunk:
                break
            if time.monotonic() - start > HANG_S:
                break
    assert Outcome(data, False, time.monotonic() - start).statuses == [408], data[:300]
    assert time.monotonic() - start < LATE_408_S
    server.still_serves()


def test_a_trickled_body_gets_408(server: Server) -> None:
    out = exchange(
        server,
        post(CHAT)[: -len(CHAT) + 2],
        shut=False,
        then=[(0.1, CHAT[2 + i : 3 + i]) for i in range(8)],
    )
    assert out.statuses == [408], out.data[:300]
    server.still_serves()


def test_an_idle_keepalive_connection_is_closed(server: Server) -> None:
    out = exchange(server, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n", shut=False)
    assert out.statuses == [200]
    assert out.seconds < KEEPALIVE_TIMEOUT_S + 2
    server.still_serves()


def test_head_gets_the_head_of_a_get(server: Server) -> None:
    out = exchange(server, b"HEAD /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert out.statuses == [200], out.data


def metric(text: str, name: str, **labels: str) -> float:
    """One sample of a Prometheus text exposition (0 when absent)."""
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            found = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
            if all(found.get(k) == v for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def wait_for(check: Callable[[], bool], what: str, timeout: float = HANG_S) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.02)


def test_a_client_that_goes_away_mid_request_logs_no_traceback(server: Server) -> None:
    server.still_serves()
    before = len(server.proc.output())

    def router(name: str, **labels: str) -> float:
        text = server.client.get(server.proc.url + "/metrics").text
        return metric(text, name, model="slow", **labels)

    def engine_running() -> float:
        text = server.client.get(server.slow_engine.url + "/metrics").text
        return metric(text, "vllm:num_requests_running")

    gone_before = router("llmgw_requests_total", status="0")
    with socket.create_connection(server.addr, timeout=HANG_S) as s:
        s.sendall(post(CHAT.replace(b'"m"', b'"slow"')))
        wait_for(
            lambda: router("llmgw_requests_in_flight") == 1 and engine_running() == 1,
            "the request in flight through the router to the engine",
        )
    # The router finishes with the request it can no longer answer ...
    wait_for(lambda: router("llmgw_requests_in_flight") == 0, "the router to let the request go")
    assert router("llmgw_requests_total", status="0") == gone_before + 1  # ... as gone
    server.still_serves()  # it serves on
    new = server.proc.output()[before:]
    server.log_seen = before + len(new)
    assert "connection handler failed" not in new, new
