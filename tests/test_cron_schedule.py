"""Schedule maths (``engine/cron/_schedule.py``) and the scheduler's decisions (``engine/cron/_plan.py``)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine import At, Cron, CronJob, Every, InvalidScheduleError, OnExit, SystemEvent, compute_next_run_at
from engine.cron._job import JobStatus
from engine.cron._plan import (
    BACKOFF_SECONDS,
    claim,
    claim_and_finish,
    finish,
    is_due,
    next_wake,
    should_delete,
)
from engine.cron._schedule import (
    MAX_EVERY_SECONDS,
    MIN_EVERY_SECONDS,
    check_on_exit_cwd,
    follows_real_time,
    next_run_after,
)

T0 = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)


def utc(year: int, month: int, day: int, hour: int = 0, minute: int = 0) -> datetime:
    return datetime(year, month, day, hour, minute, tzinfo=UTC)


def runs(schedule: Cron, start: datetime, end: datetime) -> list[datetime]:
    """Every run between ``start`` and ``end`` as the scheduler takes them (each after the last run)."""
    out: list[datetime] = []
    now, last = start, None
    while True:
        nxt = next_run_after(schedule, now, last_run_at=last)
        if nxt is None or nxt > end:
            return out
        out.append(nxt)
        now = last = nxt


def walls(instants: list[datetime], tz: str) -> list[str]:
    return [i.astimezone(ZoneInfo(tz)).strftime("%m-%d %H:%M") for i in instants]


# -- every / at / on-exit ----------------------------------------------------------------------------


def test_every_without_anchor_counts_from_now() -> None:
    assert compute_next_run_at(Every(90), T0) == T0 + timedelta(seconds=90)


def test_every_with_anchor_stays_on_its_grid() -> None:
    anchor = T0 - timedelta(seconds=25)
    assert compute_next_run_at(Every(10, anchor=anchor), T0) == T0 + timedelta(seconds=5)
    # exactly on a grid point: strictly after now
    assert compute_next_run_at(Every(10, anchor=anchor), T0 + timedelta(seconds=5)) == T0 + timedelta(
        seconds=15
    )
    # an anchor in the future is the first run
    assert compute_next_run_at(Every(10, anchor=T0 + timedelta(hours=1)), T0) == T0 + timedelta(hours=1)


def test_every_never_at_or_before_last_run() -> None:
    anchor = T0
    nxt = next_run_after(Every(60, anchor=anchor), T0, last_run_at=T0 + timedelta(seconds=130))
    assert nxt == T0 + timedelta(seconds=180)


def test_at_in_future_and_past() -> None:
    at = T0 + timedelta(minutes=5)
    assert compute_next_run_at(At(at), T0) == at
    assert compute_next_run_at(At(at), at) is None
    assert compute_next_run_at(At(T0 - timedelta(seconds=1)), T0) is None


def test_compute_next_run_at_returns_aware_utc() -> None:
    berlin = datetime(2026, 6, 1, 14, 0, tzinfo=ZoneInfo("Europe/Berlin"))
    result = compute_next_run_at(At(berlin + timedelta(hours=1)), berlin)
    assert result is not None and result.tzinfo is UTC and result == utc(2026, 6, 1, 13, 0)
    cron = compute_next_run_at(Cron("0 9 * * *", "Asia/Tokyo"), T0)
    assert cron == utc(2026, 6, 2, 0, 0) and cron.tzinfo is UTC


def test_on_exit_has_no_next_run() -> None:
    assert compute_next_run_at(OnExit("make test"), T0) is None


# -- cron across DST ---------------------------------------------------------------------------------


def test_cron_fall_back_new_york_runs_once_in_repeated_hour() -> None:
    found = runs(Cron("30 1 * * *", "America/New_York"), utc(2026, 10, 31, 0, 0), utc(2026, 11, 3, 0, 0))
    # croniter runs it at 05:30Z and again at 06:30Z on 11-01; we run it once, at the first 01:30.
    assert found == [utc(2026, 10, 31, 5, 30), utc(2026, 11, 1, 5, 30), utc(2026, 11, 2, 6, 30)]


def test_cron_fall_back_now_inside_repeated_hour() -> None:
    sched = Cron("30 1 * * *", "America/New_York")
    # 06:10Z is 01:10 EST, the second pass of 01:xx; cronsim alone answers 05:30Z, before now.
    assert compute_next_run_at(sched, utc(2026, 11, 1, 6, 10)) == utc(2026, 11, 2, 6, 30)
    # 05:40Z is 01:40 EDT, after the first 01:30: the repeated 01:30 (06:30Z) does not count again.
    assert compute_next_run_at(sched, utc(2026, 11, 1, 5, 40)) == utc(2026, 11, 2, 6, 30)
    # ... and once 01:30 EDT ran, the last-run guard holds even if the clock is stepped back.
    assert next_run_after(sched, utc(2026, 11, 1, 5, 0), last_run_at=utc(2026, 11, 1, 5, 30)) == utc(
        2026, 11, 2, 6, 30
    )


def test_cron_fall_back_fixed_hour_once_per_wall_time_wildcard_hour_in_real_time() -> None:
    found = runs(Cron("*/20 1 * * *", "America/New_York"), utc(2026, 11, 1, 4, 0), utc(2026, 11, 1, 12, 0))
    assert walls(found, "America/New_York") == ["11-01 01:00", "11-01 01:20", "11-01 01:40"]
    # The hour field is `*`: real time, so the repeated 01:00 runs again (EDT, then EST).
    hourly = runs(Cron("0 * * * *", "America/New_York"), utc(2026, 11, 1, 4, 30), utc(2026, 11, 1, 9, 30))
    assert walls(hourly, "America/New_York") == [
        "11-01 01:00",
        "11-01 01:00",
        "11-01 02:00",
        "11-01 03:00",
        "11-01 04:00",
    ]
    assert hourly == [utc(2026, 11, 1, h) for h in range(5, 10)]


def test_cron_spring_forward_new_york_runs_skipped_time_after_gap() -> None:
    found = runs(Cron("30 2 * * *", "America/New_York"), utc(2026, 3, 7, 0, 0), utc(2026, 3, 10, 0, 0))
    # 02:30 does not exist on 03-08: it runs at 03:00 EDT (07:00Z), not silently skipped.
    assert found == [utc(2026, 3, 7, 7, 30), utc(2026, 3, 8, 7, 0), utc(2026, 3, 9, 6, 30)]
    several = runs(Cron("*/20 2 * * *", "America/New_York"), utc(2026, 3, 8, 5, 0), utc(2026, 3, 8, 12, 0))
    assert several == [utc(2026, 3, 8, 7, 0)]  # 02:00, 02:20, 02:40 coalesce into one run after the gap


def test_cron_berlin_spring_forward_and_fall_back() -> None:
    spring = runs(Cron("30 2 * * *", "Europe/Berlin"), utc(2026, 3, 28, 0, 0), utc(2026, 3, 31, 0, 0))
    assert spring == [utc(2026, 3, 28, 1, 30), utc(2026, 3, 29, 1, 0), utc(2026, 3, 30, 0, 30)]
    autumn = runs(Cron("30 2 * * *", "Europe/Berlin"), utc(2026, 10, 24, 0, 0), utc(2026, 10, 27, 0, 0))
    assert autumn == [utc(2026, 10, 24, 0, 30), utc(2026, 10, 25, 0, 30), utc(2026, 10, 26, 1, 30)]
    # now inside Berlin's repeated hour (02:10 CET, second pass)
    assert compute_next_run_at(Cron("30 2 * * *", "Europe/Berlin"), utc(2026, 10, 25, 1, 10)) == utc(
        2026, 10, 26, 1, 30
    )


@pytest.mark.parametrize(
    ("tz", "start", "end"),
    [
        ("America/New_York", utc(2026, 3, 7), utc(2026, 3, 10)),
        ("America/New_York", utc(2026, 10, 31), utc(2026, 11, 3)),
        ("Europe/Berlin", utc(2026, 3, 28), utc(2026, 3, 31)),
        ("Europe/Berlin", utc(2026, 10, 24), utc(2026, 10, 27)),
        ("Australia/Lord_Howe", utc(2026, 4, 3), utc(2026, 4, 6)),  # a 30-minute change
    ],
)
def test_cron_every_quarter_hour_follows_real_time_across_dst(
    tz: str, start: datetime, end: datetime
) -> None:
    found = runs(Cron("*/15 * * * *", tz), start, end)
    # Every 15 real minutes, whatever the clocks of the zone do: no gap, no duplicate.
    assert {b - a for a, b in itertools.pairwise(found)} == {timedelta(minutes=15)}
    assert found[0] - start <= timedelta(minutes=15) and end - found[-1] < timedelta(minutes=15)
    zone = ZoneInfo(tz)
    for instant in found:
        assert instant.astimezone(zone).minute % 15 == 0


def test_cr06_row4_hourly_new_york_follows_real_time() -> None:
    """CR-06 row 4: 25 fires on the fall-back day, 3600 s apart; 23 on the spring-forward day."""
    sched = Cron("0 * * * *", "America/New_York")
    autumn = runs(sched, utc(2026, 11, 1, 4, 0) - timedelta(seconds=1), utc(2026, 11, 2, 4, 0))
    assert len(autumn) == 25 and (autumn[0], autumn[-1]) == (utc(2026, 11, 1, 4), utc(2026, 11, 2, 4))
    assert {(b - a).total_seconds() for a, b in itertools.pairwise(autumn)} == {3600.0}
    assert utc(2026, 11, 1, 6) in autumn  # the second 01:00 (EST)
    spring = runs(sched, utc(2026, 3, 8, 5, 0) - timedelta(seconds=1), utc(2026, 3, 9, 3, 0))
    assert len(spring) == 23 and (spring[0], spring[-1]) == (utc(2026, 3, 8, 5), utc(2026, 3, 9, 3))
    assert "03-08 02:00" not in walls(spring, "America/New_York")  # 02:00 does not exist: skipped
    assert compute_next_run_at(sched, utc(2026, 11, 1, 5, 0)) == utc(2026, 11, 1, 6, 0)


def test_cr06_row5_half_hourly_melbourne_every_30_real_minutes() -> None:
    """CR-06 row 5: DST ends at 16:00Z on 2026-04-04 in Melbourne; no 60- or 90-minute gap, no duplicate."""
    found = runs(Cron("*/30 * * * *", "Australia/Melbourne"), utc(2026, 4, 4, 14, 30), utc(2026, 4, 4, 17, 0))
    assert found == [
        utc(2026, 4, 4, 15),
        utc(2026, 4, 4, 15, 30),
        utc(2026, 4, 4, 16),
        utc(2026, 4, 4, 16, 30),
        utc(2026, 4, 4, 17),
    ]


def test_cr06_fixed_hour_expressions_keep_their_rule() -> None:
    ny = "America/New_York"
    assert runs(Cron("30 1 * * *", ny), utc(2026, 11, 1, 4), utc(2026, 11, 2, 4)) == [utc(2026, 11, 1, 5, 30)]
    assert len(runs(Cron("*/20 1 * * *", ny), utc(2026, 11, 1, 4), utc(2026, 11, 2, 4))) == 3
    assert runs(Cron("30 2 * * *", ny), utc(2026, 3, 8, 5), utc(2026, 3, 9, 4)) == [utc(2026, 3, 8, 7)]
    # A stepped range is a fixed hour: 01:00 runs once on the fall-back day.
    odd = runs(Cron("0 1-23/2 * * *", ny), utc(2026, 11, 1, 4), utc(2026, 11, 2, 4))
    assert walls(odd, ny)[:2] == ["11-01 01:00", "11-01 03:00"] and len(odd) == 12
    assert not follows_real_time(Cron("0 1-23/2 * * *")) and not follows_real_time(Cron("0 9 * * *"))
    assert follows_real_time(Cron("0 * * * *")) and follows_real_time(Cron("5 */2 * * *"))


# -- validation --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: Cron("61 * * * *"), "expr"),
        (lambda: Cron("* * * *"), "expr"),
        (lambda: Cron("@daily"), "expr"),
        (lambda: Cron("0 0 31 2 *"), "expr"),
        (lambda: Cron("0 9 * * *", "Mars/Olympus"), "tz"),
        (lambda: Cron("0 9 * * *", ""), "tz"),
        (lambda: Cron("0 9 * * *", "Europe/" + "x" * 300), "tz"),  # was an OSError (name too long)
        (lambda: Cron("0 9 * * *", "../../etc/passwd"), "tz"),
        (lambda: Cron("0 9 * * \udcff"), "expr"),
        (lambda: Cron("0 9 * * *", "UTC\0"), "tz"),
        (lambda: Every(0), "every_seconds"),
        (lambda: Every(-5), "every_seconds"),
        (lambda: Every(float("nan")), "every_seconds"),
        (lambda: Every(float("inf")), "every_seconds"),
        (lambda: Every(float("-inf")), "every_seconds"),
        (lambda: Every(1e-9), "every_seconds"),  # was a ZeroDivisionError
        (lambda: Every(0.999), "every_seconds"),  # below the 1 s minimum
        (lambda: Every(1e308), "every_seconds"),  # was an OverflowError
        (lambda: Every(MAX_EVERY_SECONDS + 1), "every_seconds"),
        (lambda: Every(10**400), "every_seconds"),  # an int too large for a float
        (lambda: Every("60"), "every_seconds"),  # type: ignore[arg-type]  # invalid on purpose
        (lambda: Every(True), "every_seconds"),
        (lambda: Every(10, anchor=datetime(2026, 1, 1)), "anchor"),
        (lambda: At(datetime(2026, 1, 1)), "at"),
        (lambda: At("2026-01-01T00:00:00+00:00"), "at"),  # type: ignore[arg-type]  # invalid on purpose
        (lambda: OnExit(""), "command"),
        (lambda: OnExit("   "), "command"),
        (lambda: OnExit("echo \udcff"), "command"),
        (lambda: OnExit("x" * (128 * 1024)), "command"),  # longer than one argument of execve
        (lambda: OnExit("true", cwd=""), "cwd"),
        (lambda: OnExit("true", cwd="/tmp/\0"), "cwd"),
    ],
)
def test_invalid_schedule_is_refused_when_made_naming_the_field(
    make: Callable[[], object], field: str
) -> None:
    with pytest.raises(InvalidScheduleError, match=field) as info:
        make()
    assert isinstance(info.value, ValueError)


def test_a_schedule_that_is_not_one_is_refused() -> None:
    with pytest.raises(InvalidScheduleError, match="schedule must be At, Every, Cron or OnExit"):
        compute_next_run_at("daily", T0)  # type: ignore[arg-type]  # invalid on purpose


def test_every_interval_bounds_are_inclusive() -> None:
    assert compute_next_run_at(Every(MIN_EVERY_SECONDS), T0) == T0 + timedelta(seconds=1)
    assert compute_next_run_at(Every(MAX_EVERY_SECONDS), T0) == T0 + timedelta(seconds=MAX_EVERY_SECONDS)


@pytest.mark.parametrize("schedule", [Every(MAX_EVERY_SECONDS), Cron("0 0 * * *")])
def test_next_run_past_year_9999_is_an_invalid_schedule(schedule: Every | Cron) -> None:
    # a stored row with a last run far ahead must not raise OverflowError out of the timer or enable
    last = datetime(9999, 12, 31, 12, 0, tzinfo=UTC)
    with pytest.raises(InvalidScheduleError, match="beyond year 9999"):
        next_run_after(schedule, T0, last_run_at=last, default_anchor=T0)


@pytest.mark.parametrize("expr", ["0 0 30 2 *", "0 0 31 4,6 *"])
def test_a_day_no_named_month_has_is_said_in_those_words(expr: str) -> None:
    """cronsim says "Bad day-of-month" for 30 February too; the engine says the day never comes (found by
    a new user), and keeps cronsim's words for a number out of range."""
    with pytest.raises(InvalidScheduleError, match="none of its months has that day of the month"):
        Cron(expr)
    with pytest.raises(InvalidScheduleError, match="Bad day-of-month"):
        Cron("0 0 32 2 *")
    assert compute_next_run_at(Cron("0 0 31 1-3 *"), T0) is not None  # one of its months has a 31st


def test_on_exit_cwd_must_be_an_existing_absolute_directory(tmp_path: Path) -> None:
    check_on_exit_cwd(OnExit("true"))  # no cwd: the engine's default
    check_on_exit_cwd(OnExit("true", cwd=str(tmp_path)))
    check_on_exit_cwd(Every(60))  # other schedules have no cwd
    with pytest.raises(InvalidScheduleError, match=r"cwd '/nonexistent' does not exist; create it"):
        check_on_exit_cwd(OnExit("true", cwd="/nonexistent"))
    with pytest.raises(InvalidScheduleError, match="cwd 'build' is relative"):
        check_on_exit_cwd(OnExit("true", cwd="build"))
    (tmp_path / "file").write_text("")
    with pytest.raises(InvalidScheduleError, match="is not a directory"):
        check_on_exit_cwd(OnExit("true", cwd=str(tmp_path / "file")))


def test_compute_rejects_naive_now() -> None:
    with pytest.raises(InvalidScheduleError, match="now"):
        compute_next_run_at(Every(5), datetime(2026, 1, 1))


def test_other_fixed_offsets_are_fine() -> None:
    plus2 = timezone(timedelta(hours=2))
    assert compute_next_run_at(At(datetime(2026, 6, 1, 15, 0, tzinfo=plus2)), T0) == utc(2026, 6, 1, 13, 0)


# -- the decision core -------------------------------------------------------------------------------


def make_job(schedule: Every | Cron | At, now: datetime, **kw: Any) -> CronJob:
    job = CronJob(
        id="j1",
        name="j",
        enabled=True,
        schedule=schedule,
        payload=SystemEvent("hi"),
        delete_after_run=False,
        created_at=now,
        updated_at=now,
        next_run_at=next_run_after(schedule, now, default_anchor=now),
    )
    return attrs.evolve(job, **kw)


def test_claim_coalesces_missed_slots() -> None:
    job = make_job(Every(60), T0)
    later = T0 + timedelta(hours=3, seconds=10)
    assert is_due(job, later)
    claimed = claim(job, later)
    assert claimed.last_run_at == later and claimed.last_status is JobStatus.RUNNING
    assert claimed.next_run_at == T0 + timedelta(hours=3, seconds=60)  # the next grid point after now
    assert not is_due(claimed, later)


def test_claim_disables_one_shot() -> None:
    job = make_job(At(T0 + timedelta(seconds=5)), T0, delete_after_run=True)
    claimed = claim(job, T0 + timedelta(seconds=5))
    assert not claimed.enabled and claimed.next_run_at is None
    done = finish(claimed, T0 + timedelta(seconds=6), error=None)
    assert should_delete(done)
    assert not should_delete(finish(claimed, T0 + timedelta(seconds=6), error="boom"))


def test_finish_backs_off_after_errors() -> None:
    job = claim(make_job(Every(10), T0), T0 + timedelta(seconds=10))
    waits = []
    now = T0 + timedelta(seconds=10)
    for _ in range(6):
        job = finish(job, now, error="failed")
        assert job.next_run_at is not None
        waits.append((job.next_run_at - now).total_seconds())
        now = job.next_run_at
        job = claim(job, now)
    assert waits == [*BACKOFF_SECONDS, BACKOFF_SECONDS[-1]]
    assert job.consecutive_errors == 6
    ok = finish(job, now, error=None)
    assert ok.consecutive_errors == 0 and ok.last_status is JobStatus.OK
    assert ok.next_run_at == now + timedelta(seconds=10)


def test_next_wake_ignores_disabled_and_spent_jobs() -> None:
    a = make_job(Every(60), T0)
    b = attrs.evolve(make_job(Every(30), T0), enabled=False)
    c = attrs.evolve(make_job(Every(10), T0), last_run_at=T0 + timedelta(seconds=10))  # spent due time
    assert next_wake([a, b, c]) == T0 + timedelta(seconds=60)
    assert next_wake([b]) is None


schedules = st.one_of(
    st.builds(
        Every,
        st.floats(min_value=MIN_EVERY_SECONDS, max_value=7200, allow_nan=False),
        st.one_of(st.none(), st.integers(-86400, 86400).map(lambda s: T0 + timedelta(seconds=s))),
    ),
    st.builds(
        Cron,
        st.sampled_from(
            ["*/15 * * * *", "30 1 * * *", "30 2 * * *", "0 * * * *", "*/20 1,2 * * *", "5 4 * * 0"]
        ),
        st.sampled_from(["UTC", "America/New_York", "Europe/Berlin"]),
    ),
    st.integers(1, 86400).map(lambda s: At(T0 + timedelta(seconds=s))),
)
#: Clock steps in seconds: mostly forward (small, large: downtime), sometimes back (NTP, suspend).
steps = st.lists(
    st.one_of(st.integers(1, 600), st.integers(600, 3 * 86400), st.integers(-7200, -1)),
    min_size=1,
    max_size=40,
)
starts = st.sampled_from([T0, utc(2026, 3, 8, 5, 0), utc(2026, 11, 1, 4, 50), utc(2026, 10, 25, 0, 20)])


@given(schedule=schedules, deltas=steps, start=starts, fail=st.lists(st.booleans(), max_size=40))
def test_decisions_never_early_never_twice(
    schedule: Every | Cron | At, deltas: list[int], start: datetime, fail: list[bool]
) -> None:
    """Driven like the timer: at each clock reading, run every due job once, then record its end."""
    if isinstance(schedule, At):
        schedule = At(start + (schedule.at - T0))
    job = make_job(schedule, start)
    now = start
    ran_for: list[datetime] = []
    for i, delta in enumerate(deltas):
        now += timedelta(seconds=delta)
        if is_due(job, now):
            due = job.next_run_at
            assert due is not None and due <= now, "ran before it was due"
            assert due not in ran_for, "ran twice for one due time"
            assert not ran_for or due > ran_for[-1]
            ran_for.append(due)
            job = claim(job, now)
            assert not is_due(job, now)
            job = finish(job, now, error="boom" if i < len(fail) and fail[i] else None)
            assert not is_due(job, now), "due again right after its run"
        # never silently skipped: an enabled job always has a future due time unless it is spent
        if job.enabled and not isinstance(job.schedule, At):
            assert job.next_run_at is not None
    if isinstance(schedule, At):
        assert len(ran_for) <= 1


@given(schedule=schedules, deltas=steps, start=starts, fail=st.lists(st.booleans(), max_size=40))
def test_claim_of_a_system_event_is_its_claim_then_its_end(
    schedule: Every | Cron | At, deltas: list[int], start: datetime, fail: list[bool]
) -> None:
    """The timer's one-step claim of a ``SystemEvent`` (``_plan.claim_and_finish``) is
    ``finish(claim(...))`` exactly, whatever state the job is in (failures before, the clock stepped
    back)."""
    if isinstance(schedule, At):
        schedule = At(start + (schedule.at - T0))
    job = make_job(schedule, start)
    now = start
    for i, delta in enumerate(deltas):
        now += timedelta(seconds=delta)
        if is_due(job, now):
            two_steps = finish(claim(job, now), now, error=None)
            assert claim_and_finish(job, now) == two_steps
            job = claim(job, now)
            job = finish(job, now, error="boom" if i < len(fail) and fail[i] else None)
    later = attrs.evolve(job, last_run_at=now + timedelta(hours=1))  # a last run after the clock
    assert claim_and_finish(later, now) == finish(claim(later, now), now, error=None)
    watched = attrs.evolve(job, schedule=OnExit("true", cwd="/"), next_run_at=now, consecutive_errors=2)
    assert claim_and_finish(watched, now) == finish(claim(watched, now), now, error=None)
