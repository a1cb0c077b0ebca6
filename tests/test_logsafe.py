"""Peers' words in the server's log (issue 17, finding 7): escaped, one line per event,
whatever a node sends: the helper itself, and a forging node over a real agent stream."""

from __future__ import annotations

import logging

import pytest
import trio
import trio_websocket

from llmgw_core.config import parse_config
from llmgw_core.inventory import EngineInfo, Gpu, Inventory, ShardReport, ShardState
from llmgw_core.logsafe import escaped
from llmgw_core.wire import PROTOCOL, Ack, Register, ShardUpdate, Start, decode_down, encode
from llmgw_server.wiring import Running, main

FORGED = "boom\n2026-01-01 00:00:00,000 WARNING llmgw.admin FORGED \x1b[2J\x1b[31mred\r\x07\u2028x"


def test_printable_text_is_left_as_it_is() -> None:
    assert escaped("replica m-1 rank 0: exit status 1 (it's 'fine')") == (
        "replica m-1 rank 0: exit status 1 (it's 'fine')"
    )
    assert escaped("GPU «0» größer: 80 GiB") == "GPU «0» größer: 80 GiB"
    assert escaped(None) == "None" and escaped(42) == "42"
    assert escaped(b"evil.example\r\n\xff") == "evil.example\\r\\n\xff"


def test_control_characters_are_escaped_as_repr_writes_them() -> None:
    assert escaped("a\nb\rc\td\x1b[31m\x00\x7f\x85\u2028\u202e") == (
        "a\\nb\\rc\\td\\x1b[31m\\x00\\x7f\\x85\\u2028\\u202e"
    )
    # A literal backslash-n cannot pass for an escaped newline.
    assert escaped("a\\nb") == "a\\\\nb"
    assert escaped("a\nb") != escaped("a\\nb")
    line = escaped(FORGED)
    assert line.isprintable() and "\n" not in line and "\x1b" not in line


def test_length_is_bounded_and_the_rest_counted() -> None:
    assert escaped("x" * 1500) == "x" * 1000 + "... (500 more characters)"
    assert escaped("\n" * 30, limit=10) == "\\n" * 10 + "... (20 more characters)"
    assert escaped("x" * 10, limit=10) == "x" * 10


CONFIG: dict[str, object] = {
    "server": {"listen": "127.0.0.1:0", "control_listen": "127.0.0.1:0"},
    "agents": {"insecure": True},
    "control": {"settle_after_start_s": 0},
    "models": [{"name": "m", "profile": {"engine": "mock", "model": "org/m"}}],
}


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The captured log as a file would hold it (one record, as many lines as it has)."""
    formatter = logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s")
    return "\n".join(formatter.format(r) for r in caplog.records).split("\n")


async def test_a_forging_node_writes_one_escaped_line_per_event(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    inventory = Inventory(
        name="forger",
        gpus=(Gpu(0, "GPU-0", "NVIDIA L4", 23034, 22500),),
        engines=(EngineInfo("mock", True, "1"),),
    )
    stop = trio.Event()
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            running: Running = await nursery.start(
                lambda **kw: main(parse_config(CONFIG, "<test>"), stop=stop, **kw)
            )
            url = f"ws://127.0.0.1:{running.control_port}/v1/agent"
            async with trio_websocket.open_websocket_url(url) as ws:
                await ws.send_message(encode(Register(PROTOCOL, "test", inventory)))
                while not isinstance(start := decode_down(await ws.get_message()), Start):
                    pass
                await ws.send_message(encode(Ack(start.command_id, ok=False, error=FORGED)))
                failed = ShardReport(start.spec, ShardState.FAILED, FORGED)
                await ws.send_message(encode(ShardUpdate(failed, (FORGED, "last\x1b[0m line"))))
                # The control core's own line quotes the detail: wait for it.
                while not any("; restart in" in r.getMessage() for r in caplog.records):
                    await trio.sleep(0.01)
            stop.set()
    lines = _lines(caplog)
    assert not any(c in line for line in lines for c in "\r\x1b\x07\u2028"), lines
    assert not any(line.startswith("2026-01-01") for line in lines), lines
    forged = [line for line in lines if "FORGED" in line]
    # The ack's error, the stream's failure line (detail and tail), the core's note.
    assert len(forged) == 3, forged
    assert any("refused command" in line for line in forged)
    assert any("output tail" in line and "last\\x1b[0m line" in line for line in forged)
    assert any("failed on forger: boom\\n2026-01-01" in line for line in forged)


async def test_a_node_name_with_control_characters_is_refused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    stop = trio.Event()
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            running: Running = await nursery.start(
                lambda **kw: main(parse_config(CONFIG, "<test>"), stop=stop, **kw)
            )
            url = f"ws://127.0.0.1:{running.control_port}/v1/agent"
            async with trio_websocket.open_websocket_url(url) as ws:
                await ws.send_message(encode(Register(PROTOCOL, "t", Inventory(name=FORGED))))
                with pytest.raises(trio_websocket.ConnectionClosed) as closed:
                    await ws.get_message()
            assert closed.value.reason is not None
            assert "a node name must be 1 to 253 printable characters, not" in (closed.value.reason.reason or "")
            stop.set()
    lines = _lines(caplog)
    assert not any(line.startswith("2026-01-01") for line in lines), lines
    assert [line for line in lines if "FORGED" in line] == [
        line for line in lines if "closing the stream of" in line and "FORGED" in line
    ]
    assert not any("registered" in line and "FORGED" in line for line in lines)
