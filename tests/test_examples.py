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
