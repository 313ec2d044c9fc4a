"""The supervisor: spawn children into scopes, watch them, and end them by escalation.

Every child is the leader of its own session and process group, writes straight into log files the
engine opened, and is watched through a pidfd by a task in the supervisor's nursery. Leaving
:func:`open_supervisor` terminates and reaps every child, however the body ended, except the runs
spawned with ``outlive_engine_crash``, which are left running for the next engine.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import functools
import itertools
import logging
import os
import signal
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Protocol, final

import attrs
import trio

from ._containment import Containment, Placement, open_containment
from ._errors import SpawnError, unwrap_single
from ._escalation import check_wait_seconds
from ._input import show
from ._keyed_locks import KeyedLocks
from ._procfs import (
    GUARDIAN_VAR,
    RUN_MARKER_VAR,
    ProcInfo,
    engine_children,
    engine_helpers,
    now_ticks,
    read_marker,
    read_proc,
    set_child_subreaper,
    sharing_children_reads,
)
from ._spawn import engine_environment, spawn_process, start_time_of
from ._sweep import end_processes
from ._termination import ProcessTree, wait_gone

__all__ = [
    "ManagedRun",
    "RunExit",
    "RunState",
    "SpawnSpec",
    "Supervisor",
    "TerminationReason",
    "open_supervisor",
]


class RunState(enum.Enum):
    """Where a run is in its life."""

    STARTING = "starting"
    RUNNING = "running"
    EXITING = "exiting"
    EXITED = "exited"


class TerminationReason(enum.Enum):
    """Why a run ended.

    ``EXIT``: the leader exited on its own with a code. ``SIGNAL``: a signal the engine did not send killed
    it. ``CANCELLED``: ``cancel``/``cancel_scope``/replacement/shutdown ended it. ``MAX_RUNTIME``: its
    ``max_runtime_seconds`` ran out.
    """

    EXIT = "exit"
    SIGNAL = "signal"
    CANCELLED = "cancelled"
    MAX_RUNTIME = "max_runtime"


def _optional_positive(_inst: object, attribute: attrs.Attribute[float | None], value: float | None) -> None:
    if value is not None and not value >= 0:
        raise ValueError(f"{attribute.name} must be a number of seconds >= 0, got {value!r}")


def _stream_target(_inst: object, attribute: attrs.Attribute[str | int | None], value: object) -> None:
    if value is not None and not isinstance(value, str | int):
        raise TypeError(f"{attribute.name} must be a path, a file descriptor or None, got {value!r}")


def _open_output(path: str) -> int:
    """``path`` opened for a child's output (``O_APPEND``, made 0600 when missing), as a shell's ``>>``
    opens it, except that a FIFO with no reader is refused instead of waited on (the open is
    ``O_NONBLOCK``, cleared again before the child gets the descriptor).

    Raises:
        SpawnError: it cannot be opened.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        why = "a FIFO no process reads" if exc.errno == errno.ENXIO else (exc.strerror or str(exc))
        message = f"cannot open the output file {path}: {why}"
        raise SpawnError(message, errno=exc.errno, path=path, reason="bad output file") from None
    os.set_blocking(fd, True)
    return fd


def _argv_tuple(value: Iterable[str] | None) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str | bytes):
        raise TypeError("argv must be a sequence of strings, not one string; use shell_command for a line")
    return tuple(value)


@attrs.frozen
class SpawnSpec:
    """What to run, where, and under which scope.

    Exactly one of ``argv`` and ``shell_command`` is given; a shell command runs as
    ``("/bin/sh", "-c", shell_command)``.

    Attributes:
        argv: the program and its arguments; ``argv[0]`` is looked up in the child's ``PATH``, or taken
            relative to ``cwd`` when it holds a slash.
        shell_command: a ``/bin/sh`` command line.
        cwd: the child's working directory (``None``: the engine's). ``PWD`` is set to it.
        env: variables added to (or, with ``inherit_env=False``, making up) the child's environment.
        inherit_env: start from the engine's environment.
        stdout: a path opened with ``O_APPEND`` (mode 0600), a descriptor, or ``None`` for ``/dev/null``.
        stderr: likewise.
        stdin: a descriptor the child's stdin is a copy of (the read end of a pipe the caller keeps
            writing to), or ``None`` for ``/dev/null``.
        scope_key: the scope the run belongs to.
        replace_existing_scope: end every run of ``scope_key`` (reaped) before this one starts.
        max_runtime_seconds: end the run by escalation after this many seconds.
        grace_seconds: SIGINT -> SIGKILL delay for this run (``None``: the supervisor's).
        outlive_engine_crash: leave this run to the next engine when this one stops, by a crash (the
            guardian and the start-up sweep skip it) or gracefully (closing the supervisor detaches it:
            its pidfd is closed and it is forgotten, never signalled); on-exit watched commands use it.
            ``cancel`` and ``cancel_scope`` still end it. Only an engine's supervisor (its containment
            recorded in a state directory) leaves it: a bare ``open_supervisor`` ends it at close.
    """

    argv: tuple[str, ...] | None = attrs.field(default=None, converter=_argv_tuple)
    shell_command: str | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.instance_of(str))
    )
    cwd: str | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.instance_of(str))
    )
    env: Mapping[str, str] | None = None
    inherit_env: bool = True
    stdout: str | int | None = attrs.field(default=None, validator=_stream_target)
    stderr: str | int | None = attrs.field(default=None, validator=_stream_target)
    stdin: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.instance_of(int))
    )
    scope_key: str = attrs.field(default="default", validator=attrs.validators.instance_of(str))
    replace_existing_scope: bool = False
    max_runtime_seconds: float | None = attrs.field(default=None, validator=_optional_positive)
    grace_seconds: float | None = attrs.field(
        default=None, validator=attrs.validators.optional(check_wait_seconds)
    )
    outlive_engine_crash: bool = False

    def __attrs_post_init__(self) -> None:
        if (self.argv is None) == (self.shell_command is None):
            raise ValueError("give exactly one of argv and shell_command")
        if self.argv is not None:
            if not self.argv:
                raise ValueError("argv must not be empty: name the program to run")
            if not all(isinstance(a, str) for a in self.argv):
                raise TypeError("argv must hold strings only")
            if not self.argv[0]:
                raise ValueError("argv[0] must not be empty: name the program to run")
        if self.shell_command is not None and not self.shell_command.strip():
            raise ValueError("shell_command must not be blank")

    @classmethod
    def shell(cls, command: str, **kwargs: object) -> SpawnSpec:
        """A spec running ``command`` through ``/bin/sh -c``; other fields as keyword arguments."""
        return cls(shell_command=command, **kwargs)  # type: ignore[arg-type]  # attrs checks the rest

    def resolved_argv(self) -> tuple[str, ...]:
        """The argv the child is started with."""
        if self.argv is not None:
            return self.argv
        assert self.shell_command is not None
        return ("/bin/sh", "-c", self.shell_command)


@attrs.frozen
class RunExit:
    """How a run ended.

    Attributes:
        exit_code: the leader's exit code, or ``None`` when a signal killed it.
        signal: the number of the signal that killed the leader, or ``None``.
        reason: why it ended (:class:`TerminationReason`).
        duration_seconds: from spawn to the end of clean-up, on the Trio clock.
        escalated: whether SIGKILL had to be sent to the tree.
        survivors: pids of the run's tree still alive after SIGKILL and the kill wait (normally empty).
    """

    exit_code: int | None
    signal: int | None
    reason: TerminationReason
    duration_seconds: float
    escalated: bool
    survivors: tuple[int, ...] = ()

    def describe(self) -> str:
        """A short phrase: ``"exited 0"``, ``"killed by signal 9 (SIGKILL)"``."""
        if self.signal is not None:
            try:
                import signal as _signal

                name = f" ({_signal.Signals(self.signal).name})"
            except ValueError:
                name = ""
            return f"killed by signal {self.signal}{name}"
        return f"exited {self.exit_code}"


@final
@attrs.define(eq=False)
class ManagedRun:
    """One supervised child and its process tree.

    Attributes:
        run_id: unique within the supervisor.
        pid: the leader's pid.
        pgid: its process group (equal to ``pid``).
        scope_key: the scope it was spawned under.
        argv: what it runs.
        started_at: aware UTC time of the spawn.
    """

    run_id: int
    pid: int
    pgid: int
    scope_key: str
    argv: tuple[str, ...]
    started_at: datetime
    outlive_engine_crash: bool
    _tree: ProcessTree = attrs.field(alias="tree")
    _grace_seconds: float = attrs.field(alias="grace_seconds")
    _started: float = attrs.field(alias="started")
    _placement: Placement = attrs.field(alias="placement", default=None)
    _state: RunState = attrs.field(init=False, default=RunState.RUNNING)
    _exit: RunExit | None = attrs.field(init=False, default=None)
    _leader_exit: RunExit | None = attrs.field(init=False, default=None)
    _detached: bool = attrs.field(init=False, default=False)
    _done: trio.Event = attrs.field(init=False, factory=trio.Event)
    _leader_done: trio.Event = attrs.field(init=False, factory=trio.Event)
    _leader_hooks: list[Callable[[], object]] = attrs.field(init=False, factory=list)
    _cancel_scope: trio.CancelScope = attrs.field(init=False, factory=trio.CancelScope)
    _requested: TerminationReason | None = attrs.field(init=False, default=None)

    @property
    def marker(self) -> str:
        """The run marker in the environment of the run's whole tree (``GADGET_ENGINE_RUN``)."""
        return self._tree.marker

    @property
    def start_time(self) -> int:
        """The leader's start time in clock ticks since boot (with ``pid`` it names the process)."""
        return self._tree.start_time

    @property
    def state(self) -> RunState:
        """The run's current :class:`RunState`."""
        return self._state

    @property
    def exit(self) -> RunExit | None:
        """The :class:`RunExit` once the run has ended (its whole tree gone), else ``None``."""
        return self._exit

    @property
    def leader_exit(self) -> RunExit | None:
        """How the leader ended, as soon as it is reaped; ``None`` while it lives.

        A leader that exits on its own is "exited" at once, while the rest of its tree may go on writing
        (a ``tee``, a late ``echo``) until it is gone or the grace period has passed, and is then ended by
        the usual escalation (SP-03); :attr:`exit` comes once all of that is over.
        """
        return self._exit if self._exit is not None else self._leader_exit

    @property
    def cgroup(self) -> str | None:
        """The run's cgroup v2 leaf (a directory path) in cgroup containment, else ``None``."""
        return self._placement.path if self._placement is not None else None

    async def wait(self) -> RunExit:
        """Wait until the run has ended and its tree is cleaned up, and return how it ended.

        Cancellation: safe; the run goes on and can be waited for again.
        """
        await self._done.wait()
        assert self._exit is not None
        return self._exit

    async def wait_leader_exit(self) -> RunExit:
        """Wait until the leader has exited (reaped), and return :attr:`leader_exit`; what is left of its
        tree may still be draining.

        Cancellation: safe; the run goes on and can be waited for again.
        """
        await self._leader_done.wait()
        exit = self.leader_exit
        assert exit is not None
        return exit

    def on_leader_exit(self, hook: Callable[[], object]) -> None:
        """Have ``hook`` called once the leader has exited (reaped), synchronously, right after the
        waiters of :meth:`wait_leader_exit` are woken; at once when it already has. A task that only
        waits for that to do something brief needs no task of its own (the subprocess service's records
        without a restart policy). An exception ``hook`` raises is logged and dropped."""
        if self._leader_done.is_set():
            _call_hook(hook, self)
        else:
            self._leader_hooks.append(hook)

    def _leader_exited(self) -> None:
        """Wake the waiters of :meth:`wait_leader_exit`, then call the hooks (once)."""
        self._leader_done.set()
        hooks, self._leader_hooks = self._leader_hooks, []
        for hook in hooks:
            _call_hook(hook, self)

    def pids(self) -> list[int]:
        """The live pids of the run's tree, found afresh: its leaf's members in cgroup containment; the
        leader while alive, its group and the escapees found so far in process-group containment."""
        self._tree.snapshot(fresh=False)
        return self._tree.remaining()

    def __repr__(self) -> str:
        status = self._exit.describe() if self._exit is not None else self._state.value
        return f"<ManagedRun {self.pid} {show(list(self.argv))}: {status}>"  # a huge argv is shortened


class RunObserver(Protocol):
    """Told of runs as they start and end (the guardian link keeps its records this way)."""

    def run_started(self, run: ManagedRun) -> None:
        """Called right after the spawn, before ``spawn`` returns."""

    def run_ended(self, run: ManagedRun) -> None:
        """Called once the run's tree is reaped, after the tasks its end woke (a lone end's waiter runs
        first: see ``Supervisor._housekeep``), so that the housekeeping does not delay them."""


class RunsObserver(RunObserver, Protocol):
    """A :class:`RunObserver` that is told of the runs ended together (a ``kill_all``'s) in one call
    (found by its ``runs_ended`` attribute, not by ``isinstance``: see ``Supervisor._housekeep``)."""

    def runs_ended(self, runs: list[ManagedRun]) -> None:
        """:meth:`RunObserver.run_ended` of each of ``runs``, in one call (the guardian link writes its
        journal and its pipe once for all of them)."""


_RUN_MARKER_KEY = RUN_MARKER_VAR.encode()
_log = logging.getLogger("engine.supervisor")


@final
@attrs.define(eq=False)
class Supervisor:
    """Spawns children into scopes and ends them by escalation. Made by :func:`open_supervisor`.

    Attributes:
        grace_seconds: default SIGINT -> SIGKILL delay.
        kill_wait_seconds: how long to wait after SIGKILL before reporting survivors.
        subreaper: whether this process is a child subreaper while the supervisor is open.
    """

    _nursery: trio.Nursery = attrs.field(alias="nursery")
    grace_seconds: float
    kill_wait_seconds: float
    subreaper: bool
    _containment: Containment = attrs.field(alias="containment")
    #: End orphans no run claims (``kill_all``, the supervisor's exit): the engine owns its process.
    end_unclaimed_orphans: bool = attrs.field(default=False, kw_only=True)
    _started_ticks: int = attrs.field(init=False, factory=now_ticks)
    _reaping: trio.CancelScope = attrs.field(init=False, factory=trio.CancelScope)
    _ids: itertools.count[int] = attrs.field(init=False, factory=lambda: itertools.count(1))
    _runs: dict[int, ManagedRun] = attrs.field(init=False, factory=dict)
    _leaders: set[int] = attrs.field(init=False, factory=set)
    _locks: KeyedLocks = attrs.field(init=False, factory=KeyedLocks)
    _closing: bool = attrs.field(init=False, default=False)
    _observers: list[RunObserver] = attrs.field(init=False, factory=list)
    #: The runs ended in this scheduler pass whose housekeeping is due, and the housekeeping under way.
    _ended: list[ManagedRun] = attrs.field(init=False, factory=list)
    _housekeeping: int = attrs.field(init=False, default=0)
    _housekept: trio.Event = attrs.field(init=False, factory=trio.Event)

    def __repr__(self) -> str:
        state = "closed" if self._closing else "open"
        return f"<Supervisor {state}: {len(self._runs)} runs, grace {self.grace_seconds} s>"

    @property
    def containment(self) -> Containment:
        """How runs are contained (``containment.mode``: ``"cgroup"`` or ``"process-group"``)."""
        return self._containment

    def add_observer(self, observer: RunObserver) -> None:
        """Have ``observer`` told, synchronously, of every run started and ended from now on."""
        self._observers.append(observer)

    def claims(self, info: ProcInfo) -> bool:
        """Whether process ``info`` belongs to this supervisor: a run's leader, group, session, leaf,
        tracked escapee or marker (a watched command's too), or the engine's guardian."""
        if info.pid in self._leaders or info.pgid in self._leaders or info.sid in self._leaders:
            return True
        if self._containment.holds(info.pid):
            return True
        if any(info.pid in run._tree.tracked for run in self._runs.values()):
            return True
        if info.zombie:
            return False  # no environment left to read
        marker = read_marker(info.pid)
        if marker is not None and marker.partition(":")[0] in (
            self._containment.token,
            self._containment.token + "w",
        ):
            return True
        return read_marker(info.pid, GUARDIAN_VAR) is not None

    def unclaimed_children(self) -> dict[int, int]:
        """Live children of the engine process that no run claims, ``{pid: start_time}``.

        Under the subreaper these are orphans the engine adopted whose run cannot be told (a daemon that
        double-forked, left its group and scrubbed its environment, in process-group containment), or,
        embedded, the host's own children started since the supervisor opened: they look the same.
        """
        if not self.subreaper:
            return {}
        out: dict[int, int] = {}
        for pid in engine_children() - engine_helpers():  # the guardian is the engine's own: not read
            info = read_proc(pid)
            if info is None or info.zombie or info.start_time < self._started_ticks:
                continue
            if not self.claims(info):
                out[pid] = info.start_time
        return out

    async def end_processes(self, targets: dict[int, int]) -> list[int]:
        """End ``targets`` (``{pid: start_time}``) by the escalation (blocking driver, in a worker thread)
        and reap those that are the engine's children; return the survivors.

        Cancellation: shielded; bounded by the grace period and the kill wait.
        """
        with trio.CancelScope(shield=True):
            survivors = await trio.to_thread.run_sync(
                functools.partial(
                    end_processes,
                    targets,
                    grace_seconds=self.grace_seconds,
                    kill_wait_seconds=self.kill_wait_seconds,
                )
            )
        for pid in targets:
            _reap_if_zombie(pid)
        return survivors

    def reap_zombies(self) -> None:
        """Reap the zombies among the engine's children that are not run leaders (each run reaps its
        own): those a run claims, or every one when :attr:`end_unclaimed_orphans` is set.

        By pid only, never ``waitpid(-1)`` (that would take trio's and an embedding host's children);
        ``waitid(..., WNOWAIT)`` looks before anything is reaped.
        """
        for pid in engine_children() - self._leaders:
            try:
                looked = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                continue
            if looked is None:
                continue  # alive
            info = read_proc(pid)
            if info is not None and (self.end_unclaimed_orphans or self.claims(info)):
                _reap_if_zombie(pid)

    async def own_process(self) -> None:
        """The engine owns its whole process (``serve``, ``mcp``): from now on, end unclaimed orphans at
        ``kill_all`` and at the exit (:attr:`end_unclaimed_orphans`), and reap adopted zombies as they
        appear (NB-02), woken by SIGCHLD (no polling), where this process is a subreaper and SIGCHLD is
        free (the main thread, no handler installed).

        Embedded, the host owns its signals and its children: zombies a run's tree hands to the engine are
        reaped when that run ends, and no SIGCHLD handler is installed.

        Cancellation: safe; the reaping task runs in the supervisor's nursery.
        """
        self.end_unclaimed_orphans = True
        if self.subreaper and _can_take_sigchld():
            await self._nursery.start(self._reap_on_sigchld)
        else:
            await trio.lowlevel.checkpoint()

    async def _reap_on_sigchld(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        with self._reaping, trio.open_signal_receiver(signal.SIGCHLD) as batches:
            task_status.started()
            self.reap_zombies()
            async for _ in batches:
                self.reap_zombies()

    def runs(self, scope_key: str | None = None) -> list[ManagedRun]:
        """The runs not yet ended (all of them, or those of ``scope_key``), oldest first."""
        return [r for r in self._runs.values() if scope_key is None or r.scope_key == scope_key]

    async def spawn(self, spec: SpawnSpec) -> ManagedRun:
        """Start ``spec`` and return its run; it is watched until it ends.

        With ``spec.replace_existing_scope`` every run of the scope is ended and reaped first; a per-key
        lock makes "end the old ones, start the new one" atomic against other replacements and
        ``cancel_scope`` of the same key.

        Cancellation: while waiting for the key's lock or for old runs to end, the spawn does not happen
        (old runs already being ended are still ended).

        Raises:
            SpawnError: the program or cwd cannot be used; nothing is registered.
            RuntimeError: the supervisor is closed.
        """
        if self._closing:
            raise RuntimeError("the supervisor is closed; open a new one to spawn")
        replaces = spec.replace_existing_scope and bool(self.runs(spec.scope_key))
        if self._locks.idle(spec.scope_key) and not replaces:
            # Nobody holds or waits for the key, and no run of it is left to replace: the sync start is as
            # atomic as holding its lock. The checkpoint comes after the spawn, so that the work waiting on
            # the loop (the last run's housekeeping, the next log files) runs while the child starts, not
            # before it; and a caller that made something for the child just before (an on-exit arm's
            # logs) knows that no other task ran between that and the spawn.
            await trio.lowlevel.checkpoint_if_cancelled()
            run = self._start(spec)
            await trio.lowlevel.cancel_shielded_checkpoint()
            return run
        async with self._locks.hold(spec.scope_key):
            if spec.replace_existing_scope:
                await self._end_scope(spec.scope_key)
            if self._closing:
                raise RuntimeError("the supervisor is closed; open a new one to spawn")
            return self._start(spec)

    def _start(self, spec: SpawnSpec) -> ManagedRun:
        argv = spec.resolved_argv()
        cwd = os.path.abspath(spec.cwd) if spec.cwd is not None else os.getcwd()
        env = engine_environment() if spec.inherit_env else {}
        if spec.env:
            env.update((os.fsencode(k), os.fsencode(v)) for k, v in spec.env.items())
        env[b"PWD"] = os.fsencode(cwd)
        run_id = next(self._ids)
        watched = spec.outlive_engine_crash
        marker = self._containment.marker(run_id, watched=watched)
        env[_RUN_MARKER_KEY] = marker.encode()
        placement = self._containment.place(run_id, watched=watched)
        opened: list[int] = []
        try:
            fds: list[int | None] = []
            for target in (spec.stdout, spec.stderr):
                if isinstance(target, str):
                    fd = _open_output(target)
                    opened.append(fd)
                    fds.append(fd)
                else:
                    fds.append(target)
            started = trio.current_time()  # before the spawn: the child may run a while before we go on
            pid = self._containment.spawn(
                placement,
                lambda cgroup_fd: spawn_process(
                    argv,
                    cwd=cwd,
                    env=env,
                    stdout_fd=fds[0],
                    stderr_fd=fds[1],
                    stdin_fd=spec.stdin,
                    cgroup_fd=cgroup_fd,
                ),
            )
        except BaseException:
            self._containment.release(placement)
            raise
        finally:
            for fd in opened:
                os.close(fd)
        try:
            return self._register(spec, run_id, argv, marker, placement, pid, started)
        except BaseException:
            # Nothing started may outlive a failed spawn: a record that could not be written (a full
            # state dir), a pidfd that could not be opened. The child is killed before the error goes up.
            self._containment.kill_now(placement, pid)
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
            self._containment.release(placement)
            raise

    def _register(
        self,
        spec: SpawnSpec,
        run_id: int,
        argv: tuple[str, ...],
        marker: str,
        placement: Placement,
        pid: int,
        started: float,
    ) -> ManagedRun:
        pidfd = os.pidfd_open(pid)
        start_time = start_time_of(pid)
        if start_time is None:
            info = read_proc(pid)
            start_time = info.start_time if info is not None else 0
        tree = self._containment.tree(
            placement,
            pid=pid,
            pidfd=pidfd,
            start_time=start_time,
            marker=marker,
            known_leaders=self._leaders,
        )
        grace = spec.grace_seconds if spec.grace_seconds is not None else self.grace_seconds
        run = ManagedRun(
            run_id=run_id,
            pid=pid,
            pgid=pid,
            scope_key=spec.scope_key,
            argv=argv,
            started_at=datetime.now(UTC),
            outlive_engine_crash=spec.outlive_engine_crash,
            tree=tree,
            grace_seconds=grace,
            started=started,
            placement=placement,
        )
        if spec.max_runtime_seconds is not None:
            run._cancel_scope.deadline = trio.current_time() + spec.max_runtime_seconds
        self._runs[run_id] = run
        self._leaders.add(pid)
        try:
            for observer in self._observers:
                observer.run_started(run)
        except BaseException:
            self._runs.pop(run_id, None)
            self._leaders.discard(pid)
            for observer in self._observers:
                observer.run_ended(run)
            tree.close()
            raise
        self._nursery.start_soon(self._watch, run, name=f"watch run {pid}")
        return run

    async def _watch(self, run: ManagedRun) -> None:
        tree = run._tree
        terminate = False
        try:
            with run._cancel_scope:
                await tree.wait_leader()
                # Begun: a cancel signalled the tree (_begin) before this task looked; the exit is its doing.
                if not tree.begun:
                    run._leader_exit = _exit_of(run, None, escalated=False, survivors=())
                    run._leader_exited()
                    await tree.quiet_read()  # one read of the engine's children for the leaders that exited
                    if tree.leftovers():
                        # SP-03: the leader is "exited" now; the rest of its tree may go on writing until it
                        # is gone or the grace period has passed, and is then ended by the escalation.
                        run._state = RunState.EXITING
                        tree.snapshot(fresh=True)
                        with trio.move_on_after(run._grace_seconds):
                            await wait_gone(tree)
                        tree.snapshot(fresh=True)  # what forked or left the group meanwhile
                        terminate = bool(tree.remaining())
        except trio.Cancelled:  # the supervisor is closing: end the tree, then let Cancelled go on
            if run._detached or self._leaves_to_next_engine(run):
                run._detached = True  # closing by cancellation or error detaches a watched command too
                self._forget(run, ended=False)
                raise
            with trio.CancelScope(shield=True):
                await self._finish(run, TerminationReason.CANCELLED, terminate=True)
            raise
        if run._detached and run._tree.status is None:  # left running for the next engine to adopt
            self._forget(run, ended=False)
            return
        reason: TerminationReason | None = None
        if run._cancel_scope.cancelled_caught or run._leader_exit is None:
            terminate = True
            if run._leader_exit is None:  # the leader itself was ended: by a request, or its time ran out
                reason = run._requested or TerminationReason.MAX_RUNTIME
        with trio.CancelScope(shield=True):
            await self._finish(run, reason, terminate=terminate)

    async def _finish(self, run: ManagedRun, reason: TerminationReason | None, *, terminate: bool) -> None:
        run._state = RunState.EXITING
        escalated, survivors = False, tuple[int, ...]()
        handed = False  # to the batch driver, which ends the run (_end_handed)
        try:
            if terminate:
                outcome = await run._tree.terminate(
                    grace_seconds=run._grace_seconds,
                    kill_wait_seconds=self.kill_wait_seconds,
                    done=functools.partial(self._end_handed, run, reason),
                    spawn=self._spawn_shielded,
                )
                handed = outcome is None
                if outcome is not None:
                    escalated, survivors = outcome
            if not handed and run._tree.status is None:
                await run._tree.wait_leader()
        finally:
            if not handed:
                self._record_end(run, reason, escalated=escalated, survivors=survivors)
                if self._note_ended(run):
                    await self._housekeep()

    def _record_end(
        self,
        run: ManagedRun,
        reason: TerminationReason | None,
        *,
        escalated: bool,
        survivors: tuple[int, ...],
    ) -> None:
        """The run has ended: its exit, its state, its waiters woken."""
        run._tree.close()
        run._exit = _exit_of(run, reason, escalated=escalated, survivors=survivors)
        run._state = RunState.EXITED
        self._forget(run, ended=False)
        run._leader_exited()
        run._done.set()

    def _end_handed(
        self,
        run: ManagedRun,
        reason: TerminationReason | None,
        outcome: tuple[bool, tuple[int, ...]] | BaseException,
    ) -> None:
        """The end of a run whose escalation the batch driver ended (``ProcessTree.terminate``'s ``done``),
        called from the driver's pass: the runs ended in one pass are ended in one loop, their tasks
        gone already, and only the tasks waiting for them (``cancel_many``'s one) wake. An error is
        raised by a task of its own (``_escalation_batch``), as the run's task would have."""
        escalated, survivors = (False, ()) if isinstance(outcome, BaseException) else outcome
        self._record_end(run, reason, escalated=escalated, survivors=survivors)
        if self._note_ended(run):
            self._spawn_shielded(self._housekeep)

    def _spawn_shielded(self, work: Callable[[], Awaitable[object]]) -> None:
        """Run ``work`` in a task of the supervisor's nursery, shielded (the end of a run)."""
        self._nursery.start_soon(_shielded, work)

    def _note_ended(self, run: ManagedRun) -> bool:
        """Queue ``run``'s housekeeping; ``True`` for the first run of this scheduler pass, whose caller
        then runs :meth:`_housekeep` for all of them."""
        self._ended.append(run)
        if len(self._ended) > 1:
            return False
        self._housekeeping += 1
        return True

    async def _housekeep(self) -> None:
        """The housekeeping after the runs' ends (tell the guardian and the records, then remove their
        leaves), done after the waiters of those runs have gone on, so that it overlaps what they do
        next (the next spawn's child runs meanwhile) instead of delaying them; the runs that end in the
        same scheduler pass (a ``kill_all``) share it (:meth:`_note_ended`): their leaves are removed
        together (``Containment.release_many``), after the callers waiting for the housekeeping
        (:meth:`_housekeeping_done`) have gone on: a ``kill_all`` of 1000 returns once every leaf was
        seen empty, not once the 1000 ``rmdir`` (and the kernel's freeing of the cgroups, some 40 ms of
        the two cores here) are done. The supervisor's close waits for them (this task is in its
        nursery), before the engine's parent cgroup is removed.

        A lone end (a spawn's run, waited for) takes a second checkpoint: Trio runs the tasks of one pass
        in either order (it reverses a pass's batch half of the time), so after one checkpoint the leaf's
        removal (some 50-100 us) came before the woken waiter in half the ends; after two, the waiter has
        run first. Many ends together (a ``kill_all``) go on after one, as before: their caller waits for
        the housekeeping itself (:meth:`_housekeeping_done`).

        Cancellation: callers shield it.
        """
        try:
            await trio.lowlevel.cancel_shielded_checkpoint()  # the runs ending in this pass join
            if len(self._ended) == 1:
                await trio.lowlevel.cancel_shielded_checkpoint()  # its waiter, woken in that pass, first
        finally:
            batch, self._ended = self._ended, []
            try:
                for observer in self._observers:
                    # A plain attribute look, not isinstance of the runtime-checkable protocol: that walks
                    # the protocol's members at every call (some 30 us per run ended).
                    runs_ended = getattr(observer, "runs_ended", None)
                    if runs_ended is not None:
                        runs_ended(batch)
                    else:
                        for ended in batch:
                            observer.run_ended(ended)
            finally:
                self._housekeeping -= 1
                if not self._housekeeping:
                    done, self._housekept = self._housekept, trio.Event()
                    done.set()
                # Last, once the callers waiting for the housekeeping have gone on (a kill_all returns):
                # the leaves' removal, in this task of the supervisor's nursery, which its close waits for.
                await self._containment.release_many([r._placement for r in batch])

    async def _housekeeping_done(self) -> None:
        """Wait until the housekeeping of every run ended so far is done but the leaves' removal
        (``kill_all`` returns only once the guardian and the observers are told)."""
        while self._housekeeping or self._ended:
            await self._housekept.wait()

    def _forget(self, run: ManagedRun, *, ended: bool = True) -> None:
        run._tree.close()
        self._runs.pop(run.run_id, None)
        self._leaders.discard(run.pid)
        if ended:
            for observer in self._observers:
                observer.run_ended(run)

    def _request(self, run: ManagedRun, *, force: bool) -> None:
        # A stop during SP-03's drain (the leader exited; what it left may still run) ends the leftovers at
        # once: the drain was their grace period, and a second one would make the stop the slower way.
        if force or run._leader_exit is not None:
            run._tree.request_force()
        if run._requested is None:
            run._requested = TerminationReason.CANCELLED
        run._cancel_scope.cancel()

    def begin_cancel(self, runs: Iterable[ManagedRun]) -> None:
        """Take the first step of :meth:`cancel` of each of ``runs`` now, in one loop: the look and SIGINT
        (the escalation goes on from there when :meth:`cancel` is called for the run, right after).

        Ending many runs at once (``kill_all``), every tree is signalled before the runs' tasks wake up to
        end them, and their grace periods end together; what waking 1000 tasks costs overlaps the grace
        period instead of delaying the signals. A run already ended or detached is left alone, and so is
        one whose leader exited: its task kills what the leader left at once (SP-03's drain was their grace
        period).
        """
        with sharing_children_reads():  # one read of the engine's children for every tree's look
            for run in runs:
                self._begin(run)

    def _begin(self, run: ManagedRun) -> None:
        """The first step of the escalation of ``run`` (the look, SIGINT and SIGCONT; SIGKILL when forced)
        in the caller's task, while its leader lives; the run's own task goes on from there. A run whose
        leader exited is left to its task (its leftovers get no SIGINT: :meth:`_request`)."""
        if run.state is RunState.RUNNING and run._leader_exit is None and not run._detached:
            run._tree.begin(grace_seconds=run._grace_seconds, kill_wait_seconds=self.kill_wait_seconds)

    async def cancel(self, run: ManagedRun, *, force: bool = False) -> RunExit:
        """End ``run`` by escalation (SIGINT -> grace -> SIGKILL -> wait) and return its exit.

        A run already exiting escalates no further and the same exit is returned; ``force=True`` skips
        the grace period (also for a run already in it). A run whose leader has exited while the rest of
        its tree drains (SP-03) gets no second grace period: what is left is killed at once.

        Cancellation: the tree is still ended and reaped; the caller's cancellation is re-raised after
        that, as trio's ``run_process`` does.
        """
        if run.state is RunState.EXITED:
            await trio.lowlevel.checkpoint()
            assert run.exit is not None
            return run.exit
        self._request(run, force=force)
        self._begin(run)  # SIGINT leaves now, not once the run's task has woken
        return await _wait_shielded(run)

    async def cancel_many(self, runs: Iterable[ManagedRun]) -> None:
        """:meth:`cancel` of every run of ``runs``, concurrently, from one task: each run's own task ends
        it (the escalations that start together run as one batch), and this call returns once every one
        has ended, woken only when the run it waits for ends (``kill_all`` of 1000 would otherwise wake
        1000 waiting tasks after their SIGKILL). Each run's exit is then :attr:`ManagedRun.exit`.

        Cancellation: as :meth:`cancel`, for each of them.
        """
        pending = [run for run in runs if run.state is not RunState.EXITED]
        for run in pending:
            self._request(run, force=False)
        try:
            for run in pending:
                if not run._done.is_set():
                    await run._done.wait()
            await self._housekeeping_done()
        except trio.Cancelled:
            with trio.CancelScope(shield=True):
                for run in pending:
                    await run._done.wait()
                await self._housekeeping_done()
            raise
        await trio.lowlevel.checkpoint()

    async def cancel_scope(self, scope_key: str) -> list[RunExit]:
        """End every run of ``scope_key`` concurrently and return their exits (oldest first).

        It waits for a replacement spawn of the same key that is under way and ends that run too, and
        returns once the runs' housekeeping is done (the observers told; their leaves are removed after).

        Cancellation: as :meth:`cancel`.
        """
        async with self._locks.hold(scope_key):
            return await self._end_scope(scope_key)

    async def _end_scope(self, scope_key: str) -> list[RunExit]:
        runs = self.runs(scope_key)
        for run in runs:
            self._request(run, force=False)
        exits = [await _wait_shielded(run) for run in runs]
        with trio.CancelScope(shield=True):  # bounded: the leaves' removal and the observers told
            await self._housekeeping_done()
        return exits

    def _close(self) -> None:
        self._closing = True
        self._reaping.cancel()  # each run reaps its own; the exit reaps the orphans it ends
        for run in self.runs():
            if self._leaves_to_next_engine(run):
                self._detach(run)
            else:
                self._request(run, force=False)

    def _leaves_to_next_engine(self, run: ManagedRun) -> bool:
        """Whether closing leaves ``run`` running for the next engine: spawned ``outlive_engine_crash``, not
        being ended on purpose, and this supervisor's places recorded in a state directory (a bare
        supervisor's run could never be adopted: it is ended as any other)."""
        return run.outlive_engine_crash and run._requested is None and self._containment.recorded

    def _detach(self, run: ManagedRun) -> None:
        """Stop watching ``run`` and leave it running, unsignalled, for the next engine (a graceful stop).

        Its ``wait()`` never returns; its observers are not told it ended (it did not), and its leaf stays.
        """
        run._detached = True
        run._cancel_scope.cancel()


def _call_hook(hook: Callable[[], object], run: ManagedRun) -> None:
    try:
        hook()
    except Exception:
        _log.exception("a leader-exit hook of run %d failed", run.pid)


def _reap_if_zombie(pid: int) -> None:
    try:
        if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass  # not our child, or reaped already


def _exit_of(
    run: ManagedRun, reason: TerminationReason | None, *, escalated: bool, survivors: tuple[int, ...]
) -> RunExit:
    """The :class:`RunExit` of ``run`` from its leader's wait status (``reason`` ``None``: read from it)."""
    status = run._tree.status
    code: int | None = None
    sig: int | None = None
    if status is not None:
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
        else:
            code = os.waitstatus_to_exitcode(status)
    if reason is None:
        reason = TerminationReason.SIGNAL if sig is not None else TerminationReason.EXIT
    return RunExit(
        exit_code=code,
        signal=sig,
        reason=reason,
        duration_seconds=trio.current_time() - run._started,
        escalated=escalated,
        survivors=survivors,
    )


async def _shielded(work: Callable[[], Awaitable[object]]) -> None:
    with trio.CancelScope(shield=True):
        await work()


async def _wait_shielded(run: ManagedRun) -> RunExit:
    try:
        return await run.wait()
    except trio.Cancelled:
        with trio.CancelScope(shield=True):
            await run.wait()
        raise


def _can_take_sigchld() -> bool:
    """Whether the supervisor may handle SIGCHLD: the main thread, and no handler of the host's there."""
    if threading.current_thread() is not threading.main_thread():
        return False
    return signal.getsignal(signal.SIGCHLD) in (signal.SIG_DFL, None)


@asynccontextmanager
async def open_supervisor(
    *,
    grace_seconds: float = 5.0,
    kill_wait_seconds: float = 5.0,
    subreaper: bool = True,
    containment: str | Containment = "auto",
) -> AsyncIterator[Supervisor]:
    """Open a :class:`Supervisor` whose runs all end (terminated and reaped) when the block is left.

    Runs spawned with ``outlive_engine_crash`` are the exception when ``containment`` is an engine's
    (recorded in its state directory, ``open_engine``): they are detached, left running and unsignalled
    (on-exit watched commands, adopted by the next engine). Without a state directory nothing could
    adopt them: they are ended as the others are.

    Args:
        grace_seconds: default SIGINT -> SIGKILL delay, in seconds.
        kill_wait_seconds: how long to wait after SIGKILL before reporting survivors, in seconds.
        subreaper: make this process a child subreaper (``PR_SET_CHILD_SUBREAPER``, Linux) while open, so
            descendants that leave their group are re-parented to it and can be ended and reaped.
        containment: ``"auto"``, ``"cgroup"`` or ``"process-group"`` (see ``_containment``), or a
            containment the caller opened (``open_engine`` opens one named after its state dir).

    Cancellation: leaving the block by cancellation or error still ends and reaps every run first
    (each under a shielded cancel scope), then the exception propagates. An engine's runs spawned with
    ``outlive_engine_crash`` (watched on-exit commands) are left running, unsignalled.

    Raises:
        EngineError: ``containment="cgroup"`` where no cgroup v2 hierarchy is writable.
    """
    if grace_seconds < 0 or kill_wait_seconds < 0:
        raise ValueError("grace_seconds and kill_wait_seconds must be >= 0")
    active = set_child_subreaper(True) if subreaper else False
    try:
        async with contextlib.AsyncExitStack() as stack:
            if isinstance(containment, str):
                chosen = await stack.enter_async_context(open_containment(containment, subreaper=active))
            else:
                chosen = containment
            sup: Supervisor | None = None
            try:
                async with trio.open_nursery() as nursery:
                    sup = Supervisor(
                        nursery=nursery,
                        grace_seconds=grace_seconds,
                        kill_wait_seconds=kill_wait_seconds,
                        subreaper=active,
                        containment=chosen,
                    )
                    try:
                        yield sup
                    finally:
                        sup._close()
            finally:
                if sup is not None and sup.end_unclaimed_orphans:
                    orphans = sup.unclaimed_children()
                    if orphans:
                        await sup.end_processes(orphans)
    except BaseExceptionGroup as group:
        unwrap_single(group)
    finally:
        if active:  # undo only what this call did: a failed set counted no user
            set_child_subreaper(False)
