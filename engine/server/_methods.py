"""The RPC method table: every operation of the service, the tool and cron, plus ``status``.

Each method takes named parameters, checked here (a wrong or missing one is an ``INVALID_PARAMS`` error
naming it, before anything changes) and returns JSON-ready values: subprocesses as
``SubProcessSummary.to_dict()``, jobs as ``CronJob.to_dict()``, events as ``FiredEvent.to_dict()``.
``docs/rpc.md`` lists them all.
"""

from __future__ import annotations

import math
import os
from collections.abc import Awaitable, Callable, Mapping
from datetime import datetime
from typing import Any, Final, final

import attrs
import trio

from .._engine import Engine
from .._project import Project
from ..cron._job import Command, Payload, SystemEvent
from ..cron._schedule import At, Cron, Every, OnExit, Schedule

__all__ = ["InvalidParamsError", "MethodNotFoundError", "Methods"]

_MAX_INT: Final = 2**53


class InvalidParamsError(Exception):
    """Raised by :meth:`Methods.call` when a parameter is missing, unknown or of the wrong type."""


class MethodNotFoundError(Exception):
    """Raised by :meth:`Methods.call` for a method name the table does not have."""


@final
@attrs.define
class _Params:
    """The named parameters of one call, read with type checks that name the offending field."""

    values: Mapping[str, Any]
    prefix: str = ""

    def _missing(self, name: str) -> InvalidParamsError:
        return InvalidParamsError(f"missing parameter {self.prefix}{name}")

    def _wrong(self, name: str, what: str) -> InvalidParamsError:
        return InvalidParamsError(f"{self.prefix}{name} must be {what}, got {self.values[name]!r}")

    def has(self, name: str) -> bool:
        return self.values.get(name) is not None

    def text(self, name: str) -> str:
        if not self.has(name):
            raise self._missing(name)
        value = self.values[name]
        if not isinstance(value, str) or not value:
            raise self._wrong(name, "a non-empty string")
        return value

    def opt_text(self, name: str) -> str | None:
        return self.text(name) if self.has(name) else None

    def whole(self, name: str, minimum: int = 0) -> int:
        if not self.has(name):
            raise self._missing(name)
        value = self.values[name]
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= _MAX_INT:
            raise self._wrong(name, f"a whole number >= {minimum}")
        return value

    def opt_whole(self, name: str, minimum: int = 0) -> int | None:
        return self.whole(name, minimum) if self.has(name) else None

    def number(self, name: str) -> float:
        if not self.has(name):
            raise self._missing(name)
        value = self.values[name]
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self._wrong(name, "a number")
        return float(value)

    def flag(self, name: str, default: bool) -> bool:
        if not self.has(name):
            return default
        value = self.values[name]
        if not isinstance(value, bool):
            raise self._wrong(name, "true or false")
        return value

    def str_list(self, name: str, *, required: bool = False) -> list[str]:
        if not self.has(name):
            if required:
                raise self._missing(name)
            return []
        value = self.values[name]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self._wrong(name, "an array of strings")
        if required and not value:
            raise self._wrong(name, "a non-empty array of strings")
        return value

    def str_map(self, name: str) -> dict[str, str]:
        if not self.has(name):
            return {}
        value = self.values[name]
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            raise self._wrong(name, "an object of string values")
        return value

    def sub(self, name: str) -> _Params:
        if not self.has(name):
            raise self._missing(name)
        value = self.values[name]
        if not isinstance(value, dict):
            raise self._wrong(name, "a JSON object")
        return _Params(value, prefix=f"{self.prefix}{name}.")

    def project(self, name: str = "project") -> Project:
        path = self.text(name)
        if not os.path.isabs(path):
            raise self._wrong(name, "an absolute directory path")
        try:
            return Project.from_directory(path)
        except ValueError as exc:
            raise InvalidParamsError(f"{self.prefix}{name}: {exc}") from None

    def moment(self, name: str) -> datetime:
        text = self.text(name)
        try:
            return datetime.fromisoformat(text)
        except ValueError:
            raise self._wrong(name, "an ISO 8601 date and time with a UTC offset") from None


Handler = Callable[["Methods", _Params], Awaitable[object]]
_TABLE: dict[str, tuple[Handler, frozenset[str]]] = {}


def _method(name: str, *params: str) -> Callable[[Handler], Handler]:
    def register(handler: Handler) -> Handler:
        _TABLE[name] = (handler, frozenset(params))
        return handler

    return register


def _schedule(p: _Params) -> Schedule:
    kind = p.text("kind")
    if kind == "at":
        return At(at=p.moment("at"))
    if kind == "every":
        return Every(
            every_seconds=p.number("every_seconds"), anchor=p.moment("anchor") if p.has("anchor") else None
        )
    if kind == "cron":
        return Cron(expr=p.text("expr"), tz=p.opt_text("tz") or "UTC")
    if kind == "on_exit":
        return OnExit(command=p.text("command"), cwd=p.opt_text("cwd"))
    raise InvalidParamsError(f"{p.prefix}kind must be one of at, every, cron, on_exit, got {kind!r}")


def _payload(p: _Params) -> Payload:
    kind = p.text("kind")
    if kind == "system_event":
        return SystemEvent(text=p.text("text"))
    if kind == "command":
        return Command(argv=tuple(p.str_list("argv", required=True)), cwd=p.opt_text("cwd"))
    raise InvalidParamsError(f"{p.prefix}kind must be system_event or command, got {kind!r}")


@final
@attrs.define(eq=False)
class Methods:
    """The methods an RPC server offers over one :class:`Engine`.

    Attributes:
        engine: the engine the methods act on.
        socket_path: the socket the server listens on (reported by ``status``).
        version: the engine's version (reported by ``status``).
    """

    engine: Engine
    socket_path: str
    version: str
    _started: float = attrs.field(init=False, factory=trio.current_time)

    @staticmethod
    def names() -> list[str]:
        """Every method name, sorted."""
        return sorted(_TABLE)

    async def call(self, method: str, params: Mapping[str, Any]) -> object:
        """Run ``method`` with ``params`` and return its JSON-ready result.

        Cancellation: as the engine operation behind the method (``kill`` and ``halt`` still end and
        reap the process tree).

        Raises:
            MethodNotFoundError: no such method.
            InvalidParamsError: a parameter is unknown, missing or of the wrong type; nothing changed.
            EngineError: the engine's own error (``SpawnError``, ``JobNotFoundError``, ...).
            ValueError, TypeError: a value the engine refused.
        """
        entry = _TABLE.get(method)
        if entry is None:
            raise MethodNotFoundError(f"unknown method {method!r}; methods: {', '.join(self.names())}")
        handler, allowed = entry
        unknown = sorted(set(params) - allowed)
        if unknown:
            accepted = ", ".join(sorted(allowed)) or "none"
            raise InvalidParamsError(
                f"{method} got unknown parameter(s) {', '.join(unknown)}; accepted: {accepted}"
            )
        return await handler(self, _Params(params))

    # ---- status ------------------------------------------------------------------------------------

    @_method("status")
    async def _status(self, p: _Params) -> object:
        records = self.engine.service.ps()
        jobs = await self.engine.cron.list()
        return {
            "pid": os.getpid(),
            "state_dir": self.engine.state_dir,
            "socket": self.socket_path,
            "version": self.version,
            "uptime_seconds": round(trio.current_time() - self._started, 3),
            "subprocesses": {"total": len(records), "running": sum(1 for sp in records if sp.running)},
            "cron_jobs": {"total": len(jobs), "enabled": sum(1 for job in jobs if job.enabled)},
            "methods": self.names(),
        }

    # ---- subprocesses ------------------------------------------------------------------------------

    @_method("subprocess.create", "project", "command", "args", "env")
    async def _create(self, p: _Params) -> object:
        project = p.project()
        command, args, env = p.text("command"), p.str_list("args"), p.str_map("env")
        sp = await self.engine.service.create(project, command, args, env=env or None)
        return self.engine.service.summarize(sp).to_dict()

    @_method("subprocess.list", "project")
    async def _list(self, p: _Params) -> object:
        await trio.lowlevel.checkpoint()
        service = self.engine.service
        project_id = p.project().id if p.has("project") else None
        return [
            service.summarize(sp).to_dict()
            for sp in service.ps()
            if project_id is None or sp.project.id == project_id
        ]

    @_method("subprocess.summarize", "pid")
    async def _summarize(self, p: _Params) -> object:
        await trio.lowlevel.checkpoint()
        service = self.engine.service
        return service.summarize(service.lookup(p.whole("pid", 1))).to_dict()

    @_method("subprocess.kill", "pid")
    async def _kill(self, p: _Params) -> object:
        pid = p.whole("pid", 1)
        return {"pid": pid, "stopped": await self.engine.service.kill_pid(pid)}

    @_method("subprocess.halt", "pid")
    async def _halt(self, p: _Params) -> object:
        pid = p.whole("pid", 1)
        return {"pid": pid, "stopped": await self.engine.service.halt_pid(pid)}

    @_method("subprocess.kill_project", "project", "project_id")
    async def _kill_project(self, p: _Params) -> object:
        if p.has("project") == p.has("project_id"):
            raise InvalidParamsError("give exactly one of project (a directory) and project_id")
        project_id = p.project().id if p.has("project") else p.text("project_id")
        await self.engine.service.kill_project(project_id)
        return {"project_id": project_id}

    @_method("subprocess.kill_all")
    async def _kill_all(self, p: _Params) -> object:
        return {"verified": await self.engine.service.kill_all()}

    @_method("subprocess.read_log", "pid", "stream", "offset", "limit", "tail", "max_bytes")
    async def _read_log(self, p: _Params) -> object:
        pid = p.whole("pid", 1)
        stream = p.opt_text("stream") or "stdout"
        if stream not in ("stdout", "stderr"):
            raise InvalidParamsError(f"stream must be stdout or stderr, got {stream!r}")
        offset, limit, tail = p.opt_whole("offset", 0), p.opt_whole("limit", 1), p.opt_whole("tail", 1)
        max_bytes = p.opt_whole("max_bytes", 1) or 32768
        if tail is not None and (offset is not None or limit is not None):
            raise InvalidParamsError("give tail alone, or offset and/or limit, not both")
        service = self.engine.service
        sp = service.lookup(pid)
        running = sp.running  # before the read: "not running" and a drained read mean the end
        piece = await service.read_log(
            pid, stream, offset=offset, limit=limit, tail=tail, max_bytes=max_bytes
        )
        return {**attrs.asdict(piece), "pid": sp.pid, "stream": stream, "running": running}

    # ---- the tool ----------------------------------------------------------------------------------

    @_method("tool.definition")
    async def _tool_definition(self, p: _Params) -> object:
        await trio.lowlevel.checkpoint()
        return self.engine.tool.definition

    @_method("tool.execute", "params", "project")
    async def _tool_execute(self, p: _Params) -> object:
        params = p.sub("params").values
        text = await self.engine.tool.execute(params, p.project())
        return {"text": text, "is_error": text.startswith("SUBPROCESS ERROR: ")}

    # ---- cron --------------------------------------------------------------------------------------

    @_method("cron.add", "schedule", "payload", "name", "enabled", "delete_after_run")
    async def _cron_add(self, p: _Params) -> object:
        schedule, payload = _schedule(p.sub("schedule")), _payload(p.sub("payload"))
        job = await self.engine.cron.add(
            schedule,
            payload,
            name=p.opt_text("name"),
            enabled=p.flag("enabled", True),
            delete_after_run=p.flag("delete_after_run", False),
        )
        return job.to_dict()

    @_method("cron.update", "job_id", "schedule", "payload", "name", "enabled", "delete_after_run")
    async def _cron_update(self, p: _Params) -> object:
        changes: dict[str, object] = {}
        if p.has("schedule"):
            changes["schedule"] = _schedule(p.sub("schedule"))
        if p.has("payload"):
            changes["payload"] = _payload(p.sub("payload"))
        if p.has("name"):
            changes["name"] = p.text("name")
        for flag in ("enabled", "delete_after_run"):
            if p.has(flag):
                changes[flag] = p.flag(flag, False)
        return (await self.engine.cron.update(p.text("job_id"), **changes)).to_dict()

    @_method("cron.list", "include_disabled")
    async def _cron_list(self, p: _Params) -> object:
        jobs = await self.engine.cron.list(include_disabled=p.flag("include_disabled", True))
        return [job.to_dict() for job in jobs]

    @_method("cron.get", "job_id")
    async def _cron_get(self, p: _Params) -> object:
        return (await self.engine.cron.get(p.text("job_id"))).to_dict()

    @_method("cron.remove", "job_id")
    async def _cron_remove(self, p: _Params) -> object:
        job_id = p.text("job_id")
        await self.engine.cron.remove(job_id)
        return {"job_id": job_id, "removed": True}

    @_method("cron.enable", "job_id")
    async def _cron_enable(self, p: _Params) -> object:
        return (await self.engine.cron.enable(p.text("job_id"))).to_dict()

    @_method("cron.disable", "job_id")
    async def _cron_disable(self, p: _Params) -> object:
        return (await self.engine.cron.disable(p.text("job_id"))).to_dict()

    @_method("cron.run_now", "job_id")
    async def _cron_run_now(self, p: _Params) -> object:
        job_id = p.text("job_id")
        await self.engine.cron.run_now(job_id)
        return {"job_id": job_id}

    @_method("events", "since", "limit")
    async def _events(self, p: _Params) -> object:
        since, limit = p.opt_whole("since", 0) or 0, p.opt_whole("limit", 1)
        events = await self.engine.cron.events(since)
        return [event.to_dict() for event in events[:limit]]
