"""An etcd v3 client over etcd's JSON gateway (the grpc-gateway every etcd member serves
on its client URLs), on httpx under trio: keys, leases, guarded transactions, watches and
each member's status. The gateway rather than gRPC keeps the control plane on trio (a
gRPC client would need a thread of its own); it costs JSON and base64, nothing that
matters at a control plane's rates.

The values and their JSON are store/etcd_values.py's. Everything read is checked: an
answer that is not etcd's, or larger than `MAX_RESPONSE_BYTES` (a watch message larger
than `MAX_LINE_BYTES`), fails that endpoint with one line, never a traceback.

Endpoints: each call goes to the last endpoint that answered, then to the others in the
configured order, each try within `timeout_s`, so one call takes at most `timeout_s` per
endpoint. A read fails over on any failure of an endpoint (no connection, a timeout, an
answer that is not etcd's, etcd's "unavailable": no leader, request timed out). A write
(put, delete, txn) fails over only while nothing of it was sent, as etcd's own client
does: once sent, a lost answer leaves its outcome unknown (`StoreOutcomeUnknown`), since
sending it again could apply it twice (a guarded create would then report a loss it won).
"""

from __future__ import annotations

import json
import math
import socket
import ssl
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, Literal, TypeVar, cast

import attrs
import httpx
import trio

from llmgw_core.store_config import StoreSection
from llmgw_server.store.etcd_values import (
    Compare,
    CompareResult,
    CompareTarget,
    EndpointStatus,
    KeyValue,
    Lease,
    Op,
    TxnResult,
    WatchEvent,
    b64,
    doc_of,
    int_or_zero,
    keepalive_ttl_of,
    key_range,
    kv_of,
    lease_of,
    mapping,
    page_of,
    prefix_end,
    proto_int,
    range_of,
    revision_of,
    token_of,
    txn_result_of,
)

__all__ = [
    "MAX_LINE_BYTES",
    "MAX_RESPONSE_BYTES",
    "PAGE_KEYS",
    "Compare",
    "CompareResult",
    "CompareTarget",
    "EndpointStatus",
    "EtcdClient",
    "KeyValue",
    "Lease",
    "Op",
    "StoreError",
    "StoreOutcomeUnknown",
    "StoreUnavailable",
    "TxnResult",
    "WatchCompacted",
    "WatchEvent",
    "WatchStream",
    "prefix_end",
]

# Bounds on what an endpoint may send: a whole answer, and one message of a watch's stream
# (etcd's own request limit is 1.5 MiB a value; a watch message carries one revision's
# events, a transaction's at most).
MAX_RESPONSE_BYTES = 64 * 1024 * 1024
MAX_LINE_BYTES = 8 * 1024 * 1024
# get_prefix reads this many keys a request, every page at the first page's revision.
PAGE_KEYS = 1000
# gRPC status codes, as the gateway reports them in an error's "code".
_NOT_FOUND = 5
_UNAVAILABLE = 14
_UNAUTHENTICATED = 16
# etcd answers a request while its member has a leader only (gRPC metadata "hasleader"):
# a member cut off from the others says "no leader" at once, and its watches end,
# instead of serving stale reads or waiting out the request's own timeout.
_HEADERS = {"Grpc-Metadata-hasleader": "true", "Accept-Encoding": "identity"}
_WORDS_MAX = 300  # what an endpoint's own words may add to one line
# The gateway answers these as a stream of messages ({"result": ...} or {"error": ...}),
# a line each.
_STREAMED = {"/v3/lease/keepalive"}


class StoreError(Exception):
    """A store operation that failed; `str()` is one line: which endpoint(s), what failed."""


class StoreUnavailable(StoreError):
    """No endpoint gave etcd's answer: none answered within the timeout, or only with
    something that is not etcd's, or etcd's "unavailable" (no leader)."""


class StoreOutcomeUnknown(StoreUnavailable):
    """A write was sent and its answer lost: it may or may not have been applied (read
    the key to know)."""


class WatchCompacted(StoreError):
    """The watch's start revision is older than the store keeps: read the state afresh
    and watch from its revision."""

    def __init__(self, message: str, compact_revision: int) -> None:
        super().__init__(message)
        self.compact_revision = compact_revision


class _EndpointFailed(Exception):
    """This endpoint gave no answer of etcd's (its words are the message)."""


class _Refused(Exception):
    """etcd answered with an error of its own."""

    def __init__(self, url: str, code: int, message: str) -> None:
        super().__init__(message)
        self.url = url
        self.code = code
        self.message = message


@attrs.define
class _Attempt:
    """Whether a request began to go out (httpcore's trace), so whether a write that
    failed could have been applied."""

    sent: bool = False

    async def trace(self, event: str, info: Mapping[str, object]) -> None:
        if event.endswith("send_request_headers.started"):
            self.sent = True


T = TypeVar("T")
Observe = Callable[[str, float], None]


class EtcdClient:
    """One process's client of an etcd cluster, for the whole of its run (`aclose` at the
    end). Its calls may run concurrently; it keeps at most 100 connections (httpx's
    pool), and each open watch holds one of them."""

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        user: str = "",
        password: str = "",
        ssl_context: ssl.SSLContext | None = None,
        timeout_s: float = 2.0,
        observe: Observe | None = None,
    ) -> None:
        if not endpoints:
            raise ValueError("an etcd client needs at least one endpoint")
        self.endpoints = tuple(url.rstrip("/") for url in endpoints)
        self._user = user
        self._password = password
        self._timeout_s = timeout_s
        self._observe = observe
        self._preferred = self.endpoints[0]
        self._token: str | None = None
        self._auth_lock = trio.Lock()
        tls = any(url.startswith("https://") for url in self.endpoints)
        transport = httpx.AsyncHTTPTransport(
            # no CA bundle loaded for plain http:// endpoints (it costs 0.2 s of CPU)
            verify=ssl_context if ssl_context is not None else tls,
            trust_env=False,
            socket_options=_keepalive_options(timeout_s),
        )
        self._http = httpx.AsyncClient(
            transport=transport, timeout=httpx.Timeout(timeout_s), trust_env=False
        )

    @classmethod
    def for_store(
        cls, store: StoreSection, *, observe: Observe | None = None, timeout_s: float = 2.0
    ) -> EtcdClient:
        """A client of the `[control.store]` cluster: its TLS (ca, client certificate)
        for https:// endpoints, its user and the password from `password_env`."""
        context = None
        if any(url.startswith("https://") for url in store.endpoints):
            try:
                context = ssl.create_default_context(cafile=str(store.ca) if store.ca else None)
                if store.cert is not None and store.key is not None:
                    context.load_cert_chain(str(store.cert), str(store.key))
            except (OSError, ssl.SSLError) as exc:
                raise StoreError(f"[control.store] TLS files: {_one_line(exc)}") from None
        return cls(
            store.endpoints,
            user=store.user,
            password=store.password(),
            ssl_context=context,
            timeout_s=timeout_s,
            observe=observe,
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    # Leases

    async def grant(self, ttl_s: int) -> Lease:
        # A grant sent twice leaves a second lease that ends by itself: safe to resend.
        return await self._call("grant", "/v3/lease/grant", {"TTL": str(ttl_s)}, lease_of)

    async def keepalive(self, lease_id: int) -> int:
        """Renews the lease; the TTL it has now, 0 when it is gone."""
        body = {"ID": str(lease_id)}
        return await self._call("keepalive", "/v3/lease/keepalive", body, keepalive_ttl_of)

    async def revoke(self, lease_id: int) -> None:
        """Ends the lease and deletes its keys; a lease already gone is no error."""
        try:
            await self._call("revoke", "/v3/lease/revoke", {"ID": str(lease_id)}, doc_of)
        except _Refused as exc:
            if exc.code != _NOT_FOUND:
                raise _store_error("revoke", exc) from None

    # Keys

    async def get(self, key: bytes) -> KeyValue | None:
        kvs, _ = await self._call("range", "/v3/kv/range", {"key": b64(key)}, range_of)
        return kvs[0] if kvs else None

    async def get_prefix(self, prefix: bytes) -> tuple[list[KeyValue], int]:
        """Every key beginning with `prefix`, in key order, and the revision they were
        read at: PAGE_KEYS a request, every page at the first one's revision (a page is
        bound by MAX_RESPONSE_BYTES too: 1,000 keys of this project's size are far below)."""
        body: dict[str, str] = {**key_range(prefix, True), "limit": str(PAGE_KEYS)}
        found: list[KeyValue] = []
        revision = 0
        while True:
            kvs, at, more = await self._call("range", "/v3/kv/range", body, page_of)
            found.extend(kvs)
            revision = revision or at
            if not more or not kvs:
                return found, revision
            body = {**body, "key": b64(kvs[-1].key + b"\0"), "revision": str(revision)}

    async def put(self, key: bytes, value: bytes, *, lease: int = 0) -> int:
        """Writes the key; the revision of the write."""
        body = {"key": b64(key), "value": b64(value), "lease": str(lease)}
        return await self._call("put", "/v3/kv/put", body, revision_of, idempotent=False)

    async def delete(self, key: bytes, *, prefix: bool = False) -> int:
        """Deletes the key (every key beginning with it); the store's revision after."""
        body = key_range(key, prefix)
        return await self._call("delete", "/v3/kv/deleterange", body, revision_of, idempotent=False)

    async def txn(
        self, compare: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()
    ) -> TxnResult:
        """`success` if every guard holds, else `failure`, atomically."""
        body = {
            "compare": [c.to_json() for c in compare],
            "success": [op.to_json() for op in success],
            "failure": [op.to_json() for op in failure],
        }
        return await self._call("txn", "/v3/kv/txn", body, txn_result_of, idempotent=False)

    # Watches

    @asynccontextmanager
    async def watch(
        self, key: bytes, *, prefix: bool = False, start_revision: int = 0
    ) -> AsyncIterator[WatchStream]:
        """The changes to the key (to every key beginning with it) from `start_revision`
        (0: from now on), in revision order, for as long as the context lasts. The stream
        never ends by itself: it raises StoreError when it breaks (watch again from the
        last event's revision + 1) and WatchCompacted when the start revision is gone.
        A connection gone silent (a lost host) is cut by TCP keepalive within about
        `timeout_s` + 3 s of quiet."""
        create: dict[str, str] = key_range(key, prefix)
        if start_revision:
            create["start_revision"] = str(start_revision)
        started = trio.current_time()
        try:
            stream = await self._open_watch(create, start_revision)
        finally:
            self._observed("watch", started)
        try:
            yield stream
        finally:
            await stream.aclose()

    async def _open_watch(self, create: dict[str, str], start_revision: int) -> WatchStream:
        retried = False
        while True:
            token = await self._current_token()
            failures: list[str] = []
            for url in self._in_order():
                try:
                    with trio.fail_after(self._timeout_s):
                        stream = await self._start_watch(url, create, token, start_revision)
                except trio.TooSlowError:
                    failures.append(f"{url}: no answer within {self._timeout_s:g} s")
                except _EndpointFailed as exc:
                    failures.append(f"{url}: {exc}")
                except _Refused as exc:
                    # A token that expired shows as "permission denied" at a watch's creation.
                    if self._user and not retried and "permission denied" in exc.message:
                        retried = True
                        await self._reauthenticate(token)
                        break
                    raise _store_error("watch", exc) from None
                else:
                    self._preferred = url
                    return stream
            else:
                raise StoreUnavailable(f"no etcd endpoint answered watch: {'; '.join(failures)}")

    async def _start_watch(
        self, url: str, create: dict[str, str], token: str | None, start_revision: int
    ) -> WatchStream:
        """The watch on `url`, once etcd has said it is created."""
        body = json.dumps({"create_request": create}).encode()
        request = self._http.build_request(
            "POST",
            url + "/v3/watch",
            content=body,
            headers=self._headers(token),
            # no read timeout: a watch is quiet while nothing changes
            timeout=httpx.Timeout(self._timeout_s, read=None),
        )
        try:
            response = await self._http.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise _EndpointFailed(_describe(exc)) from None
        try:
            if response.status_code != 200:
                try:
                    data = await _read_body(response)
                except httpx.HTTPError as exc:
                    raise _EndpointFailed(_describe(exc)) from None
                _answer(url, response.status_code, data)
                raise _EndpointFailed(f"answered watch with HTTP {response.status_code}")
            stream = WatchStream(url, response, start_revision)
            await stream.wait_created()
            return stream
        except BaseException:
            with trio.CancelScope(shield=True):
                await response.aclose()
            raise

    # Members

    async def status(self) -> list[EndpointStatus]:
        """Each endpoint's own status, asked of all at once (without a token: etcd
        serves it to anyone)."""
        found: dict[str, EndpointStatus] = {}

        async def ask(url: str) -> None:
            started = trio.current_time()
            error, leader, revision = "", False, 0
            try:
                with trio.fail_after(self._timeout_s):
                    doc = await self._exchange(url, "/v3/maintenance/status", {}, None, _Attempt())
                    revision = revision_of(doc)
                    member = proto_int(mapping(doc.get("header")).get("member_id"))
                    leader = member != 0 and member == proto_int(doc.get("leader"))
            except trio.TooSlowError:
                error = f"no answer within {self._timeout_s:g} s"
            except _EndpointFailed as exc:
                error = str(exc)
            except _Refused as exc:
                error = f"etcd: {_words(exc.message)}"
            except (KeyError, TypeError, ValueError, AttributeError):
                error = "answered status with a body that is not etcd's"
            latency = self._observed("status", started)
            found[url] = EndpointStatus(url, not error, leader, revision, latency, error)

        async with trio.open_nursery() as nursery:
            for url in self.endpoints:
                nursery.start_soon(ask, url)
        return [found[url] for url in self.endpoints]

    # Requests

    async def _call(
        self,
        op: str,
        path: str,
        body: Mapping[str, object],
        decode: Callable[[dict[str, Any]], T],
        *,
        idempotent: bool = True,
    ) -> T:
        """One request, over the endpoints, authenticated (again once, when etcd no longer
        knows the token)."""
        started = trio.current_time()
        try:
            token = await self._current_token()
            try:
                return await self._over_endpoints(op, path, body, decode, token, idempotent)
            except _Refused as exc:
                if not (self._user and exc.code == _UNAUTHENTICATED):
                    raise
            await self._reauthenticate(token)
            token = await self._current_token()
            return await self._over_endpoints(op, path, body, decode, token, idempotent)
        except _Refused as exc:
            if op == "revoke":
                raise  # revoke reads the code
            raise _store_error(op, exc) from None
        finally:
            self._observed(op, started)

    async def _over_endpoints(
        self,
        op: str,
        path: str,
        body: Mapping[str, object],
        decode: Callable[[dict[str, Any]], T],
        token: str | None,
        idempotent: bool,
    ) -> T:
        failures: list[str] = []
        for url in self._in_order():
            attempt = _Attempt()
            try:
                with trio.fail_after(self._timeout_s):
                    doc = await self._exchange(url, path, body, token, attempt)
                try:
                    result = decode(doc)
                except (KeyError, TypeError, ValueError, AttributeError):
                    raise _EndpointFailed(f"answered {op} with a body that is not etcd's") from None
            except trio.TooSlowError:
                why = f"no answer within {self._timeout_s:g} s"
            except _EndpointFailed as exc:
                why = str(exc)
            else:
                self._preferred = url
                return result
            failures.append(f"{url}: {why}")
            if attempt.sent and not idempotent:
                raise StoreOutcomeUnknown(
                    f"etcd {url}: {op} was sent, then {why}: it may or may not have been applied"
                )
        raise StoreUnavailable(f"no etcd endpoint answered {op}: {'; '.join(failures)}")

    async def _exchange(
        self,
        url: str,
        path: str,
        body: Mapping[str, object],
        token: str | None,
        attempt: _Attempt,
    ) -> dict[str, Any]:
        """One POST to one endpoint: etcd's answer, or _EndpointFailed/_Refused. A
        streamed answer (lease keepalive's) is its first message."""
        request = self._http.build_request(
            "POST",
            url + path,
            content=json.dumps(body).encode(),
            headers=self._headers(token),
            extensions={"trace": attempt.trace},
        )
        try:
            response = await self._http.send(request, stream=True)
            try:
                data = await _read_body(response, first_line=path in _STREAMED)
            finally:
                await response.aclose()
        except httpx.HTTPError as exc:
            raise _EndpointFailed(_describe(exc)) from None
        return _answer(url, response.status_code, data)

    def _headers(self, token: str | None) -> dict[str, str]:
        return {**_HEADERS, "Authorization": token} if token else _HEADERS

    def _in_order(self) -> list[str]:
        return [self._preferred, *(url for url in self.endpoints if url != self._preferred)]

    def _observed(self, op: str, started: float) -> float:
        took = trio.current_time() - started
        if self._observe is not None:
            self._observe(op, took)
        return took

    # Authentication: a token from /v3/auth/authenticate, sent as `Authorization`.

    async def _current_token(self) -> str | None:
        if not self._user:
            return None
        if self._token is None:
            async with self._auth_lock:
                if self._token is None:
                    self._token = await self._authenticate()
        return self._token

    async def _reauthenticate(self, stale: str | None) -> None:
        async with self._auth_lock:
            if self._token == stale:  # else another task has already
                self._token = await self._authenticate()

    async def _authenticate(self) -> str:
        body = {"name": self._user, "password": self._password}
        try:
            return await self._over_endpoints(
                "authenticate", "/v3/auth/authenticate", body, token_of, None, True
            )
        except _Refused as exc:
            raise StoreError(
                f"etcd {exc.url}: user {self._user!r} cannot log in: {_words(exc.message)}"
            ) from None


class WatchStream:
    """The events of one watch, in revision order. `revision` is the store's revision as
    of the latest message read."""

    def __init__(self, url: str, response: httpx.Response, start_revision: int) -> None:
        self.url = url
        self.revision = 0
        self._response = response
        self._start_revision = start_revision
        self._chunks = cast(AsyncGenerator[bytes, None], response.aiter_raw())
        self._buffer = bytearray()
        self._scanned = 0  # of the buffer, bytes known to hold no newline
        self._events: deque[WatchEvent] = deque()

    def __aiter__(self) -> WatchStream:
        return self

    async def __anext__(self) -> WatchEvent:
        while not self._events:
            await self._next_message()
        return self._events.popleft()

    async def wait_created(self) -> None:
        """Reads etcd's answer to the create request (_Refused when it refused it)."""
        result = await self._next_result()
        if not result.get("created"):
            raise _EndpointFailed("answered watch without creating it")
        self._take(result)

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True):
            await self._chunks.aclose()
            await self._response.aclose()

    async def _next_message(self) -> None:
        try:
            result = await self._next_result()
        except _EndpointFailed as exc:
            raise StoreError(f"etcd {self.url}: the watch broke: {exc}") from None
        try:
            self._take(result)
        except _Refused as exc:
            raise _store_error("watch", exc) from None

    def _take(self, result: dict[str, Any]) -> None:
        try:
            header = mapping(result.get("header"))
            self.revision = max(self.revision, proto_int(header.get("revision")))
            compacted = proto_int(result.get("compact_revision"))
            if compacted:
                raise WatchCompacted(
                    f"etcd {self.url}: the watch's start revision {self._start_revision} is"
                    f" compacted (the store keeps revisions from {compacted} on)",
                    compacted,
                )
            if result.get("canceled"):
                raise _Refused(self.url, 0, str(result.get("cancel_reason") or "canceled"))
            for event in result.get("events") or ():
                kv = kv_of(event["kv"])
                kind: Literal["put", "delete"] = (
                    "delete" if event.get("type") == "DELETE" else "put"
                )
                self._events.append(WatchEvent(kind, kv, kv.mod_revision))
        except (KeyError, TypeError, ValueError, AttributeError):
            raise StoreError(f"etcd {self.url}: a watch message that is not etcd's") from None

    async def _next_result(self) -> dict[str, Any]:
        """The next message's result (_Refused for an error message)."""
        line = b""
        while not line.strip():
            line = await self._next_line()
        try:
            doc = json.loads(line)
        except ValueError:
            raise _EndpointFailed("a watch message that is not JSON") from None
        if not isinstance(doc, dict):
            raise _EndpointFailed("a watch message that is not etcd's")
        error = doc.get("error")
        if isinstance(error, dict):
            code, message = int_or_zero(error.get("grpc_code")), _words(error.get("message"))
            if code == _UNAVAILABLE:
                raise _EndpointFailed(f"etcd: {message}")
            raise _Refused(self.url, code, message)
        result = doc.get("result")
        if not isinstance(result, dict):
            raise _EndpointFailed("a watch message that is not etcd's")
        return result

    async def _next_line(self) -> bytes:
        while True:
            cut = self._buffer.find(b"\n", self._scanned)
            if cut > MAX_LINE_BYTES or (cut < 0 and len(self._buffer) > MAX_LINE_BYTES):
                raise _EndpointFailed(f"a watch message over {MAX_LINE_BYTES >> 20} MiB")
            if cut >= 0:
                line = bytes(self._buffer[:cut])
                del self._buffer[: cut + 1]
                self._scanned = 0
                return line
            self._scanned = len(self._buffer)
            try:
                chunk = await self._chunks.__anext__()
            except StopAsyncIteration:
                raise _EndpointFailed("the stream ended") from None
            except httpx.HTTPError as exc:
                raise _EndpointFailed(_describe(exc)) from None
            self._buffer += chunk


async def _read_body(response: httpx.Response, *, first_line: bool = False) -> bytes:
    """The body, at most MAX_RESPONSE_BYTES (only its first line: `first_line`)."""
    length = response.headers.get("content-length", "0")
    if not length.isdigit() or int(length) > MAX_RESPONSE_BYTES:
        raise _EndpointFailed(f"answered with a body over {MAX_RESPONSE_BYTES >> 20} MiB")
    data = bytearray()
    async for chunk in response.aiter_raw():
        data += chunk
        if len(data) > MAX_RESPONSE_BYTES:
            raise _EndpointFailed(f"answered with a body over {MAX_RESPONSE_BYTES >> 20} MiB")
        if first_line and b"\n" in chunk:
            break
    return bytes(data.split(b"\n", 1)[0]) if first_line else bytes(data)


def _answer(url: str, status: int, data: bytes) -> dict[str, Any]:
    """etcd's answer: the document of a 200, else _Refused with etcd's words (or
    _EndpointFailed: etcd unavailable there, or not etcd at all)."""
    try:
        doc = json.loads(data)
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        raise _EndpointFailed(f"answered HTTP {status} with a body that is not etcd's JSON")
    if status == 200 and "error" not in doc:
        return doc
    message, code = doc.get("message") or doc.get("error"), doc.get("code")
    if isinstance(doc.get("error"), dict):  # an error message in a stream
        message, code = doc["error"].get("message"), doc["error"].get("grpc_code")
    if not isinstance(message, str) or not isinstance(code, int):
        raise _EndpointFailed(f"answered HTTP {status} without etcd's error")
    if code == _UNAVAILABLE:
        raise _EndpointFailed(f"etcd: {_words(message)}")
    raise _Refused(url, code, _words(message))


def _store_error(op: str, exc: _Refused) -> StoreError:
    return StoreError(f"etcd {exc.url}: {op} refused: {exc.message}")


def _describe(exc: httpx.HTTPError) -> str:
    """A transport failure in words."""
    if isinstance(exc, httpx.TimeoutException):
        return "no answer in time"
    if isinstance(exc, httpx.ConnectError):
        return f"cannot connect: {_reason(exc)}"
    if isinstance(exc, httpx.RemoteProtocolError):
        return f"answered something that is not HTTP: {_reason(exc)}"
    if isinstance(exc, httpx.TransportError):
        return f"the connection broke: {_reason(exc)}"
    return _reason(exc)


def _reason(exc: BaseException) -> str:
    """The first words along the exception's causes: a TLS alert shows as a trio
    BrokenResourceError with none, raised from the ssl.SSLError that names it."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            break
        if str(seen):
            return _one_line(seen)
        seen = seen.__cause__ or seen.__context__
    return type(exc).__name__


def _words(value: object) -> str:
    text = value if isinstance(value, str) else ""
    return _one_line(text) or "(no words)"


def _one_line(value: object) -> str:
    text = " ".join(str(value).split())
    return text if len(text) <= _WORDS_MAX else text[:_WORDS_MAX] + "..."


def _keepalive_options(timeout_s: float) -> list[tuple[int, int, int]]:
    """TCP keepalive on every connection: a watch is quiet while nothing changes, and a
    connection to a lost host (nothing sent back, not even a reset) is cut after about
    `timeout_s` of quiet and three unanswered probes a second apart."""
    options = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    if hasattr(socket, "TCP_KEEPIDLE"):  # Linux
        idle = max(1, math.ceil(timeout_s))
        options += [
            (socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle),
            (socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1),
            (socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3),
        ]
    return options
