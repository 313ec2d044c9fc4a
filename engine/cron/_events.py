"""Fired events: what one fire of a job tells the agent, and the pending fire it is made from.

A fire goes through two states. First a :class:`PendingFire`: every field of the event but its place in
the log, committed on the job's row (``pending_fire``). Then, recorded, a :class:`FiredEvent`: the same
fields plus ``cursor`` and ``job_id``. The ``fire_id`` stays the same from one to the other, so a delivery
repeated after a crash is recognised.
"""

from __future__ import annotations

import os
import secrets
import signal as _signal
from collections.abc import Mapping
from typing import Any, NamedTuple

import attrs

from .._errors import UntrustedPathError
from .._trust import open_own_file

__all__ = [
    "PENDING_FIRE_FIELDS",
    "FiredEvent",
    "PendingFire",
    "Tail",
    "describe_outcome",
    "exit_fire",
    "format_exit_text",
    "new_fire_id",
    "read_tail",
    "text_fire",
]

#: Default tail of each stream in a fired event.
TAIL_LINES = 50
TAIL_BYTES = 4096


def _non_empty(_inst: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not value:
        raise ValueError(f"{attribute.name} must be a non-empty string")


def _optional_float(value: object) -> object:
    """Whole-number durations (from JSON) as floats; anything else is left to the validator."""
    return float(value) if isinstance(value, int) and not isinstance(value, bool) else value


def _optional_int(_inst: object, attribute: attrs.Attribute[int | None], value: object) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise TypeError(f"{attribute.name} must be an integer or None, got {value!r}")


_str = attrs.validators.instance_of(str)
_optional_str = attrs.validators.optional(_str)


@attrs.frozen
class PendingFire:
    """A fire committed on its job's row and not yet in the event log: every field of a
    :class:`FiredEvent` but ``cursor`` and ``job_id``.

    Attributes:
        fire_id: unique id of this fire; a fire delivered again after a crash keeps it.
        job_name: the job's name at the time.
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

    fire_id: str = attrs.field(validator=[_str, _non_empty])
    job_name: str = attrs.field(validator=_str)
    text: str = attrs.field(validator=_str)
    command: str | None = attrs.field(default=None, validator=_optional_str)
    exit_code: int | None = attrs.field(default=None, validator=_optional_int)
    signal: int | None = attrs.field(default=None, validator=_optional_int)
    reason: str | None = attrs.field(default=None, validator=_optional_str)
    duration_seconds: float | None = attrs.field(
        default=None,
        converter=_optional_float,
        validator=attrs.validators.optional(attrs.validators.instance_of(float)),
    )
    stdout_tail: str = attrs.field(default="", validator=_str)
    stderr_tail: str = attrs.field(default="", validator=_str)
    truncated: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))

    def to_dict(self) -> dict[str, Any]:
        """The JSON form the store keeps (every field, in order)."""
        return {name: getattr(self, name) for name in PENDING_FIRE_FIELDS}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PendingFire:
        """A pending fire from :meth:`to_dict`'s form (other keys are ignored).

        Raises:
            ValueError: a field is missing or invalid.
        """
        try:
            return cls(**{name: data[name] for name in PENDING_FIRE_FIELDS})
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a valid fire: {exc}") from exc


#: The fields of a pending fire, in order (also the event log's columns after ``cursor, job_id``).
PENDING_FIRE_FIELDS: tuple[str, ...] = tuple(field.name for field in attrs.fields(PendingFire))


@attrs.frozen
class FiredEvent(PendingFire):
    """One fire of a job, as kept in the event log: a recorded :class:`PendingFire` and its place.

    Attributes:
        cursor: position in the event log; increases with every event (``events(since=cursor)``).
        job_id: the job that fired.
        project: the project id of that job (``CronJob.project``), or ``None``.

    The other attributes are those of :class:`PendingFire`.
    """

    cursor: int = attrs.field(kw_only=True, validator=attrs.validators.instance_of(int))
    job_id: str = attrs.field(kw_only=True, validator=_str)
    project: str | None = attrs.field(kw_only=True, default=None, validator=_optional_str)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict of every field: ``cursor``, ``fire_id``, ``job_id``, then the rest, ``project``
        last."""
        fields = super().to_dict()
        return {
            "cursor": self.cursor,
            "fire_id": fields.pop("fire_id"),
            "job_id": self.job_id,
            **fields,
            "project": self.project,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FiredEvent:
        """An event from :meth:`to_dict`'s form.

        Raises:
            ValueError: a field is missing or invalid.
        """
        fire = PendingFire.from_dict(data)
        try:
            return cls.from_pending(
                fire, cursor=data["cursor"], job_id=data["job_id"], project=data.get("project")
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a valid event: {exc}") from exc

    @classmethod
    def from_pending(
        cls, fire: PendingFire, *, cursor: int, job_id: str, project: str | None = None
    ) -> FiredEvent:
        """The event of ``fire``, recorded at ``cursor`` for ``job_id`` of ``project``."""
        return cls(
            cursor=cursor,
            job_id=job_id,
            project=project,
            **{name: getattr(fire, name) for name in PENDING_FIRE_FIELDS},
        )

    @classmethod
    def logged(cls, row: tuple[object, ...], *, cursor: int) -> FiredEvent:
        """The event a store just appended at ``cursor`` from ``row``: ``job_id``, ``project``, then the
        fields of a :class:`PendingFire`, each checked already (the fire's when it was made, the job's
        when it was read), so not checked again: a burst's claim makes a thousand of these.
        """
        event: FiredEvent = object.__new__(cls)
        put = object.__setattr__  # what the frozen class's own __init__ does
        put(event, "cursor", cursor)
        put(event, "job_id", row[0])
        put(event, "project", row[1])
        for name, value in zip(PENDING_FIRE_FIELDS, row[2:], strict=True):
            put(event, name, value)
        return event

    def pending(self) -> PendingFire:
        """The pending fire this event recorded."""
        return PendingFire(**{name: getattr(self, name) for name in PENDING_FIRE_FIELDS})


def new_fire_id() -> str:
    """A fresh, unique fire id."""
    return secrets.token_hex(12)


def text_fire(job_name: str, text: str, *, fire_id: str | None = None) -> PendingFire:
    """The pending fire of a job that only delivers ``text`` (a ``SystemEvent``)."""
    return PendingFire(fire_id=fire_id or new_fire_id(), job_name=job_name, text=text)


class Tail(NamedTuple):
    """The end of a log file, as an exit's text shows it.

    Attributes:
        text: the last lines (invalid UTF-8 replaced).
        cut_bytes: how many earlier bytes are not shown.
        problem: why the file was not read although something is at its path (a link, a FIFO: never
            followed, never waited on), or ``None``.
    """

    text: str
    cut_bytes: int
    problem: str | None = None


def read_tail(path: str | None, *, max_lines: int = TAIL_LINES, max_bytes: int = TAIL_BYTES) -> Tail:
    """The last ``max_lines`` lines of a log file in a folder of the state directory, at most ``max_bytes``
    bytes (blocking: run it in a worker thread).

    The file and its folder are opened without following a link, and a FIFO is not waited on
    (:func:`~engine._trust.open_own_file`): anything but the engine's own regular file is not read, and
    the tail says why. A missing file reads as empty.
    """
    if path is None:
        return Tail("", 0)
    try:
        fd = open_own_file(path, os.O_RDONLY, what="the log", folder_too=True)
    except FileNotFoundError:
        return Tail("", 0)
    except UntrustedPathError as exc:
        return Tail("", 0, str(exc))
    except OSError as exc:
        return Tail("", 0, f"the log {path} cannot be read: {exc.strerror or exc}")
    with os.fdopen(fd, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        start = max(0, size - max_bytes)
        f.seek(start)
        data = f.read(max_bytes)
    if start > 0:  # a partial first line: drop it
        newline = data.find(b"\n")
        data = data[newline + 1 :] if newline >= 0 else data
    lines = data.splitlines(keepends=True)
    if len(lines) > max_lines:
        lines = lines[-max_lines:]
    kept = b"".join(lines)
    return Tail(kept.decode("utf-8", errors="replace"), size - len(kept))


def describe_outcome(exit_code: int | None, signal: int | None) -> str:
    """How a command ended, in words: ``exited with code 3``, ``was killed by signal 15 (SIGTERM)``, or
    ``did not run to an exit``."""
    if signal is not None:
        try:
            name = f" ({_signal.Signals(signal).name})"
        except ValueError:
            name = ""
        return f"was killed by signal {signal}{name}"
    if exit_code is not None:
        return f"exited with code {exit_code}"
    return "did not run to an exit"


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
    stdout_problem: str | None = None,
    stderr_problem: str | None = None,
) -> str:
    """The text an agent is told when a command ended: command, outcome, duration, the last lines.

    A stream whose log was not read (``*_problem``: a link or a FIFO at its path) says so where an empty
    one says ``empty``."""
    outcome = describe_outcome(exit_code, signal)
    took = "" if duration_seconds is None else f" after {duration_seconds:.1f} s"
    parts = [intro] if intro else []
    parts.append(f"Command {command!r} {outcome}{took} (reason: {reason}).")
    for label, tail, cut, problem in (
        ("stdout", stdout_tail, stdout_cut_bytes, stdout_problem),
        ("stderr", stderr_tail, stderr_cut_bytes, stderr_problem),
    ):
        if problem:
            parts.append(f"--- {label}: not read: {problem} ---")
            continue
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
) -> PendingFire:
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
    out = read_tail(stdout_path, max_lines=max_lines, max_bytes=max_bytes)
    err = read_tail(stderr_path, max_lines=max_lines, max_bytes=max_bytes)
    text = format_exit_text(
        command=command,
        exit_code=exit_code,
        signal=signal,
        reason=reason,
        duration_seconds=duration_seconds,
        stdout_tail=out.text,
        stderr_tail=err.text,
        stdout_cut_bytes=out.cut_bytes,
        stderr_cut_bytes=err.cut_bytes,
        intro=intro,
        stdout_problem=out.problem,
        stderr_problem=err.problem,
    )
    return PendingFire(
        fire_id=fire_id or new_fire_id(),
        job_name=job_name,
        text=text,
        command=command,
        exit_code=exit_code,
        signal=signal,
        reason=reason,
        duration_seconds=duration_seconds,
        stdout_tail=out.text,
        stderr_tail=err.text,
        truncated=bool(out.cut_bytes or err.cut_bytes),
    )
