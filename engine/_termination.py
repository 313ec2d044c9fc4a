"""Ending a run's whole process tree: group signalling, reaping, and the escalation's driving (the look
at which processes are the run's is ``_tree_walk``'s).

A run is its leader (the child we spawned, leader of a new session and process group), every other
member of that group, and the *escapees*: descendants that left the group (``setsid``) and are found by
walking ``/proc`` parent links and, for orphans re-parented to the engine, by the run marker in their
environment. :class:`ProcessTree` is that tree as an escalation target (``_escalation``), and
``_escalation_driver.drive_escalation`` runs the escalation on it under Trio, as trio's ``run_process``
does for a single child with ``deliver_cancel`` but on the whole tree (trio signals only the leader and
stops as soon as it exits).
"""

from __future__ import annotations

import errno
import functools
import os
import signal
import time
from collections.abc import Callable
from collections.abc import Set as AbstractSet

import attrs
import trio

from ._escalation import Escalation, Steps, WaitGone, advance, escalate
from ._escalation_detached import Spawn
from ._escalation_driver import LeaderTarget, children_read_since, drive_escalation, wait_gone
from ._pidfd import close_pidfd, wait_pidfd
from ._procfs import (
    children_by_fds,
    children_of,
    engine_children,
    open_children_of,
    read_marker,
    read_proc,
    scan_processes,
)
from ._tree_walk import TreeWalk

# LeaderTarget, children_read_since, drive_escalation and wait_gone are named here too, where they were
# defined before the driver had a module of its own.
__all__ = ["LeaderTarget", "ProcessTree", "children_read_since", "drive_escalation", "wait_gone"]


@attrs.define(eq=False)
class ProcessTree(TreeWalk):
    """The processes one run owns, and the means to end them all.

    It is the escalation target of a run (:class:`LeaderTarget`): :meth:`snapshot`, :meth:`send`,
    :meth:`kill`, :meth:`gone` and :meth:`remaining` over the group and its escapees, woken by the
    leader's pidfd; :meth:`terminate` runs the escalation on it.

    Attributes:
        pid: the leader's pid (also the process group id).
        pidfd: the leader's pidfd, or -1 once the leader is reaped.
        start_time: the leader's start time in clock ticks (``/proc/<pid>/stat`` field 22).
        marker: the value of the run marker in this run's environment.
        subreaper: whether the engine is a child subreaper (orphans come to us).
        status: the leader's wait status once reaped, else ``None``.
        tracked: every descendant seen so far, group members included, ``{pid: start_time}``: a member
            that calls ``setsid`` after it was seen is still ours (and is signalled by pid).
        force: set to skip the rest of the grace period and send SIGKILL now.
        quiet_at: a ``time.monotonic`` instant at which nothing the tree was known to hold was alive
            (leader reaped, group empty, every tracked process gone), else ``None``; a look that finds
            a new member clears it.
    """

    pid: int
    pidfd: int
    start_time: int
    marker: str
    subreaper: bool
    known_leaders: AbstractSet[int]
    status: int | None = None
    tracked: dict[int, int] = attrs.field(factory=dict)
    force: bool = False
    quiet_at: float | None = attrs.field(init=False, default=None)
    _wake: trio.CancelScope | None = attrs.field(init=False, default=None)
    _poke: Callable[[], None] | None = attrs.field(init=False, default=None)
    #: escalated in a batch (:meth:`set_batched`)
    _batched: bool = attrs.field(init=False, default=False)
    #: the group was seen empty after the leader's reaping: it stays so (nothing can join a group with
    #: no member), and its id, the leader's pid, may name a stranger's group from then on
    _group_empty: bool = attrs.field(init=False, default=False)
    #: tasks waiting on the pidfd through Trio now (:meth:`close`)
    _pidfd_waits: int = attrs.field(init=False, default=0)
    #: the escalation once :meth:`begin` took its first step: the steps, their first answer, and when
    _begun: tuple[Steps, WaitGone | Escalation, float] | None = attrs.field(init=False, default=None)
    #: descriptors on the leader's ``/proc`` task folder and children list (:meth:`prepare`), or ``None``
    _leader_fds: tuple[int, int] | None = attrs.field(init=False, default=None)
    #: the leader was seen alive by :meth:`hold_leader_look` and is taken as alive until
    #: :meth:`drop_leader_look` (one pass of the batch driver)
    _alive_held: bool = attrs.field(init=False, default=False)

    # ---- the leader ------------------------------------------------------------------------------

    def poll_leader(self) -> bool:
        """Reap the leader if it has exited; ``True`` once it is reaped (``False`` with no look while a
        look is held: :meth:`hold_leader_look`)."""
        if self.status is not None:
            return True
        if self._alive_held:
            return False
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:  # someone else reaped it (a host calling waitpid(-1)): exit unknown
            pid, status = self.pid, 255 << 8
        if pid == 0:
            return False
        self.status = status
        self._close_leader()
        return True

    def hold_leader_look(self) -> None:
        """Look at the leader once (:meth:`poll_leader`) and, when it lives, take it as alive in every look
        until :meth:`drop_leader_look`, with no ``waitpid`` each: the batch driver's pass looks at a member
        up to three times (the quiet mark, the gone check, the escalation's own before SIGKILL), 3000
        ``waitpid`` calls at the end of a ``kill_all``'s grace period. A leader that exits meanwhile is
        seen by the next pass (its pidfd turns readable), as if it had exited just after the look."""
        self._alive_held = not self.poll_leader()

    def drop_leader_look(self) -> None:
        """End :meth:`hold_leader_look`: the next look at the leader is a ``waitpid`` again."""
        self._alive_held = False

    async def wait_leader(self) -> None:
        """Block until the leader has exited, then reap it (its pidfd turns readable on exit).

        Cancellation: safe; the leader stays unreaped and can be waited for again.
        """
        while not self.poll_leader():
            await self._wait_pidfd()

    async def _wait_pidfd(self) -> None:
        """Wait for the leader's pidfd to turn readable, counted (:meth:`close` wakes only a wait)."""
        self._pidfd_waits += 1
        try:
            await wait_pidfd(self.pidfd)
        finally:
            self._pidfd_waits -= 1

    def close(self) -> None:
        """Close the pidfd, and every descriptor the tree holds (idempotent): the run is over."""
        self._close_leader()

    def _close_leader(self) -> None:
        """Close the pidfd and :meth:`prepare`'s descriptors (the leader is reaped). Trio is told first only
        while a task of this tree waits on the pidfd: a pidfd waited on by a batch's own epoll only
        (``_escalation_batch``) leaves that set by closing, and Trio's ``notify_closing`` of 1000 pidfds
        nobody waits on costs the loop some 5-10 ms."""
        if self.pidfd >= 0:
            fd, self.pidfd = self.pidfd, -1
            if self._pidfd_waits:
                close_pidfd(fd)
            else:
                os.close(fd)
        if self._leader_fds is not None:
            fds, self._leader_fds = self._leader_fds, None
            for fd in fds:
                os.close(fd)

    def prepare(self) -> None:
        """Open the leader's ``/proc`` task folder and children list now (the grace period), so that the look
        at its children before its SIGKILL is a ``fstat`` and a ``pread`` (:meth:`_children`): in a
        ``kill_all`` that look is made for 1000 leaders at the end of the grace period. Nothing when the
        leader is reaped, or the files cannot be opened (the look reads by path then)."""
        if self._leader_fds is None and self.pidfd >= 0 and self.status is None:
            self._leader_fds = open_children_of(self.pid)

    def _children(self, pid: int) -> list[int] | None:
        """The children of ``pid`` (see ``_procfs.children_of``); the leader's through :meth:`prepare`'s
        descriptors when it made them (they stand for the leader itself, whatever its pid names later)."""
        fds = self._leader_fds
        if pid == self.pid and fds is not None:
            kids = children_by_fds(*fds)
            if kids is not None:
                return kids
        return children_of(pid)

    # ---- the rest of the tree --------------------------------------------------------------------

    def request_force(self) -> None:
        """Skip the rest of the grace period: the escalation kills at once (a wait on the leader is
        woken)."""
        self.force = True
        if self._wake is not None:
            self._wake.cancel()
        if self._poke is not None:
            self._poke()

    def notify_force(self, wake: Callable[[], None] | None) -> None:
        """Have ``wake`` called at :meth:`request_force` (the batch driver's poke), or no more."""
        self._poke = wake

    def set_batched(self, batched: bool) -> None:
        """Whether a batch driver escalates the tree now (a process tree does nothing else for it)."""
        self._batched = batched

    async def _wait_leader_or_force(self) -> None:
        """Wait for the leader's exit (its pidfd) or :meth:`request_force`, with no time step: while the
        leader lives the tree cannot be gone, so looking again would find nothing new (1000 escalations
        each looking every 20 ms through a grace period cost the loop tens of thousands of wake-ups)."""
        try:
            with trio.CancelScope() as self._wake:
                await self._wait_pidfd()
        finally:
            self._wake = None

    async def wait_change(self, step_seconds: float) -> None:
        """Wait for the leader's exit or force; once the leader is reaped, wait ``step_seconds``: the
        rest of a process tree gives no event to wait on, so an escalation looks again after each step
        (at most 20 ms)."""
        if self.pidfd >= 0:
            await self._wait_leader_or_force()
        else:
            await trio.sleep(step_seconds)
        await self.quiet_read()

    async def quiet_read(self) -> None:
        """When nothing known of the tree is alive, set :attr:`quiet_at` and wait for a read of the
        engine's children made since, shared with the trees that got there in the same pass: the fresh
        look that then decides the tree is gone (see :meth:`_adopted`), or :meth:`leftovers`, uses it.

        Cancellation: safe; the read is made all the same.
        """
        if self.mark_quiet():
            assert self.quiet_at is not None
            await children_read_since(self.quiet_at)

    def mark_quiet(self) -> bool:
        """Whether nothing known of the tree is alive (leader reaped, group empty, every tracked process
        gone); if so, :attr:`quiet_at` is set (kept if it was) and a read of the engine's children made
        since serves the fresh look (see :meth:`_adopted`). Always ``False`` without the subreaper."""
        if not self.subreaper or not self.poll_leader() or self.remaining():
            return False
        if self.quiet_at is None:
            self.quiet_at = time.monotonic()
        return True

    def leftovers(self) -> bool:
        """After the leader exited: whether anything of the tree may be left.

        On the way it reaps the zombies the leader's exit handed to the engine (see
        :meth:`_reap_orphan_zombie`).
        """
        group = self._group_exists()
        strays = False
        # A read since quiet_at (quiet_read: one for the trees whose leaders exited together) is as good
        # as a fresh one, as for the look that decides the tree is gone (see _adopted).
        quiet = self.quiet_at
        children = engine_children(read_since=quiet) if quiet is not None else engine_children()
        for pid in self._not_leaders(children):
            info = read_proc(pid)
            if info is None or not self._ours(info):
                continue
            if info.zombie:
                self._reap_orphan_zombie(info)
            elif not strays and (info.pgid == self.pid or read_marker(pid) == self.marker):
                strays = True
        return group or bool(self.tracked) or strays

    def send(self, sig: int) -> None:
        """Send ``sig`` to the group, and by pid to every tracked process that is no longer in the group
        (start time checked); a member gets it once, through the group."""
        self._send_group(sig)
        self._send_tracked(sig)

    def _send_group(self, sig: int) -> None:
        if self._group_empty:
            return
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def _group_exists(self) -> bool:
        """Whether a process is in the group (a zombie counts); once the leader is reaped and the group
        seen empty, it is not looked at again (:attr:`_group_empty`)."""
        if self._group_empty:
            return False
        try:
            os.killpg(self.pid, 0)
        except ProcessLookupError:
            self._group_empty = self.status is not None
            return False
        except OSError as exc:
            return exc.errno == errno.EPERM
        return True

    def _send_tracked(self, sig: int) -> None:
        for pid, start in list(self.tracked.items()):
            info = read_proc(pid)
            if info is None or info.start_time != start:
                del self.tracked[pid]
                continue
            if info.pgid == self.pid:
                continue
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                del self.tracked[pid]

    def remaining(self) -> list[int]:
        """Pids of the tree still alive (zombies are reaped when they are ours, and count as gone)."""
        alive: set[int] = set()
        if not self.poll_leader():
            alive.add(self.pid)
        if self._group_exists():
            for info in scan_processes():
                if info.pgid == self.pid and info.pid != self.pid and self._ours(info):
                    if info.zombie:
                        self._reap_adopted(info)
                    else:
                        alive.add(info.pid)
        for pid, start in list(self.tracked.items()):
            found = read_proc(pid)
            if found is None or found.start_time != start:
                del self.tracked[pid]
            elif found.zombie:
                self._reap_adopted(found)
                del self.tracked[pid]
            else:
                alive.add(pid)
        return sorted(alive)

    def kill(self) -> None:
        """SIGKILL the group and every tracked escapee."""
        self.send(signal.SIGKILL)

    def gone(self) -> bool:
        """Whether nothing of the tree is alive: :meth:`remaining` as a yes/no.

        While the leader lives the answer is no without a ``/proc`` scan (one scan costs about 10 us
        per process on the machine); the scan, with its reaping of adopted zombies, runs once the
        leader is gone.
        """
        if not self.poll_leader():
            return False
        return not self.remaining()

    @property
    def begun(self) -> bool:
        """Whether :meth:`begin` took the escalation's first step (the tree was signalled)."""
        return self._begun is not None

    def begin(self, *, grace_seconds: float, kill_wait_seconds: float) -> None:
        """Take the escalation's first step now (the look, SIGINT and SIGCONT; SIGKILL with force), in the
        caller's task; :meth:`terminate` goes on from there, its waits measured from now. Once only.

        ``kill_all`` signals every tree in one loop this way before the runs' tasks wake up to end them,
        so that their waking (and everything else a run's end costs before its escalation) overlaps the
        grace period instead of delaying SIGINT.
        """
        if self._begun is not None:
            return
        steps = escalate(
            self,
            grace_seconds=grace_seconds,
            kill_wait_seconds=kill_wait_seconds,
            force=self.force,
            now=trio.current_time,
        )
        first = advance(steps, None)
        self._begun = (steps, first, trio.current_time())

    async def terminate(
        self,
        *,
        grace_seconds: float,
        kill_wait_seconds: float,
        done: Callable[[tuple[bool, tuple[int, ...]] | BaseException], None] | None = None,
        spawn: Spawn | None = None,
    ) -> tuple[bool, tuple[int, ...]] | None:
        """Escalate SIGINT -> ``grace_seconds`` -> SIGKILL -> ``kill_wait_seconds`` over the whole tree.

        The steps are ``_escalation.escalate``'s; :func:`drive_escalation` waits. Once it is done the
        leader is reaped (it was sent SIGKILL if it was still alive), so it is never a survivor.

        With ``done`` and ``spawn``, an escalation driven in a batch with others is ended by the batch's
        driver (``_escalation_detached.Detached``): this call returns ``None`` at once (or once it has driven
        the batch), and ``done`` is called with what it would have returned, or with the error that ended
        it, from the driver's pass, or from a task ``spawn`` starts where something must still be waited
        for (the tree alone, or the final reap).

        Cancellation: callers run this inside a shielded cancel scope; it is bounded by the two durations
        plus the final reap of the leader after SIGKILL, which is not bounded.

        Returns:
            ``(escalated, survivors)``: whether SIGKILL was needed, and the pids still alive at the end;
            ``None`` when ``done`` is (or will be) called with them instead.
        """
        self.begin(grace_seconds=grace_seconds, kill_wait_seconds=kill_wait_seconds)
        assert self._begun is not None
        if done is None or spawn is None:
            escalation = await drive_escalation(self, *self._begun)
        else:
            escalation = await drive_escalation(
                self, *self._begun, done=functools.partial(self._ended, done, spawn), spawn=spawn
            )
        if escalation is None:
            return None
        if self.status is None:
            await self.wait_leader()  # the final reap after SIGKILL
        return self._outcome(escalation)

    def _outcome(self, escalation: Escalation) -> tuple[bool, tuple[int, ...]]:
        return escalation.escalated, tuple(pid for pid in escalation.survivors if pid != self.pid)

    def _ended(
        self,
        done: Callable[[tuple[bool, tuple[int, ...]] | BaseException], None],
        spawn: Spawn,
        end: Escalation | BaseException,
    ) -> None:
        """The end of a detached escalation (:meth:`terminate`): to ``done``, after the final reap."""
        if isinstance(end, BaseException) or self.status is not None:
            done(end if isinstance(end, BaseException) else self._outcome(end))
            return

        async def reap() -> None:
            try:
                await self.wait_leader()  # the final reap after SIGKILL
            except BaseException as exc:
                done(exc)
                raise
            done(self._outcome(end))

        spawn(reap)
