"""The look at a run's process tree: which live processes are the run's (:class:`TreeWalk`).

A run is its leader (the child we spawned, leader of a new session and process group), every other
member of that group, and the *escapees*: descendants that left the group (``setsid``). With the engine
a child subreaper, every descendant hangs, through parent links, from the leader or from an orphan
re-parented to the engine, which is the run's when it is in the run's group or carries its marker; the
walk follows ``/proc/<pid>/task/*/children`` from those. Without the subreaper, one full ``/proc`` scan.
The reads that many trees looking together can share (``kill_all``: the engine's list of children, its
orphans' stat lines) are made once.

``_termination.ProcessTree`` is a :class:`TreeWalk`: it signals what the walk found and waits for it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from collections.abc import Set as AbstractSet

from ._procfs import (
    ProcInfo,
    children_map,
    children_of,
    children_read_at,
    engine_children,
    engine_helpers,
    read_marker,
    read_proc,
    scan_processes,
)

__all__ = ["TreeWalk"]

#: How old a list of the engine's children the looks that only aim signals may use.
_SHARED_CHILDREN_SECONDS = 0.002
#: The last list of the engine's children less the run leaders and the engine's helpers:
#: ``(list, leaders, helpers, difference)``.
_not_leaders_memo: tuple[frozenset[int], AbstractSet[int], frozenset[int], frozenset[int]] = (
    frozenset(),
    frozenset(),
    frozenset(),
    frozenset(),
)
#: The stat lines of the last such list's pids, read once (:func:`_shared_infos`).
_infos_memo: tuple[frozenset[int], dict[int, ProcInfo | None]] = (frozenset(), {})


def _shared_infos(adopted: frozenset[int]) -> dict[int, ProcInfo | None]:
    """The ``/proc/<pid>/stat`` of each pid of ``adopted`` (a list :meth:`ProcessTree._not_leaders` keeps),
    read once for every look that shares that list and only aims signals (1000 trees in a ``kill_all``
    look at the same adopted orphans)."""
    global _infos_memo
    kept, infos = _infos_memo
    if kept is not adopted:
        infos = {pid: read_proc(pid) for pid in adopted}
        _infos_memo = (adopted, infos)
    return infos


class TreeWalk:
    """The look at a run's tree (see the module), for :class:`~._termination.ProcessTree`, which holds
    the attributes below (they are documented there).
    """

    pid: int
    start_time: int
    marker: str
    subreaper: bool
    known_leaders: AbstractSet[int]
    status: int | None
    tracked: dict[int, int]
    quiet_at: float | None

    def _ours(self, info: ProcInfo) -> bool:
        return info.start_time >= self.start_time

    def snapshot(self, *, fresh: bool = True) -> None:
        """Add every live descendant of the run (group members included) to :attr:`tracked`.

        With the subreaper on, every descendant is reachable through parent links from the leader or
        from an orphan re-parented to the engine, so the walk follows ``/proc/<pid>/task/*/children``
        and costs what the tree costs, not what the machine runs (1000 concurrent escalations would
        otherwise scan all of ``/proc`` 1000 times). Without it, one full ``/proc`` scan.
        """
        known = len(self.tracked)
        if not (self.subreaper and self._snapshot_by_children(fresh=fresh)):
            self._snapshot_by_scan()
        if len(self.tracked) > known:
            self.quiet_at = None  # a member nobody knew of: not quiet, whatever was seen before

    def _adopted(self, *, fresh: bool) -> frozenset[int]:
        """The engine's children that lead no run: orphans adopted from the runs' trees (and any child
        of an embedding host), from a list read in one of three ways.

        Not ``fresh``: a list read up to 2 ms ago (the looks that only aim signals). ``fresh``: a list
        read since :attr:`quiet_at`, when it holds no process that may be this run's, else a new read.
        That shared list is as good as a new one for deciding the tree is gone: every member alive when
        it was read hangs, through live parents, from a child of the engine that is a member (the leader
        was already reaped); with none in the list (each is ours by start time, or unreadable), nothing
        of the tree was alive when it was read, and nothing can fork from nothing since.
        """
        if not fresh:
            return self._not_leaders(engine_children(max_age_seconds=_SHARED_CHILDREN_SECONDS))
        if self.quiet_at is not None:
            before = children_read_at()
            shared = self._not_leaders(engine_children(read_since=self.quiet_at))
            if children_read_at() != before:
                return shared  # read just now
            # The stat lines of its pids, read once after the list for every tree that shares it: a pid
            # that then shows an older start than the tree's is the very process the list held (a pid
            # reused since has a later start), so it was not of this tree.
            infos = _shared_infos(shared)
            if not any((info := infos[pid]) is None or self._ours(info) for pid in shared):
                return shared  # nothing in it could be of this tree
        return self._not_leaders(engine_children())

    def _not_leaders(self, children: frozenset[int]) -> frozenset[int]:
        """``children`` less the run leaders and the engine's own helpers (its guardians, which no run's
        look needs to read: ``_procfs.add_helper``), computed once per list read (``kill_all``: 1000 trees
        share a list of 1000). A leader forgotten since the first computation stays left out: it was a
        leader, not an orphan, when the list was read."""
        global _not_leaders_memo
        kept, known, helpers, result = _not_leaders_memo
        now_helpers = engine_helpers()
        if kept is not children or known is not self.known_leaders or helpers is not now_helpers:
            result = children - self.known_leaders - now_helpers
            _not_leaders_memo = (children, self.known_leaders, now_helpers, result)
        return result

    def _children(self, pid: int) -> list[int] | None:
        """The children of ``pid`` (``_procfs.children_of``); a target may read some of them another way."""
        return children_of(pid)

    def _snapshot_by_children(self, *, fresh: bool) -> bool:
        roots = [self.pid] if self.status is None else []  # a reaped leader's pid may be a stranger's now
        for pid, start in self.tracked.items():  # walk only from processes that are still ours
            info = read_proc(pid)
            if info is not None and info.start_time == start:
                roots.append(pid)
        adopted = self._adopted(fresh=fresh)
        infos = None if fresh else _shared_infos(adopted)
        for pid in adopted:
            info = read_proc(pid) if infos is None else infos[pid]
            if info is None or not self._ours(info):
                continue
            if infos is not None:  # a shared stat line: read afresh before the pid counts as this tree's
                info = read_proc(pid)  # (it may have died and been reused since)
                if info is None or not self._ours(info):
                    continue
            if info.zombie:
                self._reap_orphan_zombie(info)
            elif info.pgid == self.pid or read_marker(pid) == self.marker:
                roots.append(pid)
        seen: set[int] = set()
        while roots:
            pid = roots.pop()
            if pid in seen:
                continue
            seen.add(pid)
            kids = self._children(pid)
            if kids is None:
                return False
            roots.extend(kids)
        seen.discard(self.pid)
        for pid in seen:
            info = read_proc(pid)
            if info is not None and not info.zombie and self._ours(info):
                self.tracked.setdefault(pid, info.start_time)
        return True

    def _snapshot_by_scan(self) -> None:
        procs = [p for p in scan_processes() if not p.zombie]
        roots = {p.pid for p in procs if p.pgid == self.pid and self._ours(p)}
        roots.add(self.pid)
        roots.update(self.tracked)
        by_pid = {p.pid: p for p in procs}
        if self.subreaper:
            candidates: Iterable[int] = self._not_leaders(engine_children())
        else:  # orphans went to init: only the marker can find them
            candidates = (p.pid for p in procs if self._ours(p))
        for pid in candidates:
            info = by_pid.get(pid)
            if info is not None and self._ours(info) and read_marker(pid) == self.marker:
                roots.add(pid)
        kids = children_map(procs)
        stack = list(roots)
        seen = set(stack)
        while stack:
            for child in kids.get(stack.pop(), ()):
                if child.pid not in seen and self._ours(child):
                    seen.add(child.pid)
                    stack.append(child.pid)
        for pid in seen:
            info = by_pid.get(pid)
            if info is not None and pid != self.pid and pid not in self.tracked:
                self.tracked[pid] = info.start_time

    def _reap_orphan_zombie(self, info: ProcInfo) -> None:
        """Reap a zombie re-parented to the engine (a subreaper) that came from this run's tree.

        A zombie has no environment to carry the run marker, so it is attributed by what it keeps: it
        started after this run's leader and it is in the run's session or group, or leads a session of
        its own (a daemon that double-forked: ``fork, setsid, fork, exit``, whose middle process dies at
        once). Without this it would stay a zombie for the engine's lifetime. It is reaped by its own pid,
        never with ``waitpid(-1)``; a host that starts its own ``start_new_session`` children while
        embedding the engine and needs their exit codes can turn the subreaper off.
        """
        if self.subreaper and (info.sid in (self.pid, info.pid) or info.pgid == self.pid):
            self._reap_adopted(info)

    def _reap_adopted(self, info: ProcInfo) -> None:
        # Only processes we attributed to this run, by their own pid: never waitpid(-1).
        if info.zombie and info.ppid == os.getpid() and info.pid != self.pid:
            try:
                os.waitpid(info.pid, os.WNOHANG)
            except ChildProcessError:
                pass
