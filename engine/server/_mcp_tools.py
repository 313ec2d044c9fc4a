"""The tools ``gadget-engine mcp`` offers, over a backend that is either an embedded engine or a socket.

Independent of the MCP SDK: this module names the tools, checks their arguments and writes their texts;
``_mcp`` puts them on the wire. Every tool answers with one text and an error flag:

- ``subprocess``: the engine's own tool (same schema, same texts byte for byte, ``SUBPROCESS ERROR: ...``
  flagged as an error), bound to the server's project.
- ``cron_add``, ``cron_list``, ``cron_remove``, ``cron_events``: jobs and their fired events, in texts of
  the same shape (``CRON ADDED`` ..., ``CRON ERROR: ...`` for a rejected call).

Both backends speak the RPC method table (``docs/rpc.md``): :class:`EmbeddedBackend` calls
:class:`~engine.server._methods.Methods` in this process, :class:`SocketBackend` sends the same calls to a
running ``serve`` with the synchronous client in a worker thread.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Mapping
from datetime import datetime
from typing import Any, Final, Protocol, final

import attrs
import trio

from .._errors import EngineError
from ._client import EngineClient
from ._methods import InvalidParamsError, MethodNotFoundError, Methods
from ._protocol import describe_schedule

__all__ = ["CRON_TOOLS", "EmbeddedBackend", "McpTools", "RpcBackend", "SocketBackend"]

_SUBPROCESS_ERROR: Final = "SUBPROCESS ERROR: "
_CRON_ERROR: Final = "CRON ERROR: "
_WHEN: Final = ("command", "at", "every_seconds", "cron")
_CRON_ADD_FIELDS: Final = frozenset({"text", "name", "cwd", "tz", *_WHEN})
#: How many events ``cron_events`` returns at most per call.
EVENTS_PAGE: Final = 20


class RpcBackend(Protocol):
    """Where the tools' calls go: a method of the RPC table (``docs/rpc.md``) and its named params."""

    async def call(self, method: str, params: Mapping[str, Any]) -> Any:
        """Run ``method`` and return its JSON-ready result.

        Raises:
            EngineError, InvalidParamsError, ValueError: the call was refused; the message says why.
        """
        ...


@final
@attrs.define(eq=False)
class EmbeddedBackend:
    """Calls the method table of an engine running in this process."""

    methods: Methods

    async def call(self, method: str, params: Mapping[str, Any]) -> Any:
        """Cancellation: as the method called."""
        return await self.methods.call(method, params)


@final
@attrs.define(eq=False)
class SocketBackend:
    """Sends each call to a running ``serve`` on its own connection, in a worker thread.

    Attributes:
        state_dir: the engine's state directory.
    """

    state_dir: str

    async def call(self, method: str, params: Mapping[str, Any]) -> Any:
        """Cancellation: the wait is abandoned; a request the engine received still completes there."""
        return await trio.to_thread.run_sync(
            functools.partial(self._call, method, dict(params)), abandon_on_cancel=True
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
            "description": "List the scheduled jobs: id, name, schedule, next run and last status.",
            "inputSchema": {"type": "object", "properties": {}, "additionalProperties": False},
        },
        {
            "name": "cron_remove",
            "description": "Remove a job by id (an on-exit job's command is stopped, without firing).",
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
                "Read the jobs that fired, oldest first, after cursor `since` (default 0: from the start). "
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


class _RejectedError(Exception):
    """An argument problem, reported to the agent as a ``CRON ERROR`` text."""


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

        Cancellation: as the engine operation behind the tool.
        """
        args = dict(arguments or {})
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
        except (_RejectedError, EngineError, InvalidParamsError, MethodNotFoundError) as exc:
            return f"{_CRON_ERROR}{exc}", True
        except (ValueError, TypeError, OSError) as exc:
            return f"{_CRON_ERROR}{exc}", True

    async def _subprocess(self, args: dict[str, Any]) -> tuple[str, bool]:
        try:
            result = await self.backend.call("tool.execute", {"params": args, "project": self.project_dir})
        except (EngineError, InvalidParamsError, MethodNotFoundError, ValueError, TypeError, OSError) as exc:
            return f"{_SUBPROCESS_ERROR}{exc}", True
        text = result["text"]
        return text, text.startswith(_SUBPROCESS_ERROR)

    def _cwd(self, args: Mapping[str, Any]) -> str:
        cwd = args.get("cwd")
        if cwd is None:
            return self.project_dir
        if not isinstance(cwd, str) or not cwd:
            raise _RejectedError(f"cwd must be a directory path, got {cwd!r}")
        return os.path.normpath(os.path.join(self.project_dir, os.path.expanduser(cwd)))

    def _schedule(self, args: Mapping[str, Any]) -> dict[str, Any]:
        given = [key for key in _WHEN if args.get(key) is not None]
        if len(given) != 1:
            raise _RejectedError(f"give exactly one of {', '.join(_WHEN)}; got {', '.join(given) or 'none'}")
        kind = given[0]
        if args.get("cwd") is not None and kind != "command":
            raise _RejectedError("cwd goes with command (an on-exit job); leave it out")
        if args.get("tz") is not None and kind != "cron":
            raise _RejectedError("tz goes with cron; leave it out")
        value = args[kind]
        if kind == "every_seconds":
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise _RejectedError(f"every_seconds must be a number of seconds, got {value!r}")
            return {"kind": "every", "every_seconds": value}
        if not isinstance(value, str) or not value.strip():
            raise _RejectedError(f"{kind} must be a non-empty string, got {value!r}")
        if kind == "command":
            return {"kind": "on_exit", "command": value, "cwd": self._cwd(args)}
        if kind == "cron":
            tz = args.get("tz") or "UTC"
            if not isinstance(tz, str):
                raise _RejectedError(f"tz must be a time zone name, got {tz!r}")
            return {"kind": "cron", "expr": value, "tz": tz}
        try:
            moment = datetime.fromisoformat(value)
        except ValueError:
            raise _RejectedError(f"at must be an ISO 8601 time with an offset, got {value!r}") from None
        if moment.tzinfo is None:
            raise _RejectedError(f"at needs a UTC offset, e.g. {value}+00:00")
        return {"kind": "at", "at": moment.isoformat()}

    async def _cron_add(self, args: dict[str, Any]) -> str:
        unknown = sorted(set(args) - _CRON_ADD_FIELDS)
        if unknown:
            raise _RejectedError(
                f"unknown argument(s) {', '.join(unknown)}; allowed: {', '.join(sorted(_CRON_ADD_FIELDS))}"
            )
        text = args.get("text")
        if not isinstance(text, str) or not text.strip():
            raise _RejectedError(f"text must be a non-empty string, got {text!r}")
        name = args.get("name")
        if name is not None and (not isinstance(name, str) or not name.strip()):
            raise _RejectedError(f"name must be a non-empty string, got {name!r}")
        params: dict[str, Any] = {
            "schedule": self._schedule(args),
            "payload": {"kind": "system_event", "text": text},
        }
        if name is not None:
            params["name"] = name
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

    async def _cron_list(self, args: dict[str, Any]) -> str:
        if args:
            raise _RejectedError(f"cron_list takes no arguments, got {', '.join(sorted(args))}")
        jobs = await self.backend.call("cron.list", {})
        lines = ["CRON LIST", *(_job_line(job) for job in jobs)]
        if not jobs:
            lines.append("No cron jobs.")
        return "\n".join(lines)

    async def _cron_remove(self, args: dict[str, Any]) -> str:
        job_id = args.get("id")
        if set(args) - {"id"}:
            raise _RejectedError(f"cron_remove takes only id, got {', '.join(sorted(args))}")
        if not isinstance(job_id, str) or not job_id:
            raise _RejectedError(f"id must be a job id from cron_add or cron_list, got {job_id!r}")
        await self.backend.call("cron.remove", {"job_id": job_id})
        return f"CRON REMOVED\nid: {job_id}"

    async def _cron_events(self, args: dict[str, Any]) -> str:
        if set(args) - {"since"}:
            raise _RejectedError(f"cron_events takes only since, got {', '.join(sorted(args))}")
        since = args.get("since", 0)
        if isinstance(since, float) and since.is_integer():
            since = int(since)
        if isinstance(since, bool) or not isinstance(since, int) or since < 0:
            raise _RejectedError(f"since must be an event cursor (a whole number >= 0), got {since!r}")
        events = await self.backend.call("events", {"since": since, "limit": EVENTS_PAGE})
        lines = ["CRON EVENTS"]
        for event in events:
            lines.append(f"--- event {event['cursor']}: {event['job_name']} (job {event['job_id']}) ---")
            lines.append(event["text"].rstrip("\n"))
        if not events:
            lines.append(f"No events after cursor {since}.")
        lines.append(f"next since: {events[-1]['cursor'] if events else since}")
        return "\n".join(lines)
