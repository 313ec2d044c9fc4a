"""Helpers for the exit-watcher tests: an engine factory, a store that fails on purpose, event waits."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio

from engine import CronJob, Engine, EngineConfig, FiredEvent, SqliteJobStore, open_engine
from engine._procfs import read_proc
from engine.cron._events import PendingFire
from engine.cron._protocol import JobChange
from engine.cron._watch_state import StoredWatch

from .children import wait_until

__all__ = [
    "TEST_SHELL",
    "FlakyStore",
    "config",
    "end_left_commands",
    "engine_with",
    "wait_events",
    "wait_until",
]

#: Tests run watched commands with plain bash (no login profile, ~1 ms) unless the profile is the point.
TEST_SHELL = ("bash", "-c", "--")


class FlakyStore(SqliteJobStore):
    """A real SQLite store whose exit commits fail with ENOSPC for the job ids in ``failing``, and whose
    watch-state writes fail so while ``failing_states``."""

    failing: set[str]
    commit_attempts: int
    failing_states: bool

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.failing = set()
        self.commit_attempts = 0
        self.failing_states = False

    async def set_watch_states(self, states: Mapping[str, StoredWatch | None]) -> frozenset[str]:
        if self.failing_states:
            await trio.lowlevel.checkpoint()
            raise OSError(errno.ENOSPC, "No space left on device (test)")
        return await super().set_watch_states(states)

    async def commit_fire(self, job_id: str, change: JobChange, pending_fire: PendingFire) -> CronJob:
        self.commit_attempts += 1
        if job_id in self.failing or "*" in self.failing:
            await trio.lowlevel.checkpoint()
            raise OSError(errno.ENOSPC, "No space left on device (test)")
        return await super().commit_fire(job_id, change, pending_fire)


def config(state_dir: Path, **changes: Any) -> EngineConfig:
    base: dict[str, Any] = {
        "state_dir": str(state_dir),
        "grace_seconds": 0.3,
        "kill_wait_seconds": 2.0,
        "exit_watch_shell": TEST_SHELL,
        "watch_retry_seconds": (0.3,),
        "guardian": False,
    }
    base.update(changes)
    return EngineConfig(**base)


@asynccontextmanager
async def engine_with(
    state_dir: Path,
    *,
    hooks: Mapping[str, Callable[[str], Awaitable[None]]] | None = None,
    store: FlakyStore | None = None,
    on_fire: Callable[[FiredEvent], Awaitable[None]] | None = None,
    **changes: Any,
) -> AsyncIterator[Engine]:
    if store is not None:
        changes["store_factory"] = lambda _state_dir: store
    async with open_engine(config(state_dir, watch_hooks=hooks, **changes), on_fire=on_fire) as engine:
        yield engine


async def wait_events(engine: Engine, count: int, *, seconds: float = 10.0) -> list[FiredEvent]:
    """Wait until the event log holds at least ``count`` events; return them all."""
    with trio.fail_after(seconds):
        while len(events := await engine.cron.events()) < count:
            await trio.sleep(0.02)
    return events


def end_left_commands(root: Path) -> list[int]:
    """End and reap the watched commands that engines of this test process left running.

    A graceful stop leaves a watched command running, with its watch state in the store, and its shim a
    child of this process (the engine ran here): once it ends, it stays a zombie until this process reaps
    it. For each store under ``root``, each watch state whose shim is a child of this process (same start
    time) has its group SIGKILLed and the shim reaped. Returns the shims' pids.
    """
    ended = []
    for path in root.rglob("cron.sqlite3"):
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
            rows = conn.execute("SELECT watch_state FROM jobs WHERE watch_state IS NOT NULL").fetchall()
        for (text,) in rows:
            state = json.loads(text)
            if "pid" not in state:  # an arm stored before its spawn: nothing ran from it
                continue
            info = read_proc(state["pid"])
            if info is None or info.ppid != os.getpid() or info.start_time != state["start_time"]:
                continue
            with contextlib.suppress(ProcessLookupError):
                os.killpg(info.pid, signal.SIGKILL)
            os.waitpid(info.pid, 0)
            ended.append(info.pid)
    return ended
