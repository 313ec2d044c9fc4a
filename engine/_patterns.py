"""Patterns an agent supplies (``grep``, a readiness ``log_pattern``), run with a bound on their time.

A regular expression from outside can take exponential time on some input (``(a+)+$`` against a long line
of ``a`` and a ``b``). Every such pattern runs in the ``regex`` package, which checks a ``timeout`` while
it matches and lets go of the GIL (``concurrent=True``), in a worker thread: a slow pattern costs one
thread for at most :data:`REGEX_SECONDS`, never the Trio loop, a lock or another project's reads.

Standard library and ``regex`` only; the caller runs :func:`search_lines` in a worker thread.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Final

import regex

from ._errors import EngineError, InvalidArgumentError
from ._input import check_text, show

__all__ = [
    "ANSWER_SECONDS",
    "MAX_PATTERN_CHARS",
    "REGEX_SECONDS",
    "Pattern",
    "PatternTimeoutError",
    "compile_pattern",
    "search_lines",
]

#: The regex time one call (a ``grep`` read, one readiness look) may spend in all, in seconds. The
#: ``regex`` package checks its timeout every so often and overshoots it by a few hundredths of a second.
REGEX_SECONDS: Final = 1.5
#: The longest a ``grep`` read takes to answer, whatever its pattern does, in seconds (the promise is 2 s;
#: the margin covers waking the caller on a busy machine).
ANSWER_SECONDS: Final = 1.9
#: The longest pattern accepted, in characters.
MAX_PATTERN_CHARS: Final = 4096

Pattern = regex.Pattern[str]


class PatternTimeoutError(EngineError, ValueError):
    """Raised by a ``grep`` read when its pattern ran longer than the engine allows on this log."""


def compile_pattern(value: object, field: str) -> Pattern:
    """A regular expression (``regex`` syntax, a superset of Python's ``re``) from an agent.

    Raises:
        InvalidArgumentError: not a non-empty string, too long, or not a valid expression (the message
            says where it is wrong).
    """
    text = check_text(value, field)
    if len(text) > MAX_PATTERN_CHARS:
        raise InvalidArgumentError(
            f"{field} is {len(text)} characters long; give a pattern of at most {MAX_PATTERN_CHARS}"
        )
    try:
        return regex.compile(text, regex.MULTILINE)
    except (regex.error, ValueError, OverflowError, RecursionError) as exc:
        raise InvalidArgumentError(
            f"{field} {show(text)} is not a valid regular expression: {exc}; escape special "
            "characters with a backslash, e.g. 'Error\\(' for a literal 'Error('"
        ) from None


def timed_out(field: str, seconds: float) -> PatternTimeoutError:
    """The error of a pattern that ran out of time."""
    return PatternTimeoutError(
        f"{field} took longer than {seconds:g} s on this log and was stopped; simplify it: avoid nested "
        "repetition such as (a+)+ and use a literal word or an anchored pattern"
    )


def search_lines(pattern: Pattern, text: str, deadline: float) -> Iterator[tuple[int, int]]:
    """The lines of ``text`` that ``pattern`` matches: ``(line start, line end)`` positions in ``text``
    (the end without its ``\\n``), each line once, in order.

    Args:
        deadline: a ``time.monotonic()`` time; the matching stops there.

    Raises:
        TimeoutError: the deadline passed (the ``regex`` package's own timeout).
    """
    pos = 0
    while pos <= len(text):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("pattern timed out")
        found = pattern.search(text, pos, timeout=remaining, concurrent=True)
        if found is None or (found.start() == len(text) and (not text or text.endswith("\n"))):
            return  # nothing more, or only the empty "line" after a final newline
        start = text.rfind("\n", 0, found.start()) + 1
        end = text.find("\n", max(found.start(), start))
        if end < 0:
            end = len(text)
        yield start, end
        pos = end + 1
