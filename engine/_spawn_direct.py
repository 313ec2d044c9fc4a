"""The compiled spawn: ``clone3`` straight into the child's cgroup, in one call (``_spawn_direct.c``).

``setup.py`` compiles ``_spawn_direct.c`` into the shared library ``_spawn_direct.bin`` next to this file at
install time (not ``.so``: Python would take a ``_spawn_direct.so`` for an extension module of this name). It
does in one ``ctypes`` call what ``_spawn`` otherwise asks of glibc's ``posix_spawn`` in a dozen (the file
actions built and freed per spawn), and in cgroup containment it starts the child in its leaf
(``CLONE_INTO_CGROUP``): the engine no longer moves itself into the leaf and back, two writes to
``cgroup.procs`` that each take the kernel's global lock on every process's cgroup for writing (about
0.07 ms each on a quiet machine, 0.7 ms under load).

Where the library was not built, is not ours to load, or the kernel lacks ``clone3`` (Linux 5.3),
``CLONE_INTO_CGROUP`` (5.7) or ``close_range`` (5.9), :func:`direct_spawn` is ``None`` and ``_spawn``
takes the ``posix_spawn`` path; a kernel found lacking turns the compiled path off for the process.

Standard library only (the guardian's spawns come through ``_spawn`` too).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import stat
from collections.abc import Callable

from ._trust import ours_or_roots

__all__ = ["ABI", "KILLED_AT_BIRTH", "LIBRARY", "UNSUPPORTED", "DirectSpawn", "direct_spawn", "turn_off"]

_HERE = os.path.dirname(os.path.abspath(__file__))
#: The compiled library, looked for here only.
LIBRARY = os.path.join(_HERE, "_spawn_direct.bin")

#: The version of ``gadget_spawn``'s arguments and answers this module expects (``gadget_spawn_abi``).
ABI = 3

#: ``gadget_spawn``'s answers (negated) meaning "this kernel cannot do it": no child was made.
UNSUPPORTED = frozenset({errno.ENOSYS, errno.E2BIG, errno.EINVAL})
#: The error (negated) ``gadget_spawn`` returns when the child was killed before it ran (the cgroup it
#: was cloned into had its ``cgroup.kill`` written: the kernel kills every process born there since).
KILLED_AT_BIRTH = errno.ECANCELED

#: ``(path, argv blob, argc, env blob, envc, cwd, stdin, stdout, stderr, cgroup fd, pid out, boot times)
#: -> rc``.
DirectSpawn = Callable[..., int]

_off = False


@functools.cache
def _load() -> DirectSpawn | None:
    """``gadget_spawn`` of the compiled library, loaded once; ``None`` when it is missing or not ours.

    The library runs inside the engine, so it is loaded only when nobody else can have put it there: a
    regular file (not a link) owned by this user or root and not writable by group or others, in the
    package's own folder, held to the same.
    """
    try:
        info = os.lstat(LIBRARY)
        folder = os.stat(_HERE)
    except OSError:
        return None
    if not stat.S_ISREG(info.st_mode) or not (ours_or_roots(info) and ours_or_roots(folder)):
        return None
    try:
        lib = ctypes.CDLL(LIBRARY)
        spawn = lib.gadget_spawn
        abi = lib.gadget_spawn_abi
    except (OSError, AttributeError):
        return None
    abi.restype, abi.argtypes = ctypes.c_int, []
    if abi() != ABI:
        return None  # left from another build: its arguments are not these
    c_int, c_char_p = ctypes.c_int, ctypes.c_char_p
    spawn.restype = c_int
    spawn.argtypes = [
        c_char_p,  # path
        c_char_p,  # argv: the strings laid end to end, each ending in NUL
        c_int,
        c_char_p,  # the environment, likewise
        c_int,
        c_char_p,  # cwd
        c_int,  # stdin, stdout, stderr (-1: /dev/null)
        c_int,
        c_int,
        c_int,  # the cgroup directory's descriptor (-1: the engine's own cgroup)
        ctypes.POINTER(c_int),  # the pid
        ctypes.POINTER(ctypes.c_int64),  # CLOCK_BOOTTIME before and after the clone
    ]
    return spawn


def direct_spawn() -> DirectSpawn | None:
    """The compiled spawn, or ``None`` when it cannot be used here (see the module)."""
    return None if _off else _load()


def turn_off() -> None:
    """Use the ``posix_spawn`` path from now on (the kernel lacks what the compiled one needs)."""
    global _off
    _off = True
