"""Stored responses (the Responses API): which replica holds one, read from its id.

An engine keeps the responses it stores (`store`, true by default) in its own process's
memory (vLLM with VLLM_ENABLE_RESPONSES_API_STORE=1), so a follow-up that names one
(`previous_response_id`), and `GET`/`DELETE /v1/responses/{id}` or `POST
/v1/responses/{id}/cancel`, must reach the replica that stored it. The router names that
replica inside the id the client sees: each response is given its id by the router, as
the request's `request_id` (which vLLM, and SGLang after it, use as the response's id):

    resp_lg + its model's tag (8 hex digits of a hash of the model's name)
            + its replica's rendezvous name (Replica.rid, 16 hex digits of a hash of its URL)
            + 32 random hex digits

Every router process, every worker and every router apart reads the replica back from the
id alone: nothing is shared, kept or lost on a restart, and nothing grows with the number
of responses (a map from id to replica would need a store shared by all routers, and
bounds that forget live responses). The model's tag keeps a key that may use one model of
an engine from reaching what another model of the same engine stored. The price: an
engine that ignores `request_id` mints its own ids, whose follow-ups are balanced like any
request; and the id carries a hash of the replica's URL (not the URL: a client learns
which of its responses share a replica).

Pure functions, no I/O.
"""

from __future__ import annotations

import json
import re
import secrets

import attrs

from llmgw_server.router.prefix import stable_hash

RESPONSES = b"/v1/responses"
_STORED_PREFIX = RESPONSES + b"/"
_MINTED = re.compile(r"resp_lg([0-9a-f]{8})([0-9a-f]{16})[0-9a-f]{32}")
# What an id in a path may be: the engines' ids are letters, digits, `_` and `-`.
_PATH_ID = re.compile(rb"[A-Za-z0-9_-]{1,128}")
# What may follow an id: vLLM's and OpenAI's sub-resources of a stored response.
_SUBRESOURCES = frozenset({b"", b"cancel", b"input_items"})


@attrs.frozen(slots=True)
class Holder:
    """Where a response is stored, as its id says: a model's tag and a replica's name."""

    model_tag: int
    rid: int


def model_tag(model: str) -> int:
    return stable_hash(model) >> 32


def mint(model: str, rid: int) -> str:
    """A new response id that names `model` and the replica whose rendezvous name is `rid`."""
    return f"resp_lg{model_tag(model):08x}{rid:016x}{secrets.token_hex(16)}"


def holder_of(response_id: object) -> Holder | None:
    """Where the response is stored, if the id is one the router minted; None for any
    other value (an engine's own id, garbage, not a string)."""
    if not isinstance(response_id, str):
        return None
    minted = _MINTED.fullmatch(response_id)
    if minted is None:
        return None
    return Holder(int(minted.group(1), 16), int(minted.group(2), 16))


def is_stored_path(path: bytes) -> bool:
    """Whether the path is under /v1/responses/: a stored response or its sub-resource."""
    return path.startswith(_STORED_PREFIX)


def stored_path_id(path: bytes) -> str | None:
    """The response id of `/v1/responses/{id}` or `/v1/responses/{id}/{cancel,input_items}`,
    or None when the path is no such thing."""
    rest = path[len(_STORED_PREFIX) :]
    response_id, _, sub = rest.partition(b"/")
    if not _PATH_ID.fullmatch(response_id) or sub not in _SUBRESOURCES:
        return None
    if sub == b"" and rest.endswith(b"/"):
        return None
    return response_id.decode("ascii")


def with_response_id(body: dict[str, object], response_id: str) -> bytes:
    """The request's body with the id the engine is to give its response: any
    `request_id` the client sent is replaced (the router names its responses). ASCII
    escapes: a lone surrogate that JSON allows is no UTF-8."""
    return json.dumps({**body, "request_id": response_id}).encode()
