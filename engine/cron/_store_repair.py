"""Repairing a damaged job store: a new store from every row that can be read, the damaged one kept.

``gadget-engine serve --repair`` (``EngineConfig(repair_store=True)``) runs this when the open check
(``_store_check``) finds the store damaged. The rows are read from a scratch copy (the damaged files are
never changed), table by table and, where SQLite cannot read a table whole, key by key; each row is kept
only when it reads back as its record. The new store replaces the old one under its name; the old pair
stays next to it as ``cron.sqlite3.damaged-<UTC time>`` (and ``-wal``), which SQLite can open.
"""

from __future__ import annotations

import logging
import os
import shutil
import sqlite3
import tempfile
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Final

from .._errors import StoreError
from ._migrations import migrate
from ._rows import EVENT_COLUMNS, event_of, job_of, pending_of, text_factory, watch_state_of

__all__ = ["Connect", "repair_store"]

logger = logging.getLogger("engine.cron")

#: Makes a connection (autocommit) to a path.
Connect = Callable[[str], sqlite3.Connection]

#: A table that cannot be read whole is read row by row, up to this many keys.
_PROBE_LIMIT: Final = 1_000_000


def _columns(conn: sqlite3.Connection, table: str) -> list[str]:
    return [row[1] for row in conn.execute(f"PRAGMA table_info({table})")]


def _salvage(conn: sqlite3.Connection, table: str, key: str, columns: list[str]) -> tuple[list[Any], int]:
    """The rows of ``table`` that SQLite can still give, and how many keys it could not read."""
    select = f"SELECT {', '.join(columns)} FROM {table}"
    try:
        return conn.execute(f"{select} ORDER BY {key}").fetchall(), 0
    except sqlite3.DatabaseError:
        pass  # the table cannot be read whole: key by key
    tops = []
    for query in (
        f"SELECT max({key}) FROM {table}",
        f"SELECT seq FROM sqlite_sequence WHERE name = '{table}'",
    ):
        try:
            row = conn.execute(query).fetchone()
        except sqlite3.DatabaseError:
            continue
        if row and isinstance(row[0], int):
            tops.append(row[0])
    rows, lost = [], 0
    for k in range(1, min(max(tops, default=0), _PROBE_LIMIT) + 1):
        try:
            row = conn.execute(f"{select} WHERE {key} = ?", (k,)).fetchone()
        except sqlite3.DatabaseError:
            lost += 1
            continue
        if row is not None:
            rows.append(row)
    return rows, lost


def _readable_jobs(rows: list[Any], columns: list[str]) -> tuple[list[Any], int]:
    at = {name: i for i, name in enumerate(columns)}
    kept = []
    for row in rows:
        values = list(row)
        try:
            job_of(values[at["id"]], values[at["data"]])
        except ValueError:
            continue
        for column, read in (("pending_fire", pending_of), ("watch_state", watch_state_of)):
            if column in at:
                try:
                    read(values[at[column]])
                except ValueError:
                    values[at[column]] = None  # the job is kept, this part of it cannot be
        kept.append(values)
    return kept, len(rows) - len(kept)


def _readable_events(rows: list[Any], columns: list[str]) -> tuple[list[Any], int]:
    at = {name: i for i, name in enumerate(columns)}
    wanted = [at[name.strip()] for name in EVENT_COLUMNS.split(",")]
    kept = []
    for row in rows:
        try:
            event_of(tuple(row[i] for i in wanted))
        except (ValueError, KeyError, IndexError):
            continue
        kept.append(list(row))
    return kept, len(rows) - len(kept)


def _copy_in(new: sqlite3.Connection, table: str, columns: list[str], rows: list[Any]) -> None:
    known = set(_columns(new, table))
    keep = [i for i, name in enumerate(columns) if name in known]
    if not rows or not keep:
        return
    names = ", ".join(columns[i] for i in keep)
    marks = ", ".join("?" * len(keep))
    new.executemany(
        f"INSERT OR IGNORE INTO {table} ({names}) VALUES ({marks})", ([row[i] for i in keep] for row in rows)
    )


def repair_store(path: str, connect: Connect) -> str:
    """Build a new store at ``path`` from every row of the old one that can be read; keep the old one.

    The damaged file (and its write-ahead log) stays next to the new one as
    ``<path>.damaged-<UTC time>`` (``-wal``); SQLite can open that pair for a manual recovery. The rows
    are read from a scratch copy, so the damaged files are never changed. A job whose pending fire or
    watch state cannot be read is kept without it.

    Returns:
        What was kept and where the damaged file went, one line.

    Raises:
        StoreError: the new store cannot be written; the old files are as they were.
    """
    folder = os.path.dirname(path) or "."
    scratch = tempfile.mkdtemp(prefix=".cron-repair-", dir=folder)
    try:
        copy = os.path.join(scratch, "damaged.sqlite3")
        for suffix in ("", "-wal"):
            if os.path.lexists(path + suffix):
                shutil.copyfile(path + suffix, copy + suffix, follow_symlinks=False)
        jobs: list[Any] = []
        events: list[Any] = []
        job_columns: list[str] = []
        event_columns: list[str] = []
        unread = dropped_jobs = dropped_events = 0
        try:
            old = connect(copy)
            old.text_factory = text_factory
            try:
                job_columns = _columns(old, "jobs")
                event_columns = _columns(old, "events")
                if job_columns:
                    raw, lost = _salvage(old, "jobs", "seq", job_columns)
                    jobs, dropped_jobs = _readable_jobs(raw, job_columns)
                    unread += lost
                if event_columns:
                    raw, lost = _salvage(old, "events", "cursor", event_columns)
                    events, dropped_events = _readable_events(raw, event_columns)
                    unread += lost
            finally:
                old.close()
        except sqlite3.DatabaseError as exc:
            logger.error("cron store: nothing can be read from the damaged store %s (%s)", path, exc)
        fresh = os.path.join(scratch, "repaired.sqlite3")
        try:
            new = connect(fresh)
            try:
                migrate(new, fresh)
                new.execute("BEGIN IMMEDIATE")
                _copy_in(new, "jobs", job_columns, jobs)
                _copy_in(new, "events", event_columns, events)
                new.execute("COMMIT")
            finally:
                new.close()
        except sqlite3.Error as exc:
            raise StoreError(f"cannot write the repaired job store next to {path}: {exc}") from exc
        os.chmod(fresh, 0o600)
        aside = f"{path}.damaged-{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}"
        # Keep the damaged pair under its new name (hard links: atomic, no copy), then drop its log
        # before the new file takes the name, so the old log is never applied to the new store.
        for suffix in ("", "-wal"):
            if os.path.lexists(path + suffix):
                os.link(path + suffix, aside + suffix)
        for suffix in ("-wal", "-shm", "-journal"):
            if os.path.lexists(path + suffix):
                os.unlink(path + suffix)
        os.replace(fresh, path)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    skipped = dropped_jobs + dropped_events + unread
    return (
        f"kept {len(jobs)} jobs and {len(events)} events; {skipped} rows could not be read "
        f"({dropped_jobs} jobs, {dropped_events} events, {unread} unreadable keys); "
        f"the damaged file is kept as {aside}"
    )
