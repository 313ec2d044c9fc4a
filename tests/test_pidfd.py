"""Waiting for a process's exit through a pidfd, with real processes."""

from __future__ import annotations

import subprocess
import time

import pytest
import trio

from engine._pidfd import wait_exited
from engine._procfs import read_proc

from .children import open_fds


@pytest.mark.serial  # a time bound: measured alone (make test runs the rest two at a time)
async def test_wait_exited_returns_when_the_process_exits() -> None:
    proc = subprocess.Popen(["sleep", "0.3"])
    try:
        t0 = time.monotonic()
        with trio.fail_after(5):
            await wait_exited(proc.pid)
        assert 0.2 <= time.monotonic() - t0 < 2.0
        assert proc.poll() == 0  # exited, and left for its parent to reap
    finally:
        proc.kill()
        proc.wait()


async def test_wait_exited_another_start_time_is_a_stranger() -> None:
    proc = subprocess.Popen(["sleep", "30"])
    try:
        info = read_proc(proc.pid)
        assert info is not None
        fds = open_fds()
        with trio.fail_after(1):
            await wait_exited(proc.pid, start_time=info.start_time - 1)  # "our" process is gone
        assert proc.poll() is None
        assert open_fds() == fds
    finally:
        proc.kill()
        proc.wait()


async def test_wait_exited_missing_pid_returns_at_once() -> None:
    proc = subprocess.Popen(["true"])
    proc.wait()
    with trio.fail_after(1):
        await wait_exited(proc.pid)


async def test_wait_exited_cancelled_closes_its_pidfd() -> None:
    proc = subprocess.Popen(["sleep", "30"])
    try:
        fds = open_fds()
        with trio.move_on_after(0.1) as scope:
            await wait_exited(proc.pid)
        assert scope.cancelled_caught
        assert open_fds() == fds
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()
