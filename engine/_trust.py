"""Whether a path is the engine's own to trust: its owner, its mode, its kind, never a symbolic link.

The engine often runs as a user's own daemon and sometimes as root. Whatever it finds in its state
directory it acts on: the job store holds commands it runs, ``groups/`` names process groups it signals
at start-up, ``engine.sock.path`` tells a client where to send a request (with the environment it
carries). So the state directory and each of those entries is trusted only when it is *ours*:

- owned by the engine's effective uid (root trusts only root's files, too);
- not writable by group or others (``chmod 700`` fixes it);
- the kind expected (a directory, a regular file, a socket), and never a symbolic link, which is
  neither followed nor chmod'ed.

The state directory itself may be reached through a symbolic link (the user chose the path); the
directory it resolves to is checked. Everything in it is looked at with ``lstat``.

Clients use :func:`read_pointer` before they trust ``engine.sock.path``. Standard library only: the
clients import this module.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator, Mapping
from typing import Final, Literal

from ._errors import UntrustedPathError

__all__ = [
    "STATE_ENTRIES",
    "Kind",
    "check_entry",
    "check_stat",
    "check_state_dir",
    "describe_problem",
    "make_state_dir",
    "open_own_file",
    "open_own_folder",
    "ours_or_roots",
    "read_pointer",
    "what_it_is",
]

Kind = Literal["directory", "file", "socket"]

#: What the engine keeps in its state directory, and the kind each must be (checked when present).
STATE_ENTRIES: Final[Mapping[str, Kind]] = {
    "lock": "file",
    "cron.sqlite3": "file",
    "cron.sqlite3-wal": "file",
    "cron.sqlite3-shm": "file",
    "cron.sqlite3-journal": "file",
    "engine.sock": "socket",
    "engine.sock.path": "file",
    "engine.sock.path.tmp": "file",
    "engine.new": "socket",
    "guardian.log": "file",
    "cgroup.path": "file",
    "groups": "directory",
    "watch-logs": "directory",
    "cron-logs": "directory",
}
#: Folders of the state directory whose every entry must be a regular file of ours. Not ``watch-logs``:
#: what a watched command puts there (a FIFO, a link, a folder at a log's or its exit record's name) is
#: never followed nor waited on (``cron._log_files``, ``cron._exit_record``), and must not stop a start.
_FOLDERS_OF_FILES: Final = ("groups",)
#: The longest pointer file a client reads, in bytes (a socket path is at most 107).
_POINTER_BYTES: Final = 4096

_KIND_TESTS: Final[Mapping[Kind, tuple[str, object]]] = {
    "directory": ("a directory", stat.S_ISDIR),
    "file": ("a regular file", stat.S_ISREG),
    "socket": ("a socket", stat.S_ISSOCK),
}


def what_it_is(mode: int) -> str:
    """What a file of ``mode`` is, for a message: "a FIFO", "a regular file", ..."""
    for test, name in (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return "a special file"


def describe_problem(info: os.stat_result, kind: Kind) -> str | None:
    """What makes a file with ``info`` (from ``lstat``) not ours to trust as a ``kind``, or ``None``."""
    name, test = _KIND_TESTS[kind]
    if stat.S_ISLNK(info.st_mode):
        return "is a symbolic link, which the engine does not follow"
    if not test(info.st_mode):  # type: ignore[operator]  # the stat.S_IS* predicates
        return f"is {what_it_is(info.st_mode)}, not {name}"
    euid = os.geteuid()
    if info.st_uid != euid:
        return f"is owned by uid {info.st_uid}, not by this engine's uid {euid}"
    writable = [who for who, bit in (("group", stat.S_IWGRP), ("others", stat.S_IWOTH)) if info.st_mode & bit]
    if writable:
        return f"is writable by {' and '.join(writable)} (mode {stat.S_IMODE(info.st_mode):04o})"
    return None


def ours_or_roots(info: os.stat_result) -> bool:
    """Whether a file or folder with ``info`` (from ``lstat``/``stat``) is one only this engine's user or
    root can have written: owned by either, not writable by group or others. The rule for the programs the
    engine runs or loads from its own package (the compiled shim, the compiled spawn), which root installs
    as often as the user does."""
    return info.st_uid in (os.geteuid(), 0) and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def check_stat(info: os.stat_result, path: str, kind: Kind, what: str, fix: str) -> None:
    """Raise :class:`UntrustedPathError` when ``info`` (of ``path``) is not ours as a ``kind``.

    Args:
        info: ``lstat`` (or ``fstat``) of ``path``.
        path: the path, for the message.
        kind: what it must be.
        what: what it is to the engine, for the message ("the job store").
        fix: how to fix it, for the message.
    """
    problem = describe_problem(info, kind)
    if problem is not None:
        raise UntrustedPathError(f"{what} {path} {problem}; {fix}")


def _state_fix(state_dir: str) -> str:
    """The fix the message offers for the state directory, from what is wrong with it."""
    try:
        info = os.stat(state_dir)
    except OSError:
        return "use another --state-dir"
    if not stat.S_ISDIR(info.st_mode):  # chmod cannot make a folder of a file
        return "give a folder, or use another --state-dir"
    if info.st_uid != os.geteuid():  # chmod by its owner would not make it ours
        return "use another --state-dir, or run the engine as the folder's owner"
    return f"run `chmod 700 {state_dir}` as its owner, or use another --state-dir"


def check_entry(state_dir: str, name: str, kind: Kind, *, what: str | None = None) -> bool:
    """Check the entry ``name`` of the state directory if it exists; whether it exists.

    Raises:
        UntrustedPathError: it exists but is not ours (see the module).
    """
    path = os.path.join(state_dir, name)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return False
    fix = "remove it (the engine makes its own), or use another --state-dir"
    check_stat(info, path, kind, what or f"the state directory's {name!r}", fix)
    return True


def make_state_dir(state_dir: str) -> None:
    """Create the state directory (mode 0700, whatever the umask) if it is missing, and check it.

    Raises:
        UntrustedPathError: it is not ours: another owner, writable by group or others, not a directory.
        OSError: it cannot be created.
    """
    try:
        os.makedirs(state_dir, mode=0o700)
    except FileExistsError:
        pass
    else:
        os.chmod(state_dir, 0o700)  # makedirs' mode is filtered by the umask
    info = os.stat(state_dir)  # the state dir itself may be reached through a link the user chose
    check_stat(info, state_dir, "directory", "the state directory", _state_fix(state_dir))


def check_state_dir(state_dir: str) -> None:
    """Check the state directory and every entry the engine keeps in it (see the module).

    Run at start, before anything in it is read: a store, a group record or a pointer planted by
    someone else, or a symbolic link in their place, is refused here with a message naming it.

    Raises:
        UntrustedPathError: the directory or one of its entries is not ours.
        OSError: the directory cannot be read.
    """
    check_stat(os.stat(state_dir), state_dir, "directory", "the state directory", _state_fix(state_dir))
    for name, kind in STATE_ENTRIES.items():
        if check_entry(state_dir, name, kind) and name in _FOLDERS_OF_FILES:
            folder = os.path.join(state_dir, name)
            for entry in _entries(folder):
                what = f"the file {entry!r} in {name}/ of the state directory"
                check_entry(folder, entry, "file", what=what)


def _entries(folder: str) -> Iterator[str]:
    with os.scandir(folder) as scan:
        for entry in scan:
            yield entry.name


def open_own_file(
    path: str,
    flags: int,
    mode: int = 0o600,
    *,
    what: str,
    folder_too: bool = False,
    folder_fd: int | None = None,
    fresh: bool = False,
) -> int:
    """Open ``path`` without following a symbolic link, and check the file is a regular one of ours.

    ``O_NOFOLLOW``, ``O_NONBLOCK`` (a FIFO in its place never blocks the open) and ``O_CLOEXEC`` are
    added to ``flags``; ``O_NONBLOCK`` is cleared again once the file is known to be regular.

    Args:
        path: the file.
        flags: ``os.O_*`` flags of the open.
        mode: the mode of a file ``O_CREAT`` makes.
        what: what the file is to the engine, for a message ("the job store").
        folder_too: the file's folder (a folder of the state directory: ``watch-logs/``) is reached the
            same way: its parent is opened as it is (the state directory may be a link the user chose),
            the folder with ``O_NOFOLLOW | O_DIRECTORY`` from there, and it must be ours; the file is opened
            from the folder's descriptor. A folder swapped for a link meanwhile is refused, not followed.
        folder_fd: the folder, already opened so (:func:`open_own_folder`): ``path``'s name is opened
            from it (for several files of one folder).
        fresh: remove whatever is at ``path`` first (a link, a FIFO, an older file: never followed, never
            written) and make a new file (``O_CREAT | O_EXCL`` are added): for a log that starts empty.

    Returns:
        The descriptor (the caller closes it).

    Raises:
        UntrustedPathError: ``path`` or (``folder_too``) its folder is a symbolic link, not of the kind
            expected, or not ours.
        OSError: it cannot be opened (``FileNotFoundError``: it, or its folder, is missing).
    """
    name = os.path.basename(path)
    dir_fd = open_own_folder(os.path.dirname(path), what) if folder_too and folder_fd is None else folder_fd
    try:
        if fresh:
            flags |= os.O_CREAT | os.O_EXCL
            try:
                os.unlink(name if dir_fd is not None else path, dir_fd=dir_fd)
            except FileNotFoundError:
                pass
            except IsADirectoryError:
                raise UntrustedPathError(_not_regular(what, path, "a directory")) from None
        try:
            fd = os.open(
                name if dir_fd is not None else path,
                flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                mode,
                dir_fd=dir_fd,
            )
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UntrustedPathError(
                    f"{what} {path} is a symbolic link, which the engine does not follow; remove it"
                ) from None
            if exc.errno == errno.ENXIO:  # a FIFO with no reader, opened for writing
                raise UntrustedPathError(_not_regular(what, path, "a FIFO")) from None
            if exc.errno == errno.EISDIR:  # a directory, opened for writing
                raise UntrustedPathError(_not_regular(what, path, "a directory")) from None
            raise
    finally:
        if dir_fd is not None and dir_fd != folder_fd:
            os.close(dir_fd)
    try:
        check_stat(os.fstat(fd), path, "file", what, "remove it, or use another --state-dir")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _not_regular(what: str, path: str, kind: str) -> str:
    return f"{what} {path} is {kind}, not a regular file; remove it"


def open_own_folder(folder: str, what: str) -> int:
    """A descriptor of ``folder`` (a folder of the state directory), reached without following a link at
    its last step (its parent is opened as it is), checked a directory of ours; the caller closes it.

    Args:
        folder: the folder.
        what: what is in it to the engine, for a message ("the log").

    Raises:
        UntrustedPathError: it is a link, not a directory, or not ours.
        OSError: it cannot be opened (``FileNotFoundError``: it is missing).
    """
    folder = folder or "."
    parent = os.open(os.path.dirname(folder) or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(os.path.basename(folder), flags, dir_fd=parent)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            info = os.stat(os.path.basename(folder), dir_fd=parent, follow_symlinks=False)
            problem = describe_problem(info, "directory") or "is not a folder"
            raise UntrustedPathError(f"the folder of {what} {folder} {problem}; remove it") from None
        raise
    finally:
        os.close(parent)
    try:
        check_stat(os.fstat(fd), folder, "directory", f"the folder of {what}", "remove it")
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_own_file(path: str, text: str) -> None:
    """Replace ``path`` by a file of ours holding ``text`` (0600): written under ``<path>.tmp`` without
    following a link there, then renamed over ``path``, so a reader sees the old text or the new one.

    Raises:
        OSError: the file cannot be written (a link at the temporary name: ``ELOOP``).
    """
    temp = path + ".tmp"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.replace(temp, path)


def read_pointer(state_dir: str, name: str, *, what: str = "the socket pointer") -> str | None:
    """The first line of the state directory's pointer file ``name`` (``what`` it is, in an error), or
    ``None`` when there is none.

    The clients call this before they connect where ``engine.sock.path`` says: a pointer is believed
    only when the state directory and the file are ours (see the module). A missing state directory
    or file is ``None``.

    Raises:
        UntrustedPathError: the state directory or the pointer file is not ours.
    """
    try:
        info = os.stat(state_dir)
    except (FileNotFoundError, NotADirectoryError):
        return None
    check_stat(info, state_dir, "directory", "the state directory", _state_fix(state_dir))
    path = os.path.join(state_dir, name)
    try:
        fd = open_own_file(path, os.O_RDONLY, what=what)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        data = f.read(_POINTER_BYTES)
    text = data.decode("utf-8", "replace").strip()
    return text.splitlines()[0] if text else None
