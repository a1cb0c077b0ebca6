"""The `[control]` section: the control plane's tunables.

Every field has a default that suits a fleet of real GPU nodes; tests shorten
the timers. The section is read only when a model declares a profile, but it is
validated whenever present so that a typo never waits for that day.
"""

from __future__ import annotations

import attrs

from llmgw_core.config_schema import Problem, read_table, rule_after, rules
from llmgw_core.store_config import StoreSection
from llmgw_core.tomlshape import Table


def _share(share: float) -> float:
    if not 0 < share <= 1:
        raise Problem(f"must be above 0 and at most 1 (1 turns the guard off), not {share:g}")
    return share


@attrs.frozen
class ControlSection:
    # A node that has sent nothing for this long gets no new work...
    unreachable_after_s: float = attrs.field(default=15.0, metadata=rules(min=0.1))
    # ...and after this long its replicas are placed elsewhere.
    lost_after_s: float = attrs.field(default=120.0, metadata=rules(min=0.1))
    # The fleet's heartbeats a second, at most: past unreachable_after_s / 3 s for each
    # node (5 s at most), a node registering is given a longer interval, and is
    # unreachable after three of them (control/heartbeat_pace.py).
    heartbeats_per_s: float = attrs.field(default=200.0, metadata=rules(min=1.0))
    # When more than this share of the nodes turns unreachable within one
    # window, the control plane is probably the one cut off: nobody is declared
    # lost until the share falls again.
    mass_loss_share: float = attrs.field(default=0.5, metadata=rules(min=0.0, check=_share))
    mass_loss_window_s: float = attrs.field(default=60.0, metadata=rules(min=0.1))
    # The node label that names a fabric domain; a multi-node replica stays inside one.
    fabric_key: str = "ib_domain"
    spread: bool = False  # place on the emptiest node instead of bin-packing
    # A failed replica restarts after base, doubling per consecutive failure, up to max.
    restart_backoff_s: float = attrs.field(default=10.0, metadata=rules(min=0.1))
    restart_backoff_max_s: float = attrs.field(default=300.0, metadata=rules(min=0.1))
    # Consecutive failures that mark a replica crash-looping.
    crash_loop_after: int = attrs.field(default=3, metadata=rules(min=1))
    # A draining replica is stopped when its in-flight requests finish or after this long.
    drain_timeout_s: float = attrs.field(default=60.0, metadata=rules(min=0))
    # No new replica is placed this soon after the control plane starts, so that
    # agents reconnecting after a restart get their engines adopted, not duplicated.
    settle_after_start_s: float = attrs.field(default=30.0, metadata=rules(min=0))
    # Events within this long of the last reconcile are batched into the next
    # one (at the Step's wake_at), so that a burst of events, such as a fleet
    # reconnecting at once, costs a few reconciles rather than one per node.
    # 0 reconciles on every event.
    reconcile_interval_s: float = attrs.field(default=0.2, metadata=rules(min=0))
    # How often autoscaled models ([models.autoscale]) are decided on the routers' loads
    # (which they report every 2 s); a request held for a model at zero replicas is
    # decided on at once.
    autoscale_interval_s: float = attrs.field(default=5.0, metadata=rules(min=0.1, max=300.0))
    # Ports the control plane assigns to engines (HTTP and rendezvous) on every node.
    engine_port_min: int = attrs.field(default=20000, metadata=rules(min=1024))
    engine_port_max: int = attrs.field(default=20999, metadata=rules(min=1024, max=65535))
    # The etcd cluster that keeps the control plane's state, for a leader and standbys
    # (store_config.py); None: this process is the one control plane.
    store: StoreSection | None = None


@rule_after(ControlSection)
def _control_rules(c: ControlSection) -> None:
    if c.lost_after_s <= c.unreachable_after_s:
        raise Problem(
            f"must be longer than unreachable_after_s ({c.unreachable_after_s:g}), "
            f"not {c.lost_after_s:g}",
            "lost_after_s",
        )
    if c.restart_backoff_max_s < c.restart_backoff_s:
        raise Problem(
            f"must be at least restart_backoff_s ({c.restart_backoff_s:g}), "
            f"not {c.restart_backoff_max_s:g}",
            "restart_backoff_max_s",
        )
    if c.engine_port_max - c.engine_port_min < 63:
        raise Problem(
            f"leaves too few ports above engine_port_min ({c.engine_port_min}): give at least 64",
            "engine_port_max",
        )


def read_control(t: Table) -> ControlSection:
    """Read the `[control]` table (pass `root.table("control")`); every key is read."""
    return read_table(t, ControlSection)
