"""Status says how many requests the routers hold for each autoscaled model while no
replica serves it (issue 36): the admin API's document, the CLI's AUTOSCALING column and
the count summed over routers from their last load reports."""

from __future__ import annotations

from llmgw_core.autoscaling import RouterLoad, held_counts
from llmgw_server.admin_cli import _autoscaling
from llmgw_server.control.scaling import ScaleView
from llmgw_server.control.views import ControlView, ModelView
from llmgw_server.control_shell.admin import status_doc

WAKING = ScaleView(0, 3, "2 in flight a replica", "a request woke it: 3 request(s) held", "0 -> 1")


def test_held_requests_are_summed_over_routers_and_shown_by_status() -> None:
    loads = {"chat": [RouterLoad(held=2), RouterLoad(held=1, in_flight=4)], "calm": [RouterLoad()]}
    held = held_counts(loads)
    assert held == {"chat": 3, "calm": 0}
    view = ControlView(
        (), (), (ModelView("chat", 1, 1, WAKING), ModelView("fixed", 2, 2)), {}, None
    )
    doc = status_doc(view, {}, 0.0, held=held)
    chat, fixed = doc.models
    assert chat.autoscale is not None and chat.autoscale.held == 3
    assert fixed.autoscale is None
    assert _autoscaling(chat) == "0-3, target 2 in flight a replica; 3 requests held; last: 0 -> 1"
    # None held: nothing said of it (and a status made without the routers' counts).
    (quiet, _) = status_doc(view, {}, 0.0).models
    assert quiet.autoscale is not None and quiet.autoscale.held == 0
    assert _autoscaling(quiet) == "0-3, target 2 in flight a replica; last: 0 -> 1"
