"""The benchmark suite stays runnable: its quick mode on the cheap workloads, without the bench extra."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_benchmarks_quick_run_writes_results(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.run",
            "--quick",
            "--only",
            "spawn,cron",
            "--no-supervisord",
            "--no-plot",
            "--out",
            str(out),
            "--tmp",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    table = (out / "results.md").read_text()
    assert "| spawn-to-exit of `true` | SubProcessService.create + wait |" in table
    assert "cron timer decision" in table
    # how fast the host ran this VM at each workload's start and end, beside the load average
    (probe,) = [line for line in table.splitlines() if line.startswith("- the CPU probe per workload")]
    assert "spawn " in probe and "cron " in probe
    data = json.loads((out / "results.json").read_text())
    assert set(data["meta"]["workload_cpu_probe"]) == {"spawn", "cron"}
    ratios = [row["ratios"] for row in data["rows"] if row["baseline"]]
    assert ratios and all(r and all(x > 0 for x in r) for r in ratios)


def test_benchmarks_log_bytes_flag_parses_sizes() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "from benchmarks.run import parse_size as p; print(p('1GiB'), p('256M'), p('4096'))",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert proc.stdout.split() == [str(2**30), str(256 * 2**20), "4096"]


def test_spawn_row_is_a_floor_only_when_the_file_work_alone_outlasts_the_baseline() -> None:
    """The service's spawn row shows ``floor`` when its target is missed and the two log files it must
    make per create took longer, measured alone in the same rounds, than the baseline's whole spawn."""
    from benchmarks import spawn

    def rows(log_pair_ms: float, service_ms: float) -> dict[str, tuple[bool | None, bool]]:
        ms = {
            spawn.TRIO: [1.0] * 20,
            spawn.LOG_PAIR: [log_pair_ms] * 20,
            spawn.POPEN: [0.8] * 20,
            spawn.POSIX_SPAWN: [0.7] * 20,
            f"{spawn.SERVICE}|cgroup": [service_ms] * 20,
            f"{spawn.SUPERVISOR}|cgroup": [1.0] * 20,
        }
        return {r.variant: (r.met, r.floor) for r in spawn._rows(ms, ("cgroup",), 5, "files") if r.target}

    assert rows(log_pair_ms=1.8, service_ms=1.4)[spawn.SERVICE] == (False, True)
    assert rows(log_pair_ms=0.3, service_ms=1.4)[spawn.SERVICE] == (False, False)
    assert rows(log_pair_ms=1.8, service_ms=0.9)[spawn.SERVICE] == (True, False)


def test_a_run_started_with_sigint_ignored_gives_the_baselines_cooperative_children() -> None:
    # Found in an official run started as a background job (SIGINT ignored): trio's and Popen's children
    # inherited the ignored SIGINT, so a cooperative `sleep` outlived it and every bare terminate baseline
    # waited the whole grace period, while the engine's children (it resets every signal) did not.
    script = (
        "import signal, subprocess, time\n"
        "from benchmarks.run import _default_signals\n"
        "print(_default_signals())\n"
        "child = subprocess.Popen(['sleep', '60'])\n"
        "time.sleep(0.2)\n"
        "child.send_signal(signal.SIGINT)\n"
        "try:\n"
        "    print(child.wait(timeout=10))\n"
        "finally:\n"
        "    child.kill()\n"
    )
    ignoring = "import signal, subprocess, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
    ignoring += "signal.signal(signal.SIGQUIT, signal.SIG_IGN); "
    ignoring += "sys.exit(subprocess.run([sys.executable, '-c', sys.argv[1]]).returncode)"
    proc = subprocess.run(
        [sys.executable, "-c", ignoring, script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "['SIGINT', 'SIGQUIT']\n-2\n"  # ended by the SIGINT, not by a SIGKILL later


def test_the_benchmarks_supervisord_ends_with_a_runner_killed_by_sigkill(tmp_path: Path) -> None:
    """A runner stopped by a signal runs no clean-up: its supervisord (and the sleepers it runs) went on
    running. The kernel now ends it with the runner (``PR_SET_PDEATHSIG``)."""
    pytest.importorskip("supervisor", reason="the bench extra (supervisor) is not installed")
    script = (
        "import sys, time; from benchmarks._supervisord import Supervisord; "
        f"sd = Supervisord({str(tmp_path)!r}, 1000); sd.start(); "
        "print(sd._proc.pid, flush=True); time.sleep(60)"
    )
    argv = [sys.executable, "-c", script]
    with subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, text=True) as runner:
        assert runner.stdout is not None
        supervisord = int(runner.stdout.readline())
        os.kill(runner.pid, signal.SIGKILL)
    deadline = time.monotonic() + 15
    while os.path.exists(f"/proc/{supervisord}") and time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(supervisord, os.WNOHANG)
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{supervisord}")
