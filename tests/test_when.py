"""Times as people type them (``engine/_when.py``): durations, cron nicknames, ``--at`` and zones."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine import Cron, InvalidArgumentError
from engine._when import (
    CRON_NICKNAMES,
    expand_cron,
    format_duration,
    read_at,
    read_duration,
    read_zone,
    show_moment,
)

NOW = datetime(2030, 1, 31, 10, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90", 90.0),
        ("1.5", 1.5),
        ("5m", 300.0),
        ("1h30m", 5400.0),
        ("1h 30m", 5400.0),
        ("2d", 172800.0),
        ("1w", 604800.0),
        ("0.5s", 0.5),
        ("1H", 3600.0),
        (" 10s ", 10.0),
    ],
)
def test_read_duration_takes_seconds_and_units(text: str, seconds: float) -> None:
    assert read_duration(text, "--every") == seconds


@pytest.mark.parametrize("text", ["5x", "", "h", "1h5", "-5m", "nan", "inf", "5 minutes", "1e400s"])
def test_read_duration_refuses_what_is_no_duration_naming_the_option(text: str) -> None:
    with pytest.raises(InvalidArgumentError, match=r"^--every must be .* such as 90, 5m, 1h30m"):
        read_duration(text, "--every")


@pytest.mark.parametrize("text", ["1h1h", "30m1h", "5s5m", "1d1w"])
def test_read_duration_takes_each_unit_once_largest_first(text: str) -> None:
    with pytest.raises(InvalidArgumentError, match=r"^--every takes units largest first, each once"):
        read_duration(text, "--every")


@given(st.integers(min_value=0, max_value=10 * 365 * 86400))
def test_format_duration_reads_back(seconds: int) -> None:
    assert read_duration(format_duration(seconds), "x") == seconds


def test_expand_cron_maps_nicknames_to_five_fields_cron_accepts() -> None:
    assert expand_cron("@hourly") == "0 * * * *"
    assert expand_cron("@DAILY") == "0 0 * * *"
    assert expand_cron("*/5 * * * *") == "*/5 * * * *"
    for nickname in CRON_NICKNAMES:
        Cron(expand_cron(nickname))  # the engine's own check of five fields
    with pytest.raises(InvalidArgumentError, match="@reboot is not a schedule"):
        expand_cron("@reboot")
    with pytest.raises(InvalidArgumentError, match="@hourly"):
        expand_cron("@fortnightly")


@pytest.mark.parametrize(
    ("text", "zone", "expected"),
    [
        ("2030-02-01T09:00+01:00", None, "2030-02-01T09:00:00+01:00"),
        ("2030-02-01T09:00Z", None, "2030-02-01T09:00:00+00:00"),
        ("2030-02-01T09:00[Europe/Paris]", None, "2030-02-01T09:00:00+01:00"),
        ("2030-07-01 09:00 [Europe/Paris]", None, "2030-07-01T09:00:00+02:00"),
        ("2030-02-01T09:00", "America/New_York", "2030-02-01T09:00:00-05:00"),
        ("09:00", "Europe/Paris", "2030-02-01T09:00:00+01:00"),  # 09:00 in Paris has passed today
        ("12:30", "UTC", "2030-01-31T12:30:00+00:00"),
        ("+10m", None, "2030-01-31T10:10:00+00:00"),
        ("+1h30m", "Asia/Tokyo", "2030-01-31T11:30:00+00:00"),
    ],
)
def test_read_at_reads_offsets_zones_times_of_day_and_durations(
    text: str, zone: str | None, expected: str
) -> None:
    assert read_at(text, zone=zone, now=lambda: NOW).isoformat() == expected


def test_read_at_without_a_zone_is_local_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TZ", "Asia/Tokyo")
    assert read_at("2030-02-01T09:00", now=lambda: NOW).utcoffset() == timedelta(hours=9)


@pytest.mark.parametrize(
    ("text", "zone", "message"),
    [
        ("tomorrow", None, "--at must be an ISO 8601 time"),
        ("25:00", None, "is not a time of day"),
        ("2030-02-01T09:00+01:00", "Europe/Paris", "has an offset already"),
        ("2030-02-01T09:00[Europe/Paris]", "Asia/Tokyo", "give one of them"),
        ("2030-02-01T09:00[Mars/Olympus]", None, "IANA time zone"),
        ("09:00", "Nowhere/City", "IANA time zone"),
        ("+99999999999d", None, "at most ten years ahead"),
        ("+3653d", None, "at most ten years ahead"),
        ("2030-03-31T02:30", "Europe/Paris", "does not exist in Europe/Paris"),
        ("2030-03-10T02:30[America/New_York]", None, "does not exist in America/New_York"),
    ],
)
def test_read_at_refuses_with_what_to_type(text: str, zone: str | None, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        read_at(text, zone=zone, now=lambda: NOW)


def test_show_moment_shows_the_zone() -> None:
    assert show_moment("2030-02-01T08:00:00+00:00", "Europe/Paris") == "2030-02-01 09:00:00 CET"
    assert show_moment("2030-07-01T08:00:00+00:00", "Europe/Paris") == "2030-07-01 10:00:00 CEST"
    assert show_moment("2030-07-01T08:00:00+00:00", "UTC") == "2030-07-01 08:00:00 UTC"
    assert show_moment(None) == "-" and show_moment("not a time") == "not a time"
    moment = datetime(2030, 7, 1, 8, tzinfo=timezone(timedelta(hours=2)))
    assert show_moment(moment.isoformat(), "Asia/Tokyo") == "2030-07-01 15:00:00 JST"


def test_read_zone_names_the_option() -> None:
    assert read_zone("Europe/Paris").key == "Europe/Paris"
    with pytest.raises(InvalidArgumentError, match=r"^--tz must be an IANA time zone"):
        read_zone("Europe/Atlantis")
