"""One managed subprocess (:class:`SubProcess`) and its serialisable snapshot (:class:`SubProcessSummary`).

A record is made by ``SubProcessService.create`` and lives until it is killed. It names a process by its
first pid for its whole life: with a restart policy it may run several processes one after the other
(:attr:`SubProcess.pid` is the current one), all writing to the log files named after the first pid.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Literal, final

import attrs
import trio

from ._input import show
from ._logpair import LogPair
from ._project import Project
from ._supervisor import ManagedRun, RunExit, RunState, SpawnSpec, TerminationReason

if TYPE_CHECKING:
    from ._restart import RestartTracker
    from ._stdin import StdinPipe

__all__ = ["ReadyState", "SubProcess", "SubProcessSummary"]

ReadyState = Literal["ready", "exited", "timeout"]


@final
@attrs.define(eq=False)
class SubProcess:
    """One managed child: who started it, what it runs, where its logs are, and how it ended.

    Attributes:
        first_pid: the pid of its first process; the record answers to it for its whole life, and its
            log files are named after it.
        project: the project it belongs to.
        command: the executable as given to ``create``.
        args: its arguments.
        created_at: aware UTC time of the spawn.
        ready: what the readiness wait of ``create`` found (``None``: none was asked for).
        first_output: the first lines of its output when ``create`` returned after a readiness wait.
        notify_on_exit: whether its own final exit becomes an event (``create(notify_on_exit=True)``).
    """

    first_pid: int
    project: Project
    command: str
    args: tuple[str, ...]
    created_at: datetime
    _run: ManagedRun = attrs.field(alias="run", repr=False)
    _logs: LogPair = attrs.field(alias="logs", repr=False)
    _stdin: StdinPipe | None = attrs.field(alias="stdin", default=None, repr=False)
    _restart: RestartTracker | None = attrs.field(alias="restart", default=None, repr=False)
    notify_on_exit: bool = False
    _spec: SpawnSpec | None = attrs.field(alias="spec", default=None, repr=False)
    ready: ReadyState | None = attrs.field(init=False, default=None)
    first_output: str | None = attrs.field(init=False, default=None)
    _changed_at: datetime = attrs.field(
        init=False, default=attrs.Factory(lambda self: self.created_at, takes_self=True)
    )
    _stopping: bool = attrs.field(init=False, default=False)
    _capped_final: bool = attrs.field(init=False, default=False)
    _removed: bool = attrs.field(init=False, default=False)
    #: Set once a kill of the record began: its logs are deleted when that kill ends.
    _killing: bool = attrs.field(init=False, default=False)
    #: ``new_only`` readers: the offset each has read up to, by ``(stream, reader)``.
    _cursors: dict[tuple[str, str], int] = attrs.field(init=False, factory=dict)
    _cursor_lock: trio.Lock = attrs.field(init=False, factory=trio.Lock)
    #: Set once the record will run no more process (its last exit, no restart pending).
    _final: trio.Event = attrs.field(init=False, factory=trio.Event)
    #: Set (never cleared) once a caller asked for the end: a kill, a halt, the engine's stop.
    _ended_on_purpose: bool = attrs.field(init=False, default=False)
    #: The wait before a restart, while one is pending (a kill or halt cancels it).
    _backoff: trio.CancelScope | None = attrs.field(init=False, default=None)
    _restart_status: str | None = attrs.field(init=False, default=None)
    _restarts: int = attrs.field(init=False, default=0)
    #: How the process before the latest restart ended.
    _last_exit: RunExit | None = attrs.field(init=False, default=None)

    @property
    def pid(self) -> int:
        """The pid of its current process (the first one until a restart)."""
        return self._run.pid

    @property
    def restarts(self) -> int:
        """How many times its process was restarted by its restart policy."""
        return self._restarts

    @property
    def state(self) -> RunState:
        """``RUNNING`` while the process lives, ``EXITING`` while a kill or halt ends it, then ``EXITED``.

        The process is the leader: once it has exited it is ``EXITED`` at once, while what is left of its
        tree drains (SP-03, see ``ManagedRun.leader_exit``).
        """
        return RunState.EXITED if self._run.leader_exit is not None else self._run.state

    @property
    def exit(self) -> RunExit | None:
        """How the current process ended, or ``None`` while it is alive (final once :attr:`ended`)."""
        return self._run.leader_exit

    @property
    def running(self) -> bool:
        """Whether the current process (the leader) is alive."""
        return self._run.leader_exit is None

    @property
    def ended(self) -> bool:
        """Whether the current process's whole tree is gone and reaped (a leader's leftovers included)."""
        return self._run.exit is not None

    @property
    def finished(self) -> bool:
        """Whether the record will run no more process: exited with no restart pending."""
        return self._final.is_set()

    @property
    def drained(self) -> bool:
        """Whether :attr:`finished` and the last process's whole tree is gone too (what
        :meth:`wait_drained` waits for): its logs hold everything it will ever write."""
        return self._final.is_set() and self._run.exit is not None

    @property
    def stdout_path(self) -> str:
        """Absolute path of the stdout log."""
        return self._logs.path("stdout")

    @property
    def stderr_path(self) -> str:
        """Absolute path of the stderr log."""
        return self._logs.path("stderr")

    def answers_to(self, pid: int) -> bool:
        """Whether ``pid`` names this record: its current pid or its first."""
        return pid in (self._run.pid, self.first_pid)

    async def wait(self) -> RunExit:
        """Wait until the current process and its tree have ended, and return how it ended.

        Cancellation: safe; the process goes on and can be waited for again.
        """
        return await self._run.wait()

    async def wait_finished(self) -> RunExit:
        """Wait until the record runs no more process (its last exit; no restart pending) and return
        that exit.

        Cancellation: safe; nothing changes.
        """
        await self._final.wait()
        exit = self._run.leader_exit
        assert exit is not None
        return exit

    async def wait_drained(self) -> RunExit:
        """:meth:`wait_finished`, then until the rest of the last process's tree is gone too (what a
        leader that exited on its own left running gets the grace period, then the escalation), so that its
        logs hold everything it will ever write; return the leader's exit.

        Cancellation: safe; nothing changes.
        """
        exit = await self.wait_finished()
        await self._run.wait()
        return exit

    def _last_change(self) -> datetime:
        moments = [self._changed_at]
        if self._run.exit is not None:
            moments.append(self._run.started_at + timedelta(seconds=self._run.exit.duration_seconds))
        return max(moments)

    def _status(self) -> str:
        ex = self.exit
        if self._restart_status is not None and not self._ended_on_purpose:
            return self._restart_status  # "restarting in 2 s (exited 3)", "crash loop: 5 restarts in 60 s"
        return ex.describe() if ex is not None else self.state.value

    def __repr__(self) -> str:
        status = self._run.exit.describe() if self._run.exit is not None else self.state.value
        argv = show([self.command, *self.args])  # shortened: a 128 KiB argument is not a 128 KiB repr
        return f"<SubProcess {self.pid} {self.project.slug} {argv}: {status}>"


@attrs.frozen
class SubProcessSummary:
    """A serialisable snapshot of one :class:`SubProcess`: no process handle, no stream.

    Attributes:
        pid: the current process's pid (the first one until a restart).
        project_id: its project's id.
        project_slug: its project's slug.
        command: the executable.
        args: its arguments.
        state: :class:`RunState` (``running``, ``exiting`` or ``exited``).
        status: a phrase: ``"running"``, ``"exiting"``, ``"exited 0"``, ``"killed by signal 9 (SIGKILL)"``;
            with a restart policy also ``"restarting in 2 s (exited 3)"`` and
            ``"crash loop: 5 restarts in 60 s"``.
        exit_code: the exit code, or ``None`` (alive, or ended by a signal).
        signal: the signal that ended it, or ``None``.
        reason: why it ended (:class:`TerminationReason`), or ``None`` while alive.
        escalated: whether SIGKILL was needed.
        survivors: pids of its tree that outlived SIGKILL (normally empty).
        created_at: aware UTC time of the spawn.
        updated_at: the later of its last state change and its log files' modification time.
        stdout_path: absolute path of the stdout log.
        stderr_path: absolute path of the stderr log.
        ready: what ``create``'s readiness wait found: ``"ready"``, ``"exited"``, ``"timeout"``, or
            ``None`` when none was asked for.
        first_output: the first lines of its output (stdout's, then stderr's; at most 4 KiB) when
            ``create`` returned after a readiness wait, else ``None``.
        restarts: how many times its restart policy restarted it.
        first_pid: the pid the record answers to for its whole life (its log files are named after it).
        last_exit: how the process before the latest restart ended (``"exited 3"``), or ``None``.
    """

    pid: int
    project_id: str
    project_slug: str
    command: str
    args: tuple[str, ...]
    state: RunState
    status: str
    exit_code: int | None
    signal: int | None
    reason: TerminationReason | None
    escalated: bool
    survivors: tuple[int, ...]
    created_at: datetime
    updated_at: datetime
    stdout_path: str
    stderr_path: str
    ready: ReadyState | None = None
    first_output: str | None = None
    restarts: int = 0
    first_pid: int | None = None
    last_exit: str | None = None

    def to_dict(self) -> dict[str, object]:
        """The summary as JSON-ready values: enums as their values, times as ISO 8601, tuples as lists."""
        out: dict[str, object] = {}
        for field in attrs.fields(SubProcessSummary):
            value = getattr(self, field.name)
            if isinstance(value, RunState | TerminationReason):
                value = value.value
            elif isinstance(value, datetime):
                value = value.isoformat()
            elif isinstance(value, tuple):
                value = list(value)
            out[field.name] = value
        return out
