"""The examples under docs/examples run as documented."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).parent.parent / "docs" / "examples"


def test_examples_supervisor_demo_runs_and_leaves_nothing() -> None:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "demo.py")], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert "processes left: none" in proc.stdout
    assert "escalated=True" in proc.stdout


def test_examples_standalone_demo_fires_and_leaves_nothing() -> None:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "standalone_demo.py")],
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "GET /index.html -> <h1>hello from the dev server</h1>" in proc.stdout
    assert "exit code 1, last lines:" in proc.stdout and "3 passed, 1 failed" in proc.stdout
    assert "processes left: none" in proc.stdout
