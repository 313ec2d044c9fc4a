"""The exit-recording shim on a full disk (``engine/cron/_shim.py``): the command's exit code is its own.

Tried: with the state dir full, an on-exit command that exited 0 was reported as exit 120 (the shim's
own failure). The full disk is a small tmpfs the test mounts (as root; skipped with the reason where
``mount`` is not allowed).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from engine import EngineConfig, OnExit, SystemEvent, open_engine
from engine.cron import _shim

from .children import mark, pgrep_env

SHIM = _shim.__file__


def fill(folder: Path) -> Path:
    """Write a file in ``folder`` until the filesystem is full; the file."""
    filler = folder / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return filler


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs (mode 0700) mounted for this test."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs as a full disk")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def shim(exit_file: Path, *command: str) -> subprocess.Popen[str]:
    """The shim running ``command``, in a session of its own (so a failing test ends its whole group)."""
    return subprocess.Popen(
        [sys.executable, "-I", "-S", SHIM, str(exit_file), "--", *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def end_group(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=10)


def test_shim_records_the_exit_in_reserved_space_when_the_disk_fills_meanwhile(
    small_disk: Path, tmp_path: Path
) -> None:
    go = tmp_path / "go"
    proc = shim(small_disk / "exit.json", "sh", "-c", f"while [ ! -e {go} ]; do sleep 0.02; done; exit 3")
    try:
        deadline = time.monotonic() + 10
        while not any(name.startswith("exit.json.tmp.") for name in os.listdir(small_disk)):
            assert time.monotonic() < deadline, "the shim made no reserve"
            time.sleep(0.02)
        fill(small_disk)
        go.touch()
        _, err = proc.communicate(timeout=10)
    finally:
        end_group(proc)
    assert proc.returncode == 3 and err == ""
    record = json.loads((small_disk / "exit.json").read_text())
    assert record["exit_code"] == 3


def test_shim_ends_with_the_commands_status_when_nothing_can_be_recorded(small_disk: Path) -> None:
    fill(small_disk)
    for code in (0, 7):
        proc = shim(small_disk / "exit.json", "sh", "-c", f"exit {code}")
        try:
            _, err = proc.communicate(timeout=10)
        finally:
            end_group(proc)
        assert proc.returncode == code, err  # never Python's 120 for a failed flush, never 1
        assert "could not be recorded" in err and "the command's own status" in err
        assert not (small_disk / "exit.json").exists()


async def test_on_exit_job_on_a_full_state_dir_fires_with_the_commands_own_exit_code(
    small_disk: Path, tmp_path: Path
) -> None:
    go = tmp_path / "go"
    marker = mark("340.91")
    config = EngineConfig(
        state_dir=str(small_disk / "state"),
        grace_seconds=0.3,
        kill_wait_seconds=2.0,
        exit_watch_shell=("bash", "-c", "--"),
        watch_retry_seconds=(0.2,),  # type: ignore[arg-type]  # attrs converter=tuple: mypy sees Iterable[_T_co]
    )
    command = f"while [ ! -e {go} ]; do sleep 0.02; done; echo done-{marker}; exit 0"
    async with open_engine(config) as engine:
        job = await engine.cron.add(OnExit(command=command, cwd=str(tmp_path)), SystemEvent("finished"))
        with trio.fail_after(10):
            while not pgrep_env("GADGET_WATCH_COMMAND", f"done-{marker}"):
                await trio.sleep(0.05)
            while (await engine.cron.get(job.id)).enabled and not engine.watchers.active_job_ids():
                await trio.sleep(0.05)
        await trio.sleep(0.3)  # the watch state is saved
        filler = fill(small_disk)
        go.touch()
        await trio.sleep(2.0)
        assert await engine.cron.events() == []  # fail closed while the store cannot be written
        filler.unlink()
        with trio.fail_after(15):
            while not (events := await engine.cron.events()):
                await trio.sleep(0.1)
        (event,) = events
        assert event.exit_code == 0 and event.signal is None, event
        assert event.job_id == job.id
