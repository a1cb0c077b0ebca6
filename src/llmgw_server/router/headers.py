"""Which headers cross the router, either way, and the few it reads itself."""

from __future__ import annotations

from llmgw_core.bearer import client_key_digest
from llmgw_http.server import JSON, Request

_HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"host",
        b"content-length",
        b"authorization",
        b"expect",
    }
)
# A client's own key in the other headers OpenAI-style clients send it in (Anthropic's,
# Azure's): never the engine's business, which gets the engine key (Endpoint.api_key).
_CLIENT_KEYS = frozenset({b"x-api-key", b"api-key"})
# Headers some servers and frameworks let rewrite the request's path, method or prefix
# (IIS, Symfony, Spring, ...): a client could name an engine's management path in them,
# or change what the router routed. No engine llmgw serves needs them (issue 34).
_REWRITES = frozenset(
    {b"x-original-url", b"x-rewrite-url", b"x-http-method-override", b"x-forwarded-prefix"}
)
# Never relayed either way: the above, and their lookalikes with `_` for `-`.
_NOT_FORWARDED = frozenset(
    name.replace(b"-", sep)
    for name in _HOP_BY_HOP | _CLIENT_KEYS | _REWRITES
    for sep in (b"-", b"_")
)
# Connection header values that name no further header to drop (what clients send).
_PLAIN_CONNECTION = frozenset({b"keep-alive", b"close", b"Keep-Alive", b"Close"})


def end_to_end(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The headers that cross the router, either way: not hop-by-hop ones (the router
    frames what it sends itself, so never the other side's Content-Length or
    Transfer-Encoding), not their lookalikes with `_` for `-` (a peer that reads `_` as
    `-` would take `transfer_encoding` for framing), nor those the Connection header
    names (RFC 9110 section 7.6.1), nor a client's key (`x-api-key`, `api-key`), nor the
    rewrite headers (`x-original-url` and the like)."""
    kept = []
    connection = None  # one pass: a second one for Connection would double its cost
    for name, value in headers:
        if name not in _NOT_FORWARDED:
            kept.append((name, value))
        elif name == b"connection":
            connection = value if connection is None else connection + b"," + value
    if connection is None or connection in _PLAIN_CONNECTION:
        return kept
    named = {t.strip().lower() for t in connection.split(b",")}
    named |= {name.replace(b"-", b"_") for name in named}
    return [(k, v) for k, v in kept if k not in named]


def client_key(request: Request) -> str | None:
    """The digest of a client's API key: `Authorization: Bearer`, or where Anthropic's
    clients send it, `x-api-key` (the first, when both are given)."""
    authorization = x_api_key = None
    for name, value in request.headers:  # one look through the headers
        if name == b"authorization":
            if authorization is None:
                authorization = value
        elif name == b"x-api-key" and x_api_key is None:
            x_api_key = value
    return client_key_digest(authorization, x_api_key)


def header(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes:
    for key, value in headers:
        if key == name:
            return value
    return b""


def content_type_of(body: bytes) -> list[tuple[bytes, bytes]]:
    return JSON if body[:1] == b"{" else [(b"content-type", b"text/plain")]
