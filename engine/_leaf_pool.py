"""Empty cgroup leaves kept for the next runs, so that a run's leaf is ready before its spawn (cgroup mode).

A run is born in a leaf of its own (``_containment``): the leaf must exist before the spawn. A new leaf
costs twice: a ``mkdir`` in the cgroup filesystem (which makes the leaf's interface files, some 20-40 us),
and the kernel's set-up of the cgroup at its first process, inside the clone (some 100 us more than a
spawn into a leaf that held a process before: measured in ``docs/benchmarks/analysis.md``, twelfth
round). Removing it is an ``rmdir`` of 15-30 us more.

So the pool keeps a few empty leaves under the engine's parent and a run takes one. A run's leaf that is
empty when the run has ended, and charged no memory, goes back to the pool (:meth:`LeafPool.recycle`, in
the housekeeping that follows the run's waiters, ``Supervisor._finish``) and serves the next run in turn;
when the pool is full, or the leaf still holds a process or memory, it is removed, as before. A leaf
serves one run at a time, and its CPU counter (``cpu.stat``) is read from where the run began
(``Leaf.cpu_base_usec``), so what a run is shown to use is its own. A watched command's leaf is never
reused (the guardian and the sweep tell it by its name). The pool is topped up with new leaves (names
``p<n>-<token>``) when a run could not give its leaf back.

The spare leaves are ordinary empty leaves under the parent (names ``p<n>-<token>`` or a former run's
``r<id>-<token>``, never ``w-``): the guardian and the start-up sweep remove them with the rest when the
engine dies, and :meth:`LeafPool.close` removes them when it stops.
"""

from __future__ import annotations

import contextlib
from typing import final

import attrs

from ._cgroup import EngineCgroup, Leaf

__all__ = ["LeafPool"]


@final
@attrs.define(eq=False)
class LeafPool:
    """Spare empty leaves under ``cgroup`` for the next runs.

    Attributes:
        cgroup: the engine's parent cgroup.
        token: the engine's token (in the spare leaves' names).
        size: how many spare leaves are kept at most.
    """

    cgroup: EngineCgroup
    token: str
    size: int = 2
    _spare: list[Leaf] = attrs.field(init=False, factory=list)
    _made: int = attrs.field(init=False, default=0)
    _closed: bool = attrs.field(init=False, default=False)
    #: the leaves never to be taken back (:meth:`retire`)
    _retired: set[str] = attrs.field(init=False, factory=set)

    def __repr__(self) -> str:
        return f"<LeafPool {len(self._spare)} spare>"

    def take(self, name: str) -> Leaf:
        """A spare leaf, else the leaf ``name`` made now.

        Raises:
            OSError: no spare, and the leaf cannot be made.
        """
        if self._spare:
            return self._spare.pop()
        return self.cgroup.leaf(name)

    def recycle(self, leaves: list[Leaf]) -> list[bool]:
        """Take back the leaves of ended runs that can serve another (``Leaf.reusable``), while the pool
        has room; the others are left to the caller to remove.

        Returns:
            For each leaf, in order, whether the pool took it.
        """
        kept = []
        for leaf in leaves:
            retired = leaf.path in self._retired
            self._retired.discard(leaf.path)
            full = self._closed or len(self._spare) >= self.size
            fresh = None if retired or full else leaf.reusable()
            if fresh is not None:
                self._spare.append(fresh)
            kept.append(fresh is not None)
        return kept

    def retire(self, leaf: Leaf) -> None:
        """Never take ``leaf`` back (:meth:`recycle` removes it), because:

        - it gets a ``cgroup.kill``: from then on the kernel (seen on Linux 6.18) kills every process
          cloned into it with ``CLONE_INTO_CGROUP`` at birth (its kill count is compared with the one
          the clone took from the parent's cgroup), so another run born there would die at once;
        - or its removal is handed to a worker thread (a ``kill_all``'s batch): the pool could find it
          still there, empty, and keep it for the next run as the thread removes it.
        """
        self._retired.add(leaf.path)

    def fill(self) -> None:
        """Make spare leaves up to :attr:`size`; a failure is ignored (the next run makes its own)."""
        while not self._closed and len(self._spare) < self.size:
            self._made += 1
            try:
                self._spare.append(self.cgroup.leaf(f"p{self._made}-{self.token}"))
            except OSError:
                return

    def close(self) -> None:
        """Remove the spare leaves (they are empty); none is made afterwards."""
        self._closed = True
        spare, self._spare = self._spare, []
        for leaf in spare:
            with contextlib.suppress(OSError):
                leaf.remove()
