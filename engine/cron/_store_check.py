"""Opening the job store's file only when it is ours and whole; keeping what can be read of a damaged one.

SQLite itself shrinks a damaged store without a word: a write-ahead-log frame that fails its checksum
ends the log, and every transaction committed after it is dropped at the next checkpoint; a row that
cannot be read was skipped by the engine's readers. So opening the store (:func:`connect_checked`) first
checks, and refuses to start on, a store that would lose something:

- the files (``cron.sqlite3`` and its ``-wal``, ``-shm``, ``-journal``) must be regular files of the
  engine's user, never symbolic links (``engine._trust``); the file is created and chmod'ed through a
  descriptor opened with ``O_NOFOLLOW``;
- the write-ahead log, before SQLite sees it: a frame that fails its checksum followed by a committed
  transaction is damage (a torn tail of an uncommitted transaction, which a crash leaves, is not);
- the file itself: SQLite's ``PRAGMA quick_check`` (a truncated file, a broken page);
- every row: a job, pending fire, watch state or event that does not read back as its record.

A damaged store is a :class:`StoreError` naming the file and the way out: ``gadget-engine serve
--repair`` (``EngineConfig(repair_store=True)``), which builds a new store from every row that can be
read (``_store_repair.repair_store``) and keeps the damaged files next to it, as
``cron.sqlite3.damaged-<time>`` (and its ``-wal``), for a manual recovery.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import struct
from collections.abc import Iterator
from typing import Any, Final

from .._errors import StoreError
from .._trust import check_stat, open_own_file
from ._migrations import migrate
from ._rows import EVENT_COLUMNS, event_of, job_of, pending_of, text_factory, watch_state_of
from ._store_repair import Connect, repair_store

__all__ = ["DamagedStoreError", "connect_checked", "wal_problem"]

logger = logging.getLogger("engine.cron")

_WAL_MAGIC: Final = (0x377F0682, 0x377F0683)
_WAL_HEADER: Final = 32
_FRAME_HEADER: Final = 24
_SIDE_FILES: Final = ("-wal", "-shm", "-journal")


class DamagedStoreError(StoreError):
    """Raised by :func:`connect_checked` when the store would lose something if opened as it is."""


def _damaged(path: str, detail: str) -> DamagedStoreError:
    return DamagedStoreError(
        f"the job store {path} is damaged ({detail}); nothing was changed. To keep every row that can be "
        "read in a new store and move the damaged file aside, start once with `gadget-engine serve "
        "--repair` (embedded: EngineConfig(repair_store=True)), or restore the file from a backup"
    )


# ---- the write-ahead log ----------------------------------------------------------------------------


def _checksum(data: bytes, seed: tuple[int, int], big_endian: bool) -> tuple[int, int]:
    """SQLite's WAL checksum of ``data`` (a multiple of 8 bytes), continued from ``seed``."""
    words = struct.unpack(f"{'>' if big_endian else '<'}{len(data) // 4}I", data)
    s0, s1 = seed
    for i in range(0, len(words), 2):
        s0 = (s0 + words[i] + s1) & 0xFFFFFFFF
        s1 = (s1 + words[i + 1] + s0) & 0xFFFFFFFF
    return s0, s1


def _frames(f: Any, page_size: int) -> Iterator[tuple[int, bytes, bytes]]:
    index = 0
    while True:
        header = f.read(_FRAME_HEADER)
        page = f.read(page_size)
        if len(header) < _FRAME_HEADER or len(page) < page_size:
            return  # a torn last frame: what a crash mid-write leaves
        index += 1
        yield index, header, page


def wal_problem(path: str) -> str | None:
    """What in the write-ahead log at ``path`` SQLite would drop although it was committed, or ``None``.

    SQLite reads frames while each one's cumulative checksum holds; the first that fails ends the log.
    That is right for a torn tail (an uncommitted transaction cut by a crash), and silent loss when a
    *committed* transaction follows. The chain is followed past a bad frame with the checksums the frames
    store, so a later commit frame that is intact shows the loss.
    """
    try:
        fd = open_own_file(path, os.O_RDONLY, what="the job store's write-ahead log")
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        header = f.read(_WAL_HEADER)
        has_frames = os.fstat(f.fileno()).st_size > _WAL_HEADER + _FRAME_HEADER
        if len(header) < _WAL_HEADER:
            return None  # a log being created: nothing in it yet
        magic, _version, page_size = struct.unpack(">3I", header[:12])
        if magic not in _WAL_MAGIC:
            return "its write-ahead log has no valid header" if has_frames else None
        big_endian = bool(magic & 1)
        page_size = 65536 if page_size == 1 else page_size
        salt = header[16:24]
        stored = struct.unpack(">2I", header[24:32])
        if (
            _checksum(header[:24], (0, 0), big_endian) != stored
            or page_size & (page_size - 1)
            or page_size < 512
        ):
            return "its write-ahead log's header fails its checksum" if has_frames else None
        seed = stored
        first_bad = None
        for index, frame, page in _frames(f, page_size):
            if frame[8:16] != salt:
                break  # a frame of an earlier log generation: the log ends here
            stored = struct.unpack(">2I", frame[16:24])
            if _checksum(frame[:8] + page, seed, big_endian) != stored:
                first_bad = first_bad or index
            elif first_bad is not None and struct.unpack(">I", frame[4:8])[0]:
                return (
                    f"frame {first_bad} of its write-ahead log fails its checksum, and a transaction "
                    f"committed after it (frame {index}) would be dropped"
                )
            seed = stored
    return None


# ---- opening ----------------------------------------------------------------------------------------


def _check_side_files(path: str) -> None:
    for suffix in _SIDE_FILES:
        try:
            info = os.lstat(path + suffix)
        except FileNotFoundError:
            continue
        check_stat(
            info, path + suffix, "file", "the job store's file", "remove it, or use another --state-dir"
        )


def _prepare(path: str) -> tuple[int, int]:
    """Create the file (0600) through a descriptor that follows no link; its ``(st_dev, st_ino)``."""
    os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
    _check_side_files(path)
    fd = open_own_file(path, os.O_RDWR | os.O_CREAT, 0o600, what="the job store")
    try:
        os.fchmod(fd, 0o600)
        info = os.fstat(fd)
    finally:
        os.close(fd)
    return info.st_dev, info.st_ino


def _is_damage(exc: sqlite3.Error) -> bool:
    return getattr(exc, "sqlite_errorname", "") in ("SQLITE_CORRUPT", "SQLITE_NOTADB")


def _job_row_problems(job_id: object, data: object, pending: object, watch: object) -> Iterator[str]:
    for what, read, value in (
        ("pending fire", pending_of, pending),
        ("watch state", watch_state_of, watch),
    ):
        try:
            read(value)
        except ValueError as exc:
            yield f"the {what} of job {job_id!r}: {exc}"
    try:
        job_of(job_id, data)
    except ValueError as exc:
        yield f"the record of job {job_id!r}: {exc}"


def _unreadable_rows(conn: sqlite3.Connection) -> list[str]:
    bad: list[str] = []
    for row in conn.execute("SELECT id, data, pending_fire, watch_state FROM jobs"):
        bad.extend(_job_row_problems(*row))
    for row in conn.execute(f"SELECT {EVENT_COLUMNS} FROM events"):
        try:
            event_of(row)
        except ValueError as exc:
            bad.append(f"event {row[0]!r}: {exc}")
    return bad


def _open(path: str, connect: Connect) -> sqlite3.Connection:
    """Open the store after checking it; :class:`DamagedStoreError` when it would lose something."""
    identity = _prepare(path)
    problem = wal_problem(path + "-wal")
    if problem is not None:
        raise _damaged(path, problem)
    try:
        conn = connect(path)
    except sqlite3.Error as exc:
        raise StoreError(f"cannot open the job store {path!r}: {exc}") from exc
    try:
        conn.text_factory = text_factory
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute("PRAGMA busy_timeout=5000")
        info = os.lstat(path)
        if (info.st_dev, info.st_ino) != identity:
            raise StoreError(f"the job store {path} was replaced while it was opened; start again")
        checked = [row[0] for row in conn.execute("PRAGMA quick_check").fetchall()]
        if checked != ["ok"]:
            raise _damaged(path, "; ".join(str(c) for c in checked[:3]))
        migrate(conn, path)
        bad = _unreadable_rows(conn)
        if bad:
            more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
            raise _damaged(path, f"{len(bad)} rows cannot be read: {'; '.join(bad[:3])}{more}")
    except sqlite3.Error as exc:
        conn.close()
        if _is_damage(exc):
            raise _damaged(path, str(exc)) from None
        raise StoreError(f"cannot open the job store {path!r}: {exc}") from exc
    except BaseException:
        conn.close()
        raise
    return conn


def connect_checked(path: str, connect: Connect, *, repair: bool = False) -> sqlite3.Connection:
    """Open the store at ``path`` (``connect`` makes the connection), checked as the module says.

    Args:
        path: the store file.
        connect: makes a connection in autocommit mode to a path.
        repair: repair a damaged store (``_store_repair.repair_store``) and open the result, instead
            of refusing.

    Raises:
        DamagedStoreError: the store is damaged (and ``repair`` is false); nothing was changed.
        UntrustedPathError: a file of the store is a link, another user's or writable by others.
        StoreError: the file cannot be opened, or was written by a newer schema.
    """
    try:
        return _open(path, connect)
    except DamagedStoreError as exc:
        if not repair:
            raise
        logger.warning("cron store: %s; repairing", exc)
    report = repair_store(path, connect)
    logger.warning("cron store: repaired: %s", report)
    return _open(path, connect)
