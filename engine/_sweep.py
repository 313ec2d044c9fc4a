"""Records of live process groups in the state directory, and ending the trees they name.

Both the guardian (after the engine died) and the next engine's start-up sweep use this. A record names
a group by ``(pgid, sid, leader start time)`` plus the run marker; a process is ended only when it
matches, so a pid reused by someone else is never signalled:

- the leader pid alive with the recorded start time: the group is ours;
- the leader pid alive with another start time: the pid was reused, so the group is gone (the kernel
  keeps a pid reserved while any process still uses it as its group id): nothing is ours;
- the leader pid free: processes with the recorded pgid and sid are our group's members.

Escapees are found by the run marker in their environment and by ``/proc`` parent links. The
processes found are ended by the escalation of ``_escalation``, driven here by polling with
``time.sleep``. Everything here is synchronous (it runs in the guardian, or in a worker thread of the
engine) and uses the standard library only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from ._cgroup import Cgroup2, Leaf, load_recorded_parent, parent_leaves
from ._escalation import Escalation, EscalationTarget, Phase, Steps, WaitGone, advance, escalate
from ._group_journal import JOURNAL_PREFIX, journal_path, read_journal
from ._procfs import children_map, read_marker, read_proc, scan_processes
from ._trust import read_pointer, write_own_file

if TYPE_CHECKING:
    from ._supervisor import ManagedRun

__all__ = [
    "GroupRecord",
    "drive_blocking",
    "end_processes",
    "find_marked_processes",
    "find_record_processes",
    "load_records",
    "load_tokens",
    "remove_token",
    "sweep_records",
    "unwatched_leaves",
    "write_token",
]

_RECORDS = "groups"


class GroupRecord(NamedTuple):
    """One live group of an engine, as kept in ``<state_dir>/groups/``.

    Attributes:
        pgid: the group (and leader) id.
        sid: the session id (equal to pgid for our children).
        start_time: the leader's start time in clock ticks since boot.
        marker: the run marker in the tree's environment.
    """

    pgid: int
    sid: int
    start_time: int
    marker: str

    @classmethod
    def of_run(cls, run: ManagedRun) -> GroupRecord:
        """The record of a supervised run's group (its session read from ``/proc``, else the pgid)."""
        info = read_proc(run.pid)
        sid = info.sid if info is not None else run.pgid
        return cls(pgid=run.pgid, sid=sid, start_time=run.start_time, marker=run.marker)

    def line(self) -> str:
        """The record as one line: ``pgid sid start_time marker``."""
        return f"{self.pgid} {self.sid} {self.start_time} {self.marker}"

    @classmethod
    def parse(cls, line: str) -> GroupRecord:
        """Read :meth:`line` back; ``ValueError`` on anything else."""
        pgid, sid, start, marker = line.split()
        return cls(int(pgid), int(sid), int(start), marker)

    def path(self, state_dir: str) -> Path:
        """Where this record is kept."""
        return Path(state_dir) / _RECORDS / f"{self.pgid}-{self.start_time}"

    def write(self, state_dir: str) -> None:
        """Keep the record (one small file, mode 0600)."""
        path = self.path(state_dir)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, (self.line() + "\n").encode())
        finally:
            os.close(fd)

    def remove(self, state_dir: str) -> None:
        """Forget the record (missing is fine)."""
        with contextlib.suppress(FileNotFoundError):
            self.path(state_dir).unlink()


def records_dir(state_dir: str) -> Path:
    """``<state_dir>/groups``, created (0700) if missing."""
    path = Path(state_dir) / _RECORDS
    path.mkdir(mode=0o700, exist_ok=True)
    return path


#: Token files in ``groups/``: ``.token-<token>`` holding the engine's start time (clock ticks).
_TOKEN_PREFIX = ".token-"


def write_token(state_dir: str, token: str, start_time: int) -> None:
    """Record an engine's run-marker token: every run it starts carries ``<token>:<run id>``.

    Written before the engine's first spawn and removed at its graceful exit, so a process spawned
    just before the engine died (its group record not written yet) is still found by the sweep.
    """
    path = records_dir(state_dir) / f"{_TOKEN_PREFIX}{token}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, f"{start_time}\n".encode())
    finally:
        os.close(fd)


def remove_token(state_dir: str, token: str) -> None:
    """Forget an engine's token and its group journal (missing is fine)."""
    records = records_dir(state_dir)
    journal = journal_path(records, token)
    for path in (records / f"{_TOKEN_PREFIX}{token}", journal, journal.with_name(journal.name + ".tmp")):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def load_tokens(state_dir: str) -> dict[str, int]:
    """Every recorded token with its engine's start time; unreadable ones are removed."""
    out: dict[str, int] = {}
    for path in records_dir(state_dir).iterdir():
        if not path.name.startswith(_TOKEN_PREFIX):
            continue
        token = path.name[len(_TOKEN_PREFIX) :]
        try:
            if not token.isalnum():
                raise ValueError(token)
            out[token] = int(path.read_text().strip())
        except (OSError, ValueError):
            with contextlib.suppress(OSError):
                path.unlink()
    return out


def find_marked_processes(tokens: dict[str, int]) -> dict[int, int]:
    """Live processes whose run marker carries one of ``tokens`` (``<token>:<run id>``), ``{pid: start}``.

    Watched on-exit commands carry ``<token>w:<run id>`` and are not found. Only processes started
    after the token's engine are read (their environment).
    """
    if not tokens:
        return {}
    earliest = min(tokens.values())
    prefixes = tuple(f"{token}:" for token in tokens)
    me = os.getpid()
    found: dict[int, int] = {}
    for p in scan_processes():
        if p.zombie or p.pid == me or p.start_time < earliest or p.kernel_thread:
            continue
        marker = read_marker(p.pid)
        if marker is not None and marker.startswith(prefixes):
            token = marker.partition(":")[0]
            if p.start_time >= tokens.get(token, 0):
                found[p.pid] = p.start_time
    return found


def load_records(state_dir: str) -> list[GroupRecord]:
    """Every readable record: the live ones of each engine's journal (``_group_journal``) and those kept
    one per file (by an older engine); unreadable files are removed."""
    out = []
    for path in records_dir(state_dir).iterdir():
        if path.name.startswith(_TOKEN_PREFIX):
            continue
        try:
            if path.name.startswith(JOURNAL_PREFIX):
                out.extend(read_journal(path))
            else:
                out.append(GroupRecord.parse(path.read_text()))
        except (OSError, ValueError):
            with contextlib.suppress(OSError):
                path.unlink()
    return out


def find_record_processes(records: Iterable[GroupRecord]) -> dict[int, int]:
    """The live processes the records name, ``{pid: start_time}`` (one ``/proc`` scan, see the module)."""
    records = list(records)
    procs = [p for p in scan_processes() if not p.zombie]
    by_pid = {p.pid: p for p in procs}
    found: dict[int, int] = {}
    markers: dict[str, int] = {}
    for rec in records:
        leader = by_pid.get(rec.pgid)
        if leader is not None and leader.start_time != rec.start_time:
            continue  # pid reused: the group no longer exists
        if rec.marker:  # empty: no marker known (``sessions_left``)
            markers[rec.marker] = rec.start_time
        for p in procs:
            if p.pgid == rec.pgid and p.sid == rec.sid and p.start_time >= rec.start_time:
                found[p.pid] = p.start_time
    if markers:
        earliest = min(markers.values())
        for p in procs:
            if p.pid not in found and p.start_time >= earliest and p.pid != os.getpid():
                marker = read_marker(p.pid)
                if marker is not None and marker in markers and p.start_time >= markers[marker]:
                    found[p.pid] = p.start_time
    kids = children_map(procs)
    stack = list(found)
    while stack:
        for child in kids.get(stack.pop(), ()):
            if child.pid not in found:
                found[child.pid] = child.start_time
                stack.append(child.pid)
    return found


#: The blocking driver's poll step.
_POLL_SECONDS = 0.02


class _RecordedProcesses:
    """An escalation target: a fixed set of processes named by ``(pid, start_time)``.

    The set was found once (:func:`find_record_processes`), so a new look adds nothing; a pid whose
    start time changed belongs to someone else and is dropped, never signalled. A zombie counts as
    gone: its parent reaps it, not us.
    """

    __slots__ = ("_alive",)

    def __init__(self, targets: dict[int, int]) -> None:
        self._alive = dict(targets)

    def snapshot(self, *, fresh: bool) -> None:
        pass

    def send(self, sig: int) -> None:
        for pid, start in self._alive.items():
            info = read_proc(pid)
            if info is not None and info.start_time == start:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)

    def kill(self) -> None:
        self.send(signal.SIGKILL)

    def remaining(self) -> list[int]:
        alive = {}
        for pid, start in self._alive.items():
            info = read_proc(pid)
            if info is not None and info.start_time == start and not info.zombie:
                alive[pid] = start
        self._alive = alive
        return sorted(alive)

    def gone(self) -> bool:
        return not self.remaining()


class _Leaves:
    """An escalation target: cgroup v2 leaves a dead engine left (every process in them is its)."""

    __slots__ = ("_leaves",)

    def __init__(self, leaves: Sequence[Leaf]) -> None:
        self._leaves = list(leaves)

    def snapshot(self, *, fresh: bool) -> None:
        pass

    def send(self, sig: int) -> None:
        for leaf in self._leaves:
            leaf.signal(sig)

    def kill(self) -> None:
        for leaf in self._leaves:
            leaf.kill()

    def remaining(self) -> list[int]:
        return sorted(pid for leaf in self._leaves for pid in leaf.procs())

    def gone(self) -> bool:
        return not any(leaf.populated() for leaf in self._leaves)


class _Together:
    """Several escalation targets ended by one escalation (one grace period for all of them)."""

    __slots__ = ("_targets",)

    def __init__(self, *targets: EscalationTarget) -> None:
        self._targets = targets

    def snapshot(self, *, fresh: bool) -> None:
        for target in self._targets:
            target.snapshot(fresh=fresh)

    def send(self, sig: int) -> None:
        for target in self._targets:
            target.send(sig)

    def kill(self) -> None:
        for target in self._targets:
            target.kill()

    def remaining(self) -> list[int]:
        return sorted(pid for target in self._targets for pid in target.remaining())

    def gone(self) -> bool:
        return all(target.gone() for target in self._targets)


def drive_blocking(
    target: EscalationTarget, steps: Steps, force: threading.Event | None = None
) -> Escalation:
    """Run the escalation ``steps`` on ``target``, blocking: each wait polls ``target.gone()`` every
    20 ms until it says gone or the request's time is up. Once ``force`` is set (by another thread), the
    grace period ends at the next poll: SIGKILL follows."""
    answer = advance(steps, None)
    while isinstance(answer, WaitGone):
        grace_force = force if answer.phase is Phase.GRACE else None
        answer = advance(steps, _wait_gone(target, answer.seconds, grace_force))
    return answer


def _wait_gone(target: EscalationTarget, seconds: float, force: threading.Event | None) -> bool:
    deadline = time.monotonic() + seconds
    while not target.gone():
        left = deadline - time.monotonic()
        if left <= 0 or (force is not None and force.is_set()):
            return False
        if force is not None:
            force.wait(min(_POLL_SECONDS, left))
        else:
            time.sleep(min(_POLL_SECONDS, left))
    return True


def end_processes(
    targets: dict[int, int],
    *,
    grace_seconds: float,
    kill_wait_seconds: float,
    leaves: Sequence[Leaf] = (),
    force: threading.Event | None = None,
) -> list[int]:
    """SIGINT (+SIGCONT) -> ``grace_seconds`` -> SIGKILL -> ``kill_wait_seconds`` on ``targets``.

    Blocks (polling every 20 ms). A zombie counts as gone: its parent reaps it, not us.

    Args:
        targets: the processes, ``{pid: start_time}``.
        grace_seconds: the longest wait after SIGINT.
        kill_wait_seconds: the longest wait after SIGKILL.
        leaves: cgroup v2 leaves ended in the same escalation (every process in them; SIGKILL through
            ``cgroup.kill``); removed once empty.
        force: once set (from another thread), the grace period ends: SIGKILL at once.

    Returns:
        The pids still alive at the end.
    """
    target: EscalationTarget = _RecordedProcesses(targets)
    if leaves:
        target = _Together(target, _Leaves(leaves))
    steps = escalate(
        target,
        grace_seconds=grace_seconds,
        kill_wait_seconds=kill_wait_seconds,
        force=False,
        now=time.monotonic,
    )
    survivors = list(drive_blocking(target, steps, force).survivors)
    for leaf in leaves:
        with contextlib.suppress(OSError):
            leaf.remove()
    return survivors


def unwatched_leaves(cgroup2: Cgroup2, parent: str) -> list[Leaf]:
    """The leaves under ``parent`` that are not watched on-exit commands' (those survive for adoption)."""
    return [leaf for leaf in parent_leaves(cgroup2, parent) if not leaf.watched]


_log = logging.getLogger("engine.sweep")

#: The file holding the state directory's own identity (``<st_dev>:<st_ino>``), written by each engine
#: that takes the directory: records found beside another identity were copied with the folder.
STATE_IDENTITY = "state-dir.identity"


def _identity(state_dir: str) -> str:
    info = os.stat(state_dir)
    return f"{info.st_dev}:{info.st_ino}"


def copied_records(state_dir: str) -> bool:
    """Whether the records in ``state_dir`` were written in another directory and copied here with it
    (``cp -a`` of a live engine's state directory): its identity file names another directory. A state
    directory without one (made by an older engine) counts as its own."""
    recorded = read_pointer(state_dir, STATE_IDENTITY, what="the state directory's identity")
    return recorded is not None and recorded != _identity(state_dir)


def mark_state_dir(state_dir: str) -> None:
    """Write the state directory's identity (:data:`STATE_IDENTITY`; a temporary file renamed, 0600)."""
    write_own_file(os.path.join(state_dir, STATE_IDENTITY), _identity(state_dir) + "\n")


def sweep_records(
    state_dir: str, *, grace_seconds: float, kill_wait_seconds: float, force: threading.Event | None = None
) -> tuple[int, list[int]]:
    """End every process the state dir's records name, then drop the records.

    Run by an engine at start-up, under the state-dir lock, so that no other engine's children are
    touched: processes left by a crashed engine (and a crashed guardian) are ended here: the groups
    recorded in ``groups/``, every process carrying a recorded token's marker, and every leaf of the
    recorded parent cgroup but the watched commands' (adopted by the watchers instead).

    Records copied from another state directory (:func:`copied_records`: ``cp -a`` of a live engine's)
    name that engine's children: nothing is ended, the copies are dropped, and a warning says so.

    Logs ``sweeping`` (with the number of processes) before it ends anything, and ``swept`` after. Once
    ``force`` is set (``serve`` sets it on a second stop signal, ``_engine.ServeStart``), the grace period
    ends: SIGKILL at once.

    Returns:
        ``(number of processes ended, survivors)``.
    """
    records = load_records(state_dir)
    tokens = load_tokens(state_dir)
    if copied_records(state_dir):
        if records or tokens:
            _log.warning(
                "event=sweep_skipped state_dir=%s: %d group records and %d tokens were copied from another "
                "state directory with this one; they name its engine's processes, which are left alone",
                state_dir,
                len(records),
                len(tokens),
            )
        for rec in records:
            rec.remove(state_dir)
        for token in tokens:
            remove_token(state_dir, token)
        _remove_journals(state_dir)
        return 0, []
    recorded = load_recorded_parent(state_dir)
    leaves = unwatched_leaves(*recorded) if recorded is not None else []
    if not records and not tokens and not leaves:
        _remove_journals(state_dir)
        return 0, []
    targets = find_record_processes(records)
    targets.update(find_marked_processes(tokens))
    count = len(set(targets).union(*(leaf.procs() for leaf in leaves)))  # a leaf's are often marked too
    fields = {"state_dir": state_dir, "processes": count, "grace_seconds": grace_seconds}
    _log.info("sweeping", extra={"fields": fields})
    survivors = end_processes(
        targets, grace_seconds=grace_seconds, kill_wait_seconds=kill_wait_seconds, leaves=leaves, force=force
    )
    _log.info("swept", extra={"fields": {"state_dir": state_dir, "survivors": len(survivors)}})
    for rec in records:
        rec.remove(state_dir)
    for token in tokens:
        remove_token(state_dir, token)
    _remove_journals(state_dir)
    return count, survivors


def _remove_journals(state_dir: str) -> None:
    """Remove every group journal left (one whose token file was lost too)."""
    for path in records_dir(state_dir).glob(f"{JOURNAL_PREFIX}*"):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
