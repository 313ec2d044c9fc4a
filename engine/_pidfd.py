"""Waiting for a process to exit through a pidfd, the one way the engine does it.

A pidfd (``pidfd_open(2)``, Linux 5.3) turns readable when its process exits, whoever its parent is, so
Trio can wait for it like for a socket: no polling, no SIGCHLD handler, no thread. The supervisor keeps
one open per child for the child's lifetime (:func:`wait_pidfd`, :func:`close_pidfd`); the guardian
link and the on-exit watchers wait for a process they did not just spawn (:func:`wait_exited`).
"""

from __future__ import annotations

import os

import trio

from ._procfs import is_alive

__all__ = ["close_pidfd", "wait_exited", "wait_pidfd"]


async def wait_pidfd(pidfd: int) -> None:
    """Block until the process ``pidfd`` refers to has exited (it need not be reaped).

    Cancellation: safe; nothing changes, and the pidfd can be waited on again.
    """
    await trio.lowlevel.wait_readable(pidfd)


def close_pidfd(pidfd: int) -> None:
    """Close ``pidfd``, waking any task waiting on it first (``trio.lowlevel.notify_closing``)."""
    trio.lowlevel.notify_closing(pidfd)
    os.close(pidfd)


async def wait_exited(pid: int, *, start_time: int | None = None) -> None:
    """Block until the process ``pid`` has exited; return at once when there is no such process.

    The pidfd is opened first and the start time checked after, so the pidfd waited on is the process
    meant, never a stranger that got the pid later.

    Args:
        pid: the process.
        start_time: its start time (``/proc/<pid>/stat`` field 22); when given, a process holding
            ``pid`` with another start time counts as exited. Leave it out only for a child of this
            process that is not yet reaped (its pid cannot be reused).

    Cancellation: safe; the pidfd is closed and nothing else changes.
    """
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        await trio.lowlevel.checkpoint()
        return
    try:
        if start_time is None or is_alive(pid, start_time):
            await wait_pidfd(pidfd)
        else:
            await trio.lowlevel.checkpoint()
    finally:
        close_pidfd(pidfd)
