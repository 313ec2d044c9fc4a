"""Work a batch of escalations hands to worker threads (``_escalation_batch``): the work that blocks in
the kernel without the GIL, such as a cgroup leaf's ``rmdir`` (some 20-60 us of kernel time each), done
off the driver's loop while the driver goes on with its pass.

Each pass of the driver that hands work over gets one worker thread, started by the first work handed,
fed through a queue; the pass's end tells it to stop once it has done what it was given
(:meth:`HandOff.end_pass`). An error of a work is given back, in the Trio thread, to the member that
handed it (``failed``), as the work's error in the pass itself would have been.
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from typing import Generic, TypeVar, final

import attrs
import trio

__all__ = ["HandOff"]

M = TypeVar("M")


@final
@attrs.define(eq=False)
class HandOff(Generic[M]):
    """The worker threads of one batch (see the module).

    Attributes:
        failed: called in the Trio thread with the member and the error of a work that raised.
    """

    failed: Callable[[M, BaseException], None]
    #: the work handed over in this pass goes to its worker thread through this queue
    _queue: queue.SimpleQueue[tuple[M, Callable[[], object]] | None] | None = None
    #: worker threads still at work, and the event set when none is left
    _threads: int = 0
    _threads_done: trio.Event = attrs.field(factory=trio.Event)

    def hand(self, member: M, work: Callable[[], object]) -> None:
        """Have ``work`` (``member``'s) done by this pass's worker thread, started by the first work
        handed over: it overlaps the rest of the pass and the next ones."""
        if self._queue is None:
            self._queue = self._start_thread()
        self._queue.put((member, work))

    def _start_thread(self) -> queue.SimpleQueue[tuple[M, Callable[[], object]] | None]:
        todo: queue.SimpleQueue[tuple[M, Callable[[], object]] | None] = queue.SimpleQueue()
        failed: list[tuple[M, BaseException]] = []
        token = trio.lowlevel.current_trio_token()

        def send() -> None:
            while (item := todo.get()) is not None:
                member, work = item
                try:
                    work()
                except Exception as exc:  # given to the member, as the work's error in its own pass would be
                    failed.append((member, exc))

        def deliver(_outcome: object) -> None:
            token.run_sync_soon(self._done, failed)

        self._threads += 1
        trio.lowlevel.start_thread_soon(send, deliver)
        return todo

    def end_pass(self) -> None:
        """The pass is over: its thread ends once it has done what it was handed."""
        if self._queue is not None:
            self._queue.put(None)
            self._queue = None

    def _done(self, failed: list[tuple[M, BaseException]]) -> None:
        self._threads -= 1
        for member, exc in failed:
            self.failed(member, exc)
        if not self._threads:
            done, self._threads_done = self._threads_done, trio.Event()
            done.set()

    async def wait_idle(self) -> None:
        """Wait until no worker thread is at work (no work is left in flight once the batch is over).

        Cancellation: callers run this inside a shielded cancel scope.
        """
        while self._threads:
            await self._threads_done.wait()
