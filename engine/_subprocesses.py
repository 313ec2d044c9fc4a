"""The subprocess service: long-lived children of agent projects, with log files, kill and halt.

Each child runs under the supervisor in its project's scope (``project:<id>``) with the project directory as
its working directory, and writes straight into two log files under
``<project>/<gadget_dir_name>/subprocess-logs/``. *Kill* ends the process tree, deletes both logs and
forgets the record; *halt* ends it the same way but keeps the logs and the record (state exited, with its
exit) for inspection. A background task, running only while some child is alive, keeps every log within
``EngineConfig.log_cap_bytes``.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import final

import attrs
import trio

from ._config import EngineConfig
from ._errors import (
    EngineError,
    InvalidArgumentError,
    KillInProgressError,
    LimitExceededError,
    SpawnError,
    SubProcessNotFoundError,
)
from ._folder_cache import FolderCache
from ._input import check_argv, check_env, check_flag, check_read_args, check_reader, check_string, show
from ._keeper import finish, keep, needs_task
from ._logpair import LogPair
from ._logs import LogFile, LogSlice, Stream, check_stream
from ._logsearch import grep_log
from ._logwatch import LogWatch, open_log_watch
from ._patterns import compile_pattern
from ._project import Project
from ._readiness import ReadyCheck, first_output, wait_ready
from ._restart import RestartPolicy, RestartTracker
from ._stdin import StdinClosedError, StdinPipe
from ._subprocess_record import SubProcess, SubProcessSummary
from ._supervisor import ManagedRun, RunExit, SpawnSpec, Supervisor, TerminationReason

__all__ = ["ExitHandler", "SubProcess", "SubProcessService", "SubProcessSummary", "open_subprocess_service"]

#: What the engine runs with a record's own final exit when it was created with ``notify_on_exit``.
ExitHandler = Callable[[SubProcess, RunExit], Awaitable[None]]

_log = logging.getLogger("engine.subprocesses")

#: How often at most the log-cap task looks at the files of live children (the design's floor is 1 s);
#: with inotify it looks only at those written since (``_logwatch``), without it at every one.
CAP_POLL_SECONDS = 1.0
#: ``new_only`` cursors kept per record; past this the oldest reader's is forgotten.
MAX_READERS = 256
#: How long the log folders stay open once the last record is gone (an agent that kills its one server
#: and starts the next finds them open: no walk again, no close of the files made ahead in its kill).
RELEASE_FOLDERS_AFTER_SECONDS = 1.0


def _check_directory(project: Project) -> None:
    if not os.path.isdir(project.directory):
        raise SpawnError(
            f"project directory {project.directory!r} does not exist or is not a directory",
            errno=errno.ENOENT,
            path=project.directory,
            reason="bad cwd",
        )


def _now() -> datetime:
    return datetime.now(UTC)


def _log_base(directory: str, project: Project) -> str | None:
    """Where the walk to the log folder ``directory`` starts: the project directory when it is inside."""
    return _base_of(directory, project.directory)


@functools.lru_cache(maxsize=256)
def _base_of(directory: str, project_directory: str) -> str | None:
    """:func:`_log_base` of two paths, kept (a pure function of the strings, asked at every create)."""
    inside = os.path.commonpath([directory, project_directory]) == project_directory
    return project_directory if inside else None


def _create_logs(directory: str, base: str | None, folders: FolderCache) -> LogPair:
    """The log pair of a new child, in ``directory`` reached from ``base`` (a folder walked before is
    checked again in ``folders``, not walked again)."""
    try:
        return LogPair.create(directory, base=base, folders=folders)
    except EngineError:
        raise
    except OSError as exc:
        raise SpawnError(
            f"cannot create the log files in {directory}: {exc.strerror or exc}",
            errno=exc.errno,
            path=directory,
            reason="bad log folder",
        ) from None


@final
@attrs.define(eq=False)
class SubProcessService:
    """Starts, lists, kills and halts the subprocesses of every project.

    Made by :func:`open_subprocess_service`.

    Records are keyed by pid. A kept (halted or finished) record whose pid the kernel hands to a new child
    stays listed, but the pid then resolves to the live child.
    """

    _supervisor: Supervisor = attrs.field(alias="supervisor")
    _config: EngineConfig = attrs.field(alias="config")
    _nursery: trio.Nursery = attrs.field(alias="nursery")
    _records: list[SubProcess] = attrs.field(init=False, factory=list)
    _pending: dict[str, int] = attrs.field(init=False, factory=dict)
    _fences: dict[str | None, int] = attrs.field(init=False, factory=dict)
    _settled: trio.Event = attrs.field(init=False, factory=trio.Event)
    _log_lock: trio.Lock = attrs.field(init=False, factory=trio.Lock)
    _capper: trio.CancelScope | None = attrs.field(init=False, default=None)
    _cap_fresh: bool = attrs.field(init=False, default=False)
    #: The log cap's wait for a write, while it waits: :meth:`_wake_capper` cancels it.
    _cap_idle: trio.CancelScope | None = attrs.field(init=False, default=None)
    _closed: bool = attrs.field(init=False, default=False)
    #: No record restarts any more: the engine is stopping (:meth:`call_off_restarts`).
    _restarts_off: bool = attrs.field(init=False, default=False)
    #: The projects' log folders, walked once and kept open (checked again at each create) while the
    #: service has records, and :data:`RELEASE_FOLDERS_AFTER_SECONDS` after.
    _folders: FolderCache = attrs.field(init=False, factory=lambda: FolderCache(background=True))
    #: The wait before the folders are released (:meth:`_release_folders_soon`), while one is due.
    _release_due: trio.CancelScope | None = attrs.field(init=False, default=None)
    #: Awaited with each ``notify_on_exit`` record's own final exit (the engine records a fired event).
    on_final_exit: ExitHandler | None = attrs.field(init=False, default=None)

    def __repr__(self) -> str:
        live = sum(1 for sp in self._records if sp.running)
        return f"<SubProcessService {live} live, {len(self._records) - live} kept>"

    # ---- creating ------------------------------------------------------------------------------

    async def create(
        self,
        project: Project,
        cmd: str,
        args: Sequence[str] = (),
        *,
        env: Mapping[str, str] | None = None,
        stdin: bool = False,
        ready: ReadyCheck | None = None,
        restart: RestartPolicy | None = None,
        notify_on_exit: bool = False,
    ) -> SubProcess:
        """Start ``cmd args...`` in ``project.directory`` with its output in two new log files.

        The child gets the engine's environment plus ``env`` (as ``systemd-run --setenv`` does).

        The logs are created (mode 0600, folder 0700 with a ``.gitignore`` holding ``*``) without a name
        (``O_TMPFILE``; under temporary names where the filesystem has none) before the spawn and named
        ``subproc-<pid>.stdout.log`` / ``.stderr.log`` once the pid is known; the child's descriptors
        follow. When a kept record already owns those names, its files move aside to
        ``subproc-<pid>-<n>.*`` first. The folders under the project are reached without following links
        and must be the engine user's own (``docs/security.md``); a project's folder is walked once and
        checked again at each create while the service has records, and the next create's two unnamed
        files are made after each spawn by a thread of the service's own (``FolderCache``), off the loop.

        A failure at any step leaves nothing of this call: after the spawn (a rename that fails) the
        child is killed at once (``cancel(force=True)``, shielded), and the files and the folders this
        call made are removed.

        Args:
            project: the project; the child runs in its directory.
            cmd: the program (looked up in ``PATH``, or a path relative to the project directory).
            args: its arguments.
            env: variables added to the engine's environment.
            stdin: give the child a pipe as its stdin, written with :meth:`write_stdin` (default:
                ``/dev/null``). No pseudo-terminal.
            ready: wait until the process is ready (a log line, a listening port), exits, or the check's
                timeout passes (``engine._readiness``); the process is never killed for it.
                ``summarize(sp).ready`` and ``first_output`` tell what was found.
            restart: restart the process when it exits on its own (``engine._restart``); ``None`` or
                mode ``"no"``: never.
            notify_on_exit: its own final exit (after the last restart; not a kill, a halt or the
                engine's stop) becomes a fired event with ``job_id="subprocess:<first pid>"``, through
                the event log and ``on_fire`` as cron's are.

        Cancellation: before the spawn nothing is left behind; once spawned the record is registered
        (a readiness wait cancelled leaves the process running, with ``ready`` unset).

        Raises:
            ValueError, TypeError: ``cmd`` or ``args`` is not a program and a list of strings, ``env`` is
                not a mapping of variable names to strings, or ``stdin``, ``ready``, ``restart`` or
                ``notify_on_exit`` is of the wrong type.
            LimitExceededError: ``max_processes_per_project`` or ``max_processes`` would be exceeded.
            SpawnError: the program, the project directory or the log folder cannot be used (a file in
                the way, a folder that cannot be made: reason ``"bad log folder"``); no record, no file
                is left.
            UntrustedPathError: ``.gadget`` or the log folder is a symbolic link or another user's.
            OSError: a log file cannot be renamed, or no pipe can be made; no record, no file is left.
            RuntimeError: the service is stopped.
        """
        if not isinstance(project, Project):
            raise TypeError(f"project must be a Project, got {project!r}")
        argv = check_argv(cmd, args)
        extra_env = None if env is None else check_env(env)
        check_flag(stdin, "stdin")
        check_flag(notify_on_exit, "notify_on_exit")
        if ready is not None and not isinstance(ready, ReadyCheck):
            raise TypeError(f"ready must be a ReadyCheck or None, got {show(ready)}")
        if restart is not None and not isinstance(restart, RestartPolicy):
            raise TypeError(f"restart must be a RestartPolicy or None, got {show(restart)}")
        self._check_limits(project)
        if self._closed:
            raise RuntimeError("the subprocess service is stopped; start a new engine to create processes")
        if self._fences.get(None) or self._fences.get(project.id):
            raise KillInProgressError(
                "a killAll (or a kill of this project's processes) is under way; nothing was started: "
                "create again once it has returned"
            )
        directory = os.path.join(project.directory, self._config.gadget_dir_name, "subprocess-logs")
        # As trio's open_process does: every step registers its undo, and a failure at any step, after
        # the spawn too, runs them all (end the child, delete the files and the folders made here).
        async with contextlib.AsyncExitStack() as undo:
            with self._reserve(project):
                base = _log_base(directory, project)
                try:
                    logs = _create_logs(directory, base, self._folders)
                except Exception:
                    # The project directory is looked at only when the log folder could not be used (no
                    # stat before every create): a missing one is told as such, not as a log folder error;
                    # the spawn tells a directory that went missing since in the same words.
                    _check_directory(project)
                    raise
                undo.callback(logs.discard)
                run, pipe = await self._spawn_child(
                    argv, project.directory, extra_env, project.scope_key, logs, stdin=stdin, undo=undo
                )
                logs.rename(run.pid, (sp._logs for sp in self._records))
                # The next create's two files, made by the folder cache's thread while this child runs.
                LogPair.prepare(directory, base=base, folders=self._folders)
                tracker = RestartTracker(restart) if restart is not None and restart.mode != "no" else None
                sp = SubProcess(
                    first_pid=run.pid,
                    project=project,
                    command=cmd,
                    args=tuple(args),
                    created_at=run.started_at,
                    run=run,
                    logs=logs,
                    stdin=pipe,
                    restart=tracker,
                    notify_on_exit=notify_on_exit,
                    # What the restarts start again; made after the spawn, and only for a record that
                    # restarts (the spawn itself makes the child's own, with its descriptors).
                    spec=None
                    if tracker is None
                    else SpawnSpec(
                        argv=argv, cwd=project.directory, env=extra_env, scope_key=project.scope_key
                    ),
                )
                self._records.append(sp)
            undo.pop_all()
        if needs_task(sp):
            self._nursery.start_soon(self._keep, sp, name=f"subprocess {sp.first_pid}")
        else:  # nothing to wait for but the exit: a hook of the run, no task
            run.on_leader_exit(functools.partial(finish, self, sp))
        self._start_capper()
        if ready is not None:
            await self._wait_ready(sp, ready)
        return sp

    async def _spawn(
        self, spec: SpawnSpec, logs: LogPair, *, stdin: bool, undo: contextlib.AsyncExitStack
    ) -> tuple[ManagedRun, StdinPipe | None]:
        """Spawn a record's ``spec`` again (a restart) writing into ``logs``: see :meth:`_spawn_child`."""
        assert spec.argv is not None and spec.cwd is not None
        return await self._spawn_child(
            spec.argv, spec.cwd, spec.env, spec.scope_key, logs, stdin=stdin, undo=undo
        )

    async def _spawn_child(
        self,
        argv: tuple[str, ...],
        cwd: str,
        env: Mapping[str, str] | None,
        scope_key: str,
        logs: LogPair,
        *,
        stdin: bool,
        undo: contextlib.AsyncExitStack,
    ) -> tuple[ManagedRun, StdinPipe | None]:
        """Spawn ``argv`` in ``cwd`` (with ``env`` added, under ``scope_key``) writing into ``logs`` (with a
        stdin pipe when asked); register the undo of each step on ``undo`` (close the pipe, end the child
        at once). One :class:`SpawnSpec` is made, with the child's descriptors (about 10 us each)."""
        pipe: StdinPipe | None = None
        read_end: int | None = None
        if stdin:
            pipe, read_end = StdinPipe.open()
            undo.callback(pipe.close, "the process could not be started")
        try:
            with logs.open_for_child() as (out, err):
                spec = SpawnSpec(
                    argv=argv, cwd=cwd, env=env, scope_key=scope_key, stdout=out, stderr=err, stdin=read_end
                )
                run = await self._supervisor.spawn(spec)
        finally:
            if read_end is not None:
                os.close(read_end)  # the child has its copy
        undo.push_async_callback(self._end_now, run)
        if pipe is not None:
            pipe.pid = run.pid
        return run, pipe

    @contextlib.contextmanager
    def _reserve(self, project: Project) -> Iterator[None]:
        """Count a create under way against the project's limits until it has a record or failed."""
        self._pending[project.id] = self._pending.get(project.id, 0) + 1
        try:
            yield
        finally:
            self._pending[project.id] -= 1
            if not self._pending[project.id]:
                del self._pending[project.id]
            if self._fences:  # only a fence waits for it (a fence counts itself in before it waits)
                settled, self._settled = self._settled, trio.Event()
                settled.set()

    @contextlib.asynccontextmanager
    async def _fence(self, project_id: str | None) -> AsyncIterator[None]:
        """Refuse new creates (of ``project_id``; ``None``: all) and wait for those under way (SP-16).

        A create that had started before the fence finishes and has a record, which the caller then kills
        with the rest; one that comes during the fence raises :class:`KillInProgressError`; after it,
        ``create`` works again.
        """
        self._fences[project_id] = self._fences.get(project_id, 0) + 1
        try:
            while self._pending if project_id is None else self._pending.get(project_id):
                await self._settled.wait()
            yield
        finally:
            self._fences[project_id] -= 1
            if not self._fences[project_id]:
                del self._fences[project_id]

    async def _end_now(self, run: ManagedRun) -> None:
        with trio.CancelScope(shield=True):
            await self._supervisor.cancel(run, force=True)

    def _check_limits(self, project: Project) -> None:
        per_project = self._config.max_processes_per_project
        pending = sum(self._pending.values()) if self._pending else 0
        if len(self._records) + pending < min(per_project, self._config.max_processes):
            return  # fewer records than either limit, kept ones included: no count needed
        live = [sp for sp in self._records if sp.running or sp._backoff is not None]
        mine = sum(1 for sp in live if sp.project.id == project.id) + self._pending.get(project.id, 0)
        if mine >= per_project:
            raise LimitExceededError(
                f"max_processes_per_project reached: project {project.slug!r} already has {mine} live "
                f"subprocesses (limit {per_project}); kill or halt one, or raise the setting"
            )
        total = len(live) + sum(self._pending.values())
        if total >= self._config.max_processes:
            raise LimitExceededError(
                f"max_processes reached: {total} live subprocesses in the engine (limit "
                f"{self._config.max_processes}); kill or halt one, or raise the setting"
            )

    # ---- following a record: stdin, restarts, the exit notice --------------------------------------

    async def _keep(self, sp: SubProcess) -> None:
        await keep(self, sp)

    def _asked(self, sp: SubProcess, exit: RunExit) -> bool:
        """Whether the end of ``sp``'s process was asked for (a kill, a halt, the engine's stop, a fence)."""
        fenced = bool(self._fences.get(None) or self._fences.get(sp.project.id))
        stopping = self._closed or self._restarts_off
        return sp._ended_on_purpose or exit.reason is TerminationReason.CANCELLED or stopping or fenced

    def call_off_restarts(self) -> None:
        """The engine is stopping: from now on no record is restarted. A restart waiting out its back-off
        is called off at once, and a process that exits later is not restarted: its record ends as after
        a kill (a ``wait`` on it answers; no exit notice is sent). ``serve``'s graceful stop calls it
        before it ends the processes. Not undone; sync.
        """
        self._restarts_off = True
        for sp in self._records:
            if sp._backoff is not None:
                sp._backoff.cancel()

    async def write_stdin(self, pid: int, data: str | bytes, *, eof: bool = False) -> None:
        """Write ``data`` to the stdin of the record ``pid`` names (created with ``stdin=True``); with
        ``eof``, then close it so the process reads end of input.

        Text is sent as UTF-8. Writers take turns. A process that does not read blocks the write once
        its pipe holds 64 KiB; bound the call with ``trio.move_on_after``.

        Cancellation: what was sent before stays sent (a partial write when the process was not
        reading); the pipe stays open.

        Raises:
            ValueError: ``data`` is neither text nor bytes, or ``eof`` is not a bool.
            SubProcessNotFoundError: no managed subprocess has this pid.
            StdinClosedError: it has no stdin pipe, its input was ended, or it exited; nothing was sent.
        """
        if isinstance(data, str):
            check_string(data, "data")
            payload = data.encode()
        elif isinstance(data, bytes | bytearray | memoryview):
            payload = bytes(data)
        else:
            raise InvalidArgumentError(f"data must be text or bytes, got {show(data)}")
        check_flag(eof, "eof")
        sp = self.lookup(pid)
        if sp._stdin is None:
            raise StdinClosedError(
                f"subprocess {sp.pid} has no stdin pipe (it reads /dev/null); create it with stdin=True "
                "(the CLI's create --stdin) to write to it"
            )
        await sp._stdin.write(payload, eof=eof)

    async def wait(self, pid: int) -> SubProcessSummary:
        """Wait until the record ``pid`` names has exited for good (after its last restart) and what its
        leader left running is gone too (``SubProcess.wait_drained``: the logs are then complete), and
        return its summary; at once when it already has.

        Callers bound the wait with ``trio.move_on_after``.

        Cancellation: safe; nothing changes.

        Raises:
            SubProcessNotFoundError: no managed subprocess has this pid.
        """
        sp = self.lookup(pid)
        await sp.wait_drained()
        return self.summarize(sp)

    async def wait_ready(self, pid: int, ready: ReadyCheck) -> SubProcessSummary:
        """Wait until the record ``pid`` names is ready by ``ready`` (as :meth:`create`'s ``ready``: its
        logs are read from their start, so a line written before this call counts), has exited, or
        ``ready.timeout_seconds`` passed; then return its summary, ``ready`` and ``first_output`` set.

        ``gadget-engine create --ready-log`` creates first, prints the pid, then waits here: a Ctrl-C
        during the wait leaves the pid on the screen.

        Cancellation: safe; the process goes on, its ``ready`` unchanged.

        Raises:
            SubProcessNotFoundError: no managed subprocess has this pid.
            TypeError: ``ready`` is not a :class:`ReadyCheck`.
        """
        sp = self.lookup(pid)
        if not isinstance(ready, ReadyCheck):
            raise TypeError(f"ready must be a ReadyCheck, got {show(ready)}")
        await self._wait_ready(sp, ready)
        return self.summarize(sp)

    async def _wait_ready(self, sp: SubProcess, ready: ReadyCheck) -> None:
        """Wait until ``sp``'s current process is ready by ``ready``; set ``ready`` and ``first_output``."""
        sp.ready = await wait_ready(ready, sp._run, sp._logs, self._log_lock)
        sp.first_output = await trio.to_thread.run_sync(first_output, sp._logs)

    # ---- looking ---------------------------------------------------------------------------------

    def ps(self) -> list[SubProcess]:
        """Every managed subprocess, live or kept (halted, finished), oldest first."""
        return list(self._records)

    def lookup(self, pid: int, *, project_id: str | None = None) -> SubProcess:
        """The record ``pid`` names: the live child holding it, else the newest kept record.

        A restarted record answers to its current pid and to its first; a record whose current process
        has the pid comes before one whose first pid it is.

        Args:
            pid: the child's pid (current or first).
            project_id: only this project's records (``None``: every project's). A project reading its
                own kept record gets it even while another project's live child holds the pid.

        Raises:
            InvalidArgumentError: ``pid`` is not a whole number (a string, a float, ``None``, a bool), as
                the tool and the RPC say for the same value.
            SubProcessNotFoundError: no managed subprocess (of that project) has this pid, or it was
                killed.
        """
        if isinstance(pid, bool) or not isinstance(pid, int):
            raise InvalidArgumentError(f"pid must be a whole number, got {show(pid)}")
        matches = [
            sp
            for sp in self._records
            if sp.answers_to(pid) and (project_id is None or sp.project.id == project_id)
        ]
        if not matches:
            whose = "" if project_id is None else f" of project {project_id!r}"
            raise SubProcessNotFoundError(
                f"no managed subprocess{whose} has pid {pid!r} (never created here, or killed); "
                "list the subprocesses to see which are managed"
            )
        live = [sp for sp in matches if sp.running]
        current = [sp for sp in live or matches if sp.pid == pid]
        return (current or live or matches)[-1]

    def summarize(self, sp: SubProcess) -> SubProcessSummary:
        """A serialisable snapshot of ``sp``; ``updated_at`` also looks at its log files' mtime."""
        updated = sp._last_change()
        modified = sp._logs.modified_at()
        if modified is not None:
            updated = max(updated, modified)
        ex = sp.exit
        return SubProcessSummary(
            pid=sp.pid,
            project_id=sp.project.id,
            project_slug=sp.project.slug,
            command=sp.command,
            args=sp.args,
            state=sp.state,
            status=sp._status(),
            exit_code=ex.exit_code if ex is not None else None,
            signal=ex.signal if ex is not None else None,
            reason=ex.reason if ex is not None else None,
            escalated=ex.escalated if ex is not None else False,
            survivors=ex.survivors if ex is not None else (),
            created_at=sp.created_at,
            updated_at=updated,
            stdout_path=sp.stdout_path,
            stderr_path=sp.stderr_path,
            ready=sp.ready,
            first_output=sp.first_output,
            restarts=sp.restarts,
            first_pid=sp.first_pid,
            last_exit=sp._last_exit.describe() if sp._last_exit is not None else None,
        )

    # ---- ending ----------------------------------------------------------------------------------

    def _require(self, sp: SubProcess) -> None:
        if not isinstance(sp, SubProcess) or sp._removed or sp not in self._records:
            raise SubProcessNotFoundError(
                f"{sp!r} is not a managed subprocess (killed, or never created here)"
            )

    async def _stop(self, sp: SubProcess) -> bool:
        """End ``sp``'s tree if it is alive; ``True`` when this call is the one that stopped it.

        After the leader's own exit, what is left of its tree (SP-03's drain) is ended at once. A restart
        pending is called off: nothing a caller ends comes back.
        """
        draining = sp.exit is not None  # its leader's exit stays the record's last change
        mine = self._take_stop(sp, _now())
        if mine is None:
            await trio.lowlevel.checkpoint()
            return False
        try:
            await self._supervisor.cancel(sp._run)
        finally:
            if mine and not draining:
                sp._changed_at = _now()
        return mine

    async def _stop_many(self, records: list[SubProcess]) -> None:
        """:meth:`_stop` of every record, from this one task (``Supervisor.cancel_many``)."""
        now = _now()
        draining = {id(sp) for sp in records if sp.exit is not None}  # their leaders' exits stay
        taken = [(sp, self._take_stop(sp, now)) for sp in records]
        try:
            await self._supervisor.cancel_many([sp._run for sp, mine in taken if mine is not None])
        finally:
            now = _now()
            for sp, mine in taken:
                if mine and id(sp) not in draining:
                    sp._changed_at = now

    @staticmethod
    def _take_stop(sp: SubProcess, now: datetime) -> bool | None:
        """The start of a stop of ``sp``: it ends on purpose and a restart pending is called off. Whether
        its tree is this call's to end (``True``, marked stopping at ``now``; also when the leader exited
        and what is left of its tree still drains: those are live processes this call ends), another's
        to end that this call waits for too (``False``: another call is ending it), or already over
        (``None``)."""
        sp._ended_on_purpose = True
        if sp._backoff is not None:
            sp._backoff.cancel()
        if sp._stopping:
            return None if sp.ended else False
        if sp.exit is not None:  # the leader exited: its tree drains (SP-03) or is over
            if sp.ended:
                return None
            sp._stopping = True  # this call ends the leftovers, live processes of the record
            return True
        sp._stopping = True
        sp._changed_at = now
        return True

    async def _delete_logs(self, records: list[SubProcess], deleted: set[int]) -> None:
        """Delete the logs of ``records`` (being killed) in one worker-thread call, under the log lock as
        the cap's work, while their trees are being ended: the ``unlink`` pass overlaps the grace period
        instead of following the last reap. Each record deleted is added to ``deleted`` (by ``id``).

        Cancellation: safe; what is not deleted yet is left to :meth:`_remove_many`.
        """

        def delete() -> None:
            for sp in records:
                sp._logs.delete()
                deleted.add(id(sp))

        async with self._log_lock:
            await trio.to_thread.run_sync(delete)
        if self._capper is not None and all(sp._killing for sp in self._records):
            # Every log is deleted, and a create makes a new cap: the cap ends now, during the grace, and
            # its watches go with it. Left running, it read the ``IN_IGNORED`` of every log (some 2000
            # for a kill_all of 1000) as the killed children released them, among the kills.
            self._capper.cancel()
            self._capper = None

    def _remove_many(self, records: list[SubProcess], *, deleted: AbstractSet[int] = frozenset()) -> None:
        """Forget ``records`` (killed): close their stdin, delete their logs (except those of ``deleted``,
        by ``id``: deleted already), drop them from the list in one pass (``kill_all`` of 1000 would
        otherwise search the list 1000 times)."""
        removed: set[int] = set()
        for sp in records:
            if sp._removed:
                continue
            sp._removed = True
            removed.add(id(sp))
            if sp._stdin is not None:
                sp._stdin.close("the process was killed")
            if id(sp) not in deleted:
                sp._logs.delete()
        if removed:
            self._records[:] = [sp for sp in self._records if id(sp) not in removed]
        if not self._records:  # no record left: the folders kept open (and their spare files) go too
            self._release_folders_soon()

    def _release_folders_soon(self) -> None:
        """Release the log folders kept open (and the files made ahead in them) once no record has been
        left for :data:`RELEASE_FOLDERS_AFTER_SECONDS`; an idle engine then holds nothing in a project's
        directory. Not in the kill that removed the last record: closing them there cost it 7 ``close``
        calls (0.05-0.1 ms of a ``kill_pid``) and the next create its walk."""
        if self._release_due is not None or self._closed:
            return
        self._release_due = scope = trio.CancelScope()

        async def release() -> None:
            try:
                with scope:
                    await trio.sleep(RELEASE_FOLDERS_AFTER_SECONDS)
                    if not self._records:
                        self._folders.release()  # its thread stays, idle, for the next create
            finally:
                self._release_due = None

        self._nursery.start_soon(release, name="release the log folders")

    async def kill_subprocess(self, sp: SubProcess) -> bool:
        """End ``sp`` by escalation, delete both its log files and forget it.

        Escalation: SIGINT to the group, up to ``grace_seconds`` for the whole tree to go, SIGKILL, up to
        ``kill_wait_seconds`` more, reap. A record that already exited (halted or finished) is not
        signalled again; its logs are still deleted.

        Cancellation: the tree is still ended, reaped and its logs deleted; then the cancellation
        propagates.

        Returns:
            ``True`` when this call stopped a live process (the leader, or what is left of its tree while
            it drains after the leader's exit, SP-03), ``False`` when it had already exited.

        Raises:
            SubProcessNotFoundError: ``sp`` was already killed or is not managed here.
        """
        self._require(sp)
        sp._killing = True
        self._supervisor.begin_cancel((sp._run,))  # SIGINT now
        deleted: set[int] = set()
        if not self._log_lock.locked():  # the cap's work holds it while it writes or reads logs
            # While the tree handles SIGINT: the unlinks (0.1-0.2 ms) overlap its exit instead of following
            # it. No checkpoint lies between here and the stop's start, so no restart comes in between.
            try:
                sp._logs.delete()
            except OSError:
                pass  # tried again once the tree has ended (_remove_many), whose error the caller gets
            else:
                deleted.add(id(sp))
        try:
            return await self._stop(sp)
        finally:
            if sp.exit is not None:
                self._remove_many([sp], deleted=deleted)

    async def kill_pid(self, pid: int) -> bool:
        """:meth:`kill_subprocess` for the record ``pid`` names (see :meth:`lookup`).

        Cancellation: as :meth:`kill_subprocess`.

        Raises:
            SubProcessNotFoundError: no managed subprocess has this pid.
        """
        return await self.kill_subprocess(self.lookup(pid))

    async def _kill_many(self, records: list[SubProcess]) -> bool:
        """:meth:`kill_subprocess` of every record (concurrently: the supervisor escalates the trees that
        start together as one batch), then every record forgotten at once and every log deleted.

        Cancellation: as :meth:`kill_subprocess`, for each of them.
        """
        live = [sp for sp in records if not sp._removed]
        for sp in live:
            sp._killing = True  # a halt meanwhile must not answer that the logs are kept
        self._supervisor.begin_cancel(sp._run for sp in live if not sp.ended)  # SIGINT to all, in one loop
        deleted: set[int] = set()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._delete_logs, live, deleted)
                await self._stop_many(live)
        finally:
            self._remove_many([sp for sp in records if sp.exit is not None], deleted=deleted)
        return all(sp._run.exit is not None and not sp._run.exit.survivors for sp in records)

    async def kill_project(self, project_id: str) -> None:
        """Kill every subprocess of one project (concurrently), live or kept, and delete their logs.

        Other projects' subprocesses are not touched. An unknown id kills nothing.

        Cancellation: as :meth:`kill_subprocess`, for each of them.
        """
        if not isinstance(project_id, str):
            raise TypeError(f"project_id must be a string, got {project_id!r}")
        async with self._fence(project_id):
            await self._kill_many([sp for sp in self._records if sp.project.id == project_id])

    async def kill_all(self) -> bool:
        """Kill every subprocess of every project (concurrently) and delete every log file.

        The engine runs this when it stops.

        Cancellation: as :meth:`kill_subprocess`, for each of them.

        Creates under way when it starts finish and are killed by this same call; creates that come while
        it runs raise :class:`KillInProgressError`, and work again once it has returned (SP-16).

        An orphan re-parented to the engine (the subreaper) that no run claims is ended too when the
        engine owns its process (``EngineConfig.end_unclaimed_orphans``: ``serve``, ``mcp``); embedded,
        where the host's own children look the same, it is only named in the engine log.

        Returns:
            ``True`` when every run was verified ended, with no survivor of SIGKILL anywhere: in cgroup
            containment every leaf is empty; in process-group containment every group and every tracked
            escapee is gone, and no unclaimed orphan is left (embedded: none is there). What it cannot
            prove: a process that left its group and scrubbed its environment without the engine as
            subreaper (see ``docs/guide-escalation.md``).
        """
        async with self._fence(None):
            verified = await self._kill_many(list(self._records))
        orphans = self._supervisor.unclaimed_children()
        if not orphans:
            return verified
        if not self._config.end_unclaimed_orphans:
            _log.warning(
                "kill_all: %d unclaimed children of the engine left running (not started by it, or a "
                "run's escapees it cannot attribute): %s",
                len(orphans),
                ", ".join(f"{pid} ({_command_name(pid)})" for pid in sorted(orphans)),
            )
            return False
        survivors = await self._supervisor.end_processes(orphans)
        return verified and not survivors

    async def halt_subprocess(self, sp: SubProcess) -> bool:
        """End ``sp`` by escalation but keep its record and both log files for inspection.

        Afterwards ``sp`` is exited with its exit; ``ps``, ``summarize`` and ``get_log`` still work. Halting
        a record that already exited is a harmless no-op returning ``False``: its old pid is never
        signalled again and its logs stay as they are. A record whose leader exited while the rest of
        its tree drains (SP-03) has that rest ended at once, and ``True`` is returned.

        Cancellation: the tree is still ended and reaped; then the cancellation propagates.

        Returns:
            ``True`` when this call stopped a live process.

        Raises:
            SubProcessNotFoundError: ``sp`` was killed or is not managed here, or a kill of it began
                before this halt ended (its logs are deleted: nothing is kept).
        """
        self._require(sp)
        stopped = await self._stop(sp)
        if sp._killing:  # a concurrent kill ended it, or will delete its logs at once: not kept
            raise SubProcessNotFoundError(
                f"pid {sp.pid} was killed while it was being halted; its logs are deleted"
            )
        if stopped:
            with trio.CancelScope(shield=True):
                await self._cap([sp])
        return stopped

    async def halt_pid(self, pid: int) -> bool:
        """:meth:`halt_subprocess` for the record ``pid`` names.

        Cancellation: as :meth:`halt_subprocess`.

        Raises:
            SubProcessNotFoundError: no managed subprocess has this pid.
        """
        return await self.halt_subprocess(self.lookup(pid))

    # ---- logs ------------------------------------------------------------------------------------

    async def get_log(self, pid: int, stream: str) -> str:
        """The whole kept content of one log of the record ``pid`` names (invalid UTF-8 replaced).

        Cancellation: the read runs in a worker thread and is waited for (it is bounded by the log cap).

        Raises:
            InvalidArgumentError: ``stream`` is not ``"stdout"`` or ``"stderr"``, or ``pid`` is not a
                whole number (both ``ValueError``).
            SubProcessNotFoundError: no managed subprocess has this pid, or its log file is gone.
        """
        name = check_stream(stream)
        got = await self._read(self.lookup(pid), name)
        return got.text

    async def read_log(
        self,
        pid: int,
        stream: str,
        *,
        offset: int | None = None,
        limit: int | None = None,
        tail: int | None = None,
        max_bytes: int = 32768,
        new_only: bool = False,
        grep: str | None = None,
        reader: str = "default",
        project_id: str | None = None,
    ) -> LogSlice:
        """Read a bounded slice of one log of the record ``pid`` names: forward from ``offset`` or the
        last ``tail`` lines; only what is new to ``reader``; or only the lines ``grep`` matches.

        Args:
            pid: the child's pid (see :meth:`lookup`).
            stream: ``"stdout"`` or ``"stderr"``.
            offset: logical byte offset to read forward from (the default: the oldest kept byte).
                Offsets in the part the log cap dropped start at the first kept byte.
            limit: at most this many lines (forward reads only).
            tail: the last this many lines (not with ``offset`` or ``limit``).
            max_bytes: at most this many bytes of text.
            new_only: what was written to the stream since ``reader``'s last ``new_only`` read (its first:
                everything kept). When more is new than ``max_bytes``, the oldest part is returned and the
                reader's cursor moves only past it (``total_bytes - next_offset`` is what is left). When
                output the reader never saw is gone (the log cap dropped it, or the file was truncated
                from outside), the read starts at the oldest kept byte and ``skipped_bytes`` says how
                much was lost. Not with ``offset`` or ``tail``.
            grep: a regular expression (``regex`` syntax); the text is then the matching lines as
                ``<line number>: <line>``, numbered from the oldest kept line, within ``max_bytes``
                (``engine._logsearch``). With ``new_only`` it looks in the new part only.
            reader: whose cursor ``new_only`` uses (the tool uses the calling project's id).
            project_id: only this project's records (see :meth:`lookup`).

        Cancellation: as :meth:`get_log`.

        Raises:
            ValueError, TypeError: a bad stream, a bad combination or value of the numbers, a pattern
                that does not compile, or a reader that is not a non-empty string.
            PatternTimeoutError: ``grep`` ran out of time (2 s) on this log.
            SubProcessNotFoundError: no managed subprocess (of that project) has this pid, or its log
                file is gone.
        """
        name = check_stream(stream)
        check_read_args(offset, limit, tail, max_bytes)
        check_flag(new_only, "new_only")
        who = check_reader(reader)
        if new_only and (offset is not None or tail is not None):
            raise InvalidArgumentError(
                "new_only reads on from where this reader stopped; leave out offset and tail"
            )
        pattern = compile_pattern(grep, "grep") if grep is not None else None
        sp = self.lookup(pid, project_id=project_id)
        if not new_only and pattern is None:
            return await self._read(sp, name, offset=offset, limit=limit, tail=tail, max_bytes=max_bytes)
        async with sp._cursor_lock:  # one new_only read of a record at a time: no part returned twice
            cursor = sp._cursors.get((name, who)) if new_only else offset
            try:
                if pattern is not None:
                    got = await grep_log(
                        sp._logs,
                        name,
                        pattern,
                        self._log_lock,
                        offset=cursor,
                        limit=limit,
                        tail=tail,
                        max_bytes=max_bytes,
                    )
                else:
                    got = await self._read(sp, name, offset=cursor, limit=limit, max_bytes=max_bytes)
            except FileNotFoundError:
                raise _gone(sp, name) from None
            if not new_only:
                return got
            skipped = max(0, got.start_offset - cursor) if cursor is not None else 0
            if cursor is not None and pattern is not None:
                skipped = max(0, got.dropped_bytes - cursor)
            if len(sp._cursors) >= MAX_READERS and (name, who) not in sp._cursors:
                del sp._cursors[next(iter(sp._cursors))]  # the oldest reader starts again from the start
            sp._cursors[(name, who)] = got.next_offset
            return attrs.evolve(got, skipped_bytes=skipped)

    async def _read(
        self,
        sp: SubProcess,
        stream: Stream,
        *,
        offset: int | None = None,
        limit: int | None = None,
        tail: int | None = None,
        max_bytes: int | None = None,
    ) -> LogSlice:
        read = functools.partial(
            sp._logs.read, stream, offset=offset, limit=limit, tail=tail, max_bytes=max_bytes
        )
        async with self._log_lock:
            try:
                return await trio.to_thread.run_sync(read)
            except FileNotFoundError:
                raise _gone(sp, stream) from None

    # ---- the log cap -----------------------------------------------------------------------------

    def _start_capper(self) -> None:
        if self._closed:
            return
        self._cap_fresh = True  # a new child: its logs are looked at (and their watches armed) next
        if self._capper is None:
            self._capper = trio.CancelScope()
            self._nursery.start_soon(self._cap_loop, self._capper, name="subprocess log cap")
        self._wake_capper()

    def _wake_capper(self) -> None:
        """Have the log cap look again (at its next allowed look): a child was created or restarted, or
        a process exited (when none is left alive, the cap takes its last look and ends)."""
        if self._cap_idle is not None:
            self._cap_idle.cancel()

    async def _cap_loop(self, scope: trio.CancelScope) -> None:
        watch: LogWatch[LogFile] | None = open_log_watch()
        try:
            with scope:
                if watch is None:
                    await self._cap_polling()
                else:
                    await self._cap_watching(watch)
        finally:
            if watch is not None:
                trio.lowlevel.notify_closing(watch.fileno())
                watch.close()
            if self._capper is scope:
                self._capper = None

    async def _cap_polling(self) -> None:
        """Without inotify: every log of every live child once a second, until none is alive."""
        while True:
            await trio.sleep(CAP_POLL_SECONDS)
            todo = [sp for sp in self._records if sp.running or not sp._capped_final]
            if not todo:
                return
            await self._cap(todo)

    async def _cap_watching(self, watch: LogWatch[LogFile]) -> None:
        """Look only at the logs written since the last look (``_logwatch``), at most once a second: a
        new child's logs once (arming their watches), then each log when its watch reports a write; logs
        whose watch could not be added every second, and every log when the kernel's queue overflowed.
        Between looks it waits for the inotify descriptor to become readable (or for
        :meth:`_wake_capper`), so an engine whose children write nothing does not wake for its logs. A
        write is looked at within a second of the previous look, as with a look every second. Ends once no
        child is alive."""
        tracked: dict[LogFile, SubProcess] = {}
        polled: set[LogFile] = set()

        def arm(log: LogFile, fd: int) -> None:
            if watch.arm(fd, log):
                polled.discard(log)
            else:
                polled.add(log)

        looked_at = trio.current_time()
        while True:
            await self._cap_wait(watch, busy=bool(polled))
            await trio.sleep_until(looked_at + CAP_POLL_SECONDS)  # never two looks within a second
            looked_at = trio.current_time()
            written, overflow = watch.take()  # drains the descriptor: it is not readable again until a write
            fresh, self._cap_fresh = self._cap_fresh, False
            if written or overflow or fresh or polled:
                todo: dict[SubProcess, set[LogFile] | None] = {}  # None: both files
                live = set(self._records)
                for log in [log for log, sp in tracked.items() if sp not in live]:  # killed: forgotten
                    del tracked[log]
                    polled.discard(log)
                if overflow or fresh:
                    for sp in self._records:
                        if overflow or sp._logs.files[0] not in tracked:
                            todo[sp] = None
                            tracked.update(dict.fromkeys(sp._logs.files, sp))
                for log in written | polled:
                    owner = tracked.get(log)
                    if owner is not None and (owner not in todo or todo[owner] is not None):
                        todo[owner] = {*(todo.get(owner) or ()), log}
                if todo:
                    await self._cap(list(todo), only=todo, arm=arm)
            if not any(sp.running for sp in self._records):
                last = [sp for sp in self._records if not sp._capped_final]
                if last:  # the last look: a child that ended since it was looked at gets its final cap
                    await self._cap(last)
                if not any(sp.running for sp in self._records):  # none created during that last look
                    return

    async def _cap_wait(self, watch: LogWatch[LogFile], *, busy: bool) -> None:
        """Wait until the cap has something to look at: an armed log was written (the inotify descriptor
        is readable), :meth:`_wake_capper` was called, or no child is alive; at once when ``busy`` (logs
        without a watch are looked at every second) or a new child's logs are waiting.

        Cancellation: safe; nothing is read.
        """
        if busy or self._cap_fresh or not any(sp.running for sp in self._records):
            return
        with trio.CancelScope() as idle:
            self._cap_idle = idle
            try:
                await trio.lowlevel.wait_readable(watch.fileno())
            finally:
                self._cap_idle = None

    async def _cap(
        self,
        records: list[SubProcess],
        *,
        only: Mapping[SubProcess, set[LogFile] | None] | None = None,
        arm: Callable[[LogFile, int], object] | None = None,
    ) -> None:
        finished = [sp for sp in records if not sp.running]
        cap = self._config.log_cap_bytes

        def enforce() -> None:
            for sp in records:
                sp._logs.enforce_cap(cap, only=None if only is None else only.get(sp), arm=arm)

        async with self._log_lock:
            await trio.to_thread.run_sync(enforce)
        for sp in finished:
            sp._capped_final = True

    def _close(self) -> None:
        self._closed = True
        self._folders.close()
        for sp in self._records:  # kept records: their stdin pipes go with the service
            if sp._stdin is not None:
                sp._stdin.close("the engine stopped")
        self._nursery.cancel_scope.cancel()  # the cap, and the records' tasks: nothing more restarts


def _command_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return "gone"


def _gone(sp: SubProcess, stream: Stream) -> SubProcessNotFoundError:
    path = sp._logs.path(stream)
    if sp._killing:  # a kill deletes the logs once SIGINT is sent, while the tree handles it
        return SubProcessNotFoundError(
            f"subprocess {sp.pid} is being killed: its {stream} log is deleted ({path})"
        )
    return SubProcessNotFoundError(
        f"the {stream} log of subprocess {sp.pid} is gone, or is no longer the file the engine made ({path})"
    )


@asynccontextmanager
async def open_subprocess_service(
    supervisor: Supervisor, config: EngineConfig | None = None
) -> AsyncIterator[SubProcessService]:
    """Run a :class:`SubProcessService` on ``supervisor``; leaving the block kills every subprocess.

    Args:
        supervisor: the supervisor children run under (it must outlive the block).
        config: caps, log cap and folder name (``None``: defaults).

    Cancellation: leaving the block by cancellation or error still runs ``kill_all`` (shielded), so
    every child is ended and reaped and every log deleted before the exception propagates.
    """
    async with trio.open_nursery() as nursery:
        service = SubProcessService(
            supervisor=supervisor, config=config if config is not None else EngineConfig(), nursery=nursery
        )
        try:
            yield service
        finally:
            try:
                with trio.CancelScope(shield=True):
                    await service.kill_all()
            finally:
                service._close()
