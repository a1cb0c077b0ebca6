"""An engine's description of its model, as the router's /v1/models shows it (issue 21)."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from llmgw_server.router.model_cards import (
    MAX_EXTRA_BYTES,
    MAX_EXTRA_FIELDS,
    MAX_LISTING_BYTES,
    card_of,
    plain_card,
)


def listing(*entries: object) -> bytes:
    return json.dumps({"object": "list", "data": list(entries)}).encode()


def test_the_entry_named_or_the_only_one_is_taken_reduced_to_what_clients_read() -> None:
    vllm = {"id": "m", "object": "model", "created": 7, "owned_by": "vllm", "root": "/w",
            "parent": None, "max_model_len": 4096, "permission": [{"x": 1}]}  # fmt: skip
    assert card_of(listing(vllm, {"id": "lora", "parent": "m"}), "m") == {
        "id": "m", "object": "model", "created": 7, "owned_by": "vllm", "root": "/w",
        "parent": None, "max_model_len": 4096, "permission": [{"x": 1}],
    }  # fmt: skip
    # llama-server names its model by its file or alias: the only entry is the model's;
    # its own fields (`meta`) are kept as they came.
    meta = {"vocab_type": 2, "n_vocab": 256, "n_ctx_train": 8, "n_params": 9, "size": 5.5}
    llama = {"id": "gemma.gguf", "object": "model", "owned_by": "llamacpp", "meta": meta}
    assert card_of(listing(llama), "g") == {**plain_card("g"), "owned_by": "llamacpp", "meta": meta}
    assert card_of(listing(llama, {"id": "other"}), "g") is None  # which one: not known


def test_what_an_engine_must_not_put_in_front_of_clients_is_left_out() -> None:
    hostile = {"id": "m", "owned_by": "x" * 10_000, "max_model_len": True, "created": -1,
               "root": {"nested": 1}, "parent": 3, "object": "not-a-model"}  # fmt: skip
    assert card_of(listing(hostile), "m") == plain_card("m")
    assert card_of(listing({"id": "m", "max_model_len": 2**60}), "m") == plain_card("m")
    for broken in (b"", b"[]", b'{"data": {}}', b"\xff", b'{"data": [1, "a"]}', b"null"):
        assert card_of(broken, "m") is None, broken
    assert card_of(b" " * (MAX_LISTING_BYTES + 1), "m") is None


def test_an_engines_own_fields_are_kept_within_their_bounds() -> None:
    big = "x" * MAX_EXTRA_BYTES
    entry = {"id": "m", "a": 1, "huge": big, "nan": float("nan"), "k" * 65: 1, "b": [2]}
    assert card_of(listing(entry), "m") == {**plain_card("m"), "a": 1, "b": [2]}
    many = {"id": "m", **{f"f{i}": i for i in range(MAX_EXTRA_FIELDS + 5)}}
    card = card_of(listing(many), "m")
    assert card is not None and len(card) == len(plain_card("m")) + MAX_EXTRA_FIELDS
    # As much as fits, each field whole: the JSON of the kept ones is within the bound.
    filling = {"id": "m", **{f"f{i}": "y" * 1000 for i in range(6)}, "last": 0}
    card = card_of(listing(filling), "m")
    assert card is not None
    extra = {k: v for k, v in card.items() if k not in plain_card("m")}
    assert list(extra) == ["f0", "f1", "f2", "f3", "last"]
    assert len(json.dumps(extra)) <= MAX_EXTRA_BYTES
    # Nested past the JSON parser's depth: no card, no exception.
    assert card_of(b'{"data": [' + b"[" * 100_000 + b"]}", "m") is None


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
                    max_leaves=20))  # fmt: skip
def test_any_json_gives_a_card_of_known_fields_or_none(data: object) -> None:
    card = card_of(json.dumps({"data": [data]}).encode(), "m")
    assert card is None or (card["id"] == "m" and card["object"] == "model")
    if card is not None:
        known = {"id", "object", "created", "owned_by", "root", "parent", "max_model_len"}
        extra = {k: v for k, v in card.items() if k not in known}
        assert len(json.dumps(extra)) <= MAX_EXTRA_BYTES and len(extra) <= MAX_EXTRA_FIELDS
        assert isinstance(data, dict) and all(data[k] == v for k, v in extra.items())
