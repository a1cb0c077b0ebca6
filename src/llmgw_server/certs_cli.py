"""`llmgw-server certs init DIR` and `llmgw-server certs issue NODE DIR`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from llmgw_core.certs import init_ca, issue_node


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="llmgw-server certs", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    init = sub.add_parser("init", help="make the fleet's CA and the control plane's certificate")
    init.add_argument(
        "dir",
        type=Path,
        help="where to write ca.crt, ca.key, server.crt and server.key (made if missing; "
        "an existing CA is never replaced)",
    )
    init.add_argument(
        "--host",
        action="append",
        help="a name or address agents use to reach the control plane (repeatable; "
        "default: localhost and 127.0.0.1)",
    )
    issue = sub.add_parser("issue", help="make a node's certificate and key")
    issue.add_argument(
        "node", help="the node's name, as its agent config's `name` (the certificate's name)"
    )
    issue.add_argument(
        "dir",
        type=Path,
        help="the CA's directory, from certs init: writes nodes/NODE.crt and nodes/NODE.key there",
    )
    args = parser.parse_args(argv)
    # Absolute in the printed config lines: a config takes relative paths from its own
    # directory, which need not be where this command ran.
    args.dir = args.dir.absolute()
    try:
        if args.command == "init":
            hosts = args.host or ["localhost", "127.0.0.1"]
            init_ca(args.dir, hosts)
            print(
                f"{args.dir}/ca.crt, ca.key (keep it offline), server.crt and server.key "
                f"for {', '.join(hosts)}.\nServer config:\n  [agents]\n"
                f"  ca = \"{args.dir}/ca.crt\"\n"
                f"  cert = \"{args.dir}/server.crt\"\n  key = \"{args.dir}/server.key\""
            )
        else:
            crt, key, serial = issue_node(args.dir, args.node)
            print(
                f"{crt} and {key} (serial {serial:x}).\nAgent config:\n  [tls]\n"
                f"  ca = \"{args.dir}/ca.crt\"\n  cert = \"{crt}\"\n  key = \"{key}\""
            )
    except (OSError, ValueError) as exc:
        print(f"llmgw-server certs: {exc}", file=sys.stderr)
        return 1
    return 0
