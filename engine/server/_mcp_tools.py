"""The tools ``gadget-engine mcp`` offers, over a backend that is either an embedded engine or a socket.

Independent of the MCP SDK: this module names the tools, checks their arguments and writes their texts;
``_mcp`` puts them on the wire. Every tool answers with one text and an error flag:

- ``subprocess``: the engine's own tool (same schema, same texts byte for byte, ``SUBPROCESS ERROR: ...``
  flagged as an error), bound to the server's project.
- ``cron_add``, ``cron_list``, ``cron_remove``, ``cron_events``: jobs and their fired events, in texts of
  the same shape (``CRON ADDED`` ..., ``CRON ERROR: ...`` for a rejected call). Like ``subprocess`` they
  act on the server's project only: a job is added with the project's id (``CronJob.project``), and a
  job of another project (or of none) is not listed, not removable and its events are not shown, as if
  it did not exist (one agent must never end another's on-exit command).

Each tool reads its arguments once, with :mod:`engine._input`, into typed values (a schedule, a payload,
a cursor) and hands those to a backend: :class:`EmbeddedBackend` runs the method of
:class:`~engine.server._methods.Methods` in this process on them as they are (nothing is read twice),
:class:`SocketBackend` sends them in their JSON form (``docs/rpc.md``) to a running ``serve`` with the
synchronous client in a worker thread. The ``subprocess`` tool's parameters are read by the tool itself.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from typing import Any, Final, Protocol, final

import attrs
import trio

from .._errors import EngineError, InvalidArgumentError
from .._input import check_text, read_fields, read_moment, read_project, read_seconds, read_whole
from .._project import Project
from .._supervisor import RunState
from ..cron._job import SystemEvent
from ..cron._schedule import At, Cron, Every, OnExit, Schedule
from ._client import EngineClient
from ._mcp_inflight import InFlight, cut_answer
from ._methods import MethodNotFoundError, Methods, to_wire
from ._protocol import describe_schedule

__all__ = ["CRON_TOOLS", "EmbeddedBackend", "McpTools", "RpcBackend", "SocketBackend"]

_SUBPROCESS_ERROR: Final = "SUBPROCESS ERROR: "
_CRON_ERROR: Final = "CRON ERROR: "
_WHEN: Final = ("command", "at", "every_seconds", "cron")
_CRON_ADD_FIELDS: Final = frozenset({"text", "name", "cwd", "tz", *_WHEN})
#: How many events ``cron_events`` returns at most per call.
EVENTS_PAGE: Final = 20


class RpcBackend(Protocol):
    """Where the tools' calls go: a method of the RPC table (``docs/rpc.md``) and its typed params.

    Attributes:
        remote: whether the engine runs in another process (a ``serve``), where a call this server cut
            short goes on.
    """

    @property
    def remote(self) -> bool:
        """Whether the engine runs in another process."""
        ...

    async def hurry(self) -> None:
        """stdin closed and calls are still running: make what they wait for end sooner.

        Cancellation: what was hurried stays hurried.
        """

    async def call(self, method: str, params: Mapping[str, Any]) -> Any:
        """Run ``method`` on typed ``params`` (as :meth:`Methods.run` takes them); return its JSON result.

        Raises:
            EngineError, ValueError: the call was refused; the message says why.
        """
        ...


@final
@attrs.define(eq=False)
class EmbeddedBackend:
    """Calls the method table of an engine running in this process."""

    methods: Methods

    @property
    def remote(self) -> bool:
        """``False``: the engine runs here, and stops with this server."""
        return False

    async def hurry(self) -> None:
        """Every run being ended (by a kill, a halt, a job's removal) gets SIGKILL now.

        Cancellation: the kills are sent; each run is still reaped before this returns (shielded).
        """
        supervisor = self.methods.engine.supervisor
        async with trio.open_nursery() as nursery:
            for run in supervisor.runs():
                if run.state is RunState.EXITING:
                    nursery.start_soon(functools.partial(supervisor.cancel, run, force=True))

    async def call(self, method: str, params: Mapping[str, Any]) -> Any:
        """Cancellation: as the method called."""
        return await self.methods.run(method, params)


@final
@attrs.define(eq=False)
class SocketBackend:
    """Sends each call to a running ``serve`` on its own connection, in a worker thread.

    Attributes:
        state_dir: the engine's state directory.
    """

    state_dir: str

    @property
    def remote(self) -> bool:
        """``True``: the engine is a ``serve``; a call cut short here goes on there."""
        return True

    async def hurry(self) -> None:
        """Nothing to hurry here: the engine goes on without this server."""
        await trio.lowlevel.checkpoint()

    async def call(self, method: str, params: Mapping[str, Any]) -> Any:
        """Cancellation: the wait is abandoned; a request the engine received still completes there."""
        return await trio.to_thread.run_sync(
            functools.partial(self._call, method, to_wire(params)), abandon_on_cancel=True
        )

    def _call(self, method: str, params: dict[str, Any]) -> Any:
        with EngineClient(self.state_dir) as client:
            return client.call(method, **params)


def _cron_definitions() -> list[dict[str, Any]]:
    text = {
        "type": "string",
        "description": "The message delivered when the job fires (what to do, or what to check).",
    }
    return [
        {
            "name": "cron_add",
            "description": (
                "Schedule a job that delivers `text` when it fires. Give exactly one of: `command` (an "
                "on-exit job: the shell command starts now, in `cwd` or the project directory, and the job "
                "fires once when it exits, with its exit code and last output lines), `at` (once, at an "
                "ISO 8601 time with a UTC offset), `every_seconds` (repeatedly) or `cron` (a five-field "
                "cron expression, in time zone `tz`, default UTC). Read fired jobs with cron_events."
            ),
            "inputSchema": {
                "type": "object",
                "properties": {
                    "text": text,
                    "name": {"type": "string", "description": "A short name shown in lists and events."},
                    "command": {
                        "type": "string",
                        "description": "On-exit: the shell command to run now and watch, e.g. 'make test'.",
                    },
                    "cwd": {
                        "type": "string",
                        "description": "On-exit: the command's directory (default: the project directory).",
                    },
                    "at": {
                        "type": "string",
                        "description": "Once, at this time (ISO 8601, with offset): 2030-01-31T09:00+01:00.",
                    },
                    "every_seconds": {
                        "type": "number",
                        "minimum": 1,
                        "description": "Repeatedly, this many seconds apart (at least 1).",
                    },
                    "cron": {"type": "string", "description": "A cron expression, e.g. '0 9 * * 1-5'."},
                    "tz": {"type": "string", "description": "With cron: an IANA zone, e.g. Europe/Paris."},
                },
                "required": ["text"],
                "additionalProperties": False,
            },
        },
        {
            "name": "cron_list",
            "description": "List this project's jobs: id, name, schedule, next run and last status.",
            "inputSchema": {"type": "object", "properties": {}, "additionalProperties": False},
        },
        {
            "name": "cron_remove",
            "description": (
                "Remove a job of this project by id (an on-exit job's command is stopped, without firing)."
            ),
            "inputSchema": {
                "type": "object",
                "properties": {"id": {"type": "string", "description": "The job id cron_add returned."}},
                "required": ["id"],
                "additionalProperties": False,
            },
        },
        {
            "name": "cron_events",
            "description": (
                "Read the fires of this project's jobs, oldest first, after cursor `since` (default 0: from "
                "the start). "
                f"At most {EVENTS_PAGE} per call; the text ends with the cursor to pass next time."
            ),
            "inputSchema": {
                "type": "object",
                "properties": {
                    "since": {
                        "type": "integer",
                        "minimum": 0,
                        "description": "Only events after this cursor (the last call's `next since`).",
                    }
                },
                "additionalProperties": False,
            },
        },
    ]


#: The cron tools: ``{"name", "description", "inputSchema"}`` each, plain JSON Schemas.
CRON_TOOLS: Final = _cron_definitions()


def _job_line(job: Mapping[str, Any]) -> str:
    return (
        f"id: {job['id']} | name: {job['name']} | enabled: {'yes' if job['enabled'] else 'no'} | "
        f"schedule: {describe_schedule(job['schedule'])} | next: {job['next_run_at'] or '-'} | "
        f"last: {job['last_status'] or '-'}"
    )


@final
@attrs.define(eq=False)
class McpTools:
    """The tools of one MCP server: their definitions and their calls, bound to one project.

    Attributes:
        backend: where the calls go.
        project_dir: the absolute project directory the ``subprocess`` tool acts on.
    """

    backend: RpcBackend
    project_dir: str
    _in_flight: InFlight = attrs.field(init=False, factory=InFlight)

    async def definitions(self) -> list[dict[str, Any]]:
        """``{"name", "description", "inputSchema"}`` of every tool, ``subprocess`` first.

        Cancellation: safe.

        Raises:
            EngineError: the backend could not answer (a ``serve`` that stopped).
        """
        tool = await self.backend.call("tool.definition", {})
        subprocess = {
            "name": tool["name"],
            "description": tool["description"],
            "inputSchema": tool["parameters"],
        }
        return [subprocess, *CRON_TOOLS]

    async def call(self, name: str, arguments: Mapping[str, Any] | None) -> tuple[str, bool]:
        """Run tool ``name`` and return ``(text, is_error)``; refusals are texts, nothing is raised.

        A call :meth:`cut_short` cancels returns what is true so far (``_mcp_inflight.cut_answer``).

        Cancellation: as the engine operation behind the tool.
        """
        args = dict(arguments or {})
        with self._in_flight.track(name, args) as call, call.scope:
            return await self._call(name, args)
        return cut_answer(call, remote=self.backend.remote)

    def calls_in_flight(self) -> int:
        """How many tool calls are running (a call whose request the client cancelled too)."""
        return len(self._in_flight)

    async def wait_calls_done(self) -> None:
        """Wait until no tool call runs.

        Cancellation: safe; nothing changes.
        """
        await self._in_flight.wait_done()

    async def cut_short(self, hurry_seconds: float) -> None:
        """stdin closed: hurry the calls in flight, then cut short those still running after
        ``hurry_seconds`` (see ``_mcp_inflight``); each then answers its state so far.

        Cancellation: the calls already cut stay cut.
        """
        await self._in_flight.cut_short(
            self.backend.hurry, remote=self.backend.remote, hurry_seconds=hurry_seconds
        )

    async def _call(self, name: str, args: dict[str, Any]) -> tuple[str, bool]:
        if name == "subprocess":
            return await self._subprocess(args)
        handlers = {
            "cron_add": self._cron_add,
            "cron_list": self._cron_list,
            "cron_remove": self._cron_remove,
            "cron_events": self._cron_events,
        }
        handler = handlers.get(name)
        if handler is None:
            await trio.lowlevel.checkpoint()
            names = ", ".join(["subprocess", *handlers])
            return f"ERROR: unknown tool {name!r}; tools: {names}", True
        try:
            return await handler(args), False
        except (EngineError, MethodNotFoundError, ValueError, TypeError, OSError) as exc:
            return f"{_CRON_ERROR}{exc}", True

    async def _subprocess(self, args: dict[str, Any]) -> tuple[str, bool]:
        try:
            params = {"params": args, "project": read_project(self.project_dir)}
            result = await self.backend.call("tool.execute", params)
        except (EngineError, MethodNotFoundError, ValueError, TypeError, OSError) as exc:
            return f"{_SUBPROCESS_ERROR}{exc}", True
        text = result["text"]
        return text, text.startswith(_SUBPROCESS_ERROR)

    def _project(self) -> Project:
        return read_project(self.project_dir)

    def _cwd(self, args: Mapping[str, Any]) -> str:
        cwd = args.get("cwd")
        if cwd is None:
            return self.project_dir
        path = check_text(cwd, "cwd")
        return os.path.normpath(os.path.join(self.project_dir, os.path.expanduser(path)))

    def _schedule(self, args: Mapping[str, Any]) -> Schedule:
        given = [key for key in _WHEN if key in args]
        if len(given) != 1:
            raise InvalidArgumentError(
                f"give exactly one of {', '.join(_WHEN)}; got {', '.join(given) or 'none'}"
            )
        kind = given[0]
        if "cwd" in args and kind != "command":
            raise InvalidArgumentError("cwd goes with command (an on-exit job); leave it out")
        if "tz" in args and kind != "cron":
            raise InvalidArgumentError("tz goes with cron; leave it out")
        value = args[kind]
        if kind == "every_seconds":
            return Every(every_seconds=read_seconds(value, kind))
        if kind == "at":
            return At(at=read_moment(value, kind))
        if kind == "cron":
            return Cron(expr=check_text(value, kind), tz=args.get("tz") or "UTC")
        return OnExit(command=check_text(value, kind), cwd=self._cwd(args))

    async def _cron_add(self, raw: dict[str, Any]) -> str:
        args = read_fields(raw, "cron_add", _CRON_ADD_FIELDS, what="argument")
        params: dict[str, object] = {
            "schedule": self._schedule(args),
            "payload": SystemEvent(text=check_text(args.get("text"), "text")),
            "project": self._project(),
        }
        if "name" in args:
            params["name"] = check_text(args["name"], "name")
        job = await self.backend.call("cron.add", params)
        return "\n".join(
            [
                "CRON ADDED",
                f"id: {job['id']}",
                f"name: {job['name']}",
                f"schedule: {describe_schedule(job['schedule'])}",
                f"next run: {job['next_run_at'] or '-'}",
            ]
        )

    async def _cron_list(self, raw: dict[str, Any]) -> str:
        read_fields(raw, "cron_list", (), what="argument")
        jobs = await self.backend.call("cron.list", {"project": self._project()})
        lines = ["CRON LIST", *(_job_line(job) for job in jobs)]
        if not jobs:
            lines.append("No cron jobs.")
        return "\n".join(lines)

    async def _cron_remove(self, raw: dict[str, Any]) -> str:
        args = read_fields(raw, "cron_remove", ("id",), what="argument")
        job_id = check_text(args.get("id"), "id")
        await self.backend.call("cron.remove", {"job_id": job_id, "project": self._project()})
        return f"CRON REMOVED\nid: {job_id}"

    async def _cron_events(self, raw: dict[str, Any]) -> str:
        args = read_fields(raw, "cron_events", ("since",), what="argument")
        since = read_whole(args.get("since", 0), "since")
        events = await self.backend.call(
            "events", {"since": since, "limit": EVENTS_PAGE, "project": self._project()}
        )
        lines = ["CRON EVENTS"]
        for event in events:
            lines.append(f"--- event {event['cursor']}: {event['job_name']} (job {event['job_id']}) ---")
            lines.append(event["text"].rstrip("\n"))
        if not events:
            lines.append(f"No events after cursor {since}.")
        lines.append(f"next since: {events[-1]['cursor'] if events else since}")
        return "\n".join(lines)
