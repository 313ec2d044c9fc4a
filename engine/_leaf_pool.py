"""Empty cgroup leaves made ahead, so that making a run's leaf is off its spawn's path (cgroup mode).

A run is born in a leaf of its own (``_containment``): the leaf must exist before the spawn, and a
``mkdir`` in the cgroup filesystem (which makes the leaf's interface files) is some 20-40 us of the
spawn's path. The pool keeps a few empty leaves under the engine's parent, made once a run has ended (in
the housekeeping that follows its waiters, ``Supervisor._finish``), and a run takes one instead of making
its own. Each leaf serves one run: a run's leaf is removed when it ends, as before, so a leaf's counters
(``cpu.stat``) are its run's alone.

A used leaf is never given to another run, although a spawn into one is some 0.1 ms faster than into a
new one (``docs/benchmarks/analysis.md``, eleventh round): a run can change its leaf in ways the engine
cannot see or undo, and the next run would inherit them. It can write the leaf's ``cgroup.kill`` (the
kernel then kills every process later cloned into it at birth, and no file tells), ``cgroup.freeze``
(the next spawn into it would block the engine itself), or, where controllers are on, its limits
(``pids.max``, ``memory.max``). Its files are the engine user's, so a run needs no privilege for that.
Tested in ``tests/test_leaf_pool.py``.

The spare leaves are ordinary empty leaves under the parent (names ``p<n>-<token>``, never ``w-``): the
guardian and the start-up sweep remove them with the rest when the engine dies, and :meth:`LeafPool.close`
removes them when it stops.
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
