"""Where a standalone engine lives: its state directory and the path of its socket.

The socket is ``<state_dir>/engine.sock``. A Unix socket path holds at most 107 bytes (``sun_path`` is
108 bytes with its NUL), so for a deeper state directory the socket goes to a private runtime directory
(``$XDG_RUNTIME_DIR/gadget-engine``, else ``/tmp/gadget-engine-<uid>``, mode 0700) under a name derived
from the state directory, and ``<state_dir>/engine.sock.path`` names it. Clients read that file first.

Standard library only (``platformdirs`` is imported when the default state directory is asked for): the
clients import this module. A client believes ``engine.sock.path`` only when the state directory and the
file are its user's own, and talks only to a socket whose peer runs as its user (``_client``).
"""

from __future__ import annotations

import hashlib
import os
import stat
from typing import Final, NamedTuple

from .._errors import UntrustedPathError
from .._lockfile import LOCK_NAME, parse_lock_line
from .._trust import open_own_file, read_pointer

__all__ = [
    "SOCKET_NAME",
    "SOCKET_POINTER_NAME",
    "STATE_DIR_ENV",
    "SUN_PATH_MAX",
    "LockState",
    "choose_socket_path",
    "default_state_dir",
    "find_socket_path",
    "lock_holder",
    "lock_state",
    "resolve_state_dir",
    "staging_socket_path",
]

SOCKET_NAME: Final = "engine.sock"
SOCKET_POINTER_NAME: Final = "engine.sock.path"
STATE_DIR_ENV: Final = "GADGET_ENGINE_STATE_DIR"
#: The longest socket path the kernel takes, in bytes (``sizeof(sun_path) - 1``).
SUN_PATH_MAX: Final = 107


def default_state_dir() -> str:
    """The state directory when none is given: the one ``EngineConfig().resolved_state_dir()`` names."""
    import platformdirs  # only here: a client given its state directory needs the standard library alone

    return platformdirs.user_state_dir("gadget-engine")


def resolve_state_dir(state_dir: str | None) -> str:
    """The absolute state directory: ``state_dir``, else ``$GADGET_ENGINE_STATE_DIR``, else the default."""
    chosen = state_dir if state_dir else os.environ.get(STATE_DIR_ENV) or None
    if chosen is None:
        return default_state_dir()
    return os.path.abspath(os.path.expanduser(chosen))


def _fits(path: str) -> bool:
    return len(os.fsencode(path)) <= SUN_PATH_MAX


def _private_dir(path: str) -> str:
    """Create ``path`` (0700) if needed; ``""`` when it is a real directory of ours that no one else can
    use, else why not (``"/tmp/gadget-engine-0 is a symbolic link"``)."""
    try:
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            os.makedirs(path, mode=0o700, exist_ok=True)
            info = os.lstat(path)
    except OSError as exc:
        return f"{path}: {exc.strerror or exc}"
    if stat.S_ISLNK(info.st_mode):
        return f"{path} is a symbolic link"
    if not stat.S_ISDIR(info.st_mode):
        return f"{path} is not a folder"
    if info.st_uid != os.getuid():
        return f"{path} is owned by uid {info.st_uid}, not by this user (uid {os.getuid()})"
    if stat.S_IMODE(info.st_mode) != 0o700:
        try:
            os.chmod(path, 0o700)
        except OSError as exc:
            return f"{path} cannot be made private: {exc.strerror or exc}"
    return ""


def staging_socket_path(path: str) -> str:
    """Where ``serve`` binds its socket before renaming it to ``path`` (``engine.new`` beside
    ``engine.sock``): the same folder, a shorter name, so it fits wherever ``path`` does."""
    folder, name = os.path.split(path)
    return os.path.join(folder, name.removesuffix(".sock") + ".new")


def choose_socket_path(state_dir: str) -> str:
    """The path ``serve`` binds for ``state_dir``: ``<state_dir>/engine.sock`` when it fits.

    Otherwise ``<runtime dir>/<16 hex digits of the state dir's hash>.sock``; the runtime directory is
    ``$XDG_RUNTIME_DIR/gadget-engine`` when that is set and can be made private to this user, else
    ``/tmp/gadget-engine-<uid>`` (0700, owned by this user).

    Raises:
        OSError: no runtime directory could be made private, or even its path is too long.
    """
    path = os.path.join(state_dir, SOCKET_NAME)
    if _fits(path):
        return path
    why = []
    for candidate in _runtime_candidates(state_dir):
        refused = _private_dir(os.path.dirname(candidate))
        if not refused:
            return candidate
        why.append(refused)
    because = f" ({'; '.join(why)})" if why else ""
    raise OSError(
        f"no private runtime directory for the socket of {state_dir!r}{because}; use a shorter --state-dir"
    )


def _runtime_candidates(state_dir: str) -> list[str]:
    """The runtime-directory socket paths that fit, in the order :func:`choose_socket_path` tries them."""
    name = hashlib.sha256(os.fsencode(state_dir)).hexdigest()[:16] + ".sock"
    runtimes = [os.path.join("/tmp", f"gadget-engine-{os.getuid()}")]
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isabs(xdg):  # what platformdirs.user_runtime_dir gives, without its warning when unset
        runtimes.insert(0, os.path.join(xdg, "gadget-engine"))
    return [path for runtime in runtimes if _fits(path := os.path.join(runtime, name))]


def find_socket_path(state_dir: str) -> str:
    """The socket a client connects to: the one ``engine.sock.path`` names, else the default one.

    The pointer is believed only when the state directory and the file are this user's own (owner,
    mode, no symbolic link: ``engine._trust.read_pointer``); an unreadable one counts as none.

    Raises:
        UntrustedPathError: the state directory or its pointer file is not this user's own.
    """
    try:
        named = read_pointer(state_dir, SOCKET_POINTER_NAME)
    except UntrustedPathError:
        raise
    except OSError:
        named = None
    if named:
        return named
    default = os.path.join(state_dir, SOCKET_NAME)
    if _fits(default):
        return default
    # A state dir too deep for its own socket and no pointer (yet): where serve would bind, made nowhere
    # here; a client then finds nothing there (no engine runs) instead of failing on the path's length.
    return next(iter(_runtime_candidates(state_dir)), default)


class LockState(NamedTuple):
    """The state directory's lock, as :func:`lock_state` read it."""

    #: the pid of the process holding the lock, or ``None`` when nobody does
    holder: int | None
    #: the pid the last engine to take the lock wrote in the file (as text; it writes it as it takes it)
    written: str
    #: when the file was last written: its modification time, in ns
    written_ns: int
    #: the phase that engine wrote with its pid (``_lockfile``: ``starting``, ``open``, ``serving``,
    #: ``stopping``; ``""`` from an earlier version)
    phase: str = ""
    #: its kind: ``serve``, ``mcp`` or ``embedded`` (``""`` likewise)
    kind: str = ""

    @property
    def own_line(self) -> bool:
        """Whether the line was written by the holder itself (an engine writes it as it takes the lock)."""
        return self.written == str(self.holder)


def lock_state(state_dir: str) -> LockState | None:
    """The lock of ``<state_dir>/lock``: who holds it and what the last engine wrote in it; ``None`` when
    the file cannot be read (missing, not a regular file of ours).

    The holder is read from ``/proc/locks`` (an ``flock`` write lock on the lock file's device and inode),
    so a client can name a live engine whose socket is missing; a lock file's stale pid never counts.
    Where the device numbers do not match (some overlay filesystems), the inode and the pid the engine
    wrote in the file must both match.
    """
    path = os.path.join(state_dir, LOCK_NAME)
    try:
        # A regular file of ours only: a FIFO planted there blocked the open (the engine refuses it).
        fd = open_own_file(path, os.O_RDONLY, what="the state directory's lock")
        with open(fd, encoding="ascii") as f:
            info = os.fstat(f.fileno())
            written, phase, kind = parse_lock_line(f.read(256))
        with open("/proc/locks", encoding="ascii") as f:
            lines = f.readlines()
    except (OSError, ValueError):
        return None
    where = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}:{info.st_ino}"
    holder: int | None = None
    for line in lines:
        fields = line.split()  # "1: FLOCK  ADVISORY  WRITE 4242 fe:00:2146433 0 EOF" ("->": a waiter)
        if len(fields) < 6 or fields[1:4] != ["FLOCK", "ADVISORY", "WRITE"] or not fields[4].isdigit():
            continue
        if fields[5] == where or (fields[5].endswith(f":{info.st_ino}") and fields[4] == written):
            holder = int(fields[4])
            break
    return LockState(holder, written, info.st_mtime_ns, phase, kind)


def lock_holder(state_dir: str) -> int | None:
    """The pid of the process that holds ``<state_dir>/lock`` (the engine running there), or ``None``
    (see :func:`lock_state`)."""
    state = lock_state(state_dir)
    return None if state is None else state.holder
