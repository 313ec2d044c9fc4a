"""Schedules and their maths: when does a job run next?

Everything here is pure and synchronous: wall time comes in as an argument, never from the system
clock, so the scheduler, the store and the property tests can all drive it.

Cron expressions are matched by cronsim in the job's time zone, on **wall time**: every wall time an
expression names runs once, at its first occurrence. In the autumn's repeated hour a wall time is
not run a second time (``30 1 * * *`` in America/New_York runs once on 2026-11-01, at 05:30Z); in the
spring's skipped hour the wall times that do not exist run once, at the first instant after the gap
(``30 2 * * *`` runs at 03:00 EDT on 2026-03-08). Debian cron and cronsim treat fixed-time jobs this
way; we apply the same rule to every expression, so no expression runs twice or silently skips.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import TypeAlias
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import attrs
from cronsim import CronSim, CronSimError

from .._errors import InvalidScheduleError

__all__ = [
    "MAX_EVERY_SECONDS",
    "MIN_EVERY_SECONDS",
    "At",
    "Cron",
    "Every",
    "OnExit",
    "Schedule",
    "check_on_exit_cwd",
    "compute_next_run_at",
    "next_run_after",
    "require_aware",
    "validate_schedule",
]

#: Candidates looked at before giving up on one computation (a repeated hour holds at most 60 for a
#: five-field expression; a gap maps at most a day of wall times onto one instant).
_MAX_CANDIDATES = 2000

#: The shortest interval of an :class:`Every`, in seconds: the timer's granularity. Shorter intervals
#: would only flood the event log (a fire is a store transaction and an event an agent must read).
MIN_EVERY_SECONDS = 1.0
#: The longest interval of an :class:`Every`, in seconds (ten years of 365.25 days). Longer ones run past
#: the range of ``datetime`` and are surely a unit mistake; use :class:`At` for a far single run.
MAX_EVERY_SECONDS = 10 * 365.25 * 86400


def require_aware(value: datetime, field: str) -> datetime:
    """Return ``value`` converted to UTC, or raise if it is naive.

    Raises:
        InvalidScheduleError: ``value`` has no time zone.
    """
    if not isinstance(value, datetime):
        raise InvalidScheduleError(f"{field} must be a datetime, got {value!r}")
    if value.tzinfo is None or value.utcoffset() is None:
        raise InvalidScheduleError(
            f"{field} must be an aware datetime (with a time zone), got naive {value.isoformat()}"
        )
    try:
        return value.astimezone(UTC)
    except OverflowError as exc:  # 0001-01-01 east of UTC, 9999-12-31 west of it
        raise InvalidScheduleError(f"{field} {value.isoformat()} is out of range in UTC") from exc


@attrs.frozen
class At:
    """Run once at ``at`` (aware; compared in UTC)."""

    at: datetime


@attrs.frozen
class Every:
    """Run every ``every_seconds``, on the grid ``anchor + k * every_seconds``.

    ``every_seconds`` is between :data:`MIN_EVERY_SECONDS` (1 s) and :data:`MAX_EVERY_SECONDS` (ten years).
    Without an anchor the grid starts at the job's creation time.
    """

    every_seconds: float
    anchor: datetime | None = None


@attrs.frozen
class Cron:
    """Run at the wall times a five-field cron expression names, in time zone ``tz`` (IANA name)."""

    expr: str
    tz: str = "UTC"


@attrs.frozen
class OnExit:
    """Run once when ``command`` (started in ``cwd``) exits; never fired by the timer.

    ``CronService.add`` (and ``update`` with a new schedule) requires ``cwd``, when given, to be an absolute
    path to an existing directory (:func:`check_on_exit_cwd`); a directory that vanishes later makes the
    watcher retry its spawn.
    """

    command: str
    cwd: str | None = None


Schedule: TypeAlias = At | Every | Cron | OnExit


def _zone(tz: str) -> ZoneInfo:
    if not isinstance(tz, str) or not tz.strip():
        raise InvalidScheduleError(f"tz must be an IANA time zone name such as 'Europe/Berlin', got {tz!r}")
    try:
        return ZoneInfo(tz)
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise InvalidScheduleError(
            f"tz {tz!r} is not a known time zone; use an IANA name such as 'America/New_York'"
        ) from exc


def _cronsim(expr: str, start: datetime) -> CronSim:
    try:
        return CronSim(expr, start)
    except CronSimError as exc:  # CronSimError is a bare Exception, not a ValueError
        raise InvalidScheduleError(f"expr {expr!r} is not a valid cron expression: {exc}") from exc


def validate_schedule(schedule: object) -> None:
    """Check a schedule's fields (not whether it still has a future run).

    Raises:
        InvalidScheduleError: naming the offending field.
    """
    if isinstance(schedule, At):
        require_aware(schedule.at, "at")
    elif isinstance(schedule, Every):
        seconds = schedule.every_seconds
        if isinstance(seconds, bool) or not isinstance(seconds, int | float):
            raise InvalidScheduleError(f"every_seconds must be a number, got {seconds!r}")
        # Compared without float(): a huge int is out of range, not an OverflowError; NaN fails both.
        if not MIN_EVERY_SECONDS <= seconds <= MAX_EVERY_SECONDS:
            raise InvalidScheduleError(
                f"every_seconds must be between {MIN_EVERY_SECONDS:g} and {MAX_EVERY_SECONDS:.0f} seconds "
                f"(ten years), got {seconds!r}"
            )
        if schedule.anchor is not None:
            require_aware(schedule.anchor, "anchor")
    elif isinstance(schedule, Cron):
        if not isinstance(schedule.expr, str) or len(schedule.expr.split()) != 5:
            raise InvalidScheduleError(
                "expr must have five fields (minute hour day-of-month month day-of-week), "
                f"got {schedule.expr!r}"
            )
        _zone(schedule.tz)
        _cronsim(schedule.expr, datetime(2000, 1, 1))
    elif isinstance(schedule, OnExit):
        if not isinstance(schedule.command, str) or not schedule.command.strip():
            raise InvalidScheduleError("command must be a non-empty shell command")
        if schedule.cwd is not None and (not isinstance(schedule.cwd, str) or not schedule.cwd):
            raise InvalidScheduleError(f"cwd must be a directory path or None, got {schedule.cwd!r}")
    else:
        raise InvalidScheduleError(f"schedule must be At, Every, Cron or OnExit, got {schedule!r}")


def check_on_exit_cwd(schedule: Schedule) -> None:
    """Check that an :class:`OnExit` schedule's ``cwd`` can be used now (other schedules pass).

    The engine runs the command, so a relative ``cwd`` would be read against the engine's directory, not
    the caller's: it must be absolute, and name an existing directory. ``CronService`` calls this when a
    schedule is added or replaced, not when a job is enabled or loaded (a directory may vanish later; the
    watcher then retries).

    Raises:
        InvalidScheduleError: naming ``cwd``.
    """
    if not isinstance(schedule, OnExit) or schedule.cwd is None:
        return
    cwd = schedule.cwd
    if not os.path.isabs(cwd):
        raise InvalidScheduleError(
            f"cwd {cwd!r} is relative; give an absolute directory path (the engine's cwd is not yours)"
        )
    if not os.path.isdir(cwd):
        if os.path.exists(cwd):
            raise InvalidScheduleError(f"cwd {cwd!r} is not a directory; give a directory or leave cwd out")
        raise InvalidScheduleError(f"cwd {cwd!r} does not exist; create it or leave cwd out")


def _exists(wall: datetime, zone: ZoneInfo) -> datetime | None:
    local = wall.replace(tzinfo=zone, fold=0)
    instant = local.astimezone(UTC)
    return instant if instant.astimezone(zone).replace(tzinfo=None) == wall else None


def _first_instant(wall: datetime, zone: ZoneInfo) -> datetime:
    """The first UTC instant at which the clocks of ``zone`` show ``wall`` (naive), or the end of its gap."""
    instant = _exists(wall, zone)
    if instant is not None:
        return instant
    # ``wall`` falls in a gap (spring forward): the first whole minute that exists after it, which is
    # the instant the gap ended (every transition since 1972 is on a whole minute), as cronsim does.
    probe = wall.replace(second=0, microsecond=0)
    for _ in range(48 * 60):
        probe += timedelta(minutes=1)
        instant = _exists(probe, zone)
        if instant is not None:
            return instant
    raise InvalidScheduleError(f"time zone {zone.key!r} has a gap longer than two days near {wall}")


def _cron_candidates(schedule: Cron, after: datetime) -> Iterator[datetime]:
    zone = _zone(schedule.tz)
    wall = after.astimezone(zone).replace(tzinfo=None)
    for candidate in _cronsim(schedule.expr, wall):
        yield _first_instant(candidate, zone)


def next_run_after(
    schedule: Schedule,
    now: datetime,
    *,
    last_run_at: datetime | None = None,
    default_anchor: datetime | None = None,
) -> datetime | None:
    """The next run time strictly after ``now`` and after ``last_run_at``, or ``None`` if there is none.

    This is :func:`compute_next_run_at` with the guards the scheduler needs: cronsim can return a time
    before its start inside a repeated hour, and a wall clock stepped back must not make a due time that
    already ran come round again.

    Args:
        schedule: the job's schedule.
        now: aware current wall time.
        last_run_at: aware time of the job's last run; no result is at or before it.
        default_anchor: grid origin for an :class:`Every` without an anchor (the job's creation time);
            ``None`` makes the grid start at ``now``.

    Raises:
        InvalidScheduleError: the schedule or a datetime is invalid.
    """
    validate_schedule(schedule)
    floor = require_aware(now, "now")
    if last_run_at is not None:
        floor = max(floor, require_aware(last_run_at, "last_run_at"))
    if isinstance(schedule, OnExit):
        return None
    if isinstance(schedule, At):
        at = require_aware(schedule.at, "at")
        return at if at > floor else None
    try:
        if isinstance(schedule, Every):
            return _next_every(schedule, floor, default_anchor)
        for count, instant in enumerate(_cron_candidates(schedule, floor)):
            if instant > floor:
                return instant
            if count >= _MAX_CANDIDATES:
                break
    except OverflowError as exc:  # past year 9999 (a stored last run far ahead, say)
        raise InvalidScheduleError(
            f"the next run after {floor.isoformat()} would fall beyond year 9999; check the schedule"
        ) from exc
    return None


def _next_every(schedule: Every, floor: datetime, default_anchor: datetime | None) -> datetime:
    period = timedelta(seconds=schedule.every_seconds)
    if schedule.anchor is not None:
        anchor = require_aware(schedule.anchor, "anchor")
    elif default_anchor is not None:
        anchor = require_aware(default_anchor, "default_anchor")
    else:
        anchor = floor
    if anchor > floor:
        return anchor
    steps = math.floor((floor - anchor) / period) + 1
    result = anchor + steps * period
    while result <= floor:  # float rounding of the division
        result += period
    return result


def compute_next_run_at(schedule: Schedule, now: datetime) -> datetime | None:
    """When ``schedule`` runs next after ``now``: an aware UTC datetime strictly after ``now``, or ``None``.

    ``None`` for :class:`OnExit` (the timer never fires it), for an :class:`At` not after ``now``, and
    for a cron expression that matches no time in the next 50 years. An :class:`Every` without anchor
    counts from ``now``.

    Args:
        schedule: an :class:`At`, :class:`Every`, :class:`Cron` or :class:`OnExit`.
        now: aware current wall time.

    Raises:
        InvalidScheduleError: a field of ``schedule`` is invalid (naming it) or ``now`` is naive.
    """
    return next_run_after(schedule, now)
