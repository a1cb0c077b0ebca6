"""The engines of one node, through their whole lives: launched on a start command (after
the checks of `validate` and the installed engine's own flags), supervised
(`supervisor`), drained and stopped on command, adopted again after the agent restarts
(`adoption`, with what was left of those that cannot be); each change of state is
reported to the control plane through the agent's stream, or, for a failure while no
stream is open, after the next welcome.

`Engines.run` owns the engines' nursery and their health client: it runs beside the
agent's connection loop (`agent`), not inside it, so that the engines keep serving while
the control plane is away. The connection loop drives it with the commands it receives.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Awaitable, Callable
from pathlib import Path

import attrs
import httpx
import trio

from llmgw_agent import procinfo
from llmgw_agent import shard_records as records
from llmgw_agent.adapters import Command, EngineLaunch, build_command
from llmgw_agent.adoption import MARKER, Verdict, decide
from llmgw_agent.config import AgentConfig
from llmgw_agent.engine_flags import help_command, refusals
from llmgw_agent.flag_reader import FlagCache, FlagStore, program_identity, read_help
from llmgw_agent.shm_leftovers import clean_after
from llmgw_agent.supervisor import (
    LOG_FILES_KEPT,
    EngineProcess,
    Transition,
    prune_logs,
    stop_leftovers,
)
from llmgw_agent.validate import problems
from llmgw_core.inventory import Inventory, LaunchSpec, ShardReport, ShardState
from llmgw_core.logsafe import escaped
from llmgw_core.wire import ShardUpdate, UpMessage

log = logging.getLogger("llmgw.agent")  # the agent's one log, whichever module writes

ShardId = tuple[str, int]  # replica id, rank


@attrs.define(eq=False)
class Shard:
    """One rank of a replica on this node, with its engine while one runs."""

    spec: LaunchSpec
    state: ShardState
    detail: str = ""
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    process: EngineProcess | None = None
    # Its failure's report, with the engine's output tail, when no stream took it (the
    # control plane was away): sent after the next welcome, since a registration
    # carries only the state.
    unsent_failure: ShardUpdate | None = None

    def stop(self) -> None:
        """A stop command: end the engine (cancelling alone would leave it serving)."""
        if self.process is not None:
            self.process.stop_on_cancel = True
        self.scope.cancel()

    def report(self) -> ShardReport:
        return ShardReport(self.spec, self.state, self.detail)


class Engines:
    """The node's shards and their engines; `report` sends an update up the agent's
    stream and says whether a stream took it."""

    def __init__(
        self, config: AgentConfig, inventory: Inventory, report: Callable[[UpMessage], bool]
    ) -> None:
        self.config = config
        self.inventory = inventory
        self.shards: dict[ShardId, Shard] = {}
        self._report = report
        self._nursery: trio.Nursery | None = None
        self._client: httpx.AsyncClient | None = None
        # Each engine program's flags, read once per version, kept across restarts.
        self._flags = FlagCache(store=FlagStore(config.state_dir / "engine-flags"))

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Adopt the engines an earlier run left, then hold every engine until cancelled;
        `started()` once the adoption is done, before the agent registers."""
        # Their health, over plain HTTP on the node: no certificate to verify, so no CA
        # bundle loaded (0.05 to 0.2 s of CPU at each start).
        probes = httpx.AsyncClient(timeout=2.0, verify=False)
        async with probes as client, trio.open_nursery() as nursery:
            self._client, self._nursery = client, nursery
            await self._adopt()
            task_status.started()
            await trio.sleep_forever()

    def reports(self) -> tuple[ShardReport, ...]:
        """Every shard's state, for a registration."""
        return tuple(s.report() for s in self.shards.values())

    def unsent_failures(self) -> list[ShardUpdate]:
        """The failures no stream took (with the engines' output tails), taken to send
        after a welcome: a registration carries only the states."""
        unsent = []
        for shard in self.shards.values():
            if shard.unsent_failure is not None:
                unsent.append(shard.unsent_failure)
                shard.unsent_failure = None
        return unsent

    def drain(self, key: ShardId) -> bool:
        """A drain command; False: no such shard."""
        shard = self.shards.get(key)
        if shard is None:
            return False
        if shard.state not in (ShardState.STOPPED, ShardState.FAILED):
            self.transition(shard, ShardState.DRAINING, "draining on request")
        return True

    def stop(self, key: ShardId) -> bool:
        """A stop command; False: no such shard."""
        shard = self.shards.get(key)
        if shard is None:
            return False
        shard.stop()
        if shard.state in (ShardState.FAILED, ShardState.PENDING):
            self.transition(shard, ShardState.STOPPED, "stopped on request")
            self._forget_later(shard)
        return True

    def start(self, spec: LaunchSpec) -> str:
        """A start command: why `spec` cannot run here, or "" when its engine is launched."""
        key = (spec.replica_id, spec.rank)
        old = self.shards.get(key)
        if old is not None:
            old.stop()  # a new attempt replaces the old shard
        in_use = {
            i
            for k, s in self.shards.items()
            if k != key and s.state not in (ShardState.STOPPED, ShardState.FAILED)
            for i in s.spec.gpu_indices
        }
        shard = Shard(spec, ShardState.PENDING)
        self.shards[key] = shard
        found = problems(spec, self.inventory, in_use, self.config.bind_host)
        if found:
            reason = "the profile does not fit this node: " + "; ".join(found)
            self.transition(shard, ShardState.FAILED, reason)
            return reason
        self.transition(shard, ShardState.PENDING, "accepted")
        assert self._nursery is not None
        self._nursery.start_soon(self._run_engine, shard)
        return ""

    async def _run_engine(self, shard: Shard) -> None:
        spec = shard.spec
        config = self.config
        command = engine_command(config, spec)
        log.info("starting %s rank %d: %s", spec.replica_id, spec.rank, " ".join(command.argv))
        health = f"http://{config.advertise_host}:{spec.port}/health" if spec.is_head else None
        assert self._client is not None

        state_dir = config.state_dir
        logfile = records.log_path(state_dir, spec)
        known = {records.log_path(state_dir, s.spec).name for s in self.shards.values()}
        for old in prune_logs(logfile.parent, LOG_FILES_KEPT, known):
            log.info("removed the old engine log %s", old)

        # The marker a restarted agent knows the engine by (see `adoption`).
        launch_id = f"{spec.replica_id}.{spec.rank}.{secrets.token_hex(8)}"

        def remember(pid: int, shm_before: frozenset[str]) -> None:
            started = procinfo.start_time(pid) or 0
            argv = tuple(command.argv)
            record = records.ShardRecord(
                spec, pid, started, argv, str(logfile), launch_id, tuple(sorted(shm_before))
            )
            records.save(state_dir, record)

        shard.process = EngineProcess(
            command.argv,
            {**os.environ, **command.env, MARKER: launch_id},
            health,
            self._reporter(shard),
            self._client,
            logfile,
            stop_grace_s=config.stop_grace_s,
            start_timeout_s=config.start_timeout_s,
            on_spawn=remember,
            api_key=spec.api_key,
            files=command.files,
        )
        with shard.scope:
            refused = await self._flag_problems(spec, command)
            if refused:
                reason = "the profile does not fit this node: " + "; ".join(refused)
                self.transition(shard, ShardState.FAILED, reason)
            else:
                await shard.process.run()
        # Reached when the engine failed or was stopped; an agent that shuts down is
        # cancelled before this line and keeps the record, so a new agent adopts it.
        records.remove(state_dir, spec)
        if shard.state is ShardState.STOPPED:
            self._forget_later(shard)

    async def _flag_problems(self, spec: LaunchSpec, command: Command) -> list[str]:
        """The launch's flags the installed engine does not take (see `flag_reader`)."""
        engine = self.config.engines[spec.engine]
        asking = help_command(spec.engine, engine.command)
        if asking is None:
            return []
        version = next((e.version for e in self.inventory.engines if e.name == spec.engine), "")
        key = (spec.engine, engine.command, version, program_identity(engine.command[0]))
        env = {**os.environ, **engine.env}
        found = await self._flags.flags(key, lambda: read_help(asking, env))
        program = f"{spec.engine} {version}".rstrip()
        if found.flags is None:
            log.warning("the flags were not checked against %s: %s", program, found.why)
            return []
        # Every adapter puts the profile's args last, as given.
        own = command.argv[len(engine.command) : len(command.argv) - len(spec.args)]
        return refusals(spec.engine, program, found.flags, own, spec.args)

    def _reporter(self, shard: Shard) -> Callable[[Transition], Awaitable[None]]:
        async def report(t: Transition) -> None:
            state = ShardState(t.state)
            if state is ShardState.READY and shard.state is ShardState.DRAINING:
                return
            self.transition(shard, state, t.detail, t.output_tail)

        return report

    async def _adopt(self) -> None:
        """Find the engines an earlier run of this agent started, from the state directory.
        What is left of one that cannot be adopted is stopped before the agent registers,
        so that its replacement never starts beside it."""
        config = self.config
        assert self._nursery is not None and self._client is not None
        leftovers: list[records.ShardRecord] = []
        for record in records.load(config.state_dir):
            spec = record.spec
            key = (spec.replica_id, spec.rank)
            identity = record.identity()
            decision = decide(
                identity,
                procinfo.view(record.pid, MARKER),
                procinfo.group_members(record.pid, MARKER),
            )
            if decision.verdict is not Verdict.ADOPT:
                detail = f"the engine (pid {record.pid}) ended while the agent was away"
                if decision.verdict is Verdict.STOP:
                    pids = ", ".join(map(str, decision.leftovers))
                    detail += f"; its process group (pids {pids}) is stopped"
                    leftovers.append(record)  # its record goes once they are stopped
                else:
                    records.remove(config.state_dir, spec)
                    await _clean_shm(record)
                log.warning("%s rank %d: %s", spec.replica_id, spec.rank, detail)
                self.shards[key] = Shard(spec, ShardState.FAILED, detail)
                continue
            log.info("%s rank %d: adopting engine pid %d", spec.replica_id, spec.rank, record.pid)
            shard = self.shards[key] = Shard(spec, ShardState.STARTING, f"adopted pid {record.pid}")
            health = f"http://{config.advertise_host}:{spec.port}/health" if spec.is_head else None
            shard.process = EngineProcess(
                record.argv,
                {},
                health,
                self._reporter(shard),
                self._client,
                Path(record.log),
                stop_grace_s=config.stop_grace_s,
                start_timeout_s=config.start_timeout_s,
                api_key=spec.api_key,
            )
            self._nursery.start_soon(self._watch_adopted, shard, record)
        async with trio.open_nursery() as nursery:
            for record in leftovers:
                nursery.start_soon(self._stop_leftovers, record)

    async def _stop_leftovers(self, record: records.ShardRecord) -> None:
        spec = record.spec
        if not await stop_leftovers(record.identity(), self.config.stop_grace_s):
            log.error(
                "%s rank %d: processes of the engine's group (pid %d) outlived SIGKILL",
                spec.replica_id,
                spec.rank,
                record.pid,
            )
        else:
            await _clean_shm(record)
        records.remove(self.config.state_dir, spec)

    async def _watch_adopted(self, shard: Shard, record: records.ShardRecord) -> None:
        assert shard.process is not None
        with shard.scope:
            await shard.process.adopt(record.pid, record.started, _shm_before(record))
        records.remove(self.config.state_dir, shard.spec)
        if shard.state is ShardState.STOPPED:
            self._forget_later(shard)

    def transition(
        self, shard: Shard, state: ShardState, detail: str, tail: tuple[str, ...] = ()
    ) -> None:
        shard.state, shard.detail = state, detail
        spec = shard.spec
        if state is ShardState.FAILED:
            # The engine's words, escaped: its output must not forge the agent's log lines.
            log.warning("%s rank %d failed: %s", spec.replica_id, spec.rank, escaped(detail))
            for line in tail[-10:]:
                log.warning("    %s", escaped(line))
        else:
            # A detail may begin with the state ("draining on request"): say it once.
            words = detail if detail.startswith(str(state)) else f"{state} {detail}".rstrip()
            log.info("%s rank %d: %s", spec.replica_id, spec.rank, words)
        update = ShardUpdate(shard.report(), tail)
        sent = self._report(update)
        shard.unsent_failure = None if sent or state is not ShardState.FAILED else update

    def _forget_later(self, shard: Shard) -> None:
        """A stopped shard has been reported; drop it so it is not re-registered forever."""
        key = (shard.spec.replica_id, shard.spec.rank)
        if self.shards.get(key) is shard:
            del self.shards[key]


def engine_command(config: AgentConfig, spec: LaunchSpec) -> Command:
    """How this node launches `spec`: listening on `bind_host` (by default the address it
    advertises to routers, not every interface)."""
    engine = config.engines[spec.engine]
    return build_command(
        engine.command,
        EngineLaunch(
            engine=spec.engine,
            model=spec.hf_model,
            served_name=spec.model_name,
            host=config.bind_host,
            port=spec.port,
            gpu_indices=spec.gpu_indices,
            tensor_parallel=spec.tensor_parallel,
            pipeline_parallel=spec.pipeline_parallel,
            args=spec.args,
            env=tuple(sorted({**engine.env, **spec.env}.items())),
            nnodes=spec.nnodes,
            node_rank=spec.rank,
            master_addr=spec.head_address,
            master_port=spec.dist_port,
            api_key=spec.api_key,
            key_file=str(records.key_path(config.state_dir, spec)),
            max_model_len=spec.max_model_len,
            lora=spec.lora,
            max_lora_rank=spec.max_lora_rank,
            kv_events_port=spec.ports[2] if spec.kv_events else 0,
            kv_replay_port=spec.ports[3] if spec.kv_events else 0,
        ),
    )


def _shm_before(record: records.ShardRecord) -> frozenset[str] | None:
    return None if record.shm_before is None else frozenset(record.shm_before)


async def _clean_shm(record: records.ShardRecord) -> None:
    """What an engine that ended while the agent was away left in /dev/shm (its group is
    gone by now)."""
    before = _shm_before(record)
    if before is not None:
        await trio.to_thread.run_sync(clean_after, record.pid, before)
