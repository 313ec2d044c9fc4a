"""Running a ``Command`` payload under the supervisor and turning how it ended into a pending fire."""

from __future__ import annotations

import errno
import functools
import os
import shlex

import trio

from .._errors import InvalidScheduleError, SpawnError
from .._spawn import describe_exec_failure, resolve_executable, shebang_interpreter
from .._supervisor import SpawnSpec, Supervisor
from ._events import PendingFire, exit_fire
from ._job import Command, CronJob
from ._log_files import command_log_paths, keep_within_cap, log_files, open_logs, trim_logs

__all__ = ["check_command_can_start", "run_command"]


def check_command_can_start(payload: object) -> None:
    """Check that a :class:`Command` payload's program is there now and can be run (an executable file,
    not a directory), found as its runs will look for it (``argv[0]`` in the engine's ``PATH``, or a path
    from the job's ``cwd``), as ``create`` finds out at once; other payloads pass. A script whose ``#!``
    line names an interpreter path that does not exist is refused too, as ``create`` refuses it.
    ``CronService`` calls this when a job is added or its payload replaced, not when it is loaded or fired
    (a program removed later makes that run's event say so).

    Raises:
        InvalidScheduleError: naming ``argv[0]`` and the fix.
    """
    if not isinstance(payload, Command):
        return
    program = payload.argv[0]
    cwd = payload.cwd if payload.cwd is not None else os.getcwd()
    try:
        path = resolve_executable(program, cwd, os.environ.get("PATH"))
    except SpawnError as exc:  # not in the engine's PATH
        raise InvalidScheduleError(f"payload argv[0]: {exc}") from None
    if not os.path.exists(path):
        err = errno.ENOENT
    elif os.path.isdir(path) or not os.access(path, os.X_OK):
        err = errno.EACCES
    elif _interpreter_missing(path):
        err = errno.ENOENT  # what its exec would say; described as a bad interpreter
    else:
        return
    raise InvalidScheduleError(f"payload argv[0]: {describe_exec_failure(err, program, path)}")


def _interpreter_missing(path: str) -> bool:
    """Whether the file's ``#!`` line names an interpreter by a path that does not exist."""
    interpreter = shebang_interpreter(path)
    return interpreter is not None and os.path.isabs(interpreter) and not os.path.exists(interpreter)


async def run_command(
    supervisor: Supervisor, state_dir: str, job: CronJob, payload: Command, *, log_cap_bytes: int = 50 * 2**20
) -> tuple[PendingFire, str | None]:
    """Run ``payload`` for ``job`` to its end; return its pending fire and what failed (``None``: exit 0).

    The command runs in scope ``cron:<job id>`` with its output in a fresh pair of log files, each kept
    within ``log_cap_bytes`` (bytes) while it runs (``_log_files``). A program that cannot be started is
    reported (reason ``"spawn_failed"``), not raised.

    Cancellation: the command is ended by escalation (shielded), then the cancellation propagates.
    """
    stdout, stderr = command_log_paths(state_dir, job.id)
    command = shlex.join(payload.argv)
    try:
        logs = open_logs(stdout, stderr)  # each run's pair starts empty
        try:
            files = log_files((stdout, stderr), logs)
            spec = SpawnSpec(
                argv=payload.argv, cwd=payload.cwd, stdout=logs[0], stderr=logs[1], scope_key=f"cron:{job.id}"
            )
            run = await supervisor.spawn(spec)
        finally:
            for fd in logs:
                os.close(fd)
    except SpawnError as exc:
        error = f"could not start {command!r}: {exc}"
        fire = exit_fire(
            job.name,
            command=command,
            exit_code=None,
            signal=None,
            reason="spawn_failed",
            duration_seconds=None,
            stdout_path=None,
            stderr_path=None,
            intro=error,
        )
        return fire, error
    async with trio.open_nursery() as nursery:
        nursery.start_soon(keep_within_cap, files, log_cap_bytes)
        try:
            result = await run.wait()
        except trio.Cancelled:  # the engine is closing, or the job was removed: end the command
            with trio.CancelScope(shield=True):
                await supervisor.cancel(run)
            raise
        finally:
            nursery.cancel_scope.cancel()
    await trim_logs(files, log_cap_bytes)
    read_logs = functools.partial(
        exit_fire,
        job.name,
        command=command,
        exit_code=result.exit_code,
        signal=result.signal,
        reason=result.reason.value,
        duration_seconds=result.duration_seconds,
        stdout_path=stdout,
        stderr_path=stderr,
    )
    fire = await trio.to_thread.run_sync(read_logs)
    return fire, None if result.exit_code == 0 else f"{command!r} {result.describe()}"
