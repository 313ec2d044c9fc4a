"""The examples under docs/examples run as documented."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parent.parent / "docs" / "examples"


def isolated_env(home: Path) -> dict[str, str]:
    """The environment with HOME in a fresh folder: the examples' login shells (`bash -lc`) then read
    no profile of the machine's user (a profile's own failure, such as a stale pyenv rehash lock that
    makes every login shell wait 60 s, is not what these tests are about)."""
    home.mkdir(exist_ok=True)
    return {**os.environ, "HOME": str(home)}


@pytest.mark.machine_wide  # the demo counts survivors with a machine-wide `pgrep -f`
def test_examples_supervisor_demo_runs_and_leaves_nothing() -> None:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "demo.py")], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert "processes left: none" in proc.stdout
    assert "escalated=True" in proc.stdout


def test_examples_standalone_demo_fires_and_leaves_nothing(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "standalone_demo.py")],
        env=isolated_env(tmp_path / "home"),
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "GET /index.html -> <h1>hello from the dev server</h1>" in proc.stdout
    assert "exit code 1, last lines:" in proc.stdout and "3 passed, 1 failed" in proc.stdout
    assert "processes left: none" in proc.stdout


def test_examples_on_exit_example_fires_with_exit_code(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "on_exit_example.py"), str(tmp_path / "state")],
        env=isolated_env(tmp_path / "home"),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "exit code: 1 | job enabled after firing: False" in proc.stdout
    assert "3 passed, 1 failed" in proc.stdout
