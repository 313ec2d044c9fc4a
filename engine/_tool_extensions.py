"""What the ``subprocess`` tool offers beyond the spec (``EngineConfig.tool_extensions``, on by default).

``create`` takes ``stdin``, ``ready``, ``restart`` and ``notify_on_exit``; ``log`` takes ``new`` and
``grep``; ``input`` writes to a process's stdin and ``wait`` waits for its exit. Each addition to a text
comes as lines after the spec's lines, so an agent (or a test) that knows only the spec reads the same
first lines. Every value is read with :mod:`engine._input`; a bad one is a ``SUBPROCESS ERROR:`` text
that says what to send instead.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping
from typing import Any, Final, final

import attrs
import trio

from ._config import EngineConfig
from ._errors import InvalidArgumentError
from ._input import (
    MAX_WAIT_SECONDS,
    check_flag,
    check_string,
    read_ready,
    read_restart,
    read_seconds,
    read_whole,
    show,
)
from ._logs import LogSlice, Stream
from ._restart import RESTART_MODES
from ._stdin import write_within
from ._subprocesses import SubProcess, SubProcessService, SubProcessSummary

__all__ = ["EXTENDED_COMMANDS", "EXTENDED_USES", "EXTENSION_PARAMETERS", "LogRequest", "ToolExtensions"]

EXTENDED_COMMANDS: Final = ("create", "list", "kill", "killAll", "halt", "log", "input", "wait")
EXTENSION_PARAMETERS: Final = (
    "stdin",
    "ready",
    "restart",
    "notify_on_exit",
    "new",
    "grep",
    "text",
    "eof",
    "timeout",
)
EXTENDED_USES: Final[Mapping[str, frozenset[str]]] = {
    "create": frozenset({"command", "args", "stdin", "ready", "restart", "notify_on_exit"}),
    "list": frozenset(),
    "kill": frozenset({"pid"}),
    "killAll": frozenset(),
    "halt": frozenset({"pid"}),
    "log": frozenset({"pid", "which", "offset", "limit", "tail", "new", "grep"}),
    "input": frozenset({"pid", "text", "eof"}),
    "wait": frozenset({"pid", "timeout"}),
}

#: The default and the longest ``wait``, in seconds.
WAIT_DEFAULT_SECONDS: Final = 30.0
#: What ``log`` returns at most, in bytes (as the spec's log).
LOG_MAX_BYTES: Final = 32 * 1024

_DESCRIPTION: Final = (
    " More: create takes stdin=true (then cmd=input sends `text` to the process, eof=true ends its input), "
    'ready={"log": regex, "port": n, "timeout": s} (create returns once a line matches or the port listens, '
    "and shows the first output), restart "
    '{"mode": "on-failure"|"always", "max_restarts": 5, "window": 60, "backoff": 1} (a crashed process '
    "comes back, up to a crash loop) and notify_on_exit=true (you hear when it exits on its own). "
    "cmd=log takes new=true (only what is new since your last new=true read) and grep=regex (the matching "
    "lines with their numbers). cmd=wait waits until a process exited (timeout in seconds, default 30, "
    "at most 300) and tells how it ended."
)

_PROPERTIES: Final[dict[str, Any]] = {
    "stdin": {
        "type": "boolean",
        "description": "For create: give the process a stdin pipe; write to it with cmd=input.",
    },
    "ready": {
        "type": "object",
        "properties": {
            "log": {"type": "string", "description": "A regular expression looked for in stdout and stderr."},
            "port": {
                "type": "integer",
                "minimum": 1,
                "maximum": 65535,
                "description": "A TCP port it listens on.",
            },
            "timeout": {
                "type": "number",
                "exclusiveMinimum": 0,
                "maximum": MAX_WAIT_SECONDS,
                "description": "Seconds to wait at most (default 30); the process keeps running after.",
            },
        },
        "additionalProperties": False,
        "description": "For create: return once the process is ready (a log line or a listening port).",
    },
    "restart": {
        "type": "object",
        "properties": {
            "mode": {"type": "string", "enum": list(RESTART_MODES)},
            "max_restarts": {"type": "integer", "minimum": 0, "description": "Restarts allowed per window."},
            "window": {"type": "number", "exclusiveMinimum": 0, "description": "The window, in seconds."},
            "backoff": {"type": "number", "minimum": 0, "description": "First wait, in seconds; doubles."},
        },
        "required": ["mode"],
        "additionalProperties": False,
        "description": "For create: restart the process when it exits on its own (never after kill or halt).",
    },
    "notify_on_exit": {
        "type": "boolean",
        "description": "For create: deliver an event when the process exits on its own.",
    },
    "new": {
        "type": "boolean",
        "description": "For log: only what was written since your last log call with new=true.",
    },
    "grep": {
        "type": "string",
        "description": "For log: a regular expression; show only the matching lines, with their numbers.",
    },
    "text": {
        "type": "string",
        "description": "For input: the text to send to stdin (end a line with \\n).",
    },
    "eof": {"type": "boolean", "description": "For input: close stdin after the text (end of input)."},
    "timeout": {
        "type": "number",
        "minimum": 0,
        "maximum": MAX_WAIT_SECONDS,
        "description": f"For wait: seconds to wait at most (default {WAIT_DEFAULT_SECONDS:g}).",
    },
}


@attrs.frozen
class LogRequest:
    """The arguments of one ``log`` call, read before its pid is looked up.

    Attributes:
        which: the log, ``"stdout"`` or ``"stderr"``.
        offset: read forward from this byte offset (``None``: not given).
        limit: at most this many lines forward.
        tail: the last this many lines.
        new: only what was written since the caller's last read with ``new``.
        grep: only the lines matching this regular expression.
        extended: ``new`` or ``grep`` was given: the extension's reading (:meth:`ToolExtensions.log`).
    """

    which: Stream
    offset: int | None = None
    limit: int | None = None
    tail: int | None = None
    new: bool = False
    grep: str | None = None
    extended: bool = False


def _ready_line(summary: SubProcessSummary, timeout: float) -> str:
    if summary.ready == "ready":
        return "ready: ready"
    if summary.ready == "exited":
        return f"ready: exited before it was ready ({summary.status})"
    return f"ready: timeout, not ready after {timeout:g} s; it is still running"


@final
@attrs.frozen
class ToolExtensions:
    """The tool's additions over one service (see the module)."""

    service: SubProcessService
    config: EngineConfig

    def extend_definition(self, description: str, parameters: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """The spec's description and schema, with the additions."""
        extended = copy.deepcopy(parameters)
        extended["properties"]["cmd"]["enum"] = list(EXTENDED_COMMANDS)
        extended["properties"]["cmd"]["description"] = (
            "The operation: create, list, kill, killAll, halt, log, input or wait."
        )
        extended["properties"]["pid"]["description"] = (
            "For kill, halt, log, input and wait: the pid create or list reported."
        )
        extended["properties"].update(copy.deepcopy(_PROPERTIES))
        return description + _DESCRIPTION, extended

    # ---- create ----------------------------------------------------------------------------------------

    def create_options(self, params: Mapping[str, object]) -> dict[str, Any]:
        """The keyword arguments of ``create`` the call gives (none when it gives no extension)."""
        options: dict[str, Any] = {}
        if "stdin" in params:
            options["stdin"] = check_flag(params["stdin"], "stdin")
        if "ready" in params:
            options["ready"] = read_ready(params["ready"], "ready")
        if "restart" in params:
            options["restart"] = read_restart(params["restart"], "restart")
        if "notify_on_exit" in params:
            options["notify_on_exit"] = check_flag(params["notify_on_exit"], "notify_on_exit")
        return options

    def created_lines(self, sp: SubProcess, options: Mapping[str, Any]) -> str:
        """The lines ``create`` adds after the spec's text."""
        lines: list[str] = []
        if options.get("stdin"):
            lines.append("stdin: open; send text with cmd=input")
        policy = options.get("restart")
        if policy is not None and policy.mode != "no":
            lines.append(
                f"restart: {policy.mode} (at most {policy.max_restarts} restarts in "
                f"{policy.window_seconds:g} s)"
            )
        if options.get("notify_on_exit"):
            lines.append("notify on exit: yes")
        ready = options.get("ready")
        if ready is not None:
            summary = self.service.summarize(sp)
            lines.append(_ready_line(summary, ready.timeout_seconds))
            if summary.first_output:
                lines.append("--- first output ---")
                lines.append(summary.first_output.rstrip("\n"))
        return "".join(f"\n{line}" for line in lines)

    def list_suffix(self, summary: SubProcessSummary) -> str:
        """What a ``list`` line adds after the spec's: the restarts of a restarted process."""
        if not summary.restarts:
            return ""
        last = f" | last exit: {summary.last_exit}" if summary.last_exit else ""
        return f" | restarts: {summary.restarts} | first pid: {summary.first_pid}{last}"

    # ---- log -------------------------------------------------------------------------------------------

    def read_log(self, params: Mapping[str, object], which: Stream) -> LogRequest:
        """The arguments of a ``log`` with ``new`` and/or ``grep``, read before its pid is looked up."""
        new = check_flag(params.get("new", False), "new")
        grep = params.get("grep")
        pattern = None if grep is None else check_string(grep, "grep")
        offset, limit, tail = (params.get(name) for name in ("offset", "limit", "tail"))
        if new and (offset is not None or tail is not None):
            raise InvalidArgumentError("new=true reads on from your last read; leave out offset and tail")
        if tail is not None and (offset is not None or limit is not None):
            raise InvalidArgumentError("give tail alone, or offset (and limit); not both")
        return LogRequest(
            which,
            offset=None if offset is None else read_whole(offset, "offset", 0),
            limit=None if limit is None else read_whole(limit, "limit", 1),
            tail=None if tail is None else read_whole(tail, "tail", 1),
            new=new,
            grep=pattern,
            extended=True,
        )

    async def log(self, sp: SubProcess, request: LogRequest) -> str:
        """``log`` with ``new`` and/or ``grep`` (``request`` from :meth:`read_log`)."""
        pattern, new = request.grep, request.new
        got = await self.service.read_log(
            sp.pid,
            request.which,
            offset=request.offset,
            limit=request.limit,
            tail=request.tail,
            max_bytes=LOG_MAX_BYTES,
            new_only=new,
            grep=pattern,
            reader=sp.project.id,
            project_id=sp.project.id,
        )
        notes = _grep_notes(got, pattern, request.tail is not None) if pattern is not None else []
        if new:
            notes += _new_notes(got, grep=pattern is not None)
        if got.dropped_bytes and not new:
            notes.append(
                f"[the log cap dropped the oldest {got.dropped_bytes} bytes of this log; they cannot be read]"
            )
        text = f"SUBPROCESS LOG ({request.which})\npid: {sp.pid}\n---\n{got.text}"
        return "\n".join([text, *notes])

    # ---- input and wait ---------------------------------------------------------------------------------

    @staticmethod
    def read_input(params: Mapping[str, object]) -> tuple[str, bool]:
        """The ``text`` and ``eof`` of an ``input``, read before its pid is looked up."""
        text = check_string(params.get("text", ""), "text")
        eof = check_flag(params.get("eof", False), "eof")
        if not text and not eof:
            raise InvalidArgumentError('cmd=input needs text (e.g. "y\\n"), or eof=true to end the input')
        return text, eof

    async def input(self, sp: SubProcess, text: str, *, eof: bool) -> str:
        """``input``: write ``text`` to the process's stdin (``eof``: then close it)."""
        sent = len(text.encode())
        await write_within(functools.partial(self.service.write_stdin, sp.pid, text, eof=eof), sp.pid)
        lines = ["SUBPROCESS INPUT", f"pid: {sp.pid}", f"sent: {sent} bytes"]
        if eof:
            lines.append("stdin: closed (end of input)")
        return "\n".join(lines)

    @staticmethod
    def read_wait(params: Mapping[str, object]) -> float:
        """The ``timeout`` of a ``wait``, in seconds, read before its pid is looked up."""
        seconds = read_seconds(params.get("timeout", WAIT_DEFAULT_SECONDS), "timeout")
        if seconds > MAX_WAIT_SECONDS:
            raise InvalidArgumentError(
                f"timeout must be at most {MAX_WAIT_SECONDS:g} seconds, got {show(seconds)}; "
                "call wait again to wait longer"
            )
        return seconds

    async def wait(self, sp: SubProcess, seconds: float) -> str:
        """``wait``: until the process exited for good and its leftovers are gone (its logs complete),
        at most ``seconds``."""
        with trio.move_on_after(seconds):
            await sp.wait_drained()
        summary = self.service.summarize(sp)
        lines = ["SUBPROCESS WAIT", f"pid: {sp.pid}", f"status: {summary.status}"]
        if sp.finished and not sp.drained:
            lines.append(
                f"[exited, but what it left running is still running after {seconds:g} s (it gets the grace "
                "period, then SIGINT, another grace period, SIGKILL); call wait again, or read its log]"
            )
        elif not sp.finished:
            lines.append(f"[still running after {seconds:g} s; call wait again, or read its log]")
        return "\n".join(lines)


def _new_notes(got: LogSlice, *, grep: bool) -> list[str]:
    notes: list[str] = []
    if got.skipped_bytes:
        notes.append(
            f"[{got.skipped_bytes} bytes written since your last read are gone (the log cap dropped them, "
            "or the log was truncated); reading went on from the oldest kept byte]"
        )
    unread = got.total_bytes - got.next_offset
    if unread > 0:
        notes.append(f"[{unread} more new bytes not shown yet; call log with new=true again for the rest]")
    elif not got.text and not grep:
        notes.append("[no new output since your last read with new=true]")
    return notes


def _grep_notes(got: LogSlice, pattern: str, tail: bool) -> list[str]:
    notes: list[str] = []
    if not got.text:
        notes.append(f"[no line matches {show(pattern)} in bytes {got.start_offset}-{got.next_offset}]")
    elif got.truncated and tail:
        notes.append("[earlier matching lines left out; use offset=<byte> to page forward from the start]")
    elif got.truncated:
        notes.append(
            f"[more matching lines follow; call log again with the same grep and offset={got.next_offset}]"
        )
    if got.dropped_bytes:
        notes.append(
            f"[line numbers count from the oldest kept line: the log cap dropped the oldest "
            f"{got.dropped_bytes} bytes]"
        )
    return notes
