"""The C library, loaded once for the whole engine.

Three parts of the engine call libc directly through ``ctypes``: spawning (glibc's ``posix_spawn`` and
its ``_np`` file actions), the subreaper (``prctl``) and the log cap (``fallocate``). They share one
handle, loaded on first use: looking the library up (``ctypes.util.find_library``) costs a few
milliseconds, and the guardian, which never calls libc, does not pay it at all.

Standard library only: the guardian imports this module (through ``_procfs``) without the engine's
third-party dependencies.
"""

from __future__ import annotations

import ctypes
import errno
import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ctypes import _NamedFuncPointer

__all__ = ["function", "libc", "require"]


@functools.cache
def libc() -> ctypes.CDLL | None:
    """The C library (with ``use_errno``), loaded on the first call; ``None`` where there is none."""
    import ctypes.util  # here, not above: it imports subprocess, which the guardian never needs

    try:
        return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    except OSError:
        return None


def function(name: str) -> _NamedFuncPointer | None:
    """The libc function ``name``, or ``None`` when there is no C library or it lacks the function.

    The function object is shared (``ctypes`` caches it on the library handle): a caller that sets
    ``argtypes`` sets them for every caller, so only the one module that uses a function sets them.
    """
    lib = libc()
    if lib is None:
        return None
    try:
        return getattr(lib, name)  # type: ignore[no-any-return]  # CDLL.__getattr__ is typed, getattr is not
    except AttributeError:
        return None


def require() -> ctypes.CDLL:
    """The C library, for callers that cannot work without it.

    Raises:
        OSError: ``ENOSYS`` when no C library can be loaded.
    """
    lib = libc()
    if lib is None:
        raise OSError(errno.ENOSYS, "no C library could be loaded; the engine needs glibc on Linux")
    return lib
