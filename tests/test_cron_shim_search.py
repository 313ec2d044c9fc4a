"""Finding an arm's shim by the exit file its argv names (``_shim_search``): what the next engine does
for an arm whose engine was killed before it stored the command's watch state."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from engine._procfs import RUN_MARKER_VAR, read_proc
from engine.cron._shell import shim_argv
from engine.cron._shim_search import find_spawned
from engine.cron._watch_state import ArmIntent

from .children import SESSION

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
