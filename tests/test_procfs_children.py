"""The look at a process's children (``engine._procfs``): by path (``children_of``), and through
descriptors opened ahead (``open_children_of`` / ``children_by_fds``), on real processes with one thread
and with several, whose children a thread other than the main one started; and the engine's shared read
of its own children (``engine._escalation_driver.children_read_since``)."""

from __future__ import annotations

import errno
import os
import subprocess
import time
from collections.abc import Iterator

import pytest
import trio

from engine import _escalation_driver
from engine._escalation_driver import children_read_since
from engine._procfs import children_by_fds, children_of, open_children_of

from .children import kill_leftovers, mark, py

#: Starts ``sleep MARK`` (its output not on the parent's pipe) and prints its pid.
_SPAWN = "c = subprocess.Popen(['sleep', sys.argv[1]], stdout=subprocess.DEVNULL); print(c.pid, flush=True)"
#: A parent of one thread: starts the child, then waits.
_ONE_THREAD = f"import subprocess,sys,time; {_SPAWN}; time.sleep(600)"
#: A parent of three threads, whose child was started by one of the other two.
_THREADS = (
    "import subprocess,sys,threading,time\n"
    "ev = threading.Event()\n"
    "def spawn():\n"
    f"    {_SPAWN}; ev.wait()\n"
    "ts = [threading.Thread(target=spawn), threading.Thread(target=ev.wait)]\n"
    "[t.start() for t in ts]\n"
    "time.sleep(600)\n"
)
#: A parent of one thread that starts the child once it reads a line.
_ON_LINE = f"import subprocess,sys,time; sys.stdin.readline(); {_SPAWN}; time.sleep(600)"


def _start(code: str, marker: str) -> tuple[subprocess.Popen[str], int]:
    parent = subprocess.Popen([*py(code), marker], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    return parent, child


@pytest.fixture
def parents() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for parent in started:
        parent.kill()
        parent.communicate()  # reaps it, and closes its pipes
    kill_leftovers(mark("336.9"))


def test_children_of_a_one_thread_process(parents: list[subprocess.Popen[str]]) -> None:
    parent, child = _start(_ONE_THREAD, mark("336.9"))
    parents.append(parent)
    assert children_of(parent.pid) == [child]


def test_children_of_finds_a_child_another_thread_started(parents: list[subprocess.Popen[str]]) -> None:
    """With several threads each thread's list is read: the child of a thread that is not the main one is
    found (the one-thread shortcut is not taken)."""
    parent, child = _start(_THREADS, mark("336.9"))
    parents.append(parent)
    assert children_of(parent.pid) == [child]


def test_children_by_fds_reads_afresh_and_leaves_several_threads_to_the_path(
    parents: list[subprocess.Popen[str]],
) -> None:
    marker = mark("336.9")
    one = subprocess.Popen([*py(_ON_LINE), marker], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    parents.append(one)
    fds = open_children_of(one.pid)
    assert fds is not None
    try:
        assert children_by_fds(*fds) == []  # no child yet
        assert one.stdin is not None and one.stdout is not None
        one.stdin.write("go\n")
        one.stdin.flush()
        child = int(one.stdout.readline())
        assert children_by_fds(*fds) == [child]  # the same descriptors, read again: the new list
        assert children_by_fds(*fds) == [child]
        one.kill()
        one.wait()
        assert children_by_fds(*fds) in (None, [])  # gone: nothing, and no error
    finally:
        for fd in fds:
            os.close(fd)

    several, _child = _start(_THREADS, marker)
    parents.append(several)
    fds = open_children_of(several.pid)
    assert fds is not None
    try:
        assert children_by_fds(*fds) is None  # several threads: read by path (children_of)
    finally:
        for fd in fds:
            os.close(fd)


def test_open_children_of_a_process_that_is_gone() -> None:
    proc = subprocess.Popen(["true"])
    proc.wait()
    assert open_children_of(proc.pid) is None


async def test_a_shared_read_that_fails_leaves_no_task_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    """``children_read_since``: the tasks of one scheduler pass share one read; when that read fails
    (a fake at the edge: the read raises), its error goes up in the task that made it, and the others
    are woken, not left waiting for a read that never comes (they were shielded kill waits: a hang)."""

    def failing_read() -> frozenset[int]:
        raise OSError(errno.EMFILE, "no descriptor left")

    monkeypatch.setattr(_escalation_driver, "engine_children", failing_read)
    monkeypatch.setattr(_escalation_driver, "children_read_size", lambda: 1000)  # a list read once a pass
    since = time.monotonic() + 3600  # no read kept is that recent
    outcomes: list[str] = []

    async def look() -> None:
        try:
            await children_read_since(since)
        except OSError:
            outcomes.append("the read's error")
        else:
            outcomes.append("woken")

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(look)
            nursery.start_soon(look)
    assert sorted(outcomes) == ["the read's error", "woken"]
