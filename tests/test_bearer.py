"""`Authorization: Bearer`, read in one place (llmgw_core.bearer)."""

from __future__ import annotations

import pytest

from llmgw_core.bearer import bearer_digest, bearer_matches, bearer_token
from llmgw_core.config import digest_of


@pytest.mark.parametrize(
    ("header", "token"),
    [
        (None, None),
        (b"Bearer sk-1", b"sk-1"),
        (b"bearer sk-1", b"sk-1"),
        (b"BEARER  sk-1 \t", b"sk-1"),  # the scheme in any case; whitespace around dropped
        (b"Bearer", None),
        (b"Bearer ", None),  # an empty token is no token
        (b"Bearer    ", None),
        (b"Basic c2stMQ==", None),
        (b"Bearersk-1", None),
        (b"sk-1", None),
    ],
)
def test_the_token_of_an_authorization_header(header: bytes | None, token: bytes | None) -> None:
    assert bearer_token(header) == token
    assert bearer_digest(header) == (None if token is None else digest_of(token))


def test_a_header_matches_the_digest_of_its_token_alone() -> None:
    kept = digest_of("sk-1")
    assert bearer_matches(b"Bearer sk-1", kept)
    assert bearer_matches(b"bearer  sk-1 ", kept)
    assert not bearer_matches(b"Bearer sk-2", kept)
    assert not bearer_matches(b"Bearer " + kept.encode(), kept)  # the digest is no token
    assert not bearer_matches(None, kept)
    assert not bearer_matches(b"Bearer ", digest_of(""))  # empty is never a token
    assert not bearer_matches(b"Bearer sk-1", None)  # none set: nothing matches
