"""The spawn path made cheaper (issue 19) keeps its guarantees: what each shortcut must not lose."""

from __future__ import annotations

import os
from pathlib import Path

import trio

from engine import EngineConfig, open_engine

from .test_guardian import guardian_pids


async def test_the_guardian_runs_under_batch_scheduling(tmp_path: Path) -> None:
    """SCHED_BATCH: the engine's lines wake it without preempting the engine (no wake-up preemption),
    while it keeps a normal task's share of CPU for ending the children when the engine is gone."""
    async with open_engine(EngineConfig(state_dir=str(tmp_path), containment="process-group")):
        with trio.fail_after(5):
            while not guardian_pids(tmp_path):
                await trio.sleep(0.02)
        (pid,) = guardian_pids(tmp_path)
        assert os.sched_getscheduler(pid) == os.SCHED_BATCH
        assert os.getpriority(os.PRIO_PROCESS, pid) == os.getpriority(os.PRIO_PROCESS, 0)
