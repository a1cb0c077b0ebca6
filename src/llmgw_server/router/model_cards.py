"""What `/v1/models` says of a model: the engine's own description, as its `/v1/models`
gives it (issue 21), so that clients that size prompts from `max_model_len` keep working.

Read by the health prober from a replica (`card_of`), kept per model by the router
(`Router.cards`) and used while the model is listed, whichever replica said it: a replica
that is down leaves the last description in place. An engine is not trusted with what
the client sees: only the fields below, of their types and sizes, are taken, and the id
is always the model's name here.
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
    except (ValueError, UnicodeDecodeError):
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
    return card
