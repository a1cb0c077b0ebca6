"""What the control port refuses before anything else, so that no web page can use an
operator's browser against it (issue 17, finding 4).

- **A Host that is not one of the control plane's names: 421**, on every path but the
  agents' and routers' websockets (agents dial an address, maybe through NAT, and
  prove who they are with their certificate; routers with their token). This is what
  stops DNS rebinding: a page whose own name the attacker points at 127.0.0.1 reaches
  the port with its own name in Host. The names: the DNS and IP names of the control
  plane's certificate, `control_listen`'s host, the loopback names (`localhost`,
  `127.0.0.1`, `::1`) when it listens on loopback or on every address, and
  `[server] control_hosts` (a proxy's or an alias's name). The port in Host is not
  checked: only a name can be rebound.
- **A state-changing request (any method but GET and HEAD, on any path: the admin API
  parses paths leniently, and nothing else on the port takes one) from another site: 403**,
  when `Sec-Fetch-Site` is `cross-site` or `same-site` (another port or a sibling name
  is another program: only the port's own page, or a client that is no browser, acts),
  or when `Origin` is present and is not the port's own origin (its scheme and the
  Host the request names; or any origin on a `control_hosts` name, which a proxy
  serves under a scheme and port of its own).
- **A state-changing request without `Content-Type: application/json`: 415.** A page
  can send a cross-site POST without asking the server first (a CORS "simple" request)
  only with a form's or text's content type; JSON needs a preflight, which this port
  never grants. This holds even where a browser sends no Origin.
- **A websocket upgrade with a foreign Origin: 403.** Agents and routers send none; a
  browser always does, and a page must not register as a node on a plaintext port.

`refusal` decides, from the request's method, path and headers and the port's names
alone; `ControlPortGate` applies it in front of everything the port serves.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Sequence

import attrs
import trio
from cryptography import x509

from llmgw_core.config import ServerSection, is_loopback
from llmgw_core.logsafe import escaped
from llmgw_core.openai_errors import error_body
from llmgw_core.tls_config import AgentsTLS
from llmgw_http.server import Handler, Request, Responder, UpgradeHandler
from llmgw_http.ws_server import refusal as upgrade_refusal
from llmgw_server.control_shell.agents import AGENT_PATH
from llmgw_server.route_feed.hub import ROUTES_PATH

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
_WILDCARD_LISTEN = frozenset({"", "0.0.0.0", "::"})
_SAFE_METHODS = frozenset({b"GET", b"HEAD"})
_FOREIGN_SITES = frozenset({b"cross-site", b"same-site"})
_DEFAULT_PORTS = {"http": 80, "https": 443}
_PORT = re.compile(r"[0-9]{1,5}")
# The websockets that need no Host of ours: the agents' and the routers'.
WEBSOCKET_PATHS = frozenset({AGENT_PATH, ROUTES_PATH})


@attrs.frozen
class Refusal:
    status: int
    message: str
    code: str

    def body(self) -> bytes:
        return error_body(self.status, self.message, self.code)


@attrs.frozen
class ControlNames:
    """The names a request's Host may give, as `host_name` normalises them."""

    scheme: str  # "https", or "http" on a plaintext port
    names: frozenset[str]
    wildcards: tuple[str, ...] = ()  # ".example.net" of a certificate's "*.example.net"
    aliases: frozenset[str] = frozenset()  # [server] control_hosts: also accepted in Origin

    def accepts(self, name: str) -> bool:
        if name in self.names or name in self.aliases:
            return True
        head, dot, rest = name.partition(".")
        return bool(head and dot) and f".{rest}" in self.wildcards


def host_name(text: str) -> str:
    """A name as it is compared: lower case, without brackets or a trailing dot."""
    name = text.strip().lower()
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    return name.removesuffix(".")


def control_names(
    server: ServerSection, scheme: str, certificate_names: Iterable[str] = ()
) -> ControlNames:
    listen = host_name(server.control_listen.host)
    names = {listen, *(host_name(n) for n in certificate_names if not n.startswith("*."))}
    if listen in _WILDCARD_LISTEN or is_loopback(listen):
        names |= LOOPBACK_NAMES
    wildcards = tuple(sorted({host_name(n)[1:] for n in certificate_names if n.startswith("*.")}))
    aliases = frozenset(host_name(n) for n in server.control_hosts)
    return ControlNames(scheme, frozenset(names - _WILDCARD_LISTEN), wildcards, aliases)


def certificate_names(pem: bytes) -> list[str]:
    """The DNS and IP names of a PEM certificate's subjectAltName (none without one)."""
    cert = x509.load_pem_x509_certificate(pem)
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    ips = [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)]
    return [*sans.get_values_for_type(x509.DNSName), *ips]


def port_names(server: ServerSection, tls: AgentsTLS) -> ControlNames:
    """The control port's names, from its config and its certificate's file."""
    if tls.insecure or tls.cert is None:
        return control_names(server, "http")
    try:
        names = certificate_names(tls.cert.read_bytes())
    except (OSError, ValueError):
        names = []  # not a certificate: loading it for TLS says so, next
    return control_names(server, "https", names)


def _split_authority(text: str) -> tuple[str, int | None] | None:
    """(name, port or None) of a Host value or an origin's authority; None when malformed."""
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            return None
        name, rest = text[: end + 1], text[end + 1 :]
        if rest and not rest.startswith(":"):
            return None
        port_text = rest[1:] if rest else None
    else:
        name, colon, port_text_or = text.partition(":")
        port_text = port_text_or if colon else None
    if port_text is not None and not _PORT.fullmatch(port_text):
        return None
    name = host_name(name)
    if not name or any(c in name for c in "/@?#\\ ") or ("]" in name or "[" in name):
        return None
    if ":" in name:  # only a bracketed IPv6 address has colons
        try:
            ipaddress.IPv6Address(name)
        except ValueError:
            return None
    return name, None if port_text is None else int(port_text)


def _same_origin(origin: bytes, host: tuple[str, int | None], names: ControlNames) -> bool:
    """Whether `origin` is the port's own: its scheme and the Host the request names."""
    text = origin.decode("ascii", "replace").strip()
    origin_scheme, sep, authority = text.partition("://")
    if not sep or origin_scheme.lower() not in _DEFAULT_PORTS:
        return False  # "null", or nothing a browser sends
    parsed = _split_authority(authority)
    if parsed is None:
        return False
    name, port = parsed
    if name in names.aliases:
        return True  # served by a proxy, under its own scheme and port
    origin_scheme = origin_scheme.lower()
    origin_port = _DEFAULT_PORTS[origin_scheme] if port is None else port
    own_port = _DEFAULT_PORTS[names.scheme] if host[1] is None else host[1]
    return (origin_scheme, name, origin_port) == (names.scheme, host[0], own_port)


def _values(headers: Sequence[tuple[bytes, bytes]], name: bytes) -> list[bytes]:
    return [value for key, value in headers if key == name]


def refusal(
    method: bytes,
    path: bytes,
    headers: Sequence[tuple[bytes, bytes]],
    names: ControlNames,
    *,
    websocket: bool = False,
) -> Refusal | None:
    """Why the control port refuses this request before anything else, or None."""
    origins = _values(headers, b"origin")
    host_values = _values(headers, b"host")
    host = (
        _split_authority(host_values[0].decode("ascii", "replace").strip())
        if len(host_values) == 1
        else None
    )
    if websocket and path in WEBSOCKET_PATHS:
        own = host or ("", None)
        if any(not _same_origin(o, own, names) for o in origins):
            return Refusal(
                403,
                "a websocket from a web page is refused: agents and routers send no Origin",
                "cross_site",
            )
        return None
    if host is None or not names.accepts(host[0]):
        given = "no Host" if not host_values else f"Host {escaped(host_values[0], limit=200)}"
        return Refusal(
            421,
            f"{given} is not a name of this control plane: ask for it by a name of its "
            "certificate or control_listen (or list the name in [server] control_hosts)",
            "misdirected_request",
        )
    if method in _SAFE_METHODS:
        return None
    for site in _values(headers, b"sec-fetch-site"):
        if site.strip().lower() in _FOREIGN_SITES:
            return Refusal(
                403,
                f"refused: a request from another site (Sec-Fetch-Site: {escaped(site)}) "
                "may not act on the fleet",
                "cross_site",
            )
    for origin in origins:
        if not _same_origin(origin, host, names):
            return Refusal(
                403,
                f"refused: a request from another origin ({escaped(origin, limit=200)}) may not "
                "act on the fleet",
                "cross_site",
            )
    content_types = _values(headers, b"content-type")
    media = content_types[0].partition(b";")[0].strip().lower() if len(content_types) == 1 else b""
    if media != b"application/json":
        return Refusal(
            415,
            "admin actions take Content-Type: application/json "
            "(curl: -H 'Content-Type: application/json')",
            "json_required",
        )
    return None


class ControlPortGate:
    """`refusal`, in front of everything the control port serves: its requests
    (`handle`) and its websocket upgrades (`upgrade`)."""

    def __init__(self, names: ControlNames, handler: Handler, upgrade: UpgradeHandler) -> None:
        self.names = names
        self._handler = handler
        self._upgrade = upgrade

    async def handle(self, request: Request, responder: Responder) -> None:
        refused = refusal(request.method, request.path, request.headers, self.names)
        if refused is not None:
            await responder.whole(refused.status, refused.body())
            return
        await self._handler(request, responder)

    async def upgrade(self, request: Request, raw: trio.abc.Stream) -> None:
        refused = refusal(request.method, request.path, request.headers, self.names, websocket=True)
        if refused is None:
            await self._upgrade(request, raw)
            return
        with trio.move_on_after(2):
            try:
                await raw.send_all(
                    upgrade_refusal(refused.status, _REASONS[refused.status], refused.body())
                )
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass


_REASONS = {403: b"Forbidden", 415: b"Unsupported Media Type", 421: b"Misdirected Request"}
