"""The server's agent streams, in process over real sockets: a bad peer is closed with a
reason and harms no other stream."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import trio
import trio_websocket

from llmgw_core.config import parse_config
from llmgw_core.inventory import Gpu, Inventory
from llmgw_core.wire import PROTOCOL, Heartbeat, Register, Welcome, decode_down, encode
from llmgw_server.wiring import Running, main

CONFIG: dict[str, object] = {
    "server": {"listen": "127.0.0.1:0", "control_listen": "127.0.0.1:0"},
    "agents": {"insecure": True},
    "models": [
        {"name": "m", "profile": {"engine": "vllm", "model": "org/m", "gpu_model": "B300"}},
    ],
}


def inventory(name: str) -> Inventory:
    return Inventory(name=name, gpus=(Gpu(0, "GPU-0", "NVIDIA L4", 23034, 22500),))


async def close_reason(url: str, *frames: str | bytes) -> trio_websocket.CloseReason:
    async with trio_websocket.open_websocket_url(url) as ws:
        try:
            for frame in frames:
                await ws.send_message(frame)
            while True:
                await ws.get_message()
        except trio_websocket.ConnectionClosed as closed:
            assert closed.reason is not None
            return closed.reason
    raise AssertionError("unreachable")


async def test_bad_peers_are_closed_with_a_reason_and_a_good_one_is_untouched() -> None:
    stop = trio.Event()
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            running: Running = await nursery.start(
                lambda **kw: main(parse_config(CONFIG, "<test>"), stop=stop, **kw)
            )
            url = f"ws://127.0.0.1:{running.control_port}/v1/agent"
            async with trio_websocket.open_websocket_url(url) as good:
                await good.send_message(encode(Register(PROTOCOL, "test", inventory("good-node"))))
                assert isinstance(decode_down(await good.get_message()), Welcome)

                reason = await close_reason(url, "not json at all")
                assert reason.code == 1008 and "not JSON" in (reason.reason or "")
                reason = await close_reason(url, encode(Heartbeat(1)))
                assert "the first message must be register" in (reason.reason or "")
                too_new = json.loads(encode(Register(PROTOCOL, "test", inventory("x"))))
                too_new["protocol"] = 99
                reason = await close_reason(url, json.dumps(too_new))
                assert "protocol version 99 is not supported" in (reason.reason or "")
                reason = await close_reason(
                    url,
                    encode(Register(PROTOCOL, "t", inventory("y"))),
                    encode(Register(PROTOCOL, "t", inventory("y"))),
                )
                assert "Register is out of order" in (reason.reason or "")
                reason = await close_reason(url, "x" * (2 * 1024 * 1024))
                assert reason.code == 1009  # message too big
                reason = await close_reason(url, b"\x00binary")
                assert "binary frames" in (reason.reason or "")

                # The good node kept its stream through all of it.
                await good.send_message(encode(Heartbeat(1)))
                async with httpx.AsyncClient() as client:
                    status = (
                        await client.get(f"http://127.0.0.1:{running.control_port}/v1/admin/status")
                    ).json()
                nodes = {n["name"]: n["status"] for n in status["nodes"]}
                assert nodes["good-node"] == "reachable"
                assert "x" not in nodes  # refused before it registered
                # The router still answers.
                async with httpx.AsyncClient() as client:
                    assert (
                        await client.get(f"http://127.0.0.1:{running.port}/healthz")
                    ).status_code == 200
            stop.set()


async def test_mutual_tls_binds_the_node_name_to_its_certificate(tmp_path: Path) -> None:
    import ssl

    from llmgw_core.certs import init_ca, issue_node

    certs = tmp_path / "certs"
    init_ca(certs)
    n1_crt, n1_key, _ = issue_node(certs, "n1")
    bad_crt, bad_key, bad_serial = issue_node(certs, "revoked")
    other = tmp_path / "other"
    init_ca(other)
    stranger_crt, stranger_key, _ = issue_node(other, "n1")
    config: dict[str, object] = {
        **CONFIG,
        "agents": {
            "ca": str(certs / "ca.crt"),
            "cert": str(certs / "server.crt"),
            "key": str(certs / "server.key"),
            "deny_serials": [f"{bad_serial:x}"],
        },
    }

    def client(crt: object = None, key: object = None, ca: object = certs / "ca.crt") -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(ca))
        if crt:
            context.load_cert_chain(str(crt), str(key))
        return context

    async def attempt(context: ssl.SSLContext, name: str) -> str:
        try:
            async with trio_websocket.open_websocket_url(url, context, connect_timeout=3) as ws:
                await ws.send_message(encode(Register(PROTOCOL, "t", inventory(name))))
                message = await ws.get_message()
                return type(decode_down(message)).__name__
        except trio_websocket.ConnectionClosed as closed:
            assert closed.reason is not None
            return f"closed: {closed.reason.reason}"
        except trio_websocket.ConnectionRejected as rejected:
            return f"rejected: {rejected.status_code}"
        except (trio_websocket.HandshakeError, trio.BrokenResourceError, OSError) as exc:
            return f"failed: {type(exc).__name__}"

    stop = trio.Event()
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            running: Running = await nursery.start(lambda **kw: main(parse_config(config, "<test>"), stop=stop, **kw))
            url = f"wss://127.0.0.1:{running.control_port}/v1/agent"
            assert await attempt(client(n1_crt, n1_key), "n1") == "Welcome"
            claimed = await attempt(client(n1_crt, n1_key), "n2")
            assert claimed.startswith("closed: the certificate from") and "is for 'n1', but it registered as 'n2'" in claimed
            denied = await attempt(client(bad_crt, bad_key), "revoked")
            assert denied.startswith("closed: the certificate of revoked") and "deny list" in denied
            assert await attempt(client(), "n1") == "rejected: 403"  # no client certificate
            # A certificate from another CA is refused, and the agent refuses a server it cannot verify.
            assert (await attempt(client(stranger_crt, stranger_key), "n1")).startswith(("failed", "rejected"))
            assert (await attempt(client(n1_crt, n1_key, ca=other / "ca.crt"), "n1")).startswith("failed")
            stop.set()
