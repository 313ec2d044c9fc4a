from __future__ import annotations

import contextlib
import fcntl
import itertools
import math
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, settings

from engine import Supervisor, open_supervisor
from engine._cgroup import EngineCgroup, find_cgroup2

from .children import SESSION, SESSION_VAR, add_session_root, kill_leftovers, mark
from .pg_support import fresh_database
from .serve_support import Served, start_serve

# Every child a test starts (directly, through an engine, a serve or a shim) inherits the session tag:
# children.pgrep skips processes of other sessions by it.
os.environ[SESSION_VAR] = SESSION

settings.register_profile(
    "ci",
    max_examples=25,
    stateful_step_count=10,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.register_profile(
    "dev",
    max_examples=200,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

#: The grace period tests use unless the 5 s default is the point.
SHORT_GRACE = 0.4

#: The machine-wide lock of the ``serial`` and ``machine_wide`` tests: one such test at a time on the
#: machine, whichever checkout or test run it comes from.
MACHINE_LOCK = "/tmp/gadget-engine-tests.lock"
#: How long a test waits for the lock before it fails (a whole suite's serial tests take ~1 min).
MACHINE_LOCK_SECONDS = 600.0

_lock_waits: list[float] = []
_markers = itertools.count(1)


def pytest_configure(config: pytest.Config) -> None:
    # SIGINT and SIGQUIT back to their defaults, for this process and every child it starts: a shell
    # script runs a command it puts in the background with both ignored, every child inherits that
    # through exec, and the tests of Ctrl-C (130, "it runs on") and of SIGINT before SIGKILL then fail.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)
    config.addinivalue_line(
        "markers",
        "machine_wide: looks at the whole machine's process table (the docs demos' pgrep); "
        "holds the machine-wide test lock, as serial tests do",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``slow`` (the long trials: 20 fleet rounds) run only with ``GADGET_SLOW=1``."""
    if os.environ.get("GADGET_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="a long trial: run it with GADGET_SLOW=1")
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _lock_waits:
        terminalreporter.write_line(
            f"machine lock ({MACHINE_LOCK}): {len(_lock_waits)} tests, "
            f"{sum(_lock_waits):.1f} s waiting for it in all, {max(_lock_waits):.1f} s at most"
        )


@pytest.fixture(scope="session", autouse=True)
def _session_temp_root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Paths under this run's base temp dir are unique to the session: children.pgrep accepts them.

    At the end, the cgroups of this session's engines (named by the ``cgroup.path`` files in its state
    directories) are emptied (``cgroup.kill``) and removed: a watched command's leaf outlives its engine
    on purpose (for the next one, which a test's temporary state directory never gets), and a command a
    test left running there would end later and leave an empty folder behind.
    """
    base = tmp_path_factory.getbasetemp()
    add_session_root(base)
    yield
    for record in base.rglob("cgroup.path"):
        parent = Path(record.read_text().strip())
        if not parent.name.startswith("gadget-engine-") or not str(parent).startswith("/sys/fs/cgroup/"):
            continue
        if not parent.is_dir():
            continue
        with contextlib.suppress(OSError):
            (parent / "cgroup.kill").write_text("1")
            deadline = time.monotonic() + 5.0
            while "populated 1" in (parent / "cgroup.events").read_text() and time.monotonic() < deadline:
                time.sleep(0.02)
        for leaf in parent.iterdir():
            if leaf.is_dir() and not leaf.is_symlink():
                with contextlib.suppress(OSError):  # still populated: left alone
                    leaf.rmdir()
        with contextlib.suppress(OSError):
            parent.rmdir()


@pytest.fixture(autouse=True)
def _machine_lock(request: pytest.FixtureRequest) -> Iterator[None]:
    """Tests marked ``serial`` (time bounds) or ``machine_wide`` hold an flock on :data:`MACHINE_LOCK`.

    So two suites on one machine never run their kill budgets, or their machine-wide checks, at once.
    """
    node = request.node
    if node.get_closest_marker("serial") is None and node.get_closest_marker("machine_wide") is None:
        yield
        return
    fd = os.open(MACHINE_LOCK, os.O_RDONLY | os.O_CREAT, 0o666)
    try:
        started = time.monotonic()
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() - started > MACHINE_LOCK_SECONDS:
                    pytest.fail(f"the machine-wide test lock {MACHINE_LOCK} was held for too long")
                time.sleep(0.05)
        _lock_waits.append(time.monotonic() - started)
        yield
    finally:
        os.close(fd)  # releases the lock


def cgroup_unusable() -> str:
    """Why cgroup containment cannot be used here ("" where it can): no v2 mount, not writable, ..."""
    global _cgroup_why
    if _cgroup_why is None:
        found, why = find_cgroup2()
        if found is not None:
            try:
                EngineCgroup.open(found, f"/tests/{os.getpid()}/{SESSION}", record=False).close()
                why = ""
            except OSError as exc:
                why = str(exc)
        _cgroup_why = why
    return _cgroup_why


_cgroup_why: str | None = None


@pytest.fixture
def parent(tmp_path: Path) -> Iterator[EngineCgroup]:
    """An engine's parent cgroup of its own (the tests that take it skip where cgroup v2 is not writable);
    every leaf left in it is killed and it is removed afterwards."""
    found, why = find_cgroup2()
    assert found is not None, why
    cgroup = EngineCgroup.open(found, str(tmp_path))
    try:
        yield cgroup
    finally:
        for leaf in cgroup.leaves():
            leaf.kill()
        cgroup.close()


@pytest.fixture(params=["process-group", "cgroup"])
def containment(request: pytest.FixtureRequest) -> str:
    """Each containment mode in turn; cgroup is skipped, with the reason printed, where it cannot be used."""
    mode: str = request.param
    if mode == "cgroup" and (why := cgroup_unusable()):
        pytest.skip(f"cgroup containment is not usable here: {why}")
    return mode


@pytest.fixture
def needs_cgroup() -> None:
    """Skip (with the reason printed) where cgroup containment cannot be used."""
    if why := cgroup_unusable():
        pytest.skip(f"cgroup containment is not usable here: {why}")


@pytest.fixture
async def supervisor(containment: str) -> AsyncIterator[Supervisor]:
    async with open_supervisor(
        grace_seconds=SHORT_GRACE, kill_wait_seconds=2.0, containment=containment
    ) as sup:
        yield sup


@pytest.fixture
def project_dir(tmp_path: Path) -> Path:
    d = tmp_path / "project"
    d.mkdir()
    return d


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A project folder named ``app`` (its slug) for the CLI, RPC, MCP and asyncio tests."""
    directory = tmp_path / "app"
    directory.mkdir()
    return directory


@pytest.fixture
def cleanup() -> Iterator[list[str]]:
    """Patterns (each with the session's marker) of processes to end after the test: those it leaves running
    on purpose, or would leave if it failed half-way."""
    patterns: list[str] = []
    yield patterns
    for pattern in patterns:
        kill_leftovers(pattern)


@pytest.fixture
def marker() -> str:
    """A number unique to this test and session, for a child's command line (``sleep MARKER``)."""
    return mark(f"{4000 + next(_markers)}.5")


@pytest.fixture(scope="module")
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """One ``gadget-engine serve`` for a whole test module, on a state dir of its own."""
    name = request.module.__name__.rpartition(".")[2].removeprefix("test_")
    engine = start_serve(tmp_path_factory.mktemp(name) / "state")
    yield engine
    assert engine.stop() == 0


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A fresh database on the session's PostgreSQL (started once per session, ``tests/pg_support.py``)."""
    with fresh_database() as url:
        yield url


#: How long the loop must be idle before the autojump clock of :func:`store_clock` jumps, in seconds.
STORE_CLOCK_THRESHOLD_SECONDS = 0.05


@pytest.fixture
def store_clock(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> trio.testing.MockClock:
    """Trio's autojump clock, held still while a call runs in a worker thread (``trio.to_thread.run_sync``:
    the SQLite store's calls), however long the call takes.

    A task waiting for a thread looks idle to the clock, and a store's ``COMMIT`` waits for ``fsync``,
    which a loaded VM stretches past any fixed threshold (seen: 76-391 ms for one ``claim_due``): the
    clock then jumped to the test's own deadline while a fire was being recorded, and an hourly job seemed
    to have fired 8 times in a day.
    """
    autojump_clock.autojump_threshold = STORE_CLOCK_THRESHOLD_SECONDS
    real = trio.to_thread.run_sync
    in_threads = 0

    async def run_sync(*args: object, **kwargs: object) -> object:
        nonlocal in_threads
        in_threads += 1
        autojump_clock.autojump_threshold = math.inf
        try:
            return await real(*args, **kwargs)  # type: ignore[arg-type]
        finally:
            in_threads -= 1
            if not in_threads:
                autojump_clock.autojump_threshold = STORE_CLOCK_THRESHOLD_SECONDS

    monkeypatch.setattr(trio.to_thread, "run_sync", run_sync)
    return autojump_clock
