"""gadget-engine: a Trio engine that supervises child processes for AI coding agents and async hosts.

The public names are loaded on first use (PEP 562), so ``import engine`` is cheap and the standard-library
clients (``engine.EngineClient``, ``engine.AsyncEngineClient``) work in a process without Trio; the CLI's
client commands start in ~0.1 s.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__ as __version__

if TYPE_CHECKING:
    from ._asyncio import AsyncioEngine as AsyncioEngine
    from ._asyncio import EngineClosedError as EngineClosedError
    from ._asyncio import open_asyncio_engine as open_asyncio_engine
    from ._config import EngineConfig as EngineConfig
    from ._engine import Engine as Engine
    from ._engine import EngineStatus as EngineStatus
    from ._engine import open_engine as open_engine
    from ._errors import EngineError as EngineError
    from ._errors import EngineLockedError as EngineLockedError
    from ._errors import InvalidArgumentError as InvalidArgumentError
    from ._errors import InvalidScheduleError as InvalidScheduleError
    from ._errors import JobNotFoundError as JobNotFoundError
    from ._errors import KillInProgressError as KillInProgressError
    from ._errors import LimitExceededError as LimitExceededError
    from ._errors import SpawnError as SpawnError
    from ._errors import StoreError as StoreError
    from ._errors import SubProcessNotFoundError as SubProcessNotFoundError
    from ._errors import UntrustedPathError as UntrustedPathError
    from ._logs import LogSlice as LogSlice
    from ._patterns import PatternTimeoutError as PatternTimeoutError
    from ._project import Project as Project
    from ._prompts import TOOL_MODES as TOOL_MODES
    from ._prompts import process_management_block as process_management_block
    from ._prompts import render_mode_prompt as render_mode_prompt
    from ._prompts import tools_for_mode as tools_for_mode
    from ._readiness import ReadyCheck as ReadyCheck
    from ._restart import RestartPolicy as RestartPolicy
    from ._stdin import StdinBlockedError as StdinBlockedError
    from ._stdin import StdinClosedError as StdinClosedError
    from ._subprocesses import SubProcess as SubProcess
    from ._subprocesses import SubProcessService as SubProcessService
    from ._subprocesses import SubProcessSummary as SubProcessSummary
    from ._subprocesses import open_subprocess_service as open_subprocess_service
    from ._supervisor import ManagedRun as ManagedRun
    from ._supervisor import RunExit as RunExit
    from ._supervisor import RunState as RunState
    from ._supervisor import SpawnSpec as SpawnSpec
    from ._supervisor import Supervisor as Supervisor
    from ._supervisor import TerminationReason as TerminationReason
    from ._supervisor import open_supervisor as open_supervisor
    from ._tool import SubprocessTool as SubprocessTool
    from .cron import At as At
    from .cron import Command as Command
    from .cron import Cron as Cron
    from .cron import CronExitWatchers as CronExitWatchers
    from .cron import CronJob as CronJob
    from .cron import CronService as CronService
    from .cron import Every as Every
    from .cron import FiredEvent as FiredEvent
    from .cron import JobStatus as JobStatus
    from .cron import JobStore as JobStore
    from .cron import OnExit as OnExit
    from .cron import SqliteJobStore as SqliteJobStore
    from .cron import SystemEvent as SystemEvent
    from .cron import compute_next_run_at as compute_next_run_at
    from .cron import resolve_exit_watch_shell as resolve_exit_watch_shell
    from .server._client import AsyncEngineClient as AsyncEngineClient
    from .server._client import EngineClient as EngineClient
    from .server._client import EngineConnectionError as EngineConnectionError
    from .server._client import EngineNotRunningError as EngineNotRunningError
    from .server._client import EngineSocketMissingError as EngineSocketMissingError
    from .server._client import EngineStartingError as EngineStartingError
    from .server._client import EngineStoppingError as EngineStoppingError
    from .server._client import EngineSuspendedError as EngineSuspendedError
    from .server._protocol import RpcError as RpcError


#: Every public name and the private module that defines it.
_EXPORTS: dict[str, str] = {
    "AsyncEngineClient": ".server._client",
    "AsyncioEngine": "._asyncio",
    "At": ".cron",
    "Command": ".cron",
    "Cron": ".cron",
    "CronExitWatchers": ".cron",
    "CronJob": ".cron",
    "CronService": ".cron",
    "Engine": "._engine",
    "EngineStatus": "._engine",
    "EngineClient": ".server._client",
    "EngineClosedError": "._asyncio",
    "EngineConfig": "._config",
    "EngineConnectionError": ".server._client",
    "EngineError": "._errors",
    "EngineLockedError": "._errors",
    "EngineNotRunningError": ".server._client",
    "EngineSocketMissingError": ".server._client",
    "EngineStartingError": ".server._client",
    "EngineStoppingError": ".server._client",
    "EngineSuspendedError": ".server._client",
    "Every": ".cron",
    "FiredEvent": ".cron",
    "InvalidArgumentError": "._errors",
    "InvalidScheduleError": "._errors",
    "JobNotFoundError": "._errors",
    "KillInProgressError": "._errors",
    "JobStatus": ".cron",
    "JobStore": ".cron",
    "LimitExceededError": "._errors",
    "LogSlice": "._logs",
    "ManagedRun": "._supervisor",
    "OnExit": ".cron",
    "PatternTimeoutError": "._patterns",
    "Project": "._project",
    "ReadyCheck": "._readiness",
    "RestartPolicy": "._restart",
    "RpcError": ".server._protocol",
    "RunExit": "._supervisor",
    "RunState": "._supervisor",
    "SpawnError": "._errors",
    "SpawnSpec": "._supervisor",
    "SqliteJobStore": ".cron",
    "StdinBlockedError": "._stdin",
    "StdinClosedError": "._stdin",
    "StoreError": "._errors",
    "SubProcess": "._subprocesses",
    "SubProcessNotFoundError": "._errors",
    "SubProcessService": "._subprocesses",
    "SubProcessSummary": "._subprocesses",
    "SubprocessTool": "._tool",
    "Supervisor": "._supervisor",
    "SystemEvent": ".cron",
    "TOOL_MODES": "._prompts",
    "TerminationReason": "._supervisor",
    "UntrustedPathError": "._errors",
    "compute_next_run_at": ".cron",
    "open_asyncio_engine": "._asyncio",
    "open_engine": "._engine",
    "open_subprocess_service": "._subprocesses",
    "open_supervisor": "._supervisor",
    "process_management_block": "._prompts",
    "render_mode_prompt": "._prompts",
    "resolve_exit_watch_shell": ".cron",
    "tools_for_mode": "._prompts",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
