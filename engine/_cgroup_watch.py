"""Waiting for cgroup leaves to change, without polling: one inotify instance for the whole engine.

The kernel reports a change of a leaf's ``cgroup.events`` (``populated 1`` -> ``0``) as ``IN_MODIFY`` on
that file. One task reads the inotify descriptor and wakes the tasks waiting on the leaves that changed,
so a thousand escalations waiting at once share one descriptor and cost nothing while they wait (trio
lets only one task wait on a descriptor; hence the reader task).

Each watched leaf has a *generation*, counted up at every change: a waiter notes the generation, looks
at the leaf, and waits for a newer generation, so a change between its look and its wait is never
missed.

Events nobody waits for are read late: while no task waits on a leaf, the reader reads what the kernel
queued only :data:`IDLE_READ_SECONDS` after it turned readable (or as soon as a task starts waiting). A
``kill_all`` of 1000 leaves queues some 2000 events (each leaf's ``populated 0``, then the ``IN_IGNORED``
of its removal) that its batch driver never waits on (it waits on the leaders' pidfds): read at once,
their parsing and wake-ups took the loop several milliseconds in the middle of the kills. A waiter that
comes while events are still queued may be woken by an old one: it looks again, as on any wake-up.
When the kernel's queue overflowed, every watched leaf counts as changed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import final

import attrs
import trio
from inotify_simple import INotify, flags

from ._cgroup import Leaf
from ._errors import unwrap_single

__all__ = ["IDLE_READ_SECONDS", "LeafWatcher", "open_leaf_watcher"]

#: While no task waits on a leaf, queued events are read this long after they came (see the module).
IDLE_READ_SECONDS = 0.25


@attrs.define(eq=False)
class _Watched:
    wd: int
    path: str
    generation: int = 0
    changed: trio.Event = attrs.field(factory=trio.Event)
    removed: bool = False

    def bump(self) -> None:
        self.generation += 1
        changed, self.changed = self.changed, trio.Event()
        changed.set()


@final
@attrs.define(eq=False)
class LeafWatcher:
    """Wakes the tasks waiting for a leaf's ``cgroup.events`` to change. Made by :func:`open_leaf_watcher`."""

    _inotify: INotify = attrs.field(alias="inotify")
    _by_path: dict[str, _Watched] = attrs.field(init=False, factory=dict)
    _by_wd: dict[int, _Watched] = attrs.field(init=False, factory=dict)
    #: tasks in :meth:`wait_changed` now
    _waiters: int = attrs.field(init=False, default=0)
    #: set when a task starts waiting: the reader reads what is queued at once
    _wanted: trio.Event = attrs.field(init=False, factory=trio.Event)

    def __repr__(self) -> str:
        return f"<LeafWatcher {len(self._by_path)} leaves watched>"

    def _watched(self, leaf: Leaf) -> _Watched | None:
        found = self._by_path.get(leaf.events_path)
        if found is None:
            try:
                wd = self._inotify.add_watch(leaf.events_path, flags.MODIFY)
            except FileNotFoundError:
                return None  # the leaf was removed: it is empty
            found = self._by_wd.get(wd)
            if found is None or found.removed:  # a new watch (wd numbers are not reused at once)
                found = _Watched(wd=wd, path=leaf.events_path)
                self._by_wd[wd] = found
            self._by_path[leaf.events_path] = found
        return found

    def generation(self, leaf: Leaf) -> int:
        """The leaf's change count now; the watch is in place from this call on (-1: no such leaf)."""
        found = self._watched(leaf)
        return -1 if found is None else found.generation

    async def wait_changed(self, leaf: Leaf, since: int) -> None:
        """Wait until the leaf changed after :meth:`generation` returned ``since`` (or it was removed).

        Cancellation: safe; callers bound it with ``trio.move_on_after``.
        """
        found = self._watched(leaf)
        if found is not None and not found.removed and found.generation == since:
            self._waiters += 1
            self._wanted.set()
            try:
                while not found.removed and found.generation == since:
                    await found.changed.wait()
            finally:
                self._waiters -= 1
        await trio.lowlevel.checkpoint_if_cancelled()

    def poke(self, leaf: Leaf) -> None:
        """Wake the waiters of ``leaf`` as if it changed (a forced kill: they look again now)."""
        found = self._by_path.get(leaf.events_path)
        if found is not None:
            found.bump()

    def forget(self, leaf: Leaf, *, removed: bool = False) -> None:
        """Stop watching ``leaf``; ``removed``: its directory is removed already, and the kernel dropped
        the watch with it (its ``IN_IGNORED`` is read and ignored), so no ``inotify_rm_watch`` is made
        (about 20 us each, a thousand of them in a ``kill_all``)."""
        found = self._by_path.pop(leaf.events_path, None)
        if found is not None and not found.removed:
            found.removed = True
            found.bump()
            self._by_wd.pop(found.wd, None)
            if removed:
                return
            try:
                self._inotify.rm_watch(found.wd)
            except OSError:
                pass  # already dropped by the kernel

    async def wait_empty(self, leaf: Leaf) -> None:
        """Return once no live process is in ``leaf`` (``populated 0``, or the leaf removed).

        Cancellation: safe; callers bound it with ``trio.move_on_after``.
        """
        while True:
            since = self.generation(leaf)
            if not leaf.populated():
                break
            await self.wait_changed(leaf, since)
        await trio.lowlevel.checkpoint()

    async def _read_events(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        fd = self._inotify.fileno()
        task_status.started()
        while True:
            await trio.lowlevel.wait_readable(fd)
            if not self._waiters:  # nobody waits: read late, in one go (see the module)
                with trio.move_on_after(IDLE_READ_SECONDS):
                    await self._wanted.wait()
            if self._wanted.is_set():
                self._wanted = trio.Event()
            for event in self._inotify.read(timeout=0):
                if event.mask & flags.Q_OVERFLOW:  # events were lost: every leaf may have changed
                    for watched in list(self._by_wd.values()):
                        watched.bump()
                    continue
                found = self._by_wd.get(event.wd)
                if found is None:
                    continue
                if event.mask & flags.IGNORED:  # the leaf was removed: the kernel dropped the watch
                    found.removed = True
                    del self._by_wd[event.wd]
                    if self._by_path.get(found.path) is found:
                        del self._by_path[found.path]
                found.bump()


@asynccontextmanager
async def open_leaf_watcher() -> AsyncIterator[LeafWatcher]:
    """Run a :class:`LeafWatcher` (its reader task) for the duration of the block.

    Cancellation: leaving the block stops the reader and closes the inotify descriptor.
    """
    inotify = INotify(nonblocking=True)
    try:
        async with trio.open_nursery() as nursery:
            watcher = LeafWatcher(inotify=inotify)
            await nursery.start(watcher._read_events)
            try:
                yield watcher
            finally:
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:  # the caller's own exception, not wrapped by the reader's nursery
        unwrap_single(group)
    finally:
        trio.lowlevel.notify_closing(inotify.fileno())
        inotify.close()
