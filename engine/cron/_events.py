"""Fired events: what one fire of a job tells the agent, and how a pending fire is built.

A fire goes through two states. First a *pending fire*: a JSON-able ``dict`` with every
:class:`FiredEvent` field except ``cursor`` and ``job_id``, committed on the job's row (``pending_fire``).
Then, delivered, a :class:`FiredEvent` in the event log with its cursor. The ``fire_id`` stays the same
from one to the other, so a delivery repeated after a crash is recognised.
"""

from __future__ import annotations

import os
import secrets
import signal as _signal
from collections.abc import Mapping
from typing import Any

import attrs

__all__ = [
    "PENDING_FIRE_FIELDS",
    "FiredEvent",
    "exit_fire",
    "format_exit_text",
    "new_fire_id",
    "read_tail",
    "text_fire",
]

#: The keys of a pending fire, in the order of :class:`FiredEvent`.
PENDING_FIRE_FIELDS = (
    "fire_id",
    "job_name",
    "text",
    "command",
    "exit_code",
    "signal",
    "reason",
    "duration_seconds",
    "stdout_tail",
    "stderr_tail",
    "truncated",
)

#: Default tail of each stream in a fired event.
TAIL_LINES = 50
TAIL_BYTES = 4096


@attrs.frozen
class FiredEvent:
    """One fire of a job, as kept in the event log.

    Attributes:
        cursor: position in the event log; increases with every event (``events(since=cursor)``).
        fire_id: unique id of this fire; a fire delivered again after a crash keeps it.
        job_id: the job that fired.
        job_name: its name at the time.
        text: what the agent is told.
        command: the command that ran (``Command`` payloads, on-exit jobs), else ``None``.
        exit_code: the command's exit code, or ``None``.
        signal: the number of the signal that ended the command, or ``None``.
        reason: why the command ended (``"exit"``, ``"signal"``, ``"cancelled"``, ``"spawn_failed"``...).
        duration_seconds: how long the command ran, in seconds, or ``None``.
        stdout_tail: the last lines of its stdout (empty without a command).
        stderr_tail: the last lines of its stderr.
        truncated: whether either tail was cut.
    """

    cursor: int
    fire_id: str
    job_id: str
    job_name: str
    text: str
    command: str | None = None
    exit_code: int | None = None
    signal: int | None = None
    reason: str | None = None
    duration_seconds: float | None = None
    stdout_tail: str = ""
    stderr_tail: str = ""
    truncated: bool = False

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict of every field."""
        return attrs.asdict(self)

    @classmethod
    def from_fields(cls, cursor: int, job_id: str, fields: Mapping[str, Any]) -> FiredEvent:
        """An event from a pending fire's fields plus its place in the log.

        Raises:
            ValueError: a field is missing or of the wrong type.
        """
        try:
            event = cls(cursor=cursor, job_id=job_id, **{k: fields[k] for k in PENDING_FIRE_FIELDS})
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a valid fire: {exc!r}") from exc
        if not isinstance(event.fire_id, str) or not event.fire_id or not isinstance(event.text, str):
            raise ValueError("a fire needs a fire_id and a text")
        return event


def new_fire_id() -> str:
    """A fresh, unique fire id."""
    return secrets.token_hex(12)


def text_fire(job_name: str, text: str, *, fire_id: str | None = None) -> dict[str, Any]:
    """The pending fire of a job that only delivers ``text`` (a ``SystemEvent``)."""
    return {
        "fire_id": fire_id or new_fire_id(),
        "job_name": job_name,
        "text": text,
        "command": None,
        "exit_code": None,
        "signal": None,
        "reason": None,
        "duration_seconds": None,
        "stdout_tail": "",
        "stderr_tail": "",
        "truncated": False,
    }


def read_tail(
    path: str | None, *, max_lines: int = TAIL_LINES, max_bytes: int = TAIL_BYTES
) -> tuple[str, int]:
    """The last ``max_lines`` lines of a log file, at most ``max_bytes`` bytes, and how many bytes were cut.

    Invalid UTF-8 is replaced. A missing file reads as empty.
    """
    if path is None:
        return "", 0
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            start = max(0, size - max_bytes)
            f.seek(start)
            data = f.read(max_bytes)
    except OSError:
        return "", 0
    if start > 0:  # a partial first line: drop it
        newline = data.find(b"\n")
        data = data[newline + 1 :] if newline >= 0 else data
    lines = data.splitlines(keepends=True)
    if len(lines) > max_lines:
        lines = lines[-max_lines:]
    kept = b"".join(lines)
    return kept.decode("utf-8", errors="replace"), size - len(kept)


def format_exit_text(
    *,
    command: str,
    exit_code: int | None,
    signal: int | None,
    reason: str,
    duration_seconds: float | None,
    stdout_tail: str,
    stderr_tail: str,
    stdout_cut_bytes: int = 0,
    stderr_cut_bytes: int = 0,
    intro: str | None = None,
) -> str:
    """The text an agent is told when a command ended: command, outcome, duration, the last lines."""
    if signal is not None:
        try:
            name = f" ({_signal.Signals(signal).name})"
        except ValueError:
            name = ""
        outcome = f"was killed by signal {signal}{name}"
    elif exit_code is not None:
        outcome = f"exited with code {exit_code}"
    else:
        outcome = "did not run to an exit"
    took = "" if duration_seconds is None else f" after {duration_seconds:.1f} s"
    parts = [intro] if intro else []
    parts.append(f"Command {command!r} {outcome}{took} (reason: {reason}).")
    for label, tail, cut in (
        ("stdout", stdout_tail, stdout_cut_bytes),
        ("stderr", stderr_tail, stderr_cut_bytes),
    ):
        if not tail:
            parts.append(f"--- {label}: empty ---")
            continue
        note = f", {cut} earlier bytes not shown" if cut else ""
        parts.append(f"--- {label} (last lines{note}) ---\n{tail.rstrip(chr(10))}")
    return "\n".join(parts)


def exit_fire(
    job_name: str,
    *,
    command: str,
    exit_code: int | None,
    signal: int | None,
    reason: str,
    duration_seconds: float | None,
    stdout_path: str | None,
    stderr_path: str | None,
    intro: str | None = None,
    fire_id: str | None = None,
    max_lines: int = TAIL_LINES,
    max_bytes: int = TAIL_BYTES,
) -> dict[str, Any]:
    """The pending fire of a command that ended, with the tails of its logs (``Command``, on-exit).

    Args:
        job_name: the job's name.
        command: the command as shown to the agent.
        exit_code: its exit code, or ``None``.
        signal: the signal that ended it, or ``None``.
        reason: why it ended (e.g. ``TerminationReason.value``, or ``"spawn_failed"``).
        duration_seconds: how long it ran.
        stdout_path: its stdout log (``None``: no output).
        stderr_path: its stderr log.
        intro: a first line of the text (e.g. the payload's own text).
        fire_id: the fire id (``None``: a fresh one).
        max_lines: lines kept of each stream.
        max_bytes: bytes kept of each stream.
    """
    out, out_cut = read_tail(stdout_path, max_lines=max_lines, max_bytes=max_bytes)
    err, err_cut = read_tail(stderr_path, max_lines=max_lines, max_bytes=max_bytes)
    text = format_exit_text(
        command=command,
        exit_code=exit_code,
        signal=signal,
        reason=reason,
        duration_seconds=duration_seconds,
        stdout_tail=out,
        stderr_tail=err,
        stdout_cut_bytes=out_cut,
        stderr_cut_bytes=err_cut,
        intro=intro,
    )
    return {
        "fire_id": fire_id or new_fire_id(),
        "job_name": job_name,
        "text": text,
        "command": command,
        "exit_code": exit_code,
        "signal": signal,
        "reason": reason,
        "duration_seconds": duration_seconds,
        "stdout_tail": out,
        "stderr_tail": err,
        "truncated": bool(out_cut or err_cut),
    }
