"""`[[tenants]]` and a key's `tenant`: what the file may say, and what it means; what a
request reserves of its tenant's tokens and what it is charged when its answer ends."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from llmgw_core.config import Config, parse_config
from llmgw_core.tomlshape import ConfigError
from llmgw_server.reload import plan_reload
from llmgw_server.router.access_log import AccessRecord
from llmgw_server.router.tenancy import Admitted, charged_tokens, reservation


def sha(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def config(tenants: list[dict[str, Any]], keys: list[dict[str, Any]] | None = None) -> Config:
    data: dict[str, object] = {
        "auth": {"api_keys": [sha("plain")], "keys": keys or []},
        "tenants": tenants,
        "models": [{"name": "a", "endpoints": ["http://127.0.0.1:9001"]}],
    }
    return parse_config(data, "x.toml", environ={})


def error(tenants: list[dict[str, Any]], keys: list[dict[str, Any]] | None = None) -> str:
    with pytest.raises(ConfigError) as caught:
        config(tenants, keys)
    return str(caught.value)


def test_keys_share_a_tenant_one_without_is_its_own_and_plain_keys_are_default() -> None:
    c = config(
        [{"name": "team-a", "tokens_per_minute": 1000, "priority": 2, "weight": 3}],
        [
            {"digest": sha("k1"), "tenant": "team-a"},
            {"digest": sha("k2"), "tenant": "team-a"},
            {"digest": sha("k3")},
        ],
    )
    tenant_of = c.auth.tenant_of
    assert tenant_of[sha("k1")[7:]] == tenant_of[sha("k2")[7:]] == "team-a"
    assert tenant_of[sha("k3")[7:]] == "key:" + sha("k3")[7:15]
    assert tenant_of[sha("plain")[7:]] == "default"
    entry = c.tenants.entry("team-a")
    assert entry is not None and (entry.priority, entry.weight) == (2, 3.0)
    assert entry.limited and entry.requests_per_minute is None


@pytest.mark.parametrize(
    ("tenants", "keys", "says"),
    [
        ([{"name": "team-a"}], [{"digest": sha("k"), "tenant": "team-b"}],
         "auth.keys[0].tenant: 'team-b' is not a [[tenants]] name (did you mean 'team-a'?)"),
        ([{"name": "a"}, {"name": "a"}], None, "tenants[1]: 'a' is given twice"),
        ([{"name": "a", "models": [{"model": "a"}, {"model": "a"}]}], None,
         "tenants[0].models[1]: 'a' is given twice"),
        ([{"name": "a", "models": [{"model": "b", "max_in_flight": 2}]}], None,
         "tenants[0].models[0].model: 'b' is not a model of this config"),
        ([{"name": "a", "priority": 101}], None, "tenants[0].priority: must be at most 100"),
        ([{"name": "a", "tokens_per_minute": 0}], None,
         "tenants[0].tokens_per_minute: must be at least 1"),
        ([{"name": "a b"}], None, "is not a tenant name"),
        ([{"name": "a", "tokens_per_minit": 5}], None, "tokens_per_minute"),
    ],
)  # fmt: skip
def test_what_a_tenants_table_may_not_say(
    tenants: list[dict[str, Any]], keys: list[dict[str, Any]] | None, says: str
) -> None:
    assert says in error(tenants, keys)


def test_a_reload_names_the_tenants_it_changes_and_a_key_moved_between_them() -> None:
    old = config([{"name": "a"}, {"name": "b", "max_in_flight": 4}],
                 [{"digest": sha("k"), "tenant": "a"}])  # fmt: skip
    new = config([{"name": "a", "max_in_flight": 2}, {"name": "b", "max_in_flight": 4}],
                 [{"digest": sha("k"), "tenant": "b"}])  # fmt: skip
    plan = plan_reload(old, new)
    assert plan.tenants_changed == ("a",) and plan.keys_changed == 1
    assert "tenants changed: a" in plan.summary() and plan.changes


def test_a_reservation_is_its_prompt_and_its_bound_within_the_models_context() -> None:
    chat = b"/v1/chat/completions"
    # No tokenizer counted it: 4 bytes a token, rounded up; no max_tokens: the default.
    assert reservation(chat, {}, 401, None, 512, None) == (101, 512)
    assert reservation(chat, {"max_tokens": 7}, 40, 9, 512, None) == (9, 7)
    assert reservation(chat, {"max_completion_tokens": 3}, 40, 9, 512, None) == (9, 3)
    # A huge max_tokens (or a bad one: ignored) reserves no more than the context allows.
    assert reservation(chat, {"max_tokens": 10**12}, 40, 100, 512, 4096) == (100, 3996)
    assert reservation(chat, {"max_tokens": -5}, 40, 100, 512, None) == (100, 512)
    assert reservation(chat, {"max_tokens": True}, 40, 100, 512, None) == (100, 512)
    assert reservation(chat, {}, 10**9, None, 512, 4096) == (4096, 1)
    # What generates no tokens reserves its prompt alone.
    assert reservation(b"/v1/embeddings", {"max_tokens": 9}, 40, None, 512, None) == (10, 0)


def test_what_a_request_is_charged_when_its_answer_ends() -> None:
    admitted = Admitted("t", 600, (), [], prompt=100)

    def record(**fields: Any) -> AccessRecord:
        base = AccessRecord(0.0, "id", "POST", "/v1/chat/completions", replica="http://e",
                            status=200, ttfb_s=0.1)  # fmt: skip
        for name, value in fields.items():
            setattr(base, name, value)
        return base

    # The engine's usage, whatever was reserved.
    assert charged_tokens(record(prompt_tokens=90, completion_tokens=20), 0, admitted) == 110
    # A stream without usage, or whose client left: its writes, one token each.
    assert charged_tokens(record(status=0), 37, admitted) == 137
    # No engine answered (unreachable, refused by all): nothing.
    assert charged_tokens(record(replica=None, ttfb_s=None, status=502), 0, admitted) == 0
    assert charged_tokens(record(status=429), 0, admitted) == 0
    # An answer that said nothing of its usage: the reservation.
    assert charged_tokens(record(), 0, admitted) == 600
