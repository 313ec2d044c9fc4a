"""What the command line prints: exit codes, JSON lines, tables, times and one-line errors.

Standard library only, like every client command.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence
from typing import Final

from ._errors import EngineError
from ._termtext import escape_controls
from .server._client import RpcError
from .server._protocol import METHOD_NOT_FOUND

__all__ = [
    "EXIT_FAILED",
    "EXIT_NO_ENGINE",
    "EXIT_OK",
    "EXIT_USAGE",
    "CommandFailedError",
    "emit_json",
    "one_line",
    "table",
    "user_message",
]

EXIT_OK: Final = 0
EXIT_FAILED: Final = 1
EXIT_USAGE: Final = 2
EXIT_NO_ENGINE: Final = 3


class CommandFailedError(Exception):
    """Raised by a subcommand for a failure reported on one line with exit code 1."""


def emit_json(values: Iterable[object]) -> None:
    """Print each value as one line of JSON."""
    for value in values:
        sys.stdout.write(json.dumps(value, ensure_ascii=False, separators=(",", ":")) + "\n")


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Print ``rows`` under ``headers`` in columns two spaces apart, control characters escaped."""
    rows = [[escape_controls(cell) for cell in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    for row in (headers, *rows):
        cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=True)]
        sys.stdout.write("  ".join(cells).rstrip() + "\n")


def one_line(message: str) -> str:
    """``message`` with every run of white space, newlines included, as one space."""
    return " ".join(message.split())


def user_message(error: BaseException) -> str:
    """What to tell a person about ``error``, in the CLI's words: no JSON-RPC terms.

    An unknown method means an engine older than this CLI; ``invalid params: `` is left out (the rest
    names the argument and says what to give).
    """
    if isinstance(error, RpcError) and error.code == METHOD_NOT_FOUND:
        return (
            "the running engine does not know this command (it is an older version); "
            "restart it: gadget-engine stop, then gadget-engine start"
        )
    os_error = error if isinstance(error, OSError) and not isinstance(error, EngineError) else None
    if os_error is not None and os_error.strerror and os_error.filename is not None:  # not "[Errno 2] ..."
        return one_line(f"{os_error.filename}: {os_error.strerror.lower()}")
    text = one_line(str(error))
    if isinstance(error, EngineError):  # RpcError's INVALID_PARAMS among them
        text = text.removeprefix("invalid params: ")
    return text or type(error).__name__
