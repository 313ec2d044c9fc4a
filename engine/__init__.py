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
from ._supervisor import ManagedRun as ManagedRun
from ._supervisor import RunExit as RunExit
from ._supervisor import RunState as RunState
from ._supervisor import SpawnSpec as SpawnSpec
from ._supervisor import Supervisor as Supervisor
from ._supervisor import TerminationReason as TerminationReason
from ._supervisor import open_supervisor as open_supervisor

__version__ = "0.1.0"
