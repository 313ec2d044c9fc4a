"""The log files of the commands cron runs (a ``Command`` job's in ``cron-logs/``, a watched command's in
``watch-logs/``): made fresh in a folder of the state directory and handed to the supervisor as
descriptors, kept within the engine's log cap while the command writes them, and removed with their job.

The engine trusts nothing at a path in its state directory (``docs/security.md``): a command it ran
earlier, with the engine's own uid, may have put a symbolic link or a FIFO where its next log goes. So the
folder is reached without following a link, whatever is at a log's name is removed (never followed,
truncated or waited on) and a new file is made there with ``O_EXCL`` (:func:`~engine._trust.open_own_file`).
The supervisor gets the descriptors, not the paths, so nothing can be swapped between the check and the
child's start.

While the command runs, each log is kept within ``EngineConfig.log_cap_bytes`` as a subprocess's is
(:meth:`~engine._logs.LogFile.enforce_cap`: the oldest part dropped, punched out where the filesystem can,
on the very inode made here): a chatty test run watched by an on-exit job cannot fill the state
directory's disk. The fire reads only the end. A job's logs stay after its fire, for a person to read
(one pair per job: an arm removes the older arms' files), and go when the job is removed.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator, Mapping, Sequence
from typing import Final, NoReturn

import trio

from .._errors import SpawnError, UntrustedPathError
from .._logs import LogFile
from .._trust import open_own_file, open_own_folder
from ._spare_files import SpareFiles

__all__ = [
    "COMMAND_LOGS",
    "WATCH_LOGS",
    "command_log_paths",
    "keep_within_cap",
    "log_files",
    "open_logs",
    "remove_entry",
    "remove_job_logs",
    "remove_older_arms",
    "remove_watch_entries",
    "trim_logs",
]

#: The folder of ``Command`` jobs' logs in the state directory.
COMMAND_LOGS: Final = "cron-logs"
#: The folder of watched commands' logs, exit records and start marks in the state directory.
WATCH_LOGS: Final = "watch-logs"
#: The cap's first look after the start, and its longest wait while no log grows (seconds).
_FIRST_LOOK_SECONDS: Final = 1.0
_QUIET_LOOK_SECONDS: Final = 30.0
_FAST_LOOK_SECONDS: Final = 0.1

_FLAGS = os.O_WRONLY | os.O_APPEND
_WHY = "bad log file"


def open_logs(*paths: str, spares: SpareFiles | None = None) -> list[int]:
    """New, empty log files at ``paths``, opened for appending (mode 0600); their folders are made (mode
    0700) when missing. With ``spares`` (of the paths' folder), a spare file is taken for each path while
    there is one (:meth:`SpareFiles.take`), before a new file is made: no inode is allocated for it.

    Returns:
        One descriptor per path, in order; the caller closes them once the child has started.

    Raises:
        SpawnError: a folder or a name cannot be used (a link in the folder's place, a directory at a
            log's name, another owner), or the disk refuses the file; no descriptor is left open.
    """
    fds: list[int] = []
    folders: dict[str, int] = {}
    try:
        for path in paths:
            try:
                folder = os.path.dirname(path)
                if folder not in folders:
                    folders[folder] = _folder(folder)
                spare = (
                    None if spares is None else spares.take(os.path.basename(path), folders[folder], _FLAGS)
                )
                if spare is not None:
                    fds.append(spare)
                    continue
                fds.append(open_own_file(path, _FLAGS, what="the log", folder_fd=folders[folder], fresh=True))
            except UntrustedPathError as exc:
                _close(fds)
                message = f"cannot make the log file: {exc}"
                raise SpawnError(message, errno=errno.EPERM, path=path, reason=_WHY) from None
            except OSError as exc:
                _close(fds)
                message = f"cannot make the log file {path}: {exc.strerror or exc}"
                raise SpawnError(message, errno=exc.errno, path=path, reason=_WHY) from None
    finally:
        _close(list(folders.values()))
    return fds


def _folder(path: str) -> int:
    """The log folder, opened (:func:`~engine._trust.open_own_folder`); made first when it is missing."""
    try:
        return open_own_folder(path, "the log")
    except FileNotFoundError:
        os.makedirs(path, mode=0o700, exist_ok=True)
        return open_own_folder(path, "the log")


def _close(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def log_files(paths: Sequence[str], fds: Sequence[int]) -> list[LogFile]:
    """The logs :func:`open_logs` made at ``paths`` (its descriptors ``fds``, still open), each tied to
    its inode: a file put at the path later is not this log, and the cap leaves it alone."""
    files = []
    for path, fd in zip(paths, fds, strict=True):
        info = os.fstat(fd)
        files.append(LogFile(path, identity=(info.st_dev, info.st_ino)))
    return files


async def keep_within_cap(files: Sequence[LogFile], cap_bytes: int) -> NoReturn:
    """Keep each log of ``files`` within ``cap_bytes`` until cancelled (run it beside the command's wait).

    Args:
        files: the logs (:func:`log_files`; a ``LogFile`` by path alone takes its inode at the first look).
        cap_bytes: the size each keeps on disk (``EngineConfig.log_cap_bytes``), in bytes.

    A look comes 1 s after the start, then every second while a log grows (every 0.1 s while one grows
    by more than a quarter of the cap between two looks: ``yes`` writes a gigabyte a second), and at an
    interval that doubles up to 30 s while none does: a quiet command costs a look every half minute.
    Call :func:`trim_logs` once the command has ended, for what it wrote after the last look.

    Cancellation: the only way it ends; a look under way in its worker thread finishes first.
    """
    wait: float = _FIRST_LOOK_SECONDS
    sizes: list[int] | None = None
    while True:
        await trio.sleep(wait)
        seen = await trio.to_thread.run_sync(_enforce, files, cap_bytes)
        growth = max((new - old for new, old in zip(seen, sizes or seen, strict=True)), default=0)
        if growth > cap_bytes // 4:
            wait = _FAST_LOOK_SECONDS
        else:
            wait = _FIRST_LOOK_SECONDS if seen != sizes else min(2 * wait, _QUIET_LOOK_SECONDS)
        sizes = seen


async def trim_logs(files: Sequence[LogFile], cap_bytes: int) -> None:
    """One last look of the cap at ``files``, once their command has ended (a worker thread)."""
    await trio.to_thread.run_sync(_enforce, files, cap_bytes)


def _enforce(files: Sequence[LogFile], cap_bytes: int) -> list[int]:
    """One look of the cap at each of ``files``; the size each had then (bytes)."""
    for log in files:
        log.enforce_cap(cap_bytes)
    return [log.seen_bytes for log in files]


def remove_entry(path: str) -> None:
    """Remove whatever is at ``path`` in a log folder: a file, a link (never followed), a FIFO, or a folder
    a command made at the name, with what is in it (``shutil.rmtree``, which follows no link either). A
    missing entry, or one that cannot be removed, is left (housekeeping; blocking)."""
    try:
        os.unlink(path)
    except IsADirectoryError:
        shutil.rmtree(path, ignore_errors=True)
    except OSError:
        pass


def command_log_paths(state_dir: str, job_id: str) -> tuple[str, str]:
    """The stdout and stderr logs of a ``Command`` job: ``<state_dir>/cron-logs/<job_id>.std*.log``."""
    folder = os.path.join(state_dir, COMMAND_LOGS)
    return (os.path.join(folder, f"{job_id}.stdout.log"), os.path.join(folder, f"{job_id}.stderr.log"))


def remove_watch_entries(state_dir: str, job_id: str, *, but_arm: str | None = None) -> None:
    """Remove every entry of ``job_id``'s watched commands in ``watch-logs/`` (logs, exit records, marks,
    and whatever a command put at their names: :func:`remove_entry`), but those of the arm ``but_arm``.
    Housekeeping (blocking): an entry that cannot be removed is left for the next time."""
    remove_older_arms(state_dir, {job_id: but_arm})


def remove_older_arms(state_dir: str, kept: Mapping[str, str | None]) -> None:
    """:func:`remove_watch_entries` for each job of ``kept`` (job id -> the arm whose entries stay, or
    ``None``), with one listing of the folder for all of them (the arms a ``reconcile`` started together:
    100 listings of a folder of 400 entries cost 0.1-0.4 s of CPU here)."""
    folder = os.path.join(state_dir, WATCH_LOGS)
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        if any(_older(name, cut, kept) for cut in _dots(name)):
            remove_entry(os.path.join(folder, name))


def _dots(name: str) -> Iterator[int]:
    start = name.find(".")
    while start >= 0:
        yield start
        start = name.find(".", start + 1)


def _older(name: str, cut: int, kept: Mapping[str, str | None]) -> bool:
    """Whether ``name`` is an entry of the job ``name[:cut]`` of ``kept`` that is not of its kept arm."""
    job_id = name[:cut]
    if job_id not in kept:
        return False
    arm = kept[job_id]
    return arm is None or not name.startswith(f"{arm}.", cut + 1)


def remove_job_logs(state_dir: str, job_id: str) -> None:
    """Remove what is left of ``job_id``'s logs: a ``Command`` job's pair and every entry of its watched
    commands (blocking: a worker thread, or a job's last clean-up)."""
    for path in command_log_paths(state_dir, job_id):
        remove_entry(path)
    remove_watch_entries(state_dir, job_id)
