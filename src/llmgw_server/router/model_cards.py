"""What `/v1/models` says of a model: the engine's own description, as its `/v1/models`
gives it (issue 21), so that clients that size prompts from `max_model_len` keep working.

Read by the health prober from a replica (`card_of`), kept per model by the router
(`Router.cards`) and used while the model is listed, whichever replica said it: a replica
that is down leaves the last description in place. An engine is not trusted with what
the client sees: the fields clients read are taken only of their types and sizes, the id
is always the model's name here and the object "model". The engine's other fields
(llama-server's `meta` with `n_ctx_train`, `n_params`...; vLLM's `permission`) are kept
as they came, in their order, while they fit MAX_EXTRA_FIELDS and MAX_EXTRA_BYTES; the
rest are left out.
"""

from __future__ import annotations

import json
from typing import Any

MAX_LISTING_BYTES = 256 * 1024  # vLLM's lists a base model and its LoRA adapters
_MAX_TEXT = 512
# Fields engines send (vLLM: root, parent, max_model_len; llama.cpp: owned_by, meta):
# the ones clients read, with the type each must have.
_TEXT_FIELDS = ("owned_by", "root", "parent")
_COUNT_FIELDS = ("created", "max_model_len")
_OURS = ("id", "object", *_TEXT_FIELDS, *_COUNT_FIELDS)
# An engine's own other fields, as JSON, all together: llama-server's `meta` is about
# 200 bytes, vLLM's `permission` about 300. A bound on what each model's card holds and
# every /v1/models answer repeats.
MAX_EXTRA_BYTES = 4096
MAX_EXTRA_FIELDS = 32
_MAX_KEY = 64


def plain_card(name: str) -> dict[str, Any]:
    """A model's entry when no engine has described it (yet)."""
    return {"id": name, "object": "model", "created": 0, "owned_by": "llmgw"}


def card_of(listing: bytes, name: str) -> dict[str, Any] | None:
    """The entry for `name` in an engine's `/v1/models` answer, reduced to the fields
    above (the id set to `name`), or None when the answer has none it can be told by:
    the entry whose id is `name`, else the only entry."""
    if len(listing) > MAX_LISTING_BYTES:
        return None
    try:
        data = json.loads(listing)
    except (ValueError, UnicodeDecodeError, RecursionError):  # nested past the parser's depth
        return None
    entries = data.get("data") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        return None
    models = [e for e in entries if isinstance(e, dict)]
    named = [e for e in models if e.get("id") == name]
    entry = named[0] if named else models[0] if len(models) == 1 else None
    if entry is None:
        return None
    card = plain_card(name)
    for key in _TEXT_FIELDS:
        value = entry.get(key)
        if isinstance(value, str) and len(value) <= _MAX_TEXT:
            card[key] = value
        elif value is None and key == "parent" and key in entry:
            card[key] = None
    for key in _COUNT_FIELDS:
        value = entry.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**53:
            card[key] = value
    card.update(_extra_fields(entry))
    return card


def _extra_fields(entry: dict[str, Any]) -> dict[str, Any]:
    """The engine's fields that are not ours to check, within the bounds above: each one
    whole or not at all (a field that would pass MAX_EXTRA_BYTES is left out, a later
    smaller one may still fit)."""
    extra: dict[str, Any] = {}
    used = 2  # the braces of the fields as one JSON object
    for key, value in entry.items():
        if key in _OURS or len(key) > _MAX_KEY or len(extra) == MAX_EXTRA_FIELDS:
            continue
        try:
            # As the router will send it: NaN and Infinity are not JSON.
            item = json.dumps({key: value}, allow_nan=False)
        except (ValueError, RecursionError):
            continue
        size = len(item) - 2 + (2 if extra else 0)  # its `"key": value`, and ", " before it
        if used + size <= MAX_EXTRA_BYTES:
            extra[key] = value
            used += size
    return extra
