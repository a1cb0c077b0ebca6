"""Node lifecycle: timeouts, the start-up guard and the mass-loss guard."""

from __future__ import annotations

from fleetsim import gpu_node
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hypothesis_profiles import profile_times
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
    assert lc.advance(900) == []  # b and c get lost_after (120 s) from the release
    assert lc.guard is None
    assert keep_beating(lc, "ad", 900, 1019.9) == []
    lc.heartbeat("a", 1020)
    lc.heartbeat("d", 1020)
    lost = lc.advance(1020)
    assert sorted((t.node, t.new) for t in lost) == [("b", L), ("c", L)]
    assert lost[0].reason == "no heartbeat for 520 s, 120 s since the mass-loss guard released"


def guarded_fleet() -> Lifecycle:
    """a, b, c of four go silent at 500; the guard holds until a is back at 900."""
    lc = Lifecycle(S, started_at=0)
    for name in "abcd":
        lc.register(gpu_node(name), 500)
    keep_beating(lc, "d", 500, 895)
    assert lc.guard is not None
    lc.heartbeat("a", 900)
    lc.heartbeat("d", 900)
    assert lc.advance(900) == []
    assert lc.guard is None
    return lc


def test_the_release_sets_the_next_deadline_to_lost_after_after_it() -> None:
    lc = guarded_fleet()
    assert lc.next_deadline() == 915  # a's and d's next heartbeats are due first
    lc.heartbeat("a", 1010)
    lc.heartbeat("d", 1010)
    assert lc.advance(1010) == []
    assert lc.next_deadline() == 900 + 120  # not 500 + 120: long past
    assert lc.nodes["b"].guard_released_at == 900


def test_stragglers_back_within_lost_after_of_the_release_are_never_lost() -> None:
    lc = guarded_fleet()
    assert keep_beating(lc, "ad", 900, 960) == []
    (t,) = lc.register(gpu_node("b"), 960)
    assert (t.old, t.new) == (U, R)
    assert keep_beating(lc, "abd", 960, 1019) == []
    (t,) = lc.register(gpu_node("c"), 1019)
    assert (t.old, t.new) == (U, R)
    assert keep_beating(lc, "abcd", 1019, 1300) == []
    assert set(statuses(lc).values()) == {R}


def test_the_grace_ends_with_the_silence_it_was_given_for() -> None:
    lc = guarded_fleet()
    keep_beating(lc, "ad", 900, 950)
    lc.register(gpu_node("b"), 950)  # b is back, then silent again from 950
    assert lc.nodes["b"].guard_released_at is None
    lost = keep_beating(lc, "ad", 950, 1100)
    assert [(t.node, t.at) for t in lost if t.new is L] == [("c", 1020), ("b", 1070)]
    assert lost[-1].reason == "no heartbeat for 120 s"


def test_a_guard_that_holds_again_gives_a_fresh_grace_at_its_next_release() -> None:
    lc = Lifecycle(S, started_at=0)
    for name in "abcde":
        lc.register(gpu_node(name), 500)
    keep_beating(lc, "de", 500, 895)  # a, b, c silent: 3 of 5
    assert lc.guard is not None
    lc.heartbeat("a", 900)
    assert lc.advance(900) == [] and lc.guard is None
    keep_beating(lc, "ade", 900, 1000)
    for name in "ade":  # the control plane is cut off again: 3 of 5 recent
        lc.disconnected(name, 1000)
    assert lc.advance(1000) == [] and lc.guard is not None
    assert lc.advance(1100) == []  # past 900 + 120, but the guard holds
    for name in "ade":
        lc.register(gpu_node(name), 1100)
    assert lc.advance(1100) == [] and lc.guard is None
    assert lc.next_deadline() == 1100 + 15
    assert keep_beating(lc, "ade", 1100, 1219) == []
    lost = keep_beating(lc, "ade", 1219, 1220)
    assert sorted((t.node, t.at) for t in lost) == [("b", 1220), ("c", 1220)]


def test_a_node_silent_only_after_the_release_gets_no_grace() -> None:
    lc = guarded_fleet()
    keep_beating(lc, "ad", 900, 950)
    # a falls silent after the release: lost_after after its last heartbeat, not later.
    lost = keep_beating(lc, "d", 950, 1075)
    assert [(t.node, t.at) for t in lost if t.new is L] == [("b", 1020), ("c", 1020), ("a", 1070)]


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
        # Unreachable when the mass-loss guard released, and silent since: when it released.
        self.released: dict[str, float] = {}
        self.last: list[NodeTransition] = []
        self.advanced = False  # guards are judged by `advance`, so check them right after it
        # What a node's paced heartbeat interval adds to both timeouts (heartbeat_pace).
        self.paced: dict[str, float] = {}

    @rule(name=st.sampled_from(NAMES), interval=st.sampled_from([None, 5.0, 7.0, 20.0, 50.0]))
    def register(self, name: str, interval: float | None = None) -> None:
        self.advanced = False
        self.lc.register(gpu_node(name), self.now, interval)
        self.paced[name] = 0.0 if interval is None else max(0.0, 3 * interval - 15)
        self.heard[name] = self.now
        self.closed.pop(name, None)
        self.released.pop(name, None)

    @precondition(lambda self: self.heard)
    @rule(data=st.data())
    def heartbeat(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(self.heard)))
        self.advanced = False
        self.lc.heartbeat(name, self.now)
        self.heard[name] = self.now
        self.closed.pop(name, None)
        self.released.pop(name, None)

    @precondition(lambda self: bool(set(self.heard) - set(self.closed)))
    @rule(data=st.data(), interval=st.sampled_from([5.0, 7.0, 20.0, 50.0]))
    def pace(self, data: st.DataObject, interval: float) -> None:
        # As the control port paces: on an open stream, right after its heartbeat.
        name = data.draw(st.sampled_from(sorted(set(self.heard) - set(self.closed))))
        self.advanced = False
        self.heartbeat_one(name)
        self.lc.pace(name, interval)
        self.paced[name] = max(0.0, 3 * interval - 15)

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
        held = self.lc.guard is not None
        self.last = self.lc.advance(self.now)
        self.advanced = True
        if held and self.lc.guard is None:
            just_lost = {t.node for t in self.last if t.new is L}
            for name, node in self.lc.nodes.items():
                if node.status is U or name in just_lost:
                    self.released[name] = self.now

    def heartbeat_one(self, name: str) -> None:
        self.lc.heartbeat(name, self.now)
        self.heard[name] = self.now
        self.released.pop(name, None)

    def lost_from(self, name: str) -> float:
        """When the model says an unreachable node may be declared lost, guard aside."""
        since = max(self.heard[name], self.lc.started_at, self.released.get(name, -1.0))
        return since + SETTINGS.lost_after_s + self.paced[name]

    @invariant()
    def statuses_follow_the_clock(self) -> None:
        s = SETTINGS
        lost_at = {t.node: t.at for t in self.last if t.new is L} if self.advanced else {}
        for name, node in self.lc.nodes.items():
            silent = self.now - self.heard[name]
            paced = self.paced[name]
            reachable = name not in self.closed and silent < s.unreachable_after_s + paced
            assert (node.status is R) == reachable, (name, node.status, silent)
            if name in lost_at:
                assert silent >= s.lost_after_s + paced
                assert lost_at[name] - self.lc.started_at >= s.lost_after_s + paced
                # The guard's release gave it a fresh grace.
                assert lost_at[name] >= self.released.get(name, 0) + s.lost_after_s + paced, name

    @invariant()
    def the_next_deadline_is_the_next_change(self) -> None:
        s = SETTINGS
        due = [
            self.heard[name] + s.unreachable_after_s + self.paced[name]
            for name, node in self.lc.nodes.items()
            if node.status is R
        ]
        if self.lc.guard is None:
            due += [self.lost_from(name) for name, n in self.lc.nodes.items() if n.status is U]
        assert self.lc.next_deadline() == min(due, default=None)

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
            if self.now >= self.lost_from(n.name):
                assert self.lc.guard is not None, n.name


LifecycleMachine.TestCase.settings = settings(
    max_examples=profile_times(1.5), stateful_step_count=40, deadline=None
)
TestLifecycleMachine = LifecycleMachine.TestCase
