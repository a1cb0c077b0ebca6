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

from llmgw_core.tomlshape import Table


@attrs.frozen
class AgentsTLS:
    """The server side: `[agents]`."""

    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    deny_serials: frozenset[int] = frozenset()
    insecure: bool = False


@attrs.frozen
class AgentTLS:
    """The agent side: `[tls]`."""

    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None


def _files(t: Table, keys: tuple[str, ...]) -> dict[str, Path | None]:
    """Relative paths are taken from the config file's directory (see `Table.file_path`)."""
    found: dict[str, Path | None] = {}
    for key in keys:
        path: Path | None = t.file_path(key, None)
        if path is not None:
            try:
                if not path.is_file():
                    t.fail(key, f"{path} is not a file")
                # Read now, as the daemon's user: a key left owned by whoever made it is
                # one clear line (exit 2) here, not a traceback when TLS starts.
                with path.open("rb"):
                    pass
            except OSError as exc:
                t.fail(key, f"{path} cannot be read: {exc.strerror}")
        found[key] = path
    return found


def read_agents_tls(t: Table) -> AgentsTLS:
    files = _files(t, ("ca", "cert", "key"))
    insecure = t.boolean("insecure", False)
    serials: set[int] = set()
    for i, text in enumerate(t.texts("deny_serials", ())):
        try:
            serials.add(int(text.removeprefix("0x").replace(":", ""), 16))
        except ValueError:
            t.fail(f"deny_serials[{i}]", f"{text!r} is not a hex certificate serial")
    t.finish()
    given = [k for k, v in files.items() if v is not None]
    if insecure and given:
        t.fail("insecure", "cannot be true beside ca, cert and key: choose one")
    if not insecure and len(given) != 3:
        missing = sorted({"ca", "cert", "key"} - set(given))
        t.fail(
            missing[0],
            "is required: the agent stream runs over mutual TLS (make the files with "
            "`python -m llmgw_server certs init DIR`), or set insecure = true for plaintext",
        )
    return AgentsTLS(
        ca=files["ca"], cert=files["cert"], key=files["key"],
        deny_serials=frozenset(serials), insecure=insecure,
    )


def read_agent_tls(t: Table, *, secure: bool) -> AgentTLS:
    files = _files(t, ("ca", "cert", "key"))
    t.finish()
    if secure:
        for key in ("ca", "cert", "key"):
            if files[key] is None:
                t.fail(key, "is required for a wss:// server (from `llmgw_server certs issue`)")
    return AgentTLS(ca=files["ca"], cert=files["cert"], key=files["key"])


def server_context(tls: AgentsTLS) -> ssl.SSLContext:
    assert tls.ca and tls.cert and tls.key
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(tls.ca))
    context.load_cert_chain(str(tls.cert), str(tls.key))
    context.verify_mode = ssl.CERT_OPTIONAL
    context.minimum_version = ssl.TLSVersion.TLSv1_2
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
