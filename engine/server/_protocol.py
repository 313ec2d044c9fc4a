"""JSON-RPC 2.0 framing of the engine's socket: one JSON value per line, both ways.

A request is one line of UTF-8 JSON ending with ``\\n``; so is every response. This module only uses the
standard library (plus :mod:`engine._errors` and :mod:`engine._input`, themselves standard-library only), so
the synchronous client and a future asyncio client share it with the Trio server.

Error codes: the five standard ones (``-32700`` ... ``-32603``) and, in the range JSON-RPC leaves to
implementations (``-32000`` ... ``-32099``), one code per engine exception type, with the type's name in
``error.data.type``. :func:`error_from_exception` builds an error object on the server;
:func:`exception_from_error` turns it back into the same exception class on the client.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from .._errors import (
    EngineError,
    EngineLockedError,
    InvalidArgumentError,
    InvalidScheduleError,
    JobNotFoundError,
    KillInProgressError,
    LimitExceededError,
    SpawnError,
    StoreError,
    SubProcessNotFoundError,
    UntrustedPathError,
)
from .._input import escape_text, string_problem

__all__ = [
    "APPLICATION_CODES",
    "INTERNAL_ERROR",
    "INVALID_PARAMS",
    "INVALID_REQUEST",
    "MAX_LINE_BYTES",
    "METHOD_NOT_FOUND",
    "PARSE_ERROR",
    "ProtocolError",
    "Request",
    "RpcError",
    "decode_line",
    "encode_error",
    "encode_request",
    "encode_result",
    "error_from_exception",
    "exception_from_error",
    "parse_request",
]

PARSE_ERROR: Final = -32700
INVALID_REQUEST: Final = -32600
METHOD_NOT_FOUND: Final = -32601
INVALID_PARAMS: Final = -32602
INTERNAL_ERROR: Final = -32603

#: The longest request line the server reads, in bytes (the newline excluded). A longer one gets an
#: ``INVALID_REQUEST`` error and its connection is closed.
MAX_LINE_BYTES: Final = 1024 * 1024

#: Engine exception type -> its error code. The most specific class comes first.
APPLICATION_CODES: Final[tuple[tuple[type[EngineError], int], ...]] = (
    (SubProcessNotFoundError, -32001),
    (SpawnError, -32002),
    (LimitExceededError, -32003),
    (JobNotFoundError, -32004),
    (InvalidScheduleError, -32005),
    (StoreError, -32006),
    (EngineLockedError, -32007),
    (InvalidArgumentError, -32008),
    (KillInProgressError, -32009),
    (UntrustedPathError, -32010),
    (EngineError, -32000),
)


class RpcError(EngineError):
    """Raised by the client when the engine answers with an error no engine exception type stands for.

    That is one of the standard JSON-RPC errors (a malformed request, an unknown method, invalid
    parameters, an internal error of the engine).

    Attributes:
        code: the JSON-RPC error code.
        data: the error's ``data`` member, or ``None``.
    """

    def __init__(self, message: str, *, code: int, data: object = None) -> None:
        super().__init__(message)
        self.code = code
        self.data = data


class ProtocolError(Exception):
    """Raised by :func:`parse_request` when a line is not a valid request; carries the error to send back.

    Attributes:
        code: ``PARSE_ERROR`` or ``INVALID_REQUEST``.
        message: what is wrong, one line.
        request_id: the request's id when it could be read, else ``None``.
    """

    def __init__(self, code: int, message: str, request_id: object = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id


@dataclass(frozen=True)
class Request:
    """One parsed request.

    Attributes:
        method: the method name.
        params: the named parameters (an empty dict when the request had none).
        id: the request id (a string, an integer or ``None``).
        notification: ``True`` when the request had no ``id`` member: no response is sent.
    """

    method: str
    params: dict[str, Any]
    id: str | int | None
    notification: bool


def _reject_constant(name: str) -> object:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of range for a JSON number here")
    return value


def decode_line(line: bytes) -> object:
    """The JSON value of one line.

    Raises:
        ValueError: the line is not UTF-8 or not one JSON value (``NaN`` and ``Infinity`` included, and
            numbers too large for a float, such as ``1e400``), or it nests too deeply to be read.
    """
    try:
        return json.loads(line.decode("utf-8"), parse_constant=_reject_constant, parse_float=_finite_float)
    except RecursionError:
        raise ValueError("the JSON nests too deeply") from None


def _valid_id(value: object) -> bool:
    if isinstance(value, str):
        return string_problem(value) is None  # it goes back in the answer, which is UTF-8
    return value is None or (isinstance(value, int) and not isinstance(value, bool))


def parse_request(line: bytes) -> Request:
    """Parse one request line (without its newline).

    Parameters must be given by name (a JSON object); positional parameters and batches are refused.

    Raises:
        ProtocolError: ``PARSE_ERROR`` for a line that is not JSON, ``INVALID_REQUEST`` for JSON that
            is not a request object.
    """
    try:
        value = decode_line(line)
    except ValueError as exc:
        raise ProtocolError(PARSE_ERROR, f"parse error: {exc}") from None
    if isinstance(value, list):
        raise ProtocolError(INVALID_REQUEST, "batch requests are not supported; send one request per line")
    if not isinstance(value, dict):
        raise ProtocolError(INVALID_REQUEST, "a request must be a JSON object")
    request_id = value.get("id")
    if not _valid_id(request_id):
        raise ProtocolError(INVALID_REQUEST, "id must be a string (UTF-8 text), an integer or null")
    if value.get("jsonrpc") != "2.0":
        raise ProtocolError(INVALID_REQUEST, 'jsonrpc must be "2.0"', request_id)
    method = value.get("method")
    if not isinstance(method, str) or not method:
        raise ProtocolError(INVALID_REQUEST, "method must be a non-empty string", request_id)
    params = value.get("params", {})
    if isinstance(params, list):
        raise ProtocolError(INVALID_REQUEST, "params must be given by name (a JSON object)", request_id)
    if not isinstance(params, dict):
        raise ProtocolError(INVALID_REQUEST, "params must be a JSON object", request_id)
    unknown = sorted(set(value) - {"jsonrpc", "method", "params", "id"})
    if unknown:
        raise ProtocolError(INVALID_REQUEST, f"unknown request member(s): {', '.join(unknown)}", request_id)
    return Request(method=method, params=params, id=request_id, notification="id" not in value)


def _escaped(value: object) -> object:
    if isinstance(value, str):
        return escape_text(value)
    if isinstance(value, Mapping):
        return {_escaped(k): _escaped(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_escaped(v) for v in value]
    return value


def _dump(value: Mapping[str, object]) -> bytes:
    """One line of UTF-8 JSON; text that is not UTF-8 (a lone surrogate read back from an old record) is
    sent escaped (``\\udcff``), never a reason to fail the answer."""
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    try:
        return text.encode() + b"\n"
    except UnicodeEncodeError:
        text = json.dumps(_escaped(value), ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        return text.encode() + b"\n"


def encode_request(method: str, params: Mapping[str, object], request_id: int) -> bytes:
    """One request line (newline included)."""
    return _dump({"jsonrpc": "2.0", "method": method, "params": dict(params), "id": request_id})


def encode_result(request_id: str | int | None, result: object) -> bytes:
    """One success response line (newline included).

    Raises:
        ValueError, TypeError: ``result`` is not JSON-serialisable.
    """
    return _dump({"jsonrpc": "2.0", "result": result, "id": request_id})


def encode_error(request_id: object, code: int, message: str, data: object = None) -> bytes:
    """One error response line (newline included); ``data`` is left out when ``None``."""
    error: dict[str, object] = {"code": code, "message": message}
    if data is not None:
        error["data"] = data
    return _dump({"jsonrpc": "2.0", "error": error, "id": request_id if _valid_id(request_id) else None})


def error_from_exception(exc: EngineError) -> tuple[int, str, dict[str, object]]:
    """The ``(code, message, data)`` of an engine exception; ``data["type"]`` names its class."""
    code = next(code for cls, code in APPLICATION_CODES if isinstance(exc, cls))
    data: dict[str, object] = {"type": type(exc).__name__}
    if isinstance(exc, SpawnError):
        data.update(errno=exc.errno, path=exc.filename, reason=exc.reason)
    return code, str(exc), data


def exception_from_error(code: object, message: object, data: object = None) -> EngineError:
    """The exception the client raises for an error response: the engine's own class where one fits.

    An application code gives its engine exception class (``SpawnError`` keeps its ``errno``, path and
    reason); any other code gives :class:`RpcError`.
    """
    text = message if isinstance(message, str) else repr(message)
    extra = data if isinstance(data, dict) else {}
    for cls, known in APPLICATION_CODES:
        if code == known:
            if cls is SpawnError:
                err = extra.get("errno")
                path = extra.get("path")
                reason = extra.get("reason")
                return SpawnError(
                    text,
                    errno=err if isinstance(err, int) else None,
                    path=path if isinstance(path, str) else None,
                    reason=reason if isinstance(reason, str) else "",
                )
            return cls(text)
    return RpcError(text, code=code if isinstance(code, int) else INTERNAL_ERROR, data=data)


def describe_schedule(schedule: Mapping[str, Any], *, show_time: Callable[[object], str] = str) -> str:
    """One phrase for a schedule as it travels (``{"kind": "every", "every_seconds": 60}`` and so on):
    ``every 60 s``, ``cron '0 9 * * 1-5' UTC``, ``on-exit 'pytest -q' in /my/app``.

    Args:
        schedule: the schedule's JSON object.
        show_time: renders the ``at`` time (the CLI shortens it for its tables).
    """
    kind = schedule.get("kind")
    if kind == "at":
        return f"at {show_time(schedule.get('at'))}"
    if kind == "every":
        return f"every {schedule.get('every_seconds'):.15g} s"  # whole seconds in full, never 3.15e+08
    if kind == "cron":
        return f"cron {schedule.get('expr')!r} {schedule.get('tz')}"
    cwd = schedule.get("cwd")
    return f"on-exit {schedule.get('command')!r}" + (f" in {cwd}" if cwd else "")
