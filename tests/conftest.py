from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from engine import Supervisor, open_supervisor

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


@pytest.fixture
async def supervisor() -> AsyncIterator[Supervisor]:
    async with open_supervisor(grace_seconds=SHORT_GRACE, kill_wait_seconds=2.0) as sup:
        yield sup


@pytest.fixture
def project_dir(tmp_path: Path) -> Path:
    d = tmp_path / "project"
    d.mkdir()
    return d
