"""An engine's description of its model, as the router's /v1/models shows it (issue 21)."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from llmgw_server.router.model_cards import MAX_LISTING_BYTES, card_of, plain_card


def listing(*entries: object) -> bytes:
    return json.dumps({"object": "list", "data": list(entries)}).encode()


def test_the_entry_named_or_the_only_one_is_taken_reduced_to_what_clients_read() -> None:
    vllm = {"id": "m", "object": "model", "created": 7, "owned_by": "vllm", "root": "/w",
            "parent": None, "max_model_len": 4096, "permission": [{"x": 1}]}  # fmt: skip
    assert card_of(listing(vllm, {"id": "lora", "parent": "m"}), "m") == {
        "id": "m", "object": "model", "created": 7, "owned_by": "vllm", "root": "/w",
        "parent": None, "max_model_len": 4096,
    }  # fmt: skip
    # llama-server names its model by its file or alias: the only entry is the model's.
    llama = {"id": "gemma.gguf", "object": "model", "owned_by": "llamacpp", "meta": {"n_ctx_train": 8}}
    assert card_of(listing(llama), "g") == {**plain_card("g"), "owned_by": "llamacpp"}
    assert card_of(listing(llama, {"id": "other"}), "g") is None  # which one: not known


def test_what_an_engine_must_not_put_in_front_of_clients_is_left_out() -> None:
    hostile = {"id": "m", "owned_by": "x" * 10_000, "max_model_len": True, "created": -1,
               "root": {"nested": 1}, "parent": 3, "object": "not-a-model"}  # fmt: skip
    assert card_of(listing(hostile), "m") == plain_card("m")
    assert card_of(listing({"id": "m", "max_model_len": 2**60}), "m") == plain_card("m")
    for broken in (b"", b"[]", b'{"data": {}}', b"\xff", b'{"data": [1, "a"]}', b"null"):
        assert card_of(broken, "m") is None, broken
    assert card_of(b" " * (MAX_LISTING_BYTES + 1), "m") is None


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
                    max_leaves=20))  # fmt: skip
def test_any_json_gives_a_card_of_known_fields_or_none(data: object) -> None:
    card = card_of(json.dumps({"data": [data]}).encode(), "m")
    assert card is None or (card["id"] == "m" and set(card) <= {
        "id", "object", "created", "owned_by", "root", "parent", "max_model_len"})  # fmt: skip
