"""The tests' own process helpers: session markers, owned lookups, the machine-wide lock."""

from __future__ import annotations

import fcntl
import os
import subprocess
from pathlib import Path

import pytest

from .children import SESSION, SESSION_VAR, kill_leftovers, mark, pgrep, pgrep_env, proc_exists, wait_until
from .conftest import MACHINE_LOCK


def test_mark_appends_the_session_digits_and_stays_a_number() -> None:
    assert mark("301.1") == "301.1" + SESSION
    assert len(SESSION) == 7 and SESSION.isdigit() and SESSION[-1] != "0"
    assert 301.1 <= float(mark("301.1")) < 301.2
    assert repr(float(mark("301.1"))) == mark("301.1")  # read back as a float, every digit is kept
    for bad in ("301", "sleep 301.1", "3.1.4", ""):
        with pytest.raises(ValueError, match="marker base"):
            mark(bad)


def test_children_inherit_the_session_tag() -> None:
    out = subprocess.run(["sh", "-c", f'echo "${SESSION_VAR}"'], capture_output=True, text=True, check=True)
    assert out.stdout == SESSION + "\n"


def test_pgrep_refuses_a_machine_wide_pattern(tmp_path: Path) -> None:
    for pattern in (r"^sleep 331\.[1-4]", "engine._guardian import main", "sleep"):
        with pytest.raises(ValueError, match="not unique to this test session"):
            pgrep(pattern)
        with pytest.raises(ValueError):
            kill_leftovers(pattern)
    assert pgrep(rf"sleep 340\.1{SESSION}") == []
    assert pgrep(str(tmp_path / "state")) == []  # a path of this session is unique too


async def test_pgrep_and_kill_leftovers_skip_another_sessions_process() -> None:
    marker = mark("340.2")
    foreign = subprocess.Popen(["sleep", marker], env={**os.environ, SESSION_VAR: "1234567"})
    ours = subprocess.Popen(["sleep", marker])
    try:
        await wait_until(lambda: bool(pgrep(rf"^sleep 340\.2{SESSION}")))
        assert pgrep(rf"^sleep 340\.2{SESSION}") == [ours.pid]  # the same command line, another session
        kill_leftovers(rf"^sleep 340\.2{SESSION}")  # SIGKILL, then reaped (it is this process's child)
        assert not proc_exists(ours.pid)
        assert foreign.poll() is None
    finally:
        for proc in (foreign, ours):
            proc.kill()
            proc.wait()


async def test_pgrep_env_finds_this_sessions_processes_by_variable() -> None:
    env = {**os.environ, "GADGET_TEST_PROBE": f"probe-{SESSION}"}
    proc = subprocess.Popen(["sleep", mark("340.3")], env=env)
    try:
        await wait_until(lambda: pgrep_env("GADGET_TEST_PROBE", f"probe-{SESSION}") == [proc.pid])
        assert pgrep_env("GADGET_TEST_PROBE", "no-such-value") == []
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.serial
def test_serial_tests_hold_the_machine_wide_lock() -> None:
    fd = os.open(MACHINE_LOCK, os.O_RDONLY)
    try:
        with pytest.raises(BlockingIOError):  # another open file description: the fixture's lock conflicts
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
