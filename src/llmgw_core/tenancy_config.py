"""`[[tenants]]`: who shares the fleet, and how much each may use of it.

A tenant is a team: several API keys may belong to one (`[[auth.keys]] tenant = ...`),
and then share its limits (a team's services each with a key, a key being rotated with
both live). Limits live on the tenant, not on the key, for that reason. A key that names
no tenant is a tenant of its own (`key:` and the key id), unlimited; requests without a
key, or with a key of the plain `api_keys` list, belong to the tenant `default`, which a
`[[tenants]]` table named "default" limits like any other. Nothing in a request (its
`user`, `metadata` or headers) chooses its tenant or priority: only its key does.

Each limit is per minute over a sliding 60 s window (`requests_per_minute`,
`tokens_per_minute`: prompt plus output tokens, cached prompt tokens counted like any
other, since the engine's usage says what was sent, not what it held) or a count at
once (`max_in_flight`); absent means unlimited, the default. `[[tenants.models]]` adds
limits for one model's requests, which must fit those as well as the tenant's own.
`priority` (higher first, 0 by default) and `weight` (1 by default) order the tenant's
requests when they wait for a full model's engines (router fair queues).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import attrs

from llmgw_core.config_schema import Problem, read_text, rule_after, rules

DEFAULT_TENANT = "default"
KEY_TENANT_PREFIX = "key:"  # a key's own tenant: "key:" and its key id
PRIORITY_RANGE = (-100, 100)
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def tenant_name(value: object) -> str:
    """A tenant's name as the file gives it (a label on /metrics: a bounded charset)."""
    text = read_text(value)
    if not _NAME.match(text):
        raise Problem(
            f"{text[:80]!r} is not a tenant name: 1 to 64 letters, digits, '_', '.' or '-', "
            "starting with a letter or digit (it is a label on /metrics)"
        )
    return text


@attrs.frozen
class LimitFields:
    """The limits both a tenant and one of its models may set (None: unlimited)."""

    requests_per_minute: int | None = attrs.field(default=None, metadata=rules(min=1))
    tokens_per_minute: int | None = attrs.field(default=None, metadata=rules(min=1))
    max_in_flight: int | None = attrs.field(default=None, metadata=rules(min=1))

    @property
    def limited(self) -> bool:
        return not (
            self.requests_per_minute is None
            and self.tokens_per_minute is None
            and self.max_in_flight is None
        )


@attrs.frozen
class ModelLimits(LimitFields):
    """`[[tenants.models]]`: limits on one model's requests of a tenant."""

    model: str = attrs.field(kw_only=True, metadata=rules(parse=read_text))


@attrs.frozen
class TenantEntry(LimitFields):
    """`[[tenants]]`: one tenant's limits and its place in the queues."""

    name: str = attrs.field(kw_only=True, metadata=rules(parse=tenant_name))
    priority: int = attrs.field(
        default=0, kw_only=True, metadata=rules(min=PRIORITY_RANGE[0], max=PRIORITY_RANGE[1])
    )
    weight: float = attrs.field(default=1.0, kw_only=True, metadata=rules(min=0.01, max=1000.0))
    models: tuple[ModelLimits, ...] = attrs.field(default=(), kw_only=True)

    def for_model(self, model: str) -> ModelLimits | None:
        for entry in self.models:
            if entry.model == model:
                return entry
        return None


def _once(names: list[str], what: str, at: str) -> None:
    """Each of `names` once: a second one is a Problem at `at` with its index."""
    seen: set[str] = set()
    for i, name in enumerate(names):
        if name in seen:
            raise Problem(f"{name!r} is given twice: give each {what} once", f"{at}[{i}]")
        seen.add(name)


@rule_after(TenantEntry)
def _each_model_once(entry: TenantEntry) -> None:
    _once([limits.model for limits in entry.models], "model", "models")


def _by_name(book: TenantBook) -> dict[str, TenantEntry]:
    return {t.name: t for t in book.tenants}


@attrs.frozen
class TenantBook:
    """Every `[[tenants]]` of the file, by name."""

    tenants: tuple[TenantEntry, ...] = ()
    by_name: Mapping[str, TenantEntry] = attrs.field(
        init=False, default=attrs.Factory(_by_name, takes_self=True)
    )

    def entry(self, tenant: str) -> TenantEntry | None:
        return self.by_name.get(tenant)


@rule_after(TenantBook)
def _each_tenant_once(book: TenantBook) -> None:
    _once([entry.name for entry in book.tenants], "tenant", "tenants")


def key_tenant(key_id: str) -> str:
    """The tenant of a key that names none: the key itself."""
    return KEY_TENANT_PREFIX + key_id
