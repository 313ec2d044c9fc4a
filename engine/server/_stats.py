"""``subprocess.stats``: each subprocess's summary with what its tree uses and the last line it printed.

The live view (``gadget-engine top``) asks for it once a second; an IDE's process list can too. CPU and
memory are the whole tree's (:mod:`engine._usage`: the cgroup leaf, else one ``/proc`` scan for every
run), the CPU percentage is over the time since the previous look (:class:`~engine._usage.CpuMeter`), and
the last line comes from the log that changed last, read through the service (a log is read again only
when its size or modification time changed).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Final, final

import attrs
import trio

from .._cgroup import Leaf
from .._containment import CgroupContainment
from .._engine import Engine
from .._errors import SubProcessNotFoundError
from .._project import Project
from .._subprocesses import SubProcess
from .._supervisor import ManagedRun
from .._termtext import last_line
from .._usage import GONE, CpuMeter, RunRef, measure

__all__ = ["RunStats"]

#: How much of a log's end is read for its last line, in bytes and lines.
LAST_LINE_BYTES: Final = 4096
LAST_LINE_TAIL: Final = 5


@attrs.frozen
class _Seen:
    """A log's size and modification time when its last line was read, and that line."""

    size: int
    mtime_ns: int
    line: str


def _stat(path: str) -> os.stat_result | None:
    try:
        return os.stat(path, follow_symlinks=False)
    except OSError:
        return None


@final
@attrs.define(eq=False)
class RunStats:
    """The state behind ``subprocess.stats`` for one engine: CPU references and last lines seen.

    Attributes:
        engine: the engine whose subprocesses are measured.
    """

    engine: Engine
    _meter: CpuMeter = attrs.field(init=False, factory=CpuMeter)
    _seen: dict[tuple[int, str, str], _Seen] = attrs.field(init=False, factory=dict)

    def __repr__(self) -> str:
        return f"<RunStats: {len(self._meter.statistics())} runs measured>"

    async def collect(self, project: Project | None = None) -> list[dict[str, object]]:
        """Each subprocess (of ``project``, or all), oldest first: its summary plus ``project_directory``,
        ``uptime_seconds``, ``cpu_percent``, ``cpu_seconds``, ``memory_bytes``, ``processes``,
        ``last_line`` and ``last_stream``.

        Cancellation: safe; nothing changes but what the next call compares with.
        """
        service = self.engine.service
        records = [sp for sp in service.ps() if project is None or sp.project.id == project.id]
        runs = self.engine.supervisor.runs()
        pairs = [(sp, self._run_of(sp, runs)) for sp in records]
        live = [(sp, run) for sp, run in pairs if run is not None]
        refs = [RunRef(run.pid, run.start_time, run.marker, self._leaf(run)) for _sp, run in live]
        usages = await trio.to_thread.run_sync(measure, refs, [run.pid for run in runs])
        now = trio.current_time()
        usage_of = {id(sp): usage for (sp, _run), usage in zip(live, usages, strict=True)}
        self._meter.keep_only((run.pid, run.start_time) for run in runs)
        wall = datetime.now(UTC)
        out = []
        for sp, run in pairs:
            usage = usage_of.get(id(sp), GONE)
            percent = self._meter.percent((run.pid, run.start_time), usage.cpu_seconds, now) if run else None
            line, stream = await self._last_line(sp)
            out.append(
                {
                    **service.summarize(sp).to_dict(),
                    "project_directory": sp.project.directory,
                    "uptime_seconds": round(self._uptime(sp, wall), 3),
                    "cpu_percent": round(percent, 1) if percent is not None else None,
                    "cpu_seconds": round(usage.cpu_seconds, 3) if usage.cpu_seconds is not None else None,
                    "memory_bytes": usage.memory_bytes,
                    "processes": usage.processes,
                    "last_line": line,
                    "last_stream": stream,
                }
            )
        kept = {(sp.pid, sp.created_at.isoformat()) for sp in service.ps()}
        self._seen = {key: seen for key, seen in self._seen.items() if key[:2] in kept}
        return out

    @staticmethod
    def _run_of(sp: SubProcess, runs: Sequence[ManagedRun]) -> ManagedRun | None:
        """The supervisor's run of ``sp`` while any of its tree is left (a leader's leftovers included)."""
        if sp.ended:
            return None
        return next((r for r in runs if r.pid == sp.pid and r.scope_key == sp.project.scope_key), None)

    def _leaf(self, run: ManagedRun) -> Leaf | None:
        containment = self.engine.supervisor.containment
        if run.cgroup is None or not isinstance(containment, CgroupContainment):
            return None
        return containment.cgroup.existing_leaf(os.path.basename(run.cgroup))

    @staticmethod
    def _uptime(sp: SubProcess, now: datetime) -> float:
        """How long it has run: until now while alive, else until its exit."""
        if sp.exit is not None:
            return sp.exit.duration_seconds
        return max(0.0, (now - sp.created_at).total_seconds())

    async def _last_line(self, sp: SubProcess) -> tuple[str, str | None]:
        """The last line of the log written last, and its stream (``("", None)`` before any output)."""
        found = [("stdout", _stat(sp.stdout_path)), ("stderr", _stat(sp.stderr_path))]
        written = [(i.st_mtime_ns, name, i) for name, i in found if i is not None and i.st_size]
        if not written:
            return "", None
        written.sort(key=lambda item: (item[0], item[1] == "stdout"))
        for _mtime, name, info in reversed(written):  # the newest first; an all-blank end: the other one
            key = (sp.pid, sp.created_at.isoformat(), name)
            seen = self._seen.get(key)
            if seen is None or (seen.size, seen.mtime_ns) != (info.st_size, info.st_mtime_ns):
                line = await self._read_last(sp, name)
                seen = _Seen(info.st_size, info.st_mtime_ns, line)
                self._seen[key] = seen
            if seen.line:
                return seen.line, name
        return "", None

    async def _read_last(self, sp: SubProcess, stream: str) -> str:
        service = self.engine.service
        try:
            if service.lookup(sp.pid) is not sp:
                return ""  # a kept record whose pid a live child holds now: its log is not reachable by pid
            piece = await service.read_log(sp.pid, stream, tail=LAST_LINE_TAIL, max_bytes=LAST_LINE_BYTES)
        except (SubProcessNotFoundError, FileNotFoundError):
            return ""
        return last_line(piece.text)
