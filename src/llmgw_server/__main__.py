"""`python -m llmgw_server`: run the server, or one of its small commands."""

from __future__ import annotations

import argparse
import getpass
import hashlib
import logging
import sys
from collections.abc import Sequence

from llmgw_core.config import load_config
from llmgw_core.tomlshape import ConfigError


def cli(argv: Sequence[str] | None = None) -> None:
    sys.exit(run_cli(sys.argv[1:] if argv is None else list(argv)))


def run_cli(argv: list[str]) -> int:
    if argv[:1] == ["certs"]:
        from llmgw_server.certs_cli import run as run_certs

        return run_certs(argv[1:])
    parser = argparse.ArgumentParser(
        prog="llmgw-server",
        description="One OpenAI-compatible endpoint in front of your inference engines.",
    )
    parser.add_argument("--config", help="the server's TOML config file")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("serve", help="run the server (the default)")
    check = sub.add_parser("check-config", help="validate a config file and exit")
    check.add_argument("file")
    sub.add_parser("status", help="nodes, replicas and what cannot run, as tables")
    explain = sub.add_parser("explain", help="why a model cannot be placed")
    explain.add_argument("target", metavar="MODEL")
    for action, what in (
        ("drain", "move every replica off a node"),
        ("undrain", "let a drained node take replicas again"),
        ("cordon", "place nothing new on a node"),
        ("uncordon", "let a cordoned node take new replicas"),
    ):
        node_action = sub.add_parser(action, help=what)
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
    parser.add_argument(
        "--control",
        help="the control plane's admin URL (default: control_listen of --config, "
        "else http://127.0.0.1:8081)",
    )
    parser.add_argument(
        "--ca",
        metavar="FILE",
        help="the fleet CA to trust for an https control URL (default: [agents] ca of "
        "--config, else the system's trust store or SSL_CERT_FILE)",
    )
    parser.add_argument(
        "--token-file",
        metavar="PATH",
        help="a file holding the admin token for status, explain, drain, cordon... "
        "(default: the environment variable LLMGW_ADMIN_TOKEN)",
    )
    hash_key = sub.add_parser(
        "hash-key",
        help="print the digest of a key or token ([auth] api_keys, [[auth.keys]] digest, "
        "[admin] token_digest)",
    )
    hash_key.add_argument("key", nargs="?", help="the key (read from the terminal when absent)")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.command == "hash-key":
        key = args.key or getpass.getpass("API key or admin token: ")
        print("sha256:" + hashlib.sha256(key.encode()).hexdigest())
        return 0
    if args.command in ("status", "explain", "drain", "undrain", "cordon", "uncordon"):
        from llmgw_server.admin_cli import read_token
        from llmgw_server.admin_cli import run as run_admin

        try:
            token = read_token(args.token_file)
        except ValueError as exc:
            print(f"llmgw-server: {exc}", file=sys.stderr)
            return 2
        control, ca = args.control, args.ca
        if args.config and (control is None or ca is None):
            try:
                config = load_config(args.config)
            except ConfigError as exc:
                print(f"llmgw-server: config error: {exc}", file=sys.stderr)
                return 2
            scheme = "http" if config.agents.insecure else "https"
            control = control or f"{scheme}://{config.server.control_listen}"
            ca = ca or (str(config.agents.ca) if config.agents.ca else None)
        return run_admin(
            args.command,
            getattr(args, "target", None),
            control or "http://127.0.0.1:8081",
            token,
            ca=ca,
            force=getattr(args, "force", False),
            wait=not getattr(args, "no_wait", False),
        )
    file = args.file if args.command == "check-config" else args.config
    if not file:
        parser.error("--config FILE is required")
    try:
        config = load_config(file)
    except ConfigError as exc:
        print(f"llmgw-server: config error: {exc}", file=sys.stderr)
        return 2
    if args.command == "check-config":
        print(f"{file}: ok, {len(config.catalog.models)} models")
        return 0
    from llmgw_server.app import run

    return run(config)


if __name__ == "__main__":
    cli()
