"""The etcd client (llmgw_server.store.etcd) against a real etcd: keys, leases, guarded
transactions, watches, failing over between members, etcd's own authentication, and
endpoints that are not etcd at all (garbage, a huge answer, silence), each a StoreError
of one line within the timeout."""

from __future__ import annotations

import base64
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import attrs
import httpx
import pytest
import trio

import llmgw_server.store.etcd as etcd_module
from etcd_cluster import EtcdCluster
from llmgw_core.certs import init_ca, issue_node
from llmgw_core.store_config import StoreSection
from llmgw_server.store.etcd import (
    Compare,
    EtcdClient,
    KeyValue,
    Op,
    StoreError,
    StoreOutcomeUnknown,
    StoreUnavailable,
    WatchCompacted,
    WatchEvent,
)
from procs import free_port


def fresh() -> bytes:
    """A key prefix of the test's own (the module's etcd is shared)."""
    return f"/t/{uuid.uuid4().hex}/".encode()


@asynccontextmanager
async def client(endpoints: Sequence[str], **options: object) -> AsyncIterator[EtcdClient]:
    c = EtcdClient(endpoints, **options)  # type: ignore[arg-type]
    try:
        yield c
    finally:
        await c.aclose()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


async def gateway(
    url: str, path: str, body: Mapping[str, object], *, token: str = ""
) -> dict[str, object]:
    """A request the client has no call for (auth setup, compaction)."""
    async with httpx.AsyncClient() as http:
        headers = {"Authorization": token} if token else {}
        response = await http.post(url + path, json=body, headers=headers)
        assert response.status_code == 200, response.text
        answer: dict[str, object] = response.json()
        return answer


async def until(condition: Callable[[], Awaitable[bool]], timeout_s: float) -> None:
    with trio.fail_after(timeout_s):
        while not await condition():
            await trio.sleep(0.05)


async def events(stream: AsyncIterator[WatchEvent], n: int) -> list[tuple[str, bytes, bytes]]:
    return [(e.kind, e.kv.key, e.kv.value) for e in [await anext(stream) for _ in range(n)]]


async def test_put_get_prefix_delete(etcd: EtcdCluster) -> None:
    p = fresh()
    observed: list[tuple[str, float]] = []
    with trio.fail_after(10):
        async with client(etcd.endpoints, observe=lambda op, s: observed.append((op, s))) as c:
            first = await c.put(p + b"b", b"2")
            second = await c.put(p + b"a", b"\x00\xff binary")
            await c.put(p[:-1] + b"0", b"next to the prefix, not under it")
            assert second > first
            kv = await c.get(p + b"a")
            assert kv == KeyValue(p + b"a", b"\x00\xff binary", second, second, 1, 0)
            assert await c.get(p + b"absent") is None
            found, revision = await c.get_prefix(p)
            assert [(k.key, k.value) for k in found] == [
                (p + b"a", b"\x00\xff binary"),
                (p + b"b", b"2"),
            ]
            assert revision >= second + 1
            assert await c.delete(p + b"a") > revision
            assert await c.get(p + b"a") is None
            await c.delete(p, prefix=True)
            assert await c.get_prefix(p) == ([], await c.delete(p, prefix=True))
            assert await c.get(p[:-1] + b"0") is not None
    assert {op for op, _ in observed} == {"put", "range", "delete"}
    assert all(0 <= s < 10 for _, s in observed)


async def test_get_prefix_reads_every_page_at_one_revision(
    etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(etcd_module, "PAGE_KEYS", 2)
    p = fresh()
    with trio.fail_after(10):
        async with client(etcd.endpoints) as c:
            for i in range(5):
                await c.put(p + b"%d" % i, b"v%d" % i)
            found, revision = await c.get_prefix(p)
            assert [k.value for k in found] == [b"v0", b"v1", b"v2", b"v3", b"v4"]
            assert revision == max(k.mod_revision for k in found)

            # Written all at once while being read: every read sees one write's keys.
            async def write(gen: int) -> None:
                await c.txn([], [Op.put(p + b"%d" % i, b"g%d" % gen) for i in range(5)])

            async def keep_writing() -> None:
                for gen in range(1, 1000):
                    await write(gen)

            await write(0)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(keep_writing)
                for _ in range(10):
                    found, revision = await c.get_prefix(p)
                    assert len({k.value for k in found}) == 1, found
                    assert {k.mod_revision for k in found} == {revision}
                nursery.cancel_scope.cancel()


async def test_lease_keepalive_expiry_and_revoke(etcd: EtcdCluster) -> None:
    p = fresh()
    with trio.fail_after(15):
        async with client(etcd.endpoints) as c:
            lease = await c.grant(2)
            assert lease.id != 0 and lease.ttl_s == 2
            await c.put(p + b"held", b"x", lease=lease.id)
            assert (await c.get(p + b"held")).lease == lease.id  # type: ignore[union-attr]
            assert 0 < await c.keepalive(lease.id) <= 2

            async def gone() -> bool:
                return await c.get(p + b"held") is None

            # Not renewed: etcd ends it after its TTL (and a little: it checks every 500 ms).
            await until(gone, 6)
            assert await c.keepalive(lease.id) == 0
            await c.revoke(lease.id)  # gone already: no error

            other = await c.grant(60)
            await c.put(p + b"other", b"y", lease=other.id)
            await c.revoke(other.id)
            assert await c.get(p + b"other") is None
            assert await c.keepalive(other.id) == 0


async def test_create_if_absent_has_one_winner(etcd: EtcdCluster) -> None:
    key = fresh() + b"leader"
    results = {}
    with trio.fail_after(10):
        async with client(etcd.endpoints) as a, client(etcd.endpoints) as b:

            async def create(name: bytes, c: EtcdClient) -> None:
                results[name] = await c.txn(
                    [Compare.version(key, 0)], [Op.put(key, name)], [Op.get(key)]
                )

            async with trio.open_nursery() as nursery:
                nursery.start_soon(create, b"a", a)
                nursery.start_soon(create, b"b", b)
            winners = [name for name, r in results.items() if r.succeeded]
            assert len(winners) == 1
            (loser,) = set(results) - set(winners)
            assert results[winners[0]].responses == ((),)
            (seen,) = results[loser].responses[0]
            assert seen.value == winners[0]
            assert (await a.get(key)).value == winners[0]  # type: ignore[union-attr]


async def test_guard_on_create_revision_fails_after_delete_and_create(etcd: EtcdCluster) -> None:
    key = fresh() + b"k"
    with trio.fail_after(10):
        async with client(etcd.endpoints) as c:
            await c.put(key, b"1")
            old = await c.get(key)
            assert old is not None
            ok = await c.txn(
                [Compare.create_revision(key, old.create_revision)], [Op.put(key, b"2")]
            )
            assert ok.succeeded and ok.revision > old.mod_revision
            await c.delete(key)
            await c.put(key, b"3")
            stale = await c.txn(
                [Compare.create_revision(key, old.create_revision)],
                [Op.put(key, b"4")],
                [Op.get(key), Op.delete(key + b"-none")],
            )
            assert not stale.succeeded
            assert [kv.value for kv in stale.responses[0]] == [b"3"] and stale.responses[1] == ()
            assert (await c.get(key)).value == b"3"  # type: ignore[union-attr]
            # a lease guard: the key is held by no lease
            lease = await c.grant(60)
            held = await c.txn([Compare.lease(key, lease.id)], [Op.delete(key)])
            assert not held.succeeded
            await c.revoke(lease.id)


async def test_watch_sees_changes_in_order_and_resumes(etcd: EtcdCluster) -> None:
    p = fresh()
    with trio.fail_after(10):
        async with client(etcd.endpoints) as c:
            async with c.watch(p, prefix=True) as stream:
                r1 = await c.put(p + b"a", b"1")
                await c.put(p + b"b", b"2")
                await c.put(fresh(), b"elsewhere")
                r3 = await c.delete(p + b"a")
                seen = [await anext(stream) for _ in range(3)]
            assert [(e.kind, e.kv.key, e.kv.value) for e in seen] == [
                ("put", p + b"a", b"1"),
                ("put", p + b"b", b"2"),
                ("delete", p + b"a", b""),
            ]
            assert seen[0].revision == r1 and seen[2].revision == r3
            assert seen[0].revision < seen[1].revision < seen[2].revision
            # Resumed from the first event's revision + 1: the rest, from history.
            async with c.watch(p, prefix=True, start_revision=r1 + 1) as stream:
                assert await events(stream, 2) == [
                    ("put", p + b"b", b"2"),
                    ("delete", p + b"a", b""),
                ]
            async with c.watch(p + b"b", start_revision=r1) as stream:  # one key
                assert await events(stream, 1) == [("put", p + b"b", b"2")]


async def test_watch_from_a_compacted_revision(etcd: EtcdCluster) -> None:
    key = fresh() + b"k"
    with trio.fail_after(10):
        async with client(etcd.endpoints) as c:
            first = await c.put(key, b"1")
            compacted = await c.put(key, b"2")
            await gateway(etcd.endpoints[0], "/v3/kv/compaction", {"revision": str(compacted)})
            async with c.watch(key, start_revision=first) as stream:
                with pytest.raises(WatchCompacted) as caught:
                    await anext(stream)
            assert caught.value.compact_revision == compacted
            assert f"keeps revisions from {compacted}" in str(caught.value)


async def test_failover_past_a_dead_endpoint(etcd: EtcdCluster) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    key = fresh() + b"k"
    with trio.fail_after(10):
        async with client([dead, *etcd.endpoints]) as c:
            await c.put(key, b"1")  # not sent to the dead one: safe to send to the next
            assert (await c.get(key)).value == b"1"  # type: ignore[union-attr]
            async with c.watch(key) as stream:
                await c.put(key, b"2")
                assert await events(stream, 1) == [("put", key, b"2")]
            dead_status, live_status = await c.status()
            assert not dead_status.ok and "cannot connect" in dead_status.error
            assert live_status.ok and live_status.leader and live_status.revision > 0
        async with client([dead]) as c:
            with pytest.raises(
                StoreUnavailable, match=f"no etcd endpoint answered put: {dead}: cannot connect"
            ):
                await c.put(key, b"3")


async def test_failover_when_the_member_in_use_dies(etcd3: EtcdCluster) -> None:
    key = fresh() + b"k"
    with trio.fail_after(25):
        async with client(etcd3.endpoints) as probe:
            statuses = await probe.status()
        assert all(s.ok for s in statuses) and sum(s.leader for s in statuses) == 1
        leader = next(i for i, s in enumerate(statuses) if s.leader)
        used = (leader + 1) % 3
        order = [etcd3.endpoints[used], *(u for i, u in enumerate(etcd3.endpoints) if i != used)]
        async with client(order) as c:
            await c.put(key, b"1")
            async with c.watch(key) as stream:
                etcd3.kill(used)  # a follower: the others keep their leader
                with pytest.raises(StoreError, match="the watch broke"):
                    await anext(stream)
            assert (await c.get(key)).value == b"1"  # type: ignore[union-attr]
            await c.put(key, b"2")  # nothing sent to the dead member: not OutcomeUnknown
            async with c.watch(key) as stream:
                await c.put(key, b"3")
                assert await events(stream, 1) == [("put", key, b"3")]

            # etcd's own leader dies too (the first one back): the survivors elect another.
            etcd3.start(used)
            etcd3.kill(leader)

            async def written() -> bool:
                try:
                    await c.put(key, b"4")
                except StoreUnavailable:
                    return False
                return True

            await until(written, 10)
            assert (await c.get(key)).value == b"4"  # type: ignore[union-attr]

        # A member without a leader says so at once (its watches end), rather than
        # waiting out the timeout: the client asks it to serve only while it has a leader.
        alone = used
        async with client([etcd3.endpoints[alone]], timeout_s=1) as c, c.watch(key) as stream:
            etcd3.kill(next(i for i in range(3) if i not in (alone, leader)))

            async def no_leader() -> bool:
                try:
                    await c.get(key)
                except StoreUnavailable as exc:
                    return "etcdserver: no leader" in str(exc)
                return False

            await until(no_leader, 8)
            with pytest.raises(StoreError, match="the watch broke"):
                await anext(stream)


async def test_authentication(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A user whose role may write under /fleet/ only, as a deployment would set it up."""
    cluster = EtcdCluster(tmp_path / "etcd")
    try:
        url = cluster.endpoints[0]
        with trio.fail_after(20):
            setup: list[tuple[str, Mapping[str, object]]] = [
                ("/v3/auth/user/add", {"name": "root", "password": "rootpw"}),
                ("/v3/auth/user/grant", {"user": "root", "role": "root"}),
                ("/v3/auth/role/add", {"name": "fleet"}),
                ("/v3/auth/role/grant", {"name": "fleet", "perm": {
                    "permType": "READWRITE", "key": b64(b"/fleet/"), "range_end": b64(b"/fleet0")}}),
                ("/v3/auth/user/add", {"name": "gw", "password": "pw"}),
                ("/v3/auth/user/grant", {"user": "gw", "role": "fleet"}),
                ("/v3/auth/enable", {}),
            ]  # fmt: skip
            for path, body in setup:
                await gateway(url, path, body)
            login = {"name": "root", "password": "rootpw"}
            root = str((await gateway(url, "/v3/auth/authenticate", login))["token"])

            async def forget_tokens() -> None:
                """etcd forgets a user's tokens when its password is set (to the same here)."""
                await gateway(
                    url, "/v3/auth/user/changepw", {"name": "gw", "password": "pw"}, token=root
                )

            key = b"/fleet/k"
            async with client(cluster.endpoints) as anonymous:
                with pytest.raises(StoreError, match="put refused: etcdserver: user name is empty"):
                    await anonymous.put(key, b"x")
            async with client(cluster.endpoints, user="gw", password="wrong") as wrong:
                with pytest.raises(
                    StoreError, match="user 'gw' cannot log in: etcdserver: authentication failed"
                ):
                    await wrong.get(key)
            monkeypatch.setenv("LLMGW_TEST_ETCD_PASSWORD", "pw")
            store = StoreSection(
                endpoints=tuple(cluster.endpoints),
                user="gw",
                password_env="LLMGW_TEST_ETCD_PASSWORD",
            )
            c = EtcdClient.for_store(store)
            try:
                await c.put(key, b"1")
                with pytest.raises(StoreError, match="put refused: etcdserver: permission denied"):
                    await c.put(b"/elsewhere", b"1")
                await forget_tokens()
                assert (await c.get(key)).value == b"1"  # type: ignore[union-attr]
                await forget_tokens()
                async with c.watch(key) as stream:  # a watch's refusal reads differently
                    await c.put(key, b"2")
                    assert await events(stream, 1) == [("put", key, b"2")]
                with pytest.raises(StoreError, match=r"watch refused: .*permission denied"):
                    async with c.watch(b"/elsewhere"):
                        pass
            finally:
                await c.aclose()
    finally:
        cluster.close()


async def test_for_store_over_mutual_tls(tmp_path: Path) -> None:
    """[control.store] with https endpoints, its CA and a client certificate: etcd
    admitting only clients with a certificate of that CA."""
    init_ca(tmp_path / "ca")
    cert, key, _ = issue_node(tmp_path / "ca", "llmgw")
    init_ca(tmp_path / "other")
    cluster = EtcdCluster(tmp_path / "etcd", tls=tmp_path / "ca")
    try:
        store = StoreSection(
            endpoints=tuple(cluster.endpoints), ca=tmp_path / "ca" / "ca.crt", cert=cert, key=key
        )
        observed: list[str] = []
        with trio.fail_after(10):
            c = EtcdClient.for_store(store, observe=lambda op, s: observed.append(op))
            try:
                await c.put(b"/tls/k", b"1")
                assert (await c.get(b"/tls/k")).value == b"1"  # type: ignore[union-attr]
            finally:
                await c.aclose()
            assert observed == ["put", "range"]
            for changed, words in [
                (
                    attrs.evolve(store, cert=None, key=None),
                    "cannot connect: .*alert bad certificate",
                ),
                (
                    attrs.evolve(store, ca=tmp_path / "other" / "ca.crt"),
                    "certificate verify failed",
                ),
            ]:
                c = EtcdClient.for_store(changed, timeout_s=1)
                try:
                    with pytest.raises(StoreUnavailable, match=words):
                        await c.get(b"/tls/k")
                finally:
                    await c.aclose()
        with pytest.raises(StoreError, match=r"^\[control.store\] TLS files: "):
            EtcdClient.for_store(attrs.evolve(store, key=tmp_path / "other" / "server.key"))
    finally:
        cluster.close()


# --- endpoints that are not etcd ---------------------------------------------------------


@asynccontextmanager
async def hostile(answer: bytes | None, repeat: bytes = b"") -> AsyncIterator[str]:
    """A TCP server that reads a request and answers `answer` (None: nothing, ever),
    then `repeat` over and over, and keeps the connection until the client closes it."""

    async def serve(stream: trio.SocketStream) -> None:
        try:
            await stream.receive_some()
            if answer is None:
                await trio.sleep_forever()
            await stream.send_all(answer)
            while repeat:
                await stream.send_all(repeat)
            while await stream.receive_some():  # until the client hangs up
                pass
        except trio.BrokenResourceError:
            pass
        finally:
            await stream.aclose()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, serve, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        yield f"http://127.0.0.1:{port}"
        nursery.cancel_scope.cancel()


# What a member cut off from the others answers (etcd's words for gRPC's UNAVAILABLE).
NO_LEADER = b'{"error":"etcdserver: no leader","code":14,"message":"etcdserver: no leader"}'
NO_LEADER_IN_STREAM = (
    b'{"error":{"grpc_code":14,"http_code":503,"message":"etcdserver: no leader"}}\n'
)


@pytest.mark.parametrize(
    ("answer", "repeat", "words", "watch_words"),
    [
        (b"garbage\r\n\r\n", b"", "answered something that is not HTTP", ""),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 99999999999\r\n\r\n", b"", "a body over 1 MiB", "no answer within"),
        (b"HTTP/1.1 200 OK\r\n\r\n", b"x" * 65536, "a body over 1 MiB", "a watch message over 1 MiB"),
        (b'HTTP/1.1 200 OK\r\nContent-Length: 12\r\n\r\n{"kvs": [1]}', b"", "not etcd's", "the stream ended"),
        (b'HTTP/1.1 200 OK\r\nContent-Length: 14\r\n\r\n{"header": {}}', b"", "not etcd's", "the stream ended"),
        (b"HTTP/1.1 500 Oops\r\nContent-Length: 5\r\n\r\noops!", b"", "HTTP 500 with a body that is not etcd's JSON", ""),
        (None, b"", "no answer within", ""),
        (b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: %d\r\n\r\n%s" % (len(NO_LEADER), NO_LEADER), b"", "etcd: etcdserver: no leader", ""),
        (b"HTTP/1.1 200 OK\r\n\r\n" + NO_LEADER_IN_STREAM, b"", "no answer within", "etcd: etcdserver: no leader"),
    ],
    ids=["garbage", "huge-declared", "huge-streamed", "not-etcd-json", "no-revision", "not-etcd-error", "silent", "etcd-unavailable", "etcd-unavailable-in-stream"],
)  # fmt: skip
async def test_an_endpoint_that_is_not_etcd(
    etcd: EtcdCluster,
    monkeypatch: pytest.MonkeyPatch,
    answer: bytes | None,
    repeat: bytes,
    words: str,
    watch_words: str,
) -> None:
    monkeypatch.setattr(etcd_module, "MAX_RESPONSE_BYTES", 1 << 20)
    monkeypatch.setattr(etcd_module, "MAX_LINE_BYTES", 1 << 20)
    key = fresh() + b"k"
    # A short bound where the bound is the subject; elsewhere a loaded machine's pause
    # must not pass for the endpoint's silence (a put not yet sent when 0.5 s ran out).
    timeout_s = 1.0 if "no answer within" in words + watch_words else 5.0
    silent = f"no answer within {timeout_s:g} s"
    words, watch_words = (w.replace("no answer within", silent) for w in (words, watch_words))
    async with hostile(answer, repeat) as url:
        with trio.fail_after(30):
            async with client([url], timeout_s=timeout_s) as c:
                started = trio.current_time()
                with pytest.raises(StoreUnavailable) as caught:
                    await c.get(key)
                assert trio.current_time() - started < timeout_s + 1
                assert str(caught.value).startswith(f"no etcd endpoint answered range: {url}: ")
                assert words in str(caught.value) and "\n" not in str(caught.value)
                # a write was sent: its outcome is unknown, not failed over
                with pytest.raises(StoreOutcomeUnknown, match=f"etcd {url}: put was sent, then"):
                    await c.put(key, b"x")
                started = trio.current_time()
                with pytest.raises(StoreUnavailable) as caught:
                    async with c.watch(key):
                        pass
                assert trio.current_time() - started < timeout_s + 1
                assert str(caught.value).startswith(f"no etcd endpoint answered watch: {url}: ")
                assert (watch_words or words) in str(caught.value) and "\n" not in str(caught.value)
            # a read, and a watch, go on to the next endpoint
            async with client([url, *etcd.endpoints], timeout_s=timeout_s) as c:
                assert await c.get(key) is None
                async with c.watch(key) as stream:
                    await c.put(key, b"1")
                    assert await events(stream, 1) == [("put", key, b"1")]


async def test_a_watch_message_over_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(etcd_module, "MAX_LINE_BYTES", 1 << 20)
    created = b'{"result":{"header":{"revision":"7"},"created":true}}\n'
    async with hostile(b"HTTP/1.1 200 OK\r\n\r\n" + created, b"x" * 65536) as url:
        with trio.fail_after(5):
            async with client([url], timeout_s=0.5) as c, c.watch(b"k") as stream:
                assert stream.revision == 7
                with pytest.raises(StoreError, match="the watch broke: a watch message over 1 MiB"):
                    await anext(stream)
