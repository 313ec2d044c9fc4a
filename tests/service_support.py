"""Shared set-up for the subprocess service and tool tests: an engine on a temporary state dir, projects."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from engine import Engine, EngineConfig, Project, SubProcess, open_engine

from .conftest import SHORT_GRACE


@asynccontextmanager
async def engine_at(
    tmp_path: Path, *, grace_seconds: float = SHORT_GRACE, **settings: object
) -> AsyncIterator[Engine]:
    """An engine whose state dir is under ``tmp_path`` (short grace unless the default is the point)."""
    config = EngineConfig(
        state_dir=str(tmp_path / "state"),
        grace_seconds=grace_seconds,
        kill_wait_seconds=2.0,
        **settings,  # type: ignore[arg-type]  # EngineConfig's own validators check the values
    )
    async with open_engine(config) as engine:
        yield engine


def make_project(tmp_path: Path, name: str = "project") -> Project:
    directory = tmp_path / name
    directory.mkdir(exist_ok=True)
    return Project.from_directory(directory)


def log_dir(project: Project) -> Path:
    return Path(project.directory) / ".gadget" / "subprocess-logs"


def fds_pointing_at(paths: list[str]) -> list[str]:
    """This process's descriptors open on any of ``paths``."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.removesuffix(" (deleted)") in paths:
            found.append(target)
    return found


def log_paths(sp: SubProcess) -> list[str]:
    return [sp.stdout_path, sp.stderr_path]
