"""The `[control]` section: the control plane's tunables.

Every field has a default that suits a fleet of real GPU nodes; tests shorten
the timers. The section is read only when a model declares a profile, but it is
validated whenever present so that a typo never waits for that day.
"""

from __future__ import annotations

import attrs

from llmgw_core.tomlshape import Table


@attrs.frozen
class ControlSection:
    # A node that has sent nothing for this long gets no new work...
    unreachable_after_s: float = 15.0
    # ...and after this long its replicas are placed elsewhere.
    lost_after_s: float = 120.0
    # When more than this share of the nodes turns unreachable within one
    # window, the control plane is probably the one cut off: nobody is declared
    # lost until the share falls again.
    mass_loss_share: float = 0.5
    mass_loss_window_s: float = 60.0
    # The node label that names a fabric domain; a multi-node replica stays inside one.
    fabric_key: str = "ib_domain"
    spread: bool = False  # place on the emptiest node instead of bin-packing
    # A failed replica restarts after base, doubling per consecutive failure, up to max.
    restart_backoff_s: float = 10.0
    restart_backoff_max_s: float = 300.0
    crash_loop_after: int = 3  # consecutive failures that mark a replica crash-looping
    # A draining replica is stopped when its in-flight requests finish or after this long.
    drain_timeout_s: float = 60.0
    # No new replica is placed this soon after the control plane starts, so that
    # agents reconnecting after a restart get their engines adopted, not duplicated.
    settle_after_start_s: float = 30.0
    # Events within this long of the last reconcile are batched into the next
    # one (at the Step's wake_at), so that a burst of events, such as a fleet
    # reconnecting at once, costs a few reconciles rather than one per node.
    # 0 reconciles on every event.
    reconcile_interval_s: float = 0.2
    # Ports the control plane assigns to engines (HTTP and rendezvous) on every node.
    engine_port_min: int = 20000
    engine_port_max: int = 20999


def read_control(t: Table) -> ControlSection:
    """Read the `[control]` table (pass `root.table("control")`); calls `t.finish()`."""
    d = ControlSection()
    unreachable = t.number("unreachable_after_s", d.unreachable_after_s, min=0.1)
    lost = t.number("lost_after_s", d.lost_after_s, min=0.1)
    if lost <= unreachable:
        t.fail(
            "lost_after_s",
            f"must be longer than unreachable_after_s ({unreachable:g}), not {lost:g}",
        )
    share = t.number("mass_loss_share", d.mass_loss_share, min=0.0)
    if not 0 < share <= 1:
        t.fail(
            "mass_loss_share",
            f"must be above 0 and at most 1 (1 turns the guard off), not {share:g}",
        )
    backoff = t.number("restart_backoff_s", d.restart_backoff_s, min=0.1)
    backoff_max = t.number("restart_backoff_max_s", d.restart_backoff_max_s, min=0.1)
    if backoff_max < backoff:
        t.fail(
            "restart_backoff_max_s",
            f"must be at least restart_backoff_s ({backoff:g}), not {backoff_max:g}",
        )
    port_min = t.integer("engine_port_min", d.engine_port_min, min=1024)
    port_max = t.integer("engine_port_max", d.engine_port_max, min=1024)
    if port_max > 65535:
        t.fail("engine_port_max", f"must be at most 65535, not {port_max}")
    if port_max - port_min < 63:
        t.fail(
            "engine_port_max",
            f"leaves too few ports above engine_port_min ({port_min}): give at least 64",
        )
    section = ControlSection(
        unreachable_after_s=unreachable,
        lost_after_s=lost,
        mass_loss_share=share,
        mass_loss_window_s=t.number("mass_loss_window_s", d.mass_loss_window_s, min=0.1),
        fabric_key=t.text("fabric_key", d.fabric_key),
        spread=t.boolean("spread", d.spread),
        restart_backoff_s=backoff,
        restart_backoff_max_s=backoff_max,
        crash_loop_after=t.integer("crash_loop_after", d.crash_loop_after, min=1),
        drain_timeout_s=t.number("drain_timeout_s", d.drain_timeout_s, min=0),
        settle_after_start_s=t.number("settle_after_start_s", d.settle_after_start_s, min=0),
        reconcile_interval_s=t.number("reconcile_interval_s", d.reconcile_interval_s, min=0),
        engine_port_min=port_min,
        engine_port_max=port_max,
    )
    t.finish()
    return section
