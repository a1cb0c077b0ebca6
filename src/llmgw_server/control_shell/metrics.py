"""The control plane's metrics, served as `GET /metrics` on the control port in the
Prometheus text format (with the router's helpers).

Counters are kept by the shell, where the events happen: the agent streams count
frames, the control plane counts engine failures and restarts and times its steps.
Gauges (nodes, replicas, what cannot be placed, streams open) are read from the
reconciler's view when the page is asked for, so the pure core counts nothing.

A model's unplaced replicas are counted under every reason that kept a node from
taking one (as Kubernetes counts unschedulable pods under each plugin that
rejected them), so the reasons of one model need not add up to its count.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Final, Literal, assert_never, get_args

from llmgw_core.prometheus import Histogram, family
from llmgw_core.prometheus import labels as _labels
from llmgw_server.control.fit import MisfitKind
from llmgw_server.control.lifecycle import NodeStatus
from llmgw_server.control.shards import Phase
from llmgw_server.control.views import ControlView, Unplaced

# Why a node could not take a replica: the explanation's reasons, as a bounded label set.
PlacementReason = Literal[
    "lost",
    "unreachable",
    "cordoned",
    "draining",
    "engine",
    "node_selector",
    "gpu_model",
    "free_gpus",
    "gpu_memory",
    "no_fabric_label",
    "fabric_domain",
    "waiting",  # deferred: the settle time after a start
    "no_nodes",  # no node has registered
    "other",  # placeable now, yet short (a roll holds its next replacement back)
]
PLACEMENT_REASONS: Final[tuple[PlacementReason, ...]] = get_args(PlacementReason)

# Why the control plane refused or closed an agent stream: a bounded label set.
StreamRefusal = Literal[
    "no_certificate",  # a stream without a client certificate on a TLS control port
    "identity",  # registered under a name its certificate does not carry
    "denied",  # its certificate is on the deny list
    "protocol",  # no registration in time, a bad frame, a message out of order...
    "flood",  # more messages than the budget allows
    "replaced",  # the node connected again, and this stream did not answer a ping
    "duplicate",  # a second agent for a node whose stream answers (a cloned machine?)
    "silent",  # declared unreachable or lost
    "backlog",  # too many messages waited unread
]
STREAM_REFUSALS: Final[tuple[StreamRefusal, ...]] = get_args(StreamRefusal)

_CAMEL = re.compile(r"(?<!^)(?=[A-Z])")


def message_type(message: object) -> str:
    """A wire message's type as the protocol spells it (`ShardUpdate` -> shard_update)."""
    return _CAMEL.sub("_", type(message).__name__).lower()


def placement_reason(reason: MisfitKind) -> PlacementReason:
    """The label a node's reason for being passed over is counted under."""
    match reason:
        case "lost" | "unreachable" | "cordoned" | "draining" | "engine" | "gpu_model":
            return reason
        case "selector":
            return "node_selector"
        case "few":
            return "free_gpus"
        case "memory":
            return "gpu_memory"
        case "no_fabric":
            return "no_fabric_label"
        case "domain":
            return "fabric_domain"
        case _:
            assert_never(reason)


def placement_reasons(unplaced: Unplaced) -> set[PlacementReason]:
    """Every reason that keeps a replica of this model from being placed now."""
    if unplaced.waiting is not None:
        return {"waiting"}
    explanation = unplaced.explanation
    if not explanation.passed_over and not explanation.fitting:
        return {"no_nodes"}
    reasons = {placement_reason(why.reason) for why in explanation.passed_over.values()}
    return reasons or {"other"}


class ControlMetrics:
    def __init__(self) -> None:
        self.frames: defaultdict[tuple[Literal["in", "out"], str], int] = defaultdict(int)
        self.engine_failures: defaultdict[str, int] = defaultdict(int)  # by model
        self.replica_restarts: defaultdict[str, int] = defaultdict(int)  # by model
        self.streams_refused: defaultdict[StreamRefusal, int] = defaultdict(int)
        self.reconcile = Histogram()
        self.stalled_s = 0.0  # this process's loop stalls, not counted as nodes' silence

    def frame_in(self, message: object) -> None:
        self.frames[("in", message_type(message))] += 1

    def frame_out(self, message: object) -> None:
        self.frames[("out", message_type(message))] += 1

    def bad_frame(self) -> None:
        self.frames[("in", "invalid")] += 1

    def render(self, view: ControlView, streams_open: int) -> bytes:
        out: list[str] = []

        out += family(
            "llmgw_control_nodes", "gauge", "Nodes known to the control plane, by status."
        )
        for status in NodeStatus:
            n = sum(node.status is status for node in view.nodes)
            out.append(f"llmgw_control_nodes{_labels(status=str(status))} {n}")
        out += family("llmgw_control_nodes_cordoned", "gauge", "Nodes cordoned by the operator.")
        out.append(f"llmgw_control_nodes_cordoned {sum(n.cordoned for n in view.nodes)}")
        out += family("llmgw_control_nodes_draining", "gauge", "Nodes being drained.")
        out.append(f"llmgw_control_nodes_draining {sum(n.draining for n in view.nodes)}")

        out += family(
            "llmgw_control_replicas",
            "gauge",
            "Replicas by model and phase (live: pending, starting or ready; failed: "
            "waiting to restart; retiring; broken).",
        )
        models = sorted({m.name for m in view.models} | {r.model for r in view.replicas})
        for model in models:
            for phase in Phase:
                n = sum(r.model == model and r.phase is phase for r in view.replicas)
                out.append(f"llmgw_control_replicas{_labels(model=model, phase=str(phase))} {n}")
        out += family(
            "llmgw_control_replicas_serving", "gauge", "Replicas the router sends requests."
        )
        for model in models:
            n = sum(r.model == model and r.serving for r in view.replicas)
            out.append(f"llmgw_control_replicas_serving{_labels(model=model)} {n}")
        out += family("llmgw_control_replicas_desired", "gauge", "Replicas each model asks for.")
        for m in sorted(view.models, key=lambda m: m.name):
            out.append(f"llmgw_control_replicas_desired{_labels(model=m.name)} {m.desired}")
        out += family(
            "llmgw_control_crash_loops", "gauge", "Replicas in a crash loop (restarting again)."
        )
        for model in models:
            n = sum(r.model == model and r.crash_loop for r in view.replicas)
            out.append(f"llmgw_control_crash_loops{_labels(model=model)} {n}")

        out += family(
            "llmgw_control_unplaced_replicas",
            "gauge",
            "Replicas wanted but not placed, under each reason that kept a node from taking "
            "one (a model's reasons need not add up).",
        )
        for model, unplaced in sorted(view.unplaced.items()):
            for reason in sorted(placement_reasons(unplaced)):
                labels = _labels(model=model, reason=reason)
                out.append(f"llmgw_control_unplaced_replicas{labels} {unplaced.count}")

        out += family("llmgw_control_guard_holds", "gauge", "1 while the mass-loss guard holds.")
        out.append(f"llmgw_control_guard_holds {int(view.guard is not None)}")

        out += family(
            "llmgw_control_reconcile_seconds",
            "histogram",
            "Time the control plane's steps that ran a reconcile took.",
        )
        out.extend(self.reconcile.render("llmgw_control_reconcile_seconds", ""))
        out += family(
            "llmgw_control_stalled_seconds_total",
            "counter",
            "Time the control plane's own loop stalled, not counted as its nodes' silence.",
        )
        out.append(f"llmgw_control_stalled_seconds_total {self.stalled_s:.3f}")

        out += family("llmgw_agent_streams_open", "gauge", "Agent streams registered and open.")
        out.append(f"llmgw_agent_streams_open {streams_open}")
        out += family(
            "llmgw_agent_frames_total",
            "counter",
            "Agent stream messages received (in, invalid ones included) and queued to send "
            "(out), by type.",
        )
        for (direction, kind), n in sorted(self.frames.items()):
            out.append(f"llmgw_agent_frames_total{_labels(direction=direction, type=kind)} {n}")
        out += family(
            "llmgw_agent_streams_refused_total",
            "counter",
            "Agent streams closed or refused by the control plane, by reason.",
        )
        for refusal, n in sorted(self.streams_refused.items()):
            out.append(f"llmgw_agent_streams_refused_total{_labels(reason=refusal)} {n}")

        out += family(
            "llmgw_engine_failures_total", "counter", "Engines (shards) agents reported failed."
        )
        for model, n in sorted(self.engine_failures.items()):
            out.append(f"llmgw_engine_failures_total{_labels(model=model)} {n}")
        out += family(
            "llmgw_replica_restarts_total",
            "counter",
            "Failed replicas started again (whole, after the backoff).",
        )
        for model, n in sorted(self.replica_restarts.items()):
            out.append(f"llmgw_replica_restarts_total{_labels(model=model)} {n}")
        return ("\n".join(out) + "\n").encode()
