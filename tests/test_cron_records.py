"""The cron records that cross module boundaries: ``PendingFire``, ``FiredEvent`` (``_events``) and
``WatchState`` (``_watch_state``): one definition each, JSON round trips, validation."""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import attrs
import pytest

from engine import FiredEvent, OnExit
from engine._sweep import GroupRecord
from engine.cron._events import PENDING_FIRE_FIELDS, PendingFire, exit_fire, text_fire
from engine.cron._watch_state import ArmIntent, WatchState, stored_watch_from_dict

T0 = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)

#: FiredEvent's fields and ``to_dict()`` keys, in the order of design section 0.
SECTION_0_EVENT = [
    "cursor",
    "fire_id",
    "job_id",
    "job_name",
    "text",
    "command",
    "exit_code",
    "signal",
    "reason",
    "duration_seconds",
    "stdout_tail",
    "stderr_tail",
    "truncated",
    "project",  # 0.2: the project id of the job
]


def test_fired_event_is_a_pending_fire_plus_its_place() -> None:
    assert set(PENDING_FIRE_FIELDS) | {"cursor", "job_id", "project"} == {
        f.name for f in attrs.fields(FiredEvent)
    }
    fire = text_fire("nightly", "stretch")
    event = FiredEvent.from_pending(fire, cursor=7, job_id="ab12")
    assert list(event.to_dict()) == SECTION_0_EVENT
    assert event.to_dict()["cursor"] == 7 and event.fire_id == fire.fire_id and event.text == "stretch"
    assert event.pending() == fire and event != fire
    assert FiredEvent.from_dict(json.loads(json.dumps(event.to_dict()))) == event


def test_pending_fire_round_trips_through_json(tmp_path: Path) -> None:
    out = tmp_path / "out.log"
    out.write_text("a\nb\n")
    fire = exit_fire(
        "build", command="make", exit_code=2, signal=None, reason="exit", duration_seconds=1.5,
        stdout_path=str(out), stderr_path=None,
    )  # fmt: skip
    data = json.loads(json.dumps(fire.to_dict()))
    assert list(data) == list(PENDING_FIRE_FIELDS)
    assert PendingFire.from_dict(data) == fire
    assert fire.stdout_tail == "a\nb\n" and fire.exit_code == 2 and not fire.truncated
    assert PendingFire.from_dict({**data, "duration_seconds": 2}).duration_seconds == 2.0  # JSON whole number


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("fire_id", ""),
        ("fire_id", None),
        ("text", 3),
        ("exit_code", True),
        ("exit_code", "1"),
        ("signal", 1.5),
        ("duration_seconds", "1"),
        ("truncated", 0),
    ],
)
def test_pending_fire_refuses_invalid_fields(field: str, value: object) -> None:
    data = text_fire("j", "t").to_dict()
    with pytest.raises(ValueError, match=field):
        PendingFire.from_dict({**data, field: value})
    del data[field]
    with pytest.raises(ValueError, match=field):
        PendingFire.from_dict(data)


def _state(**changes: Any) -> WatchState:
    base = WatchState(
        arm_id="0123abcd", pid=4242, sid=4242, start_time=98765, marker="tok:7", exit_file="/s/x.exit.json",
        command="make test", cwd="/srv", started_at=T0,
    )  # fmt: skip
    return attrs.evolve(base, **changes)


def test_watch_state_round_trips_and_names_its_group() -> None:
    state = _state()
    assert WatchState.from_dict(json.loads(json.dumps(state.to_dict()))) == state
    assert state.group_record() == GroupRecord(4242, 4242, 98765, "tok:7")
    assert state.targets(OnExit("make test", cwd="/srv")) and not state.targets(OnExit("make test"))


def test_watch_state_of_a_live_process_is_alive() -> None:
    with open(f"/proc/{os.getpid()}/stat") as f:
        start_time = int(f.read().rsplit(")", 1)[1].split()[19])
    assert _state(pid=os.getpid(), start_time=start_time).alive()
    assert not _state(pid=os.getpid(), start_time=start_time + 1).alive()  # a reused pid is not it


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("pid", "4242"),
        ("pid", -1),
        ("start_time", True),
        ("marker", None),
        ("started_at", "2026-06-01T12:00"),
    ],
)
def test_watch_state_refuses_invalid_fields(field: str, value: object) -> None:
    data = _state().to_dict()
    with pytest.raises(ValueError, match=field):
        WatchState.from_dict({**data, field: value})
    del data[field]
    with pytest.raises(ValueError, match=field):
        WatchState.from_dict(data)


def test_an_arm_before_its_spawn_round_trips_and_becomes_the_state_of_its_shim() -> None:
    arm = ArmIntent(
        arm_id="0123abcd", exit_file="/s/x.exit.json", command="make test", cwd="/srv", started_at=T0,
        marks_start=True,
    )  # fmt: skip
    data = json.loads(json.dumps(arm.to_dict()))
    assert stored_watch_from_dict(data) == arm and ArmIntent.from_dict(data) == arm
    assert stored_watch_from_dict(_state().to_dict()) == _state()  # a state is told from an arm
    assert arm.targets(OnExit("make test", cwd="/srv")) and not arm.targets(OnExit("make test"))
    assert arm.spawned(pid=4242, start_time=98765, marker="tok:7", cgroup=None) == _state(marks_start=True)
    with pytest.raises(ValueError, match="exit_file"):
        stored_watch_from_dict({k: v for k, v in data.items() if k != "exit_file"})
    with pytest.raises(ValueError, match="started_at"):
        stored_watch_from_dict({**data, "started_at": "2026-06-01T12:00"})
    with pytest.raises(ValueError):
        stored_watch_from_dict([1])  # type: ignore[arg-type]
