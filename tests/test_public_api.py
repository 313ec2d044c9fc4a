"""Every public name of design section 0 is importable from ``engine``, exported once."""

from __future__ import annotations

import ast
import subprocess
import sys
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


def _type_checking_imports() -> dict[str, str]:
    """``{name: module}`` of the ``if TYPE_CHECKING:`` block of engine/__init__.py (what mypy sees)."""
    tree = ast.parse(Path(engine.__file__).read_text())
    block = next(node for node in tree.body if isinstance(node, ast.If))
    out: dict[str, str] = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom)
        for alias in node.names:
            name = alias.asname or alias.name
            assert name not in out, f"{name} exported twice"
            out[name] = "." * node.level + (node.module or "")
    return out


def test_public_api_each_name_exported_once() -> None:
    imports = _type_checking_imports()
    assert imports == engine._EXPORTS  # the lazy table and the typed imports name the same things
    assert engine.__all__ == sorted(imports)
    for name in engine.__all__:
        assert getattr(engine, name) is not None
    assert set(engine.__all__) <= set(dir(engine))


def test_public_api_clients_import_without_trio() -> None:
    code = (
        "import sys; sys.modules['trio'] = None; import engine; "
        "print(engine.EngineClient.__name__, engine.AsyncEngineClient.__name__, engine.SpawnError.__name__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["EngineClient", "AsyncEngineClient", "SpawnError"]


def test_public_api_errors_subclass_stdlib_types() -> None:
    assert issubclass(engine.SpawnError, OSError)
    assert issubclass(engine.SubProcessNotFoundError, LookupError)
    assert issubclass(engine.JobNotFoundError, LookupError)
    assert issubclass(engine.InvalidScheduleError, ValueError)
    assert issubclass(engine.InvalidArgumentError, ValueError)
    assert issubclass(engine.InvalidArgumentError, engine.EngineError)
    assert not issubclass(engine.InvalidArgumentError, engine.InvalidScheduleError)
    assert issubclass(engine.LimitExceededError, RuntimeError)
    assert issubclass(engine.StoreError, OSError)
    assert issubclass(engine.EngineLockedError, RuntimeError)
    for name in SECTION_0_SUPERVISOR[10:]:
        assert issubclass(getattr(engine, name), engine.EngineError)
