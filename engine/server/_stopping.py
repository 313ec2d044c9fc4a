"""How ``serve`` is asked to stop, and how a second signal forces the stop.

``serve`` stops gracefully on the first SIGTERM, SIGHUP or SIGINT (:data:`STOP_SIGNALS`), or when the
``engine.stop`` method asks (:class:`StopRequest`): every child is ended by escalation and reaped, but the
watched on-exit commands, left running for the next engine. The agents' subprocesses are ended first,
while the requests waiting for them are still answered (:func:`end_subprocesses`); the rest when the
engine closes. A further signal during that stop (:func:`force_on_next_signal`) sends SIGKILL to every
child still running or being ended; the watched commands are still left running. ``docs/guide-cli.md``
has the table. Before it listens (the start-up sweep, :func:`stop_while_starting`), the first signal
cuts the start short: the sweep ends what it ends, and the engine closes without listening; a further
signal ends the sweep's grace period (SIGKILL at once).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import threading
from collections.abc import AsyncIterator
from typing import Any, Final, final

import attrs
import trio

from .._lockfile import STOPPING, mark_phase
from .._subprocesses import SubProcessService
from .._supervisor import RunState, Supervisor
from ._eventlog import log_event

__all__ = ["STOP_SIGNALS", "StopRequest", "end_subprocesses", "force_on_next_signal", "stop_while_starting"]

#: The signals that stop ``serve`` gracefully; another one during the stop forces it.
STOP_SIGNALS: Final = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@final
@attrs.define(eq=False)
class StopRequest:
    """What asked ``serve`` to stop: a signal or the ``engine.stop`` method; the first request counts.

    Attributes:
        reason: the fields of the ``stopping`` log line (``signal=SIGTERM``, or ``request=engine.stop``),
            ``None`` until asked.
    """

    reason: dict[str, Any] | None = None
    _asked: trio.Event = attrs.field(init=False, factory=trio.Event)

    def request(self, **reason: Any) -> None:
        """Ask for the stop (a later request changes nothing)."""
        if self.reason is None:
            self.reason = reason
            self._asked.set()

    def by_method(self, end_watched: bool) -> None:
        """``Methods.stop``: the ``engine.stop`` method asked (its watched commands already ended)."""
        self.request(request="engine.stop", end_watched=end_watched)

    async def wait(self, signals: AsyncIterator[int]) -> dict[str, Any]:
        """Wait for the first stop signal or request; return its reason.

        Cancellation: safe; a signal that arrives meanwhile stays queued in ``signals``.
        """
        async with trio.open_nursery() as nursery:

            async def on_signal() -> None:
                async for signum in signals:
                    self.request(signal=signal.Signals(signum).name)
                    return

            nursery.start_soon(on_signal)
            await self._asked.wait()
            nursery.cancel_scope.cancel()
        assert self.reason is not None
        return self.reason


async def end_subprocesses(service: SubProcessService, supervisor: Supervisor) -> None:
    """A graceful stop's first step: end the run of every subprocess of ``service`` by escalation (SIGINT,
    grace, SIGKILL, the wait after it) and return once each is reaped.

    ``serve`` runs it while its connections are still open, so that the requests waiting for one of those
    ends (a ``kill`` or ``halt`` in its grace period, a ``kill_all``, a ``wait``) are answered as they
    would be without the stop: a run a request is ending already is waited for, not signalled again.
    Restarts are called off first (``SubProcessService.call_off_restarts``: a record waiting out its
    back-off ends at once, and its ``wait`` answers), and each run ends with reason ``cancelled``, so none
    is restarted; a run that started meanwhile (a ``create`` under way at the stop) is ended too. The
    records and their logs stay until the engine closes (its ``kill_all``), and the commands of cron jobs
    are ended by the cron service as it closes (their jobs then show "interrupted"; nothing fires).

    Cancellation: as ``Supervisor.cancel_many``: the runs are still ended and reaped, then it propagates.
    """
    service.call_off_restarts()  # a record waiting out its restart back-off ends now, unrestarted
    while runs := [
        run for scope in {sp.project.scope_key for sp in service.ps()} for run in supervisor.runs(scope)
    ]:
        await supervisor.cancel_many(runs)
    await trio.lowlevel.checkpoint()


async def force_on_next_signal(signals: AsyncIterator[int], supervisor: Supervisor) -> None:
    """During a graceful stop: at each further signal, end every child with SIGKILL now, but the watched.

    Every run still running or being ended gets ``Supervisor.cancel(run, force=True)``: no more grace.
    Watched on-exit commands (``outlive_engine_crash``) are left running, as in any stop, unless one is
    already being ended on purpose (a job removed, ``engine.stop`` with ``end_watched``).

    Cancellation: stops listening; kills already sent stand.
    """
    async for signum in signals:
        log_event("forced", level=logging.WARNING, signal=signal.Signals(signum).name)
        async with trio.open_nursery() as nursery:
            for run in supervisor.runs():
                if not run.outlive_engine_crash or run.state is RunState.EXITING:  # ended on purpose
                    nursery.start_soon(functools.partial(supervisor.cancel, run, force=True))


async def stop_while_starting(
    signals: AsyncIterator[int], start: trio.CancelScope, force_sweep: threading.Event, state_dir: str
) -> None:
    """While ``serve`` starts (``open_engine``: the start-up sweep, the services): the first stop signal
    cancels ``start``, so the engine closes as soon as the sweep is over, without listening; each further
    one sets ``force_sweep``, which ends the sweep's grace period (SIGKILL at once, ``_sweep.SWEEP_FORCE``).

    The first signal is logged as ``stopping`` (``phase=starting``) and the lock file's phase becomes
    ``stopping`` at once, so that a client waiting for the engine to answer (``start``) waits for its exit
    instead; further ones as ``forced``.

    Cancellation: ``serve`` cancels it once the engine is open; a signal not read yet stays queued in
    ``signals`` for the stop that follows.
    """
    async for signum in signals:
        name = signal.Signals(signum).name
        if not start.cancel_called:
            log_event("stopping", signal=name, pid=os.getpid(), phase="starting")
            with contextlib.suppress(OSError):  # what clients are told, not the stop itself
                mark_phase(state_dir, STOPPING)
            start.cancel()
        else:
            log_event("forced", level=logging.WARNING, signal=name, phase="starting")
            force_sweep.set()
