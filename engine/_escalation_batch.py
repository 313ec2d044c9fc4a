"""Driving many escalations at once from one task: the escalations that start in one scheduler pass
(``kill_all``, ``cancel_scope``, a supervisor's exit) form a *batch*.

One task of the batch, the *driver*, advances every member's steps (``_escalation``) in tight loops, and
waits for all of them at once: on one private epoll instance that holds every live leader's pidfd (one
``epoll_ctl`` per tree instead of a Trio wait, a cancel scope and a task wake-up), until the earliest
deadline, or until a force request pokes it. Its other tasks sleep until their own escalation is over,
or, detached (the supervisor's runs), return as soon as they have joined.

Three things cut what a batch of 1000 costs beyond its ``killpg`` (or ``cgroup.kill``) and reaps:

- the first step of every member (a look, SIGINT, SIGCONT) is taken in one loop before the runs' tasks
  even wake up (``Supervisor.begin_cancel``, in ``kill_all``); each grace period ends at its own
  deadline (its SIGINT plus the grace: the first SIGKILLs go out while the last SIGINTs' graces run
  on, instead of all waiting for the last), and the driver aims SIGKILL at every member due in its pass
  (in chunks, the reaping of the trees already gone in between); each later wait is measured from the
  end of the chunk that asked for it. During the grace each member makes ahead what its looks after it
  need (:meth:`~._escalation_driver.LeaderTarget.prepare`: descriptors on the leader's files);
- a wait ends late by at most :data:`COALESCE_SECONDS`, so deadlines a few microseconds apart expire
  in one pass;
- the members whose leaders exited together are settled together: each notes that nothing it knew of
  is alive (:meth:`~._escalation_driver.LeaderTarget.mark_quiet`), then one read of the engine's children
  list serves all of their final looks (see ``_escalation_driver.children_read_since``).

The SIGKILLs a pass aims are sent in the pass itself (a ``killpg`` or a ``pidfd_send_signal`` costs the
loop a few microseconds). An empty leaf is not removed in the pass: its ``rmdir`` (and the kernel's work
of freeing the cgroup that follows) would take the cores from the killed processes' exits and from the
driver; the supervisor's housekeeping removes the leaves once the runs' waiters have gone on
(``Supervisor._housekeep``). Detached members (``_escalation_detached``) are ended by the driver in its
pass.

A member whose leader is reaped while the rest of its tree lives (a straggler outside the group, a leaf
not yet empty) has no pidfd left to wait on: it is handed back to its own task, which waits on it alone
as before (``_escalation_driver.drive_escalation`` with the target's ``wait_change``); a detached member
gets a new task for that (``Detached.resume``). When the driver's own escalation is over, the driver
role passes to a member still waiting with a task of its own; while detached members wait, the driver
goes on driving. An escalation alone in its pass (``kill_pid``, one ``cancel``) makes no batch: it waits
on its own leader's pidfd through Trio.
"""

from __future__ import annotations

import heapq
import os
import resource
from functools import partial
from typing import TYPE_CHECKING, Final

import attrs
import trio

from ._escalation import Escalation, Phase, Steps, WaitGone, advance
from ._escalation_detached import Detached, reraise
from ._pidfd_set import PidfdSet
from ._procfs import engine_children, sharing_children_reads

if TYPE_CHECKING:
    from ._escalation_driver import LeaderTarget

__all__ = ["COALESCE_SECONDS", "drive_in_batch"]

#: A wait of the batch ends up to this much after its deadline, never before it: deadlines a few
#: microseconds apart then expire in one pass of the driver.
COALESCE_SECONDS: Final = 0.001

#: The batch that escalations starting in this scheduler pass join, if one is forming.
_FORMING: trio.lowlevel.RunVar[_Batch | None] = trio.lowlevel.RunVar("_FORMING", default=None)

#: The members make ahead what their looks need (:meth:`_Batch._prepare`) only while the earliest deadline
#: is at least this far: some 10-20 us a member, 1000 of them.
_PREPARE_MARGIN_SECONDS: Final = 0.01

#: The most descriptors one member's :meth:`~._escalation_driver.LeaderTarget.prepare` opens.
_PREPARE_DESCRIPTORS: Final = 2
#: Descriptors :meth:`_Batch._prepare` leaves free for everything else the engine opens meanwhile (the
#: guardian's journal, logs, the next creates).
_DESCRIPTORS_KEPT_FREE: Final = 512


def _spare_descriptors() -> int:
    """How many descriptors the process may open beyond those it has now and :data:`_DESCRIPTORS_KEPT_FREE`:
    the members' descriptors made ahead never take the last ones (a ``RLIMIT_NOFILE`` of 1024 is common)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1 << 30
    try:
        used = len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0
    return max(soft - used - _DESCRIPTORS_KEPT_FREE, 0)


#: How many members a pass answers before it looks for leaders that exited meanwhile (:meth:`_Batch._pass`).
_PASS_CHUNK: Final = 128


@attrs.define(eq=False)
class _Member:
    """One escalation of a batch."""

    target: LeaderTarget
    steps: Steps
    #: the wait the steps asked for last
    request: WaitGone
    deadline: float
    #: the pidfd registered in the batch's epoll, or -1
    fd: int = -1
    result: Escalation | None = None
    error: BaseException | None = None
    #: handed back to its own task (its leader is reaped, the rest of its tree not gone)
    alone: bool = False
    #: this member's task is to drive the batch
    drives: bool = False
    turn: trio.Event = attrs.field(factory=trio.Event)
    #: ended by the driver instead of its task (:class:`Detached`), or ``None``
    detach: Detached | None = None

    @property
    def over(self) -> bool:
        return self.result is not None or self.error is not None


@attrs.define(eq=False)
class _Batch:
    members: list[_Member] = attrs.field(factory=list)
    #: the live leaders' pidfds, waited on at once
    _leaders: PidfdSet[_Member] = attrs.field(factory=PidfdSet)
    _deadlines: list[tuple[float, int, _Member]] = attrs.field(factory=list)
    _seq: int = 0
    _due: list[_Member] = attrs.field(factory=list)
    _wake: trio.CancelScope | None = None
    _started: bool = False

    # ---- the wait set ------------------------------------------------------------------------------

    def _watch(self, member: _Member) -> None:
        fd = member.target.pidfd
        if fd >= 0 and member.fd < 0:
            self._leaders.add(fd, member)
            member.fd = fd

    def _unwatch(self, member: _Member) -> None:
        fd, member.fd = member.fd, -1
        if fd >= 0:
            self._leaders.discard(fd, member, still_open=member.target.pidfd == fd)

    def _poke(self, member: _Member) -> None:
        """Force was requested for ``member``: the driver looks at it now."""
        self._due.append(member)
        if self._wake is not None:
            self._wake.cancel()

    # ---- one pass ----------------------------------------------------------------------------------

    def _exited(self) -> list[_Member]:
        """The members whose leader exited (their pidfd readable), taken out of the wait set."""
        exited: list[_Member] = []
        for fd, member in self._leaders.ready():
            if member.fd == fd:
                # Level-triggered: an exited leader stays readable. Reaped now, its pidfd is closed, and
                # closing takes it out of the epoll (no ``epoll_ctl``, some 7 us each).
                member.target.poll_leader()
                self._unwatch(member)
                exited.append(member)
        return exited

    def _ready(self) -> list[_Member]:
        """The members the driver must look at now: leaders exited, deadlines passed, forced."""
        due, self._due = self._due, []
        due += self._exited()
        now = trio.current_time()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, member = heapq.heappop(self._deadlines)
            due.append(member)
        return due

    def _step(self, member: _Member, gone: bool) -> bool:
        """Advance ``member``; ``True`` when it asked for a new wait (its deadline to be set)."""
        try:
            answer = advance(member.steps, gone)
        except BaseException as exc:  # never leave the other members waiting on a driver that died
            member.error = exc
            self._unwatch(member)
            self._settled(member)
            return False
        if isinstance(answer, Escalation):
            member.result = answer
            self._unwatch(member)
            self._settled(member)
            return False
        member.request = answer
        self._watch(member)
        return True

    def _settled(self, member: _Member) -> None:
        """``member``'s escalation is over, or it is handed back: tell its task, or end it here when it
        has none (:class:`Detached`)."""
        detach = member.detach
        if detach is None:
            member.turn.set()
            return
        member.target.notify_force(None)  # its own task (resume) or nobody looks at it from now on
        member.target.set_batched(False)
        try:
            if member.error is not None:
                detach.done(member.error)
                detach.spawn(partial(reraise, member.error))
            elif member.result is not None:
                detach.done(member.result)
            else:
                detach.resume(member.request.phase, member.deadline)
        except Exception as exc:  # raised by a task, as the member's own would have: the pass goes on
            detach.spawn(partial(reraise, exc))

    def _schedule(self, member: _Member) -> None:
        self._seq += 1
        heapq.heappush(self._deadlines, (member.deadline, self._seq, member))

    def _pass(self) -> None:
        """Answer every member whose wait is over, and set the deadlines of the waits they ask for next.

        Many due at once (the grace periods of a ``kill_all`` end within a few milliseconds: the one loop
        that sent their SIGINTs) are answered in chunks of
        :data:`_PASS_CHUNK`, and before each chunk the members whose leaders exited meanwhile: the reaping
        of the first trees killed overlaps the exits of the next ones (on the other core) instead of
        waiting for the last SIGKILL of the pass, while the killed processes' exits are what the machine
        is busy with anyway.
        """
        if not self._started:
            self._started = True
            for member in self.members:
                self._schedule(member)
            self._answer(list(self.members))
            self._prepare()
            return
        due = self._ready()
        while due:
            chunk, due = due[:_PASS_CHUNK], due[_PASS_CHUNK:]
            self._answer(chunk)
            if due:
                due = self._exited() + due

    def _prepare(self) -> None:
        """In the first pass, once every member waits: have each member waiting in its grace period make
        ahead what its looks after the grace need (:meth:`~._escalation_driver.LeaderTarget.prepare`), while
        the earliest deadline is more than :data:`_PREPARE_MARGIN_SECONDS` away. The pass at the end of the
        grace, which aims SIGKILL at every member, then looks at each for less."""
        waiting = [m for m in self.members if not (m.over or m.alone) and m.request.phase is Phase.GRACE]
        del waiting[_spare_descriptors() // _PREPARE_DESCRIPTORS :]
        for i, member in enumerate(waiting):
            if i % _PASS_CHUNK == 0 and self._deadline_near():
                return
            member.target.prepare()

    def _deadline_near(self) -> bool:
        """Whether the earliest deadline is within :data:`_PREPARE_MARGIN_SECONDS`."""
        if not self._deadlines:
            return False
        return trio.current_time() + _PREPARE_MARGIN_SECONDS >= self._deadlines[0][0]

    def _answer(self, due: list[_Member]) -> None:
        """Answer the members of ``due``, and set the deadlines of the waits they ask for next, measured
        from the end of this answer."""
        todo: list[_Member] = []
        seen: set[int] = set()
        for member in due:
            if not (member.over or member.alone or id(member) in seen):
                seen.add(id(member))
                todo.append(member)
        # One look at each leader for the whole pass (hold_leader_look), not one per check below.
        for member in todo:
            member.target.hold_leader_look()
        try:
            asked = self._answer_held(todo)
        finally:
            for member in todo:
                member.target.drop_leader_look()
        end = trio.current_time()
        for member in asked:
            member.deadline = end + member.request.seconds
            if member.fd < 0:  # no leader to wait on (it exited before): the tree is waited on alone
                member.alone = True
                self._settled(member)
                continue
            self._schedule(member)

    def _answer_held(self, todo: list[_Member]) -> list[_Member]:
        """The looks and steps of :meth:`_answer`, each leader's look held: the members that asked for a
        new wait."""
        # Settle together: mark those with nothing known alive, then one read of the engine's children
        # made after every mark serves their final looks.
        marked = [m for m in todo if m.target.mark_quiet()]
        if marked:
            engine_children()
        asked: list[_Member] = []
        now = trio.current_time()
        for member in todo:
            request = member.request
            if member.target.gone():
                gone = True
            elif (request.phase is Phase.GRACE and member.target.force) or now >= member.deadline:
                gone = False
            elif member.target.pidfd < 0:  # the leader is reaped, the rest of the tree is not gone
                member.alone = True
                self._unwatch(member)
                self._settled(member)
                continue
            else:
                self._watch(member)  # not yet: keep waiting
                continue
            if self._step(member, gone):
                asked.append(member)
        return asked

    async def _wait(self) -> None:
        """Until the earliest deadline (plus :data:`COALESCE_SECONDS`), a leader's exit, or a poke."""
        while self._deadlines and (self._deadlines[0][2].over or self._deadlines[0][2].alone):
            heapq.heappop(self._deadlines)
        at = self._deadlines[0][0] + COALESCE_SECONDS if self._deadlines else float("inf")
        if self._due:
            at = -float("inf")
        with trio.move_on_at(at) as self._wake:
            await self._leaders.wait()
        self._wake = None

    def _waiting(self) -> list[_Member]:
        return [m for m in self.members if not m.over and not m.alone]

    async def drive(self, me: _Member) -> None:
        """Drive the batch until ``me`` is over or handed back and no member left waiting is detached
        (:class:`Detached`: it has no task to drive); then pass the role on.

        Cancellation: callers run this inside a shielded cancel scope.
        """
        try:
            while True:
                with sharing_children_reads():
                    self._pass()
                if (me.over or me.alone) and not any(m.detach is not None for m in self._waiting()):
                    return
                await self._wait()
        finally:
            me.drives = False
            rest = self._waiting()
            with_task = [m for m in rest if m.detach is None]
            if with_task:
                with_task[0].drives = True
                with_task[0].turn.set()
            elif rest:  # left only by an error of the driver's own: a new task drives the detached
                heir = rest[0]
                assert heir.detach is not None
                heir.drives = True
                heir.detach.spawn(partial(self.drive, heir))
            else:
                self._close()

    def _close(self) -> None:
        for member in self.members:
            member.target.notify_force(None)
            member.target.set_batched(False)
        self._leaders.close()


async def drive_in_batch(
    target: LeaderTarget, steps: Steps, first: WaitGone, at: float, *, detach: Detached | None = None
) -> Escalation | tuple[Phase, float] | None:
    """Run ``steps`` on ``target`` in the batch of this scheduler pass (see the module), from the wait
    ``first`` that their first step, taken at ``at`` (Trio clock), asked for.

    With ``detach``, the member is ended by the driver (:class:`Detached`) once it is in a batch of more
    than one: a member that does not drive returns ``None`` as soon as it has joined, and the driver once
    no detached member is left waiting.

    Cancellation: callers run this inside a shielded cancel scope.

    Returns:
        The escalation's end; or, when it was handed back in the middle of a wait, that wait's phase
        and deadline (on the Trio clock): the caller finishes the wait and the steps alone (see
        :func:`~._escalation_driver.drive_escalation`); ``None`` when ``detach`` ends it.
    """
    batch = _FORMING.get()
    me = _Member(target=target, steps=steps, request=first, deadline=at + first.seconds)
    if batch is None:
        batch = _Batch()
        _FORMING.set(batch)
        me.drives = True
        batch.members.append(me)
        target.notify_force(lambda: batch._poke(me))
        target.set_batched(True)
        try:
            await trio.lowlevel.cancel_shielded_checkpoint()  # the escalations of this pass join
        finally:
            if _FORMING.get() is batch:
                _FORMING.set(None)
        if len(batch.members) == 1:  # alone in its pass: the one-tree wait costs less than a batch's
            target.notify_force(None)
            target.set_batched(False)
            return first.phase, me.deadline
        me.detach = detach
    else:
        me.detach = detach
        batch.members.append(me)
        target.notify_force(lambda: batch._poke(me))
        target.set_batched(True)
        if detach is not None:
            return None  # the driver ends it (Detached); it forgets the target's hooks then (_close)
    if me.detach is not None:  # the first member: it drives, and the driver ends it with the others
        await batch.drive(me)
        return None
    while not (me.over or me.alone):
        if me.drives:
            await batch.drive(me)
        else:
            await me.turn.wait()
            me.turn = trio.Event()
    target.notify_force(None)
    target.set_batched(False)
    if me.error is not None:
        raise me.error
    if me.result is not None:
        return me.result
    return me.request.phase, me.deadline
