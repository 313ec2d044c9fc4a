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

SECTION_0_SERVICE_AND_CRON = [
    "Project",
    "SubProcessService",
    "SubProcessSummary",
    "LogSlice",
    "SubprocessTool",
    "At",
    "Every",
    "Cron",
    "OnExit",
    "compute_next_run_at",
    "SystemEvent",
    "Command",
    "CronJob",
    "CronService",
    "FiredEvent",
    "CronExitWatchers",
    "resolve_exit_watch_shell",
]

SECTION_0_METHODS = {
    "Supervisor": ["spawn", "cancel", "cancel_scope", "runs"],
    "ManagedRun": ["wait"],
    "SubProcessService": [
        "create",
        "ps",
        "summarize",
        "kill_pid",
        "kill_subprocess",
        "kill_project",
        "kill_all",
        "halt_pid",
        "halt_subprocess",
        "get_log",
        "read_log",
    ],
    "CronService": ["add", "update", "remove", "enable", "disable", "get", "list", "run_now", "events"],
    "CronExitWatchers": ["reconcile", "cancel", "cancel_all", "active_job_ids"],
    "SubprocessTool": ["execute"],
}


def test_public_api_names_are_exported() -> None:
    for name in SECTION_0_SUPERVISOR + SECTION_0_SERVICE_AND_CRON:
        assert hasattr(engine, name), name


def test_public_api_methods_exist() -> None:
    for cls, methods in SECTION_0_METHODS.items():
        for method in methods:
            assert callable(getattr(getattr(engine, cls), method)), f"{cls}.{method}"


def test_public_api_resolve_exit_watch_shell_per_platform() -> None:
    assert engine.resolve_exit_watch_shell("linux") == ("bash", "-lc", "--")
    assert engine.resolve_exit_watch_shell("win32") == ("cmd.exe", "/d", "/s", "/c")
    assert engine.resolve_exit_watch_shell("win32", "  ") == ("cmd.exe", "/d", "/s", "/c")
    assert engine.resolve_exit_watch_shell("win32", r"C:\cmd.exe")[0] == r"C:\cmd.exe"


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
