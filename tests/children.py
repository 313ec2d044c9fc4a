"""Child-process snippets and process-table checks shared by the tests.

Every process a test looks up or kills belongs to this test session. Its command line carries a marker
unique to the session (:func:`mark`: ``sleep 301.1`` becomes ``sleep 301.1048213``), or a path under
this session's temporary directory (a state dir: guardians and shims carry it in their argv). Every child
also inherits :data:`SESSION_VAR` (``tests/conftest.py`` exports it), and :func:`pgrep` skips a process
whose environment names another session. So two test runs on one machine never see, or kill, each
other's processes (``cases.md``'s convention for markers).
"""

from __future__ import annotations

import inspect
import os
import random
import re
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Final

import trio

PY = sys.executable

#: The environment variable every child of the session inherits, holding :data:`SESSION`.
SESSION_VAR: Final = "GADGET_TEST_SESSION"


def _session_digits() -> str:
    rng = random.SystemRandom()
    # Seven digits, the last never 0: a marker read back as a float keeps every digit.
    return f"{rng.randrange(10**5, 10**6)}{rng.randrange(1, 10)}"


#: Random digits fixed for the whole test session (one pytest run).
SESSION: Final = _session_digits()

#: Folders unique to this session (its pytest base temp dir), registered by ``tests/conftest.py``.
_session_roots: list[str] = []


def mark(base: str) -> str:
    """``base``, a decimal number, made unique to this session: ``mark("301.1") == "301.1" + SESSION``.

    The digits go after the last one, so the marker is still a number (a ``sleep`` or ``time.sleep``
    duration that differs from ``base`` by less than one unit of its last place).

    Raises:
        ValueError: ``base`` is not a decimal number with a fractional part.
    """
    if not re.fullmatch(r"\d+\.\d+", base):
        raise ValueError(f"marker base must be a decimal number like '301.1', got {base!r}")
    return base + SESSION


def add_session_root(path: str | Path) -> None:
    """Register a folder only this session uses; a :func:`pgrep` pattern naming a path under it is owned."""
    _session_roots.append(str(path).rstrip("/") + "/")


def owned(pattern: str) -> bool:
    """Whether ``pattern`` names something unique to this session: :data:`SESSION` or a session path."""
    return SESSION in pattern or any(root in pattern + "/" for root in _session_roots)


def py(code: str) -> tuple[str, ...]:
    """argv running a Python snippet with the test interpreter."""
    return (PY, "-c", code)


def ignoring_sigint(marker: str) -> tuple[str, ...]:
    """Prints ``ready`` then sleeps ``marker`` seconds (a :func:`mark` so :func:`pgrep` finds it)."""
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


def _environ(pid: int) -> dict[bytes, bytes] | None:
    """The environment of ``pid``, or ``None`` when it is gone or unreadable."""
    try:
        data = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    return dict(item.partition(b"=")[::2] for item in data.split(b"\0") if item)


def session_of(pid: int) -> str | None:
    """The :data:`SESSION_VAR` value in the environment of ``pid``; ``None`` if absent, gone or unreadable.

    (A process in the middle of ``exec`` shows an empty environment for a moment: ``None`` too.)
    """
    value = (_environ(pid) or {}).get(SESSION_VAR.encode())
    return None if value is None else value.decode(errors="replace")


def pgrep(pattern: str) -> list[int]:
    """This session's pids whose command line matches ``pattern`` (``pgrep -f``; zombies never match).

    The test process is excluded, and so is any process whose environment names another session.

    Raises:
        ValueError: ``pattern`` holds neither :data:`SESSION` nor a path under this session's temporary
            directory, so it could match another test run's processes.
    """
    if not owned(pattern):
        raise ValueError(
            f"pattern {pattern!r} is not unique to this test session: "
            "put a marker from children.mark() or a tmp_path in it"
        )
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True, check=False).stdout
    pids = [int(p) for p in out.split() if int(p) != os.getpid()]
    return [pid for pid in pids if session_of(pid) in (None, SESSION)]


def pgrep_env(name: str, text: str) -> list[int]:
    """This session's pids whose environment variable ``name`` contains ``text``.

    For what is not in a command line: the bash wrapper of an on-exit command carries the command
    string in ``GADGET_WATCH_COMMAND``, and its children inherit it.
    """
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        env = _environ(int(entry))
        if env is None or env.get(SESSION_VAR.encode()) != SESSION.encode():
            continue
        value = env.get(name.encode())
        if value is not None and text.encode() in value:
            found.append(int(entry))
    return found


def kill_pids(pids: list[int]) -> None:
    """SIGKILL each of ``pids`` (already gone is fine), and reap those that are this process's children.

    A watched on-exit command left running by a graceful stop stays a child of the test process (the
    engine was embedded in it): without the reap it would stay a zombie for the rest of the session.
    """
    for pid in pids:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
    for pid in pids:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass  # not our child: its parent reaps it


def kill_leftovers(pattern: str) -> None:
    """Last-resort clean-up so one failing test does not leave sleepers for the next.

    Only this session's processes, by :func:`pgrep`'s rules.
    """
    kill_pids(pgrep(pattern))


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
    return process_fds(os.getpid())


def process_fds(pid: int) -> int:
    """How many descriptors process ``pid`` has open, less those an engine keeps on its own threads'
    ``/proc`` files (``engine._own_children``: the task folder and one per thread, kept until the look
    after a thread ends, so they come and go with Trio's worker threads; its own tests count them)."""
    own = f"/proc/{pid}/task"
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(own):
                continue
        except OSError:
            continue  # closed meanwhile
        count += 1
    return count


async def wait_until(
    predicate: Callable[[], bool | Awaitable[bool]], *, seconds: float = 10.0, interval: float = 0.02
) -> None:
    """Poll ``predicate()`` (plain or async) every ``interval`` until it is true; fail after ``seconds``.

    Raises:
        trio.TooSlowError: it was still false after ``seconds``.
    """
    with trio.fail_after(seconds):
        while True:
            result = predicate()
            if inspect.isawaitable(result):
                result = await result
            if result:
                return
            await trio.sleep(interval)


async def wait_for_text(path: Path | str, text: str, *, seconds: float = 10.0) -> None:
    """Wait (polling every 10 ms, up to ``seconds``) until the file at ``path`` contains ``text``."""

    def found() -> bool:
        try:
            return text in Path(path).read_text(errors="replace")
        except FileNotFoundError:
            return False

    await wait_until(found, seconds=seconds, interval=0.01)


async def wait_for_state(pid: int, state: str, *, seconds: float = 10.0) -> None:
    await wait_until(lambda: proc_state(pid) == state, seconds=seconds, interval=0.01)
