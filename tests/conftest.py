from __future__ import annotations

import itertools
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from engine import Supervisor, open_supervisor

from .children import SESSION, SESSION_VAR, add_session_root, mark
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

_markers = itertools.count(1)


@pytest.fixture(scope="session", autouse=True)
def _session_temp_root(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Paths under this run's base temp dir are unique to the session: children.pgrep accepts them."""
    add_session_root(tmp_path_factory.getbasetemp())


@pytest.fixture
async def supervisor() -> AsyncIterator[Supervisor]:
    async with open_supervisor(grace_seconds=SHORT_GRACE, kill_wait_seconds=2.0) as sup:
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
