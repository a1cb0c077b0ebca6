"""`llmgw-server status | explain MODEL | drain NODE | cordon NODE`: the admin API as tables.

The admin token comes from `--token-file PATH` or, without it, the environment variable
LLMGW_ADMIN_TOKEN; never from the command line, where other users could read it.

`drain NODE` follows the drain until no replica is left on the node, a line for each
replica as it moves (`--no-wait` returns at once); `--force` drains even when a replica
fits nowhere else. A drain not forced never takes a model offline: a replica with no room
for a replacement serves on from the node, and the progress says why (`drain NODE --force`
again makes it stop).
"""

from __future__ import annotations

import json
import os
import socket
import ssl
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import httpx

from llmgw_core.tls_advice import cert_error, name_mismatch
from llmgw_server.admin_reach import LeaderClient, controls
from llmgw_server.control.documents import (
    ControlDoc,
    DocumentError,
    ExplainDoc,
    ModelDoc,
    NodeDoc,
    ReplicaDoc,
    StatusDoc,
    from_json,
)
from llmgw_server.control.explanation import natural
from llmgw_server.control.shards import Phase

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


def render_status(status: StatusDoc) -> str:
    nodes = table(
        ["NODE", "STATUS", "FLAGS", "GPUS USED", "GPU", "FABRIC", "SEEN"],
        [
            [
                n.name,
                n.status,
                _flags(n),
                f"{sum(g.used for g in n.gpus)}/{len(n.gpus)}",
                n.gpus[0].name if n.gpus else "-",
                ",".join(f"{k}={v}" for k, v in sorted(n.fabric.items())) or "-",
                f"{n.last_seen_s_ago}s ago",
            ]
            for n in sorted(status.nodes, key=lambda n: natural(n.name))
        ],
    )
    replicas = table(
        ["REPLICA", "MODEL", "PHASE", "SERVING", "SHARDS", "URL", "FAILURES"],
        [
            [
                r.replica_id,
                r.model,
                r.phase
                + (" (crash loop)" if r.crash_loop else "")
                + (" (moving)" if r.moving else ""),
                "yes" if r.serving else "no",
                " ".join(f"{s.node}#{s.rank}:{s.state}" for s in r.shards),
                r.url,
                r.failures,
            ]
            for r in status.replicas
        ],
    )
    models = table(
        ["MODEL", "DESIRED", "PLACED", "SERVING", "AUTOSCALING", "WHY NOT"],
        [
            [
                m.name,
                m.desired,
                m.kept,
                sum(r.serving for r in status.replicas if r.model == m.name),
                _autoscaling(m),
                "; ".join(_why_not(m, status.replicas)) or "-",
            ]
            for m in status.models
        ],
    )
    out = [nodes, "", replicas, "", models]
    if status.tenants:
        per = {"requests": "/min", "tokens": "/min", "in_flight": " at once"}
        out += [
            "",
            table(
                ["TENANT", "LIMIT", "MODEL", "USED", "ROUTERS' SHARES"],
                [
                    [
                        t.tenant,
                        f"{t.limit:g} {t.kind}{per.get(t.kind, '')}",
                        t.model or "-",
                        f"{t.used:g} ({t.used / t.limit:.0%})" if t.limit else f"{t.used:g}",
                        " ".join(f"{name}={share:g}" for name, share in t.shares.items()) or "-",
                    ]
                    for t in status.tenants
                ],
            ),
        ]
    if status.guard:
        out += ["", f"mass-loss guard: {status.guard}"]
    if status.control is not None:
        out += ["", *_control_lines(status.control)]
    return "\n".join(out)


def _control_lines(control: ControlDoc) -> list[str]:
    """Who leads the control planes that share a store, and the store's health."""
    leader = control.leader
    since = (
        ""
        if control.since is None
        else " since " + time.strftime("%Y-%m-%d %H:%M:%S %z", time.localtime(control.since))
    )
    lines = [
        f"leader: {leader.id} at {leader.url} (epoch {control.epoch}{since})"
        if leader is not None
        else f"leader: none ({control.why})"
    ]
    if control.control_planes is not None:
        planes = ", ".join(
            p.url + (" (leads)" if leader is not None and p.id == leader.id else "")
            for p in control.control_planes
        )
        lines.append(f"control planes: {len(control.control_planes)}: {planes}")
    latency = "" if control.store_latency_ms is None else f", {control.store_latency_ms:g} ms"
    lines.append(f"store: {'ok' if control.store_ok else 'unreachable'}{latency}")
    return lines


def _autoscaling(model: ModelDoc) -> str:
    """`1-4, target 8 in flight a replica; last: 1 -> 3 (...)`; `-` for a fixed count."""
    a = model.autoscale
    if a is None:
        return "-"
    said = f"{a.min}-{a.max}, target {a.target}"
    if a.held:  # requests the routers hold for it now, waiting for a replica
        said += f"; {a.held} request{'s' if a.held != 1 else ''} held"
    return f"{said}; last: {a.last_change}" if a.last_change else said


def _why_not(model: ModelDoc, replicas: Sequence[ReplicaDoc]) -> list[str]:
    """Why a model has fewer replicas serving than it wants: what cannot be placed, and
    each placed replica that failed (a crash loop most of all) with its reason."""
    reasons = []
    if model.unplaced:
        reasons.append(model.unplaced.waiting or model.unplaced.explanation)
    for r in replicas:
        failed = r.phase in (Phase.FAILED, Phase.BROKEN)
        if r.model != model.name or r.serving or not (r.crash_loop or failed):
            continue
        what = "crash loop" if r.crash_loop else str(r.phase)
        why = r.reason or ("restarting" if r.phase is Phase.LIVE else "no reason given")
        failures = r.failures
        counted = f"{failures} failure{'s' if failures != 1 else ''}" if failures else ""
        restart = "" if r.restart_in_s is None else f"restart in {r.restart_in_s:g} s"
        detail = ", ".join(x for x in (counted, restart) if x)
        reasons.append(f"{r.replica_id} {what}: {why}" + (f" ({detail})" if detail else ""))
    return reasons


def _flags(node: NodeDoc) -> str:
    flags = [f for f, on in (("cordoned", node.cordoned), ("draining", node.draining)) if on]
    if node.drain_forced:
        flags.append("forced")
    return ",".join(flags) or "-"


class DrainProgress:
    """A drain as successive status snapshots show it: a line for each change a user
    cares about, and whether the node is empty.

    `before` is the status read before the drain began: a replica of an affected model
    that is not in it is a replacement.
    """

    def __init__(self, node: str, before: StatusDoc) -> None:
        self.node = node
        self.existing = {r.replica_id for r in before.replicas}
        self.models: set[str] = set()  # models with a replica on the node
        self.leaving: dict[str, str] = {}  # replicas seen on the node -> model
        self.said: dict[str, str] = {}  # replica id or model -> the last line about it

    def update(self, status: StatusDoc) -> tuple[list[str], bool]:
        here = {r.replica_id: r for r in status.replicas if self._on_node(r)}
        self.models |= {r.model for r in here.values()}
        self.leaving |= {rid: r.model for rid, r in here.items()}
        current = {
            rid: f"{rid} ({r.model}): {leaving}"
            for rid, r in here.items()
            if (leaving := self._leaving(r)) is not None
        }
        for r in status.replicas:
            rid = r.replica_id
            if rid not in here and rid not in self.existing and r.model in self.models:
                where = ",".join(dict.fromkeys(s.node for s in r.shards))
                state = "serves" if r.serving else r.phase + _shard_states(r)
                current[rid] = f"{rid} ({r.model}): replacement on {where}: {state}"
        node = next((n for n in status.nodes if n.name == self.node), None)
        forced = node is not None and node.drain_forced
        for m in status.models:
            if m.name in self.models and m.unplaced:
                why = m.unplaced.waiting or m.unplaced.explanation
                line = f"{m.name}: no room for a replacement yet: {why}"
                held = any(r.model == m.name and r.moving for r in here.values())
                if held and not m.unplaced.waiting and not forced:
                    # A drain not forced waits for room, however long: say how to end it.
                    line += (
                        f"; it serves on from {self.node} meanwhile "
                        "(`drain --force` stops it without one)"
                    )
                current[m.name] = line
        lines = [text for key, text in current.items() if self.said.get(key) != text]
        for rid in [rid for rid in self.leaving if rid not in here]:
            lines.append(f"{rid} ({self.leaving.pop(rid)}): stopped, off {self.node}")
        self.said = current
        return lines, not here

    def _on_node(self, replica: ReplicaDoc) -> bool:
        return any(s.node == self.node for s in replica.shards)

    def _leaving(self, r: ReplicaDoc) -> str | None:
        """How a replica on the node is leaving it; None before the control plane decided."""
        if r.moving and r.serving:
            return f"serves on {self.node} until its replacement serves"
        if any(s.retiring for s in r.shards):
            return f"leaving {self.node}: no new requests, stopping once those in flight end"
        return None


def _shard_states(replica: ReplicaDoc) -> str:
    states: list[str] = sorted({str(s.state) for s in replica.shards})
    return f" ({', '.join(states)})" if states != [str(replica.phase)] else ""


def follow_drain(
    node: str,
    before: StatusDoc,
    read_status: Callable[[], StatusDoc],
    *,
    poll_s: float = 0.5,
    out: Callable[[str], None] = print,
) -> int:
    """Print the drain's progress until the node holds no replica; 1 if it is undrained."""
    progress = DrainProgress(node, before)
    while True:
        status = read_status()
        lines, done = progress.update(status)
        for line in lines:
            out(line)
        if done:
            out(f"{node}: drained, no replica left on it")
            return 0
        node_doc = next((n for n in status.nodes if n.name == node), None)
        if node_doc is None or not node_doc.draining:
            out(f"{node}: no longer draining; stopped following")
            return 1
        time.sleep(poll_s)


def run(
    command: str,
    target: str | None,
    control: str,
    token: str | None = None,
    *,
    ca: str | None = None,
    force: bool = False,
    wait: bool = True,
    poll_s: float = 0.5,
    as_json: bool = False,
) -> int:
    urls = controls(control)
    base = urls[0] + "/v1/admin"
    headers = {"authorization": f"Bearer {token}"} if token else {}
    verify: ssl.SSLContext | bool = True
    if ca:
        try:
            verify = ssl.create_default_context(cafile=ca)
        except (OSError, ssl.SSLError) as exc:
            print(f"llmgw-server: cannot use the CA file {ca}: {exc}", file=sys.stderr)
            return 2
    try:
        with httpx.Client(timeout=10, headers=headers, verify=verify) as http:
            client = LeaderClient(urls, http)
            if command == "status":
                response = client.get(f"{base}/status")
                if response.status_code == 200:
                    data = response.json()
                    if as_json:  # as the control plane sent it, fields this CLI lacks too
                        print(json.dumps(data, indent=2))
                    else:
                        print(render_status(from_json(data, StatusDoc)))
            elif command == "explain":
                response = client.get(f"{base}/explain/{target}")
                if response.status_code == 200:
                    print(from_json(response.json(), ExplainDoc).text)
            elif command == "drain":
                assert target is not None
                return _drain(client, base, target, token, force=force, wait=wait, poll_s=poll_s)
            else:
                response = client.post(f"{base}/nodes/{target}/{command}", json={})
                if response.status_code == 200:
                    print(f"{target}: {command} done")
    except httpx.HTTPError as exc:
        print(
            f"llmgw-server: cannot reach the control plane at {control}: {exc}"
            + tls_hint(control, exc, ca),
            file=sys.stderr,
        )
        return 1
    except (DocumentError, ValueError) as exc:  # ValueError: not JSON at all
        print(
            f"llmgw-server: the control plane at {control} answered what this CLI cannot "
            f"read ({exc}): is --control its control port?",
            file=sys.stderr,
        )
        return 1
    except BrokenPipeError:
        # The reader left (`status --json | head`): nothing more to say. Python would
        # fail again flushing stdout at exit, so it goes to /dev/null.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return _failed(response, token)


def tls_hint(control: str, exc: httpx.HTTPError, ca: str | None) -> str:
    """What to do when the error is the wrong scheme or an untrusted certificate ("" when
    it is neither). A plain-HTTP request to the TLS control port is only seen as a
    dropped connection, so the port is asked directly whether it speaks TLS."""
    url = httpx.URL(control)
    port = url.port or (443 if url.scheme == "https" else 80)
    text = str(exc)
    if url.scheme == "http" and isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError)):
        if speaks_tls(url.host, port):
            where = f"https://{url.netloc.decode()}"
            return (
                f" (the control port speaks https: use --control {where} with --ca FILE, "
                "the fleet's CA, or --config with the server's config)"
            )
    elif url.scheme == "https" and "CERTIFICATE_VERIFY_FAILED" in text:
        verify_error = cert_error(exc)
        mismatch = name_mismatch(verify_error) if verify_error is not None else None
        if mismatch is not None:
            return f" ({mismatch})"
        if ca is None:
            return (
                " (the control plane's certificate is not trusted: give --ca FILE, the "
                "fleet's CA (ca.crt from `certs init`), or --config with the server's config)"
            )
        return f" (the control plane's certificate is not trusted by {ca}: is it the fleet's CA?)"
    elif url.scheme == "https" and ("WRONG_VERSION_NUMBER" in text or "record layer" in text):
        return (
            " (that port does not speak https: a control plane with [agents] insecure = true "
            "takes http://)"
        )
    return ""


def speaks_tls(host: str, port: int, timeout_s: float = 3.0) -> bool:
    """Whether host:port completes a TLS handshake (the certificate is not checked)."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with (
            socket.create_connection((host, port), timeout=timeout_s) as raw,
            context.wrap_socket(raw, server_hostname=host),
        ):
            return True
    except (OSError, ssl.SSLError):
        return False


class _Failed(Exception):
    def __init__(self, response: httpx.Response) -> None:
        self.response = response


# The router's own 404 for an admin path, and an older router's (a CLI may be upgraded first).
_ROUTERS_404 = ("llmgw: no such route /v1/admin/", "no route /v1/admin/")


def _failed(response: httpx.Response, token: str | None) -> int:
    """0 for a 200; else say what went wrong and return 1."""
    if response.status_code == 200:
        return 0
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
    elif response.status_code == 307:
        message += (
            " (the CLI goes to the leader only when --control lists it: give every control "
            "plane, comma-separated)"
        )
    elif response.status_code == 409:
        message += " (--force drains anyway: those replicas are stopped without a replacement)"
    elif response.status_code == 404 and message.startswith(_ROUTERS_404):
        # The control port knows every /v1/admin/ path; the router's port knows none.
        message += (
            " (this looks like the router's port: --control takes the control plane's, "
            "[server] control_listen, 8081 by default)"
        )
    print(f"llmgw-server: {message}", file=sys.stderr)
    return 1


def _drain(
    client: LeaderClient,
    base: str,
    node: str,
    token: str | None,
    *,
    force: bool,
    wait: bool,
    poll_s: float,
) -> int:
    def read_status() -> StatusDoc:
        response = client.get(f"{base}/status")
        if response.status_code != 200:
            raise _Failed(response)
        return from_json(response.json(), StatusDoc)

    try:
        before = read_status() if wait else None
        response = client.post(f"{base}/nodes/{node}/drain", json={"force": True} if force else {})
        if response.status_code != 200:
            raise _Failed(response)
        if before is None:
            print(f"{node}: draining (`llmgw-server status` shows the replicas as they move)")
            return 0
        return follow_drain(node, before, read_status, poll_s=poll_s)
    except _Failed as failed:
        return _failed(failed.response, token)
    except KeyboardInterrupt:
        print(f"{node}: stopped following; the drain goes on", file=sys.stderr)
        return 130
