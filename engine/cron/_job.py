"""Jobs: the payloads a job delivers, the job record itself, and its JSON form for the store."""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any, TypeAlias

import attrs

from .._errors import InvalidScheduleError
from .._input import (
    check_argument,
    check_flag,
    check_int,
    check_optional_text,
    check_string,
    check_strings,
    check_text,
    read_moment,
    read_payload,
    read_schedule,
    show,
)
from ._schedule import At, Cron, Every, Schedule, checked_field

__all__ = ["Command", "CronJob", "JobStatus", "Payload", "SystemEvent", "validate_payload"]


@attrs.frozen
class SystemEvent:
    """Deliver ``text`` to the agent (the event log, and ``on_fire`` when embedded).

    Raises:
        InvalidScheduleError: ``text`` is blank, or holds NUL or a lone surrogate.
    """

    text: str = attrs.field(validator=checked_field(check_text))


def _to_argv(value: Iterable[str]) -> tuple[str, ...]:
    if isinstance(value, list | tuple):
        return tuple(value)
    return value  # type: ignore[return-value]  # anything else: the validator names it


def _argv(value: object, field: str) -> tuple[str, ...]:
    argv = check_strings(value, field, non_empty=True, item=check_argument)
    check_text(argv[0], f"{field}[0]")
    return argv


@attrs.frozen
class Command:
    """Run ``argv`` under the engine's supervisor, in ``cwd``, and deliver how it ended.

    Its output goes to ``<state_dir>/cron-logs/<job id>.stdout.log`` / ``.stderr.log`` (replaced at every
    run); the fired event carries the exit code or signal, the duration and the last lines of each stream.

    Raises:
        InvalidScheduleError: ``argv`` is not a non-empty sequence of strings naming a program, or
            ``cwd`` is not a non-empty string.
    """

    argv: tuple[str, ...] = attrs.field(converter=_to_argv, validator=checked_field(_argv))
    cwd: str | None = attrs.field(default=None, validator=checked_field(check_optional_text))


Payload: TypeAlias = SystemEvent | Command


class JobStatus(enum.Enum):
    """How a job's last run went (``CronJob.last_status``)."""

    OK = "ok"
    ERROR = "error"
    #: claimed by the run pipeline and not finished yet.
    RUNNING = "running"
    #: the engine stopped (shut down or crashed) while the run was under way.
    INTERRUPTED = "interrupted"


def validate_payload(payload: object) -> None:
    """Check that ``payload`` is one of the payload classes (each checks its fields when made).

    Raises:
        InvalidScheduleError: it is not a :class:`SystemEvent` or :class:`Command`.
    """
    if not isinstance(payload, SystemEvent | Command):
        raise InvalidScheduleError(f"payload must be SystemEvent or Command, got {show(payload)}")


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def _parse_time(value: object, field: str) -> datetime | None:
    return None if value is None else read_moment(value, field)


def schedule_to_dict(schedule: Schedule) -> dict[str, Any]:
    """The JSON form of a schedule."""
    if isinstance(schedule, At):
        return {"kind": "at", "at": schedule.at.isoformat()}
    if isinstance(schedule, Every):
        return {"kind": "every", "every_seconds": schedule.every_seconds, "anchor": _iso(schedule.anchor)}
    if isinstance(schedule, Cron):
        return {"kind": "cron", "expr": schedule.expr, "tz": schedule.tz}
    return {"kind": "on_exit", "command": schedule.command, "cwd": schedule.cwd}


def payload_to_dict(payload: Payload) -> dict[str, Any]:
    """The JSON form of a payload."""
    if isinstance(payload, SystemEvent):
        return {"kind": "system_event", "text": payload.text}
    return {"kind": "command", "argv": list(payload.argv), "cwd": payload.cwd}


@attrs.frozen
class CronJob:
    """One scheduled job and its run state, as the store holds it.

    Attributes:
        id: unique id, given by ``CronService.add``.
        name: a human label.
        enabled: whether the timer (or an exit watcher) may fire it.
        schedule: :class:`At`, :class:`Every`, :class:`Cron` or :class:`OnExit`.
        payload: :class:`SystemEvent` or :class:`Command`.
        delete_after_run: remove a one-shot job once it ran successfully.
        created_at: aware UTC time of ``add``.
        updated_at: aware UTC time of the last change of any field.
        next_run_at: when the timer fires it next (``None``: never, e.g. disabled or on-exit).
        last_run_at: when it last started running; no run happens for a due time at or before it.
        last_status: how the last run went, or ``None`` before the first.
        last_error: what went wrong in the last run, or ``None``.
        consecutive_errors: failed runs in a row (drives the back-off of recurring jobs).
        project: the id of the project the job belongs to (``Project.id``; an MCP session or an RPC
            client that named a project), or ``None`` for a job added without one (the CLI, the library).
            The MCP cron tools of a project see and touch only its jobs. It never changes.
        owner: the id of the engine that added the job (``EngineConfig.engine_id``), or ``None`` for a job
            added before engines had ids. On a fleet store only the owner runs a ``Command`` payload or an
            on-exit schedule; a ``SystemEvent`` job on a timed schedule floats (any engine fires it). It
            never changes.
    """

    id: str
    name: str
    enabled: bool
    schedule: Schedule
    payload: Payload
    delete_after_run: bool
    created_at: datetime
    updated_at: datetime
    next_run_at: datetime | None = None
    last_run_at: datetime | None = None
    last_status: JobStatus | None = None
    last_error: str | None = None
    consecutive_errors: int = 0
    project: str | None = None
    owner: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON form the store keeps (times as ISO 8601 strings)."""
        return {
            "id": self.id,
            "name": self.name,
            "enabled": self.enabled,
            "schedule": schedule_to_dict(self.schedule),
            "payload": payload_to_dict(self.payload),
            "delete_after_run": self.delete_after_run,
            "created_at": self.created_at.isoformat(),
            "updated_at": self.updated_at.isoformat(),
            "next_run_at": _iso(self.next_run_at),
            "last_run_at": _iso(self.last_run_at),
            "last_status": None if self.last_status is None else self.last_status.value,
            "last_error": self.last_error,
            "consecutive_errors": self.consecutive_errors,
            "project": self.project,
            "owner": self.owner,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CronJob:
        """A job from :meth:`to_dict`'s form, checked field by field.

        Raises:
            ValueError: a field is missing or invalid (the store reports the row and skips it).
        """
        try:
            status = data.get("last_status")
            last_error = data.get("last_error")
            return cls(
                id=check_text(data["id"], "id"),
                name=check_text(data["name"], "name"),
                enabled=check_flag(data["enabled"], "enabled"),
                schedule=read_schedule(data["schedule"]),
                payload=read_payload(data["payload"]),
                delete_after_run=check_flag(data["delete_after_run"], "delete_after_run"),
                created_at=read_moment(data["created_at"], "created_at"),
                updated_at=read_moment(data["updated_at"], "updated_at"),
                next_run_at=_parse_time(data.get("next_run_at"), "next_run_at"),
                last_run_at=_parse_time(data.get("last_run_at"), "last_run_at"),
                last_status=None if status is None else JobStatus(status),
                last_error=None if last_error is None else check_string(last_error, "last_error"),
                consecutive_errors=check_int(data.get("consecutive_errors", 0), "consecutive_errors"),
                project=check_optional_text(data.get("project"), "project"),
                owner=check_optional_text(data.get("owner"), "owner"),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a valid job record: {exc!r}") from exc
