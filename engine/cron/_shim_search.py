"""Finding the shims of arms whose watch state was never stored: by the exit file their argv names.

An engine killed between a watched command's spawn and the write of its :class:`WatchState` leaves only
the arm (:class:`ArmIntent`) in the store. Its shim runs on (``outlive_engine_crash``), as the leader of
its own session, with the arm's exit file in its argv (``_shell.shim_argv``: ``... EXIT_FILE -- ARGV``).
The next engine finds it there, once, at start-up, and adopts it as if the state had been stored.

A shim that was killed alone meanwhile is not there to find; its command may run on, in the session
the shim led. The record the shim reserved names its pid (``remove_reserved_by_any``), and
:func:`sessions_left` turns that into the group record the escalation ends, as a stored state's would.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Collection
from datetime import UTC, datetime
from typing import Final

from .._cgroup import WATCH_PREFIX, find_cgroup2
from .._procfs import now_ticks, read_marker, read_proc, scan_processes
from .._sweep import GroupRecord
from ._watch_state import ArmIntent, WatchState

__all__ = ["find_spawned", "sessions_left"]

#: How much earlier than its arm's time a process of a killed shim's session may have started (seconds):
#: the arm's time is the wall clock's, ``/proc`` counts ticks since boot, and each has its own rounding.
_START_SLACK_SECONDS: Final = 2.0


def _argv(pid: int) -> list[bytes] | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            data = f.read()
    except OSError:
        return None
    return data.split(b"\0")


def _named_exit_file(argv: list[bytes], wanted: Collection[bytes]) -> bytes | None:
    """The exit file ``argv`` runs a shim for, when it is one of ``wanted`` (followed by ``--``)."""
    for i, arg in enumerate(argv[:-1]):
        if arg in wanted and argv[i + 1] == b"--":
            return arg
    return None


def _ours(pid: int) -> bool:
    """Whether ``pid`` runs as this engine's user: no other user's process is taken for a shim (it would
    be watched, and signalled when its job changes)."""
    try:
        return os.stat(f"/proc/{pid}").st_uid == os.getuid()
    except OSError:
        return False


def _cgroup_of(pid: int) -> str | None:
    """The absolute path of ``pid``'s cgroup v2, or ``None`` when there is no v2 hierarchy to name it."""
    found, _ = find_cgroup2()
    if found is None:
        return None
    text = ""
    with contextlib.suppress(OSError), open(f"/proc/{pid}/cgroup", encoding="utf-8", errors="replace") as f:
        text = f.read()
    rel = next((line[3:] for line in text.splitlines() if line.startswith("0::")), None)
    return None if rel is None else os.path.normpath(os.path.join(found.mount, rel.lstrip("/")))


def find_spawned(arms: Collection[ArmIntent]) -> dict[str, WatchState]:
    """The shims of ``arms`` that run now, as the watch states their engine would have stored, by arm id.

    One pass over ``/proc`` (synchronous: call it in a worker thread). A process counts as an arm's shim
    when its argv names the arm's exit file followed by ``--``, it leads its own session (the supervisor
    starts every run so), it has not exited, it runs as this process's user, and its environment holds a
    run marker. Its cgroup is kept only where it is a watched command's leaf (``w-...``); the caller
    trusts it as it trusts a stored one (``watched_leaf``).
    """
    by_file = {os.fsencode(arm.exit_file): arm for arm in arms}
    found: dict[str, WatchState] = {}
    if not by_file:
        return found
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        argv = _argv(pid)
        exit_file = _named_exit_file(argv, by_file) if argv else None
        if exit_file is None:
            continue
        info = read_proc(pid)
        if info is None or info.zombie or info.sid != pid or not _ours(pid):
            continue
        marker = read_marker(pid)
        if marker is None:
            continue
        cgroup = _cgroup_of(pid)
        if cgroup is not None and not os.path.basename(cgroup).startswith(WATCH_PREFIX):
            cgroup = None
        arm = by_file[exit_file]
        found[arm.arm_id] = arm.spawned(pid=pid, start_time=info.start_time, marker=marker, cgroup=cgroup)
    return found


def sessions_left(arm: ArmIntent, shim_pids: Collection[int]) -> list[GroupRecord]:
    """What the killed shims ``shim_pids`` of ``arm`` left running: for each shim's session that still
    has a process, the record the escalation ends it by (``find_record_processes``, ``end_processes``).

    One pass over ``/proc`` (synchronous: call it in a worker thread). A shim led its own session, so its
    command's processes have the shim's pid as their session id. Only processes started since the arm
    was stored (less :data:`_START_SLACK_SECONDS`) count, and none where the pid runs again (a live
    leader is another process now, not the dead shim). The record carries the run marker one of the
    processes holds in its environment, when one does: then the command's processes that left its
    session are found by it too, as for a stored state.

    Args:
        arm: the arm whose shims were killed (its ``started_at`` bounds the start times).
        shim_pids: the pids the shims' reserved records named.
    """
    ago = (datetime.now(UTC) - arm.started_at).total_seconds() + _START_SLACK_SECONDS
    bound = max(0, now_ticks() - int(ago * os.sysconf("SC_CLK_TCK")))
    wanted = set(shim_pids)
    sessions: dict[int, list[int]] = {}
    for info in scan_processes():
        if info.sid in wanted and not info.zombie:
            if info.pid == info.sid:  # the pid leads a session again: another process's now
                wanted.discard(info.sid)
                sessions.pop(info.sid, None)
            elif info.start_time >= bound:
                sessions.setdefault(info.sid, []).append(info.pid)
    records = []
    for sid, pids in sessions.items():
        if sid not in wanted:
            continue
        markers = (read_marker(pid) for pid in pids)
        marker = next((m for m in markers if m is not None and _watched_marker(m)), "")
        records.append(GroupRecord(pgid=sid, sid=sid, start_time=bound, marker=marker))
    return records


def _watched_marker(marker: str) -> bool:
    """Whether ``marker`` has the form of a watched command's run marker (``<token>w:<run id>``)."""
    token, sep, run_id = marker.partition("w:")
    return bool(sep) and token.isalnum() and run_id.isdigit()
