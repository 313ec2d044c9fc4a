"""What ``gadget-engine top`` shows, as text: rows, columns, groups, durations, sizes. No terminal here.

The live view (:mod:`engine._top_app`) asks the engine for ``status``, ``subprocess.stats`` and
``cron.list`` and draws what this module makes of the answers: runs grouped by project, each with its
pid, status, uptime, CPU, memory, restarts, command and last line of output, then the cron jobs with
their next run and last result. The columns fit the terminal's width: below :data:`WIDE_COLUMNS` a run
takes two lines (its last output under its command), from there one. Everything is a pure function of
the answers, the width and the time, so the tests check the screen's text without a terminal.

Standard library only.
"""

from __future__ import annotations

import shlex
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final

from ._termtext import escape_controls

__all__ = [
    "WIDE_COLUMNS",
    "EngineLine",
    "Group",
    "JobRow",
    "RunRow",
    "fit",
    "format_cpu",
    "format_duration",
    "format_memory",
    "group_runs",
    "job_lines",
    "run_header",
    "run_lines",
]

#: From this many columns on, a run's last output shares its line; below, it goes on a second line.
WIDE_COLUMNS: Final = 120
#: The fixed columns of a run: name, width, alignment (``>`` right, ``<`` left).
_FIXED: Final = (("PID", 7, ">"), ("STATUS", 10, "<"), ("UPTIME", 7, ">"), ("CPU%", 6, ">"), ("MEM", 7, ">"))
_RESTARTS: Final = ("RST", 4, ">")
#: Where a run's second line (its last output) starts, under the command.
_INDENT: Final = 9
_ELLIPSIS: Final = "…"


def fit(text: str, width: int) -> str:
    """``text`` cut to ``width`` characters, the cut marked with an ellipsis."""
    if width <= 0:
        return ""
    return text if len(text) <= width else text[: width - 1] + _ELLIPSIS


def format_duration(seconds: float | None) -> str:
    """A duration in its two largest units: ``45s``, ``5m12s``, ``3h05m``, ``2d04h`` (``-`` when unknown)."""
    if seconds is None or seconds < 0:
        return "-"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def format_memory(size: int | None) -> str:
    """Bytes as ``812K``, ``21.3M``, ``1.2G`` (powers of 1024; ``-`` when unknown)."""
    if size is None:
        return "-"
    value = float(size)
    for unit in ("B", "K", "M", "G"):
        if value < 1024 or unit == "G":
            return f"{value:.0f}{unit}" if unit in ("B", "K") or value >= 100 else f"{value:.1f}{unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_cpu(percent: float | None) -> str:
    """A CPU percentage with one decimal below 100 (``-`` when not measured yet)."""
    if percent is None:
        return "-"
    return f"{percent:.1f}" if percent < 100 else f"{percent:.0f}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


@dataclass(frozen=True)
class RunRow:
    """One subprocess as the view shows it (from a ``subprocess.stats`` entry).

    Attributes:
        pid: its pid.
        project_id: its project's id.
        project: its project's slug.
        directory: its project's directory.
        command: the command line, one line.
        state: ``running``, ``exiting`` or ``exited``.
        status: the short status: ``running``, ``stopping``, ``exit 1``, ``SIGKILL``, ``restarting``.
        uptime_seconds: how long it has run (until its exit once it exited).
        cpu_percent: CPU over the last interval, ``None`` before the second look.
        memory_bytes: its tree's memory, ``None`` when unknown.
        restarts: how often the engine restarted it, ``None`` where the engine does not say.
        last_line: the last line of its output.
        last_stream: ``stdout``, ``stderr`` or ``None``.
    """

    pid: int
    project_id: str
    project: str
    directory: str
    command: str
    state: str
    status: str
    uptime_seconds: float | None
    cpu_percent: float | None
    memory_bytes: int | None
    restarts: int | None
    last_line: str
    last_stream: str | None = None

    @classmethod
    def from_stats(cls, entry: Mapping[str, Any]) -> RunRow:
        """The row of one ``subprocess.stats`` entry."""
        state = str(entry.get("state", ""))
        status = str(entry.get("status", state))
        if "restart" in status:
            short = "restarting"
        elif state == "exiting":
            short = "stopping"
        elif state == "exited":
            code, number = entry.get("exit_code"), entry.get("signal")
            short = f"exit {code}" if code is not None else _signal_name(number) if number else "exited"
        else:
            short = status
        restarts = entry.get("restarts")
        argv = [str(entry.get("command", "")), *(str(a) for a in entry.get("args") or ())]
        return cls(
            pid=int(entry["pid"]),
            project_id=str(entry.get("project_id", "")),
            project=str(entry.get("project_slug", "")),
            directory=str(entry.get("project_directory", "")),
            command=escape_controls(shlex.join(argv)),  # as ``cron list`` shows a command: \n stays visible
            state=state,
            status=short,
            uptime_seconds=entry.get("uptime_seconds"),
            cpu_percent=entry.get("cpu_percent"),
            memory_bytes=entry.get("memory_bytes"),
            restarts=restarts if isinstance(restarts, int) else None,
            last_line=str(entry.get("last_line") or ""),
            last_stream=entry.get("last_stream"),
        )

    @property
    def alive(self) -> bool:
        """Whether it still runs (or is being stopped)."""
        return self.state != "exited"


@dataclass(frozen=True)
class Group:
    """One project's runs, in pid order of creation (as the engine lists them)."""

    project_id: str
    project: str
    directory: str
    runs: list[RunRow] = field(default_factory=list)


def _matches(row: RunRow, needle: str) -> bool:
    needle = needle.lower()
    return needle in row.project.lower() or needle in row.directory.lower()


def group_runs(rows: Sequence[RunRow], needle: str = "") -> list[Group]:
    """The runs by project, projects by name then directory; only the projects ``needle`` is found in
    (their name or directory, case ignored) when it is not empty."""
    groups: dict[str, Group] = {}
    for row in rows:
        if needle and not _matches(row, needle):
            continue
        group = groups.setdefault(row.project_id, Group(row.project_id, row.project, row.directory))
        group.runs.append(row)
    return sorted(groups.values(), key=lambda g: (g.project, g.directory))


def _cells(columns: Sequence[tuple[str, int, str]], values: Sequence[str]) -> str:
    return " ".join(
        fit(value, width).rjust(width) if align == ">" else fit(value, width).ljust(width)
        for (_name, width, align), value in zip(columns, values, strict=True)
    )


def _columns(restarts: bool) -> tuple[tuple[str, int, str], ...]:
    return (*_FIXED, _RESTARTS) if restarts else _FIXED


def _command_width(width: int, restarts: bool) -> tuple[int, int]:
    """The command's and the last output's widths (0: on the second line) at ``width`` columns."""
    fixed = sum(w + 1 for _n, w, _a in _columns(restarts)) + 1
    rest = max(0, width - fixed)
    if width < WIDE_COLUMNS:
        return rest, 0
    command = min(48, rest * 2 // 5)
    return command, max(0, rest - command - 2)


def run_header(width: int, *, restarts: bool) -> str:
    """The column titles over the runs."""
    command, last = _command_width(width, restarts)
    names = [name for name, _w, _a in _columns(restarts)]
    line = _cells(_columns(restarts), names) + "  COMMAND"
    if last:
        line = line.ljust(len(line) - len("COMMAND") + command + 2) + "LAST OUTPUT"
    return fit(line, width)


def run_lines(row: RunRow, width: int, *, restarts: bool) -> list[str]:
    """A run as one or two lines of ``width`` columns: its cells and command, then its last output."""
    values = [
        str(row.pid),
        row.status,
        format_duration(row.uptime_seconds),
        format_cpu(row.cpu_percent) if row.alive else "",
        format_memory(row.memory_bytes) if row.alive else "",
    ]
    if restarts:
        values.append("-" if row.restarts is None else str(row.restarts))
    command, last = _command_width(width, restarts)
    head = _cells(_columns(restarts), values) + "  " + fit(row.command, command)
    if last:
        head = head.ljust(width - last) + fit(row.last_line, last)
        return [fit(head.rstrip(), width)]
    lines = [fit(head.rstrip(), width)]
    if row.last_line:
        lines.append(fit(" " * _INDENT + "└ " + row.last_line, width))
    return lines


@dataclass(frozen=True)
class JobRow:
    """One cron job as the view shows it (from a ``cron.list`` entry).

    Attributes:
        id: the job's id.
        name: its name.
        project_id: the project it belongs to, or ``None``.
        enabled: whether it is enabled.
        schedule: its schedule in a few words (``every 1h30m``, ``cron 0 9 * * 1-5``).
        next_run_at: when it fires next, or ``None``.
        last_status: how its last run went (``ok``, ``error``), ``""`` before the first.
        last_run_at: when it last ran, or ``None``.
    """

    id: str
    name: str
    project_id: str | None
    enabled: bool
    schedule: str
    next_run_at: datetime | None
    last_status: str
    last_run_at: datetime | None

    @classmethod
    def from_job(cls, job: Mapping[str, Any]) -> JobRow:
        """The row of one ``cron.list`` job."""
        next_run, last_run = job.get("next_run_at"), job.get("last_run_at")
        return cls(
            id=str(job.get("id", "")),
            name=escape_controls(str(job.get("name") or job.get("id", ""))),
            project_id=job.get("project"),
            enabled=bool(job.get("enabled")),
            schedule=_schedule(job.get("schedule") or {}),
            next_run_at=datetime.fromisoformat(next_run) if isinstance(next_run, str) else None,
            last_status=str(job.get("last_status") or ""),
            last_run_at=datetime.fromisoformat(last_run) if isinstance(last_run, str) else None,
        )

    def last(self, now: datetime) -> str:
        """How it last went, and when: ``ok 5m12s ago``, ``error 3s ago``; ``-`` before its first run."""
        if self.last_run_at is None:
            return self.last_status or "-"
        ago = format_duration(max(0.0, (now - self.last_run_at).total_seconds()))
        return f"{self.last_status or 'ran'} {ago} ago"

    def next_run(self, now: datetime) -> str:
        """When it fires next, from ``now``: ``in 1h29m``, ``due``, ``-``; ``off`` when disabled."""
        if not self.enabled:
            return "off"
        if self.next_run_at is None:
            return "-"
        left = (self.next_run_at - now).total_seconds()
        return "due" if left < 1 else f"in {format_duration(left)}"


def _schedule(schedule: Mapping[str, Any]) -> str:
    kind = schedule.get("kind")
    if kind == "every":
        return f"every {format_duration(float(schedule.get('every_seconds') or 0))}"
    if kind == "cron":
        tz = schedule.get("tz") or "UTC"
        return f"cron {schedule.get('expr')}" + ("" if tz == "UTC" else f" {tz}")
    if kind == "at":
        at = schedule.get("at")
        return f"at {datetime.fromisoformat(at):%Y-%m-%d %H:%M}" if isinstance(at, str) else "at ?"
    return f"on exit of {escape_controls(str(schedule.get('command')))}"


_JOB_COLUMNS: Final = (("NAME", 16, "<"), ("NEXT RUN", 10, "<"))


def job_lines(jobs: Sequence[JobRow], width: int, now: datetime) -> list[str]:
    """The cron jobs under a title line: name, next run, last result, schedule."""
    rest = max(0, width - sum(w + 1 for _n, w, _a in _JOB_COLUMNS) - 1)
    last_width = min(18, rest // 2)
    title = _cells(_JOB_COLUMNS, ["CRON JOB", "NEXT RUN"]) + " " + "LAST".ljust(last_width) + " SCHEDULE"
    lines = [fit(title, width)]
    for job in jobs:
        cells = _cells(_JOB_COLUMNS, [job.name, job.next_run(now)])
        line = f"{cells} {fit(job.last(now), last_width).ljust(last_width)} {job.schedule}"
        lines.append(fit(line, width))
    if not jobs:
        lines.append("(no cron jobs)")
    return lines


@dataclass(frozen=True)
class EngineLine:
    """The title line's facts, from ``status`` and the runs."""

    pid: int
    containment: str
    uptime_seconds: float

    @classmethod
    def from_status(cls, status: Mapping[str, Any]) -> EngineLine:
        """The facts of a ``status`` answer."""
        return cls(
            pid=int(status.get("pid", 0)),
            containment=str(status.get("containment", "")),
            uptime_seconds=float(status.get("uptime_seconds", 0.0)),
        )

    def text(self, runs: Sequence[RunRow], jobs: Sequence[JobRow], needle: str, width: int) -> str:
        """``top · engine 811 (cgroup) up 5m12s · 3 runs, 2 running · 2 jobs · filter: app``."""
        running = sum(1 for r in runs if r.alive)
        parts = [
            "top",
            f"engine {self.pid} ({self.containment}) up {format_duration(self.uptime_seconds)}",
            f"{len(runs)} runs, {running} running",
            f"{len(jobs)} jobs",
        ]
        if needle:
            parts.append(f"filter: {needle}")
        return fit(" · ".join(parts), width)
