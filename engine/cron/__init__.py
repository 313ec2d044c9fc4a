"""Cron: schedules, the durable job store, the service with its timer and run pipeline, the event log,
and the on-exit watchers."""

from __future__ import annotations

from ._events import FiredEvent as FiredEvent
from ._exit_watchers import CronExitWatchers as CronExitWatchers
from ._job import Command as Command
from ._job import CronJob as CronJob
from ._job import JobStatus as JobStatus
from ._job import SystemEvent as SystemEvent
from ._protocol import JobStore as JobStore
from ._schedule import At as At
from ._schedule import Cron as Cron
from ._schedule import Every as Every
from ._schedule import OnExit as OnExit
from ._schedule import compute_next_run_at as compute_next_run_at
from ._service import CronService as CronService
from ._service import open_cron_service as open_cron_service
from ._shell import resolve_exit_watch_shell as resolve_exit_watch_shell
from ._store import SqliteJobStore as SqliteJobStore
