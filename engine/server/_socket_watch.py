"""The RPC socket of ``serve`` and of ``mcp``'s embedded engine, bound again when its file goes away (NB-06).

A socket file removed while the engine runs (by hand, by a cleaner of ``/tmp``) would leave a live
engine that no client reaches, and whose state directory no other engine can take. :func:`serve_socket`
serves the listener and watches the file: inotify on the socket's folder wakes it when a name there is
removed, renamed or created (:func:`wait_socket_lost`); where inotify is not available, the file is
checked every :data:`SOCKET_CHECK_SECONDS`. No busy polling: an idle engine does no work. When the file
is no longer the socket bound, the socket is bound again at the same path; connections already open go
on. Meanwhile clients name the engine holding the state directory (``_location.lock_holder``).
"""

from __future__ import annotations

import functools
import logging
import os
import stat
from collections.abc import Awaitable, Callable
from typing import Any, Final

import trio

from .._errors import EngineLockedError
from ._eventlog import log_event

__all__ = ["SOCKET_CHECK_SECONDS", "serve_socket", "wait_socket_lost"]

#: Where inotify cannot watch the socket's folder: how often the socket file is checked, in seconds.
SOCKET_CHECK_SECONDS: Final = 5.0


def _socket_inode(path: str) -> int | None:
    """The inode of the socket at ``path``, or ``None`` if there is none (removed, or another file)."""
    try:
        info = os.lstat(path)
    except OSError:
        return None
    return info.st_ino if stat.S_ISSOCK(info.st_mode) else None


def _watch_folder(folder: str) -> Any:
    """An inotify instance (``inotify_simple.INotify``, non-blocking) reporting names removed, renamed or
    created in ``folder`` (and the folder's own removal), or ``None`` where inotify is not available."""
    try:
        from inotify_simple import INotify, flags
    except ImportError:
        return None
    mask = (
        flags.DELETE | flags.MOVED_FROM | flags.CREATE | flags.MOVED_TO | flags.DELETE_SELF | flags.MOVE_SELF
    )
    try:
        watcher = INotify(nonblocking=True)
    except OSError:
        return None
    try:
        watcher.add_watch(folder, mask)
    except OSError:
        watcher.close()
        return None
    return watcher


async def wait_socket_lost(path: str, inode: int) -> None:
    """Return once the file at ``path`` is no longer the socket ``inode``: removed, renamed or replaced.

    Woken by inotify on the socket's folder; where inotify is not available (or the folder itself goes
    away), the file is checked every :data:`SOCKET_CHECK_SECONDS`. No busy polling.

    Cancellation: safe; nothing changes.
    """
    watcher = _watch_folder(os.path.dirname(path))
    try:
        while _socket_inode(path) == inode:
            if watcher is None:
                await trio.sleep(SOCKET_CHECK_SECONDS)
                continue
            await trio.lowlevel.wait_readable(watcher.fileno())
            from inotify_simple import flags

            if any(event.mask & flags.IGNORED for event in watcher.read(timeout=0)):  # the folder is gone
                watcher.close()
                watcher = None
    finally:
        if watcher is not None:
            watcher.close()


async def serve_socket(
    handler: Callable[[trio.SocketStream], Awaitable[object]],
    listener: trio.SocketListener,
    path: str,
    bind_again: Callable[[], Awaitable[trio.SocketListener]],
    connections: trio.Nursery,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Accept connections on ``listener`` (each served by ``handler`` in ``connections``) until cancelled,
    and bind the socket again (``bind_again()``) whenever its file at ``path`` is removed or replaced.

    Connections already open go on. While the socket is missing, clients name this engine (from the
    state directory's lock) instead of saying that none runs; a bind that fails is tried again every
    :data:`SOCKET_CHECK_SECONDS`.

    Cancellation: the listener is closed; the socket file is the caller's to remove.
    """
    started = False
    while True:
        inode = _socket_inode(path)
        async with trio.open_nursery() as nursery:
            await nursery.start(
                functools.partial(trio.serve_listeners, handler, [listener], handler_nursery=connections)
            )
            if not started:
                started = True
                task_status.started()
            if inode is not None:
                await wait_socket_lost(path, inode)
            nursery.cancel_scope.cancel()
        await listener.aclose()
        log_event("socket_lost", level=logging.WARNING, socket=path)
        while True:
            try:
                listener = await bind_again()
            except (OSError, EngineLockedError) as exc:
                log_event("socket_bind_failed", level=logging.ERROR, socket=path, error=str(exc))
                await trio.sleep(SOCKET_CHECK_SECONDS)
                continue
            break
        log_event("socket_bound", socket=path)
