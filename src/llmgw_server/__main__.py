"""`python -m llmgw_server`: run the server, or one of its small commands."""

from __future__ import annotations

import argparse
import getpass
import hashlib
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

import attrs

from llmgw_core.config import Config, ListenAddress, load_config, parse_listen
from llmgw_core.tomlshape import ConfigError

LOG_LEVELS = ("debug", "info", "warning", "error")
ADMIN_COMMANDS = ("status", "explain", "drain", "undrain", "cordon", "uncordon")


def cli(argv: Sequence[str] | None = None) -> None:
    sys.exit(run_cli(sys.argv[1:] if argv is None else list(argv)))


def add_global_options(
    parser: argparse.ArgumentParser, *, after_command: bool, admin: bool = True
) -> None:
    """The options every command takes, before or after its name (`admin`: with those
    that reach a control plane, which `hash-key` has no use for).

    After the name their default is SUPPRESS, so that one given before the name is not
    overwritten by the subcommand's default.
    """

    def default(value: str | None) -> str | None:
        return argparse.SUPPRESS if after_command else value

    parser.add_argument(
        "--config", metavar="FILE", default=default(None), help="the server's TOML config file"
    )
    parser.add_argument(
        "--log-level",
        type=str.lower,
        choices=LOG_LEVELS,
        default=default("info"),
        help="how much the server logs (default: info)",
    )
    if not admin:
        return
    parser.add_argument(
        "--control",
        metavar="URL",
        action="append",
        default=default(None),
        help="the control plane's admin URL (default: control_listen of --config, "
        "else http://127.0.0.1:8081); for router, each control plane's (repeated, or "
        "comma-separated): the router follows the one that leads",
    )
    parser.add_argument(
        "--ca",
        metavar="FILE",
        default=default(None),
        help="the fleet CA to trust for an https control URL (default: [agents] ca of "
        "--config, else the system's trust store or SSL_CERT_FILE)",
    )
    parser.add_argument(
        "--token-file",
        metavar="PATH",
        default=default(None),
        help="a file holding the admin token for status, explain, drain, cordon... "
        "(default: the environment variable LLMGW_ADMIN_TOKEN), or the router token for "
        "router (default: LLMGW_ROUTER_TOKEN)",
    )


def add_serve_options(parser: argparse.ArgumentParser, *, after_command: bool) -> None:
    """What one process of several running the same config sets for itself (control
    planes that share a store: a port each, and the URL its peers reach it at)."""
    default = argparse.SUPPRESS if after_command else None
    parser.add_argument(
        "--listen", metavar="HOST:PORT", default=default, help="[server] listen, for this process"
    )
    parser.add_argument(
        "--control-listen",
        metavar="HOST:PORT",
        default=default,
        help="[server] control_listen, for this process",
    )
    parser.add_argument(
        "--advertise",
        metavar="URL",
        default=default,
        help="[control.store] advertise: this control plane's wss:// (or ws://) URL as "
        "agents, routers and operators reach it",
    )


def with_process_options(config: Config, args: argparse.Namespace) -> Config:
    """The config with this process's own --listen, --control-listen and --advertise.
    Raises ValueError."""
    server = config.server
    if getattr(args, "listen", None):
        server = attrs.evolve(server, listen=parse_listen(args.listen))
    if getattr(args, "control_listen", None):
        server = attrs.evolve(server, control_listen=parse_listen(args.control_listen))
    control = config.control
    if getattr(args, "advertise", None):
        if control.store is None:
            raise ValueError("--advertise is for control planes that share a [control.store]")
        url = args.advertise.rstrip("/")
        if not url.startswith(("ws://", "wss://")) or url.count("/") != 2:
            raise ValueError(f"--advertise must be ws://HOST:PORT or wss://HOST:PORT, not {url!r}")
        control = attrs.evolve(control, store=attrs.evolve(control.store, advertise=url))
    return attrs.evolve(config, server=server, control=control)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmgw-server",
        description="One OpenAI-compatible endpoint in front of your inference engines.",
    )
    add_global_options(parser, after_command=False)
    common = argparse.ArgumentParser(add_help=False)
    add_global_options(common, after_command=True)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    local = argparse.ArgumentParser(add_help=False)
    add_global_options(local, after_command=True, admin=False)

    def command(name: str, help: str, *, admin: bool = True) -> argparse.ArgumentParser:
        parents = [common if admin else local]
        return sub.add_parser(name, help=help, description=help, parents=parents)

    add_serve_options(parser, after_command=False)
    add_serve_options(command("serve", "run the server (the default)"), after_command=True)
    command(
        "router",
        "run a router apart that follows the control plane at --control (its https:// URL), "
        "with the router token from --token-file or LLMGW_ROUTER_TOKEN, trusting --ca",
    )
    check = command("check-config", "validate a config file and exit")
    check.add_argument("file")
    status = command("status", "nodes, replicas and what cannot run, as tables")
    status.add_argument(
        "--json", action="store_true", help="print the control plane's status as JSON, for scripts"
    )
    explain = command("explain", "why a model cannot be placed")
    explain.add_argument("target", metavar="MODEL")
    for action, what in (
        ("drain", "move every replica off a node"),
        ("undrain", "let a drained node take replicas again"),
        ("cordon", "place nothing new on a node"),
        ("uncordon", "let a cordoned node take new replicas"),
    ):
        node_action = command(action, what)
        node_action.add_argument("target", metavar="NODE")
        if action == "drain":
            node_action.add_argument(
                "--force",
                action="store_true",
                help="drain even when a replica fits nowhere else (it stops; its model may "
                "go offline)",
            )
            node_action.add_argument(
                "--no-wait",
                action="store_true",
                help="return at once instead of following the replicas until the node is empty",
            )
    hash_key = command(
        "hash-key",
        "print the digest of a key or token ([auth] api_keys, [[auth.keys]] digest, "
        "[admin] token_digest)",
        admin=False,
    )
    hash_key.add_argument(
        "key", nargs="?", help="the key (default: read from stdin, or asked at the terminal)"
    )
    # Listed for --help only: `certs` has its own parser (certs_cli), reached before this one.
    sub.add_parser(
        "certs",
        help="make the fleet's CA and certificates (certs init DIR, certs issue NODE DIR; "
        "certs --help)",
    )
    return parser


def _split_certs(argv: list[str]) -> tuple[list[str], list[str]] | None:
    """(global options, certs arguments) when the command is `certs`, else None."""
    takes_value = {"--config", "--log-level", "--control", "--ca", "--token-file"}
    i = 0
    while i < len(argv):
        if argv[i] == "certs":
            return argv[:i], argv[i + 1 :]
        if argv[i] in takes_value:
            i += 2
        elif argv[i].split("=", 1)[0] in takes_value:
            i += 1
        else:
            return None
    return None


def run_cli(argv: list[str]) -> int:
    parser = build_parser()
    certs = _split_certs(argv)
    if certs is not None:
        parser.parse_args(certs[0])  # the options before `certs` must still make sense
        from llmgw_server.certs_cli import run as run_certs

        return run_certs(certs[1])
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.command == "hash-key":
        return _hash_key(args.key)
    if args.command in ADMIN_COMMANDS:
        return _admin(args)
    file = args.file if args.command == "check-config" else args.config
    if not file:
        parser.error("--config FILE is required")
    from llmgw_server.router.policies import PolicyBook  # the balancing policies

    try:
        # A router apart may declare no model: the control plane it follows places them.
        config = load_config(file, models_required=args.command != "router", policies=PolicyBook())
    except ConfigError as exc:
        print(f"llmgw-server: config error: {exc}", file=sys.stderr)
        return 2
    if args.command == "check-config":
        count = len(config.catalog.models)
        print(f"{file}: ok, {count} model{'' if count == 1 else 's'}")
        return 0
    if args.command == "router":
        return _router(args, config)
    try:
        config = with_process_options(config, args)
    except ValueError as exc:
        print(f"llmgw-server: {exc}", file=sys.stderr)
        return 2
    from llmgw_server.wiring import run

    return run(config)


def _router(args: argparse.Namespace, config: Config) -> int:
    from llmgw_server.route_feed.remote import feed_targets, read_router_token
    from llmgw_server.wiring import run_router_apart

    if not args.control:
        print("llmgw-server router: --control URL is required", file=sys.stderr)
        return 2
    try:
        feed_targets(args.control)
        token = read_router_token(args.token_file)
    except ValueError as exc:
        print(f"llmgw-server router: {exc}", file=sys.stderr)
        return 2
    ca = Path(args.ca) if args.ca else config.agents.ca
    return run_router_apart(config, args.control, token, ca)


def _hash_key(given: str | None) -> int:
    try:
        key = _read_key(given).strip()  # as a header's value is: no surrounding whitespace
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    if not key:
        print(
            "llmgw-server: hash-key: no key given (pass it as an argument, on stdin, "
            "or type it at the prompt)",
            file=sys.stderr,
        )
        return 2
    print("sha256:" + hashlib.sha256(key.encode()).hexdigest())
    return 0


def _read_key(given: str | None) -> str:
    if given is not None:
        return given
    if sys.stdin is None:
        return ""
    if not sys.stdin.isatty():  # piped in: the first line, no prompt
        return sys.stdin.readline()
    try:
        return getpass.getpass("API key or admin token: ")
    except EOFError:  # Ctrl-D at the prompt
        return ""


def _admin(args: argparse.Namespace) -> int:
    from llmgw_server.admin_cli import read_token
    from llmgw_server.admin_cli import run as run_admin

    try:
        token = read_token(args.token_file)
    except ValueError as exc:
        print(f"llmgw-server: {exc}", file=sys.stderr)
        return 2
    control, ca = args.control[-1] if args.control else None, args.ca  # the last one given
    if args.config and (control is None or ca is None):
        from llmgw_server.router.policies import PolicyBook

        try:
            config = load_config(args.config, policies=PolicyBook())
        except ConfigError as exc:
            print(f"llmgw-server: config error: {exc}", file=sys.stderr)
            return 2
        scheme = "http" if config.agents.insecure else "https"
        control = control or f"{scheme}://{_reachable(config.server.control_listen)}"
        ca = ca or (str(config.agents.ca) if config.agents.ca else None)
    return run_admin(
        args.command,
        getattr(args, "target", None),
        control or "http://127.0.0.1:8081",
        token,
        ca=ca,
        force=getattr(args, "force", False),
        wait=not getattr(args, "no_wait", False),
        as_json=getattr(args, "json", False),
    )


def _reachable(listen: ListenAddress) -> ListenAddress:
    """Where to reach a control plane listening on `listen` from this machine: a wildcard
    address is reached on loopback (and a certificate made by `certs init` names it)."""
    loopback = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}
    return ListenAddress(loopback.get(listen.host, listen.host), listen.port)


if __name__ == "__main__":
    cli()
