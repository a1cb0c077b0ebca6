"""The route feed's codec: round trips, and bad frames that only ever raise FeedError."""

from __future__ import annotations

import json

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from hypothesis_profiles import profile_times
from llmgw_core.autoscaling import RouterLoad
from llmgw_core.catalog import Endpoint
from llmgw_server.route_feed.connection import local_pair
from llmgw_server.route_feed.hub import RouteHub
from llmgw_server.route_feed.messages import (
    LOAD_INTERVAL_S,
    PROTOCOL,
    FeedError,
    Hello,
    InFlight,
    Load,
    Routes,
    RouteTable,
    decode_down,
    decode_table,
    decode_up,
    encode,
)
from llmgw_server.route_feed.relay import TableRelay

endpoints = st.builds(
    Endpoint,
    host=st.text(min_size=1, max_size=20),
    port=st.integers(1, 65535),
    prefix=st.text(max_size=10),
    api_key=st.text(max_size=20),
)
tables = st.builds(
    RouteTable,
    version=st.integers(0, 2**53),
    models=st.dictionaries(
        st.text(min_size=1, max_size=20), st.lists(endpoints, max_size=4).map(tuple), max_size=5
    ),
    draining=st.frozensets(endpoints, max_size=4),
    complete=st.booleans(),
)



@st.composite
def tables_with_adapters(draw: st.DrawFn) -> RouteTable:
    """A table whose adapters each adapt one of its models and are named like none."""
    table = draw(tables)
    names = st.text(min_size=1, max_size=20).filter(lambda n: n not in table.models)
    bases = st.sampled_from(sorted(table.models)) if table.models else st.nothing()
    adapters = draw(st.dictionaries(names, bases, max_size=4)) if table.models else {}
    return RouteTable(table.version, table.models, table.draining, table.complete, adapters)


ups = st.one_of(
    st.builds(Hello, protocol=st.just(PROTOCOL), router=st.text(max_size=30)),
    st.builds(
        InFlight,
        version=st.integers(0, 2**53),
        counts=st.dictionaries(st.text(max_size=30), st.integers(0, 10**6), max_size=5),
    ),
)


@settings(max_examples=profile_times(2))
@given(tables)
def test_routes_round_trip(table: RouteTable) -> None:
    assert decode_down(encode(Routes(table))) == Routes(table)


@settings(max_examples=profile_times(2))
@given(tables_with_adapters())
def test_routes_with_lora_adapters_round_trip(table: RouteTable) -> None:
    assert decode_down(encode(Routes(table))) == Routes(table)


def test_a_table_carries_each_adapter_and_its_model_and_one_without_still_decodes() -> None:
    endpoint = Endpoint("10.0.0.5", 8000)
    table = RouteTable(3, {"qwen": (endpoint,)}, frozenset(), adapters={"qwen-sql": "qwen"})
    frame = encode(Routes(table))
    assert json.loads(frame)["table"]["adapters"] == {"qwen-sql": "qwen"}
    assert decode_table(frame).adapters == {"qwen-sql": "qwen"}
    # A control plane from before adapters sends none: the table decodes without them.
    older = json.loads(frame)
    del older["table"]["adapters"]
    assert decode_table(json.dumps(older)) == RouteTable(3, {"qwen": (endpoint,)}, frozenset())


@settings(max_examples=profile_times(2))
@given(ups)
def test_up_messages_round_trip(message: Hello | InFlight) -> None:
    assert decode_up(encode(message)) == message


def test_the_engine_key_travels_with_its_endpoint() -> None:
    endpoint = Endpoint("10.0.0.5", 8000, api_key="engine-secret")
    table = RouteTable(7, {"qwen": (endpoint,)}, frozenset({endpoint}))
    decoded = decode_table(encode(Routes(table)))
    assert decoded.models["qwen"][0].api_key == "engine-secret"
    assert decoded.draining == {endpoint}


def test_a_load_frame_and_an_autoscaling_table_round_trip() -> None:
    load = Load({"chat": RouterLoad(3, 1, 120.5, 0.25, 0.4, 17), "idle": RouterLoad()})
    assert decode_up(encode(load)) == load
    table = RouteTable(2, {"chat": ()}, frozenset(), autoscaled=frozenset({"chat"}))
    assert decode_down(encode(Routes(table))) == Routes(table)
    # A table from before autoscaling still decodes: it autoscales nothing.
    old = json.loads(encode(Routes(table)))
    del old["table"]["autoscaled"]
    assert decode_table(json.dumps(old)).autoscaled == frozenset()


async def test_the_hub_keeps_the_loads_of_autoscaled_models_only_and_hears_a_held_one(
    autojump_clock: trio.abc.Clock,
) -> None:
    hub = RouteHub()
    hub.publish({"chat": (), "fixed": ()}, frozenset(), complete=True, autoscaled=frozenset({"chat"}))
    router_end, hub_end = local_pair()
    held_heard: list[float] = []

    async def hear_held() -> None:
        await hub.wait_held()
        held_heard.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(hub.serve, hub_end, "peer")
        nursery.start_soon(hear_held)
        await router_end.send(encode(Hello(PROTOCOL, "r1")))
        await router_end.receive()  # the table
        models = {m: RouterLoad(in_flight=2, ttft_p90_ms=90.0, requests=5) for m in ("chat", "fixed", "x" * 50)}
        await router_end.send(encode(Load(models)))
        await trio.sleep(1)
        assert hub.loads() == {"chat": [models["chat"]]}  # what the table does not autoscale: not kept
        assert dict(hub.arrived) == {"chat": 5} and not held_heard
        assert hub.ttft_peak("chat", since=0.0) == 90.0 and hub.ttft_peak("fixed", since=0.0) is None
        await router_end.send(encode(Load({"chat": RouterLoad(held=1, ttft_p90_ms=40.0, requests=1)})))
        await trio.sleep(1)
        assert held_heard and hub.loads()["chat"][0].held == 1 and hub.arrived["chat"] == 6
        assert hub.ttft_peak("chat", since=0.0) == 90.0  # the worst since then
        assert hub.ttft_peak("chat", since=trio.current_time() - 0.5) is None
        assert hub.ttft_peak("chat", since=trio.current_time() - 1.5) == 40.0
        router_end.close()
    assert hub.loads() == {}  # a follower gone: its load goes with it


def test_up_and_down_do_not_mix() -> None:
    with pytest.raises(FeedError, match="unknown message type 'routes'"):
        decode_up(encode(Routes(RouteTable(1))))
    with pytest.raises(FeedError, match="unknown message type 'hello'"):
        decode_down(encode(Hello(PROTOCOL, "r1")))


@pytest.mark.parametrize(
    ("frame", "reason"),
    [
        ("not json", "not JSON"),
        ("[1]", "JSON object"),
        ('{"router": "r"}', "unknown message type None"),
        ('{"type": "hello", "protocol": 3, "router": "r"}', "protocol 3 is not supported"),
        ('{"type": "hello", "protocol": 0, "router": "r"}', "protocol 0 is not supported"),
        ('{"type": "hello", "protocol": 1, "router": "r", "newest": "2"}', "expected int"),
        ('{"type": "hello", "router": "r"}', "required field missing @ frame.protocol"),
        ('{"type": "hello", "protocol": "1", "router": "r"}', "expected int @ frame.protocol"),
        ('{"type": "hello", "protocol": true, "router": "r"}', "expected int @ frame.protocol"),
        ('{"type": "in_flight", "version": 1, "counts": {"u": -1}}', "must not be negative"),
        ('{"type": "in_flight", "version": 1, "counts": {"u": 1.5}}', "expected int"),
        ('{"type": "in_flight", "version": 1, "counts": [1]}', "malformed"),
        (b"\x00\x01", "binary frames"),
        ('"' + "x" * (17 * 1024 * 1024) + '"', "exceeds"),
        ("[" * 100000 + "]" * 100000, "not JSON"),
        ('{"type": "load", "models": {"m": {"in_flight": -1}}}', "must not be negative"),
        ('{"type": "load", "models": {"m": {"held": 1.5}}}', "expected int"),
        ('{"type": "load", "models": {"m": {"kv_use": 1.5}}}', "a share, 0-1"),
        ('{"type": "load", "models": {"m": {"kv_use": "0.5"}}}', "expected float"),
        ('{"type": "load", "models": {"m": {"ttft_p90_ms": 1e999}}}', "expected float"),
        ('{"type": "load", "models": {"m": {"ttft_p90_ms": -3}}}', "must not be negative"),
        ('{"type": "load", "models": {"m": {"idle_s": -1}}}', "must not be negative"),
        ('{"type": "load", "models": {"m": {"requests": true}}}', "expected int"),
        ('{"type": "load", "models": [1]}', "malformed"),
        (
            json.dumps({"type": "load", "models": {str(i): {} for i in range(10_001)}}),
            "names 10001 models, over 10000",
        ),
    ],
)
def test_bad_up_frames_say_why(frame: str | bytes, reason: str) -> None:
    with pytest.raises(FeedError, match=reason):
        decode_up(frame)


def _routes(table: object) -> str:
    return json.dumps({"type": "routes", "table": table})


@pytest.mark.parametrize(
    ("frame", "reason"),
    [
        (_routes({"models": {}}), "required field missing @ frame.table.version"),
        (_routes({"version": -1}), "must not be negative"),
        (_routes({"version": 1, "models": {"m": [{"host": "h", "port": 0}]}}), "port 0"),
        (_routes({"version": 1, "models": {"m": [{"host": "", "port": 80}]}}), "no host"),
        (_routes({"version": 1, "models": {"": []}}), "empty name"),
        (_routes({"version": 1, "models": {"m": [{"port": 80}]}}), "required field missing"),
        (_routes({"version": 1, "draining": [{"host": "h", "port": 70000}]}), "port 70000"),
        (_routes({"version": 1, "complete": "yes"}), "expected bool"),
        (_routes({"version": 1, "models": {"m": "http://h:1"}}), "malformed"),
        (_routes([]), "malformed"),
        (_routes({"version": 1, "adapters": {"a": 1}}), "expected str"),
        (_routes({"version": 1, "adapters": ["a"]}), "malformed"),
        (_routes({"version": 1, "models": {"m": []}, "adapters": {"a": "n"}}),
         "the adapter 'a' adapts 'n', which the table lacks"),
        (_routes({"version": 1, "models": {"m": []}, "adapters": {"m": "m"}}),
         "names the adapter 'm', which is no adapter's name"),
        (_routes({"version": 1, "models": {"m": []}, "adapters": {"": "m"}}),
         "names the adapter '', which is no adapter's name"),
        (_routes({"version": 1, "models": {"m": []}, "autoscaled": ["n"]}),
         "autoscales 'n', which it does not place"),
    ],
)  # fmt: skip
def test_bad_tables_say_why(frame: str, reason: str) -> None:
    with pytest.raises(FeedError, match=reason):
        decode_down(frame)


@settings(max_examples=profile_times(3))
@given(st.one_of(st.text(max_size=300), st.binary(max_size=300)))
def test_arbitrary_frames_decode_or_raise_feed_error(frame: str | bytes) -> None:
    for decode in (decode_up, decode_down):
        try:
            decode(frame)
        except FeedError:
            pass


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=20,
)
endpoint_like = st.fixed_dictionaries(
    {}, optional={"host": json_values, "port": json_values, "prefix": json_values}
)


@settings(max_examples=profile_times(5))
@given(
    st.sampled_from(["hello", "in_flight", "routes", "nope"]),
    st.dictionaries(
        st.sampled_from(["protocol", "router", "version", "counts", "table"]),
        json_values
        | st.fixed_dictionaries(
            {},
            optional={
                "version": json_values,
                "models": st.dictionaries(
                    st.text(max_size=5), st.lists(endpoint_like) | json_values
                ),
                "draining": st.lists(endpoint_like) | json_values,
                "complete": json_values,
                "adapters": st.dictionaries(st.text(max_size=5), json_values) | json_values,
            },
        ),
    ),
)
def test_typed_garbage_decodes_or_raises_feed_error(tag: str, fields: dict[str, object]) -> None:
    frame = json.dumps({"type": tag, **fields})
    for decode in (decode_up, decode_down):
        try:
            decode(frame)
        except FeedError:
            pass


async def test_a_workers_parent_forwards_its_workers_loads_combined_and_a_held_one_at_once(
    autojump_clock: trio.abc.Clock,
) -> None:
    control = RouteHub()  # the control plane's
    control.publish({"chat": ()}, frozenset(), complete=True, autoscaled=frozenset({"chat"}))
    relay = TableRelay(RouteHub(), "parent")
    up_relay, up_control = local_pair()
    workers = [local_pair() for _ in range(2)]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(control.serve, up_control, "parent")
        nursery.start_soon(relay.follow, up_relay)
        while relay.table is None:
            await trio.sleep(0.01)
        for i, (worker, parent_end) in enumerate(workers):
            nursery.start_soon(relay.hub.serve, parent_end, f"worker {i}")
            await worker.send(encode(Hello(PROTOCOL, f"worker {i}")))
            table = decode_table(await worker.receive())
            assert table.autoscaled == frozenset({"chat"})  # relayed to the workers
            await worker.send(encode(InFlight(table.version, {})))
        await workers[0][0].send(encode(Load({"chat": RouterLoad(2, 0, 80.0, 3.0, None, 4)})))
        await workers[1][0].send(encode(Load({"chat": RouterLoad(1, 0, 120.0, 1.0, None, 2)})))
        await trio.sleep(LOAD_INTERVAL_S + 0.5)
        (combined,) = control.loads()["chat"]
        assert combined == RouterLoad(3, 0, 120.0, 1.0, None, 6)
        assert control.arrived["chat"] == 6
        # Nothing new arrived since: the next report forwards no request twice.
        await trio.sleep(LOAD_INTERVAL_S)
        assert control.arrived["chat"] == 6
        # A worker holds a request: the control plane hears it at once, not a report later.
        start = trio.current_time()
        await workers[1][0].send(encode(Load({"chat": RouterLoad(held=1, requests=1)})))
        await control.wait_held()
        assert trio.current_time() - start < LOAD_INTERVAL_S / 2
        assert control.loads()["chat"][0].held == 1
        nursery.cancel_scope.cancel()


async def test_a_workers_parent_refuses_a_stale_epoch_and_tells_a_new_leader_what_is_held_at_once(
    autojump_clock: trio.abc.Clock,
) -> None:
    """The relay fences as a router's Follower does: a table of a lower epoch ends the
    feed and never reaches the workers; connecting to a new control plane, it reports
    what its workers hold as soon as it has the table."""
    zero = frozenset({"chat"})
    relay = TableRelay(RouteHub(relays=True), "parent")
    old, new = RouteHub(epoch=5), RouteHub(epoch=6)
    for hub in (old, new):
        hub.publish({"chat": ()}, frozenset(), complete=True, autoscaled=zero)
    worker, parent_end = local_pair()
    async with trio.open_nursery() as nursery:
        up_relay, up_control = local_pair()
        nursery.start_soon(old.serve, up_control, "parent")
        nursery.start_soon(relay.follow, up_relay)
        while relay.table is None:
            await trio.sleep(0.01)
        nursery.start_soon(relay.hub.serve, parent_end, "worker")
        await worker.send(encode(Hello(1, "worker", PROTOCOL)))
        relayed = decode_table(await worker.receive())
        await worker.send(encode(Load({"chat": RouterLoad(held=1, requests=1)})))
        await old.wait_held()
        up_control.outbox.close()  # the old leader is gone
        # A control plane of a stale epoch: refused, and the workers keep their table.
        stale = RouteHub(epoch=4)
        stale.publish({"chat": (Endpoint("10.0.0.9", 8000),)}, frozenset(), complete=True)
        up_relay, up_control = local_pair()
        nursery.start_soon(stale.serve, up_control, "parent")
        with pytest.raises(FeedError, match="stale epoch 4"), trio.fail_after(5):
            await relay.follow(up_relay)
        assert relay.refused_stale == 1 and relay.epoch == 5
        assert relay.hub.table.version == relayed.version
        # The new leader hears of the held request at once, not a load interval later.
        up_relay, up_control = local_pair()
        nursery.start_soon(new.serve, up_control, "parent")
        nursery.start_soon(relay.follow, up_relay)
        start = trio.current_time()
        while not new.loads():
            await trio.sleep(0.01)
        assert trio.current_time() - start < LOAD_INTERVAL_S / 4
        assert new.loads()["chat"][0].held == 1 and relay.epoch == 6
        nursery.cancel_scope.cancel()
