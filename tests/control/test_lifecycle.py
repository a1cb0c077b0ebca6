"""Node lifecycle: timeouts, the start-up guard and the mass-loss guard."""

from __future__ import annotations

from fleetsim import gpu_node
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from llmgw_core.control_config import ControlSection
from llmgw_server.control.lifecycle import Lifecycle, NodeStatus, NodeTransition

S = ControlSection()
R, U, L = NodeStatus.REACHABLE, NodeStatus.UNREACHABLE, NodeStatus.LOST


def statuses(lc: Lifecycle) -> dict[str, NodeStatus]:
    return {name: node.status for name, node in lc.nodes.items()}


def keep_beating(lc: Lifecycle, names: str, start: float, end: float) -> list[NodeTransition]:
    """`names` heartbeat every 5 s from `start` to `end`; returns what `advance` reported."""
    out: list[NodeTransition] = []
    t = start
    while t < end:
        t = min(end, t + 5)
        for name in names:
            lc.heartbeat(name, t)
        out += lc.advance(t)
    return out


def test_silence_leads_to_unreachable_then_lost() -> None:
    lc = Lifecycle(S, started_at=0)
    lc.register(gpu_node("a"), 200)
    lc.register(gpu_node("b"), 200)
    assert keep_beating(lc, "b", 200, 214.9) == []
    lc.heartbeat("b", 215)
    (t,) = lc.advance(215)
    assert t == NodeTransition("a", R, U, 215, "no heartbeat for 15 s")
    assert lc.nodes["a"].unreachable_since == 215
    assert keep_beating(lc, "b", 215, 319.9) == []
    lc.heartbeat("b", 320)
    (t,) = lc.advance(320)
    assert (t.node, t.old, t.new) == ("a", U, L)
    assert lc.next_deadline() == 320 + 15
    (t,) = lc.heartbeat("a", 400)
    assert (t.old, t.new, t.reason) == (L, R, "heartbeat")


def test_late_ticks_use_the_logical_time() -> None:
    lc = Lifecycle(S, started_at=0)
    lc.register(gpu_node("a"), 200)
    lc.register(gpu_node("b"), 200)
    lc.heartbeat("b", 260)
    lc.advance(261)
    assert lc.nodes["a"].unreachable_since == 215


def test_nothing_is_lost_before_lost_after_since_the_start() -> None:
    lc = Lifecycle(S, started_at=1000)
    for name in "abc":
        lc.register(gpu_node(name), 1000)
    keep_beating(lc, "bc", 1000, 1016)
    assert statuses(lc)["a"] is U
    assert keep_beating(lc, "bc", 1016, 1119.9) == []
    lc.heartbeat("b", 1120)
    lc.heartbeat("c", 1120)
    assert [t.new for t in lc.advance(1120)] == [L]


def test_a_closed_stream_makes_a_node_unreachable_at_once() -> None:
    lc = Lifecycle(S, started_at=0)
    lc.register(gpu_node("a"), 200)
    (t,) = lc.disconnected("a", 201)
    assert (t.old, t.new, t.reason) == (R, U, "stream closed")
    (t,) = lc.register(gpu_node("a"), 202)
    assert (t.old, t.new, t.reason) == (U, R, "registered again")


def test_mass_loss_holds_lost_until_the_share_falls() -> None:
    lc = Lifecycle(S, started_at=0)
    for name in "abcd":
        lc.register(gpu_node(name), 500)
    lc.heartbeat("d", 510)
    lc.advance(516)  # a, b, c turn unreachable at 515: 3 of 4
    assert lc.guard is not None and lc.guard.startswith(
        "3 of 4 nodes turned unreachable within 60 s"
    )
    for t in range(520, 900, 5):
        lc.heartbeat("d", t)
        assert all(x.new is not L for x in lc.advance(t))
    lc.heartbeat("a", 900)  # 2 of 4 unreachable: no longer more than half
    lost = lc.advance(900)
    assert lc.guard is None
    assert sorted((t.node, t.new) for t in lost) == [("b", L), ("c", L)]


def test_nodes_failing_one_by_one_are_not_a_mass_loss() -> None:
    lc = Lifecycle(S, started_at=0)
    for name in "abcd":
        lc.register(gpu_node(name), 500)
    silent: set[str] = set()
    for t in range(505, 1100, 5):
        if t in (600, 700, 800):
            silent.add("abc"[len(silent)])
        for name in "abcd":
            if name not in silent:
                lc.heartbeat(name, t)
        lc.advance(t)
        assert lc.guard is None
    assert statuses(lc) == {"a": L, "b": L, "c": L, "d": R}


# -- a machine against a reference model ----------------------------------------------

NAMES = ["n0", "n1", "n2", "n3", "n4", "n5"]
SETTINGS = ControlSection(unreachable_after_s=15, lost_after_s=60, mass_loss_window_s=30)


class LifecycleMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 1000.0
        self.lc = Lifecycle(SETTINGS, started_at=self.now)
        self.heard: dict[str, float] = {}  # the last heartbeat or registration
        self.closed: dict[str, float] = {}  # a stream that closed after it
        self.last: list[NodeTransition] = []
        self.advanced = False  # guards are judged by `advance`, so check them right after it

    @rule(name=st.sampled_from(NAMES))
    def register(self, name: str) -> None:
        self.advanced = False
        self.lc.register(gpu_node(name), self.now)
        self.heard[name] = self.now
        self.closed.pop(name, None)

    @precondition(lambda self: self.heard)
    @rule(data=st.data())
    def heartbeat(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(self.heard)))
        self.advanced = False
        self.lc.heartbeat(name, self.now)
        self.heard[name] = self.now
        self.closed.pop(name, None)

    @precondition(lambda self: self.heard)
    @rule(data=st.data())
    def disconnect(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(self.heard)))
        self.advanced = False
        if self.lc.nodes[name].status is R:
            self.closed[name] = self.now
        self.lc.disconnected(name, self.now)

    @rule(dt=st.sampled_from([1.0, 5.0, 14.0, 16.0, 31.0, 61.0]), beat=st.booleans())
    def advance(self, dt: float, beat: bool) -> None:
        self.now += dt
        if beat:  # the first half of the nodes keep beating
            for name in sorted(self.heard)[: len(self.heard) // 2]:
                self.register(name) if name in self.closed else self.heartbeat_one(name)
        self.last = self.lc.advance(self.now)
        self.advanced = True

    def heartbeat_one(self, name: str) -> None:
        self.lc.heartbeat(name, self.now)
        self.heard[name] = self.now

    @invariant()
    def statuses_follow_the_clock(self) -> None:
        s = SETTINGS
        lost_at = {t.node: t.at for t in self.last if t.new is L} if self.advanced else {}
        for name, node in self.lc.nodes.items():
            silent = self.now - self.heard[name]
            reachable = name not in self.closed and silent < s.unreachable_after_s
            assert (node.status is R) == reachable, (name, node.status, silent)
            if name in lost_at:
                assert silent >= s.lost_after_s
                assert lost_at[name] - self.lc.started_at >= s.lost_after_s

    @invariant()
    def guards_hold(self) -> None:
        if not self.advanced:
            return
        s = SETTINGS
        live = [n for n in self.lc.nodes.values() if n.status is not L]
        unreachable = [n for n in live if n.status is U]
        share = s.mass_loss_share * len(live)
        if self.lc.guard is not None:
            assert len(unreachable) > share
        since = {
            n.name: self.closed.get(n.name, self.heard[n.name] + s.unreachable_after_s)
            for n in unreachable
        }
        recent = [n for n in since.values() if n >= self.now - s.mass_loss_window_s]
        if len(recent) > share:
            assert self.lc.guard is not None
        # Whoever was just declared lost was declared so while the guard did not hold.
        just_lost = {t.node for t in self.last if t.new is L}
        if just_lost:
            before = [n for n in self.lc.nodes.values() if n in unreachable or n.name in just_lost]
            recent_before = [
                n
                for n in before
                if self.closed.get(n.name, self.heard[n.name] + s.unreachable_after_s)
                >= self.now - s.mass_loss_window_s
            ]
            assert len(recent_before) <= s.mass_loss_share * (len(live) + len(just_lost))
        # Eligible but not lost: only the guard may hold it back.
        for n in unreachable:
            if (
                self.now - self.heard[n.name] >= s.lost_after_s
                and self.now - self.lc.started_at >= s.lost_after_s
            ):
                assert self.lc.guard is not None, n.name


LifecycleMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
TestLifecycleMachine = LifecycleMachine.TestCase
