"""gadget-engine: a Trio engine that supervises child processes for AI coding agents and async hosts."""

from __future__ import annotations

from ._config import EngineConfig as EngineConfig
from ._engine import Engine as Engine
from ._engine import open_engine as open_engine
from ._errors import EngineError as EngineError
from ._errors import EngineLockedError as EngineLockedError
from ._errors import InvalidScheduleError as InvalidScheduleError
from ._errors import JobNotFoundError as JobNotFoundError
from ._errors import LimitExceededError as LimitExceededError
from ._errors import SpawnError as SpawnError
from ._errors import StoreError as StoreError
from ._errors import SubProcessNotFoundError as SubProcessNotFoundError
from ._logs import LogSlice as LogSlice
from ._project import Project as Project
from ._prompts import TOOL_MODES as TOOL_MODES
from ._prompts import process_management_block as process_management_block
from ._prompts import render_mode_prompt as render_mode_prompt
from ._prompts import tools_for_mode as tools_for_mode
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

__version__ = "0.1.0"
