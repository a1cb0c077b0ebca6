"""Adoption's decision: a restarted agent adopts its engine, stops what is left of one, or
finds it gone, from the record and what /proc says, whatever the engine's command line."""

from __future__ import annotations

from llmgw_agent.adoption import Decision, Identity, ProcView, Verdict, decide

LAUNCH = "r-1.0.5f3a9c0d11e2b4a7"
RECORD = Identity(pid=4242, started=1000, launch_id=LAUNCH)
OLD_RECORD = Identity(pid=4242, started=1000, launch_id="")  # before launch ids


def proc(pid: int = 4242, started: int = 1000, pgid: int = 4242, marker: str | None = LAUNCH) -> ProcView:
    return ProcView(pid=pid, start_time=started, pgid=pgid, marker=marker)


def test_the_engine_is_adopted_by_pid_start_time_and_launch_marker() -> None:
    # Nothing about the command line: a console script, a shell or a binary alike.
    leader = proc()
    assert decide(RECORD, leader, [leader]) == Decision(Verdict.ADOPT)


def test_a_wrapper_that_forked_the_engine_is_adopted_through_the_wrapper() -> None:
    leader = proc()  # `sh wrapper.sh` waiting on its engine: the recorded PID, the marker
    engine = proc(pid=4250, started=1003)
    assert decide(RECORD, leader, [leader, engine]).verdict is Verdict.ADOPT


def test_an_unreadable_environment_falls_back_to_the_process_group() -> None:
    assert decide(RECORD, proc(marker=None), [proc(marker=None)]).verdict is Verdict.ADOPT
    # The same PID and start time but in another group: not the session the agent made.
    other = proc(pgid=1, marker=None)
    assert decide(RECORD, other, []).verdict is Verdict.GONE


def test_a_reused_pid_is_not_the_engine() -> None:
    newcomer = proc(started=5000, marker="")
    assert decide(RECORD, newcomer, [newcomer]) == Decision(Verdict.GONE)


def test_the_same_pid_and_start_time_without_the_marker_is_not_the_engine() -> None:
    # After a reboot a process may get the PID and start time again; it is left alone,
    # and so is its group.
    lookalike = proc(marker="")
    assert decide(RECORD, lookalike, [lookalike, proc(pid=4300, marker="")]) == Decision(Verdict.GONE)
    other_launch = proc(marker="r-1.0.0000000000000000")
    assert decide(RECORD, other_launch, [other_launch]).verdict is Verdict.GONE


def test_what_is_left_of_an_engine_whose_leader_ended_is_stopped() -> None:
    # The wrapper (the recorded PID) was killed; the engine it forked holds the GPU.
    engine = proc(pid=4250, started=1003)
    worker = proc(pid=4251, started=1010)
    stranger = proc(pid=4260, started=1020, marker="")  # in the group, not of the launch
    assert decide(RECORD, None, [worker, engine, stranger]) == Decision(Verdict.STOP, (4250, 4251))


def test_nothing_left_is_gone() -> None:
    assert decide(RECORD, None, []) == Decision(Verdict.GONE)
    # A process of the launch that left the group (setsid) is not the engine's group.
    assert decide(RECORD, None, [proc(pid=4250, pgid=4250)]) == Decision(Verdict.GONE)


def test_a_record_written_before_launch_ids_is_adopted_by_its_process_group() -> None:
    leader = proc(marker="")
    assert decide(OLD_RECORD, leader, [leader]).verdict is Verdict.ADOPT
    assert decide(OLD_RECORD, proc(pgid=7), []).verdict is Verdict.GONE  # not a session leader
    assert decide(OLD_RECORD, proc(started=5000), []).verdict is Verdict.GONE
    # Its leader gone, the members of its group are its own: the kernel gives the PID to
    # no new process while the group has one.
    orphan = proc(pid=4250, started=1003, marker="")
    assert decide(OLD_RECORD, None, [orphan]) == Decision(Verdict.STOP, (4250,))
    # A group led by a process that reused the PID is someone else's.
    assert decide(OLD_RECORD, proc(started=5000), [orphan]).verdict is Verdict.GONE
