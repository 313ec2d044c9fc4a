"""A run contained in a cgroup v2 leaf, as an escalation target.

The leaf holds the run's whole tree, whatever its processes did (``setsid``, a double fork, ``env -i``),
so there is nothing to look for: SIGINT and SIGCONT go to every pid of ``cgroup.procs``, SIGKILL is one
write to ``cgroup.kill``, and the tree is gone when ``cgroup.events`` says ``populated 0`` and the
zombies it handed to the engine (a subreaper) are reaped by their own pid: a zombie leaves
``cgroup.procs`` at once but keeps naming its cgroup until it is reaped. Waits are woken by inotify on
``cgroup.events`` (``_cgroup_watch``) and by the leader's pidfd, never by polling the leaf.
"""

from __future__ import annotations

import os
import signal
import time

import attrs

from ._cgroup import Leaf, populated_in
from ._cgroup_watch import LeafWatcher
from ._escalation_driver import children_read_since
from ._procfs import engine_children
from ._termination import ProcessTree

__all__ = ["LeafTree"]

#: A SIGCONT sent this soon after a signal that found the leader alone in its leaf goes to the leader
#: alone (:meth:`LeafTree.send`): the two are sent one after the other by the escalation's first step.
_SAME_STEP_SECONDS = 0.001

#: The last list of adopted children looked at by :func:`_exited_among`, and its exited pids.
_exited_memo: tuple[frozenset[int], tuple[int, ...]] = (frozenset(), ())


def _exited_among(adopted: frozenset[int]) -> tuple[int, ...]:
    """The pids of ``adopted`` (a list ``_not_leaders`` keeps) that have exited and are not reaped
    (``waitid`` with ``WNOWAIT``: nothing is reaped here), looked at once per list: 1000 leaves that
    emptied together share one list of adopted children."""
    global _exited_memo
    kept, exited = _exited_memo
    if kept is not adopted:
        found = []
        for pid in adopted:
            try:
                if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                    found.append(pid)
            except ChildProcessError:
                pass
        exited = tuple(found)
        _exited_memo = (adopted, exited)
    return exited


@attrs.define(eq=False)
class LeafTree(ProcessTree):
    """A run's leader and its cgroup leaf: the escalation target of a run in cgroup containment.

    The leader is handled as in :class:`ProcessTree` (its pidfd, its reaping); the rest is the leaf's.

    Attributes:
        leaf: the run's cgroup.
        watcher: the engine's inotify watcher of leaves.
    """

    leaf: Leaf = attrs.field(kw_only=True)
    watcher: LeafWatcher = attrs.field(kw_only=True)
    _seen: int = attrs.field(init=False, default=-1)
    _killed_once: bool = attrs.field(init=False, default=False)
    #: when :meth:`send` last found the leader alone in the leaf (``time.monotonic``), or -1
    _leader_alone_at: float = attrs.field(init=False, default=-1.0)
    #: the leaf as a whole got its ``cgroup.kill`` (not only the leader its SIGKILL)
    _rest_killed: bool = attrs.field(init=False, default=False)
    #: a descriptor on the leaf's ``cgroup.events`` (:meth:`prepare`), or -1
    _events_fd: int = attrs.field(init=False, default=-1)

    def prepare(self) -> None:
        """Open the leaf's ``cgroup.events`` now (the grace period): the look after the leader's SIGKILL
        that tells whether the leaf is empty is then one ``pread`` instead of an ``open``, a read and a
        ``close`` (some 15-20 us, 1000 of them in a ``kill_all``). Closed by :meth:`close`."""
        if self._events_fd < 0 and self.quiet_at is None:
            try:
                self._events_fd = os.open(self.leaf.events_path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                pass  # the leaf is read by path

    def close(self) -> None:
        """Close every descriptor the tree holds, :meth:`prepare`'s too (the run is over)."""
        super().close()
        self._close_events()

    def _close_events(self) -> None:
        if self._events_fd >= 0:
            fd, self._events_fd = self._events_fd, -1
            os.close(fd)

    def _populated(self) -> bool:
        """``Leaf.populated`` through :meth:`prepare`'s descriptor when there is one (the kernel makes the
        file afresh at each read from offset 0; a removed leaf's fails, and the path says "empty")."""
        if self._events_fd >= 0:
            try:
                return populated_in(os.pread(self._events_fd, 256, 0).decode("ascii", "replace"))
            except OSError:
                pass
        return self.leaf.populated()

    def snapshot(self, *, fresh: bool = True) -> None:
        """Nothing to look for: every descendant is in the leaf."""

    def send(self, sig: int) -> None:
        """Send ``sig`` to every process in the leaf (each pinned by a pidfd first: the leader's, while it
        is not reaped, is the run's own).

        A leaf found holding its leader alone gets the signal through the leader's pidfd; a SIGCONT right
        after (the escalation's first step sends SIGINT then SIGCONT, see ``_escalation``) goes to the
        same processes without a second read of ``cgroup.procs`` (some 8 us each, 1000 in a ``kill_all``).
        """
        if self.pidfd < 0:
            self.leaf.signal(sig)
            return
        at = time.monotonic()
        if sig != signal.SIGCONT or at - self._leader_alone_at > _SAME_STEP_SECONDS:
            if self.leaf.procs() != [self.pid]:
                self._leader_alone_at = -1.0
                self.leaf.signal(sig, pinned={self.pid: self.pidfd})
                return
            self._leader_alone_at = at
        try:
            signal.pidfd_send_signal(self.pidfd, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """SIGKILL the whole leaf at once through ``cgroup.kill`` (forks in flight included).

        In a batch (:meth:`set_batched`) the first kill goes to the leader alone, through its pidfd (a
        ``cgroup.kill`` write holds the cgroup mutex for some 40-70 us, and 1000 of them queue up with the
        leaves' removals behind the same mutex; reading ``cgroup.procs`` first costs as much again): a run
        is most often its leader alone. What else the leaf holds is killed by ``cgroup.kill`` as soon as
        the leader's exit is seen with the leaf still populated (:meth:`_kill_rest`), before the member
        waits for the leaf to empty.
        """
        if not self._batched or self._killed_once or self.pidfd < 0:
            self._killed_once = True
            self._rest_killed = True
            self.leaf.kill()
            return
        self._killed_once = True
        try:
            signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _kill_rest(self) -> None:
        """After a kill of the leader alone (:meth:`kill`): the leader is reaped and the leaf is still
        populated, so the rest of it gets its ``cgroup.kill`` now (once)."""
        if self._killed_once and not self._rest_killed:
            self._rest_killed = True
            self.leaf.kill()

    def request_force(self) -> None:
        """Skip the rest of the grace period, and wake a wait on the leaf so it happens now."""
        super().request_force()
        self.watcher.poke(self.leaf)

    def _empty(self) -> bool:
        """Whether the leaf holds no live process; the first time it is seen so, :attr:`quiet_at` is set,
        and the leaf is not read again: an empty leaf stays empty (nothing can fork into it, and the
        engine moves no process into a leaf but at its run's spawn)."""
        if self.quiet_at is not None:
            return True
        if self._populated():
            if self.status is not None:
                self._kill_rest()
            return False
        self.quiet_at = time.monotonic()
        self._close_events()  # not read again; the leaf's removal follows
        return True

    def mark_quiet(self) -> bool:
        """Whether the leader is reaped and the leaf holds no live process; :attr:`quiet_at` is set then
        (a read of the engine's children made since serves the reaping of its zombies)."""
        return self.poll_leader() and self._empty()

    def _reap_leaf_zombies(self) -> None:
        # A read made since the leaf was seen empty (shared by the leaves that emptied together, see
        # wait_change), else a fresh one: a process re-parented to the engine by then counts. Every zombie
        # of this leaf was one already when the leaf was seen empty, so the exited pids of that list,
        # looked at once after it was read for every leaf that shares it, hold them all.
        adopted = self._not_leaders(engine_children(read_since=self.quiet_at))
        for pid in _exited_among(adopted):
            try:  # reap only a zombie of this leaf, by its own pid, never waitpid(-1)
                if self.leaf.holds(pid):
                    os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass

    def gone(self) -> bool:
        """Whether the leader is reaped, the leaf holds no live process, and its zombies are reaped."""
        if not self.poll_leader():
            return False
        if self.quiet_at is None:  # a leaf seen empty stays so: no watch, no look (see _empty)
            self._seen = self.watcher.generation(self.leaf)  # before the look: no change is missed
            if not self._empty():
                return False
        self._reap_leaf_zombies()
        return True

    def remaining(self) -> list[int]:
        """The pids in the leaf now, the leader's while it is not reaped (zombies reaped on the way)."""
        alive = set() if self.quiet_at is not None else set(self.leaf.procs())
        if not self.poll_leader():
            alive.add(self.pid)
        if not alive:
            self._empty()
            self._reap_leaf_zombies()
        return sorted(alive)

    async def quiet_read(self) -> None:
        """After the leader exited: one look at the leaf (``cgroup.events``), and no read of the engine's
        children. ``populated 0`` is the kernel's word that nothing of the run is alive (the leaf holds
        its whole tree), so :meth:`leftovers` needs nothing more; the zombies it handed to the engine are
        reaped by the look that decides the tree is gone (:meth:`gone`), as before.

        Cancellation: not a checkpoint.
        """
        self.mark_quiet()

    def leftovers(self) -> bool:
        """After the leader exited: whether a process is still in the leaf (not read again once the leaf
        was seen empty: an empty leaf stays empty)."""
        if self.quiet_at is not None:
            return False
        self._seen = self.watcher.generation(self.leaf)
        return self.leaf.populated()

    async def wait_change(self, step_seconds: float) -> None:
        """While the leader lives, wait for its exit or force (the leaf cannot empty before the leader
        exits); after, wait for the leaf's ``cgroup.events`` to change, with no polling. Once the leaf is
        empty, wait for a read of the engine's children made since (shared with the leaves that emptied
        in the same pass) to reap its zombies from."""
        if self.pidfd >= 0:
            await self._wait_leader_or_force()
        else:
            await self.watcher.wait_changed(self.leaf, self._seen)
        if self.mark_quiet():  # its zombies are reaped from a read shared with others
            await children_read_since(self.quiet_at or 0.0)
