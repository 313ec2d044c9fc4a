"""The one reader of loose input: JSON-ish values from an agent, the socket, MCP or the command line.

Every edge of the engine (the ``subprocess`` tool, the RPC methods, the MCP tools, the CLI) reads its
arguments here once and passes typed values down; the library's public functions
(``SubProcessService.create``, ``read_log``, ``CronService.add``, ``Project`` ...) check theirs with the
same functions. Two families:

- ``check_*`` take a value that should already have its type and return it checked (``check_int``,
  ``check_text``, ``check_strings``, ``check_env``, ``check_flag``, ``check_argv``, ``check_read_args``).
- ``read_*`` convert what JSON can carry into the engine's types: a whole number from ``3.0``, seconds as
  a float, an aware datetime from ISO 8601, a :class:`~engine.Project` from a directory, and the wire forms
  of schedules and payloads (``{"kind": "every", "every_seconds": 60}``) into the cron value classes,
  which check their own fields when they are made (raising ``InvalidScheduleError``).

The rules, everywhere:

- A whole number is an ``int`` (JSON ``3.0`` reads as 3, ``true`` never counts) between its minimum and
  :data:`MAX_INT` (2**53, the largest integer JSON carries exactly).
- A number of seconds is finite; a number too large for a float is refused, not overflowed.
- Every string, wherever it sits (an argument, a list item, a map's key or value, a nested object), must be
  text the engine can store in SQLite and send back in a UTF-8 JSON answer: no NUL, no lone surrogate
  (``"\\udce9"`` is what ``os.fsdecode`` makes of a byte that is not UTF-8).

Errors are :class:`~engine.InvalidArgumentError`: the message names the field (``args[1]``, ``env['A']``,
``schedule.every_seconds``) and says what to send instead; a value is shown shortened.

Only the standard library is imported here, as the CLI's client commands use this module; the project and
cron classes are imported by the functions that build them (the cron package loads Trio).
"""

from __future__ import annotations

import math
import os
import reprlib
from collections.abc import Callable, Collection, Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Final, Literal

from ._errors import InvalidArgumentError

if TYPE_CHECKING:
    from ._project import Project
    from ._readiness import ReadyCheck
    from ._restart import RestartPolicy
    from .cron._job import Payload
    from .cron._schedule import Schedule

__all__ = [
    "MAX_ARG_BYTES",
    "MAX_INT",
    "MAX_WAIT_SECONDS",
    "STREAMS",
    "Stream",
    "check_argument",
    "check_argv",
    "check_env",
    "check_flag",
    "check_int",
    "check_json",
    "check_optional_text",
    "check_read_args",
    "check_reader",
    "check_string",
    "check_strings",
    "check_text",
    "escape_text",
    "read_directory",
    "read_fields",
    "read_moment",
    "read_payload",
    "read_project",
    "read_ready",
    "read_restart",
    "read_schedule",
    "read_seconds",
    "read_stream",
    "read_whole",
    "required",
    "show",
    "string_problem",
]

#: The largest whole number read anywhere: 2**53, the largest integer a JSON number carries exactly.
MAX_INT: Final = 2**53
#: The longest wait an agent may ask for (the tool's ``wait``, a readiness timeout), in seconds.
MAX_WAIT_SECONDS: Final = 300.0
#: The longest single argument Linux passes to a program (``MAX_ARG_STRLEN``, the NUL excluded), in bytes.
MAX_ARG_BYTES: Final = 128 * 1024 - 1

Stream = Literal["stdout", "stderr"]
STREAMS: Final[tuple[Stream, Stream]] = ("stdout", "stderr")

_SCHEDULE_FIELDS: Final[Mapping[str, tuple[str, ...]]] = {
    "at": ("at",),
    "every": ("every_seconds", "anchor"),
    "cron": ("expr", "tz"),
    "on_exit": ("command", "cwd"),
}
_PAYLOAD_FIELDS: Final[Mapping[str, tuple[str, ...]]] = {
    "system_event": ("text",),
    "command": ("argv", "cwd"),
}


class _Shown(reprlib.Repr):
    """``repr`` cut to a readable size; integers too long to print are described."""

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 128:
            return f"a {math.floor(x.bit_length() * math.log10(2)) + 1}-digit number"
        return repr(x)


_SHOWN = _Shown()
_SHOWN.maxstring = _SHOWN.maxother = 60
_SHOWN.maxlist = _SHOWN.maxtuple = _SHOWN.maxdict = 5
_SHOWN.maxlevel = 3


def show(value: object) -> str:
    """``repr(value)`` cut to about 60 characters, for error messages (never the whole of a huge value)."""
    return _SHOWN.repr(value)


# ---- strings ------------------------------------------------------------------------------------------


def string_problem(text: str) -> str | None:
    """What makes ``text`` unfit to store and send back (a NUL, a lone surrogate), or ``None``."""
    if "\0" in text:
        return "holds a NUL character"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        char = f"U+{ord(text[exc.start]):04X}"
        return f"holds the lone surrogate {char}, which is not text (a name that is not UTF-8?)"
    return None


def escape_text(text: str) -> str:
    """``text`` with what :func:`string_problem` finds shown as escapes: a lone surrogate as ``\\udcff``,
    NUL as ``\\x00``. For a value read back from disk that the engine never let in (an older engine's
    record, a file planted in the store): shown, never refused, so it cannot stop a listing."""
    if string_problem(text) is None:
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8").replace("\0", "\\x00")


def check_string(value: object, field: str) -> str:
    """``value`` if it is a string without NUL or lone surrogates (it may be empty)."""
    if not isinstance(value, str):
        raise InvalidArgumentError(f"{field} must be a string, got {show(value)}")
    problem = string_problem(value)
    if problem is not None:
        raise InvalidArgumentError(f"{field} {problem}; send UTF-8 text without NUL characters")
    return value


def check_text(value: object, field: str) -> str:
    """``value`` if it is a string with something besides white space, fit to store and send back."""
    if not isinstance(value, str) or not value.strip():
        raise InvalidArgumentError(f"{field} must be a non-empty string, got {show(value)}")
    return check_string(value, field)


def check_optional_text(value: object, field: str) -> str | None:
    """``None``, or :func:`check_text` of ``value``."""
    return None if value is None else check_text(value, field)


def check_argument(
    value: object, field: str, *, max_bytes: int = MAX_ARG_BYTES, what: str = "one argument"
) -> str:
    """:func:`check_string`, and short enough for one argument of a program (:data:`MAX_ARG_BYTES`), or
    for ``max_bytes`` of it (``what`` then says what holds them, in the error)."""
    text = check_string(value, field)
    if len(text) > max_bytes // 4 and len(text.encode()) > max_bytes:
        raise InvalidArgumentError(
            f"{field} is {len(text.encode())} bytes long; {what} holds at most {max_bytes}"
        )
    return text


def check_strings(
    value: object,
    field: str,
    *,
    non_empty: bool = False,
    item: Callable[[object, str], str] = check_string,
) -> tuple[str, ...]:
    """A list (any sequence but a string) of strings, each checked with ``item`` (:func:`check_string`)."""
    if isinstance(value, str | bytes | bytearray) or not isinstance(value, Sequence):
        raise InvalidArgumentError(f"{field} must be an array of strings, got {show(value)}")
    items = tuple(item(element, f"{field}[{i}]") for i, element in enumerate(value))
    if non_empty and not items:
        raise InvalidArgumentError(f"{field} must be a non-empty array of strings")
    return items


def check_env(value: object, field: str = "env") -> dict[str, str]:
    """Environment variables: names without ``=`` mapped to strings, all fit to store and pass on."""
    if not isinstance(value, Mapping):
        raise InvalidArgumentError(
            f"{field} must be an object of variable names to strings, got {show(value)}"
        )
    out: dict[str, str] = {}
    for key, item in value.items():
        if not isinstance(key, str) or not key or "=" in key:
            raise InvalidArgumentError(
                f"{field} names must be non-empty strings without '=', got {show(key)}"
            )
        check_string(key, f"{field} name {show(key)}")
        out[key] = check_string(item, f"{field}[{show(key)}]")
    return out


def check_json(value: object, field: str) -> None:
    """Check every string in a JSON-ish value (object keys included), however deep it sits."""
    stack: list[tuple[object, str]] = [(value, field)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            check_string(item, where)
        elif isinstance(item, Mapping):
            for key, inner in item.items():
                name = check_string(key, f"{where} key {show(key)}") if isinstance(key, str) else show(key)
                stack.append((inner, f"{where}.{name}"))
        elif isinstance(item, list | tuple):
            stack.extend((inner, f"{where}[{i}]") for i, inner in enumerate(item))


def check_argv(cmd: object, args: object) -> tuple[str, ...]:
    """The argv ``(cmd, *args)`` of a program to start: a named program, then any strings."""
    program = check_argument(check_text(cmd, "cmd"), "cmd")
    return (program, *check_strings(args, "args", item=check_argument))


# ---- numbers, flags, names -------------------------------------------------------------------------


def check_int(value: object, field: str, minimum: int = 0) -> int:
    """``value`` if it is an ``int`` (not a ``bool``) from ``minimum`` to :data:`MAX_INT`."""
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= MAX_INT:
        raise InvalidArgumentError(
            f"{field} must be a whole number from {minimum} to {MAX_INT}, got {show(value)}"
        )
    return value


def read_whole(value: object, field: str, minimum: int = 0) -> int:
    """A whole number as JSON carries it: :func:`check_int`, where ``3.0`` counts as 3."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    return check_int(value, field, minimum)


def read_seconds(
    value: object, field: str, *, minimum: float | None = 0.0, maximum: float | None = None
) -> float:
    """A finite number of seconds as a float, ``>= minimum`` (unless ``None``) and ``<= maximum``."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidArgumentError(f"{field} must be a number of seconds, got {show(value)}")
    try:
        seconds = float(value)
    except OverflowError:
        seconds = math.inf
    if not math.isfinite(seconds) or (minimum is not None and seconds < minimum):
        floor = "" if minimum is None else f" >= {minimum:g}"
        raise InvalidArgumentError(f"{field} must be a finite number of seconds{floor}, got {show(value)}")
    if maximum is not None and seconds > maximum:
        raise InvalidArgumentError(f"{field} must be at most {maximum:g} seconds, got {show(value)}")
    return seconds


def check_flag(value: object, field: str) -> bool:
    """``value`` if it is ``True`` or ``False``."""
    if not isinstance(value, bool):
        raise InvalidArgumentError(f"{field} must be true or false, got {show(value)}")
    return value


def read_stream(value: object, field: str = "stream") -> Stream:
    """The name of a log stream: ``"stdout"`` or ``"stderr"``."""
    if value == "stdout" or value == "stderr":
        return value
    raise InvalidArgumentError(f'{field} must be "stdout" or "stderr", got {show(value)}')


def check_read_args(offset: object, limit: object, tail: object, max_bytes: object) -> None:
    """The numbers of a log read: ``offset >= 0``, ``limit``, ``tail`` and ``max_bytes >= 1``.

    ``offset``, ``limit`` and ``tail`` may be ``None``; ``tail`` goes alone.
    """
    for name, value, minimum in (("offset", offset, 0), ("limit", limit, 1), ("tail", tail, 1)):
        if value is not None:
            check_int(value, name, minimum)
    check_int(max_bytes, "max_bytes", 1)
    if tail is not None and (offset is not None or limit is not None):
        raise InvalidArgumentError("give tail alone, or offset and/or limit, not both")


def check_reader(value: object, field: str = "reader") -> str:
    """The name of a ``new_only`` log reader: a non-empty string of at most 200 characters."""
    text = check_text(value, field)
    if len(text) > 200:
        raise InvalidArgumentError(f"{field} must be at most 200 characters long, got {len(text)}")
    return text


def read_moment(value: object, field: str) -> datetime:
    """An aware datetime from an ISO 8601 string with a UTC offset (``2030-01-31T09:00+01:00``)."""
    text = check_text(value, field)
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise InvalidArgumentError(
            f"{field} must be an ISO 8601 date and time with a UTC offset, got {show(text)}"
        ) from None
    if moment.tzinfo is None or moment.utcoffset() is None:
        raise InvalidArgumentError(f"{field} needs a UTC offset, e.g. {show(text + '+00:00')}")
    return moment


def read_directory(value: object, field: str) -> str:
    """An absolute directory path (not checked for existence)."""
    path = check_text(value, field)
    if not os.path.isabs(path):
        raise InvalidArgumentError(f"{field} must be an absolute directory path, got {show(path)}")
    return path


def read_project(value: object, field: str = "project") -> Project:
    """The :class:`~engine.Project` of an existing directory, given by its absolute path."""
    from ._project import Project  # attrs: not for the CLI's client commands

    path = read_directory(value, field)
    try:
        return Project.from_directory(path)
    except ValueError as exc:  # its message names the project directory already
        raise InvalidArgumentError(str(exc)) from None


# ---- objects: parameters, schedules, payloads --------------------------------------------------------


def read_fields(
    value: object, field: str, allowed: Collection[str], *, what: str = "field"
) -> dict[str, object]:
    """The members of a JSON object whose names are all in ``allowed``; ``null`` members are left out.

    Args:
        value: the object (any mapping).
        field: what it is, for messages (``"schedule"``, an RPC method's name).
        allowed: the member names it may have.
        what: what a member is called in messages (``"parameter"``, ``"argument"``).
    """
    if not isinstance(value, Mapping):
        raise InvalidArgumentError(f"{field} must be a JSON object, got {show(value)}")
    unknown = sorted(show(key) for key in value if key not in allowed)
    if unknown:
        raise InvalidArgumentError(
            f"{field}: unknown {what}(s) {', '.join(unknown)}; allowed: {', '.join(allowed) or 'none'}"
        )
    return {key: item for key, item in value.items() if item is not None}


def required(fields: Mapping[str, object], name: str, field: str) -> object:
    """``fields[name]``; a missing or ``null`` one is an error naming ``field``."""
    value = fields.get(name)
    if value is None:
        raise InvalidArgumentError(f"missing {field}")
    return value


def _kind(value: object, field: str, kinds: Mapping[str, tuple[str, ...]]) -> tuple[str, dict[str, object]]:
    """The ``kind`` of a wire object and its members, checked against that kind's member names."""
    if not isinstance(value, Mapping):
        raise InvalidArgumentError(f"{field} must be a JSON object with a kind, got {show(value)}")
    kind = required(value, "kind", f"{field}.kind")
    if not isinstance(kind, str) or kind not in kinds:
        raise InvalidArgumentError(f"{field}.kind must be one of {', '.join(kinds)}, got {show(kind)}")
    return kind, read_fields(value, f"{field} of kind {kind}", ("kind", *kinds[kind]))


def read_schedule(value: object, field: str = "schedule") -> Schedule:
    """A schedule from its wire form (``{"kind": "at"|"every"|"cron"|"on_exit", ...}``, as ``to_dict``).

    Raises:
        InvalidArgumentError: not an object of a known kind, a missing or unknown member, a time that is
            not ISO 8601 with an offset, an ``every_seconds`` that is no finite number.
        InvalidScheduleError: the schedule class refused a field (a bad expression, zone or interval).
    """
    from .cron._schedule import At, Cron, Every, OnExit  # the cron package loads Trio

    kind, fields = _kind(value, field, _SCHEDULE_FIELDS)
    if kind == "at":
        return At(at=read_moment(required(fields, "at", f"{field}.at"), f"{field}.at"))
    if kind == "every":
        every = required(fields, "every_seconds", f"{field}.every_seconds")
        anchor = fields.get("anchor")
        return Every(
            every_seconds=read_seconds(every, f"{field}.every_seconds", minimum=None),
            anchor=None if anchor is None else read_moment(anchor, f"{field}.anchor"),
        )
    if kind == "cron":
        expr = required(fields, "expr", f"{field}.expr")
        return Cron(expr=expr, tz=fields.get("tz", "UTC"))  # type: ignore[arg-type]  # Cron checks them
    command = required(fields, "command", f"{field}.command")
    return OnExit(command=command, cwd=fields.get("cwd"))  # type: ignore[arg-type]  # OnExit checks them


def read_payload(value: object, field: str = "payload") -> Payload:
    """A payload from its wire form (``{"kind": "system_event"|"command", ...}``, as ``to_dict``).

    Raises:
        InvalidArgumentError: not an object of a known kind, a missing or unknown member.
        InvalidScheduleError: the payload class refused a field (an empty text or argv).
    """
    from .cron._job import Command, SystemEvent  # the cron package loads Trio

    kind, fields = _kind(value, field, _PAYLOAD_FIELDS)
    if kind == "system_event":
        return SystemEvent(text=required(fields, "text", f"{field}.text"))  # type: ignore[arg-type]
    argv = required(fields, "argv", f"{field}.argv")
    return Command(argv=argv, cwd=fields.get("cwd"))  # type: ignore[arg-type]  # Command checks them


def read_ready(value: object, field: str = "ready") -> ReadyCheck:
    """A readiness check from its wire form ``{"log": regex, "port": n, "timeout": s}`` (``log`` or
    ``port`` or both; ``timeout`` in seconds, default 30, at most 300).

    Raises:
        InvalidArgumentError: not an object, an unknown member, neither ``log`` nor ``port``, a pattern
            that does not compile, a port out of range, a timeout that is no number in range.
    """
    from ._readiness import ReadyCheck  # attrs, trio: not for the CLI's client commands

    fields = read_fields(value, field, ("log", "port", "timeout"), what="member")
    if "log" not in fields and "port" not in fields:
        raise InvalidArgumentError(
            f'{field} needs "log" (a regular expression) or "port" (a TCP port), e.g. {{"port": 8000}}'
        )
    pattern = None if "log" not in fields else check_text(fields["log"], f"{field}.log")
    port = None if "port" not in fields else read_whole(fields["port"], f"{field}.port", 1)
    if port is not None and port > 65535:
        raise InvalidArgumentError(f"{field}.port must be a TCP port from 1 to 65535, got {port}")
    timeout = read_seconds(fields.get("timeout", 30.0), f"{field}.timeout")
    if not 0 < timeout <= MAX_WAIT_SECONDS:
        raise InvalidArgumentError(
            f"{field}.timeout must be more than 0 and at most {MAX_WAIT_SECONDS} seconds, got {show(timeout)}"
        )
    try:
        return ReadyCheck(log_pattern=pattern, port=port, timeout_seconds=timeout)
    except ValueError as exc:
        raise InvalidArgumentError(f"{field}: {exc}") from None


def read_restart(value: object, field: str = "restart") -> RestartPolicy:
    """A restart policy from its wire form ``{"mode": "on-failure", "max_restarts": 5, "window": 60,
    "backoff": 1}`` (only ``mode`` is needed), or a mode alone (``"always"``).

    Raises:
        InvalidArgumentError: not an object or a mode, an unknown member, a value out of range.
    """
    from ._restart import RESTART_MODES, RestartPolicy  # attrs: not for the CLI's client commands

    if isinstance(value, str):
        value = {"mode": value}
    fields = read_fields(value, field, ("mode", "max_restarts", "window", "backoff"), what="member")
    mode = required(fields, "mode", f"{field}.mode")
    if mode not in RESTART_MODES:
        raise InvalidArgumentError(
            f"{field}.mode must be one of {', '.join(RESTART_MODES)}, got {show(mode)}"
        )
    try:
        return RestartPolicy(
            mode=str(mode),
            max_restarts=read_whole(fields.get("max_restarts", 5), f"{field}.max_restarts"),
            window_seconds=read_seconds(fields.get("window", 60.0), f"{field}.window"),
            backoff_seconds=read_seconds(fields.get("backoff", 1.0), f"{field}.backoff"),
        )
    except ValueError as exc:
        raise InvalidArgumentError(f"{field}: {exc}") from None
