"""Every public name of design section 0 is importable from ``engine``, exported once."""

from __future__ import annotations

import ast
from pathlib import Path

import engine

SECTION_0_SUPERVISOR = [
    "EngineConfig",
    "open_engine",
    "Engine",
    "open_supervisor",
    "SpawnSpec",
    "Supervisor",
    "ManagedRun",
    "RunExit",
    "RunState",
    "TerminationReason",
    "EngineError",
    "SpawnError",
    "SubProcessNotFoundError",
    "JobNotFoundError",
    "InvalidScheduleError",
    "LimitExceededError",
    "StoreError",
    "EngineLockedError",
]


def test_public_api_names_are_exported() -> None:
    for name in SECTION_0_SUPERVISOR:
        assert hasattr(engine, name), name


def test_public_api_each_name_exported_once() -> None:
    tree = ast.parse(Path(engine.__file__).read_text())
    names = [
        alias.asname or alias.name
        for node in tree.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    ]
    names = [n for n in names if n != "annotations"]
    assert len(names) == len(set(names))


def test_public_api_errors_subclass_stdlib_types() -> None:
    assert issubclass(engine.SpawnError, OSError)
    assert issubclass(engine.SubProcessNotFoundError, LookupError)
    assert issubclass(engine.JobNotFoundError, LookupError)
    assert issubclass(engine.InvalidScheduleError, ValueError)
    assert issubclass(engine.LimitExceededError, RuntimeError)
    assert issubclass(engine.StoreError, OSError)
    assert issubclass(engine.EngineLockedError, RuntimeError)
    for name in SECTION_0_SUPERVISOR[10:]:
        assert issubclass(getattr(engine, name), engine.EngineError)
