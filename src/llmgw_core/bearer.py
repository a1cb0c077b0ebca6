"""`Authorization: Bearer <token>`, read in one place for every port (the router's API
keys and metrics token, the admin API's tokens, the route feed's router token).

A token is kept and compared as its digest (`digest_of`), never as itself; an empty
token is no token.
"""

from __future__ import annotations

import hmac

from llmgw_core.config_schema import digest_of


def bearer_token(authorization: bytes | None) -> bytes | None:
    """The token of an Authorization header's value (the scheme in any case, the token's
    surrounding whitespace dropped); None when the header is absent, names another scheme
    or carries an empty token."""
    if authorization is None or authorization[:7].lower() != b"bearer ":
        return None
    return authorization[7:].strip() or None


def bearer_digest(authorization: bytes | None) -> str | None:
    """The digest of the token in an Authorization header's value; None when it has none."""
    token = bearer_token(authorization)
    return None if token is None else digest_of(token)


def client_key_digest(authorization: bytes | None, x_api_key: bytes | None) -> str | None:
    """The digest of a client's API key: the Bearer token, or else Anthropic's `x-api-key`
    header's value (its clients send the key there); None when neither carries one."""
    token = bearer_token(authorization)
    if token is None and x_api_key is not None:
        token = x_api_key.strip() or None
    return None if token is None else digest_of(token)


def bearer_matches(authorization: bytes | None, digest: str | None) -> bool:
    """Whether the header carries the token kept as `digest` (None: no token is set, so
    none matches); the digests are compared in constant time."""
    if digest is None:
        return False
    presented = bearer_digest(authorization)
    return presented is not None and hmac.compare_digest(presented, digest)
