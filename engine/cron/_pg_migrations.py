"""The fleet store's schema in PostgreSQL, one numbered step per version (table ``gadget_schema``).

As for SQLite (``_migrations``), :data:`PG_MIGRATIONS` holds one step per version: ``PG_MIGRATIONS[n]``
takes a database from version ``n`` to ``n + 1``, each in a transaction of its own that also records the
version; a database of a newer version is refused. Engines of a fleet may start together: each step
holds a transaction-level advisory lock (:data:`MIGRATION_LOCK`), so one engine applies it and the
others find it applied. A released step never changes.

Every table is prefixed ``gadget_`` so the store can share a database with other tables. The job record
is the same JSON as in SQLite; the columns beside it (``owner``, ``floats``, ``due_at``) copy what the
claims filter and sort on, and are written with the record in every transaction.

History: 1 creates the jobs, the event log and the heartbeats.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from .._errors import StoreError

__all__ = ["EVENTS_LOCK", "MIGRATION_LOCK", "PG_MIGRATIONS", "PG_SCHEMA_VERSION", "migrate_pg"]

#: Advisory lock keys (``pg_advisory_xact_lock``): schema steps, and appends to the event log.
MIGRATION_LOCK: Final = 0x6761646765740001
EVENTS_LOCK: Final = 0x6761646765740002

#: One schema step: runs ``cursor.execute`` inside the transaction that records the new version.
PgMigration = Callable[[Any], None]


def _create_tables(cur: Any) -> None:
    """0 -> 1: the jobs, the event log and the heartbeats."""
    cur.execute(
        """CREATE TABLE gadget_jobs (
            seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            id TEXT NOT NULL UNIQUE,
            data TEXT NOT NULL,
            project TEXT,
            owner TEXT,
            floats BOOLEAN NOT NULL,
            due_at TIMESTAMPTZ,
            pending_fire TEXT,
            watch_state TEXT
        )"""
    )
    cur.execute("CREATE INDEX gadget_jobs_due ON gadget_jobs (due_at) WHERE due_at IS NOT NULL")
    cur.execute(
        """CREATE TABLE gadget_events (
            cursor BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            fire_id TEXT NOT NULL UNIQUE,
            job_id TEXT NOT NULL,
            project TEXT,
            job_name TEXT NOT NULL,
            text TEXT NOT NULL,
            command TEXT,
            exit_code INTEGER,
            signal INTEGER,
            reason TEXT,
            duration_seconds DOUBLE PRECISION,
            stdout_tail TEXT NOT NULL,
            stderr_tail TEXT NOT NULL,
            truncated BOOLEAN NOT NULL,
            acked BOOLEAN NOT NULL,
            engine_id TEXT,
            floats BOOLEAN NOT NULL,
            leased_until TIMESTAMPTZ,
            logged_at TIMESTAMPTZ NOT NULL DEFAULT now()
        )"""
    )
    cur.execute("CREATE INDEX gadget_events_unacked ON gadget_events (cursor) WHERE NOT acked")
    cur.execute(
        """CREATE TABLE gadget_engines (
            engine_id TEXT PRIMARY KEY,
            host TEXT NOT NULL,
            pid INTEGER NOT NULL,
            version TEXT NOT NULL,
            containment TEXT NOT NULL,
            live_runs INTEGER NOT NULL,
            started_at TIMESTAMPTZ NOT NULL,
            beat_at TIMESTAMPTZ NOT NULL
        )"""
    )


def _add_notices(cur: Any) -> None:
    """1 -> 2: ``gadget_notices``, the subprocess exit notices persisted before they are recorded
    (``_notices``); each belongs to the engine whose subprocess exited (``owner``)."""
    cur.execute(
        """CREATE TABLE gadget_notices (
            seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            fire_id TEXT NOT NULL UNIQUE,
            job_id TEXT NOT NULL,
            project TEXT,
            owner TEXT,
            fire TEXT NOT NULL
        )"""
    )


#: The steps, in order: ``PG_MIGRATIONS[n]`` takes a database from version ``n`` to ``n + 1``.
PG_MIGRATIONS: tuple[PgMigration, ...] = (_create_tables, _add_notices)
#: The schema version this engine writes.
PG_SCHEMA_VERSION = len(PG_MIGRATIONS)


def _version(cur: Any) -> int:
    cur.execute("SELECT max(version) FROM gadget_schema")
    row = cur.fetchone()
    return 0 if row is None or row[0] is None else int(row[0])


def migrate_pg(conn: Any, where: str, migrations: tuple[PgMigration, ...] = PG_MIGRATIONS) -> None:
    """Bring the database to the newest version, one step per transaction, under the migration lock.

    Args:
        conn: a psycopg connection in autocommit mode.
        where: the store (a URL without its password), for messages.
        migrations: the steps (tests pass a prefix, to write an older version).

    Raises:
        StoreError: the database has a version newer than ``migrations`` know.
        psycopg.Error: a step failed; the database stays at the version before it.
    """
    newest = len(migrations)
    with conn.transaction(), conn.cursor() as cur:
        cur.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
        cur.execute("CREATE TABLE IF NOT EXISTS gadget_schema (version INTEGER NOT NULL)")
        version = _version(cur)
    if version > newest:
        raise StoreError(
            f"the job store {where} has schema {version}, newer than this engine's {newest}; "
            "upgrade the engine"
        )
    while version < newest:
        with conn.transaction(), conn.cursor() as cur:
            cur.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
            version = _version(cur)
            if version < newest:
                migrations[version](cur)
                version += 1
                cur.execute("INSERT INTO gadget_schema (version) VALUES (%s)", (version,))
