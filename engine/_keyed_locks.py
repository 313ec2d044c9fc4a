"""One lock per key, kept only while someone holds or waits for it.

A long-lived engine sees an unbounded number of keys (a scope per project, a lock per on-exit job ever
armed); a ``dict`` of ``trio.Lock`` that only grows would keep one for each forever.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import final

import attrs
import trio

__all__ = ["KeyedLocks"]


@final
@attrs.define(eq=False)
class KeyedLocks:
    """A ``trio.Lock`` per key, made on first use and dropped when its last user leaves."""

    _locks: dict[str, trio.Lock] = attrs.field(init=False, factory=dict)
    _users: dict[str, int] = attrs.field(init=False, factory=dict)

    def __len__(self) -> int:
        return len(self._locks)

    def __repr__(self) -> str:
        return f"<KeyedLocks {len(self._locks)} in use>"

    def idle(self, key: str) -> bool:
        """Whether nobody holds or waits for the lock of ``key`` (a sync step may then act as its holder)."""
        return key not in self._locks

    @asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        """Hold the lock of ``key`` for the block.

        Cancellation: while waiting for the lock, the block does not run; the lock is dropped if this
        was its last user.
        """
        lock = self._locks.setdefault(key, trio.Lock())
        self._users[key] = self._users.get(key, 0) + 1
        try:
            async with lock:
                yield
        finally:
            self._users[key] -= 1
            if not self._users[key]:
                del self._users[key]
                del self._locks[key]
