"""Jobs: the payloads a job delivers, the job record itself, and its JSON form for the store."""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any, TypeAlias

import attrs

from .._errors import InvalidScheduleError
from ._schedule import At, Cron, Every, OnExit, Schedule, require_aware, validate_schedule

__all__ = ["Command", "CronJob", "JobStatus", "Payload", "SystemEvent", "validate_payload"]


@attrs.frozen
class SystemEvent:
    """Deliver ``text`` to the agent (the event log, and ``on_fire`` when embedded)."""

    text: str


def _to_argv(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(value)


@attrs.frozen
class Command:
    """Run ``argv`` under the engine's supervisor, in ``cwd``, and deliver how it ended.

    Its output goes to ``<state_dir>/cron-logs/<job id>.stdout.log`` / ``.stderr.log`` (replaced at every
    run); the fired event carries the exit code or signal, the duration and the last lines of each stream.
    """

    argv: tuple[str, ...] = attrs.field(converter=_to_argv)
    cwd: str | None = None


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
    """Check a payload's fields.

    Raises:
        InvalidScheduleError: naming the offending field.
    """
    if isinstance(payload, SystemEvent):
        if not isinstance(payload.text, str) or not payload.text.strip():
            raise InvalidScheduleError("text must be a non-empty string")
    elif isinstance(payload, Command):
        if not payload.argv or not all(isinstance(a, str) for a in payload.argv) or not payload.argv[0]:
            raise InvalidScheduleError(f"argv must be a non-empty sequence of strings, got {payload.argv!r}")
        if payload.cwd is not None and (not isinstance(payload.cwd, str) or not payload.cwd):
            raise InvalidScheduleError(f"cwd must be a directory path or None, got {payload.cwd!r}")
    else:
        raise InvalidScheduleError(f"payload must be SystemEvent or Command, got {payload!r}")


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def _parse_time(value: object, field: str) -> datetime | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError(f"{field} must be an ISO 8601 string, got {value!r}")
    return require_aware(datetime.fromisoformat(value), field)


def _req_time(value: object, field: str) -> datetime:
    parsed = _parse_time(value, field)
    if parsed is None:
        raise ValueError(f"{field} is missing")
    return parsed


def schedule_to_dict(schedule: Schedule) -> dict[str, Any]:
    """The JSON form of a schedule."""
    if isinstance(schedule, At):
        return {"kind": "at", "at": schedule.at.isoformat()}
    if isinstance(schedule, Every):
        return {"kind": "every", "every_seconds": schedule.every_seconds, "anchor": _iso(schedule.anchor)}
    if isinstance(schedule, Cron):
        return {"kind": "cron", "expr": schedule.expr, "tz": schedule.tz}
    return {"kind": "on_exit", "command": schedule.command, "cwd": schedule.cwd}


def schedule_from_dict(data: Mapping[str, Any]) -> Schedule:
    """A schedule from its JSON form.

    Raises:
        ValueError: the data does not describe a valid schedule (``InvalidScheduleError`` is one).
    """
    kind = data["kind"]
    schedule: Schedule
    if kind == "at":
        schedule = At(at=_req_time(data["at"], "at"))
    elif kind == "every":
        schedule = Every(
            every_seconds=data["every_seconds"], anchor=_parse_time(data.get("anchor"), "anchor")
        )
    elif kind == "cron":
        schedule = Cron(expr=data["expr"], tz=data["tz"])
    elif kind == "on_exit":
        schedule = OnExit(command=data["command"], cwd=data.get("cwd"))
    else:
        raise ValueError(f"unknown schedule kind {kind!r}")
    validate_schedule(schedule)
    return schedule


def payload_to_dict(payload: Payload) -> dict[str, Any]:
    """The JSON form of a payload."""
    if isinstance(payload, SystemEvent):
        return {"kind": "system_event", "text": payload.text}
    return {"kind": "command", "argv": list(payload.argv), "cwd": payload.cwd}


def payload_from_dict(data: Mapping[str, Any]) -> Payload:
    """A payload from its JSON form.

    Raises:
        ValueError: the data does not describe a valid payload.
    """
    kind = data["kind"]
    payload: Payload
    if kind == "system_event":
        payload = SystemEvent(text=data["text"])
    elif kind == "command":
        payload = Command(argv=tuple(data["argv"]), cwd=data.get("cwd"))
    else:
        raise ValueError(f"unknown payload kind {kind!r}")
    validate_payload(payload)
    return payload


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
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CronJob:
        """A job from :meth:`to_dict`'s form, checked field by field.

        Raises:
            ValueError: a field is missing or invalid (the store reports the row and skips it).
        """
        try:
            status = data.get("last_status")
            errors = data.get("consecutive_errors", 0)
            if isinstance(errors, bool) or not isinstance(errors, int) or errors < 0:
                raise ValueError(f"consecutive_errors must be an integer >= 0, got {errors!r}")
            for field in ("id", "name"):
                if not isinstance(data[field], str) or not data[field]:
                    raise ValueError(f"{field} must be a non-empty string")
            for field in ("enabled", "delete_after_run"):
                if not isinstance(data[field], bool):
                    raise ValueError(f"{field} must be true or false")
            return cls(
                id=data["id"],
                name=data["name"],
                enabled=data["enabled"],
                schedule=schedule_from_dict(data["schedule"]),
                payload=payload_from_dict(data["payload"]),
                delete_after_run=data["delete_after_run"],
                created_at=_req_time(data["created_at"], "created_at"),
                updated_at=_req_time(data["updated_at"], "updated_at"),
                next_run_at=_parse_time(data.get("next_run_at"), "next_run_at"),
                last_run_at=_parse_time(data.get("last_run_at"), "last_run_at"),
                last_status=None if status is None else JobStatus(status),
                last_error=data.get("last_error"),
                consecutive_errors=errors,
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a valid job record: {exc!r}") from exc
