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

from ._cgroup import Leaf
from ._cgroup_watch import LeafWatcher
from ._escalation_driver import children_read_since
from ._procfs import engine_children
from ._termination import ProcessTree

__all__ = ["LeafTree"]


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
    _removal_handed: bool = attrs.field(init=False, default=False)

    def snapshot(self, *, fresh: bool = True) -> None:
        """Nothing to look for: every descendant is in the leaf."""

    def send(self, sig: int) -> None:
        """Send ``sig`` to every process in the leaf (each pinned by a pidfd first: the leader's, while it
        is not reaped, is the run's own)."""
        self.leaf.signal(sig, pinned={self.pid: self.pidfd} if self.pidfd >= 0 else None)

    def kill(self) -> None:
        """SIGKILL the whole leaf at once through ``cgroup.kill`` (forks in flight included).

        In a batch (:meth:`hand_kills`) the first kill goes instead to each process of the leaf through a
        pidfd, from the batch driver's worker thread: a ``cgroup.kill`` write holds the cgroup mutex for
        some 40-70 us, and 1000 of them queue up with the leaves' removals behind the same mutex. A process
        forked while ``cgroup.procs`` was read is what that misses: the leaf is then still populated at
        the look that follows the leader's exit, and the kill asked for again is the ``cgroup.kill``. The
        leader is not reaped while the kill is in flight, so its pidfd stays open for the thread.
        """
        if self._hand is None or self._killed_once:
            self.leaf.kill()
            return
        self._killed_once = True
        token = object()
        self._in_flight.append(token)
        pinned = {self.pid: self.pidfd} if self.pidfd >= 0 else None

        def kill_each() -> None:  # on the worker thread
            try:
                self.leaf.signal(signal.SIGKILL, pinned=pinned)
            finally:
                self._in_flight.remove(token)

        self._hand(kill_each)

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
        if self.leaf.populated():
            return False
        self.quiet_at = time.monotonic()
        return True

    def mark_quiet(self) -> bool:
        """Whether the leader is reaped and the leaf holds no live process; :attr:`quiet_at` is set then
        (a read of the engine's children made since serves the reaping of its zombies)."""
        return self.poll_leader() and self._empty()

    def _reap_leaf_zombies(self) -> None:
        # A read made since the leaf was seen empty (shared by the leaves that emptied together, see
        # wait_change), else a fresh one: a process re-parented to the engine by then counts.
        adopted = self._not_leaders(engine_children(read_since=self.quiet_at))
        for pid in adopted:
            try:  # look first (WNOWAIT): reap only a zombie of this leaf, by its own pid, never waitpid(-1)
                if os.waitid(
                    os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT
                ) is not None and self.leaf.holds(pid):
                    os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass

    def gone(self) -> bool:
        """Whether the leader is reaped, the leaf holds no live process, and its zombies are reaped."""
        if not self.poll_leader():
            return False
        self._seen = self.watcher.generation(self.leaf)  # before the look: no change is missed
        if not self._empty():
            return False
        self._reap_leaf_zombies()
        if self._hand is not None and not self._removal_handed:
            # In a batch, the empty leaf is removed now from the worker thread, overlapping the ends of the
            # other runs; the release after the run's end then finds it gone (_containment).
            self._removal_handed = True
            self._hand(self.leaf.remove)
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
