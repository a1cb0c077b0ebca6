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
    hash_key = sub.add_parser("hash-key", help="print the [auth] api_keys entry for a key")
    hash_key.add_argument("key", nargs="?", help="the key (read from the terminal when absent)")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.command == "hash-key":
        key = args.key or getpass.getpass("API key: ")
        print("sha256:" + hashlib.sha256(key.encode()).hexdigest())
        return 0
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
