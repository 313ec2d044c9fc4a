"""What a run's whole process tree uses: CPU time and memory, from its cgroup leaf or from ``/proc``.

A run is more than its leader: a dev server's workers, a test runner's children, a ``setsid`` escapee. In
cgroup containment the leaf counts all of them: ``cpu.stat`` ``usage_usec`` (always there) and
``memory.current`` (only where the memory controller is enabled for the parent; elsewhere the resident
memory of the leaf's processes is added up). In process-group containment the tree is found in one
``/proc`` scan, as the escalation finds it (``_termination``): the leader, the members of its group, the
engine's adopted children that carry the run's marker, and every descendant of these, each started no
earlier than the leader (a reused pid is not ours).

CPU time is cumulative; :class:`CpuMeter` turns two looks into a percentage (100 % is one core busy, as
``top`` counts). A process's own time plus the time of the children it reaped (``cutime``) keeps a
tree's total steady when a member exits and its parent reaps it.

Everything here is synchronous; the RPC layer runs :func:`measure` in a worker thread.
"""

from __future__ import annotations

import os
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Final, final

import attrs

from ._cgroup import Leaf
from ._procfs import read_marker

__all__ = [
    "CpuMeter",
    "ProcSample",
    "RunRef",
    "TreeUsage",
    "measure",
    "read_sample",
    "scan_samples",
    "tree_members",
    "usage_of",
]

_TICKS: Final = os.sysconf("SC_CLK_TCK")
_PAGE: Final = os.sysconf("SC_PAGE_SIZE")


@attrs.frozen
class ProcSample:
    """One process's line of ``/proc/<pid>/stat``, the fields usage needs.

    Attributes:
        pid: process id.
        ppid: parent pid.
        pgid: process group id.
        start_time: start time in clock ticks since boot.
        cpu_ticks: ``utime + stime + cutime + cstime``, in clock ticks.
        rss_pages: resident set size, in pages.
        zombie: whether it has exited and waits to be reaped.
    """

    pid: int
    ppid: int
    pgid: int
    start_time: int
    cpu_ticks: int
    rss_pages: int
    zombie: bool = False


def _parse(pid: int, data: bytes) -> ProcSample | None:
    end = data.rfind(b")")  # the command name may hold ')' and spaces
    fields = data[end + 2 :].split()
    try:
        return ProcSample(
            pid=pid,
            ppid=int(fields[1]),
            pgid=int(fields[2]),
            start_time=int(fields[19]),
            cpu_ticks=sum(int(f) for f in fields[11:15]),
            rss_pages=int(fields[21]),
            zombie=fields[0] in (b"Z", b"X"),
        )
    except (IndexError, ValueError):
        return None


def read_sample(pid: int) -> ProcSample | None:
    """Read ``/proc/<pid>/stat``; ``None`` when the process is gone."""
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    try:
        data = os.read(fd, 4096)
    except (ProcessLookupError, OSError):
        return None
    finally:
        os.close(fd)
    return _parse(pid, data)


def scan_samples() -> list[ProcSample]:
    """Every process of the machine; those that vanish during the scan are left out."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            sample = read_sample(int(name))
            if sample is not None:
                found.append(sample)
    return found


def tree_members(
    samples: Sequence[ProcSample], leader: int, start_time: int, roots: Iterable[int] = ()
) -> list[ProcSample]:
    """The processes of one run in a scan: the leader, its group, ``roots``, and their descendants.

    Only processes started no earlier than the leader count (``start_time``), so a pid the kernel reused
    for someone else's process is never added. Pure: the scan is given.

    Args:
        samples: one scan (:func:`scan_samples`).
        leader: the run's leader pid, also its process group id.
        start_time: the leader's start time in clock ticks.
        roots: other pids known to be the run's (escapees adopted by the engine, found by marker).
    """
    ours = [s for s in samples if s.start_time >= start_time]
    by_pid = {s.pid: s for s in ours}
    kids: dict[int, list[int]] = {}
    for s in ours:
        kids.setdefault(s.ppid, []).append(s.pid)
    stack = [leader, *roots, *(s.pid for s in ours if s.pgid == leader)]
    seen: set[int] = set()
    while stack:
        pid = stack.pop()
        if pid in seen or pid not in by_pid:
            continue
        seen.add(pid)
        stack.extend(kids.get(pid, ()))
    return [by_pid[pid] for pid in sorted(seen)]


@attrs.frozen
class TreeUsage:
    """What one run's process tree uses now.

    Attributes:
        cpu_seconds: CPU time used so far (user and system), in seconds; ``None`` when unknown.
        memory_bytes: memory in use, in bytes (the leaf's ``memory.current``, else the sum of the
            processes' resident sets); ``None`` when unknown.
        processes: live processes in the tree (zombies not counted).
    """

    cpu_seconds: float | None
    memory_bytes: int | None
    processes: int

    @classmethod
    def of_samples(cls, members: Iterable[ProcSample]) -> TreeUsage:
        """The usage of a tree's processes, read from ``/proc``."""
        members = list(members)
        return cls(
            cpu_seconds=sum(m.cpu_ticks for m in members) / _TICKS,
            memory_bytes=sum(m.rss_pages for m in members if not m.zombie) * _PAGE,
            processes=sum(1 for m in members if not m.zombie),
        )


#: The usage of a run whose tree is gone.
GONE: Final = TreeUsage(cpu_seconds=None, memory_bytes=None, processes=0)


def usage_of(leaf: Leaf) -> TreeUsage:
    """The usage of a cgroup leaf's processes: ``cpu.stat``, ``memory.current`` where it exists."""
    pids = leaf.procs()
    usec = leaf.cpu_usec()
    memory = leaf.memory_bytes()
    if memory is None:
        samples = [s for s in map(read_sample, pids) if s is not None]
        memory = sum(s.rss_pages for s in samples if not s.zombie) * _PAGE
    return TreeUsage(
        cpu_seconds=usec / 1e6 if usec is not None else None, memory_bytes=memory, processes=len(pids)
    )


@attrs.frozen
class RunRef:
    """One live run, as :func:`measure` needs it.

    Attributes:
        pid: the leader's pid (and process group id).
        start_time: the leader's start time in clock ticks.
        marker: the run marker in its tree's environment.
        leaf: its cgroup leaf in cgroup containment, else ``None`` (its tree is found in ``/proc``).
    """

    pid: int
    start_time: int
    marker: str
    leaf: Leaf | None = None


def measure(runs: Sequence[RunRef], known_leaders: Iterable[int]) -> list[TreeUsage]:
    """The usage of each run of ``runs``, in order: one ``/proc`` scan for all that have no leaf.

    Args:
        runs: the runs to measure.
        known_leaders: the leaders of every run of the engine (an adopted child that leads a run is
            that run's, never another's escapee).
    """
    if all(run.leaf is not None for run in runs):
        return [usage_of(run.leaf) for run in runs if run.leaf is not None]
    samples = scan_samples()
    me = os.getpid()
    leaders = set(known_leaders)
    adopted: dict[str, list[int]] = {}
    for s in samples:  # escapees re-parented to the engine (the subreaper): attributed by their marker
        if s.ppid == me and s.pid not in leaders and not s.zombie:
            marker = read_marker(s.pid)
            if marker is not None:
                adopted.setdefault(marker, []).append(s.pid)
    out = []
    for run in runs:
        if run.leaf is not None:
            out.append(usage_of(run.leaf))
        else:
            members = tree_members(samples, run.pid, run.start_time, adopted.get(run.marker, ()))
            out.append(TreeUsage.of_samples(members) if members else GONE)
    return out


@final
@attrs.define(eq=False)
class CpuMeter:
    """Turns cumulative CPU seconds into a percentage over the time since an earlier look.

    Each key (a run) keeps one reference look; a look at least :attr:`min_interval_seconds` after it
    gives the percentage over that interval and becomes the new reference. A look sooner (two viewers
    asking at once) is measured against the same reference and leaves it in place. The first look of a
    key has no percentage. A total that went down (a member reaped outside the tree took its time along)
    counts as no CPU used. Pure: the clock is given.

    Attributes:
        min_interval_seconds: the shortest interval a reference is replaced after.
    """

    min_interval_seconds: float = 0.5
    _refs: dict[Hashable, tuple[float, float]] = attrs.field(init=False, factory=dict)

    def percent(self, key: Hashable, cpu_seconds: float | None, now: float) -> float | None:
        """The CPU percentage of ``key`` since its reference look, or ``None`` (first look, unknown).

        Args:
            key: the run.
            cpu_seconds: its cumulative CPU time now, in seconds (``None``: unknown, nothing is kept).
            now: the time of this look, in seconds on a monotonic clock.
        """
        if cpu_seconds is None:
            self._refs.pop(key, None)
            return None
        ref = self._refs.get(key)
        if ref is None:
            self._refs[key] = (now, cpu_seconds)
            return None
        then, used = ref
        if now - then >= self.min_interval_seconds:
            self._refs[key] = (now, cpu_seconds)
        if now <= then:
            return None
        return max(0.0, cpu_seconds - used) / (now - then) * 100.0

    def keep_only(self, keys: Iterable[Hashable]) -> None:
        """Forget the references of every key but ``keys`` (runs that ended)."""
        keep = set(keys)
        for key in [k for k in self._refs if k not in keep]:
            del self._refs[key]

    def statistics(self) -> Mapping[Hashable, tuple[float, float]]:
        """The reference looks, ``{key: (time, cpu_seconds)}`` (a copy)."""
        return dict(self._refs)
