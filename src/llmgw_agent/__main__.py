"""`python -m llmgw_agent`: run the agent on a GPU node, or print what it detects."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import Sequence

import trio

from llmgw_agent.config import load_agent_config
from llmgw_core.tomlshape import ConfigError


def cli(argv: Sequence[str] | None = None) -> None:
    sys.exit(run_cli(sys.argv[1:] if argv is None else list(argv)))


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="llmgw-agent",
        description="Runs inference engines on this node for the llmgw control plane.",
    )
    parser.add_argument("--config", help="the agent's TOML config file")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("run", help="run the agent (the default)")
    probe = sub.add_parser(
        "probe", help="print this node's inventory as TOML, the inventory_file format"
    )
    probe.add_argument("--from", dest="source", help="read a simulated inventory instead of NVML")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    from llmgw_agent.inventory_probe import (
        detect_hardware,
        hardware_to_toml,
        read_simulated,
        take_inventory,
    )

    try:
        if args.command == "probe":
            from pathlib import Path

            hardware = read_simulated(Path(args.source)) if args.source else detect_hardware()
            print(hardware_to_toml(hardware), end="")
            return 0
        if not args.config:
            parser.error("--config FILE is required")
        config = load_agent_config(args.config)
        inventory = take_inventory(config)
    except ConfigError as exc:
        print(f"llmgw-agent: config error: {exc}", file=sys.stderr)
        return 2
    from llmgw_agent.agent import Agent

    logging.getLogger("llmgw.agent").info(
        "node %s: %d GPUs, engines %s",
        inventory.name,
        len(inventory.gpus),
        ", ".join(f"{e.name}={'ok' if e.found else 'missing'}" for e in inventory.engines),
    )
    with contextlib.suppress(KeyboardInterrupt):
        trio.run(_run_until_signal, Agent(config, inventory))
    return 0


async def _run_until_signal(agent: object) -> None:
    import signal

    from llmgw_agent.agent import Agent

    assert isinstance(agent, Agent)
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            await nursery.start(agent.run)
            async for signum in signals:
                logging.getLogger("llmgw.agent").info(
                    "received %s: exiting; %d engines keep serving and the next start adopts them",
                    signal.Signals(signum).name,
                    len(agent.shards),
                )
                nursery.cancel_scope.cancel()
                break


if __name__ == "__main__":
    cli()
