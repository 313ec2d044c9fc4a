"""On-exit watchers: run a job's command, and fire the job once when it exits (docs/design.md, invariant 5).

Each enabled :class:`OnExit` job gets a slot with an arm token (``_arming``) and a watcher task in the
engine's nursery. The task runs the command under our exit-recording shim (``_shim.bin``, compiled from
``_shim.c`` at install time, else ``_shim.pl``, else ``_shim.py``; see ``_shell.shim_argv``), in scope
``cron-exit:<job_id>`` with replace-existing, output to ``<state_dir>/watch-logs/``. When the command
exits, the job is disabled and its pending fire written in one transaction (**persist**), and only then
fired (**fire**). A failed persist keeps the result and retries the persist, never the command; a task
that lost its slot never persists and never fires.

Across restarts: the store keeps the arm (:class:`ArmIntent`) before the spawn, then a :class:`WatchState`
per watched job (pid, start time, exit file). An engine that stops, by a crash or gracefully
(:meth:`CronExitWatchers.detach_all`), leaves the command running, unsignalled (``outlive_engine_crash``),
with its watch state kept; the next engine adopts it if it is alive, reads the shim's exit file if it
ended meanwhile, and reports "watch lost across restart" (job disabled, nothing fired) if neither. An
engine killed between the spawn and the state's write leaves the arm only: the next one finds the shim
by the exit file its argv names (``_shim_search``), or its record, else reports the watch lost where the
shim had started (the record it reserves, output in the logs), and only where nothing started runs the
command. A command with side effects never runs twice. To end the commands on purpose there is
:meth:`CronExitWatchers.cancel_all`: each job is disabled and fires once, with reason ``cancelled``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping
from datetime import datetime
from signal import SIGKILL
from typing import TypeVar, final

import attrs
import trio

from .._cgroup import Leaf, watched_leaf
from .._errors import JobNotFoundError, SpawnError
from .._group_commit import GroupCommit
from .._keyed_locks import KeyedLocks
from .._logs import LogFile
from .._pidfd import wait_exited
from .._procfs import read_proc
from .._retry import RetryPolicy
from .._supervisor import ManagedRun, RunState, SpawnSpec, Supervisor, TerminationReason
from .._sweep import GroupRecord, end_processes, find_record_processes
from ._arming import ArmTable, watchable
from ._events import PendingFire, describe_outcome, exit_fire
from ._exit_record import ExitRecordRead, read_exit_record, remove_reserved, remove_reserved_by_any
from ._job import CronJob, JobStatus, SystemEvent
from ._log_files import (
    WATCH_LOGS,
    keep_within_cap,
    log_files,
    open_logs,
    remove_entry,
    remove_older_arms,
    trim_logs,
)
from ._protocol import JobStore
from ._schedule import OnExit
from ._service import utc_now
from ._shell import STARTED_VAR, shell_installed, shim_argv, watch_argv, what_runs_first
from ._shim_search import find_spawned, sessions_left
from ._spare_files import SpareFiles
from ._watch_state import ArmIntent, StoredWatch, WatchState

__all__ = ["HOOK_POINTS", "CronExitWatchers", "WatchHook"]

logger = logging.getLogger("engine.cron")

#: ``async def hook(job_id: str) -> None`` called at a named point (tests hold or crash a watcher there).
WatchHook = Callable[[str], Awaitable[None]]
#: The named points: the arm is stored and the command about to be spawned; the command was spawned and its
#: watch state not stored yet; after it was stored; after the command exited (the slot can still be
#: re-armed); inside the commit, before the persist transaction (a re-arm now waits for the commit to
#: decide); after the persist committed; and right before the fire is delivered.
HOOK_POINTS = (
    "before_spawn",
    "spawned",
    "after_spawn",
    "after_exit",
    "before_persist",
    "after_persist",
    "before_fire",
)

#: How a failed start of a watched command begins its ``last_error``.
_START_FAILED = "cannot start the watched command"
#: How a note that the watched command has not started yet (its login shell still busy) begins.
_NOT_STARTED_YET = "the watched command has not started yet"

_T = TypeVar("_T")

FirePending = Callable[[str, PendingFire], Awaitable[object]]
#: What the shim recorded of a command's end (``exit_code`` or ``signal``, ``ended_at``, ...).
ExitRecord = Mapping[str, object]


@attrs.frozen
class _Paths:
    stdout: str
    stderr: str
    exit_file: str
    started: str

    @classmethod
    def of(cls, state_dir: str, job_id: str, arm_id: str) -> _Paths:
        base = os.path.join(state_dir, WATCH_LOGS, f"{job_id}.{arm_id}")
        return cls(f"{base}.stdout.log", f"{base}.stderr.log", f"{base}.exit.json", f"{base}.started")


@attrs.define(eq=False)
class _Watch:
    job_id: str
    token: int
    arm_id: str
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    run: ManagedRun | None = None
    #: the command's logs, kept within the cap while it runs (made with it, or found at adoption)
    logs: list[LogFile] = attrs.field(factory=list)
    adopted: WatchState | None = None
    #: an adopted command whose shim has exited: what its tree left (its process group, its marked
    #: processes, its leaf in cgroup mode) is ended once the command is over
    leftover: WatchState | None = None
    #: what the store must hold for the next engine to adopt the command, once it runs
    state: WatchState | None = None
    saved: bool = False
    #: the arm, once it is in the store: stored once, before the first spawn attempt
    arm: ArmIntent | None = None
    completed: bool = False
    #: ``cancel_all`` asked to end the command on purpose (the job then fires, reason ``cancelled``)
    ending: bool = False
    end_requested: trio.Event = attrs.field(factory=trio.Event)
    done: trio.Event = attrs.field(factory=trio.Event)
    #: the job's watch started before this one, if it may still be ending its command: this one spawns
    #: only after it is done (and after the one it waited for, and so on)
    after: _Watch | None = None


def _reap_if_ours(pid: int, start_time: int) -> None:
    """Reap ``pid`` if it is an exited child of this very process with that start time.

    An engine embedded in a host that goes on running leaves its watched commands as children of the
    host after a graceful stop; the next engine in the same process finds one as its own zombie.
    """
    info = read_proc(pid)
    if info is not None and info.zombie and info.ppid == os.getpid() and info.start_time == start_time:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)


def _started_at(paths: _Paths, spawned: float) -> float:
    """When the command itself started: its start mark's time where the shell made one (a login profile
    ran before it), else ``spawned`` (the wall time of the spawn)."""
    try:
        return max(spawned, os.stat(paths.started, follow_symlinks=False).st_mtime)
    except OSError:
        return spawned


def _size(path: str) -> int:
    """The size of the file at ``path`` in bytes (a link is not followed); 0 when there is none."""
    try:
        return os.stat(path, follow_symlinks=False).st_size
    except OSError:
        return 0


def _still_watched(job: CronJob | None, state: StoredWatch) -> bool:
    """Whether ``job`` still watches what ``state`` (an arm or a watch state of the last engine) ran: it
    exists, is enabled, and has the same on-exit command and cwd."""
    return (
        job is not None
        and watchable(job)
        and isinstance(job.schedule, OnExit)
        and state.targets(job.schedule)
    )


def _is_start_note(error: str | None) -> bool:
    """Whether ``error`` is a watcher's note on the start of its command (failed, or not yet)."""
    return error is not None and error.startswith((_START_FAILED, _NOT_STARTED_YET))


def _because(read: ExitRecordRead) -> str:
    return f" ({read.problem})" if read.problem else ""


def _outcome(record: Mapping[str, object]) -> tuple[int | None, int | None]:
    code, sig = record.get("exit_code"), record.get("signal")
    return (code if isinstance(code, int) else None, sig if isinstance(sig, int) else None)


@final
@attrs.define(eq=False)
class CronExitWatchers:
    """The exit watchers of one engine (``engine.watchers``).

    Attributes:
        store: the job store (persist, watch states).
        fire_pending: delivers a committed fire (``CronService.fire_pending``).
        supervisor: runs the watched commands.
        state_dir: where the watch logs and exit files live.
        shell: argv prefix of the commands (``EngineConfig.exit_watch_shell``).
        nursery: where the watcher tasks run.
        retry: the waits between persist (or spawn) attempts (``EngineConfig.watch_retry_seconds``).
        now: the wall clock, aware (``CronService.now``), for the jobs' ``last_run_at`` and ``updated_at``.
        hooks: named test hooks, see :data:`HOOK_POINTS`.
        start_hint_seconds: how long a command whose shell runs a file of the user's first (a login
            profile) may take to start before the job's ``last_error`` says it has not started yet, and
            why that may be; the note goes once the command starts (seconds, from the spawn: an adopted
            command held back longer already gets the note at once).
        log_cap_bytes: the size each log of a running command keeps on disk (``EngineConfig.log_cap_bytes``).
    """

    store: JobStore
    fire_pending: FirePending
    supervisor: Supervisor
    state_dir: str
    shell: tuple[str, ...]
    nursery: trio.Nursery
    retry: RetryPolicy = attrs.field(factory=RetryPolicy)
    now: Callable[[], datetime] = utc_now
    hooks: Mapping[str, WatchHook] = attrs.field(factory=dict)
    start_hint_seconds: float = 10.0
    log_cap_bytes: int = 50 * 2**20
    _table: ArmTable = attrs.field(init=False, factory=ArmTable)
    _watches: dict[tuple[str, int], _Watch] = attrs.field(init=False, factory=dict)
    #: each job's newest watch, until it is done
    _latest: dict[str, _Watch] = attrs.field(init=False, factory=dict)
    _errors: dict[str, str] = attrs.field(init=False, factory=dict)
    #: A job's ``(last_status, last_error)`` from before its watched command's first failed start: put
    #: back once a start succeeds.
    _before_start_error: dict[str, tuple[JobStatus | None, str | None]] = attrs.field(
        init=False, factory=dict
    )
    _state_locks: KeyedLocks = attrs.field(init=False, factory=KeyedLocks)
    #: The watch states stored in group commits (:meth:`_store_state`): the arms of one ``reconcile``
    #: store theirs in a few transactions, not one each.
    _state_writes: GroupCommit[tuple[str, StoredWatch | None], frozenset[str]] = attrs.field(init=False)
    #: The older arms' files swept in groups (:meth:`_write_sweeps`): one listing of the folder for
    #: the arms started together.
    _sweeps: GroupCommit[tuple[str, str], None] = attrs.field(init=False)
    _detached: bool = attrs.field(init=False, default=False)
    #: Spent exit records kept for the next logs (``_spare_files``).
    _spares: SpareFiles = attrs.field(init=False)

    @_spares.default
    def _spares_default(self) -> SpareFiles:
        return SpareFiles(os.path.join(self.state_dir, WATCH_LOGS))

    @_state_writes.default
    def _state_writes_default(self) -> GroupCommit[tuple[str, StoredWatch | None], frozenset[str]]:
        return GroupCommit(self._write_states)

    @_sweeps.default
    def _sweeps_default(self) -> GroupCommit[tuple[str, str], None]:
        return GroupCommit(self._write_sweeps)

    def __repr__(self) -> str:
        return f"<CronExitWatchers {len(self._table)} armed: {self._table.active_job_ids()}>"

    # -- the public API ----------------------------------------------------------------------------

    def active_job_ids(self) -> list[str]:
        """Ids of the jobs that have a watcher now (armed, running, or persisting its exit)."""
        return self._table.active_job_ids()

    def watched_pid(self, job_id: str) -> int | None:
        """The pid of the command watched for ``job_id`` (the shim, its group leader), if any."""
        slot = self._table.slot(job_id)
        watch = self._watches.get((job_id, slot.token)) if slot is not None else None
        if watch is None:
            return None
        if watch.run is not None:
            return watch.run.pid
        return watch.adopted.pid if watch.adopted is not None else None

    def last_error(self, job_id: str) -> str | None:
        """The last spawn or persistence error of ``job_id``'s watcher, if one is failing now."""
        return self._errors.get(job_id)

    async def reconcile(self, jobs: Iterable[CronJob]) -> None:
        """Make the watchers match ``jobs``, the **complete** desired set of jobs.

        Decided before the first checkpoint: every enabled on-exit job without a slot gets one with a
        fresh arm token; an unchanged job keeps its watcher (same command, same pid); a payload-only
        change keeps it and the fire uses the newest job; a changed command or cwd re-arms; every
        active id not in the set (or disabled) is cancelled, ending its command without a fire.

        Cancellation: the decisions are made and the watchers started before the first checkpoint; a
        cancelled call changes nothing more.
        """
        if self._errors or self._before_start_error:
            jobs = list(jobs)  # read twice: by the table, then for the removed jobs' entries
            self._forget_removed({job.id for job in jobs})
        decisions = self._table.reconcile(jobs)
        for job_id, token in decisions.cancel:
            self._stop(job_id, token)
        for job, token in decisions.arm:
            self._start(job, token)
        await trio.lowlevel.checkpoint()

    def _forget_removed(self, present: set[str]) -> None:
        """Drop what is kept per job for the jobs not in ``present`` (removed): a start's error and the
        status it replaced. A disabled job keeps the status, to be put back when it is enabled again and
        its command starts."""
        for kept in (self._errors, self._before_start_error):
            for job_id in [job_id for job_id in kept if job_id not in present]:
                del kept[job_id]

    async def cancel(self, job_id: str) -> None:
        """End ``job_id``'s watcher and its command (no fire). A watcher already persisting the exit
        of its command finishes that (the exit is the job's fire).

        Cancellation: the watcher is cancelled before the first checkpoint.
        """
        token = self._table.cancel(job_id)
        if token is not None:
            self._stop(job_id, token)
        await trio.lowlevel.checkpoint()

    async def cancel_all(self) -> None:
        """End every watched command on purpose, and wait until each job has fired.

        Each command is ended by escalation (SIGINT, the grace period, SIGKILL; an adopted one the same
        way); then, as for an exit, its job is disabled and its fire persisted (reason ``cancelled``), and
        only then fired. A job whose command had not started yet (a spawn being retried) fires once too,
        without an exit. Nothing re-runs later. A watcher whose command already exited fires that exit.
        This is ``serve``'s stop with ``end_watched``; a graceful stop without it leaves the commands
        running (:meth:`detach_all`).

        Cancellation: only the waiting stops; each watcher goes on ending its command and firing.
        """
        watches = [w for w in self._watches.values() if self._owns(w) and not w.completed]
        for watch in watches:
            watch.ending = True
            watch.end_requested.set()
        for watch in watches:
            await watch.done.wait()
        await trio.lowlevel.checkpoint()

    def detach_all(self) -> None:
        """Stop watching and leave every watched command running, for the next engine to adopt.

        The engine's graceful stop (``open_engine``'s exit): each watcher task ends without signalling
        its command; the command's watch state and exit file stay in the state directory, so the next
        engine adopts it exactly as after a crash (design section 5: a command with side effects never
        runs twice). A command spawned an instant ago whose watch state was not stored yet has it stored
        now, or, if the store fails, is ended (its job stays enabled). Watchers ending their commands on
        purpose (:meth:`cancel_all`) finish that. Nothing is armed afterwards.
        """
        self._detached = True
        for watch in list(self._watches.values()):
            if not watch.ending:
                watch.scope.cancel()

    # -- tasks -------------------------------------------------------------------------------------

    def _start(
        self,
        job: CronJob,
        token: int,
        *,
        adopted: StoredWatch | None = None,
        recorded: ExitRecord | None = None,
    ) -> None:
        """Start a watcher: a fresh command, or (``adopted``) one a crashed engine left, running or
        already ended with its exit ``recorded`` (only then may ``adopted`` be an :class:`ArmIntent`: an
        arm whose shim ended before any engine stored its state)."""
        if self._detached:  # the engine is stopping: the next one arms it
            self._table.release(job.id, token)
            return
        arm_id = adopted.arm_id if adopted is not None else uuid.uuid4().hex[:12]
        watch = _Watch(job.id, token, arm_id, after=self._latest.get(job.id))
        self._watches[(job.id, token)] = watch
        self._latest[job.id] = watch
        self.nursery.start_soon(
            self._watch, job, watch, adopted, recorded, name=f"watch on-exit job {job.id}"
        )

    def _stop(self, job_id: str, token: int) -> None:
        watch = self._watches.get((job_id, token))
        if watch is not None:
            watch.scope.cancel()

    async def _hook(self, point: str, job_id: str) -> None:
        hook = self.hooks.get(point)
        if hook is not None:
            await hook(job_id)

    def _owns(self, watch: _Watch) -> bool:
        return self._table.owns(watch.job_id, watch.token)

    async def _watch(
        self, job: CronJob, watch: _Watch, adopted: StoredWatch | None, recorded: ExitRecord | None
    ) -> None:
        paths = _Paths.of(self.state_dir, job.id, watch.arm_id)
        leave = False
        try:
            with watch.scope:
                record: ExitRecord | None
                if recorded:
                    record = recorded
                elif adopted is not None:
                    assert isinstance(adopted, WatchState)  # an arm without a state comes recorded
                    watch.state, watch.saved = adopted, True
                    record = await self._wait_adopted(watch, adopted)
                else:
                    record = await self._run(job, watch, paths)
                if record is None or not self._owns(watch):
                    return
                # The command's shell marks its start (a profile ran first): without the mark, whichever
                # engine started the command, it never ran.
                state = watch.state or adopted
                if state is not None and state.marks_start and await self._never_started(paths):
                    record = {**record, "reason": "not_started"}
                started_at = adopted.started_at if adopted is not None else None
                await self._hook("after_exit", job.id)
                await self._complete(watch, paths, record, started_at)
        except trio.Cancelled:  # from outside (``_stop`` cancels ``watch.scope``): the engine is stopping
            leave = True
            raise
        finally:
            with trio.CancelScope(shield=True):
                if (self._detached or leave) and not watch.ending:
                    await self._leave(watch, paths)
                else:
                    await self._end_command(watch)
                    if not watch.completed:
                        await self._forget(watch, paths)
            self._watches.pop((watch.job_id, watch.token), None)
            if self._latest.get(watch.job_id) is watch:
                del self._latest[watch.job_id]
            self._table.release(watch.job_id, watch.token)
            watch.done.set()

    async def _run(self, job: CronJob, watch: _Watch, paths: _Paths) -> ExitRecord | None:
        """Spawn the command (retrying failed spawns) and wait for its exit; the shim's record."""
        schedule = job.schedule
        assert isinstance(schedule, OnExit)
        cwd = schedule.cwd or os.getcwd()
        argv, env = watch_argv(self.shell, schedule.command, cwd, paths.started)
        spec = SpawnSpec(
            argv=shim_argv(paths.exit_file, argv),
            cwd=cwd,
            env=env,
            stdout=paths.stdout,
            stderr=paths.stderr,
            scope_key=f"cron-exit:{job.id}",
            replace_existing_scope=True,
            outlive_engine_crash=True,
        )

        unowned = False

        async def spawn() -> ManagedRun:
            nonlocal unowned
            try:
                if not shell_installed(self.shell[0]):
                    raise SpawnError(f"the exit-watch shell {self.shell[0]!r} is not installed")
                if watch.arm is None:  # before anything can run: see ``_store_arm``
                    while watch.after is not None:  # the older command of the job ended, its state kept
                        await watch.after.done.wait()
                        watch.after = watch.after.after
                    if not await self._store_arm(watch, job, paths, marks_start=STARTED_VAR in env):
                        unowned = True
                        spawning.cancel()
                        await trio.sleep_forever()  # cancelled at once, by ``spawning``
                    await self._hook("before_spawn", job.id)
                # Older arms' files are removed once the command is started, off the path to its start.
                logs = open_logs(paths.stdout, paths.stderr, spares=self._spares)
                if STARTED_VAR in env:  # the shell makes the mark: whatever is at its name goes first (a
                    remove_entry(paths.started)  # link would be followed by ``>``, a FIFO would block it)
                try:
                    watch.logs = log_files((paths.stdout, paths.stderr), logs)
                    run = await self.supervisor.spawn(attrs.evolve(spec, stdout=logs[0], stderr=logs[1]))
                except BaseException:  # nothing started: its (empty) logs go
                    for path in (paths.stdout, paths.stderr):
                        remove_entry(path)
                    raise
                finally:
                    for fd in logs:
                        os.close(fd)
                watch.run = run  # known at once to the clean-up
                assert watch.arm is not None  # stored before the first attempt
                watch.state = watch.arm.spawned(
                    pid=run.pid,
                    start_time=run.start_time,
                    marker=run.marker,
                    cgroup=run.cgroup,
                    started_at=run.started_at,
                )
                return run
            except SpawnError as exc:
                message = f"{_START_FAILED}: {exc}; retrying"
                if self._errors.get(job.id) != message:  # shown in the job's last_error too, once
                    self._errors[job.id] = message
                    await self._store_start_error(job.id, message)
                raise

        spawning = trio.CancelScope()

        async def stop_spawning() -> None:
            spawning.cancel()
            await trio.lowlevel.checkpoint()

        with spawning:
            await self._wait_or_end(
                watch,
                functools.partial(
                    self.retry.run,
                    f"on-exit job {job.id}: starting the watched command",
                    spawn,
                    retry_on=SpawnError,
                    logger=logger,
                ),
                stop_spawning,
            )
        if unowned:  # its job went away, or it lost the slot, before the spawn: nothing ran
            return None
        run = watch.run
        if run is None:  # ended on purpose (cancel_all) before the command could start
            return {"reason": "cancelled"}
        if not self._owns(watch):  # lost the slot while spawning: end what we started, do nothing else
            return None
        await self._hook("spawned", job.id)
        if self._errors.pop(job.id, None) is not None:
            await self._clear_start_error(job.id)
        # The older arms' files (the supervisor has ended their runs of the scope by now).
        await self._sweeps.submit((job.id, watch.arm_id))
        await self._save_state(watch, job)
        await self._hook("after_spawn", job.id)
        result = await self._while_running(
            watch,
            paths,
            watch.logs,
            run.wait,
            functools.partial(self.supervisor.cancel, run),
            marks_start=watch.state is not None and watch.state.marks_start,
            pid=run.pid,
        )
        read = await trio.to_thread.run_sync(read_exit_record, paths.exit_file)
        record = read.record
        if record is None:  # the shim was killed, or could not write (a full disk): what the supervisor saw
            await trio.to_thread.run_sync(remove_reserved, paths.exit_file, run.pid)
            if result.signal == SIGKILL and result.escalated:
                logger.warning(
                    "on-exit job %s: the command outlived the grace period and was ended by SIGKILL with "
                    "its shim; nothing recorded, using what the supervisor saw: %s",
                    job.id,
                    result.describe(),
                )
            else:
                logger.warning(
                    "on-exit job %s: its exit was not recorded (%s); using what the supervisor saw: %s",
                    job.id,
                    read.problem or f"the shim says why in {paths.stderr}",
                    result.describe(),
                )
            record = {"exit_code": result.exit_code, "signal": result.signal}
        if watch.ending and result.reason is TerminationReason.CANCELLED:
            record = {**record, "reason": "cancelled"}
        # The command's own time: from its start (the mark, where a profile ran first) to the shim's
        # ``ended_at``, not the run's, which also waits for what the command left behind (a daemon ended by
        # escalation) and, under a login shell, includes the profile.
        ended = record.get("ended_at")
        started = await trio.to_thread.run_sync(_started_at, paths, run.started_at.timestamp())
        own = ended - started if isinstance(ended, float) else -1.0
        return {**record, "duration_seconds": own if own >= 0 else result.duration_seconds}

    async def _note_slow_start(self, job_id: str, paths: _Paths, pid: int, held_seconds: float = 0.0) -> None:
        """Once :attr:`start_hint_seconds` have passed without the start mark, say so in the job's
        ``last_error`` (and :meth:`last_error`) until the mark appears; cancelled when the command ends.

        A login profile that waits (a lock, a prompt on a closed stdin, a slow network mount) holds the
        command back with nothing to show for it: the job stays enabled, its pid is the shim's.
        ``held_seconds``: how long the command has been held back already (an adopted one: since the
        previous engine spawned it), counted in the hint's time.
        """
        await trio.sleep(max(0.0, self.start_hint_seconds - held_seconds))
        if not await self._never_started(paths):
            return
        what, remedy = what_runs_first()
        message = (
            f"{_NOT_STARTED_YET}: after {self.start_hint_seconds:g} s the shell (in the shim, pid {pid}) is "
            f"still running what comes before the command ({what} waiting on something?); what it printed "
            f"is in {paths.stdout} and {paths.stderr}; {remedy}"
        )
        logger.warning("on-exit job %s: %s", job_id, message)
        self._errors[job_id] = message
        try:
            await self._store_start_error(job_id, message, status=None)
            wait = 0.5
            while await self._never_started(paths):
                await trio.sleep(wait)
                wait = min(2 * wait, 10.0)
            logger.info("on-exit job %s: the watched command has started", job_id)
        finally:  # started, or ended (its outcome comes next), or no longer watched: the note goes
            if self._errors.get(job_id) == message:
                del self._errors[job_id]
            with trio.CancelScope(shield=True), trio.move_on_after(2.0):
                await self._clear_start_error(job_id)

    @staticmethod
    async def _never_started(paths: _Paths) -> bool:
        """Whether the mark the shell makes as the command starts (:func:`~._shell.watch_argv`) is missing:
        what ran before the command (a profile) replaced the shell, and the command never ran."""
        return not await trio.Path(paths.started).exists()

    async def _wait_or_end(
        self, watch: _Watch, wait: Callable[[], Awaitable[_T]], end: Callable[[], Awaitable[object]]
    ) -> _T:
        """``await wait()``; if :meth:`cancel_all` asks meanwhile, ``await end()`` alongside (the wait
        then sees the command's end)."""
        async with trio.open_nursery() as nursery:

            async def end_when_asked() -> None:
                await watch.end_requested.wait()
                await end()

            nursery.start_soon(end_when_asked)
            result = await wait()
            nursery.cancel_scope.cancel()
        return result

    async def _while_running(
        self,
        watch: _Watch,
        paths: _Paths,
        logs: list[LogFile],
        wait: Callable[[], Awaitable[_T]],
        end: Callable[[], Awaitable[object]],
        *,
        marks_start: bool,
        pid: int,
        held_seconds: float = 0.0,
    ) -> _T:
        """:meth:`_wait_or_end` of a running command (its shim ``pid``, this engine's or adopted), with
        its ``logs`` kept within the cap meanwhile and looked at once more at the end; where its shell
        ``marks_start``, a start held back past :attr:`start_hint_seconds` is noted
        (:meth:`_note_slow_start`, ``held_seconds`` counted in)."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(keep_within_cap, logs, self.log_cap_bytes)
            if marks_start:
                nursery.start_soon(self._note_slow_start, watch.job_id, paths, pid, held_seconds)
            result = await self._wait_or_end(watch, wait, end)
            nursery.cancel_scope.cancel()
        await trim_logs(logs, self.log_cap_bytes)
        return result

    async def _wait_adopted(self, watch: _Watch, state: WatchState) -> ExitRecord | None:
        """Wait (through a pidfd) for a command the previous engine started, then read its record."""
        watch.adopted = state
        paths = _Paths.of(self.state_dir, watch.job_id, state.arm_id)
        await self._while_running(
            watch,
            paths,
            [LogFile(paths.stdout), LogFile(paths.stderr)],  # their inodes: taken at the first look
            functools.partial(wait_exited, state.pid, start_time=state.start_time),
            functools.partial(self._end_group, state),
            marks_start=state.marks_start,  # its profile may still hold it back, as a fresh command's may
            pid=state.pid,
            held_seconds=(self.now() - state.started_at).total_seconds(),
        )
        watch.adopted = None
        # What its tree left is ended after the fire: its leaf, and (found by a fresh tester: in
        # process-group containment a `sleep &` of an adopted command ran on) its group and marked processes.
        watch.leftover = state
        _reap_if_ours(state.pid, state.start_time)
        read = await trio.to_thread.run_sync(read_exit_record, state.exit_file)
        record = read.record
        if record is None:
            await trio.to_thread.run_sync(remove_reserved, state.exit_file, state.pid)
        if record is None and watch.ending:
            # Ended on purpose: the escalation's SIGKILL reached the shim too (it outlives every other
            # signal of the group), so nothing was recorded; fire as a command this engine started does.
            logger.warning(
                "on-exit job %s: the adopted command was ended by SIGKILL with its shim; nothing recorded",
                watch.job_id,
            )
            record = {"exit_code": None, "signal": int(SIGKILL)}
        if record is None:
            await self._report_lost(
                watch.job_id, f"the adopted command ended without a record of its exit{_because(read)}"
            )
        elif watch.ending:
            record = {**record, "reason": "cancelled"}
        return record

    async def _complete(
        self, watch: _Watch, paths: _Paths, record: ExitRecord, started_at: datetime | None
    ) -> None:
        """Persist the exit (retrying the persist, never the command), then fire."""
        job = self._table.begin_commit(watch.job_id, watch.token)
        if job is None:
            return
        await self._hook("before_persist", job.id)
        exit_code, signal = _outcome(record)
        duration = record.get("duration_seconds")
        if not isinstance(duration, float) and started_at is not None:
            ended = record.get("ended_at")
            if isinstance(ended, float):
                # As for a command of this engine's own: from its start mark where a profile ran first
                # (it may have held the command back across the restart), else from the spawn.
                started = await trio.to_thread.run_sync(_started_at, paths, started_at.timestamp())
                duration = ended - started
        reason = str(record.get("reason") or ("signal" if signal is not None else "exit"))
        assert isinstance(job.schedule, OnExit)
        intro = job.payload.text if isinstance(job.payload, SystemEvent) else None
        if reason == "not_started":
            intro = (intro + "\n" if intro else "") + (
                "Warning: the login shell exited before running the command (does a profile `exec` "
                "another shell?); the command did not run."
            )
        build = functools.partial(
            exit_fire,
            job.name,
            command=job.schedule.command,
            exit_code=exit_code,
            signal=signal,
            reason=reason,
            duration_seconds=duration if isinstance(duration, float) else None,
            stdout_path=paths.stdout,
            stderr_path=paths.stderr,
            intro=intro,
            fire_id=f"exit-{job.id}-{watch.arm_id}",
        )
        fire = await trio.to_thread.run_sync(build)

        async def persist() -> bool:
            """One attempt; ``False``: this watcher must not persist (slot lost, job gone, successor)."""
            if self._table.begin_commit(watch.job_id, watch.token) is None:  # (again, after a failure)
                return False
            try:
                exited = functools.partial(_exited, fire=fire, now=self.now())
                await self.store.commit_fire(job.id, exited, fire)
            except JobNotFoundError:
                self._table.end_commit(job.id, watch.token, committed=False)
                return False
            except OSError as exc:
                self._errors[job.id] = f"persisting the exit failed ({exc}); retrying; it fires once stored"
                successor = self._table.end_commit(job.id, watch.token, committed=False)
                if successor is not None:
                    self._start(*successor)
                    return False
                raise
            return True

        if not await self.retry.run(f"on-exit job {job.id}: persisting the exit", persist, logger=logger):
            return
        self._table.end_commit(job.id, watch.token, committed=True)
        watch.completed = True
        self._errors.pop(job.id, None)
        await self._forget(watch, paths, keep_logs=True)
        await self._hook("after_persist", job.id)
        await self._hook("before_fire", job.id)
        await self.fire_pending(job.id, fire)

    async def _store_start_error(
        self, job_id: str, message: str, *, status: JobStatus | None = JobStatus.ERROR
    ) -> None:
        """A start of the watched command failed (or is slow): ``message`` becomes the job's
        ``last_error`` (and ``status`` its ``last_status``; ``None``: unchanged), and what they were before
        is kept for :meth:`_clear_start_error`."""
        now = self.now()

        before: list[tuple[JobStatus | None, str | None]] = []

        def change(job: CronJob) -> CronJob:
            # Such a note there already is stale (left by an engine that crashed): never put back.
            before.append((job.last_status, None if _is_start_note(job.last_error) else job.last_error))
            last_status = status or job.last_status
            return attrs.evolve(job, last_status=last_status, last_error=message, updated_at=now)

        with contextlib.suppress(OSError, JobNotFoundError):
            await self.store.update_job(job_id, change)
        if before:
            self._before_start_error.setdefault(job_id, before[-1])

    async def _clear_start_error(self, job_id: str) -> None:
        """A start succeeded after failed ones (or a slow one started): the job's ``last_status`` and
        ``last_error`` are what they were before (found by a new user: the start error stayed after the
        command ran)."""
        status, error = self._before_start_error.pop(job_id, (None, None))
        now = self.now()

        def change(job: CronJob) -> CronJob:
            if not _is_start_note(job.last_error):
                return job  # changed meanwhile (an exit, another error): that stands
            return attrs.evolve(job, last_status=status, last_error=error, updated_at=now)

        with contextlib.suppress(OSError, JobNotFoundError):
            await self.store.update_job(job_id, change)

    async def _leave(self, watch: _Watch, paths: _Paths) -> None:
        """Graceful stop: leave the command running with its watch state stored (see :meth:`detach_all`)."""
        run = watch.run
        if run is None or watch.completed:
            return
        if not watch.saved and watch.state is not None:
            with trio.move_on_after(2.0):
                try:
                    await self._store_state(watch.job_id, watch.state)
                    watch.saved = True
                except (OSError, JobNotFoundError) as exc:
                    logger.error("on-exit job %s: storing the watch state failed (%s)", watch.job_id, exc)
        if not watch.saved:  # the next engine could not find it and would run it again: end it now
            await self._end_command(watch)
            await self._forget(watch, paths)
            return
        if run.state is not RunState.EXITED:
            logger.info(
                "on-exit job %s: its command (pid %s) is left running for the next engine",
                watch.job_id,
                run.pid,
            )

    async def _end_command(self, watch: _Watch) -> None:
        if watch.run is not None and watch.run.state is not RunState.EXITED:
            await self.supervisor.cancel(watch.run)
        if watch.adopted is not None:
            await self._end_group(watch.adopted)
        elif watch.leftover is not None:
            state, watch.leftover = watch.leftover, None
            await self._end_group(state)

    async def _end_group(self, state: WatchState) -> None:
        """End a command this engine did not spawn (adopted) by escalation, in a worker thread: its
        recorded group and marked processes, and in cgroup containment its whole leaf (then removed)."""
        leaf = watched_leaf(state.cgroup) if state.cgroup is not None else None
        await self._end_records([state.group_record()], leaf=leaf)

    async def _end_records(self, records: list[GroupRecord], *, leaf: Leaf | None) -> None:
        """End the processes ``records`` name (``find_record_processes``) and what is in ``leaf`` by
        escalation, in a worker thread; reap a leader that was this very process's child."""
        grace, kill_wait = self.supervisor.grace_seconds, self.supervisor.kill_wait_seconds

        def end() -> None:
            end_processes(
                find_record_processes(records),
                grace_seconds=grace,
                kill_wait_seconds=kill_wait,
                leaves=[leaf] if leaf is not None else [],
            )
            for record in records:
                _reap_if_ours(record.pgid, record.start_time)  # left by an engine in this very process

        await trio.to_thread.run_sync(end)

    async def _end_leaf(self, path: str) -> None:
        """End what an adopted command left in its leaf, then remove the leaf (cgroup containment)."""
        leaf = watched_leaf(path)
        if leaf is None:
            await trio.lowlevel.checkpoint()
            return
        grace, kill_wait = self.supervisor.grace_seconds, self.supervisor.kill_wait_seconds
        await trio.to_thread.run_sync(
            functools.partial(
                end_processes, {}, grace_seconds=grace, kill_wait_seconds=kill_wait, leaves=[leaf]
            )
        )

    # -- watch state in the store ------------------------------------------------------------------

    async def _store_state(self, job_id: str, state: StoredWatch | None) -> None:
        """``store.set_watch_state(job_id, state)``, in a group commit with the other watchers' writes:
        returns once this one is committed.

        Cancellation: see :meth:`GroupCommit.submit` (before the transaction begins, nothing is written).

        Raises:
            JobNotFoundError: no such job.
            OSError: the store failed (``StoreError``); nothing of the transaction is kept.
        """
        if job_id in await self._state_writes.submit((job_id, state)):
            raise JobNotFoundError(f"job_id {job_id!r} names no cron job")

    async def _write_states(self, states: list[tuple[str, StoredWatch | None]]) -> frozenset[str]:
        return await self.store.set_watch_states(dict(states))  # a later write of a job wins, as in turn

    async def _write_sweeps(self, kept: list[tuple[str, str]]) -> None:
        await trio.to_thread.run_sync(remove_older_arms, self.state_dir, dict(kept))

    async def _save_state(self, watch: _Watch, job: CronJob) -> None:
        state = watch.state
        assert state is not None
        async with self._state_locks.hold(job.id):
            if not self._owns(watch):
                return
            try:
                await self._store_state(job.id, state)
                watch.saved = True
            except JobNotFoundError:  # removed meanwhile: reconcile is ending this watcher
                logger.debug("on-exit job %s: removed before its watch state was saved", job.id)
            except OSError as exc:  # only adoption after a crash needs it
                logger.error("on-exit job %s: saving the watch state failed (%s)", job.id, exc)

    async def _store_arm(self, watch: _Watch, job: CronJob, paths: _Paths, *, marks_start: bool) -> bool:
        """Store the arm (:class:`ArmIntent`) before its command is spawned, so that an engine killed
        before the command's :class:`WatchState` is stored leaves enough for the next one never to run
        the command again (``_adopt_arm``).

        Returns:
            ``False`` when there is nothing to spawn: the watcher lost its slot or the job is gone.

        Raises:
            SpawnError: the store failed: the start is retried (fail-closed: nothing runs unrecorded).
        """
        assert isinstance(job.schedule, OnExit)
        arm = ArmIntent(
            arm_id=watch.arm_id,
            exit_file=paths.exit_file,
            command=job.schedule.command,
            cwd=job.schedule.cwd,
            started_at=self.now(),
            marks_start=marks_start,
        )
        async with self._state_locks.hold(job.id):
            if not self._owns(watch):
                return False
            try:
                await self._store_state(job.id, arm)
            except JobNotFoundError:  # removed meanwhile: reconcile is ending this watcher
                return False
            except OSError as exc:
                raise SpawnError(f"storing the arm before the start failed ({exc})") from exc
        watch.arm = arm
        return True

    async def _forget(self, watch: _Watch, paths: _Paths, *, keep_logs: bool = False) -> None:
        async with self._state_locks.hold(watch.job_id):
            slot = self._table.slot(watch.job_id)
            if slot is None or slot.token == watch.token:
                with contextlib.suppress(OSError, JobNotFoundError):
                    await self._store_state(watch.job_id, None)
        for path in (paths.exit_file, paths.started) if keep_logs else attrs.astuple(paths):
            # The spent exit record's inode is kept for the next logs (``_spare_files``), not freed.
            if path != paths.exit_file or not self._spares.retire(path):
                remove_entry(path)

    # -- start-up ----------------------------------------------------------------------------------

    async def adopt(self) -> None:
        """Take over what the last engine left (stopped gracefully or crashed): adopt live commands, fire
        recorded exits, report lost watches. Call once at start-up, before the first :meth:`reconcile`.

        Cancellation: what was adopted so far stays adopted.
        """
        stored = await self.store.watch_states()
        jobs = {job.id: job for job in await self.store.list_jobs()}
        # Arms whose engine was killed before it stored their command's state: their shims, by exit file.
        arms = [state for state in stored.values() if isinstance(state, ArmIntent)]
        spawned = await trio.to_thread.run_sync(find_spawned, arms) if arms else {}
        states: dict[str, WatchState] = {}
        for job_id, found in stored.items():
            if isinstance(found, WatchState):
                states[job_id] = found
            elif found.arm_id in spawned:
                states[job_id] = spawned[found.arm_id]
            else:
                await self._adopt_arm(job_id, jobs.get(job_id), found)
        for job_id, state in states.items():
            job = jobs.get(job_id)
            alive = state.alive()
            if not alive:
                _reap_if_ours(state.pid, state.start_time)
            read = read_exit_record(state.exit_file)
            record = read.record
            if not alive and record is None:  # its shim was killed: the temp file it reserved is all left
                remove_reserved(state.exit_file, state.pid)
            if not _still_watched(job, state):  # changed or gone meanwhile: end the old command, forget it
                if alive or state.cgroup is not None:
                    await self._end_group(state)
                with contextlib.suppress(OSError, JobNotFoundError):
                    await self._store_state(job_id, None)
                continue
            assert job is not None
            if alive or record is not None:
                token = self._table.arm(job)
                self._start(job, token, adopted=state, recorded=None if alive else record)
                if not alive:  # its leftovers, now: the command is over (its group, its leaf)
                    await self._end_group(state)
            else:
                why = "the command's shim is not running" + (
                    f" and {read.problem}" if read.problem else " and left no record of its exit"
                )
                await self._report_lost(job_id, why)
                # What its tree left, its shim killed alone (in process-group containment too, where no
                # leaf holds it: found by a fresh tester), and the leaf itself.
                await self._end_group(state)
        # Leaves of watched commands no job watches any more (the state was dropped meanwhile).
        claimed = {state.cgroup for state in states.values() if state.cgroup is not None}
        for leaf in self.supervisor.containment.watched_leaves():
            if leaf.path not in claimed:
                await self._end_leaf(leaf.path)

    async def _adopt_arm(self, job_id: str, job: CronJob | None, arm: ArmIntent) -> None:
        """Take over an arm stored before its spawn whose shim does not run (:meth:`adopt`).

        Its exit recorded: the command ran and ended while no engine watched; the job fires that exit.
        Else, where its shim started (the temp file every shim reserves for the record before it runs the
        command is there) or something wrote to the arm's logs (made empty before the spawn), the command
        may have run: the watch is reported lost, never run again, and what the command left running in
        the session of its killed shim (whose pid the reserved record names) is ended by escalation, as
        for a stored state's (in process-group containment too; in cgroup containment its leaf goes with
        the unclaimed ones). Else nothing ran (the engine was killed before the spawn, or in it): the arm
        is dropped and the next :meth:`reconcile` arms the job afresh.
        """
        paths = _Paths.of(self.state_dir, job_id, arm.arm_id)
        read = await trio.to_thread.run_sync(read_exit_record, arm.exit_file)
        current = _still_watched(job, arm)
        if current and read.record is not None:
            assert job is not None
            self._start(job, self._table.arm(job), adopted=arm, recorded=read.record)
            return

        def began() -> tuple[bool, list[GroupRecord]]:  # the shim's reserved record goes either way
            shims = remove_reserved_by_any(arm.exit_file)
            ran = bool(shims) or any(_size(path) > 0 for path in (paths.stdout, paths.stderr))
            return ran, sessions_left(arm, shims) if shims else []

        ran, left = await trio.to_thread.run_sync(began)
        if ran and current:
            why = "the engine stopped while it started the command, whose shim is not running and left " + (
                read.problem if read.problem else "no record of its exit"
            )
            await self._report_lost(job_id, why)
        else:  # never ran, or the job changed or went away meanwhile: the arm goes
            with contextlib.suppress(OSError, JobNotFoundError):
                await self._store_state(job_id, None)
        if left:  # its shim killed alone, found by a fresh tester: the command ran on, watched by nobody
            await self._end_records(left, leaf=None)

    async def _report_lost(self, job_id: str, why: str) -> None:
        message = f"watch lost across restart: {why}; the job is disabled and did not fire"
        logger.error("on-exit job %s: %s", job_id, message)
        self._errors[job_id] = message
        now = self.now()

        def change(job: CronJob) -> CronJob:  # "interrupted": listed as such, not as a job that never ran
            return attrs.evolve(
                job,
                enabled=False,
                last_status=JobStatus.INTERRUPTED,
                last_error=message,
                updated_at=now,
                next_run_at=None,
            )

        with contextlib.suppress(OSError, JobNotFoundError):
            await self.store.update_job(job_id, change)
            await self._store_state(job_id, None)


def _exited(job: CronJob, *, fire: PendingFire, now: datetime) -> CronJob:
    """The job after its watched command exited at ``now``: disabled (one-shot), with the run's outcome."""
    failed = fire.exit_code != 0
    return attrs.evolve(
        job,
        enabled=False,
        next_run_at=None,
        last_run_at=now,
        updated_at=now,
        last_status=JobStatus.ERROR if failed else JobStatus.OK,
        last_error=f"{fire.command!r} {describe_outcome(fire.exit_code, fire.signal)}" if failed else None,
        consecutive_errors=job.consecutive_errors + 1 if failed else 0,
    )
