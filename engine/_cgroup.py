"""cgroup v2 containment on the file system: finding a writable hierarchy, the engine's parent, leaves.

Each run gets a *leaf*: a cgroup of its own under the engine's *parent* cgroup, which is named after the
state directory (``gadget-engine-<16 hex digits of its hash>``) and created under the engine's own v2
cgroup. Nothing a process does (double fork, ``setsid``, a scrubbed environment) takes it out of its
leaf; only a write to a ``cgroup.procs`` file moves it, and the engine never does that for a child. This
is systemd's ``KillMode=control-group`` without systemd, per run.

The child is *born* in its leaf (:meth:`EngineCgroup.spawn_in`): started there by ``clone3`` with
``CLONE_INTO_CGROUP`` where the compiled spawn was built (``_spawn_direct``). Else the engine moves itself
into the leaf, spawns (``posix_spawn`` returns once the child has exec'd), and moves itself back: glibc
2.36 has no ``posix_spawnattr_setcgroup_np``, and a shell wrapper writing to ``cgroup.procs`` would turn
``exec`` errors into exit 127. The two moves cost about 0.07 ms each on a quiet machine (each takes the
kernel's global lock on every process's cgroup for writing: 0.7 ms under load); those spawns are
serialised by a lock, and the engine forks nothing else meanwhile (in an embedding host, the host process
is moved for that moment too: documented in ``docs/guide-escalation.md``).

Everything here is synchronous and standard library only, so the guardian (which imports no Trio) and
the start-up sweep use it too. Waiting for a leaf to empty, without polling, is ``_cgroup_watch``.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import signal
import stat
import threading
from collections.abc import Callable, Iterator
from typing import Final, final

import attrs

from ._procfs import read_kernel_file
from ._trust import write_own_file

__all__ = [
    "PARENT_RECORD",
    "WATCH_PREFIX",
    "Cgroup2",
    "CgroupError",
    "EngineCgroup",
    "Leaf",
    "find_cgroup2",
    "load_recorded_parent",
    "parent_leaves",
    "parent_name",
    "populated_in",
    "remove_leaves",
    "watched_leaf",
]

#: The file in the state directory that names the engine's parent cgroup (for the guardian and the sweep).
PARENT_RECORD: Final = "cgroup.path"
#: Leaves of watched on-exit commands start with this; the guardian and the sweep leave them alone.
WATCH_PREFIX: Final = "w-"

_MOUNTS: Final = "/proc/self/mounts"
_SELF: Final = "/proc/self/cgroup"
#: Where distributions mount the v2 hierarchy: unified layout first, then the hybrid layout's v2 part.
_PREFERRED: Final = ("/sys/fs/cgroup", "/sys/fs/cgroup/unified")


class CgroupError(OSError):
    """Raised when a cgroup file cannot be used as the engine needs (the message says which and why)."""


def _unescape(field: str) -> str:
    """A path field of ``/proc/self/mounts``, where space, tab, newline and backslash are octal escapes."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


#: One ``read`` of a cgroup or ``/proc`` file; a shorter answer is the whole file (they are ``seq_file``s).
_READ_BYTES = 65536


def _read(path: str) -> str:
    return read_kernel_file(path, _READ_BYTES).decode("utf-8", "replace")


@attrs.frozen
class Cgroup2:
    """Where the engine's cgroup v2 lives.

    Attributes:
        mount: where the v2 hierarchy is mounted (``/sys/fs/cgroup``, or ``/sys/fs/cgroup/unified`` in a
            hybrid layout).
        own: the engine's own cgroup directory (absolute), from ``/proc/self/cgroup``.
    """

    mount: str
    own: str

    def relative(self, path: str) -> str:
        """``path`` as ``/proc/<pid>/cgroup`` names it: relative to the mount, with a leading ``/``."""
        rel = os.path.relpath(path, self.mount)
        return "/" if rel == "." else "/" + rel


def find_cgroup2() -> tuple[Cgroup2 | None, str]:
    """The v2 hierarchy this process is in, and why not when there is none.

    Reads ``/proc/self/mounts`` (mounts of type ``cgroup2``) and the ``0::`` line of ``/proc/self/cgroup``.
    A delegated subtree (``systemd-run --user --scope -p Delegate=yes``, a container with a private cgroup
    namespace) is found the same way: the path is relative to the namespace's root, which is what is
    mounted there.

    Returns:
        ``(Cgroup2, "")``, or ``(None, reason)`` with a short lowercase reason.
    """
    try:
        mounts = [
            _unescape(line.split()[1])
            for line in _read(_MOUNTS).splitlines()
            if line.split()[2:3] == ["cgroup2"]
        ]
        lines = _read(_SELF).splitlines()
    except (OSError, IndexError):
        return None, "cannot read /proc/self/mounts or /proc/self/cgroup"
    if not mounts:
        return None, "no cgroup2 hierarchy is mounted"
    rel = next((line[3:] for line in lines if line.startswith("0::")), None)
    if rel is None:
        return None, "this process is in no cgroup v2 (no 0:: line in /proc/self/cgroup)"
    ordered = [m for m in _PREFERRED if m in mounts] + [m for m in mounts if m not in _PREFERRED]
    for mount in ordered:
        own = os.path.normpath(os.path.join(mount, rel.lstrip("/")))
        if own.startswith(mount) and os.path.isdir(own):
            return Cgroup2(mount=mount, own=own), ""
    return None, f"the cgroup {rel!r} of this process is not under a cgroup2 mount ({', '.join(mounts)})"


def parent_name(state_dir: str) -> str:
    """The engine's parent cgroup name for ``state_dir``: ``gadget-engine-<16 hex digits>``."""
    return "gadget-engine-" + hashlib.sha256(os.fsencode(os.path.abspath(state_dir))).hexdigest()[:16]


def _flag_in(events: str, name: str) -> bool:
    """Whether the ``cgroup.events`` text ``events`` has ``<name> 1``."""
    for line in events.splitlines():
        key, _, value = line.partition(" ")
        if key == name:
            return value.strip() == "1"
    return False


def populated_in(events: str) -> bool:
    """Whether a ``cgroup.events`` text says a live process is in its cgroup (``populated 1``)."""
    return _flag_in(events, "populated")


@attrs.frozen
class Leaf:
    """One run's cgroup.

    Attributes:
        path: its directory.
        rel: its path as ``/proc/<pid>/cgroup`` shows it (``/gadget-engine-.../r12-ab34``).
    """

    path: str
    rel: str

    @property
    def name(self) -> str:
        """The leaf's directory name (``r<run id>-<token>``, or ``w-...`` for a watched command)."""
        return os.path.basename(self.path)

    @property
    def watched(self) -> bool:
        """Whether it holds a watched on-exit command (the guardian and the sweep skip it)."""
        return self.name.startswith(WATCH_PREFIX)

    @property
    def events_path(self) -> str:
        """Its ``cgroup.events`` file (``populated 0|1``); inotify reports a change as ``IN_MODIFY``."""
        return f"{self.path}/cgroup.events"

    def procs(self) -> list[int]:
        """The pids in the leaf now (zombies have left it); ``[]`` once it is removed."""
        try:
            return [int(p) for p in _read(f"{self.path}/cgroup.procs").split()]
        except FileNotFoundError:
            return []

    def populated(self) -> bool:
        """Whether a live process is in the leaf (``populated 1``); ``False`` once it is removed."""
        try:
            return populated_in(_read(self.events_path))
        except FileNotFoundError:
            return False

    def frozen(self) -> bool:
        """Whether the leaf is frozen (``frozen 1``: its ``cgroup.freeze`` or an ancestor's was written
        ``1``); ``False`` once it is removed."""
        try:
            return _flag_in(_read(self.events_path), "frozen")
        except FileNotFoundError:
            return False

    def holds(self, pid: int) -> bool:
        """Whether the process ``pid`` (zombies included) is in this leaf now."""
        try:
            text = _read(f"/proc/{pid}/cgroup")
        except (FileNotFoundError, ProcessLookupError):
            return False
        return any(line == f"0::{self.rel}" for line in text.splitlines())

    def signal(self, sig: int, *, pinned: dict[int, int] | None = None) -> None:
        """Send ``sig`` to every process in the leaf.

        Each pid is pinned with a pidfd and checked to be in the leaf before the signal goes through the
        pidfd, so a pid that exited and was reused outside the leaf meanwhile is never signalled.

        Args:
            sig: the signal.
            pinned: ``{pid: pidfd}`` of processes already pinned that are this leaf's while they are in
                it (the run's leader, not reaped): the signal goes through that pidfd with no check.
        """
        for pid in self.procs():
            fd = pinned.get(pid) if pinned else None
            if fd is not None:
                try:
                    signal.pidfd_send_signal(fd, sig)
                except ProcessLookupError:
                    pass
                continue
            try:
                pidfd = os.pidfd_open(pid)
            except OSError:
                continue  # gone meanwhile
            try:
                if self.holds(pid):
                    signal.pidfd_send_signal(pidfd, sig)
            except ProcessLookupError:
                pass
            finally:
                os.close(pidfd)

    def kill(self) -> None:
        """SIGKILL every process in the leaf at once (``cgroup.kill``), forks in flight included."""
        try:
            fd = os.open(f"{self.path}/cgroup.kill", os.O_WRONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return
        try:
            os.write(fd, b"1")
        except ProcessLookupError:
            pass
        finally:
            os.close(fd)

    def zombie_children(self, parent: int) -> list[int]:
        """Zombies whose parent is ``parent`` (the engine) and that were in this leaf when they exited.

        A zombie leaves ``cgroup.procs`` at once but keeps naming its cgroup until it is reaped, so the
        leaf is "gone" only once these are reaped, by their own pid.
        """
        out = []
        for pid in _children(parent):
            try:
                state = _read(f"/proc/{pid}/stat").rpartition(")")[2].split()[0]
            except (OSError, IndexError):
                continue
            if state in ("Z", "X") and self.holds(pid):
                out.append(pid)
        return out

    def cpu_usec(self) -> int | None:
        """CPU time the leaf's processes used, in microseconds (``cpu.stat`` ``usage_usec``), or ``None``."""
        try:
            text = _read(os.path.join(self.path, "cpu.stat"))
        except OSError:
            return None
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "usage_usec":
                return int(value)
        return None

    def memory_bytes(self) -> int | None:
        """Memory in use (``memory.current``, bytes) where the memory controller is on, else ``None``."""
        try:
            return int(_read(os.path.join(self.path, "memory.current")))
        except (OSError, ValueError):
            return None

    def remove(self) -> bool:
        """Remove the leaf's directory; ``True`` once it is gone (``False`` while a process is in it)."""
        try:
            os.rmdir(self.path)
        except FileNotFoundError:
            return True
        except OSError as exc:
            if exc.errno == errno.EBUSY:
                return False
            raise
        return True


def remove_leaves(leaves: list[Leaf]) -> list[bool]:
    """:meth:`Leaf.remove` of each leaf, ``False`` where it failed (still in use, or any other error): safe
    from a worker thread (nothing but ``rmdir``)."""
    removed = []
    for leaf in leaves:
        try:
            removed.append(leaf.remove())
        except OSError:
            removed.append(False)
    return removed


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return out
    for tid in tids:
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            out.extend(int(p) for p in _read(f"/proc/{pid}/task/{tid}/children").split())
    return out


def _safe_dir(path: str) -> None:
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise CgroupError(errno.ENOTDIR, f"{path} is not a cgroup directory")


@final
@attrs.define(eq=False)
class EngineCgroup:
    """The engine's parent cgroup: it makes the leaves and spawns children into them.

    Made by :meth:`open`; only the engine holding the state directory's lock touches it, so two engines
    (two state directories) on one machine never touch each other's leaves.

    Attributes:
        cgroup2: where the hierarchy and the engine's own cgroup are.
        path: the parent's directory, ``<own cgroup>/gadget-engine-<hash of the state dir>``.
    """

    cgroup2: Cgroup2
    path: str
    _home_procs: int = attrs.field(alias="home_procs", repr=False)
    _lock: threading.Lock = attrs.field(init=False, factory=threading.Lock, repr=False)
    #: The parent as ``/proc/<pid>/cgroup`` names it, worked out at the first leaf.
    _rel: str | None = attrs.field(init=False, default=None, repr=False)

    @classmethod
    def open(cls, cgroup2: Cgroup2, state_dir: str, *, record: bool = True) -> EngineCgroup:
        """Create (or reuse) the parent cgroup of ``state_dir`` and record it in the state directory.

        Args:
            cgroup2: the hierarchy (:func:`find_cgroup2`).
            state_dir: the engine's state directory; the parent is named after it.
            record: write the parent's path to ``<state_dir>/cgroup.path`` for the guardian and the next
                engine's sweep (``False`` for a supervisor without a state directory, whose key is only
                a name).

        Raises:
            CgroupError: the hierarchy is not writable by this process, or lacks ``cgroup.kill`` (Linux
                5.14); the message names the file.
        """
        home = os.path.join(cgroup2.own, "cgroup.procs")
        try:
            home_procs = os.open(home, os.O_WRONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise CgroupError(exc.errno, f"cannot write {home}: {exc.strerror}") from None
        try:
            os.write(home_procs, b"0")  # moving into our own cgroup is a no-op that proves the right
            path = os.path.join(cgroup2.own, parent_name(state_dir))
            try:
                os.mkdir(path, 0o755)
            except FileExistsError:
                _safe_dir(path)
            if not os.path.exists(os.path.join(path, "cgroup.kill")):
                raise CgroupError(errno.ENOTSUP, f"{path} has no cgroup.kill (needs Linux 5.14 or newer)")
            if record:
                _record_parent(state_dir, path)
        except OSError as exc:
            os.close(home_procs)
            if isinstance(exc, CgroupError):
                raise
            raise CgroupError(
                exc.errno, f"cannot use the cgroup {cgroup2.own}: {exc.strerror or exc}"
            ) from None
        return cls(cgroup2=cgroup2, path=path, home_procs=home_procs)

    def leaf(self, name: str) -> Leaf:
        """Create the leaf ``name`` (a leftover of that name is reused) and return it.

        A parent removed meanwhile is made again first: the guardian of a crashed engine of the same
        state directory removes the parent it finds empty, which this engine may have opened an instant
        before (found by a crash test: an engine restarted at once failed its first spawn).
        """
        path = os.path.join(self.path, name)
        try:
            os.mkdir(path, 0o755)
        except FileExistsError:
            pass
        except FileNotFoundError:
            with contextlib.suppress(FileExistsError):
                os.mkdir(self.path, 0o755)
            with contextlib.suppress(FileExistsError):
                os.mkdir(path, 0o755)
        return Leaf(path=path, rel=self._child_rel(name))

    def _child_rel(self, name: str) -> str:
        """:meth:`Cgroup2.relative` of the leaf ``name`` under the parent, without a ``relpath`` (about
        15 us, at every leaf made): the parent's own, and the name."""
        if self._rel is None:
            self._rel = self.cgroup2.relative(self.path)
        return f"{self._rel.rstrip('/')}/{name}"

    def _renew(self, leaf: Leaf) -> None:
        """Remove the empty ``leaf`` (:meth:`Leaf.remove`) and make it again under its name
        (:meth:`leaf`): a new cgroup, its state the kernel's defaults.

        Raises:
            CgroupError: it cannot be removed (a process is in it) or made again.
        """
        try:
            if not leaf.remove():
                raise OSError(errno.EBUSY, os.strerror(errno.EBUSY))
            self.leaf(leaf.name)
        except OSError as exc:
            raise CgroupError(
                exc.errno, f"cannot make the cgroup {leaf.path} again: {exc.strerror}"
            ) from None

    def existing_leaf(self, name: str) -> Leaf | None:
        """The leaf ``name`` if it exists (a watched command's, found again on adoption)."""
        path = os.path.join(self.path, name)
        return Leaf(path=path, rel=self.cgroup2.relative(path)) if os.path.isdir(path) else None

    def leaves(self) -> list[Leaf]:
        """Every leaf under the parent now."""
        return list(_leaves(self.path, self.cgroup2))

    def spawn_in(self, leaf: Leaf, spawn: Callable[[int | None], int]) -> int:
        """Run ``spawn`` so that the child is born in ``leaf``.

        ``spawn`` takes a descriptor of the leaf's directory, for a spawn straight into it
        (``CLONE_INTO_CGROUP``, ``_spawn_direct``), when that can be done here; else ``None``, and it runs
        with this process moved into the leaf (and back after, whatever happened), as before. A child
        killed as it was born there (the leaf, empty, had a ``cgroup.kill``: ``CgroupKilledAtBirthError``)
        is spawned again once in the leaf made again under its name.

        Returns:
            What ``spawn`` returned (the child's pid).

        Raises:
            CgroupError: the leaf cannot be entered (it was removed, or the hierarchy is read-only now), or
                it is frozen: a child born there would never reach its ``exec``, and the clone would hold
                this thread in the kernel until someone thaws it (one read of ``cgroup.events`` first;
                a freeze written between that read and the clone still holds it).
            Whatever ``spawn`` raises (``SpawnError``); this process is back in its own cgroup either way.
        """
        from ._spawn import (  # here: the guardian needs no ctypes
            CgroupKilledAtBirthError,
            CgroupSpawnRefusedError,
            spawns_into_cgroup,
        )

        if leaf.frozen():
            raise CgroupError(
                errno.EBUSY,
                f"the cgroup {leaf.path} is frozen (its cgroup.freeze or a parent's is 1): nothing was "
                "started; write 0 to the cgroup.freeze that holds 1 to thaw it",
            )

        for attempt in range(2):
            if not spawns_into_cgroup():
                break
            try:
                fd = os.open(leaf.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError as exc:
                raise CgroupError(exc.errno, f"cannot enter the cgroup {leaf.path}: {exc.strerror}") from None
            try:
                return spawn(fd)
            except CgroupKilledAtBirthError:
                # The leaf (made ahead, empty) had a cgroup.kill: its parent's, written by someone to end
                # the engine's runs. Made again under its name, it kills no child.
                if attempt == 0:
                    self._renew(leaf)
            except CgroupSpawnRefusedError:
                break  # the move below says why, or works (the compiled spawn is off now)
            finally:
                os.close(fd)
        with self._lock:
            try:
                fd = os.open(os.path.join(leaf.path, "cgroup.procs"), os.O_WRONLY | os.O_CLOEXEC)
            except OSError as exc:
                raise CgroupError(exc.errno, f"cannot enter the cgroup {leaf.path}: {exc.strerror}") from None
            try:
                os.write(fd, b"0")
                try:
                    return spawn(None)
                finally:
                    os.write(self._home_procs, b"0")
            finally:
                os.close(fd)

    def close(self) -> None:
        """Close the engine's handle on its own cgroup and remove the parent if it is empty."""
        if self._home_procs >= 0:
            os.close(self._home_procs)
            self._home_procs = -1
        with contextlib.suppress(OSError):
            os.rmdir(self.path)


def _leaves(path: str, cgroup2: Cgroup2) -> Iterator[Leaf]:
    try:
        names = sorted(os.listdir(path))
    except FileNotFoundError:
        return
    for name in names:
        child = os.path.join(path, name)
        if os.path.isdir(child) and not os.path.islink(child):
            yield Leaf(path=child, rel=cgroup2.relative(child))


def _record_parent(state_dir: str, path: str) -> None:
    write_own_file(os.path.join(state_dir, PARENT_RECORD), path + "\n")


def load_recorded_parent(state_dir: str) -> tuple[Cgroup2, str] | None:
    """The parent cgroup an engine on ``state_dir`` recorded, checked, or ``None``.

    A record is trusted only when it names a directory called :func:`parent_name` of this state dir
    under a mounted cgroup2 hierarchy, so a planted record cannot point the sweep at another cgroup.
    """
    try:
        fd = os.open(os.path.join(state_dir, PARENT_RECORD), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        path = os.read(fd, 4096).decode("utf-8", "replace").strip()
    finally:
        os.close(fd)
    found, _ = find_cgroup2()
    if (
        found is None
        or not os.path.isabs(path)
        or os.path.basename(path) != parent_name(state_dir)
        or os.path.normpath(path) != path
        or not path.startswith(found.mount + os.sep)
        or not os.path.isdir(path)
        or os.path.islink(path)
    ):
        return None
    return found, path


def parent_leaves(cgroup2: Cgroup2, path: str) -> list[Leaf]:
    """The leaves under a recorded parent (see :func:`load_recorded_parent`)."""
    return list(_leaves(path, cgroup2))


def watched_leaf(path: str) -> Leaf | None:
    """The watched command's leaf at ``path`` (from a watch state), or ``None`` if it is not one.

    Trusted only when it is a real directory named ``w-...`` whose parent is an engine's parent cgroup
    (``gadget-engine-...``) under a mounted cgroup2 hierarchy.
    """
    found, _ = find_cgroup2()
    if found is None or not os.path.isabs(path) or os.path.normpath(path) != path:
        return None
    if not path.startswith(found.mount + os.sep) or not os.path.basename(path).startswith(WATCH_PREFIX):
        return None
    if not os.path.basename(os.path.dirname(path)).startswith("gadget-engine-"):
        return None
    if not os.path.isdir(path) or os.path.islink(path):
        return None
    return Leaf(path=path, rel=found.relative(path))
