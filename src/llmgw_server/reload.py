"""Reloading the config file without a restart (SIGHUP, `POST /v1/admin/reload`).

What a reload applies: the API keys (`[auth]`), the tenants and their limits
(`[[tenants]]`: requests in flight finish and are settled where they are; a tenant's
use so far counts against its new limits), the metrics token, the static models
(`[[models]]` with `endpoints`: added, removed, their endpoints changed) and, where a
control plane runs, the profiled models: added (placed as a change of `replicas` from
0 would be), removed (drained, then stopped, as a change to 0 would be), and the profile
and `replicas` of the others (the control plane rolls the changed ones, one replica at a
time). Everything else (listen addresses, workers, `[router]` tuning, the control
plane's settings, a name that turns from static to profiled or back) is read from the
new file only at the next start: `plan_reload` names it, the log says it, the rest is
applied. A file that does not validate changes nothing.

`plan_reload` and `reloaded_config` are pure; `Reloader` reads the file and hands what
to apply to its owner (a Router, or the workers' parent); `reload_on_sighup` is the
signal loop any process that serves can run.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import attrs
import trio

from llmgw_core.catalog import Catalog, Endpoint, ModelEntry
from llmgw_core.config import Config, load_config
from llmgw_core.tomlshape import ConfigError

log = logging.getLogger("llmgw.reload")

# Fields of [server] a reload applies; any other change there waits for a restart.
_SERVER_RELOADED = frozenset({"metrics_token_digest"})
_SECTIONS = ("server", "router", "control", "admin", "agents")


@attrs.frozen
class ReloadPlan:
    """What a reload changes, and what it leaves for a restart."""

    keys_added: int = 0
    keys_removed: int = 0
    keys_changed: int = 0  # the same key, other models allowed
    metrics_token_changed: bool = False
    # Static models: name -> endpoints, for the added and the changed ones.
    models_added: Mapping[str, tuple[Endpoint, ...]] = attrs.field(factory=dict)
    models_changed: Mapping[str, tuple[Endpoint, ...]] = attrs.field(factory=dict)
    models_removed: tuple[str, ...] = ()
    # Profiled models handed to the control plane: those added (it places them) and
    # removed (it drains and stops their replicas), those whose profile changed (it rolls
    # their replicas) and those whose `replicas` changed (old, new: it adds or removes
    # replicas, nothing rolls).
    placed_added: tuple[str, ...] = ()
    placed_removed: tuple[str, ...] = ()
    profiles_changed: tuple[str, ...] = ()
    replicas_changed: Mapping[str, tuple[int, int]] = attrs.field(factory=dict)
    # Those whose [models.autoscale] changed (bounds, targets, windows; or one added or
    # removed): their autoscalers follow, keeping their counts within the new bounds.
    autoscale_changed: tuple[str, ...] = ()
    # Tenants added, removed or with other limits, priority or weight.
    tenants_changed: tuple[str, ...] = ()
    needs_restart: tuple[str, ...] = ()  # such as "server.listen", "models.chat (profile)"

    @property
    def changes(self) -> bool:
        return bool(
            self.keys_added
            or self.keys_removed
            or self.keys_changed
            or self.metrics_token_changed
            or self.tenants_changed
            or self.models_added
            or self.models_changed
            or self.models_removed
            or self.control_plane_changes
        )

    @property
    def control_plane_changes(self) -> bool:
        """Whether the control plane must take the reloaded catalog."""
        return bool(
            self.placed_added
            or self.placed_removed
            or self.profiles_changed
            or self.replicas_changed
            or self.autoscale_changed
        )

    def summary(self) -> str:
        parts = []
        if self.keys_added or self.keys_removed or self.keys_changed:
            parts.append(
                f"API keys: {self.keys_added} added, {self.keys_removed} removed, "
                f"{self.keys_changed} changed"
            )
        if self.metrics_token_changed:
            parts.append("the metrics token changed")
        if self.tenants_changed:
            parts.append(f"tenants changed: {', '.join(self.tenants_changed)}")
        for what, names in (
            ("added", self.models_added),
            ("changed", self.models_changed),
            ("removed", self.models_removed),
        ):
            if names:
                parts.append(f"models {what}: {', '.join(names)}")
        if self.placed_added:
            parts.append(f"placed models added: {', '.join(self.placed_added)}")
        if self.placed_removed:
            parts.append(f"placed models removed (drained): {', '.join(self.placed_removed)}")
        if self.profiles_changed:
            parts.append(f"profiles changed (rolled): {', '.join(self.profiles_changed)}")
        if self.replicas_changed:
            counts = (f"{name} {a} -> {b}" for name, (a, b) in self.replicas_changed.items())
            parts.append(f"replicas changed: {', '.join(counts)}")
        if self.autoscale_changed:
            parts.append(f"autoscaling changed: {', '.join(self.autoscale_changed)}")
        return "; ".join(parts) or "nothing to apply"

    def as_json(self) -> dict[str, Any]:
        return {
            "keys": {
                "added": self.keys_added,
                "removed": self.keys_removed,
                "changed": self.keys_changed,
            },
            "metrics_token_changed": self.metrics_token_changed,
            "tenants_changed": list(self.tenants_changed),
            "models": {
                "added": sorted(self.models_added),
                "changed": sorted(self.models_changed),
                "removed": list(self.models_removed),
                "placed_added": list(self.placed_added),
                "placed_removed": list(self.placed_removed),
                "profiles_changed": list(self.profiles_changed),
                "replicas_changed": {k: list(v) for k, v in self.replicas_changed.items()},
                "autoscale_changed": list(self.autoscale_changed),
            },
            "needs_restart": list(self.needs_restart),
        }


def plan_reload(old: Config, new: Config, *, plane: bool | None = None) -> ReloadPlan:
    """What reloading `new` over `old` applies, and what only a restart would. `plane`:
    whether this process runs a control plane (None: whether `old` has profiled models;
    one that started keeps running when a reload removes every profiled model)."""
    old_keys, new_keys = old.auth.keys, new.auth.keys
    old_tenant, new_tenant = old.auth.tenant_of, new.auth.tenant_of
    old_tenants, new_tenants = old.tenants.by_name, new.tenants.by_name
    old_static, new_static = _static(old.catalog), _static(new.catalog)
    old_profiled, new_profiled = _profiled(old.catalog), _profiled(new.catalog)
    restart = [*_differing_fields(old, new)]
    rolled = []
    replicas = {}
    autoscaled = []
    added, removed = [], []
    handed = _handed(old, new, plane)
    for name in sorted(set(old_profiled) | set(new_profiled)):
        was, now = old_profiled.get(name), new_profiled.get(name)
        if was == now:
            continue
        if name not in handed:
            restart.append(f"models.{name} (profile)")
        elif was is None:
            added.append(name)
        elif now is None:
            removed.append(name)
        else:
            if was.profile != now.profile:
                rolled.append(name)
            if was.replicas != now.replicas:
                replicas[name] = (was.replicas, now.replicas)
            if was.autoscale != now.autoscale:
                autoscaled.append(name)
    return ReloadPlan(
        keys_added=len(new_keys.keys() - old_keys.keys()),
        keys_removed=len(old_keys.keys() - new_keys.keys()),
        keys_changed=sum(
            1
            for k in old_keys.keys() & new_keys.keys()
            if old_keys[k] != new_keys[k] or old_tenant[k] != new_tenant[k]
        ),
        metrics_token_changed=old.server.metrics_token_digest != new.server.metrics_token_digest,
        models_added={
            name: entry.endpoints
            for name, entry in new_static.items()
            if name not in old_static and name not in old_profiled
        },
        models_changed={
            name: entry.endpoints
            for name, entry in new_static.items()
            if name in old_static and old_static[name].endpoints != entry.endpoints
        },
        # A static model that turns into a profiled one is a restart's business.
        models_removed=tuple(
            name for name in old_static if name not in new_static and name not in new_profiled
        ),
        placed_added=tuple(added),
        placed_removed=tuple(removed),
        profiles_changed=tuple(rolled),
        replicas_changed=replicas,
        autoscale_changed=tuple(autoscaled),
        tenants_changed=tuple(
            sorted(
                name
                for name in old_tenants.keys() | new_tenants.keys()
                if old_tenants.get(name) != new_tenants.get(name)
            )
        ),
        needs_restart=tuple(restart),
    )


def reloaded_config(old: Config, new: Config, *, plane: bool | None = None) -> Config:
    """`old` with what a reload applies taken from `new`: the config that serves after it.

    Models come in the new file's order: its static ones, and its profiled ones where a
    control plane runs (added, changed; a removed one is gone). What a reload does not
    apply stays as it was, after them: every profiled model where no control plane runs,
    and a name that changed between static and profiled, until a restart.
    """
    old_profiled, new_profiled = _profiled(old.catalog), _profiled(new.catalog)
    handed = _handed(old, new, plane)
    models = [
        e
        for e in new.catalog.models
        if (e.profile is None and e.name not in old_profiled) or e.name in handed
    ]
    models += [
        e
        for e in old.catalog.models
        if e.name not in handed and (e.profile is not None or e.name in new_profiled)
    ]
    server = attrs.evolve(old.server, metrics_token_digest=new.server.metrics_token_digest)
    catalog = Catalog(models=tuple(models))
    return attrs.evolve(old, server=server, auth=new.auth, tenants=new.tenants, catalog=catalog)


def _handed(old: Config, new: Config, plane: bool | None) -> set[str]:
    """The profiled models a reload hands to the running control plane, where one runs:
    every name profiled in either file, but one that is static in the other (it turns
    from static to profiled or back: a restart's business)."""
    if not (old.runs_control_plane if plane is None else plane):
        return set()
    old_static, new_static = _static(old.catalog), _static(new.catalog)
    return {m for m in _profiled(old.catalog) if m not in new_static} | {
        m for m in _profiled(new.catalog) if m not in old_static
    }


def _static(catalog: Catalog) -> dict[str, ModelEntry]:
    return {m.name: m for m in catalog.models if m.profile is None}


def _profiled(catalog: Catalog) -> dict[str, ModelEntry]:
    return {m.name: m for m in catalog.models if m.profile is not None}


def _differing_fields(old: Config, new: Config) -> list[str]:
    """`section.field` for every field a reload does not apply that differs."""
    found = []
    for section in _SECTIONS:
        a, b = getattr(old, section), getattr(new, section)
        if a == b:
            continue
        if not attrs.has(type(a)) or type(a) is not type(b):
            found.append(section)
            continue
        for field in attrs.fields(type(a)):
            if section == "server" and field.name in _SERVER_RELOADED:
                continue
            if getattr(a, field.name) != getattr(b, field.name):
                found.append(f"{section}.{field.name}")
    return found


Apply = Callable[[Config, ReloadPlan], Awaitable[None]]


class Reloader:
    """Reads the config file again and hands the result to `apply`; one reload at a time.

    `config` is what serves now; after a reload, the config `reloaded_config` made.
    """

    def __init__(self, config: Config, apply: Apply) -> None:
        self.config = config
        self.apply = apply
        # A control plane starts with profiled models, and runs on when a reload removes
        # them all: one added again later is its business, not a restart's.
        self.plane = config.runs_control_plane
        self._lock = trio.Lock()

    async def reload(self) -> ReloadPlan:
        """Raises ConfigError (and changes nothing) when the file does not validate."""
        async with self._lock:
            try:
                new = load_config(
                    self.config.file,
                    models_required=self.config.models_required,
                    policies=self.config.policies,  # as it was read first
                )
            except ConfigError as exc:
                log.error("reload refused, the running config stays: %s", exc)
                raise
            plan = plan_reload(self.config, new, plane=self.plane)
            effective = reloaded_config(self.config, new, plane=self.plane)
            await self.apply(effective, plan)
            self.config = effective
            log.info("reloaded %s: %s", self.config.file, plan.summary())
            if plan.needs_restart:
                log.warning(
                    "reload: these changes take effect only after a restart: %s",
                    ", ".join(plan.needs_restart),
                )
            return plan


def with_control_plane(apply: Apply, set_catalog: Callable[[Catalog], None]) -> Apply:
    """`apply`, then the reloaded catalog to this process's control plane when a profiled
    model was added or removed, or a profile, a replicas count or an [models.autoscale]
    changed (it places the added, drains the removed and rolls the changed profiles)."""

    async def both(config: Config, plan: ReloadPlan) -> None:
        await apply(config, plan)
        if plan.control_plane_changes:
            set_catalog(config.catalog)

    return both


async def reload_on_sighup(
    reloader: Reloader, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Reload on every SIGHUP until cancelled; a refused file is logged by `reload`."""
    with trio.open_signal_receiver(signal.SIGHUP) as signals:
        task_status.started()
        async for _ in signals:
            log.info("received SIGHUP: reloading %s", reloader.config.file)
            try:
                await reloader.reload()
            except ConfigError:
                pass
