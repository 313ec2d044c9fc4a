"""Structured logging of ``gadget-engine serve``: one logfmt line on stderr per thing the engine does.

::

    ts=2026-05-01T12:00:00.123Z level=info event=spawned pid=4242 scope=project:1f2e argv="npm run dev"
    ts=2026-05-01T12:00:09.456Z level=info event=exited pid=4242 status="exited 0" reason=exit ...
    ts=2026-05-01T12:01:00.001Z level=info event=fired job_id=ab12 cursor=7 exit_code=1 reason=exit

Every record of the ``engine`` loggers goes through :class:`LogfmtFormatter`; the engine's own events
carry their fields in ``extra={"fields": {...}}`` and their event name as the message. Sources: a
supervisor observer (:class:`RunLogger`: spawned, escalated, exited) and a fire observer of the cron
service (:func:`log_fired`: fired, as each event is recorded in the event log;
``EngineConfig.fire_observers``).
"""

from __future__ import annotations

import json
import logging
import shlex
from datetime import UTC, datetime
from typing import IO, Any, Final

from .._supervisor import ManagedRun
from ..cron._events import FiredEvent

__all__ = ["LogfmtFormatter", "RunLogger", "configure_logging", "log_event", "log_fired"]

#: The logger of the standalone engine's own events.
logger: Final = logging.getLogger("engine.serve")

_PLAIN = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:/+@,")


def _value(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    text = value if isinstance(value, str) else str(value)
    if text and all(ch in _PLAIN for ch in text):
        return text
    return json.dumps(text, ensure_ascii=False)


class LogfmtFormatter(logging.Formatter):
    """Formats a record as ``ts=... level=... event=... key=value ...`` on one line.

    A record without ``fields`` (a library warning, say) becomes ``event=log logger=... msg="..."``.
    """

    def format(self, record: logging.LogRecord) -> str:
        moment = datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds")
        parts = [f"ts={moment.replace('+00:00', 'Z')}", f"level={record.levelname.lower()}"]
        fields: dict[str, object] | None = getattr(record, "fields", None)
        if fields is None:
            parts += ["event=log", f"logger={record.name}", f"msg={_value(record.getMessage())}"]
        else:
            parts.append(f"event={_value(record.getMessage())}")
            parts += [f"{key}={_value(value)}" for key, value in fields.items()]
        if record.exc_info:
            parts.append(f"exc={_value(self.formatException(record.exc_info))}")
        return " ".join(parts)


def configure_logging(stream: IO[str], level: int = logging.INFO) -> None:
    """Send every ``engine`` logger's records at ``level`` or above to ``stream``, one logfmt line each."""
    handler = logging.StreamHandler(stream)
    handler.setFormatter(LogfmtFormatter())
    root = logging.getLogger("engine")
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    root.propagate = False


def log_event(event: str, *, level: int = logging.INFO, **fields: Any) -> None:
    """Log one engine event with its fields (in the order given)."""
    logger.log(level, event, extra={"fields": fields})


class RunLogger:
    """A supervisor observer logging ``spawned`` and ``exited`` of every run (``escalated`` first if so)."""

    def run_started(self, run: ManagedRun) -> None:
        log_event("spawned", pid=run.pid, scope=run.scope_key, argv=_capped(shlex.join(run.argv)))

    def run_ended(self, run: ManagedRun) -> None:
        ex = run.exit
        if ex is None:
            return
        if ex.escalated:
            log_event(
                "escalated",
                level=logging.WARNING,
                pid=run.pid,
                scope=run.scope_key,
                survivors=",".join(map(str, ex.survivors)) or None,
            )
        log_event(
            "exited",
            pid=run.pid,
            scope=run.scope_key,
            status=ex.describe(),
            exit_code=ex.exit_code,
            signal=ex.signal,
            reason=ex.reason.value,
            escalated=ex.escalated,
            duration_seconds=round(ex.duration_seconds, 3),
        )


#: The longest command line a ``spawned`` log line carries, in characters (``summarize`` keeps it whole).
_ARGV_CHARS = 1000


def _capped(line: str) -> str:
    if len(line) <= _ARGV_CHARS:
        return line
    return f"{line[: _ARGV_CHARS - 40]}... ({len(line.encode())} bytes in all)"


def log_fired(event: FiredEvent) -> None:
    """A fire observer logging ``fired`` for every event recorded in the event log."""
    log_event(
        "fired",
        job_id=event.job_id,
        job_name=event.job_name,
        cursor=event.cursor,
        fire_id=event.fire_id,
        command=event.command,
        exit_code=event.exit_code,
        signal=event.signal,
        reason=event.reason,
    )
