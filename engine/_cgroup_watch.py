"""Waiting for cgroup leaves to empty, without polling: one inotify instance for the whole engine.

The kernel reports a change of a leaf's ``cgroup.events`` (``populated 1`` -> ``0``) as ``IN_MODIFY`` on
that file. One task reads the inotify descriptor and wakes the tasks waiting on the leaves that changed,
so a thousand escalations waiting at once share one descriptor and cost nothing while they wait (trio
lets only one task wait on a descriptor; hence the reader task).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import final

import attrs
import trio
from inotify_simple import INotify, flags

from ._cgroup import Leaf

__all__ = ["LeafWatcher", "open_leaf_watcher"]


@final
@attrs.define(eq=False)
class LeafWatcher:
    """Wakes the tasks waiting for a leaf's ``cgroup.events`` to change. Made by :func:`open_leaf_watcher`."""

    _inotify: INotify = attrs.field(alias="inotify")
    _wds: dict[str, int] = attrs.field(init=False, factory=dict)
    _paths: dict[int, str] = attrs.field(init=False, factory=dict)
    _changed: dict[int, trio.Event] = attrs.field(init=False, factory=dict)

    def __repr__(self) -> str:
        return f"<LeafWatcher {len(self._wds)} leaves watched, {len(self._changed)} waiting>"

    def _watch(self, leaf: Leaf) -> int | None:
        wd = self._wds.get(leaf.events_path)
        if wd is None:
            try:
                wd = self._inotify.add_watch(leaf.events_path, flags.MODIFY)
            except FileNotFoundError:
                return None  # the leaf was removed: it is empty
            self._wds[leaf.events_path] = wd
            self._paths[wd] = leaf.events_path
        return wd

    async def wait_changed(self, leaf: Leaf) -> None:
        """Wait for the next change of ``leaf``'s ``cgroup.events`` (or its removal).

        Callers look at the leaf, then wait, then look again; the watch is in place before their first
        look when they call :meth:`watch` first (as :meth:`wait_empty` does), so no change is missed.

        Cancellation: safe; nothing changes.
        """
        wd = self._watch(leaf)
        if wd is None:
            await trio.lowlevel.checkpoint()
            return
        await self._changed.setdefault(wd, trio.Event()).wait()

    def watch(self, leaf: Leaf) -> None:
        """Start watching ``leaf`` now, so a change after this call wakes a later :meth:`wait_changed`."""
        wd = self._watch(leaf)
        if wd is not None:
            self._changed.setdefault(wd, trio.Event())

    async def wait_empty(self, leaf: Leaf) -> None:
        """Return once no live process is in ``leaf`` (``populated 0``, or the leaf removed).

        Cancellation: safe; callers bound it with ``trio.move_on_after``.
        """
        self.watch(leaf)
        while leaf.populated():
            await self.wait_changed(leaf)
        await trio.lowlevel.checkpoint()

    async def _read_events(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        fd = self._inotify.fileno()
        task_status.started()
        while True:
            await trio.lowlevel.wait_readable(fd)
            for event in self._inotify.read(timeout=0):
                waiting = self._changed.pop(event.wd, None)
                if waiting is not None:
                    waiting.set()
                if event.mask & flags.IGNORED:  # the leaf was removed: the kernel dropped the watch
                    path = self._paths.pop(event.wd, None)
                    if path is not None:
                        self._wds.pop(path, None)


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
    finally:
        trio.lowlevel.notify_closing(inotify.fileno())
        inotify.close()
