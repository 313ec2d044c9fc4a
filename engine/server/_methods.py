"""The RPC method table: the service, the tool and cron, plus ``status`` and ``engine.stop``.

Each method declares its named parameters and the reader of :mod:`engine._input` that turns each into a
typed value. :meth:`Methods.call` reads a request's parameters once (an unknown, missing or wrong one is an
``INVALID_PARAMS`` error naming it, before anything changes) and runs the method on the typed values;
:meth:`Methods.run` runs it on values a caller has already typed (the MCP tools). Results are JSON-ready:
subprocesses as ``SubProcessSummary.to_dict()``, jobs as ``CronJob.to_dict()``, events as
``FiredEvent.to_dict()``. ``docs/rpc.md`` lists them all.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Final, final

import attrs
import trio

from .._engine import Engine
from .._errors import EngineError, InvalidArgumentError, JobNotFoundError
from .._input import (
    MAX_WAIT_SECONDS,
    check_env,
    check_flag,
    check_read_args,
    check_reader,
    check_string,
    check_strings,
    check_text,
    read_fields,
    read_payload,
    read_project,
    read_ready,
    read_restart,
    read_schedule,
    read_seconds,
    read_stream,
    read_whole,
    show,
)
from .._project import Project
from .._readiness import ReadyCheck
from .._restart import RestartPolicy
from .._stdin import write_within
from ..cron._claims import floats
from ..cron._job import Command, CronJob, Payload, SystemEvent, payload_to_dict, schedule_to_dict
from ..cron._schedule import At, Cron, Every, OnExit, Schedule
from ._stats import RunStats

__all__ = ["InvalidParamsError", "MethodNotFoundError", "Methods", "to_wire"]

#: ``subprocess.read_log``'s default ``max_bytes``.
READ_LOG_MAX_BYTES: Final = 32768


class InvalidParamsError(InvalidArgumentError):
    """Raised by :meth:`Methods.call` when a parameter is missing, unknown or of the wrong type."""


class MethodNotFoundError(Exception):
    """Raised by :meth:`Methods.call` for a method name the table does not have."""


Reader = Callable[[object, str], object]
Handler = Callable[..., Awaitable[object]]


@attrs.frozen
class _Param:
    """One named parameter: the reader that types it, and whether the method needs it."""

    read: Reader
    required: bool = False


@attrs.frozen
class _Entry:
    """One method: its handler (typed keyword arguments), its parameters, and a check across them."""

    handler: Handler
    params: Mapping[str, _Param]
    check: Callable[[Mapping[str, object]], None] | None = None


_TABLE: dict[str, _Entry] = {}


def _method(
    method: str, /, *, check: Callable[[Mapping[str, object]], None] | None = None, **params: _Param
) -> Callable[[Handler], Handler]:
    """Register ``method``: its handler takes each parameter, typed by its reader, by keyword."""

    def register(handler: Handler) -> Handler:
        _TABLE[method] = _Entry(handler, params, check)
        return handler

    return register


def _need(read: Reader) -> _Param:
    return _Param(read, required=True)


def _may(read: Reader) -> _Param:
    return _Param(read)


def _positive(value: object, field: str) -> int:
    return read_whole(value, field, 1)


def _offset(value: object, field: str) -> int:
    return read_whole(value, field, 0)


#: The longest one ``events.wait`` waits, in seconds (under the socket's idle limit).
EVENTS_WAIT_MAX_SECONDS: Final = 50.0


def _wait_seconds(value: object, field: str) -> float:
    return read_seconds(value, field, maximum=EVENTS_WAIT_MAX_SECONDS)


def _subprocess_wait_seconds(value: object, field: str) -> float:
    return read_seconds(value, field, maximum=MAX_WAIT_SECONDS)


def _tool_params(value: object, field: str) -> Mapping[str, object]:
    if not isinstance(value, Mapping):
        raise InvalidArgumentError(f"{field} must be a JSON object of tool parameters, got {show(value)}")
    return value  # the tool reads its own parameters


def _read(method: str, entry: _Entry, params: Mapping[str, Any]) -> dict[str, object]:
    given = read_fields(params, method, entry.params, what="parameter")
    for name, param in entry.params.items():
        if param.required and name not in given:
            raise InvalidArgumentError(f"missing parameter {name}")
    typed = {name: entry.params[name].read(value, name) for name, value in given.items()}
    if entry.check is not None:
        entry.check(typed)
    return typed


def to_wire(params: Mapping[str, object]) -> dict[str, object]:
    """The JSON form of typed parameters, as :meth:`Methods.call` reads them back.

    Schedules and payloads become their ``to_dict`` objects, a :class:`Project` its directory, tuples lists.
    """
    out: dict[str, object] = {}
    for name, value in params.items():
        if isinstance(value, At | Every | Cron | OnExit):
            value = schedule_to_dict(value)
        elif isinstance(value, SystemEvent | Command):
            value = payload_to_dict(value)
        elif isinstance(value, Project):
            value = value.directory
        elif isinstance(value, ReadyCheck | RestartPolicy):
            value = value.to_dict()
        elif isinstance(value, tuple):
            value = list(value)
        out[name] = value
    return out


@final
@attrs.define(eq=False)
class Methods:
    """The methods an RPC server offers over one :class:`Engine`.

    Attributes:
        engine: the engine the methods act on.
        socket_path: the socket the server listens on (reported by ``status``).
        version: the engine's version (reported by ``status``).
        stop: what ``engine.stop`` calls, with its ``end_watched``, once the watched commands it was
            asked to end are ended: ``serve``'s graceful stop (``None``: this engine cannot be stopped
            over RPC, e.g. the one an ``mcp`` session embeds).
        stopping: whether the engine is stopping (set by the server when its stop begins; ``status``
            says so, and ``gadget-engine start`` then waits for the stop to end before starting anew).
    """

    engine: Engine
    socket_path: str
    version: str
    stop: Callable[[bool], None] | None = None
    stopping: bool = attrs.field(init=False, default=False)
    _started: float = attrs.field(init=False, factory=trio.current_time)
    _last_event: dict[str, object] | None = attrs.field(init=False, default=None)
    _stats: RunStats = attrs.field(
        init=False, default=attrs.Factory(lambda self: RunStats(self.engine), takes_self=True)
    )

    @staticmethod
    def names() -> list[str]:
        """Every method name, sorted."""
        return sorted(_TABLE)

    async def call(self, method: str, params: Mapping[str, Any]) -> object:
        """Read ``params`` (JSON values) for ``method``, run it and return its JSON-ready result.

        Cancellation: as the engine operation behind the method (``kill`` and ``halt`` still end and
        reap the process tree).

        Raises:
            MethodNotFoundError: no such method.
            InvalidParamsError: a parameter is unknown, missing or invalid (named); nothing changed.
            InvalidScheduleError: a schedule or payload its class refused; nothing changed.
            EngineError: the engine's own error (``SpawnError``, ``JobNotFoundError``, ...).
        """
        entry = self._entry(method)
        try:
            typed = _read(method, entry, params)
        except InvalidArgumentError as exc:
            raise InvalidParamsError(str(exc)) from None
        return await entry.handler(self, **typed)

    async def run(self, method: str, params: Mapping[str, object]) -> object:
        """Run ``method`` on parameters that are already typed (a :class:`Schedule`, a :class:`Project`).

        For callers that read their own input with :mod:`engine._input` (the MCP tools): nothing is read
        twice. A parameter the method does not take is a ``TypeError``.

        Cancellation, errors: as :meth:`call`.
        """
        return await self._entry(method).handler(self, **params)

    def _entry(self, method: str) -> _Entry:
        entry = _TABLE.get(method)
        if entry is None:
            raise MethodNotFoundError(f"unknown method {show(method)}; methods: {', '.join(self.names())}")
        return entry

    # ---- status ------------------------------------------------------------------------------------

    @_method("status")
    async def _status(self) -> object:
        records = self.engine.service.ps()
        jobs = await self.engine.cron.list()
        status = (await self.engine.status()).to_dict()
        return {
            **status,
            "socket": self.socket_path,
            "uptime_seconds": round(trio.current_time() - self._started, 3),
            "stopping": self.stopping,
            "subprocesses": {"total": len(records), "running": sum(1 for sp in records if sp.running)},
            "cron_jobs": {"total": len(jobs), "enabled": sum(1 for job in jobs if job.enabled)},
            "last_event": await self._newest_event(),
            "methods": self.names(),
        }

    async def _newest_event(self) -> dict[str, object] | None:
        """The newest event of the log (its summary), reading only what came since the last look."""
        since = self._last_event["cursor"] if self._last_event is not None else 0
        assert isinstance(since, int)
        events = await self.engine.cron.events(since)
        if events:
            newest = events[-1]
            self._last_event = {
                "cursor": newest.cursor,
                "job_id": newest.job_id,
                "job_name": newest.job_name,
                "exit_code": newest.exit_code,
                "signal": newest.signal,
                "reason": newest.reason,
            }
        return self._last_event

    @_method("engine.stop", end_watched=_may(check_flag))
    async def _engine_stop(self, end_watched: bool = False) -> object:
        if self.stop is None:
            raise EngineError(
                f"the engine on {self.engine.state_dir} (pid {os.getpid()}) belongs to an MCP session; "
                "it stops when its MCP client closes its stdin"
            )
        ended = self.engine.watchers.active_job_ids() if end_watched else []
        if end_watched:  # each job disabled, and fired once with reason "cancelled"
            await self.engine.watchers.cancel_all()
        self.stop(end_watched)
        return {"pid": os.getpid(), "stopping": True, "ended_watched": ended}

    # ---- subprocesses ------------------------------------------------------------------------------

    @_method(
        "subprocess.create",
        project=_need(read_project),
        command=_need(check_text),
        args=_may(check_strings),
        env=_may(check_env),
        stdin=_may(check_flag),
        ready=_may(read_ready),
        restart=_may(read_restart),
        notify_on_exit=_may(check_flag),
    )
    async def _create(
        self,
        project: Project,
        command: str,
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        stdin: bool = False,
        ready: ReadyCheck | None = None,
        restart: RestartPolicy | None = None,
        notify_on_exit: bool = False,
    ) -> object:
        sp = await self.engine.service.create(
            project,
            command,
            args,
            env=env or None,
            stdin=stdin,
            ready=ready,
            restart=restart,
            notify_on_exit=notify_on_exit,
        )
        return self.engine.service.summarize(sp).to_dict()

    @_method("subprocess.input", pid=_need(_positive), text=_may(check_string), eof=_may(check_flag))
    async def _input(self, pid: int, text: str = "", eof: bool = False) -> object:
        await write_within(functools.partial(self.engine.service.write_stdin, pid, text, eof=eof), pid)
        return {"pid": pid, "sent": len(text.encode()), "eof": eof}

    @_method("subprocess.wait", pid=_need(_positive), timeout_seconds=_may(_subprocess_wait_seconds))
    async def _wait(self, pid: int, timeout_seconds: float = 30.0) -> object:
        service = self.engine.service
        sp = service.lookup(pid)
        with trio.move_on_after(timeout_seconds):
            await sp.wait_drained()
        # "finished" once what wait_drained waits for is over: the leader's exit alone leaves its leftovers
        # running (SP-03), which "leftovers_running" tells.
        return {
            **service.summarize(sp).to_dict(),
            "finished": sp.drained,
            "leftovers_running": sp.finished and not sp.drained,
        }

    @_method("subprocess.wait_ready", pid=_need(_positive), ready=_need(read_ready))
    async def _wait_ready(self, pid: int, ready: ReadyCheck) -> object:
        return (await self.engine.service.wait_ready(pid, ready)).to_dict()

    @_method("subprocess.list", project=_may(read_project))
    async def _list(self, project: Project | None = None) -> object:
        await trio.lowlevel.checkpoint()
        service = self.engine.service
        return [
            service.summarize(sp).to_dict()
            for sp in service.ps()
            if project is None or sp.project.id == project.id
        ]

    @_method("subprocess.summarize", pid=_need(_positive))
    async def _summarize(self, pid: int) -> object:
        await trio.lowlevel.checkpoint()
        service = self.engine.service
        return service.summarize(service.lookup(pid)).to_dict()

    @_method("subprocess.kill", pid=_need(_positive))
    async def _kill(self, pid: int) -> object:
        pending = self._restart_pending(pid)
        return self._stopped(pid, await self.engine.service.kill_pid(pid), pending)

    @_method("subprocess.halt", pid=_need(_positive))
    async def _halt(self, pid: int) -> object:
        pending = self._restart_pending(pid)
        return self._stopped(pid, await self.engine.service.halt_pid(pid), pending)

    @staticmethod
    def _stopped(pid: int, stopped: bool, restart_called_off: bool) -> dict[str, object]:
        """``{pid, stopped}``, with ``restart_called_off: true`` when a restart back-off was called off."""
        return {
            "pid": pid,
            "stopped": stopped,
            **({"restart_called_off": True} if restart_called_off else {}),
        }

    def _restart_pending(self, pid: int) -> bool:
        """Whether the record of ``pid`` waits out a restart back-off (a kill or halt calls it off)."""
        service = self.engine.service
        return service.summarize(service.lookup(pid)).status.startswith("restarting")

    @_method(
        "subprocess.kill_project",
        check=lambda p: _one_of(p, "project", "project_id"),
        project=_may(read_project),
        project_id=_may(check_text),
    )
    async def _kill_project(self, project: Project | None = None, project_id: str | None = None) -> object:
        target = project.id if project is not None else project_id
        assert target is not None
        await self.engine.service.kill_project(target)
        return {"project_id": target}

    @_method("subprocess.kill_all")
    async def _kill_all(self) -> object:
        return {"verified": await self.engine.service.kill_all()}

    @_method(
        "subprocess.read_log",
        check=lambda p: check_read_args(
            p.get("offset"), p.get("limit"), p.get("tail"), p.get("max_bytes", READ_LOG_MAX_BYTES)
        ),
        pid=_need(_positive),
        stream=_may(read_stream),
        offset=_may(_offset),
        limit=_may(_positive),
        tail=_may(_positive),
        max_bytes=_may(_positive),
        new_only=_may(check_flag),
        grep=_may(check_text),
        reader=_may(check_reader),
    )
    async def _read_log(
        self,
        pid: int,
        stream: str = "stdout",
        offset: int | None = None,
        limit: int | None = None,
        tail: int | None = None,
        max_bytes: int = READ_LOG_MAX_BYTES,
        new_only: bool = False,
        grep: str | None = None,
        reader: str = "default",
    ) -> object:
        service = self.engine.service
        sp = service.lookup(pid)
        # before the read: "not running" and a drained read mean the end (the tree gone, no restart due)
        running = not sp.drained
        piece = await service.read_log(
            pid,
            stream,
            offset=offset,
            limit=limit,
            tail=tail,
            max_bytes=max_bytes,
            new_only=new_only,
            grep=grep,
            reader=reader,
        )
        return {**attrs.asdict(piece), "pid": sp.pid, "stream": stream, "running": running}

    @_method("subprocess.stats", project=_may(read_project))
    async def _stats_of(self, project: Project | None = None) -> object:
        return await self._stats.collect(project)

    # ---- the tool ----------------------------------------------------------------------------------

    @_method("tool.definition")
    async def _tool_definition(self) -> object:
        await trio.lowlevel.checkpoint()
        return self.engine.tool.definition

    @_method("tool.execute", params=_need(_tool_params), project=_need(read_project))
    async def _tool_execute(self, params: Mapping[str, object], project: Project) -> object:
        text = await self.engine.tool.execute(params, project)
        return {"text": text, "is_error": text.startswith("SUBPROCESS ERROR: ")}

    # ---- cron --------------------------------------------------------------------------------------

    # A ``project`` (a directory) scopes a cron method to that project's jobs, as the MCP tools use it:
    # a job of another project (or of none) is "not found", exactly as an unknown id.

    async def _scoped(self, job_id: str, project: Project | None) -> None:
        """Raise ``JobNotFoundError`` unless ``project`` is ``None`` or job ``job_id`` belongs to it."""
        if project is None:
            await trio.lowlevel.checkpoint()
            return
        job = await self.engine.cron.get(job_id)
        if job.project != project.id:
            raise JobNotFoundError(f"job_id {job_id!r} names no cron job; list the jobs to see their ids")

    @_method(
        "cron.add",
        schedule=_need(read_schedule),
        payload=_need(read_payload),
        name=_may(check_text),
        enabled=_may(check_flag),
        delete_after_run=_may(check_flag),
        project=_may(read_project),
    )
    async def _cron_add(
        self,
        schedule: Schedule,
        payload: Payload,
        name: str | None = None,
        enabled: bool = True,
        delete_after_run: bool = False,
        project: Project | None = None,
    ) -> object:
        job = await self.engine.cron.add(
            schedule,
            payload,
            name=name,
            enabled=enabled,
            delete_after_run=delete_after_run,
            project=project.id if project is not None else None,
        )
        return job.to_dict()

    @_method(
        "cron.update",
        job_id=_need(check_text),
        schedule=_may(read_schedule),
        payload=_may(read_payload),
        name=_may(check_text),
        enabled=_may(check_flag),
        delete_after_run=_may(check_flag),
        project=_may(read_project),
    )
    async def _cron_update(self, job_id: str, project: Project | None = None, **changes: object) -> object:
        await self._scoped(job_id, project)
        return (await self.engine.cron.update(job_id, **changes)).to_dict()

    @_method("cron.list", include_disabled=_may(check_flag), project=_may(read_project))
    async def _cron_list(self, include_disabled: bool = True, project: Project | None = None) -> object:
        jobs = await self.engine.cron.list(include_disabled=include_disabled)
        lost = await self._lost_owners(jobs)
        return [  # ``owner_lost`` only where true: a job is otherwise its ``to_dict()`` as everywhere
            {**job.to_dict(), **({"owner_lost": True} if job.id in lost else {})}
            for job in jobs
            if project is None or job.project == project.id
        ]

    async def _lost_owners(self, jobs: Sequence[CronJob]) -> set[str]:
        """The ids of ``jobs`` that only another engine runs, one whose heartbeat is older than
        ``owner_lost_seconds`` (or that never beat): ``cron list`` shows them ``owner lost``."""
        store = self.engine.cron.store
        elsewhere = [job for job in jobs if not floats(job) and not store.owns(job)]
        if not elsewhere:
            await trio.lowlevel.checkpoint()
            return set()
        live = {member.engine_id for member in await store.fleet() if not member.lost}
        return {job.id for job in elsewhere if job.owner not in live}

    @_method("fleet")
    async def _fleet(self) -> object:
        members = await self.engine.cron.store.fleet()
        return [{**m.to_dict(), "self": m.engine_id == self.engine.engine_id} for m in members]

    @_method("cron.get", job_id=_need(check_text), project=_may(read_project))
    async def _cron_get(self, job_id: str, project: Project | None = None) -> object:
        await self._scoped(job_id, project)
        return (await self.engine.cron.get(job_id)).to_dict()

    @_method("cron.remove", job_id=_need(check_text), project=_may(read_project))
    async def _cron_remove(self, job_id: str, project: Project | None = None) -> object:
        await self._scoped(job_id, project)
        await self.engine.cron.remove(job_id)
        return {"job_id": job_id, "removed": True}

    @_method("cron.enable", job_id=_need(check_text), project=_may(read_project))
    async def _cron_enable(self, job_id: str, project: Project | None = None) -> object:
        await self._scoped(job_id, project)
        return (await self.engine.cron.enable(job_id)).to_dict()

    @_method("cron.disable", job_id=_need(check_text), project=_may(read_project))
    async def _cron_disable(self, job_id: str, project: Project | None = None) -> object:
        await self._scoped(job_id, project)
        return (await self.engine.cron.disable(job_id)).to_dict()

    @_method("cron.run_now", job_id=_need(check_text), project=_may(read_project))
    async def _cron_run_now(self, job_id: str, project: Project | None = None) -> object:
        await self._scoped(job_id, project)
        fire_id = await self.engine.cron.run_now(job_id)
        return {"job_id": job_id, "fire_id": fire_id}

    @_method(
        "events.wait",
        since=_may(_offset),
        seconds=_may(_wait_seconds),
        limit=_may(_positive),
        project=_may(read_project),
    )
    async def _events_wait(
        self, since: int = 0, seconds: float = 30.0, limit: int | None = None, project: Project | None = None
    ) -> object:
        with trio.move_on_after(seconds):
            while True:
                events = await self.engine.cron.wait_events(since, seconds)
                mine = [event for event in events if project is None or event.project == project.id]
                if mine:
                    return [event.to_dict() for event in mine[:limit]]
                if events:
                    since = events[-1].cursor
        return []

    @_method("events", since=_may(_offset), limit=_may(_positive), project=_may(read_project))
    async def _events(
        self, since: int = 0, limit: int | None = None, project: Project | None = None
    ) -> object:
        events = await self.engine.cron.events(since)
        mine = [event for event in events if project is None or event.project == project.id]
        return [event.to_dict() for event in mine[:limit]]


def _one_of(typed: Mapping[str, object], first: str, second: str) -> None:
    if (first in typed) == (second in typed):
        raise InvalidArgumentError(f"give exactly one of {first} (a directory) and {second}")
