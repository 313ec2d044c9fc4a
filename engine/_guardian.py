"""The guardian: a small separate process that ends the engine's children if the engine dies.

The engine starts it (``python -c`` calling :func:`main`) in its own session, with a pipe from the engine
as its stdin and a log file in the state dir as stdout/stderr: it never touches the engine's stdio. The
engine writes one line per run started (``+ pgid sid start_time marker``) and ended (``- pgid
start_time``). When the pipe reaches end-of-file, the engine is gone: by a graceful exit (nothing left
registered) or by any death, SIGKILL included. Then the guardian finds every descendant of the registered
groups (group members, ``/proc`` parent links and the run marker), runs SIGINT -> grace -> SIGKILL on them
and removes their records. Runs spawned with ``outlive_engine_crash`` (on-exit watched commands) are
never registered, so they survive for the next engine to adopt.
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
from collections.abc import Iterator

from ._cgroup import find_cgroup2
from ._group_journal import apply_group_line
from ._sweep import (
    GroupRecord,
    end_processes,
    find_marked_processes,
    find_record_processes,
    remove_token,
    unwatched_leaves,
)

__all__ = ["BOOTSTRAP", "main"]

#: ``python -c`` code that runs :func:`main` without importing the ``engine`` package's ``__init__``
#: (trio and the rest): the guardian needs only ``_sweep`` and ``_procfs``, and starts in ~50 ms.
BOOTSTRAP = (
    "import sys, types; pkg = types.ModuleType('engine'); pkg.__path__ = [sys.argv[1]]; "
    "sys.modules['engine'] = pkg; from engine._guardian import main; sys.exit(main(sys.argv[2:]))"
)


#: After each read of the pipe, the guardian waits this long before it reads again: the lines the engine
#: writes meanwhile (two per run) are read together, and a busy engine wakes it 10 times a second at
#: most, not twice per run (each wake took a core from the engine's children, ~0.1 ms a run). Nothing is
#: lost: the engine's lines wait in the pipe, and every one is read before the guardian acts on
#: end-of-file; the engine's end closing (its stop, its death) ends the wait at once.
BATCH_SECONDS = 0.1


def _lines(fd: int) -> Iterator[str]:
    """The lines of the pipe ``fd`` until end-of-file, read in batches (see :data:`BATCH_SECONDS`).

    Between batches it waits on the pipe for nothing but the engine's end closing (``poll`` with no
    event asked: a hang-up is always reported, new lines are not), so end-of-file is seen at once.
    """
    closing = select.poll()
    closing.register(fd, 0)
    pending = b""
    while chunk := os.read(fd, 1 << 16):
        *complete, pending = (pending + chunk).split(b"\n")
        for raw in complete:
            yield raw.decode("utf-8", errors="replace")
        closing.poll(BATCH_SECONDS * 1000)
    if pending:
        yield pending.decode("utf-8", errors="replace")


def _log(message: str) -> None:
    print(f"guardian {os.getpid()}: {message}", flush=True)


def main(argv: list[str]) -> int:
    """The guardian process: read registrations until end-of-file, then end what is still registered.

    Lines: ``+ pgid sid start_time marker`` (a group started), ``- pgid start_time`` (it ended),
    ``T token start_time`` (every run of the engine carries the marker ``<token>:<run id>``, so a run
    spawned just before the engine died is found even before its group line arrived), ``C path`` (the
    engine's parent cgroup: every leaf under it but the watched commands' is ended).
    """
    state_dir, grace, kill_wait = argv[0], float(argv[1]), float(argv[2])
    live: dict[tuple[int, int], GroupRecord] = {}
    tokens: dict[str, int] = {}
    parents: list[str] = []
    for line in _lines(0):
        kind, _, rest = line.strip().partition(" ")
        try:
            if apply_group_line(live, kind, rest):
                continue
            if kind == "T":
                token, start = rest.split()
                tokens[token] = int(start)
            elif kind == "C":
                parents.append(rest)
        except ValueError:
            _log(f"ignored a bad line: {line!r}")
    os.close(0)
    found, _ = find_cgroup2()
    leaves = [leaf for path in parents if found is not None for leaf in unwatched_leaves(found, path)]
    targets = find_record_processes(live.values())
    targets.update(find_marked_processes(tokens))
    if not targets and not any(leaf.populated() for leaf in leaves):
        for leaf in leaves:
            leaf.remove()
        _remove_empty(parents)
        return 0
    _log(
        f"the engine is gone; ending {len(targets)} processes of {len(live)} groups and {len(leaves)} cgroups"
    )
    survivors = end_processes(targets, grace_seconds=grace, kill_wait_seconds=kill_wait, leaves=leaves)
    if survivors:
        _log(f"survivors after SIGKILL: {survivors}")
    for record in live.values():
        record.remove(state_dir)
    for token in tokens:
        remove_token(state_dir, token)
    for leaf in leaves:
        leaf.remove()
    _remove_empty(parents)
    return 0


def _remove_empty(parents: list[str]) -> None:
    """Remove the engine's parent cgroups that no leaf is left in (a watched command's keeps its own)."""
    for path in parents:
        with contextlib.suppress(OSError):  # not empty (a watched command's leaf), or gone already
            os.rmdir(path)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
