"""The escalation core on its own: the steps, the deadlines and the report, over an in-memory target.

The target is a fake at the edge (no processes): members that end on SIGINT, on SIGKILL or never, and
members that appear only once the target looks again (a child forked while handling SIGINT). The
driver here answers each request from a fake clock, as the real drivers do from theirs.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence

import attrs
from hypothesis import given
from hypothesis import strategies as st

from engine._escalation import Escalation, Phase, WaitGone, advance, escalate

GRACE = 5.0
KILL_WAIT = 5.0

#: How a member reacts: ends on SIGINT, ends on SIGKILL only, never ends.
Behaviour = str


@attrs.define
class FakeTarget:
    """Members by pid; ``hidden`` members appear at the next fresh look after SIGINT was sent."""

    members: dict[int, Behaviour]
    hidden: dict[int, Behaviour] = attrs.field(factory=dict)
    sent: list[int] = attrs.field(factory=list)
    looks: list[bool] = attrs.field(factory=list)

    def snapshot(self, *, fresh: bool) -> None:
        self.looks.append(fresh)
        if fresh and signal.SIGINT in self.sent:
            self.members.update(self.hidden)
            self.hidden.clear()

    def send(self, sig: int) -> None:
        self.sent.append(sig)
        ends = {signal.SIGINT: ("int",), signal.SIGKILL: ("int", "kill")}.get(signal.Signals(sig), ())
        self.members = {pid: how for pid, how in self.members.items() if how not in ends}

    def kill(self) -> None:
        self.send(signal.SIGKILL)

    def gone(self) -> bool:
        return not self.members

    def remaining(self) -> Sequence[int]:
        return sorted(self.members)


@attrs.define
class Run:
    result: Escalation
    requests: list[WaitGone]
    elapsed: float


def drive(target: FakeTarget, *, force: bool = False) -> Run:
    """Answer every request at once when the target is gone, else after its full time."""
    clock = [0.0]
    steps = escalate(
        target, grace_seconds=GRACE, kill_wait_seconds=KILL_WAIT, force=force, now=lambda: clock[0]
    )
    requests = []
    answer = advance(steps, None)
    while isinstance(answer, WaitGone):
        requests.append(answer)
        if not target.gone():
            clock[0] += answer.seconds
        answer = advance(steps, target.gone())
    return Run(answer, requests, clock[0])


def test_escalate_cooperative_tree_ends_on_sigint_without_sigkill() -> None:
    target = FakeTarget({10: "int", 11: "int"})
    run = drive(target)
    assert run.result == Escalation(escalated=False, survivors=())
    assert target.sent == [signal.SIGINT, signal.SIGCONT]
    assert run.requests == [WaitGone(Phase.GRACE, GRACE)]
    assert target.looks == [False, True]  # the first look may be shared; the deciding one is fresh


def test_escalate_sigint_ignored_kills_after_the_full_grace() -> None:
    target = FakeTarget({10: "int", 11: "kill"})
    run = drive(target)
    assert run.result == Escalation(escalated=True, survivors=())
    assert target.sent == [signal.SIGINT, signal.SIGCONT, signal.SIGKILL]
    assert run.requests == [WaitGone(Phase.GRACE, GRACE), WaitGone(Phase.KILL, KILL_WAIT)]
    assert run.elapsed == GRACE


def test_escalate_reports_survivors_within_both_budgets() -> None:
    target = FakeTarget({10: "never", 11: "kill"})
    run = drive(target)
    assert run.result == Escalation(escalated=True, survivors=(10,))
    assert run.elapsed == GRACE + KILL_WAIT


def test_escalate_force_skips_sigint_and_the_grace() -> None:
    target = FakeTarget({10: "int"})
    run = drive(target, force=True)
    assert run.result == Escalation(escalated=True, survivors=())
    assert target.sent == [signal.SIGKILL]
    assert [r.phase for r in run.requests] == [Phase.KILL]


def test_escalate_signals_what_a_fresh_look_finds_within_the_same_grace() -> None:
    target = FakeTarget({10: "int"}, hidden={20: "int"})
    clock = [0.0]
    steps = escalate(
        target, grace_seconds=GRACE, kill_wait_seconds=KILL_WAIT, force=False, now=lambda: clock[0]
    )
    assert advance(steps, None) == WaitGone(Phase.GRACE, GRACE)
    clock[0] = 1.5
    # The cheap check said gone; the fresh look finds the child forked meanwhile and signals it.
    again = advance(steps, True)
    assert again == WaitGone(Phase.GRACE, GRACE - 1.5)
    assert target.sent == [signal.SIGINT, signal.SIGCONT, signal.SIGINT]
    assert advance(steps, True) == Escalation(escalated=False, survivors=())


def test_escalate_driver_giving_up_early_goes_straight_to_sigkill() -> None:
    target = FakeTarget({10: "kill"})
    steps = escalate(target, grace_seconds=GRACE, kill_wait_seconds=KILL_WAIT, force=False, now=lambda: 0.0)
    first = advance(steps, None)
    assert isinstance(first, WaitGone) and first.phase is Phase.GRACE
    assert advance(steps, False) == WaitGone(Phase.KILL, KILL_WAIT)  # force, seen by the driver
    assert target.sent[-1] == signal.SIGKILL


def test_escalate_past_deadline_asks_for_zero_seconds() -> None:
    target = FakeTarget({10: "int"}, hidden={20: "kill"})
    clock = [0.0]
    steps = escalate(target, grace_seconds=1.0, kill_wait_seconds=1.0, force=False, now=lambda: clock[0])
    advance(steps, None)
    clock[0] = 3.0  # the look took longer than the grace
    assert advance(steps, True) == WaitGone(Phase.GRACE, 0.0)


@given(
    members=st.lists(st.sampled_from(["int", "kill", "never"]), max_size=6),
    hidden=st.lists(st.sampled_from(["int", "kill", "never"]), max_size=3),
    force=st.booleans(),
)
def test_escalate_invariants(members: list[Behaviour], hidden: list[Behaviour], force: bool) -> None:
    target = FakeTarget(dict(enumerate(members, start=100)), hidden=dict(enumerate(hidden, start=200)))
    everyone = {**target.members, **target.hidden}
    run = drive(target, force=force)
    assert run.elapsed <= GRACE + KILL_WAIT
    assert all(r.seconds >= 0 for r in run.requests)
    assert (signal.SIGINT in target.sent) is (not force)
    if force:
        assert run.result.escalated is bool(members)
    else:  # SIGKILL exactly when something outlived SIGINT
        assert run.result.escalated is any(how != "int" for how in everyone.values())
    if signal.SIGKILL in target.sent:
        assert run.result.escalated
        assert target.sent.index(signal.SIGKILL) > (-1 if force else target.sent.index(signal.SIGINT))
    # Whatever never ends is reported, and only that; nothing that ends is left.
    expected = tuple(
        sorted(
            pid
            for pid, how in everyone.items()
            if how == "never" and (pid < 200 or not force)  # hidden ones appear only after SIGINT
        )
    )
    assert run.result.survivors == expected
