"""The spawn path made cheaper (issue 19) keeps its guarantees: what each shortcut must not lose."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from engine import EngineConfig, _group_journal, open_engine
from engine._group_journal import GroupJournal, journal_path, read_journal
from engine._procfs import read_marker
from engine._sweep import GroupRecord, load_records

from .children import kill_leftovers, mark, pgrep
from .test_guardian import ROOT, guardian_pids


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


# ---- the group journal: one line per run start and end, read back by the sweep ---------------------


def test_journal_replays_starts_and_ends_and_skips_a_cut_line(tmp_path: Path) -> None:
    journal = GroupJournal(tmp_path, "abc123")
    a, b = GroupRecord(100, 100, 5000, "abc123:1"), GroupRecord(200, 200, 6000, "abc123:2")
    journal.add(a)
    journal.add(b)
    journal.drop(a)
    journal.close()
    path = journal_path(tmp_path, "abc123")
    with open(path, "a") as f:
        f.write("+ 300 300 70")  # a line cut short by a crash
    assert read_journal(path) == [b]


def test_journal_compaction_keeps_the_live_records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_group_journal, "_COMPACT_LINES", 8)
    journal = GroupJournal(tmp_path, "abc123")
    keep = [GroupRecord(10 + i, 10 + i, 100, f"abc123:{i}") for i in range(2)]
    for record in keep:
        journal.add(record)
    for i in range(20):
        gone = GroupRecord(1000 + i, 1000 + i, 100, f"abc123:x{i}")
        journal.add(gone)
        journal.drop(gone)
    path = journal_path(tmp_path, "abc123")
    assert len(path.read_text().splitlines()) < 12  # rewritten along the way
    journal.add(GroupRecord(50, 50, 100, "abc123:y"))  # appends go to the rewritten file
    journal.close()
    assert read_journal(path) == [*keep, GroupRecord(50, 50, 100, "abc123:y")]
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


_SCRUBBED_ENGINE = """
import sys, trio
from engine import EngineConfig, SpawnSpec, open_engine
async def main():
    config = EngineConfig(state_dir=sys.argv[1], grace_seconds=0.3, containment="process-group")
    async with open_engine(config) as engine:
        run = await engine.supervisor.spawn(SpawnSpec(argv=("env", "-i", "sleep", sys.argv[2])))
        print("ready", run.pid, flush=True)
        await trio.sleep_forever()
trio.run(main)
"""


async def test_sweep_ends_a_scrubbed_run_known_only_from_the_journal(tmp_path: Path) -> None:
    """``env -i``: no run marker, no token to find it by; only its group record names it."""
    state, marker = tmp_path / "state", mark("341.2")
    proc = subprocess.Popen(
        [sys.executable, "-c", _SCRUBBED_ENGINE, str(state), marker],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().split()
        assert line[:1] == ["ready"], line
        pid = int(line[1])
        with trio.fail_after(5):
            while not guardian_pids(state) or read_marker(pid) is not None:
                await trio.sleep(0.02)  # the guardian is up; the leader has exec'd env -i's sleep
        assert [r.pgid for r in load_records(str(state))] == [pid]
        for guardian in guardian_pids(state):  # the guardian first, then the engine: nobody cleans up
            os.kill(guardian, signal.SIGKILL)
        proc.kill()
        proc.wait()
        await trio.sleep(0.3)
        assert pgrep(f"^sleep {marker}") == [pid]
        async with open_engine(EngineConfig(state_dir=str(state), grace_seconds=0.3)):
            assert not pgrep(f"^sleep {marker}")  # swept at start-up
        assert not os.listdir(state / "groups")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        kill_leftovers(f"^sleep {marker}")
