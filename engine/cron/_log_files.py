"""The log files of the commands cron runs (a ``Command`` job's in ``cron-logs/``, a watched command's in
``watch-logs/``): made fresh in a folder of the state directory, and handed to the supervisor as
descriptors.

The engine trusts nothing at a path in its state directory (``docs/security.md``): a command it ran
earlier, with the engine's own uid, may have put a symbolic link or a FIFO where its next log goes. So the
folder is reached without following a link, whatever is at a log's name is removed (never followed,
truncated or waited on) and a new file is made there with ``O_EXCL`` (:func:`~engine._trust.open_own_file`).
The supervisor gets the descriptors, not the paths, so nothing can be swapped between the check and the
child's start.
"""

from __future__ import annotations

import errno
import os

from .._errors import SpawnError, UntrustedPathError
from .._trust import open_own_file, open_own_folder

__all__ = ["open_logs"]

_FLAGS = os.O_WRONLY | os.O_APPEND
_WHY = "bad log file"


def open_logs(*paths: str) -> list[int]:
    """New, empty log files at ``paths``, opened for appending (mode 0600); their folders are made (mode
    0700) when missing.

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
