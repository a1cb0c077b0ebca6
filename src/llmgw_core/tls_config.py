"""TLS for the agent stream: the server's `[agents]` section, the agent's `[tls]`, and
the SSL contexts made from them.

The control port asks every client for a certificate signed by the fleet's CA
but does not require one at the TLS layer (CERT_OPTIONAL): the agent stream
refuses a connection without one, while the admin API authenticates with its
token, so operators need no certificate of their own.
"""

from __future__ import annotations

import ssl
from pathlib import Path

import attrs

from llmgw_core.config_schema import Problem, read_table, read_texts, rule_after, rules
from llmgw_core.tomlshape import Table


def _readable_file(path: Path) -> Path:
    """Relative paths are taken from the config file's directory (see `config_schema.read_path`)."""
    try:
        if not path.exists():
            raise Problem(
                f"{path} does not exist (`llmgw-server certs init DIR` makes the CA and the "
                "control plane's certificate, `llmgw-server certs issue NODE DIR` a node's)"
            )
        if not path.is_file():
            raise Problem(f"{path} is not a file")
        # Read now, as the daemon's user: a key left owned by whoever made it is
        # one clear line (exit 2) here, not a traceback when TLS starts.
        with path.open("rb"):
            pass
    except OSError as exc:
        raise Problem(f"{path} cannot be read: {exc.strerror}") from None
    return path


def _serials(value: object) -> frozenset[int]:
    serials: set[int] = set()
    for i, text in enumerate(read_texts(value)):
        try:
            serials.add(int(text.removeprefix("0x").replace(":", ""), 16))
        except ValueError:
            raise Problem(f"{text!r} is not a hex certificate serial", f"[{i}]") from None
    return frozenset(serials)


_FILE = rules(check=_readable_file)


@attrs.frozen
class AgentsTLS:
    """The server side: `[agents]`."""

    ca: Path | None = attrs.field(default=None, metadata=_FILE)
    cert: Path | None = attrs.field(default=None, metadata=_FILE)
    key: Path | None = attrs.field(default=None, metadata=_FILE)
    deny_serials: frozenset[int] = attrs.field(default=frozenset(), metadata=rules(parse=_serials))
    insecure: bool = False


@rule_after(AgentsTLS)
def _mutual_tls_or_insecure(tls: AgentsTLS) -> None:
    files = {"ca": tls.ca, "cert": tls.cert, "key": tls.key}
    given = [k for k, v in files.items() if v is not None]
    if tls.insecure and given:
        raise Problem("cannot be true beside ca, cert and key: choose one", "insecure")
    if not tls.insecure and len(given) != 3:
        missing = sorted(set(files) - set(given))
        raise Problem(
            "is required: the agent stream runs over mutual TLS (make the files with "
            "`python -m llmgw_server certs init DIR`), or set insecure = true for plaintext",
            missing[0],
        )


@attrs.frozen
class AgentTLS:
    """The agent side: `[tls]`."""

    ca: Path | None = attrs.field(default=None, metadata=_FILE)
    cert: Path | None = attrs.field(default=None, metadata=_FILE)
    key: Path | None = attrs.field(default=None, metadata=_FILE)


def read_agents_tls(t: Table) -> AgentsTLS:
    return read_table(t, AgentsTLS)


def require_agent_tls(tls: AgentTLS) -> None:
    """A wss:// server needs all three files; raises Problem naming the first missing."""
    for key in ("ca", "cert", "key"):
        if getattr(tls, key) is None:
            raise Problem("is required for a wss:// server (from `llmgw_server certs issue`)", key)


def server_context(tls: AgentsTLS) -> ssl.SSLContext:
    assert tls.ca and tls.cert and tls.key
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(tls.ca))
    context.load_cert_chain(str(tls.cert), str(tls.key))
    context.verify_mode = ssl.CERT_OPTIONAL
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    # Agents cannot resume a session (trio's SSLStream takes no session), so a
    # ticket is pure cost: two of them were a third of the server's handshake CPU.
    context.num_tickets = 0
    context.options |= ssl.OP_NO_TICKET
    return context


def client_context(tls: AgentTLS) -> ssl.SSLContext:
    assert tls.ca and tls.cert and tls.key
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(tls.ca))
    context.load_cert_chain(str(tls.cert), str(tls.key))
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


def peer_identity(certificate: dict[str, object] | None) -> str | None:
    """The common name of a verified peer certificate (what `getpeercert()` returns)."""
    if not certificate:
        return None
    for rdn in certificate.get("subject", ()):  # type: ignore[attr-defined]
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return None
