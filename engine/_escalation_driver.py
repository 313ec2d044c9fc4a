"""The Trio driver of an escalation: runs the sans-IO steps of ``_escalation`` on a target led by a
child of the engine (a run's :class:`~._termination.ProcessTree`, or its cgroup leaf), waiting on the
leader's pidfd and on the target's own wake-ups.

The escalations that start in one scheduler pass are driven together while their leaders live
(``_escalation_batch``); one alone, or one whose leader is reaped while the rest of its tree lives, is
driven here by its own task. The reads of the engine's children list that the trees settling together
need are shared (:func:`children_read_since`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import trio

from ._escalation import Escalation, EscalationTarget, Phase, Steps, WaitGone, advance
from ._escalation_batch import drive_in_batch
from ._escalation_detached import Detached, Spawn
from ._procfs import children_read_at, children_read_size, engine_children

__all__ = ["LeaderTarget", "children_read_since", "drive_escalation", "wait_gone"]

#: Polling steps inside an escalation: start fast (a cooperative child dies within a millisecond), back
#: off to the design's ceiling of 20 ms.
_FIRST_STEP_SECONDS = 0.0005
_MAX_STEP_SECONDS = 0.02
#: From this many children of the engine on, a read of their list is shared with the tasks of the same
#: scheduler pass (:func:`children_read_since`); a shorter list is read at once (the spawn-to-exit path).
_SHARE_READS_FROM = 64
#: The read of the engine's children that tasks wait for (:func:`children_read_since`), if one is due.
_DUE_READ: trio.lowlevel.RunVar[trio.Event | None] = trio.lowlevel.RunVar("_DUE_READ", default=None)


async def children_read_since(since: float) -> None:
    """Wait until the list of the engine's children that ``engine_children`` keeps was read at ``since``
    (``time.monotonic``) or later. The tasks that ask in one pass of the scheduler share one read, made
    at the next pass: with 1000 trees settling at once (``kill_all``) that is one read of a list of 1000
    children instead of 1000 (about 0.5 ms each). While the list is short (under 64 pids), and no read
    is due, it is read at once: a pass of the scheduler would cost more (a child's own exit).

    Cancellation: safe; the read that is due is made all the same, for the other tasks waiting on it.
    """
    if children_read_at() >= since:
        return
    due = _DUE_READ.get()
    if due is None and children_read_size() < _SHARE_READS_FROM:
        engine_children()  # a short list: reading it now costs less than a pass of the scheduler
        return
    if due is not None:  # asked for before this call and made after it: after ``since``
        await due.wait()
        return
    done = trio.Event()
    _DUE_READ.set(done)
    try:
        await trio.lowlevel.cancel_shielded_checkpoint()  # the other tasks of this pass join it
    finally:
        _DUE_READ.set(None)
        try:
            engine_children()
        finally:
            done.set()  # a read that failed (its error goes up here) leaves no task waiting for it


class LeaderTarget(EscalationTarget, Protocol):
    """An escalation target led by a child of the engine, which the Trio driver can wait on.

    Attributes:
        force: set (by another task, through ``request_force``) to cut the grace period short.
    """

    @property
    def force(self) -> bool: ...

    @property
    def pidfd(self) -> int:
        """The leader's pidfd, or -1 once the leader is reaped (it turns readable when the leader exits)."""
        ...

    def poll_leader(self) -> bool:
        """Reap the leader if it has exited (its pidfd is closed then); ``True`` once it is reaped."""
        ...

    def hold_leader_look(self) -> None:
        """Look at the leader once and, when it lives, answer every look with "alive" without looking
        until :meth:`drop_leader_look` (one pass of a batch driver)."""

    def drop_leader_look(self) -> None:
        """End :meth:`hold_leader_look`."""

    def notify_force(self, wake: Callable[[], None] | None) -> None:
        """Have ``wake`` called when force is requested (``None``: no more); a batch driver waits for it."""

    def set_batched(self, batched: bool) -> None:
        """Tell the target whether a batch driver escalates it now (a leaf then sends its first SIGKILL to
        the leader alone: ``LeafTree.kill``)."""

    def mark_quiet(self) -> bool:
        """Whether nothing the target is known to hold is alive (its leader reaped on the way); if so, the
        instant is noted, and a read of the engine's children made after it serves the look that decides
        the target is gone (one read for the targets that went quiet together)."""
        ...

    def prepare(self) -> None:
        """Make ahead, during a wait the batch driver has time for (the grace period), what lets the looks
        after it cost less (descriptors opened on the leader's files); the looks are the same without it."""

    async def wait_change(self, step_seconds: float) -> None:
        """Wait until the target may have changed: its leader exited, a member left, or force was asked;
        at most ``step_seconds`` where the target has no way to be told (a process group is polled)."""


async def drive_escalation(
    target: LeaderTarget,
    steps: Steps,
    first: WaitGone | Escalation,
    at: float,
    *,
    done: Callable[[Escalation | BaseException], None] | None = None,
    spawn: Spawn | None = None,
) -> Escalation | None:
    """Run the escalation ``steps`` on ``target`` under Trio.

    The escalations that start in one scheduler pass are driven together while their leaders live
    (``_escalation_batch``: one task, one epoll of pidfds, descriptors made ahead during the grace). An
    escalation whose leader is reaped while the rest of its tree lives goes on alone: each wait polls
    :meth:`~EscalationTarget.gone`, woken by the target (:meth:`LeaderTarget.wait_change`) in steps that
    start at 0.5 ms and double up to 20 ms; a grace wait ends early when :attr:`LeaderTarget.force` is
    set.

    Args:
        target: what the steps act on.
        steps: the escalation, its first step taken.
        first: what that step answered (a wait, or the end already).
        at: when it was taken (``trio.current_time``): the first wait is measured from then.
        done: with ``spawn``, lets the batch end the escalation without this task (see
            ``_escalation_detached.Detached``): it is called with the end (or the error that ended it) from
            the batch driver's pass, or from the task ``spawn`` starts to go on alone once handed back.
        spawn: starts a task (shielded) for what must still wait once the batch let go of the target.

    Cancellation: callers run this inside a shielded cancel scope; it is bounded by the waits the steps
    request.

    Returns:
        The end; ``None`` when ``done`` is (or will be) called with it instead.
    """
    if isinstance(first, Escalation):
        await trio.lowlevel.checkpoint()
        return first
    detach = None
    if done is not None and spawn is not None:
        end, start = done, spawn

        def resume(phase: Phase, deadline: float) -> None:
            async def alone() -> None:
                try:
                    result = await _finish_alone(target, steps, phase, deadline)
                except BaseException as exc:
                    end(exc)
                    raise
                end(result)

            start(alone)

        detach = Detached(done=end, resume=resume, spawn=start)
    handed = await drive_in_batch(target, steps, first, at, detach=detach)
    if handed is None or isinstance(handed, Escalation):
        return handed
    return await _finish_alone(target, steps, *handed)


async def _finish_alone(target: LeaderTarget, steps: Steps, phase: Phase, deadline: float) -> Escalation:
    """Go on with ``steps`` alone from a wait of ``phase`` that ends at ``deadline`` (Trio clock)."""
    gone = False
    with trio.move_on_at(deadline):
        gone = await _wait_gone(target, honour_force=phase is Phase.GRACE)
    answer = advance(steps, gone)
    while isinstance(answer, WaitGone):
        gone = False
        with trio.move_on_after(answer.seconds):
            gone = await _wait_gone(target, honour_force=answer.phase is Phase.GRACE)
        answer = advance(steps, gone)
    return answer


async def _wait_gone(target: LeaderTarget, *, honour_force: bool) -> bool:
    """Wait until the target is gone; ``False`` at once when ``honour_force`` and force is set.
    Callers bound it with ``trio.move_on_after``."""
    step = _FIRST_STEP_SECONDS
    while not target.gone():
        if honour_force and target.force:
            return False
        await target.wait_change(step)
        step = min(step * 2, _MAX_STEP_SECONDS)
    return True


async def wait_gone(target: LeaderTarget) -> None:
    """Wait until nothing of ``target`` is alive (the drain after a leader's own exit, see SP-03).

    Cancellation: safe; callers bound it with ``trio.move_on_after``.
    """
    await _wait_gone(target, honour_force=False)
