"""The task that follows one record of the subprocess service from its spawn to its last exit.

One per record that has a restart policy or an exit notice, in the service's nursery
(``SubProcessService._keep``); a record with neither has no task: its run calls :func:`finish` when its
process exits (``ManagedRun.on_leader_exit``). The keeper closes the record's stdin pipe
when its process exits, restarts the process by the record's policy (the decision is
:class:`~engine._restart.RestartTracker`'s; here only the waiting, the marker lines and the spawn), then,
for a ``notify_on_exit`` record whose final exit was its own, hands the exit to the engine's notice
sender (``engine._exit_notices``).
"""

from __future__ import annotations

import contextlib
import logging
from datetime import UTC, datetime
from typing import TYPE_CHECKING

import trio

from ._errors import EngineError
from ._subprocess_record import SubProcess
from ._supervisor import RunExit

if TYPE_CHECKING:
    from ._subprocesses import SubProcessService

__all__ = ["exited", "finish", "keep", "needs_task"]

_log = logging.getLogger("engine.subprocesses")


def _now() -> datetime:
    return datetime.now(UTC)


def needs_task(sp: SubProcess) -> bool:
    """Whether ``sp`` needs a keeper task (a restart policy, an exit notice); else its process's exit is
    followed by :func:`exited` as a hook of its run (``ManagedRun.on_leader_exit``), with no task."""
    return sp._restart is not None or sp.notify_on_exit


def exited(service: SubProcessService, sp: SubProcess) -> None:
    """What follows every exit of ``sp``'s process: the log cap looks again (it ends once no child is
    alive), and the stdin pipe is closed. Sync: a hook of the run for a record without a keeper task."""
    service._wake_capper()
    if sp._stdin is not None:
        ended = sp.exit
        how = "" if ended is None else f" ({ended.describe()}{', halted' if sp._ended_on_purpose else ''})"
        sp._stdin.close(f"the process ended{how}")


def finish(service: SubProcessService, sp: SubProcess) -> None:
    """The exit of a record that runs no more process and sends no notice: :func:`exited`, then the
    record is finished (``wait_finished`` returns)."""
    exited(service, sp)
    sp._final.set()


async def keep(service: SubProcessService, sp: SubProcess) -> None:
    """Follow ``sp`` from its spawn to its last exit: close its stdin when its process exits, restart
    it by its policy, then send its exit notice. One task per record, in the service's nursery.

    Cancellation: the service is closing; nothing more is restarted or sent.
    """
    while True:
        exit = await sp._run.wait_leader_exit()
        exited(service, sp)
        if sp._restart is None or not await _restart_after(service, sp, exit):
            break
    sp._final.set()
    if sp.notify_on_exit and not service._asked(sp, exit) and service.on_final_exit is not None:
        try:
            await service.on_final_exit(sp, exit)
        except Exception:
            _log.exception("the exit notice of subprocess %d could not be recorded", sp.first_pid)


async def _restart_after(service: SubProcessService, sp: SubProcess, exit: RunExit) -> bool:
    """Decide (``engine._restart``), wait the back-off, write the marker lines and spawn the next
    process into ``sp``; ``False`` when no restart happened."""
    tracker = sp._restart
    assert tracker is not None and sp._spec is not None
    decision = tracker.decide(
        exit_code=exit.exit_code, signal=exit.signal, asked=service._asked(sp, exit), now=trio.current_time()
    )
    sp._restart_status = decision.status
    sp._changed_at = _now()
    if not decision.restart:
        return False
    with trio.CancelScope() as scope:
        sp._backoff = scope
        try:
            await trio.sleep(decision.delay_seconds)
        finally:
            sp._backoff = None
    if scope.cancelled_caught or sp._removed or service._asked(sp, exit):
        return False
    sp._logs.append_line(tracker.marker(exit_code=exit.exit_code, signal=exit.signal))
    try:
        async with contextlib.AsyncExitStack() as undo:
            run, pipe = await service._spawn(sp._spec, sp._logs, stdin=sp._stdin is not None, undo=undo)
            if sp._removed or service._asked(sp, exit):
                return False  # a kill or halt came during the spawn: the undo ends the new process
            undo.pop_all()
    except (EngineError, OSError, RuntimeError) as exc:
        _log.warning("subprocess %d could not be restarted: %s", sp.first_pid, exc)
        sp._restart_status = f"restart failed: {exc}"
        return False
    sp._last_exit = exit
    sp._restarts += 1
    sp._run, sp._stdin = run, pipe
    sp._restart_status = None
    sp._changed_at = _now()
    service._start_capper()
    return True
