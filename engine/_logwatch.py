"""Which log files were written since the log cap last looked: one-shot inotify watches on their inodes.

The log cap (``SubProcessService``) keeps every log within ``log_cap_bytes``. A log nobody writes cannot
grow, so it need not be looked at: instead of a ``stat`` of every log of every live child each second
(about 13 us per log: 26 ms of CPU per second for a thousand children), the cap arms a watch on each log
when it looks at it and, from then on, looks only at the logs that were written since.

Each watch is ``IN_MODIFY | IN_ONESHOT`` on the very inode the engine made: it is added through
``/proc/self/fd/<fd>`` of a descriptor that :class:`~engine._logs.LogFile` has checked (``O_NOFOLLOW``,
same device and inode), never by a path that could be a link. A write through any name of the file (a
hard link made elsewhere too) reports it. One-shot: a busy log reports once, then stays quiet until the
cap has looked at it and armed it again, so a log written a million times a second costs one event per
look. When the kernel's queue overflows, every log is looked at.

Used from a worker thread (arming, during the cap's pass) and from the Trio thread (reading, between
passes), never at the same time.
"""

from __future__ import annotations

import os
from collections.abc import Hashable
from typing import Any, Generic, TypeVar, final

import attrs

__all__ = ["LogWatch", "open_log_watch"]

K = TypeVar("K", bound=Hashable)

_IN_MODIFY = 0x00000002
_IN_Q_OVERFLOW = 0x00004000
_IN_IGNORED = 0x00008000
_IN_ONESHOT = 0x80000000


@final
@attrs.define(eq=False)
class LogWatch(Generic[K]):
    """One inotify instance whose watches report which logs (by key) were written. Made by
    :func:`open_log_watch`."""

    _inotify: Any = attrs.field(alias="inotify")
    _keys: dict[int, K] = attrs.field(init=False, factory=dict)

    def __repr__(self) -> str:
        return f"<LogWatch {len(self._keys)} armed>"

    def fileno(self) -> int:
        """The inotify descriptor: readable once an armed log was written."""
        fd: int = self._inotify.fileno()
        return fd

    def arm(self, fd: int, key: K) -> bool:
        """Report the next write to the file ``fd`` (a checked descriptor of the log) as ``key``.

        Returns:
            ``False`` when no watch could be added (the user's ``max_user_watches`` reached): the caller
            then looks at that log every time instead.
        """
        try:
            wd: int = self._inotify.add_watch(f"/proc/self/fd/{fd}", _IN_MODIFY | _IN_ONESHOT)
        except OSError:
            return False
        self._keys[wd] = key
        return True

    def take(self) -> tuple[set[K], bool]:
        """The keys of the logs written since they were armed (each watch is then spent), and whether
        the kernel's queue overflowed (then any log may have been written). Does not block."""
        written: set[K] = set()
        overflow = False
        for event in self._inotify.read(timeout=0):
            if event.mask & _IN_Q_OVERFLOW:
                overflow = True
                continue
            key = self._keys.pop(event.wd, None) if event.mask & _IN_IGNORED else self._keys.get(event.wd)
            if key is not None and event.mask & _IN_MODIFY:
                written.add(key)
        return written, overflow

    def close(self) -> None:
        """Close the inotify descriptor (every watch goes with it)."""
        self._keys.clear()
        self._inotify.close()


def open_log_watch() -> LogWatch[K] | None:
    """A :class:`LogWatch`, or ``None`` where inotify cannot be used (the cap then polls every log)."""
    try:
        from inotify_simple import INotify
    except ImportError:
        return None
    try:
        inotify = INotify(nonblocking=True)
    except OSError:
        return None
    if not os.path.isdir("/proc/self/fd"):
        inotify.close()
        return None
    return LogWatch(inotify=inotify)
