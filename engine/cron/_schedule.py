"""Schedules and their maths: when does a job run next?

Everything here is pure and synchronous: wall time comes in as an argument, never from the system
clock, so the scheduler, the store and the property tests can all drive it.

Cron expressions are matched by cronsim in the job's time zone. Across a daylight-saving change the
hour field decides (docs/guide-cron.md):

- **Real time**: an hour field of ``*``, alone or with a step (``*/2``), follows the clock of the
  world. A wall time that occurs twice (the autumn's repeated hour) runs each time it occurs; one that
  does not exist (the spring's gap) is skipped. ``0 * * * *`` in America/New_York runs 25 times on
  2026-11-01, 3600 s apart, and 23 times on 2026-03-08; ``*/30 * * * *`` runs every 30 real minutes.
- **Fixed hour**: any other hour field (``1``, ``1,13``, ``1-23/2``) names wall times, each run once,
  at its first occurrence: the repeated ``30 1 * * *`` runs once on 2026-11-01 (05:30Z), and a wall
  time in the gap runs once at the first instant after it (``30 2 * * *`` at 03:00 EDT on 2026-03-08,
  07:00Z; ``*/20 1 * * *`` three times on 2026-11-01). Debian cron treats fixed-time jobs this way.

Either way no due time runs twice and none is silently lost to a repeated or skipped hour.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any, TypeAlias, TypeVar
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import attrs
from cronsim import CronSim, CronSimError

from .._errors import InvalidArgumentError, InvalidScheduleError
from .._input import check_argument, check_optional_text, check_text, show
from .._when import TEN_YEARS_SECONDS
from ._shell import MAX_COMMAND_BYTES

__all__ = [
    "MAX_CRON_EXPR_CHARS",
    "MAX_EVERY_SECONDS",
    "MAX_TZ_CHARS",
    "MIN_EVERY_SECONDS",
    "At",
    "Cron",
    "Every",
    "OnExit",
    "Schedule",
    "check_on_exit_cwd",
    "checked_field",
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
MAX_EVERY_SECONDS = TEN_YEARS_SECONDS
#: The longest time zone name of a :class:`Cron` (IANA names have at most about 40 characters).
MAX_TZ_CHARS = 64
#: The longest cron expression of a :class:`Cron`.
MAX_CRON_EXPR_CHARS = 1000

#: An hour field that follows real time across DST: ``*`` alone or with a step.
_REAL_TIME_HOURS = re.compile(r"\*(/\d+)?")
#: Offset changes a real-time search crosses at most (two a year in most zones: a century).
_MAX_OFFSET_CHANGES = 200
#: The step at which a real-time search looks for offset changes between two instants: two changes
#: less than a day apart would be missed (no zone has had them).
_OFFSET_PROBE = timedelta(days=1)

_T = TypeVar("_T")
_Validator: TypeAlias = Callable[[Any, "attrs.Attribute[Any]", Any], None]


def checked_field(check: Callable[[object, str], object]) -> _Validator:
    """An attrs validator running one check of :mod:`engine._input` on a schedule or payload field.

    The check's :class:`~engine.InvalidArgumentError` comes out as :class:`~engine.InvalidScheduleError`
    (same message, naming the field).
    """

    def validate(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
        _schedule_check(check, value, attribute.name)

    return validate


def _schedule_check(check: Callable[[object, str], _T], value: object, field: str) -> _T:
    try:
        return check(value, field)
    except InvalidArgumentError as exc:
        raise InvalidScheduleError(str(exc)) from None


def _shell_command(value: object, field: str) -> str:
    # One argument of a program, less the wrapper's first line that travels in it (``_shell``).
    return check_argument(
        check_text(value, field), field, max_bytes=MAX_COMMAND_BYTES, what="an on-exit command"
    )


def require_aware(value: datetime, field: str) -> datetime:
    """Return ``value`` converted to UTC, or raise if it is naive.

    Raises:
        InvalidScheduleError: ``value`` has no time zone.
    """
    if not isinstance(value, datetime):
        raise InvalidScheduleError(f"{field} must be a datetime, got {show(value)}")
    if value.tzinfo is None or value.utcoffset() is None:
        raise InvalidScheduleError(
            f"{field} must be an aware datetime (with a time zone), got naive {value.isoformat()}"
        )
    try:
        return value.astimezone(UTC)
    except OverflowError as exc:  # 0001-01-01 east of UTC, 9999-12-31 west of it
        raise InvalidScheduleError(f"{field} {value.isoformat()} is out of range in UTC") from exc


def _aware(_inst: object, attribute: attrs.Attribute[Any], value: datetime) -> None:
    require_aware(value, attribute.name)


def _interval(_inst: object, _attribute: attrs.Attribute[Any], seconds: object) -> None:
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        raise InvalidScheduleError(f"every_seconds must be a number, got {show(seconds)}")
    # Compared without float(): a huge int is out of range, not an OverflowError; NaN fails both.
    if not MIN_EVERY_SECONDS <= seconds <= MAX_EVERY_SECONDS:
        raise InvalidScheduleError(
            f"every_seconds must be between {MIN_EVERY_SECONDS:g} and {MAX_EVERY_SECONDS:.0f} seconds "
            f"(ten years), got {show(seconds)}"
        )


def _expression(_inst: object, _attribute: attrs.Attribute[Any], value: object) -> None:
    expr = _schedule_check(check_text, value, "expr")
    if len(expr) > MAX_CRON_EXPR_CHARS or len(expr.split()) != 5:
        raise InvalidScheduleError(
            f"expr must have five fields (minute hour day-of-month month day-of-week), got {show(expr)}"
        )
    _cronsim(expr, datetime(2000, 1, 1))


def _time_zone(_inst: object, _attribute: attrs.Attribute[Any], tz: object) -> None:
    _zone(tz)


@attrs.frozen
class At:
    """Run once at ``at`` (aware; compared in UTC).

    Raises:
        InvalidScheduleError: ``at`` is not an aware datetime.
    """

    at: datetime = attrs.field(validator=_aware)


@attrs.frozen
class Every:
    """Run every ``every_seconds``, on the grid ``anchor + k * every_seconds``.

    ``every_seconds`` is between :data:`MIN_EVERY_SECONDS` (1 s) and :data:`MAX_EVERY_SECONDS` (ten years).
    Without an anchor the grid starts at the job's creation time.

    Raises:
        InvalidScheduleError: the interval is out of range, or ``anchor`` is not an aware datetime.
    """

    every_seconds: float = attrs.field(validator=_interval)
    anchor: datetime | None = attrs.field(default=None, validator=attrs.validators.optional(_aware))


@attrs.frozen
class Cron:
    """Run at the wall times a five-field cron expression names, in time zone ``tz`` (IANA name).

    Raises:
        InvalidScheduleError: the expression is not five valid fields, or ``tz`` is no known zone.
    """

    expr: str = attrs.field(validator=_expression)
    tz: str = attrs.field(default="UTC", validator=_time_zone)


@attrs.frozen
class OnExit:
    """Run once when ``command`` (started in ``cwd``) exits; never fired by the timer.

    ``CronService.add`` (and ``update`` with a new schedule) requires ``cwd``, when given, to be an absolute
    path to an existing directory (:func:`check_on_exit_cwd`); a directory that vanishes later makes the
    watcher retry its spawn.

    Raises:
        InvalidScheduleError: ``command`` is blank or longer than one argument may be, or ``cwd`` is
            not a non-empty string.
    """

    command: str = attrs.field(validator=checked_field(_shell_command))
    cwd: str | None = attrs.field(default=None, validator=checked_field(check_optional_text))


Schedule: TypeAlias = At | Every | Cron | OnExit


def _zone(tz: object) -> ZoneInfo:
    if not isinstance(tz, str) or not tz.strip() or len(tz) > MAX_TZ_CHARS:
        raise InvalidScheduleError(
            f"tz must be an IANA time zone name of at most {MAX_TZ_CHARS} characters such as "
            f"'Europe/Berlin', got {show(tz)}"
        )
    _schedule_check(check_text, tz, "tz")
    try:
        return ZoneInfo(tz)
    except (ZoneInfoNotFoundError, ValueError, OSError) as exc:
        raise InvalidScheduleError(
            f"tz {show(tz)} is not a known time zone; use an IANA name such as 'America/New_York'"
        ) from exc


def _cronsim(expr: str, start: datetime) -> CronSim:
    try:
        return CronSim(expr, start)
    except CronSimError as exc:  # CronSimError is a bare Exception, not a ValueError
        reason = str(exc)
        fields = expr.split()
        if reason == "Bad day-of-month" and len(fields) == 5:
            # cronsim refuses a day no named month has (30 February) with the words of a bad number
            with contextlib.suppress(CronSimError):
                CronSim(" ".join([*fields[:3], "*", fields[4]]), start)
                reason = "none of its months has that day of the month, so it would never run"
        raise InvalidScheduleError(f"expr {show(expr)} is not a valid cron expression: {reason}") from exc


def validate_schedule(schedule: object) -> None:
    """Check that ``schedule`` is one of the schedule classes (each checks its fields when made).

    Raises:
        InvalidScheduleError: it is not an :class:`At`, :class:`Every`, :class:`Cron` or :class:`OnExit`.
    """
    if not isinstance(schedule, At | Every | Cron | OnExit):
        raise InvalidScheduleError(f"schedule must be At, Every, Cron or OnExit, got {show(schedule)}")


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


def follows_real_time(schedule: Cron) -> bool:
    """Whether ``schedule``'s hour field is ``*`` or ``*/n``: it then follows real time across DST."""
    return _REAL_TIME_HOURS.fullmatch(schedule.expr.split()[1]) is not None


def _offset_change(zone: ZoneInfo, start: datetime, end: datetime, offset: timedelta) -> datetime | None:
    """The first instant in ``(start, end]`` (aware UTC) at which ``zone``'s offset is no longer
    ``offset``, to the second, or ``None``."""

    def differs(instant: datetime) -> bool:
        return instant.astimezone(zone).utcoffset() != offset

    low = start
    while low < end:
        high = min(end, low + _OFFSET_PROBE)
        if differs(high):
            while high - low > timedelta(seconds=1):
                middle = low + (high - low) / 2
                if differs(middle):
                    high = middle
                else:
                    low = middle
            return high.replace(microsecond=0)  # changes fall on whole seconds, in (high - 1 s, high]
        low = high
    return None


def _next_real_time(schedule: Cron, floor: datetime) -> datetime | None:
    """The first instant strictly after ``floor`` whose wall time in the job's zone matches (real time).

    Between two offset changes wall time is UTC plus a constant: the first matching wall time of that
    stretch, minus its offset, is the answer if no change comes before it; else the search goes on
    from the change, where the wall clock jumps (a gap skipped, or a repeated hour run again).
    """
    zone = _zone(schedule.tz)
    start, inclusive = floor, False
    for _ in range(_MAX_OFFSET_CHANGES):
        offset = start.astimezone(zone).utcoffset()
        assert offset is not None
        wall = (start + offset).replace(tzinfo=None)
        if inclusive:
            wall -= timedelta(microseconds=1)
        candidate = next(iter(_cronsim(schedule.expr, wall)), None)
        if candidate is None:
            return None
        instant = (candidate - offset).replace(tzinfo=UTC)
        change = _offset_change(zone, start, instant, offset)
        if change is None:
            return instant
        start, inclusive = change, True
    return None


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
        if follows_real_time(schedule):
            return _next_real_time(schedule, floor)
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
