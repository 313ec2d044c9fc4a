"""Child-process snippets and process-table checks shared by the tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import trio

PY = sys.executable


def py(code: str) -> tuple[str, ...]:
    """argv running a Python snippet with the test interpreter."""
    return (PY, "-c", code)


#: Prints ``ready`` then sleeps; ``marker`` is a unique float so ``pgrep -f`` finds it.
def ignoring_sigint(marker: str) -> tuple[str, ...]:
    return py(
        "import signal,time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
        f"print('ready', flush=True); time.sleep({marker})"
    )


def cooperative(marker: str) -> tuple[str, ...]:
    """Exits 0 on SIGINT after printing ``bye``."""
    return py(
        "import signal,sys,time\n"
        "def h(s,f):\n    print('bye', flush=True); sys.exit(0)\n"
        "signal.signal(signal.SIGINT, h)\n"
        f"print('ready', flush=True); time.sleep({marker})"
    )


def pgrep(pattern: str) -> list[int]:
    """Pids whose command line matches ``pattern`` (zombies never match), the test process excluded."""
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True, check=False).stdout
    return [int(p) for p in out.split() if int(p) != os.getpid()]


def proc_exists(pid: int) -> bool:
    """Whether ``/proc/<pid>`` exists at all (a zombie counts)."""
    return os.path.exists(f"/proc/{pid}")


def proc_state(pid: int) -> str | None:
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    return data[data.rfind(b")") + 2 :].split()[0].decode()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def wait_for_text(path: Path | str, text: str, *, seconds: float = 10.0) -> None:
    """Wait (polling every 10 ms, up to ``seconds``) until the file at ``path`` contains ``text``."""
    with trio.fail_after(seconds):
        while True:
            try:
                if text in Path(path).read_text(errors="replace"):
                    return
            except FileNotFoundError:
                pass
            await trio.sleep(0.01)


async def wait_for_state(pid: int, state: str, *, seconds: float = 10.0) -> None:
    with trio.fail_after(seconds):
        while proc_state(pid) != state:
            await trio.sleep(0.01)


def kill_leftovers(pattern: str) -> None:
    """Last-resort clean-up so one failing test does not leave sleepers for the next."""
    for pid in pgrep(pattern):
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
