"""Composition: one root nursery holding the supervisor and the services built on it."""

from __future__ import annotations

import fcntl
import functools
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, final

import attrs
import trio

from ._config import EngineConfig
from ._errors import EngineLockedError
from ._guardian_link import GuardianLink
from ._retry import RetryPolicy
from ._subprocesses import SubProcessService, open_subprocess_service
from ._supervisor import Supervisor, open_supervisor
from ._sweep import sweep_records
from ._tool import SubprocessTool
from ._trust import check_state_dir, make_state_dir, open_own_file
from .cron._exit_watchers import CronExitWatchers
from .cron._protocol import JobStore
from .cron._service import CronService, open_cron_service
from .cron._shell import resolve_exit_watch_shell
from .cron._store import SqliteJobStore

__all__ = ["Engine", "open_engine"]

#: ``on_fire`` handlers: ``async def handler(event: FiredEvent) -> None``.
FireHandler = Callable[[Any], Awaitable[None]]


@final
@attrs.define(eq=False)
class Engine:
    """A running engine, as yielded by :func:`open_engine`.

    Attributes:
        config: the :class:`EngineConfig` in force.
        state_dir: the absolute state directory it holds the lock of.
        supervisor: the :class:`Supervisor` every child runs under.
        service: the :class:`SubProcessService` of agent subprocesses (stopping the engine kills them all).
        tool: the ``subprocess`` agent tool over ``service``.
        cron: the :class:`CronService` (scheduled jobs and the event log).
        watchers: the :class:`CronExitWatchers` of on-exit jobs (reconciled on every job change).
    """

    config: EngineConfig
    state_dir: str
    supervisor: Supervisor
    service: SubProcessService
    tool: SubprocessTool
    cron: CronService
    watchers: CronExitWatchers


def _lock_state_dir(state_dir: str) -> int:
    """Create (0700) and check the state directory, take its lock, then check what it holds.

    Nothing in the directory is read before it is known to be ours (``_trust``): the lock file is
    opened without following a link, and the entries are checked under the lock, before the start-up
    sweep reads ``groups/`` and the cron service opens the store.

    Raises:
        UntrustedPathError: the directory or an entry in it is not ours (the message names it).
        EngineLockedError: another engine holds the lock.
    """
    make_state_dir(state_dir)
    fd = open_own_file(
        os.path.join(state_dir, "lock"), os.O_RDWR | os.O_CREAT, 0o600, what="the state directory's lock"
    )
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise EngineLockedError(
                f"another engine holds the state directory {state_dir!r}; stop it or use another --state-dir"
            ) from None
        check_state_dir(state_dir)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
    except BaseException:
        os.close(fd)
        raise
    return fd


def _job_store(config: EngineConfig, state_dir: str) -> JobStore:
    """The cron store: ``config.store_factory``'s, else SQLite in the state dir (``repair_store`` on)."""
    if config.store_factory is not None:
        return config.store_factory(state_dir)
    return SqliteJobStore.in_state_dir(state_dir, repair=config.repair_store)


@asynccontextmanager
async def open_engine(
    config: EngineConfig | None = None, *, on_fire: FireHandler | None = None
) -> AsyncIterator[Engine]:
    """Start an engine on ``config.state_dir`` and stop it when the block is left.

    The state directory is created (mode 0700) and locked with an exclusive ``flock`` on
    ``<state_dir>/lock`` for the engine's lifetime, so one engine owns it at a time.

    Args:
        config: the settings (``None``: all defaults).
        on_fire: ``async`` callable awaited with each ``FiredEvent`` (embedded hosts).

    Cancellation: leaving the block by cancellation or error still terminates and reaps every child
    before the exception propagates.

    Raises:
        EngineLockedError: another engine holds the state directory.
        UntrustedPathError: the state directory, or something in it, is not the engine's own: another
            owner, writable by group or others, a symbolic link (``docs/security.md``).
    """
    config = config if config is not None else EngineConfig()
    state_dir = config.resolved_state_dir()
    lock_fd = _lock_state_dir(state_dir)
    guardian = GuardianLink(state_dir, config.grace_seconds, config.kill_wait_seconds)
    try:
        # Under the lock: what a crashed engine (and its guardian) left behind is ours to end.
        await trio.to_thread.run_sync(
            functools.partial(
                sweep_records,
                state_dir,
                grace_seconds=config.grace_seconds,
                kill_wait_seconds=config.kill_wait_seconds,
            )
        )
        if config.guardian:
            guardian.start()
        async with (
            open_supervisor(
                grace_seconds=config.grace_seconds,
                kill_wait_seconds=config.kill_wait_seconds,
                subreaper=config.subreaper,
            ) as supervisor,
            open_subprocess_service(supervisor, config) as service,
            open_cron_service(
                state_dir=state_dir,
                supervisor=supervisor,
                store=_job_store(config, state_dir),
                now=config.wall_clock,
                on_fire=on_fire,
                fire_observers=config.fire_observers,
            ) as cron,
            trio.open_nursery() as watch_nursery,
        ):
            supervisor.add_observer(guardian)
            tool = SubprocessTool(service, config=config)
            watchers = CronExitWatchers(
                store=cron.store,
                fire_pending=cron.fire_pending,
                supervisor=supervisor,
                state_dir=state_dir,
                shell=config.exit_watch_shell or resolve_exit_watch_shell(),
                nursery=watch_nursery,
                retry=RetryPolicy(config.watch_retry_seconds),
                now=cron.now,
                hooks=config.watch_hooks or {},
            )
            # Adopt what a crashed engine left before the first reconcile, which arms the rest.
            await watchers.adopt()
            cron.on_jobs_changed = watchers.reconcile
            await cron.notify_jobs_changed()
            try:
                yield Engine(
                    config=config,
                    state_dir=state_dir,
                    supervisor=supervisor,
                    service=service,
                    tool=tool,
                    cron=cron,
                    watchers=watchers,
                )
            finally:
                cron.on_jobs_changed = None
                await watchers.cancel_all()  # graceful: the jobs stay enabled, re-armed at next start
    finally:
        try:
            await guardian.close()
        finally:
            os.close(lock_fd)
