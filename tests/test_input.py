"""The one reader of loose input (``engine/_input.py``): its rules, and Hypothesis over JSON-ish values."""

from __future__ import annotations

import json
import math
import os
import sqlite3
from collections.abc import Callable
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import attrs
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import (
    At,
    Command,
    Cron,
    CronJob,
    Every,
    InvalidArgumentError,
    InvalidScheduleError,
    OnExit,
    Project,
    SqliteJobStore,
    SystemEvent,
)
from engine._input import (
    MAX_ARG_BYTES,
    MAX_INT,
    check_argv,
    check_env,
    check_flag,
    check_int,
    check_json,
    check_read_args,
    check_string,
    check_strings,
    check_text,
    read_directory,
    read_fields,
    read_moment,
    read_payload,
    read_project,
    read_schedule,
    read_seconds,
    read_stream,
    read_whole,
    show,
    string_problem,
)
from engine.cron._job import payload_to_dict, schedule_to_dict

T0 = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)
#: What ``json.dumps(os.fsdecode(b"caf\xe9.txt"))`` sends: a lone surrogate for the byte that is not UTF-8.
NOT_UTF8 = os.fsdecode(b"caf\xe9.txt")


# ---- whole numbers and seconds -------------------------------------------------------------------------


def test_whole_numbers_one_bound_floats_that_are_whole_count_booleans_never() -> None:
    assert read_whole(3.0, "n") == 3 and isinstance(read_whole(3.0, "n"), int)
    assert read_whole(MAX_INT, "n") == MAX_INT == 2**53
    assert read_whole(1, "pid", 1) == 1
    for bad in (True, False, 3.5, math.nan, math.inf, "3", None, [3], MAX_INT + 1, float(MAX_INT * 2), -1):
        with pytest.raises(InvalidArgumentError, match="n must be a whole number from 0 to"):
            read_whole(bad, "n")
    with pytest.raises(InvalidArgumentError, match="pid must be a whole number from 1"):
        read_whole(0, "pid", 1)
    # The library's typed arguments are ints: 3.0 is not one there.
    assert check_int(3, "offset") == 3
    with pytest.raises(InvalidArgumentError, match="offset"):
        check_int(3.0, "offset")


def test_seconds_are_finite_and_huge_numbers_are_usage_errors() -> None:
    assert read_seconds(2, "s") == 2.0 and isinstance(read_seconds(2, "s"), float)
    assert read_seconds(-1.5, "s", minimum=None) == -1.5
    for bad in (math.nan, math.inf, -math.inf, True, "1", -0.5):
        with pytest.raises(InvalidArgumentError, match="s must be"):
            read_seconds(bad, "s")
    with pytest.raises(InvalidArgumentError, match="a 400-digit number"):
        read_seconds(10**399, "every_seconds")  # was an OverflowError deeper down


def test_flags_and_stream_names() -> None:
    assert check_flag(True, "enabled") is True
    with pytest.raises(InvalidArgumentError, match="enabled must be true or false, got 1"):
        check_flag(1, "enabled")
    assert read_stream("stderr") == "stderr"
    for bad in ("both", None, 1, "STDOUT"):
        with pytest.raises(InvalidArgumentError, match='which must be "stdout" or "stderr"'):
            read_stream(bad, "which")


# ---- strings ------------------------------------------------------------------------------------------


def test_poison_strings_are_named_and_say_what_to_send() -> None:
    assert json.dumps(NOT_UTF8) == '"caf\\udce9.txt"'
    assert string_problem("plain, caf\u00e9, \U0001f600 and \x7f") is None
    assert "NUL" in (string_problem("a\0b") or "")
    assert "U+DCE9" in (string_problem(NOT_UTF8) or "")
    assert string_problem("\ud83d\ude00") is not None  # a pair in a Python str is two lone surrogates
    assert check_string("", "x") == ""  # an empty string is text
    with pytest.raises(InvalidArgumentError, match=r"args\[1\] holds the lone surrogate U\+DCE9") as info:
        check_strings(["-f", NOT_UTF8], "args")
    assert "send UTF-8 text without NUL" in str(info.value)
    info.value.args[0].encode()  # the message itself can be sent back
    with pytest.raises(InvalidArgumentError, match="holds a NUL character"):
        check_text("a\0b", "command")
    for blank in ("", "   ", None, 3):
        with pytest.raises(InvalidArgumentError, match="name must be a non-empty string"):
            check_text(blank, "name")


def test_strings_are_checked_inside_lists_maps_and_nested_objects() -> None:
    with pytest.raises(InvalidArgumentError, match=r"JSON\.params\.args\[1\]"):
        check_json({"cmd": "create", "params": {"args": ["ok", NOT_UTF8]}}, "JSON")
    with pytest.raises(InvalidArgumentError, match="key"):
        check_json({"\udcff": 1}, "JSON")
    deep: object = "\udcff"
    for _ in range(5000):  # no recursion: a deep value cannot crash the check
        deep = [deep]
    with pytest.raises(InvalidArgumentError):
        check_json(deep, "JSON")
    check_json({"a": [1, 2.5, None, True, {"b": "caf\u00e9"}]}, "JSON")


def test_env_names_and_values() -> None:
    assert check_env({"A": "1", "EMPTY": ""}) == {"A": "1", "EMPTY": ""}
    for bad, where in [
        ({"A=B": "x"}, "without '='"),
        ({"": "x"}, "without '='"),
        ({1: "x"}, "without '='"),
        ({"A": 1}, r"env\['A'\] must be a string"),
        ({"A": "x\0"}, r"env\['A'\] holds a NUL"),
        ({"A": NOT_UTF8}, r"env\['A'\] holds the lone surrogate"),
        ({"\udcff": "x"}, "env name"),
        (["A=1"], "must be an object"),
    ]:
        with pytest.raises(InvalidArgumentError, match=where):
            check_env(bad)


def test_argv_and_log_read_arguments() -> None:
    assert check_argv("tail", ["-f", ""]) == ("tail", "-f", "")
    for cmd, args, where in [
        ("", [], "cmd"),
        ("echo", "abc", "args must be an array"),
        ("echo", [1], r"args\[0\] must be a string"),
        ("echo", ["a\0b"], r"args\[0\] holds a NUL"),
        ("tail", ["-f", NOT_UTF8], r"args\[1\]"),
        ("echo", ["x" * (MAX_ARG_BYTES + 1)], "one argument holds at most"),
    ]:
        with pytest.raises(InvalidArgumentError, match=where):
            check_argv(cmd, args)
    check_read_args(0, 1, None, 1)
    for offset, limit, tail, max_bytes, where in [
        (-1, None, None, 1, "offset"),
        (None, 0, None, 1, "limit"),
        (None, True, None, 1, "limit"),
        (None, None, 0, 1, "tail"),
        (None, None, None, None, "max_bytes"),
        (0, None, 2, 1, "tail alone"),
    ]:
        with pytest.raises(InvalidArgumentError, match=where):
            check_read_args(offset, limit, tail, max_bytes)


def test_show_cuts_what_an_error_quotes() -> None:
    assert len(show("x" * 100_000)) < 80
    assert show(10**5000) == "a 5001-digit number"  # str() itself refuses past 4300 digits
    assert show([10**400]) == "[a 401-digit number]"
    assert show("\udcff") == "'\\udcff'"  # escaped: the message stays text


# ---- times, directories, objects -------------------------------------------------------------------------


def test_moments_are_aware_iso_8601() -> None:
    assert read_moment("2030-01-31T09:00+01:00", "at") == datetime(2030, 1, 31, 8, 0, tzinfo=UTC)
    assert read_moment("2030-01-31T09:00+01:00", "at").utcoffset() == timedelta(hours=1)
    with pytest.raises(InvalidArgumentError, match=r"at needs a UTC offset, e.g. '2030-01-31T09:00\+00:00'"):
        read_moment("2030-01-31T09:00", "at")
    for bad in ("tomorrow", "", 1700000000, None):
        with pytest.raises(InvalidArgumentError, match="at"):
            read_moment(bad, "at")


def test_directories_and_projects(tmp_path: Path) -> None:
    assert read_project(str(tmp_path)) == Project.from_directory(tmp_path)
    assert read_directory("/x/y", "cwd") == "/x/y"
    with pytest.raises(InvalidArgumentError, match="project must be an absolute directory path"):
        read_project("relative/dir")
    with pytest.raises(InvalidArgumentError, match="does not exist"):
        read_project(str(tmp_path / "missing"))
    with pytest.raises(InvalidArgumentError, match="lone surrogate"):
        read_project(str(tmp_path) + "/" + NOT_UTF8)
    # A real directory whose name is not UTF-8 cannot be a project: its path could not be answered with.
    odd = os.path.join(os.fsencode(tmp_path), b"caf\xe9")
    os.mkdir(odd)
    with pytest.raises(ValueError, match="directory holds the lone surrogate") as info:
        Project.from_directory(os.fsdecode(odd))
    assert isinstance(info.value, InvalidArgumentError)


def test_fields_drop_nulls_and_refuse_unknown_members() -> None:
    assert read_fields({"a": 1, "b": None}, "thing", ("a", "b")) == {"a": 1}
    with pytest.raises(
        InvalidArgumentError, match=r"status: unknown parameter\(s\) 'verbose'; allowed: none"
    ):
        read_fields({"verbose": None}, "status", (), what="parameter")
    with pytest.raises(InvalidArgumentError, match="thing must be a JSON object"):
        read_fields([1], "thing", ("a",))


# ---- schedules and payloads ----------------------------------------------------------------------------

_SCHEDULES = [
    At(T0),
    At(datetime(2030, 1, 31, 9, 0, tzinfo=timezone(timedelta(hours=1)))),
    Every(60),
    Every(90.5, anchor=T0),
    Cron("*/5 * * * *"),
    Cron("0 9 * * 1-5", "Europe/Paris"),
    OnExit("make test"),
    OnExit("pytest -q", cwd="/srv/app"),
]
_PAYLOADS = [SystemEvent("check the build"), Command(("make", "test")), Command(("ls",), cwd="/tmp")]


@pytest.mark.parametrize("schedule", _SCHEDULES)
def test_schedule_wire_form_reads_back_as_the_value(schedule: At | Every | Cron | OnExit) -> None:
    wire = json.loads(json.dumps(schedule_to_dict(schedule)))
    assert read_schedule(wire) == schedule


@pytest.mark.parametrize("payload", _PAYLOADS)
def test_payload_wire_form_reads_back_as_the_value(payload: SystemEvent | Command) -> None:
    assert read_payload(json.loads(json.dumps(payload_to_dict(payload)))) == payload


@pytest.mark.parametrize(
    ("wire", "error", "where"),
    [
        ("daily", InvalidArgumentError, "schedule must be a JSON object"),
        ({}, InvalidArgumentError, "missing schedule.kind"),
        ({"kind": "weekly"}, InvalidArgumentError, "schedule.kind must be one of at, every, cron, on_exit"),
        ({"kind": "every"}, InvalidArgumentError, "missing schedule.every_seconds"),
        ({"kind": "every", "every_seconds": 60, "expr": "x"}, InvalidArgumentError, "'expr'"),
        ({"kind": "every", "every_seconds": "60"}, InvalidArgumentError, "schedule.every_seconds"),
        ({"kind": "every", "every_seconds": 10**400}, InvalidArgumentError, "schedule.every_seconds"),
        ({"kind": "every", "every_seconds": 0.5}, InvalidScheduleError, "every_seconds must be between"),
        ({"kind": "at", "at": "2030-01-01T00:00"}, InvalidArgumentError, "schedule.at needs a UTC offset"),
        ({"kind": "cron", "expr": "61 * * * *"}, InvalidScheduleError, "expr"),
        ({"kind": "cron", "expr": "0 9 * * *", "tz": "x" * 300}, InvalidScheduleError, "at most 64"),
        ({"kind": "cron", "expr": "0 9 * * *", "tz": 5}, InvalidScheduleError, "tz must be"),
        ({"kind": "cron", "expr": "0 9 * * \udcff"}, InvalidScheduleError, "lone surrogate"),
        ({"kind": "on_exit", "command": "cat \udcff"}, InvalidScheduleError, "command holds"),
        ({"kind": "on_exit", "command": "true", "cwd": ["/"]}, InvalidScheduleError, "cwd"),
    ],
)
def test_bad_schedule_wire_forms_name_the_field(wire: object, error: type[Exception], where: str) -> None:
    with pytest.raises(error, match=where):
        read_schedule(wire)


@pytest.mark.parametrize(
    ("wire", "error", "where"),
    [
        ({"kind": "shout", "text": "x"}, InvalidArgumentError, "payload.kind must be one of"),
        ({"kind": "system_event"}, InvalidArgumentError, "missing payload.text"),
        ({"kind": "system_event", "text": "  "}, InvalidScheduleError, "text must be a non-empty string"),
        ({"kind": "system_event", "text": "\udcff"}, InvalidScheduleError, "text holds the lone surrogate"),
        ({"kind": "command", "argv": []}, InvalidScheduleError, "argv must be a non-empty array"),
        ({"kind": "command", "argv": "make"}, InvalidScheduleError, "argv must be an array"),
        ({"kind": "command", "argv": ["", "x"]}, InvalidScheduleError, r"argv\[0\]"),
        ({"kind": "command", "argv": ["ls", "a\0"]}, InvalidScheduleError, r"argv\[1\] holds a NUL"),
    ],
)
def test_bad_payload_wire_forms_name_the_field(wire: object, error: type[Exception], where: str) -> None:
    with pytest.raises(error, match=where):
        read_payload(wire)


def test_cron_job_from_dict_refuses_poison_and_the_store_shows_the_row_escaped(tmp_path: Path) -> None:
    good = CronJob(
        id="j1",
        name="job",
        enabled=True,
        schedule=Every(60, anchor=T0),
        payload=SystemEvent("x"),
        delete_after_run=False,
        created_at=T0,
        updated_at=T0,
    )
    assert CronJob.from_dict(good.to_dict()) == good
    for field, value in (("name", "\udcff"), ("last_error", "a\0b"), ("consecutive_errors", 1.5)):
        with pytest.raises(ValueError, match=field):
            CronJob.from_dict({**good.to_dict(), field: value})
    poisoned = {**good.to_dict(), "id": "j2", "payload": {"kind": "system_event", "text": "\udcff"}}
    with pytest.raises(ValueError, match="text"):
        CronJob.from_dict(poisoned)

    async def main() -> list[CronJob]:
        store = SqliteJobStore.in_state_dir(str(tmp_path))
        await store.open()
        try:
            await store.insert_job(good)
            await store.insert_job(attrs.evolve(good, id="j2"))
            # A row written by something else: the poison arrives as JSON's own escape.
            with sqlite3.connect(tmp_path / "cron.sqlite3") as conn:
                conn.execute("UPDATE jobs SET data = ? WHERE id = 'j2'", (json.dumps(poisoned),))
            return await store.list_jobs()
        finally:
            await store.aclose()

    # Issue 16: a row that already holds poison is not skipped (a start-up refuses a store with rows it
    # cannot read): it is read with the poison shown escaped, so it can be listed, fired and removed.
    listed = trio.run(main)
    assert listed[0] == good and len(listed) == 2
    assert listed[1].id == "j2" and listed[1].payload == SystemEvent("\\udcff")


# ---- Hypothesis: any JSON-ish value into every reader ---------------------------------------------------

_poison = st.sampled_from(["\udcff", NOT_UTF8, "a\0b", "\ud83d\ude00", "\ud800"])
_strings = st.one_of(
    st.text(max_size=8),
    st.text(st.characters(exclude_categories=()), max_size=4),
    _poison,
    st.sampled_from(
        ["stdout", "stderr", "UTC", "Europe/Paris", "*/5 * * * *", "2030-01-01T00:00+00:00", "/"]
    ),
)
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(-(10**500), 10**500),
    st.floats(),
    _strings,
)
_json = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_strings, inner, max_size=3),
    max_leaves=8,
)
_kinds = st.sampled_from(["at", "every", "cron", "on_exit", "system_event", "command", "other"])
_members = st.sampled_from(
    ["at", "every_seconds", "anchor", "expr", "tz", "command", "cwd", "text", "argv", "kind", "x"]
)
_wire = st.builds(
    lambda kind, extra: {"kind": kind, **extra},
    _kinds,
    st.dictionaries(_members, st.one_of(_json, _strings, st.lists(_strings, max_size=3)), max_size=3),
)

_READERS: list[Callable[[object], object]] = [
    lambda v: read_whole(v, "n", 1),
    lambda v: check_int(v, "n"),
    lambda v: read_seconds(v, "s"),
    lambda v: check_flag(v, "f"),
    lambda v: check_string(v, "s"),
    lambda v: check_text(v, "s"),
    lambda v: check_strings(v, "l"),
    lambda v: check_env(v),
    lambda v: check_json(v, "j"),
    lambda v: read_stream(v),
    lambda v: read_moment(v, "m"),
    lambda v: read_directory(v, "d"),
    lambda v: read_fields(v, "o", ("a", "b")),
    read_schedule,
    read_payload,
    lambda v: check_argv(v, ()),
    lambda v: check_argv("ls", v),
    lambda v: check_read_args(v, None, None, 1),
]


def _sendable(value: object) -> None:
    """What a reader accepted can be stored and sent back: UTF-8 JSON without NUL."""
    if isinstance(value, At | Every | Cron | OnExit):
        value = schedule_to_dict(value)
    elif isinstance(value, SystemEvent | Command):
        value = payload_to_dict(value)
    elif isinstance(value, datetime):
        value = value.isoformat()
    text = json.dumps(value, ensure_ascii=False, allow_nan=False, default=list)
    text.encode("utf-8")
    assert "\\u0000" not in text


@settings(max_examples=500)  # pure and fast: more than the profile's default
@given(value=st.one_of(_json, _wire))
def test_readers_raise_only_the_documented_errors_and_accept_only_sendable_values(value: object) -> None:
    for read in _READERS:
        try:
            result = read(value)
        except (InvalidArgumentError, InvalidScheduleError) as exc:
            str(exc).encode("utf-8")  # the error itself can be answered with
            continue
        if result is not None:
            _sendable(result)
