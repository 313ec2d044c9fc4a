"""The engine's end of the guardian (see ``_guardian``): group records (a journal) and the pipe."""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
from typing import final

import attrs
import trio

from ._group_journal import GroupJournal
from ._guardian import BOOTSTRAP
from ._pidfd import wait_exited
from ._procfs import GUARDIAN_VAR, RUN_MARKER_VAR, add_helper, drop_helper, read_proc
from ._spawn import spawn_process
from ._supervisor import ManagedRun
from ._sweep import GroupRecord, records_dir, remove_token, write_token

__all__ = ["GuardianLink"]

_LOG = "guardian.log"
#: The pipe's capacity, in bytes, asked for (``F_SETPIPE_SZ``; Linux's default is 64 KiB): the guardian
#: reads in batches (``_guardian.BATCH_SECONDS``) and starts in the background, and the engine's writes
#: are plain blocking ``write``s from its loop, so the lines of a ``kill_all`` of 1000 runs (about 100
#: bytes each) must fit while it sleeps. 1 MiB is the default most an unprivileged user may ask for.
PIPE_BYTES = 1 << 20


def _batch_scheduling(pid: int) -> None:
    """Put the guardian under ``SCHED_BATCH``: the lines the engine writes wake it without preempting
    the engine (a woken normal task would run at once on the engine's CPU, ~0.25 ms per line under load),
    and it still gets a normal task's share of CPU when it must end the engine's children."""
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setscheduler(pid, os.SCHED_BATCH, os.sched_param(0))


@final
@attrs.define(eq=False)
class GuardianLink:
    """The engine's end: keeps the group records and feeds the guardian (a ``RunObserver``).

    Attributes:
        state_dir: where records and the guardian's log live.
        grace_seconds: the guardian's SIGINT -> SIGKILL delay.
        kill_wait_seconds: its wait after SIGKILL.
        pid: the guardian's pid, or ``None`` before :meth:`start`.
    """

    state_dir: str
    grace_seconds: float
    kill_wait_seconds: float
    token: str = ""
    cgroup: str | None = None
    pid: int | None = attrs.field(init=False, default=None)
    _pipe: int = attrs.field(init=False, default=-1)
    _records: dict[int, GroupRecord] = attrs.field(init=False, factory=dict)
    _journal: GroupJournal | None = attrs.field(init=False, default=None)

    def start(self) -> None:
        """Start the guardian process (it loads in the background; lines wait in the pipe)."""
        records_dir(self.state_dir)
        read_end, write_end = os.pipe2(os.O_CLOEXEC)
        with contextlib.suppress(OSError):  # refused (a lower pipe-max-size): the default 64 KiB it is
            fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        log = os.open(
            os.path.join(self.state_dir, _LOG), os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600
        )
        try:
            argv = (
                sys.executable,
                "-c",
                BOOTSTRAP,
                os.path.dirname(os.path.abspath(__file__)),
                self.state_dir,
                str(self.grace_seconds),
                str(self.kill_wait_seconds),
            )
            env = {k: v for k, v in os.environ.items() if k != RUN_MARKER_VAR}
            env[GUARDIAN_VAR] = self.state_dir  # the engine's own child, never an orphan to end
            self.pid = spawn_process(argv, cwd="/", env=env, stdout_fd=log, stderr_fd=log, stdin_fd=read_end)
            add_helper(self.pid)  # reaped only here: the runs' looks leave it out unread
            _batch_scheduling(self.pid)
        finally:
            os.close(read_end)
            os.close(log)
        self._pipe = write_end
        if self.token:
            self._send(f"T {self.token} {self._start_time()}")
        if self.cgroup is not None:
            self._send(f"C {self.cgroup}")
        for record in self._records.values():
            self._send(f"+ {record.line()}")

    @staticmethod
    def _start_time() -> int:
        info = read_proc(os.getpid())
        return info.start_time if info is not None else 0

    def record_token(self) -> None:
        """Write the engine's token to the state dir before its first spawn (see ``_sweep.write_token``),
        and open its group journal (``_group_journal``)."""
        if self.token:
            write_token(self.state_dir, self.token, self._start_time())
            self._journal = GroupJournal(records_dir(self.state_dir), self.token)

    def _send(self, line: str) -> None:
        if self._pipe < 0:
            return
        try:
            os.write(self._pipe, (line + "\n").encode())
        except BrokenPipeError:  # the guardian died: start another one, re-registering every group
            os.close(self._pipe)
            self._pipe = -1
            self._reap_guardian(block=False)
            self.start()

    def run_started(self, run: ManagedRun) -> None:
        """Record the run's group and tell the guardian.

        Skipped for ``outlive_engine_crash`` runs, and in cgroup containment, where the guardian and the
        sweep end every leaf under the engine's parent cgroup instead.
        """
        if run.outlive_engine_crash or run.cgroup is not None:
            return
        # Every run leads a session of its own (``posix_spawn`` with ``POSIX_SPAWN_SETSID``), and its pid
        # stays its own while it is not reaped: its session id is its pid, no ``/proc`` read needed.
        record = GroupRecord(pgid=run.pgid, sid=run.pid, start_time=run.start_time, marker=run.marker)
        self._records[run.pid] = record
        if self._journal is not None:
            self._journal.add(record)
        else:
            record.write(self.state_dir)
        self._send(f"+ {record.line()}")

    def run_ended(self, run: ManagedRun) -> None:
        """Drop the run's record and tell the guardian."""
        record = self._records.pop(run.pid, None)
        if record is not None:
            if self._journal is not None:
                self._journal.drop(record)
            else:
                record.remove(self.state_dir)
            self._send(f"- {record.pgid} {record.start_time}")

    def runs_ended(self, runs: list[ManagedRun]) -> None:
        """:meth:`run_ended` of each of ``runs``: one journal write and one pipe write for all of them
        (a ``kill_all`` of 1000 wrote each 1000 times, and each pipe write woke the guardian)."""
        records = [record for run in runs if (record := self._records.pop(run.pid, None)) is not None]
        if not records:
            return
        if self._journal is not None:
            self._journal.drop_many(records)
        else:
            for record in records:
                record.remove(self.state_dir)
        self._send("\n".join(f"- {record.pgid} {record.start_time}" for record in records))

    def _reap_guardian(self, *, block: bool) -> bool:
        if self.pid is None:
            return True
        try:
            pid, _ = os.waitpid(self.pid, 0 if block else os.WNOHANG)
        except ChildProcessError:
            pid = self.pid
        if pid == 0:
            return False
        drop_helper(self.pid)
        self.pid = None
        return True

    async def close(self) -> None:
        """Close the pipe (the guardian exits: nothing is registered any more) and reap the guardian.

        Cancellation: shielded and bounded (2 s, then SIGKILL).
        """
        with trio.CancelScope(shield=True):
            if self._journal is not None:
                self._journal.close()
            if self.token:
                remove_token(self.state_dir, self.token)
            if self._pipe >= 0:
                os.close(self._pipe)
                self._pipe = -1
            if self.pid is not None and not self._reap_guardian(block=False):
                with trio.move_on_after(2.0):
                    await wait_exited(self.pid)  # our child, not yet reaped: its pid cannot be reused
                self._reap_guardian(block=False)
            if self.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, 9)
                self._reap_guardian(block=True)
