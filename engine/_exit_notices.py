"""The exit notice of a subprocess created with ``notify_on_exit=True``: its own final exit as an event.

When the record's process exits for good on its own (after its last restart; not a kill or a halt a
caller asked for, nor the engine's stop), the service calls :func:`send_exit_notice`, which builds a fire
with ``job_id="subprocess:<first pid>"``, the project, the exit code or signal and the last lines of both
logs (read through the log pair: only the files the engine made), and hands it to
``CronService.notify``: persisted, then recorded in the event log and delivered as cron's fires are
(``engine.cron._notices``). The guardian and the start-up sweep end processes while no engine runs, so
those ends are never notified; nor is a process that exits while no engine runs (the engine's children
end with it).
"""

from __future__ import annotations

import shlex

from ._logs import STREAMS, LogSlice
from ._subprocesses import SubProcess, SubProcessService
from ._supervisor import RunExit
from .cron._events import TAIL_BYTES, TAIL_LINES, PendingFire, format_exit_text, new_fire_id
from .cron._service import CronService

__all__ = ["notice_job_id", "send_exit_notice"]


def notice_job_id(sp: SubProcess) -> str:
    """The ``job_id`` of ``sp``'s exit notice: ``subprocess:<first pid>``."""
    return f"subprocess:{sp.first_pid}"


async def send_exit_notice(
    cron: CronService, service: SubProcessService, sp: SubProcess, exit: RunExit
) -> None:
    """Build ``sp``'s exit notice and deliver it through ``cron`` (persisted first).

    Cancellation: once persisted, the notice is delivered at the next start.
    """
    tails: dict[str, LogSlice | None] = {}
    for stream in STREAMS:
        try:
            tails[stream] = await service._read(sp, stream, tail=TAIL_LINES, max_bytes=TAIL_BYTES)
        except LookupError:  # the log is gone
            tails[stream] = None
    out, err = tails["stdout"], tails["stderr"]
    command = shlex.join((sp.command, *sp.args))
    restarts = f" after {sp.restarts} restarts" if sp.restarts else ""
    status = sp._restart_status
    why = f" ({status})" if status and status.startswith("crash loop") else ""
    intro = f"Subprocess {sp.first_pid} of project {sp.project.slug} exited on its own{restarts}{why}."
    text = format_exit_text(
        command=command,
        exit_code=exit.exit_code,
        signal=exit.signal,
        reason=exit.reason.value,
        duration_seconds=exit.duration_seconds,
        stdout_tail=out.text if out is not None else "",
        stderr_tail=err.text if err is not None else "",
        stdout_cut_bytes=out.start_offset if out is not None else 0,
        stderr_cut_bytes=err.start_offset if err is not None else 0,
        intro=intro,
    )
    fire = PendingFire(
        fire_id=new_fire_id(),
        job_name=f"subprocess {sp.first_pid}",
        text=text,
        command=command,
        exit_code=exit.exit_code,
        signal=exit.signal,
        reason=exit.reason.value,
        duration_seconds=exit.duration_seconds,
        stdout_tail=out.text if out is not None else "",
        stderr_tail=err.text if err is not None else "",
        truncated=bool((out is not None and out.start_offset) or (err is not None and err.start_offset)),
    )
    await cron.notify(notice_job_id(sp), sp.project.id, fire)
