"""`llmgw-server status | explain MODEL | drain NODE | cordon NODE`: the admin API as tables.

The admin token comes from `--token-file PATH` or, without it, the environment variable
LLMGW_ADMIN_TOKEN; never from the command line, where other users could read it.
"""

from __future__ import annotations

import os
import ssl
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

TOKEN_ENV = "LLMGW_ADMIN_TOKEN"


def read_token(token_file: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    """The admin token: the first line of `token_file`, else $LLMGW_ADMIN_TOKEN, else None.

    Raises ValueError (the whole message for the user) for a file that cannot be read or is
    empty.
    """
    if token_file is not None:
        try:
            text = Path(token_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot read the token file {token_file}: {exc}") from None
        token = text.strip()
        if not token:
            raise ValueError(f"the token file {token_file} is empty")
        return token
    value = (os.environ if environ is None else environ).get(TOKEN_ENV, "").strip()
    return value or None


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(c) for c in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def render_status(data: dict[str, Any]) -> str:
    nodes = table(
        ["NODE", "STATUS", "FLAGS", "GPUS USED", "GPU", "FABRIC", "SEEN"],
        [
            [
                n["name"],
                n["status"],
                ",".join(f for f in ("cordoned", "draining") if n[f]) or "-",
                f"{sum(g['used'] for g in n['gpus'])}/{len(n['gpus'])}",
                n["gpus"][0]["name"] if n["gpus"] else "-",
                ",".join(f"{k}={v}" for k, v in sorted(n["fabric"].items())) or "-",
                f"{n['last_seen_s_ago']}s ago",
            ]
            for n in data["nodes"]
        ],
    )
    replicas = table(
        ["REPLICA", "MODEL", "PHASE", "SERVING", "SHARDS", "URL", "FAILURES"],
        [
            [
                r["replica_id"],
                r["model"],
                r["phase"] + (" (crash loop)" if r["crash_loop"] else ""),
                "yes" if r["serving"] else "no",
                " ".join(f"{s['node']}#{s['rank']}:{s['state']}" for s in r["shards"]),
                r["url"],
                r["failures"],
            ]
            for r in data["replicas"]
        ],
    )
    models = table(
        ["MODEL", "DESIRED", "RUNNING", "WHY NOT"],
        [
            [
                m["name"],
                m["desired"],
                m["kept"],
                "-"
                if not m["unplaced"]
                else m["unplaced"]["waiting"] or m["unplaced"]["explanation"],
            ]
            for m in data["models"]
        ],
    )
    out = [nodes, "", replicas, "", models]
    if data.get("guard"):
        out += ["", f"mass-loss guard: {data['guard']}"]
    return "\n".join(out)


def run(
    command: str,
    target: str | None,
    control: str,
    token: str | None = None,
    *,
    ca: str | None = None,
) -> int:
    base = control.rstrip("/") + "/v1/admin"
    headers = {"authorization": f"Bearer {token}"} if token else {}
    verify: ssl.SSLContext | bool = True
    if ca:
        try:
            verify = ssl.create_default_context(cafile=ca)
        except (OSError, ssl.SSLError) as exc:
            print(f"llmgw-server: cannot use the CA file {ca}: {exc}", file=sys.stderr)
            return 2
    try:
        with httpx.Client(timeout=10, headers=headers, verify=verify) as client:
            if command == "status":
                response = client.get(f"{base}/status")
                if response.status_code == 200:
                    print(render_status(response.json()))
            elif command == "explain":
                response = client.get(f"{base}/explain/{target}")
                if response.status_code == 200:
                    print(response.json()["text"])
            else:
                response = client.post(f"{base}/nodes/{target}/{command}")
                if response.status_code == 200:
                    print(f"{target}: {command} done")
    except httpx.HTTPError as exc:
        print(f"llmgw-server: cannot reach the control plane at {control}: {exc}", file=sys.stderr)
        return 1
    if response.status_code != 200:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text[:200]
        if response.status_code == 401:
            message += (
                f" (the CLI sends the token from {TOKEN_ENV} or --token-file PATH)"
                if token is None
                else " (the token given was refused)"
            )
        print(f"llmgw-server: {message}", file=sys.stderr)
        return 1
    return 0
