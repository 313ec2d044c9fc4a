"""Times as people type them at a terminal: ``5m``, ``1h30m``, ``@daily``, ``09:00 Europe/Paris``.

The command line reads its schedule options here and sends the engine what its readers take (a number
of seconds, a five-field cron expression, an ISO 8601 time with an offset), so nothing new crosses the
socket:

- :func:`read_duration`: a number of seconds (``90``, ``1.5``) or a duration of units ``w d h m s``
  (``5m``, ``1h30m``, ``2d``, ``1h 30m``), as systemd's time spans are written.
- :func:`expand_cron`: a five-field expression as it is, or one of the nicknames of Vixie cron (``@hourly``
  ``@daily`` ``@midnight`` ``@weekly`` ``@monthly`` ``@yearly`` ``@annually``) as its five fields;
  cronsim takes only the fields.
- :func:`read_at`: one moment: ISO 8601 with an offset (``2030-01-31T09:00+01:00``, ``...Z``), a wall time
  (``2030-01-31 09:00``, ``09:00``: the next one) in a zone (``--tz``, an RFC 9557 suffix
  ``2030-01-31T09:00[Europe/Paris]``, else the local zone), or ``+DURATION`` from now.
- :func:`show_moment`: an ISO time for a table, in a zone, with the zone's abbreviation.

Standard library only: the client commands import it. Errors are :class:`~engine.InvalidArgumentError`
naming the option and showing what to type.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta, tzinfo
from typing import Final
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from ._errors import InvalidArgumentError
from ._input import read_seconds, show

__all__ = [
    "CRON_NICKNAMES",
    "UNIT_SECONDS",
    "expand_cron",
    "format_duration",
    "read_at",
    "read_duration",
    "read_zone",
    "show_moment",
]

#: Seconds per unit of a duration.
UNIT_SECONDS: Final[Mapping[str, int]] = {"w": 604800, "d": 86400, "h": 3600, "m": 60, "s": 1}
#: The nicknames Vixie cron takes, as the five fields they stand for (``@reboot`` is no schedule).
CRON_NICKNAMES: Final[Mapping[str, str]] = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}

#: The farthest ahead a schedule reaches, in seconds (ten years of 365.25 days): the longest ``--every``
#: (``cron._schedule.MAX_EVERY_SECONDS``) and the longest ``--at +DURATION``. Longer is surely a unit mistake.
TEN_YEARS_SECONDS: Final = 10 * 365.25 * 86400

_NUMBER = r"(?:\d+(?:\.\d*)?|\.\d+)"
_PART = re.compile(rf"\s*({_NUMBER})\s*([wdhms])", re.IGNORECASE)
_UNIT_ORDER = "wdhms"
_WALL_TIME = re.compile(r"(\d{1,2}):(\d{2})(?::(\d{2}))?")
_ZONE_SUFFIX = re.compile(r"\[([^\]]+)\]$")


def read_duration(text: str, field: str) -> float:
    """Seconds from ``90``, ``1.5``, ``5m``, ``1h30m``, ``1h 30m``, ``2d`` or ``1w`` (finite, >= 0).

    Raises:
        InvalidArgumentError: not a number of seconds nor a duration with units ``w d h m s``.
    """
    stripped = text.strip()
    try:
        return read_seconds(float(stripped), field)
    except ValueError:
        pass  # not a plain number: a duration with units
    total = 0.0
    at = 0
    units = ""
    while at < len(stripped):
        part = _PART.match(stripped, at)
        if part is None:
            break
        unit = part.group(2).lower()
        if units and _UNIT_ORDER.index(unit) <= _UNIT_ORDER.index(units[-1]):
            raise InvalidArgumentError(
                f"{field} takes units largest first, each once (1h30m, not 30m1h or 1h1h), got {show(text)}"
            )
        units += unit
        total += float(part.group(1)) * UNIT_SECONDS[unit]
        at = part.end()
    if at == 0 or stripped[at:].strip():
        raise InvalidArgumentError(
            f"{field} must be a number of seconds or a duration such as 90, 5m, 1h30m or 2d, got {show(text)}"
        )
    return read_seconds(total, field)


def format_duration(seconds: float) -> str:
    """``3723`` -> ``1h2m3s``, ``90`` -> ``1m30s``, ``0.5`` -> ``0.5s``: as :func:`read_duration` reads."""
    if seconds < 60 and not float(seconds).is_integer():
        return f"{seconds:g}s"
    rest = round(seconds)
    parts = []
    for unit in ("d", "h", "m", "s"):
        count, rest = divmod(rest, UNIT_SECONDS[unit])
        if count:
            parts.append(f"{count}{unit}")
    return "".join(parts) or "0s"


def expand_cron(expr: str, field: str = "--cron") -> str:
    """``expr`` as five cron fields: a nickname (``@daily``) becomes its fields, anything else is kept.

    Raises:
        InvalidArgumentError: ``@reboot``, or a nickname cron does not know.
    """
    stripped = expr.strip()
    if not stripped.startswith("@"):
        return expr
    fields = CRON_NICKNAMES.get(stripped.lower())
    if fields is not None:
        return fields
    if stripped.lower() == "@reboot":
        raise InvalidArgumentError(
            f"{field} @reboot is not a schedule here; run the command with `gadget-engine create` instead"
        )
    raise InvalidArgumentError(
        f"{field} must be five fields or one of {', '.join(CRON_NICKNAMES)}, got {show(expr)}"
    )


def read_zone(name: str, field: str = "--tz") -> ZoneInfo:
    """The IANA zone ``name`` (``Europe/Paris``, ``UTC``).

    Raises:
        InvalidArgumentError: no such zone on this machine.
    """
    try:
        return ZoneInfo(name.strip())
    except (ZoneInfoNotFoundError, ValueError):
        raise InvalidArgumentError(
            f"{field} must be an IANA time zone such as Europe/Paris or UTC, got {show(name)}"
        ) from None


def _local_zone() -> tzinfo:
    """The local zone with its rules (``$TZ``, else ``/etc/localtime``), else today's fixed offset."""
    name = os.environ.get("TZ", "").removeprefix(":")
    try:
        if name:
            return ZoneInfo(name)
        with open("/etc/localtime", "rb") as f:
            return ZoneInfo.from_file(f, key="localtime")
    except (OSError, ValueError, ZoneInfoNotFoundError):
        zone = datetime.now().astimezone().tzinfo
        assert zone is not None
        return zone


def read_at(
    text: str, *, zone: str | None = None, now: Callable[[], datetime] = lambda: datetime.now(UTC)
) -> datetime:
    """The aware moment ``--at`` names.

    Args:
        text: ISO 8601 with an offset or ``Z``; a wall time without one (``2030-01-31T09:00``,
            ``2030-01-31 09:00``), optionally followed by ``[ZONE]``; ``HH:MM[:SS]`` alone (its next
            occurrence); or ``+DURATION`` (``+10m``) from now.
        zone: the zone of a wall time (``--tz``); ``None``: the ``[ZONE]`` suffix, else the local zone.
        now: the current time (aware), for ``HH:MM`` and ``+DURATION``.

    Raises:
        InvalidArgumentError: none of these forms, an unknown zone, or an offset and a zone that disagree.
    """
    stripped = text.strip()
    if stripped.startswith("+"):
        ahead = read_duration(stripped[1:], "--at +DURATION")
        if ahead > TEN_YEARS_SECONDS:
            raise InvalidArgumentError(f"--at +DURATION must be at most ten years ahead, got {show(text)}")
        return now() + timedelta(seconds=ahead)
    suffix = _ZONE_SUFFIX.search(stripped)
    named = read_zone(suffix.group(1), "--at [ZONE]") if suffix else None
    if suffix is not None:
        stripped = stripped[: suffix.start()].strip()
    if named is not None and zone is not None and read_zone(zone).key != named.key:
        raise InvalidArgumentError(f"--at names the zone {named.key} and --tz {zone}; give one of them")
    where = named or (read_zone(zone) if zone is not None else _local_zone())
    wall = _WALL_TIME.fullmatch(stripped)
    if wall is not None:
        hour, minute, second = (int(g) if g else 0 for g in wall.groups())
        if hour > 23 or minute > 59 or second > 59:
            raise InvalidArgumentError(f"--at {show(text)} is not a time of day")
        today = now().astimezone(where)
        moment = today.replace(hour=hour, minute=minute, second=second, microsecond=0)
        return moment if moment > today else moment + timedelta(days=1)
    try:
        moment = datetime.fromisoformat(stripped)
    except ValueError:
        raise InvalidArgumentError(
            "--at must be an ISO 8601 time (2030-01-31T09:00, with an offset or a [Zone]), "
            f"HH:MM or +DURATION, got {show(text)}"
        ) from None
    if moment.tzinfo is None:
        aware = moment.replace(tzinfo=where)
        if aware.astimezone(UTC).astimezone(where).replace(tzinfo=None) != moment:
            raise InvalidArgumentError(
                f"--at {show(text)} does not exist in {getattr(where, 'key', where)}: the clocks skip it "
                "(a daylight saving change); give a time after the gap, or an offset"
            )
        return aware
    if named is not None or zone is not None:
        raise InvalidArgumentError(
            f"--at {show(text)} has an offset already; leave out the zone, or the offset"
        )
    return moment


def show_moment(value: object, zone: str | None = None) -> str:
    """An ISO 8601 time as ``2030-01-31 09:00:00 CET``: in ``zone`` (an IANA name), else the local zone.

    A value that is not an ISO time is shown as it is (``-`` for ``None``).
    """
    if not isinstance(value, str):
        return "-"
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        return value
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    where: tzinfo
    try:
        where = ZoneInfo(zone) if zone else _local_zone()
    except (ZoneInfoNotFoundError, ValueError):
        where = _local_zone()
    local = moment.astimezone(where)
    return f"{local:%Y-%m-%d %H:%M:%S} {local.tzname() or format(local, '%z')}"
