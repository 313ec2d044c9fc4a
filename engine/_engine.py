"""Composition: one root nursery holding the supervisor and the services built on it."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import os
import secrets
import socket
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any, Final, final

import attrs
import trio

from ._config import EngineConfig
from ._containment import Containment, open_containment
from ._errors import EngineLockedError
from ._exit_notices import send_exit_notice
from ._guardian_link import GuardianLink
from ._lockfile import EMBEDDED, LOCK_NAME, OPEN, SERVE, STARTING, STOPPING, write_phase
from ._retry import RetryPolicy
from ._subprocesses import SubProcessService, open_subprocess_service
from ._supervisor import Supervisor, open_supervisor
from ._sweep import mark_state_dir, sweep_records
from ._tool import SubprocessTool
from ._trust import check_state_dir, make_state_dir, open_own_file, write_own_file
from ._version import __version__
from .cron._exit_watchers import CronExitWatchers
from .cron._fleet import FleetMember, run_heartbeats
from .cron._protocol import JobStore
from .cron._service import CronService, open_cron_service
from .cron._shell import resolve_exit_watch_shell
from .cron._store import SqliteJobStore

__all__ = ["Engine", "EngineStatus", "open_engine"]

_logger = logging.getLogger("engine.engine")
#: The file in the state directory that keeps the engine's id.
_ENGINE_ID: Final = "engine-id"

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
        watchers: the :class:`CronExitWatchers` of on-exit jobs (reconciled on every job change; their
            commands outlive a graceful stop).
    """

    config: EngineConfig
    state_dir: str
    supervisor: Supervisor
    service: SubProcessService
    tool: SubprocessTool
    cron: CronService
    watchers: CronExitWatchers
    engine_id: str = ""
    started_at: datetime = attrs.field(factory=lambda: datetime.now(UTC))

    async def status(self) -> EngineStatus:
        """What the engine is and does now: pid, version, state dir, containment, store, runs, jobs.

        Cancellation: safe; nothing changes (the job count is one store read).

        Raises:
            StoreError: the job store cannot be read.
        """
        runs: dict[str, int] = {}
        for sp in self.service.ps():
            if sp.running:
                runs[sp.project.directory] = runs.get(sp.project.directory, 0) + 1
        jobs = await self.cron.list(include_disabled=False)
        containment = self.supervisor.containment
        return EngineStatus(
            pid=os.getpid(),
            version=__version__,
            state_dir=self.state_dir,
            containment=containment.mode,
            containment_detail=containment.describe(),
            store=self.cron.store.describe(),
            engine_id=self.engine_id,
            runs=runs,
            watched=len(self.watchers.active_job_ids()),
            jobs=len(jobs),
            started_at=self.started_at,
        )


@attrs.frozen
class EngineStatus:
    """A snapshot of a running engine (:meth:`Engine.status`; the RPC ``status`` method returns it too).

    Attributes:
        pid: the engine's process id.
        version: the engine's version.
        state_dir: the state directory it holds the lock of.
        containment: ``"cgroup"`` or ``"process-group"``: how runs are contained.
        containment_detail: where (``cgroup <parent path>``) or why (the reason ``auto`` fell back).
        store: the job store, e.g. ``sqlite:/path/cron.sqlite3``.
        engine_id: the engine's id (``EngineConfig.engine_id``, else generated once and kept in the state
            dir).
        runs: live subprocesses per project directory.
        watched: on-exit jobs with a watcher now.
        jobs: enabled cron jobs.
        started_at: when the engine started (aware UTC).
    """

    pid: int
    version: str
    state_dir: str
    containment: str
    containment_detail: str
    store: str
    engine_id: str
    runs: Mapping[str, int]
    watched: int
    jobs: int
    started_at: datetime

    def to_dict(self) -> dict[str, object]:
        """JSON-ready values (the time as ISO 8601)."""
        out = attrs.asdict(self)
        out["runs"] = dict(self.runs)
        out["started_at"] = self.started_at.isoformat()
        return out


@final
@attrs.frozen
class ServeStart:
    """What ``serve`` tells the ``open_engine`` it calls, through :data:`SERVE_START` (set in its task): the
    engine is a ``serve``, which the lock file says (``_lockfile``: ``gadget-engine stop`` may signal it
    while it starts, never an engine embedded in another program), and ``force_sweep``, an event whose
    setting (a second stop signal) ends the start-up sweep's grace period: SIGKILL at once."""

    force_sweep: threading.Event
    #: what the lock file calls the engine (``_lockfile``: ``serve``, or ``mcp`` for ``mcp``'s own)
    kind: str = SERVE


#: Set by ``serve`` (and ``mcp``) in its own task's context before it calls ``open_engine``; ``None``:
#: embedded.
SERVE_START: ContextVar[ServeStart | None] = ContextVar("SERVE_START", default=None)


def _lock_state_dir(state_dir: str, *, kind: str) -> int:
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
        os.path.join(state_dir, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o600, what="the state directory's lock"
    )
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise EngineLockedError(
                f"another engine holds the state directory {state_dir!r}; stop it or use another --state-dir"
            ) from None
        # The pid and the phase first (a client tells from them that this engine, which does not listen
        # yet, is starting), then the entries are checked.
        write_phase(fd, STARTING, kind)
        check_state_dir(state_dir)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _job_store(config: EngineConfig, state_dir: str, engine_id: str) -> JobStore:
    """The cron store, chosen once: ``config.store_factory``'s; the fleet's PostgreSQL store at
    ``config.store_url``; else SQLite in the state dir (``repair_store`` on)."""
    if config.store_factory is not None:
        return config.store_factory(state_dir)
    if config.store_url is not None:
        from .cron._pg_store import PostgresJobStore  # the driver loads only for a fleet store

        return PostgresJobStore(
            config.store_url,
            engine_id,
            lease_seconds=config.lease_seconds,
            owner_lost_seconds=config.owner_lost_seconds,
        )
    return SqliteJobStore.in_state_dir(
        state_dir, repair=config.repair_store, owner_lost_seconds=config.owner_lost_seconds
    )


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

    Leaving the block (a graceful stop) terminates and reaps every child, except the commands of on-exit
    jobs: those are left running, unsignalled, with their watch states kept, and the next engine on the
    state directory adopts them as after a crash (``CronExitWatchers.cancel_all()`` first ends them on
    purpose instead).

    Cancellation: leaving the block by cancellation or error is the same stop; every other child is
    terminated and reaped before the exception propagates.

    Raises:
        EngineLockedError: another engine holds the state directory.
        UntrustedPathError: the state directory, or something in it, is not the engine's own: another
            owner, writable by group or others, a symbolic link (``docs/security.md``).
    """
    config = config if config is not None else EngineConfig()
    state_dir = config.resolved_state_dir()
    serving = SERVE_START.get()
    kind = EMBEDDED if serving is None else serving.kind
    lock_fd = _lock_state_dir(state_dir, kind=kind)
    try:
        engine_id = config.engine_id or _engine_id(state_dir)
        # Under the lock: what a crashed engine (and its guardian) left behind is ours to end.
        await trio.to_thread.run_sync(
            functools.partial(
                sweep_records,
                state_dir,
                grace_seconds=config.grace_seconds,
                kill_wait_seconds=config.kill_wait_seconds,
                force=None if serving is None else serving.force_sweep,
            )
        )
        mark_state_dir(state_dir)  # what is recorded from now on is this directory's own
        async with open_containment(
            config.containment, state_dir=state_dir, subreaper=config.subreaper
        ) as containment:
            _logger.info(
                "starting",
                extra={
                    "fields": {
                        "pid": os.getpid(),
                        "state_dir": state_dir,
                        "containment": containment.mode,
                        "detail": containment.describe(),
                        "reason": containment.reason,
                    }
                },
            )
            guardian = GuardianLink(
                state_dir,
                config.grace_seconds,
                config.kill_wait_seconds,
                token=containment.token,
                cgroup=containment.describe().removeprefix("cgroup ")
                if containment.mode == "cgroup"
                else None,
            )
            guardian.record_token()
            try:
                if config.guardian:
                    guardian.start()
                async with _open_services(
                    config, state_dir, containment, guardian, on_fire, engine_id
                ) as engine:
                    write_phase(lock_fd, OPEN, kind)
                    try:
                        yield engine
                    finally:
                        with contextlib.suppress(OSError):  # what clients are told, not the stop itself
                            write_phase(lock_fd, STOPPING, kind)
            finally:
                await guardian.close()
    finally:
        os.close(lock_fd)


@asynccontextmanager
async def _open_services(
    config: EngineConfig,
    state_dir: str,
    containment: Containment,
    guardian: GuardianLink,
    on_fire: FireHandler | None,
    engine_id: str,
) -> AsyncIterator[Engine]:
    async with (
        open_supervisor(
            grace_seconds=config.grace_seconds,
            kill_wait_seconds=config.kill_wait_seconds,
            subreaper=config.subreaper,
            containment=containment,
        ) as supervisor,
        open_subprocess_service(supervisor, config) as service,
        open_cron_service(
            state_dir=state_dir,
            supervisor=supervisor,
            store=_job_store(config, state_dir, engine_id),
            now=config.wall_clock,
            on_fire=on_fire,
            fire_observers=config.fire_observers,
            engine_id=engine_id,
            log_cap_bytes=config.log_cap_bytes,
        ) as cron,
        trio.open_nursery() as watch_nursery,
        trio.open_nursery() as beat_nursery,
    ):
        if config.end_unclaimed_orphans:
            await supervisor.own_process()
        supervisor.add_observer(guardian)
        service.on_final_exit = functools.partial(send_exit_notice, cron, service)  # notify_on_exit
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
            log_cap_bytes=config.log_cap_bytes,
        )
        # Adopt what a crashed engine left before the first reconcile, which arms the rest.
        await watchers.adopt()
        cron.on_jobs_changed = watchers.reconcile
        await cron.notify_jobs_changed()
        started_at = datetime.now(UTC)

        async def beat() -> None:
            member = FleetMember(
                engine_id=engine_id,
                host=socket.gethostname(),
                pid=os.getpid(),
                version=__version__,
                containment=containment.mode,
                live_runs=len(supervisor.runs()),
                started_at=started_at,
                beat_at=started_at,
            )
            await cron.store.beat(member)

        await beat_nursery.start(run_heartbeats, beat)
        try:
            yield Engine(
                config=config,
                state_dir=state_dir,
                supervisor=supervisor,
                service=service,
                tool=tool,
                cron=cron,
                watchers=watchers,
                engine_id=engine_id,
                started_at=started_at,
            )
        finally:
            cron.stop_timer()  # nothing more starts while the rest closes
            cron.on_jobs_changed = None
            # Graceful: watched commands keep running, unsignalled, adopted by the next engine.
            watchers.detach_all()
            beat_nursery.cancel_scope.cancel()


def _engine_id(state_dir: str) -> str:
    """The engine's id: generated once and kept in ``<state_dir>/engine-id``, so it survives host renames."""
    path = os.path.join(state_dir, _ENGINE_ID)
    try:  # a regular file of ours: a link is refused, a FIFO planted there does not block the start
        fd = open_own_file(path, os.O_RDONLY, what="the engine id")
    except FileNotFoundError:
        pass
    else:
        try:
            text = os.read(fd, 256).decode("ascii", "replace").strip()
        finally:
            os.close(fd)
        if text and text.replace("-", "").isalnum() and len(text) <= 64:
            return text
    new = f"{socket.gethostname().split('.')[0][:24]}-{secrets.token_hex(4)}"
    new = "".join(ch if ch.isalnum() or ch == "-" else "-" for ch in new)
    write_own_file(path, new + "\n")
    return new
