"""Finding an arm's shim by the exit file its argv names (``_shim_search``): what the next engine does
for an arm whose engine was killed before it stored the command's watch state."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import attrs
import pytest

from engine._procfs import RUN_MARKER_VAR, read_proc
from engine._sweep import find_record_processes
from engine.cron._shell import shim_argv
from engine.cron._shim_search import find_spawned, sessions_left
from engine.cron._watch_state import ArmIntent

from .children import SESSION, mark

T0 = datetime(2026, 12, 1, tzinfo=UTC)


def _arm(tmp_path: Path, name: str) -> ArmIntent:
    return ArmIntent(
        arm_id=name, exit_file=str(tmp_path / f"{name}.exit.json"), command="sleep", cwd=None, started_at=T0
    )


@pytest.fixture
def shims() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _shim(
    arm: ArmIntent, shims: list[subprocess.Popen[bytes]], *, user: int | None = None, marked: bool = True
) -> subprocess.Popen[bytes]:
    env = {"PATH": os.environ["PATH"]}
    if marked:
        env[RUN_MARKER_VAR] = f"test{SESSION}w:1"
    proc = subprocess.Popen(
        shim_argv(arm.exit_file, ("sleep", "30")),
        env=env,
        start_new_session=True,
        user=user,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    shims.append(proc)
    return proc


def test_a_running_shim_is_found_by_its_exit_file_as_its_engine_would_have_stored_it(
    tmp_path: Path, shims: list[subprocess.Popen[bytes]]
) -> None:
    found_arm, other_arm, unmarked_arm = (_arm(tmp_path, n) for n in ("a1", "a2", "a3"))
    shim = _shim(found_arm, shims)
    _shim(unmarked_arm, shims, marked=False)  # no run marker: not a run of an engine
    found = find_spawned([found_arm, other_arm, unmarked_arm])
    assert list(found) == ["a1"]  # the arm without a shim, and the unmarked one, are not found
    state = found["a1"]
    info = read_proc(shim.pid)
    assert info is not None
    assert (state.pid, state.sid, state.start_time) == (shim.pid, shim.pid, info.start_time)
    assert state.marker == f"test{SESSION}w:1" and state.exit_file == found_arm.exit_file
    assert state.alive() and state.arm_id == "a1" and state.started_at == T0
    os.killpg(shim.pid, signal.SIGKILL)
    shim.wait()
    assert find_spawned([found_arm]) == {}  # ended: nothing to adopt
    assert find_spawned([]) == {}


@pytest.mark.skipif(os.getuid() != 0, reason="starting a process as another user needs root")
def test_another_users_process_naming_the_exit_file_is_not_taken_for_the_shim(
    tmp_path: Path, shims: list[subprocess.Popen[bytes]]
) -> None:
    """It would be watched, and signalled when its job changes: no stranger is signalled."""
    arm = _arm(tmp_path, "a1")
    tmp_path.chmod(0o755)  # the other user's shim can reach its folder (it records nothing here)
    _shim(arm, shims, user=65534)
    assert find_spawned([arm]) == {}


# ---- sessions_left: what a shim killed alone left running (its pid from the record it reserved) ----------


@pytest.fixture
def orphaned() -> Iterator[list[int]]:
    """Sessions whose leader exited, leaving a ``sleep`` in them; each is killed by its group at the end."""
    groups: list[int] = []
    yield groups
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)


def _orphan_session(groups: list[int], marker: str | None) -> tuple[int, int]:
    """A session whose leader (a shell, as a shim) ends at once, leaving ``sleep`` running in it: the
    session's id (the dead leader's pid) and the sleep's pid."""
    env = {"PATH": os.environ["PATH"]}
    if marker is not None:
        env[RUN_MARKER_VAR] = marker
    leader = subprocess.Popen(
        ["sh", "-c", f"sleep {mark('31.4')} >/dev/null 2>&1 & echo $!"],
        env=env,
        start_new_session=True,
        stdout=subprocess.PIPE,
    )
    out, _ = leader.communicate(timeout=10)
    groups.append(leader.pid)
    return leader.pid, int(out)


def _now_arm(tmp_path: Path, *, later_seconds: float = 0.0) -> ArmIntent:
    return attrs.evolve(_arm(tmp_path, "a1"), started_at=datetime.now(UTC) + timedelta(seconds=later_seconds))


def test_a_killed_shims_session_is_found_with_the_marker_its_processes_carry(
    tmp_path: Path, orphaned: list[int]
) -> None:
    marker = f"test{SESSION}w:7"
    arm = _now_arm(tmp_path)
    sid, sleeper = _orphan_session(orphaned, marker)
    (record,) = sessions_left(arm, [sid])
    assert (record.pgid, record.sid, record.marker) == (sid, sid, marker)
    assert sleeper in find_record_processes([record])


def test_a_session_without_a_marker_is_found_by_its_group_alone(tmp_path: Path, orphaned: list[int]) -> None:
    arm = _now_arm(tmp_path)
    sid, sleeper = _orphan_session(orphaned, None)
    (record,) = sessions_left(arm, [sid])
    assert record.marker == ""
    assert list(find_record_processes([record])) == [sleeper]


def test_processes_started_before_the_arm_are_not_its_commands(tmp_path: Path, orphaned: list[int]) -> None:
    sid, _ = _orphan_session(orphaned, f"test{SESSION}w:8")
    later = _now_arm(tmp_path, later_seconds=10)
    assert sessions_left(later, [sid]) == []


def test_a_pid_that_leads_a_session_again_is_not_a_dead_shims(
    tmp_path: Path, shims: list[subprocess.Popen[bytes]]
) -> None:
    arm = _now_arm(tmp_path)
    alive = _shim(arm, shims)  # its pid leads its session: the shim (or whatever has the pid) runs
    assert sessions_left(arm, [alive.pid]) == []
    assert sessions_left(arm, []) == []
