"""The job store's schema, one numbered step per version (``PRAGMA user_version``).

:data:`MIGRATIONS` holds one step per version: ``MIGRATIONS[n]`` takes a file from version ``n`` to
``n + 1``. Opening a store applies the missing steps in order, each in a transaction of its own that also
sets the version, so a file of any older version is brought up to date (a step is applied whole or not
at all) and a file of a newer one is refused. A change of the schema adds one step at the end; a released
step never changes, and reads only what the file held at its version (never today's record classes).

History: 1 creates the jobs and the event log; 2 adds ``events.acked`` (existing events count as acked,
except one whose fire is still pending on its job: a version-1 engine stopped between logging it and
``on_fire``); 3 adds ``jobs.project`` and ``events.project`` (the project id of a job and of its events;
``NULL`` for what existed: no job had a project before); 4 adds the ``notices`` table (subprocess exit
notices persisted before delivery, ``_notices``).
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable

from .._errors import StoreError
from ._notices import add_notices_table

__all__ = ["MIGRATIONS", "SCHEMA_VERSION", "Migration", "migrate"]

#: One schema step: runs inside the transaction that sets the new version.
Migration = Callable[[sqlite3.Connection], None]


def _create_tables(conn: sqlite3.Connection) -> None:
    """0 -> 1: the jobs and the event log."""
    conn.execute(
        """CREATE TABLE jobs (
            seq INTEGER PRIMARY KEY AUTOINCREMENT,
            id TEXT NOT NULL UNIQUE,
            data TEXT NOT NULL,
            pending_fire TEXT,
            watch_state TEXT
        )"""
    )
    conn.execute(
        """CREATE TABLE events (
            cursor INTEGER PRIMARY KEY AUTOINCREMENT,
            fire_id TEXT NOT NULL UNIQUE,
            job_id TEXT NOT NULL,
            job_name TEXT NOT NULL,
            text TEXT NOT NULL,
            command TEXT,
            exit_code INTEGER,
            signal INTEGER,
            reason TEXT,
            duration_seconds REAL,
            stdout_tail TEXT NOT NULL,
            stderr_tail TEXT NOT NULL,
            truncated INTEGER NOT NULL
        )"""
    )


def _add_events_acked(conn: sqlite3.Connection) -> None:
    """1 -> 2: ``events.acked``; an event whose fire is still pending on its job is not acked yet."""
    conn.execute("ALTER TABLE events ADD COLUMN acked INTEGER NOT NULL DEFAULT 1")
    for (text,) in conn.execute("SELECT pending_fire FROM jobs WHERE pending_fire IS NOT NULL").fetchall():
        try:
            pending = json.loads(text)
        except ValueError:
            continue  # unreadable: the store skips it (and logs it) when it reads the row
        if isinstance(pending, dict) and isinstance(pending.get("fire_id"), str):
            conn.execute("UPDATE events SET acked = 0 WHERE fire_id = ?", (pending["fire_id"],))


def _add_project(conn: sqlite3.Connection) -> None:
    """2 -> 3: ``jobs.project`` and ``events.project``, ``NULL`` for every existing row."""
    conn.execute("ALTER TABLE jobs ADD COLUMN project TEXT")
    conn.execute("ALTER TABLE events ADD COLUMN project TEXT")


#: The steps, in order: ``MIGRATIONS[n]`` takes a file from version ``n`` to ``n + 1``.
MIGRATIONS: tuple[Migration, ...] = (_create_tables, _add_events_acked, _add_project, add_notices_table)
#: The schema version this engine writes: the number of steps.
SCHEMA_VERSION = len(MIGRATIONS)


def _user_version(conn: sqlite3.Connection) -> int:
    version: int = conn.execute("PRAGMA user_version").fetchone()[0]
    return version


def migrate(conn: sqlite3.Connection, path: str, migrations: tuple[Migration, ...] = MIGRATIONS) -> None:
    """Bring the open database to the newest version, one step per transaction.

    Each step runs in a ``BEGIN IMMEDIATE`` transaction that also sets ``user_version``; the version is
    read again inside it, so a file another process migrated meanwhile is left as it is.

    Args:
        conn: a connection in autocommit mode (``isolation_level=None``).
        path: the file, for messages.
        migrations: the steps (tests pass a prefix, to write an older version).

    Raises:
        StoreError: the file has a version newer than ``migrations`` know.
        sqlite3.Error: a step failed; the file stays at the version before it.
    """
    newest = len(migrations)
    version = _user_version(conn)
    if version > newest:
        raise StoreError(
            f"the job store {path!r} has schema {version}, newer than this engine's {newest}; "
            "upgrade the engine"
        )
    while version < newest:
        conn.execute("BEGIN IMMEDIATE")
        try:
            version = _user_version(conn)
            if version < newest:
                migrations[version](conn)
                version += 1
                conn.execute(f"PRAGMA user_version={version}")
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.rollback()
            raise
