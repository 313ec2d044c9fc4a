"""A stopping ``serve`` starts no cron run: its timer stops first, and a job that falls due during the stop
runs on the next engine (found by a fresh tester: during a 5 s grace period, an every-1-s job was started
five times, each ended at once and marked interrupted, its due time spent)."""

from __future__ import annotations

import time
from pathlib import Path

from .children import SESSION, kill_leftovers, mark
from .serve_support import start_serve, wait_until


def _stamps(path: Path) -> list[float]:
    return [float(line) for line in path.read_text().split()] if path.exists() else []


def test_a_stopping_serve_starts_no_cron_run_and_the_next_engine_runs_the_due_job(tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    runs = tmp_path / "runs.txt"
    served = start_serve(tmp_path / "state", "--grace-seconds", "2")
    try:
        # A child that ignores SIGINT holds the stop for the whole grace period.
        hold = f"trap '' INT; sleep {mark('401.3')}"
        child = served.cli("create", "--project", str(project), "--", "bash", "-c", hold)
        assert child.returncode == 0, child.stderr
        added = served.cli(
            "cron", "add", "--every", "1", "--name", "each-second", "--command",
            "sh", "-c", f"date +%s.%N >> {runs}",
        )  # fmt: skip
        assert added.returncode == 0, added.stderr
        assert wait_until(lambda: len(_stamps(runs)) >= 2, seconds=15)
        asked = time.time()
        assert served.stop() == 0
        stopped = time.time()
        assert stopped - asked >= 1.5  # the grace period was waited out: the timer had time to fire
        late = [stamp for stamp in _stamps(runs) if stamp > asked + 0.3]
        assert late == [], served.log()
        before = len(_stamps(runs))
        again = start_serve(tmp_path / "state", "--grace-seconds", "2")
        try:
            assert wait_until(lambda: len(_stamps(runs)) > before, seconds=15)  # due, so it runs
        finally:
            assert again.stop() == 0
    finally:
        served.stop()
        kill_leftovers(rf"sleep 401\.3{SESSION}")
