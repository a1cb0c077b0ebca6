"""One process of the fleet simulator: simulated agents `first` .. `first + count - 1`.

Run by bench/fleet_bench.py, several at once, so that the simulator is never the
bottleneck it measures. Each simulated node does what the real agent's stream
does (llmgw_core.dial for the TCP and TLS dial, with its own certificate from
the fleet CA; register; a heartbeat every interval; the agent's silence bound
and full-jitter reconnect backoff), and nothing else: no engines.

With several control planes (--url URL1,URL2,...: a fleet kept in a store), each
node follows the leader with the agent's own code (llmgw_agent.following): a
standby's NOT_LEADER close names the leader or sends it to the next one, a lost
leader's stream sends it down the list with the election's jitter, and a welcome
or a command of an epoch below the highest the node has seen is refused (the
welcome's stream closed with STALE_EPOCH_CLOSE), as the agent does.

Talks to the bench over stdin/stdout, one line each:
  in:  "go T"     boot node i at T + uniform(0, boot_s) (T on CLOCK_MONOTONIC, shared
                  by every process on the machine)
       "epoch T"  count the nodes registered since T from now on
       "stop"     exit
  out: "ready", then every 0.5 s a JSON report: registered now, registered since the
       epoch, connection attempts, heartbeats sent, and the times of registrations;
       with the leaders' epochs: the nodes registered now per epoch, each
       registration's time per epoch, and what stale epochs were refused.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import resource
import ssl
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import cast

import attrs
import trio
import trio_websocket

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from llmgw_agent.agent import CONNECT_TIMEOUT_S, Session, next_attempt, reconnect_delay
from llmgw_agent.config import AgentConfig
from llmgw_agent.following import ControlPlanes, lost_after, stale
from llmgw_core.dial import ConnectFailed, open_agent_stream
from llmgw_core.inventory import Gpu, Inventory
from llmgw_core.wire import (
    LOST_LEADER_HEADER,
    MAX_FRAME_BYTES,
    NOT_LEADER_CLOSE,
    PROTOCOL,
    STALE_EPOCH_CLOSE,
    Heartbeat,
    Pace,
    Register,
    Welcome,
    WireError,
    decode_down,
    encode,
    leader_from_reason,
    not_leader_reason,
    stale_epoch_reason,
)
from llmgw_core.ws_frames import Heard, Paced

H100 = "NVIDIA H100 80GB HBM3"
_ADDRESS = re.compile(r"Error connecting to \('[^']*', \d+\): |\[?[0-9a-f.:]*[0-9]\]?:\d+:? ?")
# The real agent's reconnect backoff, as its config has it by default (attrs types a
# field's default as optional: a field may have none; these have one).
BASE_S = cast(float, attrs.fields(AgentConfig).reconnect_base_s.default)
CAP_S = cast(float, attrs.fields(AgentConfig).reconnect_cap_s.default)


LONG_WAIT_S = 10.0


def why_failed(exc: BaseException) -> str:
    """Why a session ended, in a few words: the cause, never the control plane's address
    (the same in every line, it would crowd the cause out of the table)."""
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    if isinstance(exc, ConnectFailed):
        text = str(exc)
        if exc.come_back_s is not None:
            why = "refused, told when to come back"
        elif text.startswith("refused by the control plane"):
            why = text[: text.find(":", text.find("HTTP") + 5)]  # its HTTP status
        elif "refused" in text:
            why = "refused"
        elif "no answer" in text:  # and during which step
            why = "no answer " + text[text.rfind("(") :]
        else:
            why = text
    else:
        why = type(exc).__name__
    return _ADDRESS.sub("", why)[:90]


def source_address(i: int) -> str:
    """Each node dials from its own loopback address, as real nodes have their own: the
    control port's per-address limits see a fleet, not one peer."""
    return f"127.{1 + i // 62500}.{i // 250 % 250}.{i % 250 + 1}"


def node_name(i: int) -> str:
    return f"sim-{i:05d}"


def inventory(i: int) -> Inventory:
    """An 8-GPU node, as a real agent's probe reports it."""
    return Inventory(
        name=node_name(i),
        address=f"10.{i // 62500}.{i // 250 % 250}.{i % 250 + 1}",
        labels={"pool": "bench"},
        fabric={"ib_domain": f"pod-{i // 32}"},
        cpus=96,
        memory_mib=1_000_000,
        gpus=tuple(Gpu(g, f"GPU-{i}-{g}", H100, 81559, 81000) for g in range(8)),
    )


class Worker:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.urls = tuple(url.strip() for url in args.url.split(",") if url.strip())
        self.rng = random.Random(args.first)
        self.registered: set[int] = set()
        self.epoch = float("inf")
        self.since_epoch: set[int] = set()
        self.new_registrations: list[float] = []
        self.new_firsts: list[float] = []  # nodes registered for the first time since the epoch
        self.connects = 0
        self.heartbeats = 0
        self.contexts: dict[int, ssl.SSLContext] = {}
        self.failures: dict[str, int] = {}
        self.epochs: dict[int, int] = {}  # each node's highest epoch seen (absent: 0)
        self.registered_epoch: dict[int, int] = {}  # the epoch of its stream now
        self.new_by_epoch: dict[int, list[float]] = {}  # registrations' times since the last report
        self.stale_welcomes = 0  # welcomes refused for a stale epoch (stream closed)
        self.stale_messages = 0  # messages after a welcome refused for a stale epoch
        self.moves: dict[str, int] = {}  # why nodes went to another control plane
        # NOT_LEADER closes that came before the register could be sent.
        self.not_leader_before_register = 0
        # Standbys' hellos answered with the leader's URL before any TLS (agent_lane).
        self.sent_before_tls = 0
        self.long_waits: dict[str, tuple[int, float]] = {}  # why: (how many, the longest)

    def context(self, i: int) -> ssl.SSLContext | None:
        """The node's own TLS context, made once as the real agent does."""
        certs = self.args.certs
        if certs is None:
            return None
        context = self.contexts.get(i)
        if context is None:
            context = ssl.create_default_context(cafile=f"{certs}/ca.crt")
            name = node_name(i)
            context.load_cert_chain(f"{certs}/nodes/{name}.crt", f"{certs}/nodes/{name}.key")
            self.contexts[i] = context
        return context

    async def agent(self, i: int, boot_at: float) -> None:
        await trio.sleep(max(0.0, boot_at - time.monotonic()))
        register = encode(Register(PROTOCOL, "fleet-sim", inventory(i)))
        planes = ControlPlanes(self.urls)
        attempt = 0
        lost: str | None = None  # the control plane lost, named to the next (as the agent)
        while True:
            session = Session(planes.current)
            come_back: float | None = None
            try:
                await self.session(i, register, session, planes, lost)
            except* ConnectFailed as group:
                failed = group.exceptions[0]
                assert isinstance(failed, ConnectFailed)
                come_back = failed.come_back_s
                if failed.leader is not None:  # a standby named the leader before TLS
                    session.not_leader = not_leader_reason(failed.leader)
                    self.sent_before_tls += 1
                else:
                    self.failed(failed, session)
            except* (
                OSError,
                trio.TooSlowError,
                trio_websocket.HandshakeError,
                trio_websocket.ConnectionClosed,
                WireError,
            ) as group:
                self.failed(group.exceptions[0], session)
            self.registered.discard(i)
            self.registered_epoch.pop(i, None)
            if len(self.urls) > 1:
                welcomed = session.welcomed_at is not None
                busy = come_back is not None
                lost = lost_after(session.url, session.ended(), welcomed, lost, busy=busy)
            # Where next, as the agent's connect loop decides (llmgw_agent.agent.Agent.run).
            redial = planes.after(
                session.ended(),
                now=trio.current_time(),
                rng=self.rng,
                healthy=next_attempt(0, session) == 0,
                welcomed=session.welcomed_at is not None,
                epoch=self.epochs.get(i, 0),
                leader=leader_from_reason(session.not_leader),
                reason=session.not_leader or "",
                come_back_s=come_back,
            )
            if redial is not None:
                key = session.ended().value
                self.moves[key] = self.moves.get(key, 0) + 1
            if redial is not None and redial.delay_s is not None:
                self.waited(
                    "come back (failover)" if come_back is not None else "redial", redial.delay_s
                )
                await trio.sleep(redial.delay_s)
                continue
            attempt = next_attempt(attempt, session)
            delay = reconnect_delay(attempt, come_back, BASE_S, CAP_S, self.rng)
            self.waited("come back" if come_back is not None else "backoff", delay)
            await trio.sleep(delay)

    def waited(self, why: str, delay_s: float) -> None:
        """Waits of 10 s or more before a dial, by why: what keeps an agent away long."""
        if delay_s >= LONG_WAIT_S:
            count, longest = self.long_waits.get(why, (0, 0.0))
            self.long_waits[why] = (count + 1, max(longest, delay_s))

    def failed(self, exc: BaseException, session: Session) -> None:
        """Count why a session ended, in a few words (before or after its welcome)."""
        when = "after welcome" if session.welcomed_at is not None else "before welcome"
        key = f"{why_failed(exc)} ({when})"
        self.failures[key] = self.failures.get(key, 0) + 1

    async def session(
        self, i: int, register: str, session: Session, planes: ControlPlanes, lost: str | None
    ) -> None:
        self.connects += 1
        heard = Heard(trio.current_time())
        async with open_agent_stream(
            session.url,
            self.context(i),
            # The agent's own patience (shorter during a failover among several).
            connect_timeout_s=planes.dial_patience_s(trio.current_time(), CONNECT_TIMEOUT_S),
            disconnect_timeout_s=1.0,
            max_message_size=MAX_FRAME_BYTES,
            heard=heard,
            local_address=source_address(i) if self.args.own_addresses else None,
            headers=[] if lost is None else [(LOST_LEADER_HEADER, lost.encode())],
            lost_epoch=None if lost is None or planes.named else self.epochs.get(i, 0),
        ) as ws:
            sent = False
            with trio.fail_after(10):
                try:
                    # A standby accepts and closes at once: its close may come before the
                    # register is sent (then the send raises), as well as after.
                    await ws.send_message(register)
                    sent = True
                    welcome = decode_down(await ws.get_message())
                except trio_websocket.ConnectionClosed as closed:
                    if closed.reason is not None and closed.reason.code == NOT_LEADER_CLOSE:
                        session.not_leader = closed.reason.reason or ""
                        if not sent:
                            self.not_leader_before_register += 1
                        return
                    raise
            if not isinstance(welcome, Welcome):
                raise WireError(f"expected welcome, got {type(welcome).__name__}")
            highest = self.epochs.get(i, 0)
            if stale(welcome.epoch, highest):
                self.stale_welcomes += 1
                session.stale = True
                await ws.aclose(
                    code=STALE_EPOCH_CLOSE, reason=stale_epoch_reason(welcome.epoch, highest)
                )
                return
            if welcome.epoch > highest:
                self.epochs[i] = welcome.epoch
            heard.now()
            now = time.monotonic()
            self.registered.add(i)
            self.registered_epoch[i] = welcome.epoch
            self.new_by_epoch.setdefault(welcome.epoch, []).append(now)
            self.new_registrations.append(now)
            if now >= self.epoch and i not in self.since_epoch:
                self.since_epoch.add(i)
                self.new_firsts.append(now)
            paced = Paced.at(welcome.heartbeat_interval_s)
            session.welcomed_at, session.heard, session.bound = heard.at, heard, paced.bound
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self.drain, i, ws, nursery.cancel_scope, paced)
                # The real agent's first heartbeat comes one interval after the welcome,
                # and a pace moves the next one as the agent's does.
                seq = 0
                last = trio.current_time()
                while True:
                    changed = paced.changed
                    with trio.move_on_at(last + paced.interval_s):
                        await changed.wait()
                        continue
                    last = trio.current_time()
                    if last - heard.at > paced.bound.cut_after_s:
                        nursery.cancel_scope.cancel()  # silent: dial again, as the agent does
                        break
                    seq += 1
                    await ws.send_message(encode(Heartbeat(seq)))
                    self.heartbeats += 1
            if ws.closed is not None and ws.closed.code == NOT_LEADER_CLOSE:
                session.not_leader = ws.closed.reason or ""  # the leader stepped down

    async def drain(
        self,
        i: int,
        ws: trio_websocket.WebSocketConnection,
        scope: trio.CancelScope,
        paced: Paced,
    ) -> None:
        """What the control plane sends: a pace is followed unless its epoch is stale (a
        simulated node runs no command, so it acks none)."""
        try:
            while True:
                message = decode_down(await ws.get_message())
                highest = self.epochs.get(i, 0)
                if stale(message.epoch, highest):
                    self.stale_messages += 1
                    continue
                if message.epoch > highest:
                    self.epochs[i] = message.epoch
                if isinstance(message, Pace):
                    paced.set(message.heartbeat_interval_s)
        except trio_websocket.ConnectionClosed:
            scope.cancel()

    async def report(self) -> None:
        while True:
            line = {
                "registered": len(self.registered),
                "since_epoch": len(self.since_epoch),
                "connects": self.connects,
                "heartbeats": self.heartbeats,
                "at": self.new_registrations,
                "firsts": self.new_firsts,
                "failures": self.failures,
                "by_epoch": _counts(self.registered_epoch.values()),
                "at_epoch": self.new_by_epoch,
                "stale_welcomes": self.stale_welcomes,
                "stale_messages": self.stale_messages,
                "moves": self.moves,
                "not_leader_before_register": self.not_leader_before_register,
                "sent_before_tls": self.sent_before_tls,
                "long_waits": self.long_waits,
            }
            self.new_registrations, self.new_firsts, self.new_by_epoch = [], [], {}
            print(json.dumps(line), flush=True)
            await trio.sleep(0.5)

    async def run(self) -> None:
        commands = trio.lowlevel.FdStream(sys.stdin.fileno())
        # A real agent loads its certificate once, at start: not part of what is measured.
        for i in range(self.args.first, self.args.first + self.args.count):
            self.context(i)
        print("ready", flush=True)
        buffer = b""
        async with trio.open_nursery() as nursery:
            while True:
                data = await commands.receive_some()
                if not data:
                    break
                buffer += data
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    word, _, value = line.decode().partition(" ")
                    if word == "go":
                        start = float(value)
                        nursery.start_soon(self.report)
                        for i in range(self.args.first, self.args.first + self.args.count):
                            boot = start + self.rng.uniform(0, self.args.boot_s)
                            nursery.start_soon(self.agent, i, boot)
                    elif word == "epoch":
                        self.epoch = float(value)
                        self.since_epoch, self.new_firsts = set(), []
                    elif word == "stop":
                        nursery.cancel_scope.cancel()
                        return
            nursery.cancel_scope.cancel()


def _counts(values: Iterable[int]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for value in values:
        counts[value] = counts.get(value, 0) + 1
    return counts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--url", required=True, help="the control plane's agent URL, or several, comma-separated"
    )
    parser.add_argument("--first", type=int, required=True)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--boot-s", type=float, default=10.0)
    parser.add_argument("--certs", default=None)
    parser.add_argument("--own-addresses", action="store_true", help="a source address per node")
    args = parser.parse_args()
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    trio.run(Worker(args).run)


if __name__ == "__main__":
    main()
