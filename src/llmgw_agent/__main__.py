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


LOG_LEVELS = ("debug", "info", "warning", "error")


def add_global_options(parser: argparse.ArgumentParser, *, after_command: bool) -> None:
    """Options taken before or after the command's name (after it, SUPPRESS keeps one given
    before the name from being overwritten by the subcommand's default)."""
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=argparse.SUPPRESS if after_command else None,
        help="the agent's TOML config file",
    )
    parser.add_argument(
        "--log-level",
        type=str.lower,
        choices=LOG_LEVELS,
        default=argparse.SUPPRESS if after_command else "info",
        help="how much the agent logs (default: info)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmgw-agent",
        description="Runs inference engines on this node for the llmgw control plane.",
    )
    add_global_options(parser, after_command=False)
    common = argparse.ArgumentParser(add_help=False)
    add_global_options(common, after_command=True)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("run", help="run the agent (the default)", parents=[common])
    check = sub.add_parser(
        "check-config",
        help="validate an agent config file (and the files it names) and exit",
        parents=[common],
    )
    check.add_argument(
        "file", nargs="?", help="the config to validate (default: the one --config names)"
    )
    probe = sub.add_parser(
        "probe",
        help="print this node's inventory as TOML, the inventory_file format",
        parents=[common],
    )
    probe.add_argument("--from", dest="source", help="read a simulated inventory instead of NVML")
    return parser


def run_cli(argv: list[str]) -> int:
    parser = build_parser()
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

            # --from, else the config's inventory_file, else the hardware (NVML).
            source = Path(args.source) if args.source else None
            if source is None and args.config:
                source = load_agent_config(args.config).inventory_file
            hardware = read_simulated(source) if source else detect_hardware()
            print(hardware_to_toml(hardware), end="")
            return 0
        if args.command == "check-config":
            if not (args.file or args.config):
                parser.error("check-config needs a config file: check-config FILE")
            return check_config(args.file or args.config)
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
        # A missing engine says why (not found, timed out, its exit status).
        ", ".join(
            f"{e.name}=ok" if e.found else f"{e.name}=missing ({e.version})"
            for e in inventory.engines
        ),
    )
    with contextlib.suppress(KeyboardInterrupt):
        trio.run(_run_until_signal, Agent(config, inventory))
    return 0


def check_config(file: str) -> int:
    """Validate an agent config as the agent would read it at start: the file, the
    simulated inventory it names and its [tls] files; the hardware is not probed."""
    import ssl

    from llmgw_agent.inventory_probe import read_simulated
    from llmgw_core.tls_config import client_context

    config = load_agent_config(file)  # ConfigError: the caller says it
    gpus = "probed at start (NVML)"
    if config.inventory_file is not None:
        gpus = f"{len(read_simulated(config.inventory_file).gpus)} simulated"
    if config.tls.cert:
        try:
            client_context(config.tls)
        except (OSError, ssl.SSLError) as exc:
            print(
                f"llmgw-agent: config error: {file}: [tls]: cannot load the CA, certificate or "
                f"key: {exc}",
                file=sys.stderr,
            )
            return 2
    engines = ", ".join(sorted(config.engines)) or "none"
    server = ", ".join(config.servers)
    print(f"{file}: ok, node {config.name}, server {server}, GPUs {gpus}, engines {engines}")
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
                    len(agent.engines.shards),
                )
                nursery.cancel_scope.cancel()
                break


if __name__ == "__main__":
    cli()
