"""Starting one child with a clean slate: the compiled spawn (``_spawn_direct``), else ``posix_spawn``.

Python's ``os.posix_spawn`` has ``setsid``, ``setsigdef`` and ``setsigmask`` but no way to change the
child's working directory, and ``subprocess.Popen`` has a working directory but cannot reset an inherited
``SIG_IGN`` or the signal mask without ``preexec_fn`` (which the design rules out). So we call the C library
directly: ``posix_spawn_file_actions_addchdir_np`` (glibc 2.29) and ``_addclosefrom_np`` (glibc 2.34) give
the child its cwd and close every descriptor above 2. glibc's ``posix_spawn`` uses ``CLONE_VFORK`` and
reports an ``exec`` failure as an error number, so a missing executable is an exception here, never a
child that "exited 127".

The call blocks only until the child has exec'd (well under a millisecond), so the supervisor makes it on
the Trio thread instead of paying a worker-thread hop.
"""

from __future__ import annotations

import ctypes
import errno as errno_mod
import fcntl
import functools
import os
import signal
import stat
import threading
from collections.abc import Mapping, Sequence

from . import _libc, _spawn_direct
from ._errors import EngineError, SpawnError

__all__ = [
    "CgroupSpawnRefusedError",
    "Environment",
    "describe_exec_failure",
    "engine_environment",
    "resolve_executable",
    "shebang_interpreter",
    "spawn_process",
    "spawns_into_cgroup",
    "start_time_of",
]

# glibc's flag values (<spawn.h>); musl uses the same numbers.
_POSIX_SPAWN_SETSIGDEF = 0x04
_POSIX_SPAWN_SETSIGMASK = 0x08
_POSIX_SPAWN_SETSID = 0x80

# Opaque C types, over-allocated: glibc's are 80 (file actions), 336 (attr) and 128 (sigset) bytes.
_FILE_ACTIONS_SIZE = 256
_ATTR_SIZE = 1024
_SIGSET_SIZE = 256

#: Signals reset to their default disposition in every child, whatever the engine inherited.
_DEFAULT_SIGNALS = tuple(s for s in range(1, 32) if s not in (signal.SIGKILL, signal.SIGSTOP))

_O_FLAGS_READ = os.O_RDONLY


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise OSError(rc, f"{what}: {os.strerror(rc)}")


def _cstrings(items: Sequence[bytes]) -> ctypes.Array[ctypes.c_char_p]:
    return (ctypes.c_char_p * (len(items) + 1))(*items, None)


def resolve_executable(command: str, cwd: str, path_var: str | None) -> str:
    """Find the file ``command`` names, the way ``execvp`` would, relative to the child's ``cwd``.

    A name with a slash is taken relative to ``cwd``; a bare name is looked up in ``path_var`` (the
    child's ``PATH``, else ``os.defpath``). As in ``execvp``, a match that is not executable is kept only
    when nothing executable is found, so the error says "permission denied" and not "not found".

    Raises:
        SpawnError: ``ENOENT`` "command not found" when nothing matches.
    """
    if "/" in command:
        return os.path.normpath(os.path.join(cwd, command))
    fallback: str | None = None
    for directory in (path_var if path_var is not None else os.defpath).split(os.pathsep):
        candidate = os.path.join(cwd, directory or ".", command)
        try:
            st = os.stat(candidate)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and os.access(candidate, os.X_OK):
            return candidate
        if fallback is None:
            fallback = candidate
    if fallback is not None:
        return fallback
    # A PATH the caller set for the child (create -e PATH=...) is named: it is not the one the user sees.
    own = os.environ.get("PATH", os.defpath)
    searched = "PATH" if path_var in (None, own) else f"the PATH set for it ({path_var or 'empty'})"
    raise SpawnError(
        f"command not found: {command!r} is not in {searched}; give a path or install it",
        errno=errno_mod.ENOENT,
        path=command,
        reason="command not found",
    )


def describe_exec_failure(err: int, command: str, path: str) -> SpawnError:
    """Turn an ``exec`` error number into a message that names the file and the cause (also for a
    program checked before it is run, as ``cron`` does for a ``Command`` job)."""
    if err == errno_mod.EACCES:
        if os.path.isdir(path):
            reason = "is a directory"
            message = f"cannot run {command!r}: permission denied, it is a directory ({path})"
        else:
            reason = "permission denied"
            message = (
                f"cannot run {command!r}: permission denied, the file is not executable ({path}); "
                "chmod +x it or run it through its interpreter"
            )
    elif err == errno_mod.ENOENT:
        interpreter = shebang_interpreter(path)
        if os.path.exists(path) and interpreter is not None:
            reason = "bad interpreter"
            message = (
                f"cannot run {command!r}: its interpreter {interpreter!r} (from the #! line of {path}) "
                "does not exist"
            )
        else:
            reason = "command not found"
            message = f"command not found: {command!r} ({path} does not exist)"
    elif err == errno_mod.E2BIG:
        reason = "argument list too long"
        message = (
            f"cannot run {command!r}: its arguments and environment together are more than the kernel takes "
            "in one exec (argument list too long); pass large data through a file or stdin"
        )
    elif err == errno_mod.ENOEXEC:
        reason = "exec format error"
        message = f"cannot run {command!r}: exec format error, {path} is not a program or script"
    else:
        reason = os.strerror(err).lower()
        message = f"cannot run {command!r}: {reason} ({path})"
    return SpawnError(message, errno=err, path=command, reason=reason)


def shebang_interpreter(path: str) -> str | None:
    """The interpreter the ``#!`` line of the file at ``path`` names; ``None`` without such a line, or
    when it is not a regular file we can read (a FIFO never blocks the look)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        head = os.read(fd, 256) if stat.S_ISREG(os.fstat(fd).st_mode) else b""
    except OSError:
        return None
    finally:
        os.close(fd)
    if not head.startswith(b"#!"):
        return None
    line = head[2:].split(b"\n", 1)[0].strip()
    return os.fsdecode(line.split()[0]) if line else None


@functools.cache
def _spawn_attr() -> ctypes.Array[ctypes.c_char]:
    """The spawn attributes every child gets, built once: a new session, every catchable signal at its
    default disposition, an empty signal mask. ``posix_spawn`` only reads them, so one copy serves every
    spawn (glibc copies the signal sets into the attributes)."""
    libc = _libc.require()
    attr = ctypes.create_string_buffer(_ATTR_SIZE)
    sigdef = ctypes.create_string_buffer(_SIGSET_SIZE)
    sigmask = ctypes.create_string_buffer(_SIGSET_SIZE)
    _check(libc.posix_spawnattr_init(attr), "posix_spawnattr_init")
    libc.sigemptyset(sigdef)
    for sig in _DEFAULT_SIGNALS:
        libc.sigaddset(sigdef, sig)
    libc.sigemptyset(sigmask)
    _check(libc.posix_spawnattr_setsigdefault(attr, sigdef), "setsigdefault")
    _check(libc.posix_spawnattr_setsigmask(attr, sigmask), "setsigmask")
    flags = _POSIX_SPAWN_SETSID | _POSIX_SPAWN_SETSIGDEF | _POSIX_SPAWN_SETSIGMASK
    _check(libc.posix_spawnattr_setflags(attr, ctypes.c_short(flags)), "setflags")
    return attr


def engine_environment() -> dict[bytes, bytes]:
    """A copy of this process's environment as the OS holds it (bytes), without decoding it.

    ``os.environb`` and ``os.environ`` share one table of bytes; copying that table costs a microsecond
    where rebuilding it from ``os.environ`` decodes and encodes every variable again.
    """
    data = getattr(os.environb, "_data", None)
    if isinstance(data, dict):
        return dict(data)
    return {os.fsencode(k): os.fsencode(v) for k, v in os.environ.items()}


Environment = Mapping[str, str] | Mapping[bytes, bytes]


def _encoded(text: str | bytes) -> bytes:
    return text if isinstance(text, bytes) else os.fsencode(text)


def _env_entries(env: Environment) -> tuple[list[bytes], str | None]:
    """``NAME=value`` entries of ``env`` and its ``PATH`` (for :func:`resolve_executable`)."""
    entries: list[bytes]
    try:  # the supervisor's own environment is bytes throughout: joined without a call per variable
        entries = [k + b"=" + v for k, v in env.items()]  # type: ignore[operator,misc]  # str: TypeError
    except TypeError:
        entries = [_encoded(k) + b"=" + _encoded(v) for k, v in env.items()]
    path = env.get("PATH", env.get(b"PATH"))  # type: ignore[call-overload]  # a str or a bytes key
    return entries, None if path is None else os.fsdecode(path)


def _bad_cwd(cwd: str) -> SpawnError:
    return SpawnError(
        f"working directory {cwd!r} does not exist or is not a directory",
        errno=errno_mod.ENOENT,
        path=cwd,
        reason="bad cwd",
    )


#: Nanoseconds per clock tick of ``/proc/<pid>/stat`` start times (``None``: not a whole number).
_TICK_NS = 10**9 // os.sysconf("SC_CLK_TCK") if 10**9 % os.sysconf("SC_CLK_TCK") == 0 else None


class _LastStart(threading.local):
    """The start time of the last child the compiled spawn started on this thread, ``(pid, clock ticks
    since boot)``: per thread, so that engines on two threads of one host never read each other's."""

    known: tuple[int, int] = (0, 0)


_last_start = _LastStart()


class CgroupSpawnRefusedError(EngineError, OSError):
    """The compiled spawn could not start the child in the cgroup asked for (no child was made): the
    caller spawns again with this process moved into the cgroup, which reports the cause as before."""


class CgroupKilledAtBirthError(CgroupSpawnRefusedError):
    """The child was killed as it was born in the cgroup asked for, before it ran (it was reaped: nothing
    is left). The kernel does that to every process cloned into a cgroup whose ``cgroup.kill`` was written
    since the cgroup was made (its own, or an ancestor's: ``echo 1 > <parent>/cgroup.kill``), as Linux
    6.18 does; a new cgroup of the same name is not affected, so the caller makes the cgroup again."""


def spawn_process(
    argv: Sequence[str],
    *,
    cwd: str,
    env: Environment,
    stdout_fd: int | None,
    stderr_fd: int | None,
    stdin_fd: int | None = None,
    cgroup_fd: int | None = None,
) -> int:
    """Start ``argv`` as the leader of a new session and return its pid.

    The child gets: stdin from ``/dev/null`` (or ``stdin_fd``); stdout and stderr on the given
    descriptors (``None`` means ``/dev/null``); every catchable signal at its default disposition and an
    empty signal mask; no other open descriptor; ``cwd`` as its working directory; exactly ``env`` as its
    environment. Started by the compiled spawn where it was built (``_spawn_direct``), else by glibc's
    ``posix_spawn``.

    Args:
        argv: the program and its arguments; ``argv[0]`` is resolved as :func:`resolve_executable` does.
        cwd: absolute working directory of the child.
        env: the complete environment, as strings or as bytes (:func:`engine_environment`).
        stdout_fd: descriptor the child's stdout is a copy of, or ``None``.
        stderr_fd: likewise for stderr.
        stdin_fd: descriptor the child's stdin is a copy of (the guardian's pipe), or ``None``.
        cgroup_fd: a descriptor of the cgroup v2 directory the child is born in; only when
            :func:`spawns_into_cgroup` (``None``: this process's cgroup).

    Raises:
        SpawnError: the executable is missing, not executable, a directory, has a missing interpreter, or
            the cwd is not a directory. Nothing is left running.
        CgroupSpawnRefusedError: ``cgroup_fd`` was given and the child could not be started there (or the
            compiled spawn turned out unusable meanwhile); nothing was started.
        CgroupKilledAtBirthError: ``cgroup_fd`` was given and the child was killed as it was born there
            (that cgroup had its ``cgroup.kill`` written); nothing is left.
        ValueError: an argument or a variable holds a NUL byte.
        OSError: ``ENOSYS`` when no C library can be loaded.
    """
    entries, path_var = _env_entries(env)
    try:
        path = resolve_executable(argv[0], cwd, path_var)
    except SpawnError:
        if not os.path.isdir(cwd):
            raise _bad_cwd(cwd) from None
        raise
    _last_start.known = (0, 0)  # for this child only: never a start time of an earlier one with its pid
    direct = _spawn_direct.direct_spawn()
    outcome: tuple[int, int] | None
    if direct is not None:
        outcome = _spawn_compiled(direct, path, argv, entries, cwd, stdin_fd, stdout_fd, stderr_fd, cgroup_fd)
    elif cgroup_fd is None:
        outcome = _posix_spawn(path, argv, entries, cwd, stdin_fd, stdout_fd, stderr_fd)
    else:
        outcome = None
    if outcome is None:
        raise CgroupSpawnRefusedError(
            errno_mod.EINVAL, "the child could not be started in the cgroup directly"
        )
    err, pid = outcome
    if err != 0:
        # The child's chdir fails as its exec would (ENOENT, ENOTDIR): told apart here, on the error path
        # only, instead of a look at the directory before every spawn.
        if not os.path.isdir(cwd):
            raise _bad_cwd(cwd)
        raise describe_exec_failure(err, argv[0], path)
    return pid


def _note_start(pid: int, before_ns: int, after_ns: int) -> None:
    """Keep the start time of child ``pid`` when the clock readings around its clone fall in one tick.

    The kernel stamps a new process with ``CLOCK_BOOTTIME`` inside the clone and shows it in
    ``/proc/<pid>/stat`` cut to whole ticks: readings before and after the clone in the same tick name
    that tick. (They straddle a tick boundary in a few spawns out of a hundred: ``/proc`` is read then.)
    """
    if _TICK_NS is not None and before_ns >= 0 and before_ns // _TICK_NS == after_ns // _TICK_NS:
        _last_start.known = (pid, before_ns // _TICK_NS)


def start_time_of(pid: int) -> int | None:
    """The start time (clock ticks since boot, as ``/proc/<pid>/stat`` field 22 says) of ``pid``, when
    it is the child the last :func:`spawn_process` of this thread started and the compiled spawn could
    tell it without a read of ``/proc`` (about 40 us while the child is still in its ``exec``); else
    ``None``."""
    known, ticks = _last_start.known
    return ticks if known == pid else None


def spawns_into_cgroup() -> bool:
    """Whether :func:`spawn_process` can start a child straight in a cgroup (``cgroup_fd``)."""
    return _spawn_direct.direct_spawn() is not None


def _blob(items: Sequence[bytes], what: str) -> bytes:
    """``items`` laid end to end, each ending in NUL (the compiled spawn splits them again)."""
    blob = b"\0".join(items) + b"\0" if items else b""
    if blob.count(0) != len(items):
        raise ValueError(f"{what} must not hold a NUL byte")
    return blob


def _spawn_compiled(
    direct: _spawn_direct.DirectSpawn,
    path: str,
    argv: Sequence[str],
    entries: list[bytes],
    cwd: str,
    stdin_fd: int | None,
    stdout_fd: int | None,
    stderr_fd: int | None,
    cgroup_fd: int | None,
) -> tuple[int, int] | None:
    """``(0, pid)``, or ``(error number, 0)`` when the exec or a step before it failed (nothing is left);
    ``None`` when ``cgroup_fd`` was given and no child could be made there. Without ``cgroup_fd``, a
    kernel found lacking what the compiled spawn needs turns it off and ``posix_spawn`` runs instead."""
    pid = ctypes.c_int(0)
    boottimes = (ctypes.c_int64 * 2)()
    rc = direct(
        os.fsencode(path),
        _blob([os.fsencode(a) for a in argv], "argv"),
        len(argv),
        _blob(entries, "the environment"),
        len(entries),
        os.fsencode(cwd),
        -1 if stdin_fd is None else stdin_fd,
        -1 if stdout_fd is None else stdout_fd,
        -1 if stderr_fd is None else stderr_fd,
        -1 if cgroup_fd is None else cgroup_fd,
        ctypes.byref(pid),
        boottimes,
    )
    if rc == 0:
        _note_start(pid.value, boottimes[0], boottimes[1])
    if rc >= 0:
        return rc, pid.value
    if -rc == _spawn_direct.KILLED_AT_BIRTH and cgroup_fd is not None:
        raise CgroupKilledAtBirthError(
            errno_mod.ECANCELED, "the child was killed as it was born: the cgroup's cgroup.kill was written"
        )
    if -rc in _spawn_direct.UNSUPPORTED:
        _spawn_direct.turn_off()
    if cgroup_fd is not None:
        return None
    if -rc in _spawn_direct.UNSUPPORTED:
        return _posix_spawn(path, argv, entries, cwd, stdin_fd, stdout_fd, stderr_fd)
    return -rc, 0  # the clone itself failed (EAGAIN, ENOMEM): as posix_spawn reports it


def _posix_spawn(
    path: str,
    argv: Sequence[str],
    entries: list[bytes],
    cwd: str,
    stdin_fd: int | None,
    stdout_fd: int | None,
    stderr_fd: int | None,
) -> tuple[int, int]:
    """glibc's ``posix_spawn`` with the file actions and attributes of :func:`spawn_process`:
    ``(0, pid)`` or ``(error number, 0)``."""
    sources = (stdin_fd, stdout_fd, stderr_fd)
    if any(fd is not None and fd < 3 and fd != target for target, fd in enumerate(sources)):
        # The file actions run in order: a source among 0-2 that an earlier action overwrites is copied
        # out of the way first (an engine started with a standard descriptor closed gets low numbers).
        moved = [None if fd is None else fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3) for fd in sources]
        try:
            return _posix_spawn(path, argv, entries, cwd, *moved)
        finally:
            for fd in moved:
                if fd is not None:
                    os.close(fd)
    libc = _libc.require()
    attr = _spawn_attr()

    fa = ctypes.create_string_buffer(_FILE_ACTIONS_SIZE)
    _check(libc.posix_spawn_file_actions_init(fa), "posix_spawn_file_actions_init")
    try:
        devnull = b"/dev/null"
        if stdin_fd is None:
            rc = libc.posix_spawn_file_actions_addopen(fa, 0, devnull, _O_FLAGS_READ, 0)
        else:
            rc = libc.posix_spawn_file_actions_adddup2(fa, stdin_fd, 0)
        _check(rc, "file action stdin")
        for target, fd in ((1, stdout_fd), (2, stderr_fd)):
            if fd is None:
                rc = libc.posix_spawn_file_actions_addopen(fa, target, devnull, os.O_WRONLY, 0)
            else:
                rc = libc.posix_spawn_file_actions_adddup2(fa, fd, target)
            _check(rc, "file action")
        _check(libc.posix_spawn_file_actions_addclosefrom_np(fa, 3), "addclosefrom_np")
        _check(libc.posix_spawn_file_actions_addchdir_np(fa, os.fsencode(cwd)), "addchdir_np")

        encoded = [os.fsencode(a) for a in argv]
        for items, what in ((encoded, "argv"), (entries, "the environment")):
            if any(0 in item for item in items):  # glibc would cut the string there
                raise ValueError(f"{what} must not hold a NUL byte")
        c_argv = _cstrings(encoded)
        c_env = _cstrings(entries)
        pid = ctypes.c_int(0)
        rc = libc.posix_spawn(ctypes.byref(pid), os.fsencode(path), fa, attr, c_argv, c_env)
    finally:
        libc.posix_spawn_file_actions_destroy(fa)
    return rc, pid.value
