"""A set of pidfds waited on at once: one private epoll instance, which a batch of escalations
(``_escalation_batch``) waits on through Trio as one descriptor (one ``epoll_ctl`` per tree instead of a
Trio wait, a cancel scope and a task wake-up each).

Each pidfd stands for a member of the caller's (``M``); a pidfd turns readable when its process exits,
and stays so (level-triggered) until it is taken out. A pidfd closed while in the set leaves it by
itself, and its number may then be reused by another member's: :meth:`PidfdSet.discard` is told whether
it is still open.
"""

from __future__ import annotations

import select
from typing import Generic, TypeVar, final

import attrs
import trio

__all__ = ["PidfdSet"]

M = TypeVar("M")


@final
@attrs.define(eq=False)
class PidfdSet(Generic[M]):
    """Pidfds of members ``M``, waited on at once (see the module)."""

    _epoll_made: select.epoll | None = None
    _by_fd: dict[int, M] = attrs.field(factory=dict)

    @property
    def _epoll(self) -> select.epoll:
        if self._epoll_made is None:
            self._epoll_made = select.epoll()
        return self._epoll_made

    def add(self, fd: int, member: M) -> None:
        """Wait on the pidfd ``fd`` for ``member``."""
        self._epoll.register(fd, select.EPOLLIN)
        self._by_fd[fd] = member

    def discard(self, fd: int, member: M, *, still_open: bool) -> None:
        """Stop waiting on ``fd`` for ``member``; ``still_open``: the pidfd was not closed meanwhile (a
        closed one left the epoll already, and its number may be another member's now)."""
        if self._by_fd.get(fd) is member:
            del self._by_fd[fd]
        if still_open:
            try:
                self._epoll.unregister(fd)
            except OSError:
                pass

    def ready(self) -> list[tuple[int, M]]:
        """The pidfds readable now (their processes exited), with their members; does not block."""
        if not self._by_fd:
            return []
        found = [(fd, self._by_fd.get(fd)) for fd, _events in self._epoll.poll(0)]
        return [(fd, member) for fd, member in found if member is not None]

    async def wait(self) -> None:
        """Wait until a pidfd of the set is readable.

        Cancellation: safe; callers bound it with a cancel scope.
        """
        await trio.lowlevel.wait_readable(self._epoll.fileno())

    def close(self) -> None:
        """Close the epoll instance (the pidfds stay the caller's)."""
        if self._epoll_made is not None:
            trio.lowlevel.notify_closing(self._epoll_made.fileno())
            self._epoll_made.close()
            self._epoll_made = None
