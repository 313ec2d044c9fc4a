"""The look at a process's children (``engine._procfs``): by path (``children_of``), and through
descriptors opened ahead (``open_children_of`` / ``children_by_fds``), on real processes with one thread
and with several, whose children a thread other than the main one started; and the engine's look at its
own children through descriptors kept on its threads (``engine._own_children``)."""

from __future__ import annotations

import errno
import json
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


# ---- the engine's own children, through kept descriptors ------------------------------------------
# Each in a Python of its own: pytest's faulthandler timeout runs a thread Python did not start, with which
# nothing is ever kept.

_THREADS_COME_AND_GO = """
import json, os, subprocess, sys, threading
own = OwnChildren()
children = []
def spawn_then_wait(until):
    children.append(subprocess.Popen(['sleep', sys.argv[1]]))
    until.wait()
def started(until):
    n = len(children)
    t = threading.Thread(target=spawn_then_wait, args=(until,))
    t.start()
    while len(children) == n:
        threading.Event().wait(0.005)
    return t
out = {}
children.append(subprocess.Popen(['sleep', sys.argv[1]]))
stop, ends = threading.Event(), threading.Event()
started(stop)
out['first'] = own.read(); out['kept_first'] = own.kept; out['again'] = own.read()
out['listings_again'] = own.listings
late = started(ends)
out['after_start'] = own.read(); out['kept_after_start'] = own.kept
ends.set(); late.join()
out['after_end'] = own.read()  # the thread may still be in the kernel's count: read by path then
while len(os.listdir('/proc/self/task')) != len(threading.enumerate()):
    threading.Event().wait(0.001)  # the ended thread leaves the kernel's count a moment after join
own.read(); out['kept_after_end'] = own.kept
out['threads'] = len(threading.enumerate()); out['children'] = [c.pid for c in children]
own.close(); out['kept_closed'] = own.kept
stop.set()
for c in children:
    c.kill(); c.wait()
print(json.dumps(out))
"""


def _run_json(code: str, marker: str) -> dict[str, object]:
    """Run ``code`` (with :class:`OwnChildren` imported) in a Python of its own; what it printed."""
    code = "from engine._own_children import OwnChildren\n" + code
    try:
        out = subprocess.run([*py(code), marker], capture_output=True, text=True, timeout=30, check=True)
    finally:
        kill_leftovers(marker)
    seen: dict[str, object] = json.loads(out.stdout)
    return seen


def _pids(value: object) -> set[int]:
    assert isinstance(value, list)
    return {int(pid) for pid in value}


def test_own_children_of_every_thread_as_threads_come_and_go() -> None:
    """The engine's look at its own children finds those of each thread, keeps one descriptor per
    thread while the threads stay the same, and follows a thread that starts (and its child) and one that
    ends (its child is then another thread's)."""
    seen = _run_json(_THREADS_COME_AND_GO, mark("337.1"))
    children = seen["children"]
    assert isinstance(children, list) and len(children) == 3
    assert _pids(children[:2]) <= _pids(seen["first"])
    assert seen["kept_first"] == 2  # the main thread and the spawning one
    assert seen["again"] == seen["first"]  # through the kept descriptors: the same list
    assert seen["listings_again"] == 1  # ... with no listing of the threads
    assert _pids(children) <= _pids(seen["after_start"])
    assert seen["kept_after_start"] == 3
    assert _pids(children) <= _pids(seen["after_end"])
    assert seen["kept_after_end"] == seen["threads"] == 2
    assert seen["kept_closed"] == 0


_FOREIGN_THREAD = """
import _thread, json, os, sys
own = OwnChildren()
started, release = _thread.allocate_lock(), _thread.allocate_lock()
started.acquire(); release.acquire()
pids = []
def foreign():  # no threading call in it: never listed by threading.enumerate
    pids.append(os.posix_spawn('/bin/sleep', ['sleep', sys.argv[1]], dict(os.environ)))
    started.release()
    release.acquire()
_thread.start_new_thread(foreign, ())
started.acquire()
reads = [own.read() for _ in range(2)]
out = {'child': pids[0], 'reads': reads, 'kept': own.kept, 'listings': own.listings}
os.kill(pids[0], 9); os.waitpid(pids[0], 0)
print(json.dumps(out))
"""


def test_own_children_with_a_thread_python_did_not_start_reads_by_path() -> None:
    """A thread :func:`threading.enumerate` does not list (an embedding host's): nothing is kept, every
    look lists the threads, and that thread's child is found each time."""
    seen = _run_json(_FOREIGN_THREAD, mark("337.2"))
    assert seen["reads"] == [[seen["child"]], [seen["child"]]]
    assert seen["kept"] == 0
    assert seen["listings"] == 2


_FORKED = """
import json, os, subprocess, sys
own = OwnChildren()
parent_child = subprocess.Popen(['sleep', sys.argv[1]])
before = own.read()
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    mine = subprocess.Popen(['sleep', sys.argv[1]])
    os.write(w, json.dumps({'mine': mine.pid, 'read': own.read(), 'kept': own.kept}).encode())
    mine.kill(); mine.wait()
    os._exit(0)
os.close(w)
seen = json.loads(os.read(r, 65536))
os.waitpid(pid, 0)
parent_child.kill(); parent_child.wait()
print(json.dumps({'parent_child': parent_child.pid, 'before': before, **seen}))
"""


def test_own_children_in_a_forked_child_are_its_own() -> None:
    """Descriptors kept by a parent name the parent's threads: a forked child reads its own children."""
    seen = _run_json(_FORKED, mark("337.3"))
    assert seen["before"] == [seen["parent_child"]]
    assert seen["read"] == [seen["mine"]]
    assert seen["kept"] == 1


_CONCURRENT = """
import json, os, subprocess, sys, threading
own = OwnChildren()
kids = [subprocess.Popen(['sleep', sys.argv[1]]) for _ in range(2)]
want = {k.pid for k in kids}
stop = threading.Event()
errors, wrong, looks = [], [], [0]
def reader():
    while not stop.is_set():
        try:
            got = own.read()
        except Exception as exc:
            errors.append(repr(exc))
            continue
        looks[0] += 1
        if got is None or not want <= set(got):
            wrong.append(got)
def churn():  # threads that come and go: the kept descriptors are dropped and made again
    while not stop.is_set():
        t = threading.Thread(target=lambda: None)
        t.start(); t.join()
readers = [threading.Thread(target=reader) for _ in range(3)] + [threading.Thread(target=churn)]
[t.start() for t in readers]
threading.Event().wait(1.5)
stop.set()
[t.join() for t in readers]
for k in kids:
    k.kill(); k.wait()
print(json.dumps({'errors': errors[:5], 'wrong': wrong[:5], 'looks': looks[0]}))
"""


def test_own_children_read_from_several_threads_at_once() -> None:
    """The escalation driver also runs in worker threads (``Supervisor.end_processes``, the start-up
    sweep): looks from several threads at once, while threads come and go, each find every child and
    never read a descriptor another look closed."""
    seen = _run_json(_CONCURRENT, mark("337.4"))
    assert seen["errors"] == [] and seen["wrong"] == []
    assert isinstance(seen["looks"], int) and seen["looks"] > 100


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
