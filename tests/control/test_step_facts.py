"""Each step carries the facts the shell acts on, where they change (issue 37): the shell
reads nothing back after a step, so a fact a step leaves out is one it gets wrong.
`fleetsim.Shell` keeps what the steps say and checks it after every step against the
core's queries; the control machine's random histories run with it, and these are the
cases its settings do not reach (a reconcile batched, a shard that no record names)."""

from __future__ import annotations

from fleetsim import Fleet, Shell, catalog, gpu_node, model

from llmgw_core.catalog import LoraAdapter
from llmgw_core.control_config import ControlSection
from llmgw_core.inventory import ShardState

BATCHED = ControlSection(settle_after_start_s=0.0, reconcile_interval_s=10.0)


def shell_fleet(fleet: Fleet) -> Fleet:
    fleet.shell = Shell()
    fleet.join(gpu_node("n1", 2), gpu_node("n2", 2))
    fleet.ready_all()
    return fleet


def test_a_catalog_reloaded_between_reconciles_carries_its_routes_at_once() -> None:
    """A reload within reconcile_interval_s of the last reconcile waits for the batch, but
    its adapters and the models the table names are the new catalog's from that step on."""
    f = shell_fleet(Fleet(BATCHED, catalog(model("a"))))
    f.advance(20)  # the batch reconciled, then nothing for reconcile_interval_s
    f.set_catalog(catalog(model("a")))
    assert f.last_step.reconciled  # the interval since the last reconcile passed
    lora = (LoraAdapter("b-sql", "/lora/sql"),)
    step = f.set_catalog(catalog(model("a"), model("b", lora=lora)))
    assert not step.reconciled and step.routes is not None
    assert step.routes.adapters == {"b-sql": "b"}
    assert set(step.routes.serving) == {"a", "b"}
    f.advance(10)
    assert f.starts()[-1].spec.model_name == "b"


def test_the_tail_of_a_shard_no_record_names_goes_at_the_next_reconcile() -> None:
    """A failure reported of a shard the control plane has no record of: the shell keeps
    its tail until the next reconcile says the replica is not known, as it did when it
    asked the core after each reconcile."""
    f = shell_fleet(Fleet(BATCHED, catalog(model("a"))))
    assert f.shell is not None
    f.advance(20)
    f.shell.failed(f.cp, "x-1")
    step = f.feed(f.cp.shard_status("n1", "x-1", 0, ShardState.FAILED, f.now, "exit 1"))
    assert not step.reconciled and f.shell.tails == {"x-1"}
    step = f.set_catalog(catalog(model("a")))
    assert step.reconciled and step.forgotten == {"x-1"}
    assert f.shell.tails == set()
