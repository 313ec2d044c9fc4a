"""The engine's exception types.

Every error derives from :class:`EngineError` and also from the standard-library type a caller would
naturally catch (``OSError``, ``LookupError``, ``ValueError``, ``RuntimeError``), the way trio's
``BusyResourceError`` is a ``RuntimeError``.
"""

from __future__ import annotations

from typing import NoReturn

__all__ = [
    "EngineError",
    "EngineLockedError",
    "InvalidArgumentError",
    "InvalidScheduleError",
    "JobNotFoundError",
    "KillInProgressError",
    "LimitExceededError",
    "SpawnError",
    "StoreError",
    "SubProcessNotFoundError",
    "UntrustedPathError",
]


class EngineError(Exception):
    """The root of every error the engine raises on purpose."""


class SpawnError(EngineError, OSError):
    """Raised by ``Supervisor.spawn`` and ``SubProcessService.create`` when a child cannot be started.

    Nothing is registered when this is raised: no run, no record, no log file is left behind.

    Attributes:
        errno: the ``errno`` value of the failure (``ENOENT``, ``EACCES``, ...) or ``None``.
        filename: the path the failure concerns (the executable or the working directory).
        reason: a short lowercase phrase, e.g. ``"command not found"``.
    """

    def __init__(self, message: str, *, errno: int | None = None, path: str | None = None, reason: str = ""):
        super().__init__(errno, message, path)
        self.message = message
        self.reason = reason

    def __str__(self) -> str:
        return self.message


class SubProcessNotFoundError(EngineError, LookupError):
    """Raised by ``SubProcessService`` methods when a pid names no managed subprocess (or it was killed)."""


class JobNotFoundError(EngineError, LookupError):
    """Raised by ``CronService`` methods when a job id names no job in the store."""


class InvalidScheduleError(EngineError, ValueError):
    """Raised when a schedule or payload is invalid: a bad cron expression, unknown time zone, and so on.

    The schedule and payload classes (``At``, ``Every``, ``Cron``, ``OnExit``, ``SystemEvent``,
    ``Command``) raise it when they are made with invalid fields; ``CronService`` raises it for a schedule
    that cannot run (an ``at`` in the past, an on-exit ``cwd`` that is no directory).
    """


class InvalidArgumentError(EngineError, ValueError):
    """Raised when an argument that is not a schedule is invalid: a name, a flag, a pid, a cursor, a path.

    Raised by the library's public functions (``SubProcessService.create``, ``read_log``,
    ``CronService.add``/``update``/``events``, ``Project``) and by the one reader of loose input
    (``engine._input``) the tool, the RPC methods, MCP and the CLI share. The message names the argument
    and says what to send instead. A string holding NUL or a lone surrogate (not UTF-8 text) is one.
    """


class LimitExceededError(EngineError, RuntimeError):
    """Raised when an ``EngineConfig`` cap (e.g. ``max_processes_per_project``) would be exceeded."""


class StoreError(EngineError, OSError):
    """Raised by a job store when a read or a write transaction fails; nothing of the write is kept."""


class KillInProgressError(EngineError, RuntimeError):
    """Raised by ``SubProcessService.create`` while ``kill_all`` (or ``kill_project`` of the same project)
    is ending processes; nothing was started. Create again once it has returned."""


class UntrustedPathError(EngineError, PermissionError):
    """Raised when a path the engine would act on is not its own to trust.

    The state directory and what the engine keeps in it (the lock, the job store, the socket and its
    pointer file, ``groups/``), and the log folders under a project (``.gadget``,
    ``subprocess-logs``): each must be owned by the engine's uid, not writable by group or others, and
    the kind of file expected, never a symbolic link. Raised by ``open_engine`` at start, by
    ``SubProcessService.create`` for a log folder, and by the clients before they trust the state
    directory's pointer file. The message names the path and says how to fix it. See
    ``docs/security.md``.
    """


class EngineLockedError(EngineError, RuntimeError):
    """Raised by ``open_engine`` when another engine holds the state directory's lock."""


def unwrap_single(group: BaseExceptionGroup[BaseException]) -> NoReturn:
    """Raise the one leaf exception of a nursery's group, or the group itself when there are several.

    ``open_supervisor`` uses it so that an exception raised in the caller's block comes out as itself,
    not wrapped in an ``ExceptionGroup`` by the nursery around the block. The leaf keeps what it
    carried: its ``__cause__``, its ``__context__`` (a ``raise`` inside an ``except`` block would
    otherwise replace it with the group) and its traceback, to which the re-raise only adds frames;
    trio's ``raise_single_exception_from_group`` keeps them the same way.

    Raises:
        BaseException: the leaf, or ``group`` when it holds more than one exception.
    """
    leaf: BaseException = group
    while isinstance(leaf, BaseExceptionGroup) and len(leaf.exceptions) == 1:
        leaf = leaf.exceptions[0]
    context = leaf.__context__
    try:
        raise leaf
    finally:
        leaf.__context__ = context
        del leaf, context, group  # no reference cycle through this frame
