"""A replica's failures in a row (status' FAILURES, the page's "N in a row") end when it
serves again: a recovered engine does not show its last crash forever (issue 36)."""

from __future__ import annotations

from fleetsim import Fleet, catalog, gpu_node, model

from llmgw_core.inventory import ShardState
from llmgw_server.control_shell.admin import status_doc


def test_a_replica_that_serves_again_has_no_failure_in_a_row() -> None:
    f = Fleet(cat=catalog(model("a", 1)))
    f.join(gpu_node("n1", 2))
    (start,) = f.starts()
    rid = start.spec.replica_id
    f.ready_all()
    f.report("n1", rid, 0, ShardState.FAILED, "exit status 1")
    assert f.cp.view().replicas[0].failures == 1
    while len(f.starts()) == 1:  # its restart, after the backoff
        f.advance(1)
    assert f.cp.view().replicas[0].failures == 1  # restarted, not serving yet
    f.ready_all()
    (r,) = f.cp.view().replicas
    assert r.serving and r.failures == 0
    (shown,) = status_doc(f.cp.view(), {}, f.now).replicas
    assert shown.failures == 0
    # A failure soon after is counted again: the restart pacing still sees a loop.
    f.report("n1", rid, 0, ShardState.FAILED, "exit status 1")
    assert f.cp.view().replicas[0].failures == 2
    assert f.notes[-1].endswith("exit status 1; restart in 20 s"), f.notes[-1]
