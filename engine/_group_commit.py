"""Group commit: the items handed in while one write is under way are written together by the next.

A database's group commit (PostgreSQL's ``commit_delay``, SQLite applications that batch their
transactions) shares one durable write among the callers that arrive while the last one is being made:
each caller still returns only once its own item is written. The engine's cron needs it where many tasks
write at once: a ``reconcile`` of 100 on-exit jobs stores 100 watch states and sweeps 100 jobs' older
files right after their spawns, which as single writes cost 100 ``synchronous=FULL`` transactions and
100 listings of the same folder.

No task of its own: the first caller of a batch writes it (it "leads"), after the write before it ends;
the callers that come meanwhile join the batch and wait.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar, final

import attrs
import trio

__all__ = ["GroupCommit"]

T = TypeVar("T")
R = TypeVar("R")


@final
@attrs.define(eq=False)
class _Entry(Generic[T]):
    """One caller's item: taken out by identity, never confused with an equal item of another caller."""

    item: T


@final
@attrs.define(eq=False)
class _Batch(Generic[T, R]):
    """The items written together; ``result`` or ``error`` once ``done``."""

    entries: list[_Entry[T]] = attrs.field(factory=list)
    led: bool = False
    #: The write has begun: an item is in it whatever happens to its caller.
    started: bool = False
    done: trio.Event = attrs.field(factory=trio.Event)
    #: Set (and replaced) when the batch is done or its leader gave the lead up.
    wake: trio.Event = attrs.field(factory=trio.Event)
    result: R | None = None
    error: BaseException | None = None

    def rouse(self) -> None:
        self.wake.set()
        self.wake = trio.Event()


@final
@attrs.define(eq=False)
class GroupCommit(Generic[T, R]):
    """Writes items in batches with ``write``: one batch at a time, the next one made of every item handed
    in while the one before was being written.

    Attributes:
        write: writes a batch (the items in the order they were handed in) and returns the batch's
            result, which every caller of the batch gets; an exception it raises is raised to each of them.
    """

    write: Callable[[list[T]], Awaitable[R]]
    _open: _Batch[T, R] = attrs.field(init=False, factory=_Batch)
    _writing: trio.Lock = attrs.field(init=False, factory=trio.Lock)
    #: How many batches were written (``statistics``-like, for tests and ``__repr__``).
    batches: int = attrs.field(init=False, default=0)

    def __repr__(self) -> str:
        state = "writing" if self._writing.locked() else "idle"
        return f"<GroupCommit {state}, {len(self._open.entries)} waiting, {self.batches} written>"

    async def submit(self, item: T) -> R:
        """Have ``item`` written, in the next batch; return that batch's result once it is written.

        Cancellation: before the batch's write begins, the item is taken out of it (nothing of it is
        written; a caller that was to write the batch hands that to another caller of it); once the write
        has begun, it goes on to its end (as a worker thread's write does) and the item is written.

        Raises:
            Whatever ``write`` raised for the batch.
        """
        batch = self._open
        entry = _Entry(item)
        batch.entries.append(entry)
        try:
            while not batch.done.is_set():
                if batch.led:
                    await batch.wake.wait()  # done, or its leader gave the lead up
                else:
                    batch.led = True
                    await self._lead(batch)
        except trio.Cancelled:
            if not batch.started:
                batch.entries.remove(entry)  # by identity: ``_Entry`` compares as objects do
            raise
        if batch.error is not None:
            raise batch.error
        return batch.result  # type: ignore[return-value]  # set by the write: ``R``, which may be None

    async def _lead(self, batch: _Batch[T, R]) -> None:
        """Write ``batch`` once the write before it has ended; cancelled while waiting for that, give the
        lead back (another caller of the batch takes it)."""
        try:
            await self._writing.acquire()
        except trio.Cancelled:
            batch.led = False
            batch.rouse()
            raise
        try:
            if self._open is batch:
                self._open = _Batch()  # closed: later items go to the next batch
            batch.started = True
            if batch.entries:
                with trio.CancelScope(shield=True):
                    try:
                        batch.result = await self.write([entry.item for entry in batch.entries])
                    except BaseException as exc:  # told to every caller of the batch
                        batch.error = exc
                self.batches += 1
        finally:
            self._writing.release()
            batch.done.set()
            batch.rouse()
