"""The ``subprocess`` agent tool: one function over the subprocess service, bound to a project per call.

The tool is the edge where an agent's loosely typed parameters meet the library: it reads them once with
:mod:`engine._input` (whole numbers, strings fit to store and answer with, the stream name) and turns
every rejection and every service error into one text starting ``SUBPROCESS ERROR: ``; a rejected call
changes nothing. It acts only on the calling project's
subprocesses: ``list`` and ``killAll`` cover that project, and another project's pid is "not found", so
one agent can never end another agent's processes.

With ``EngineConfig.tool_extensions`` (the default) the tool offers more than the spec: ``create`` takes
``stdin``, ``ready``, ``restart`` and ``notify_on_exit``; ``log`` takes ``new`` and ``grep``; two more
commands, ``input`` and ``wait``. Every call the spec describes still answers with the spec's text byte
for byte; what an extension adds comes as lines after the spec's lines. With ``tool_extensions=False`` the
definition is exactly the spec's: six commands and the parameters ``cmd``, ``command``, ``args``, ``pid``,
``which``, ``offset``, ``limit`` and ``tail``.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import ClassVar, Final, final

import attrs
import trio

from ._config import EngineConfig
from ._errors import EngineError, InvalidArgumentError, SubProcessNotFoundError
from ._input import check_strings, check_text, read_fields, read_stream, read_whole, show
from ._logs import LogSlice
from ._project import Project
from ._subprocesses import SubProcess, SubProcessService
from ._tool_extensions import (
    EXTENDED_COMMANDS,
    EXTENDED_USES,
    EXTENSION_PARAMETERS,
    LogRequest,
    ToolExtensions,
)

__all__ = ["SubprocessTool"]

#: The spec's commands and parameters (``tool_extensions=False``: exactly these).
COMMANDS: Final = ("create", "list", "kill", "killAll", "halt", "log")
_USES: Final[Mapping[str, frozenset[str]]] = {
    "create": frozenset({"command", "args"}),
    "list": frozenset(),
    "kill": frozenset({"pid"}),
    "killAll": frozenset(),
    "halt": frozenset({"pid"}),
    "log": frozenset({"pid", "which", "offset", "limit", "tail"}),
}
_PARAMETERS: Final = ("cmd", "command", "args", "pid", "which", "offset", "limit", "tail")

#: What ``log`` shows by default: the last lines within a byte budget.
LOG_DEFAULT_LINES: Final = 200
LOG_MAX_BYTES: Final = 32 * 1024

_KILLALL_TEXT: Final = (
    "SUBPROCESS KILLALL\nAll managed subprocesses have been terminated and their logs removed."
)
_HALTED_TEXT: Final = "The process has been stopped. Log files are retained for inspection."


def _iso(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@final
@attrs.define(eq=False)
class SubprocessTool:
    """The ``subprocess`` tool (category ``system``) for agents in the modes Build, Test, Ship and Develop.

    Attributes:
        service: the service it acts through.
        config: the engine settings, quoted in the tool's description (``None``: defaults).
    """

    service: SubProcessService
    config: EngineConfig | None = attrs.field(default=None, kw_only=True)

    name: ClassVar[str] = "subprocess"
    category: ClassVar[str] = "system"

    @property
    def definition(self) -> dict[str, object]:
        """``{"name", "description", "parameters"}``; ``parameters`` is a plain JSON Schema object.

        No ``$schema``, ``$ref`` or conditional keywords, so OpenAI, Anthropic and MCP tool definitions
        can all take it as it is. Which parameters each ``cmd`` needs is in the descriptions.
        """
        config = self._config
        description = (
            "Manage long-running processes (dev servers, watchers, test runs, builds) in the current "
            "project. cmd=create starts `command` with `args` in the project directory and returns its pid "
            "and the paths of its stdout and stderr log files; the process keeps running after this call. "
            "cmd=list shows this project's processes. cmd=log shows the end of one log (pid, which); "
            "page with offset/limit or tail. cmd=halt stops a process and keeps its logs; cmd=kill stops it "
            "and deletes its logs; cmd=killAll kills every process of this project. Stopping sends SIGINT, "
            f"then SIGKILL after {config.grace_seconds:g} s. At most {config.max_processes_per_project} "
            f"live processes per project; each log keeps its newest {config.log_cap_bytes // 2**20} MiB."
        )
        parameters: dict[str, object] = {
            "type": "object",
            "properties": {
                "cmd": {
                    "type": "string",
                    "enum": list(COMMANDS),
                    "description": "The operation: create, list, kill, killAll, halt or log.",
                },
                "command": {
                    "type": "string",
                    "description": "For create: the executable to run, e.g. npm, node, python3, ./run.sh.",
                },
                "args": {
                    "type": "array",
                    "items": {"type": "string"},
                    "description": "For create: the arguments, one string each (no shell parsing).",
                },
                "pid": {
                    "type": "integer",
                    "minimum": 1,
                    "description": "For kill, halt and log: the pid create or list reported.",
                },
                "which": {
                    "type": "string",
                    "enum": ["stdout", "stderr"],
                    "description": "For log: which log to read.",
                },
                "offset": {
                    "type": "integer",
                    "minimum": 0,
                    "description": "For log: read forward from this byte offset (0 = the start).",
                },
                "limit": {
                    "type": "integer",
                    "minimum": 1,
                    "description": (
                        f"For log with offset: at most this many lines (default {LOG_DEFAULT_LINES})."
                    ),
                },
                "tail": {
                    "type": "integer",
                    "minimum": 1,
                    "description": f"For log: the last this many lines (default {LOG_DEFAULT_LINES}).",
                },
            },
            "required": ["cmd"],
            "additionalProperties": False,
        }
        if config.tool_extensions:
            description, parameters = self._extensions.extend_definition(description, parameters)
        return {"name": self.name, "description": description, "parameters": parameters}

    @property
    def _config(self) -> EngineConfig:
        return self.config if self.config is not None else EngineConfig()

    @property
    def _extensions(self) -> ToolExtensions:
        return ToolExtensions(self.service, self._config)

    def _commands(self) -> tuple[str, ...]:
        return EXTENDED_COMMANDS if self._config.tool_extensions else COMMANDS

    def _uses(self, cmd: str) -> frozenset[str]:
        return (EXTENDED_USES if self._config.tool_extensions else _USES)[cmd]

    def _parameters(self) -> tuple[str, ...]:
        return _PARAMETERS + EXTENSION_PARAMETERS if self._config.tool_extensions else _PARAMETERS

    async def execute(self, params: Mapping[str, object], project: Project) -> str:
        """Run one tool call for ``project`` and return the response text.

        Every rejected call, and every error of the service, comes back as one text starting
        ``SUBPROCESS ERROR: ``; nothing else is raised.

        Cancellation: propagates ``trio.Cancelled``; a kill or halt under way still ends and reaps its
        process first (see :meth:`SubProcessService.kill_subprocess`).
        """
        try:
            return await self._execute(params, project)
        except (EngineError, ValueError, TypeError) as exc:
            return f"SUBPROCESS ERROR: {exc}"
        except OSError as exc:
            return f"SUBPROCESS ERROR: {exc.strerror or exc} ({exc.filename or 'no path'})"
        except Exception as exc:  # the tool must answer with a text, whatever broke underneath
            return f"SUBPROCESS ERROR: internal error: {type(exc).__name__}: {exc}"

    async def _execute(self, raw: Mapping[str, object], project: Project) -> str:
        if not isinstance(project, Project):
            raise InvalidArgumentError("the call is not bound to a project")
        names = self._parameters()
        params = read_fields(raw, "subprocess", names, what="parameter")
        cmd = params.get("cmd")
        commands = self._commands()
        if not isinstance(cmd, str) or cmd not in commands:
            raise InvalidArgumentError(f"cmd must be one of {', '.join(commands)}, got {show(cmd)}")
        stray = [k for k in names[1:] if k in params and k not in self._uses(cmd)]
        if stray:
            raise InvalidArgumentError(
                f"cmd={cmd} does not take {', '.join(stray)}; leave {'them' if len(stray) > 1 else 'it'} out"
            )
        if cmd == "create":
            return await self._create(params, project)
        if cmd == "list":
            await trio.lowlevel.checkpoint()
            return self._list(project)
        if cmd == "killAll":
            await self.service.kill_project(project.id)
            return _KILLALL_TEXT
        pid = read_whole(self._required(params, "pid"), "pid", 1)
        # Every argument is read before the pid is looked up: a call that lacks one is told so, whatever pid.
        if cmd == "log":
            request = self._read_log(params)
            return await self._log(self._find(project, pid), request)
        if cmd == "input":
            text, eof = self._extensions.read_input(params)
            return await self._extensions.input(self._find(project, pid), text, eof=eof)
        if cmd == "wait":
            seconds = self._extensions.read_wait(params)
            return await self._extensions.wait(self._find(project, pid), seconds)
        sp = self._find(project, pid)
        if cmd == "kill":
            await self.service.kill_subprocess(sp)
            return f"SUBPROCESS KILLED\npid: {sp.pid}"
        await self.service.halt_subprocess(sp)
        return f"SUBPROCESS HALTED\npid: {sp.pid}\n{_HALTED_TEXT}"

    @staticmethod
    def _required(params: Mapping[str, object], name: str) -> object:
        value = params.get(name)
        if value is None:
            raise InvalidArgumentError(f"cmd={params['cmd']} needs {name}")
        return value

    def _find(self, project: Project, pid: int) -> SubProcess:
        try:
            return self.service.lookup(pid, project_id=project.id)
        except SubProcessNotFoundError:
            raise SubProcessNotFoundError(
                f"no subprocess with pid {pid} in this project (killed, or never created); see cmd=list"
            ) from None

    async def _create(self, params: Mapping[str, object], project: Project) -> str:
        command = check_text(self._required(params, "command"), "command")
        args = check_strings(params.get("args", ()), "args")
        options = self._extensions.create_options(params)
        sp = await self.service.create(project, command, args, **options)
        text = f"SUBPROCESS CREATED\npid: {sp.pid}\nstdout: {sp.stdout_path}\nstderr: {sp.stderr_path}"
        return text + self._extensions.created_lines(sp, options)

    def _list(self, project: Project) -> str:
        lines = ["SUBPROCESS LIST"]
        for sp in self.service.ps():
            if sp.project.id != project.id:
                continue
            summary = self.service.summarize(sp)
            line = (
                f"pid: {sp.pid} | project: {project.slug} | created: {_iso(summary.created_at)} | "
                f"updated: {_iso(summary.updated_at)} | status: {summary.status}"
            )
            lines.append(
                line + self._extensions.list_suffix(summary) if self._config.tool_extensions else line
            )
        if len(lines) == 1:
            lines.append("No subprocesses in this project.")
        return "\n".join(lines)

    def _read_log(self, params: Mapping[str, object]) -> LogRequest:
        which = read_stream(self._required(params, "which"), "which")
        if "new" in params or "grep" in params:
            return self._extensions.read_log(params, which)
        offset, limit, tail = (params.get(name) for name in ("offset", "limit", "tail"))
        if tail is not None and (offset is not None or limit is not None):
            raise InvalidArgumentError("give tail alone, or offset (and limit); not both")
        if offset is None and limit is None:
            return LogRequest(which, tail=LOG_DEFAULT_LINES if tail is None else read_whole(tail, "tail", 1))
        return LogRequest(
            which,
            offset=None if offset is None else read_whole(offset, "offset", 0),
            limit=LOG_DEFAULT_LINES if limit is None else read_whole(limit, "limit", 1),
        )

    async def _log(self, sp: SubProcess, request: LogRequest) -> str:
        if request.extended:
            return await self._extensions.log(sp, request)
        which = request.which
        got: LogSlice
        if request.tail is not None:
            got = await self.service.read_log(
                sp.pid, which, tail=request.tail, max_bytes=LOG_MAX_BYTES, project_id=sp.project.id
            )
            note = _tail_note(got)
        else:
            got = await self.service.read_log(
                sp.pid,
                which,
                offset=request.offset,
                limit=request.limit,
                max_bytes=LOG_MAX_BYTES,
                project_id=sp.project.id,
            )
            note = _forward_note(got)
        if got.dropped_bytes:
            note = (note + " " if note else "") + (
                f"[the log cap dropped the oldest {got.dropped_bytes} bytes of this log; they cannot be read]"
            )
        text = f"SUBPROCESS LOG ({which})\npid: {sp.pid}\n---\n{got.text}"
        return f"{text}\n{note}" if note else text


def _shown_lines(text: str) -> int:
    return text.count("\n") + (1 if text and not text.endswith("\n") else 0)


def _tail_note(got: LogSlice) -> str:
    before = got.start_offset - got.dropped_bytes
    if before <= 0:
        return ""
    lines = max(got.total_lines - _shown_lines(got.text), 0)
    # No earlier line at all: the bytes left out are the start of the one long line shown.
    left_out = f"{lines} earlier lines" if lines else "the start of the first line shown"
    return (
        f"[truncated: showing bytes {got.start_offset}-{got.next_offset} of {got.total_bytes}; "
        f"{left_out} ({before} bytes) left out. For more, call log again with tail=<lines> "
        f"(up to {LOG_MAX_BYTES} bytes per call) or with offset=<byte> and limit=<lines>, "
        f"e.g. offset={got.dropped_bytes} to page from the start.]"
    )


def _forward_note(got: LogSlice) -> str:
    after = got.total_bytes - got.next_offset
    if after <= 0:
        return ""
    return (
        f"[truncated: showing bytes {got.start_offset}-{got.next_offset} of {got.total_bytes}; {after} "
        f"more bytes follow. Continue with offset={got.next_offset}, or use tail=<lines> for the end.]"
    )
