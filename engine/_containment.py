"""Containment: where a run's processes are kept so that all of them can be ended, chosen once at start.

Two variants behind one protocol, as trio's ``_subprocess_platform`` picks its wait mechanism once:

- **cgroup** (``"cgroup"``): each run is born in a cgroup v2 leaf of its own (``_cgroup``); nothing a
  process does takes it out. The escalation target is a :class:`~._leaf_tree.LeafTree`.
- **process group** (``"process-group"``): each run leads a session and process group of its own;
  escapees are found by ``/proc`` parent links and the run marker in their environment (a
  :class:`~._termination.ProcessTree`). A daemon that double-forks, calls ``setsid`` and scrubs its
  environment is out of reach of the run; under the subreaper it is an *unclaimed orphan* of the engine.

``"auto"`` (the default) is cgroup wherever a cgroup v2 hierarchy is mounted and writable by the engine
(the unified mount, or the v2 part of a hybrid layout; a delegated subtree counts), else process group.
The supervisor asks its containment where to put a run (:meth:`Containment.place`), to spawn into that
place, for the run's escalation target, and to release the place once the run ended; it never asks
which variant it has.
"""

from __future__ import annotations

import os
import secrets
import signal
from collections.abc import AsyncIterator, Callable, Set
from contextlib import asynccontextmanager
from typing import Protocol, final

import attrs
import trio

from ._cgroup import EngineCgroup, Leaf, find_cgroup2, remove_leaves
from ._cgroup_watch import LeafWatcher, open_leaf_watcher
from ._config import CONTAINMENT_MODES
from ._errors import EngineError
from ._leaf_pool import LeafPool
from ._leaf_tree import LeafTree
from ._termination import ProcessTree

__all__ = [
    "CONTAINMENT_MODES",
    "CgroupContainment",
    "Containment",
    "ProcessGroupContainment",
    "open_containment",
]

#: From this many leaves released together (the runs that ended in one scheduler pass), they are removed
#: from a worker thread (:meth:`CgroupContainment.release_many`); fewer are removed at once.
_THREAD_RELEASES_FROM = 16


#: Where a run is kept: its leaf in cgroup containment, nothing more in process-group containment.
Placement = Leaf | None


class Containment(Protocol):
    """What the supervisor needs from a containment variant (see the module).

    Attributes:
        mode: ``"cgroup"`` or ``"process-group"``.
        reason: why this variant is in use (for the engine log and ``Engine.status()``).
        token: the prefix of every run marker of this engine (``<token>:<run id>``; watched commands
            ``<token>w:<run id>``), which the guardian and the sweep look for in process-group mode.
        recorded: whether it belongs to an engine's state directory (``open_engine``), where the next
            engine finds the runs left to it (``outlive_engine_crash``); a bare supervisor's is not, and
            such a run is then ended at its close like any other (nothing could adopt it).
    """

    mode: str
    reason: str
    token: str
    recorded: bool

    def marker(self, run_id: int, *, watched: bool) -> str:
        """The run marker (``GADGET_ENGINE_RUN``) of run ``run_id``."""
        ...

    def place(self, run_id: int, *, watched: bool) -> Placement:
        """Make the run's place before it is spawned (its leaf); ``watched`` for on-exit commands."""
        ...

    def spawn(self, placement: Placement, spawn: Callable[[int | None], int]) -> int:
        """Run ``spawn`` (it returns the child's pid) so that the child is born in ``placement``; it is
        given a descriptor of the cgroup to start the child in, or ``None`` (``EngineCgroup.spawn_in``)."""
        ...

    def tree(
        self,
        placement: Placement,
        *,
        pid: int,
        pidfd: int,
        start_time: int,
        marker: str,
        known_leaders: Set[int],
    ) -> ProcessTree:
        """The escalation target of a run just spawned into ``placement``."""
        ...

    def kill_now(self, placement: Placement, pid: int) -> None:
        """SIGKILL a run that failed right after its spawn (nothing of it may outlive the failure)."""

    def release(self, placement: Placement) -> None:
        """Remove what :meth:`place` made, once the run has ended (a leaf still in use stays)."""

    async def release_many(self, placements: list[Placement]) -> None:
        """:meth:`release` of each of ``placements`` (the runs that ended together); many may be removed
        from a worker thread. Cancellation: callers shield it."""

    def holds(self, pid: int) -> bool:
        """Whether process ``pid`` (a zombie too) is in one of this engine's places."""
        ...

    def describe(self) -> str:
        """A short phrase for logs: ``cgroup /sys/fs/cgroup/...`` or ``process-group``."""
        ...

    def watched_leaves(self) -> list[Leaf]:
        """The leaves of watched on-exit commands under this engine's parent (``[]`` without cgroups)."""
        ...


@final
@attrs.define(eq=False)
class ProcessGroupContainment:
    """Process groups, ``/proc`` parent links and run markers (see the module)."""

    token: str
    subreaper: bool
    reason: str = "asked for"
    recorded: bool = False
    mode: str = attrs.field(init=False, default="process-group")

    def marker(self, run_id: int, *, watched: bool) -> str:
        return f"{self.token}{'w' if watched else ''}:{run_id}"

    def place(self, run_id: int, *, watched: bool) -> Placement:
        return None

    def spawn(self, placement: Placement, spawn: Callable[[int | None], int]) -> int:
        return spawn(None)

    def tree(
        self,
        placement: Placement,
        *,
        pid: int,
        pidfd: int,
        start_time: int,
        marker: str,
        known_leaders: Set[int],
    ) -> ProcessTree:
        return ProcessTree(
            pid=pid,
            pidfd=pidfd,
            start_time=start_time,
            marker=marker,
            subreaper=self.subreaper,
            known_leaders=known_leaders,
        )

    def kill_now(self, placement: Placement, pid: int) -> None:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def release(self, placement: Placement) -> None:
        pass

    async def release_many(self, placements: list[Placement]) -> None:
        pass  # nothing to remove: no checkpoint either (the runs' housekeeping follows at once)

    def holds(self, pid: int) -> bool:
        return False  # a process group holds nothing a process cannot leave

    def describe(self) -> str:
        return "process-group"

    def watched_leaves(self) -> list[Leaf]:
        return []


@final
@attrs.define(eq=False)
class CgroupContainment:
    """A cgroup v2 leaf per run, under the engine's parent cgroup (see the module)."""

    token: str
    subreaper: bool
    cgroup: EngineCgroup
    watcher: LeafWatcher
    reason: str = "a writable cgroup v2 hierarchy"
    recorded: bool = False
    mode: str = attrs.field(init=False, default="cgroup")
    #: Empty leaves made ahead for the next runs (``_leaf_pool``).
    pool: LeafPool = attrs.field(
        init=False, default=attrs.Factory(lambda self: LeafPool(self.cgroup, self.token), takes_self=True)
    )

    def marker(self, run_id: int, *, watched: bool) -> str:
        return f"{self.token}{'w' if watched else ''}:{run_id}"

    def place(self, run_id: int, *, watched: bool) -> Placement:
        if watched:
            return self.cgroup.leaf(f"w-{run_id}-{self.token}")
        return self.pool.take(f"r{run_id}-{self.token}")

    def spawn(self, placement: Placement, spawn: Callable[[int | None], int]) -> int:
        assert placement is not None
        return self.cgroup.spawn_in(placement, spawn)

    def tree(
        self,
        placement: Placement,
        *,
        pid: int,
        pidfd: int,
        start_time: int,
        marker: str,
        known_leaders: Set[int],
    ) -> ProcessTree:
        assert placement is not None
        # No inotify watch yet (about 30 us per spawn): the tree adds it at its first need, the
        # generation it notes before each look at the leaf (``LeafWatcher.generation``); a run whose leaf
        # is empty once its leader exited (the usual end) is never watched.
        return LeafTree(
            pid=pid,
            pidfd=pidfd,
            start_time=start_time,
            marker=marker,
            subreaper=self.subreaper,
            known_leaders=known_leaders,
            leaf=placement,
            watcher=self.watcher,
        )

    def kill_now(self, placement: Placement, pid: int) -> None:
        assert placement is not None
        placement.kill()

    def release(self, placement: Placement) -> None:
        if placement is not None:  # no look first: the kernel refuses (EBUSY) while a live process is in it
            self._released([placement], remove_leaves([placement]))

    async def release_many(self, placements: list[Placement]) -> None:
        leaves = [leaf for leaf in placements if leaf is not None]
        if len(leaves) < _THREAD_RELEASES_FROM:
            removed = remove_leaves(leaves)
        else:
            # An rmdir of a leaf costs some 30-60 us of kernel time: a kill_all's thousand go to a worker
            # thread, overlapping the ends of the runs still finishing.
            removed = await trio.to_thread.run_sync(remove_leaves, leaves)
        self._released(leaves, removed)

    def _released(self, leaves: list[Leaf], removed: list[bool]) -> None:
        """After the removal of ``leaves``: forget the watches of those gone (a survivor keeps its leaf,
        watched still; the next start-up sweep ends it), then make the next runs' leaves, off their spawn's
        path."""
        for leaf, gone in zip(leaves, removed, strict=True):
            if gone:
                self.watcher.forget(leaf, removed=True)
        if any(not leaf.watched for leaf in leaves):
            self.pool.fill()

    def holds(self, pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/cgroup", encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError:
            return False
        prefix = f"0::{self.cgroup.cgroup2.relative(self.cgroup.path)}/"
        return any(line.startswith(prefix) for line in text.splitlines())

    def describe(self) -> str:
        return f"cgroup {self.cgroup.path}"

    def watched_leaves(self) -> list[Leaf]:
        return [leaf for leaf in self.cgroup.leaves() if leaf.watched]


@asynccontextmanager
async def open_containment(
    mode: str = "auto", *, state_dir: str | None = None, subreaper: bool = True
) -> AsyncIterator[Containment]:
    """Choose and set up the containment ``mode`` names for the duration of the block.

    Args:
        mode: ``"auto"``, ``"cgroup"`` or ``"process-group"`` (see the module).
        state_dir: the engine's state directory: the parent cgroup is named after it and recorded in it.
            ``None`` (a bare supervisor): a parent named after this process and a random token, not
            recorded; the runs that would outlive the engine are then ended at the supervisor's close
            (``Containment.recorded``).
        subreaper: whether the engine is a child subreaper (orphans of a run come to it).

    Cancellation: leaving the block removes the parent cgroup if it is empty.

    Raises:
        EngineError: ``mode`` is ``"cgroup"`` and no writable cgroup v2 hierarchy is there (the message
            says why and what to do).
        ValueError: ``mode`` is not one of :data:`CONTAINMENT_MODES`.
    """
    if mode not in CONTAINMENT_MODES:
        raise ValueError(f"containment must be one of {', '.join(CONTAINMENT_MODES)}, got {mode!r}")
    token = secrets.token_hex(6)
    recorded = state_dir is not None
    if mode == "process-group":
        yield ProcessGroupContainment(token=token, subreaper=subreaper, recorded=recorded)
        return
    found, why = find_cgroup2()
    cgroup: EngineCgroup | None = None
    if found is not None:
        key = state_dir if state_dir is not None else f"/supervisor/{os.getpid()}/{token}"
        try:
            cgroup = EngineCgroup.open(found, key, record=state_dir is not None)
        except OSError as exc:
            why = str(exc)
    if cgroup is None:
        if mode == "cgroup":
            raise EngineError(
                f"containment 'cgroup' needs a cgroup v2 hierarchy this process can write: {why}; use "
                "containment 'process-group', or run the engine in a delegated cgroup (see "
                "docs/guide-escalation.md)"
            )
        yield ProcessGroupContainment(
            token=token, subreaper=subreaper, reason=f"no usable cgroup: {why}", recorded=recorded
        )
        return
    chosen: CgroupContainment | None = None
    try:
        async with open_leaf_watcher() as watcher:
            chosen = CgroupContainment(
                token=token, subreaper=subreaper, cgroup=cgroup, watcher=watcher, recorded=recorded
            )
            yield chosen
    finally:
        if chosen is not None:
            chosen.pool.close()
        cgroup.close()
