"""The arm-token core, driven by a Hypothesis state machine (no I/O): who may persist and fire."""

from __future__ import annotations

from datetime import UTC, datetime

import attrs
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine import CronJob, OnExit, SystemEvent
from engine.cron._arming import ArmTable, SlotState

JOB_IDS = ["a", "b", "c"]
T0 = datetime(2026, 11, 29, tzinfo=UTC)


def make_job(job_id: str, command: str, *, enabled: bool = True) -> CronJob:
    return CronJob(
        id=job_id,
        name=job_id,
        enabled=enabled,
        schedule=OnExit(command=command),
        payload=SystemEvent("t"),
        delete_after_run=False,
        created_at=T0,
        updated_at=T0,
        next_run_at=None,
        last_run_at=None,
        last_status=None,
        last_error=None,
        consecutive_errors=0,
    )


class ArmTableMachine(RuleBasedStateMachine):
    """Model: ``desired`` jobs; ``tasks`` are the live watcher tasks (job id, token, command)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = ArmTable()
        self.desired: dict[str, CronJob] = {}
        self.tasks: dict[int, tuple[str, str]] = {}
        self.fired: list[tuple[str, int, str]] = []
        self.cancelled: set[int] = set()
        self.generation = 0

    def _reconcile(self) -> None:
        decisions = self.table.reconcile(self.desired.values())
        for _job_id, token in decisions.cancel:
            self.cancelled.add(token)
            self.tasks.pop(token, None)
        for job, token in decisions.arm:
            assert isinstance(job.schedule, OnExit)
            self.tasks[token] = (job.id, job.schedule.command)

    @rule(job_id=st.sampled_from(JOB_IDS))
    def edit(self, job_id: str) -> None:
        self.generation += 1
        self.desired[job_id] = make_job(job_id, f"gen-{self.generation}")
        self._reconcile()

    @rule(job_id=st.sampled_from(JOB_IDS))
    def payload_only(self, job_id: str) -> None:
        if job_id in self.desired:
            self.desired[job_id] = attrs.evolve(self.desired[job_id], payload=SystemEvent("new"))
            before = self.table.slot(job_id)
            token = before.token if before else None
            self._reconcile()
            after = self.table.slot(job_id)
            if token is not None and after is not None and self.desired[job_id].enabled:
                assert after.token == token  # a payload-only change keeps the watcher

    @rule(job_id=st.sampled_from(JOB_IDS))
    def disable(self, job_id: str) -> None:
        if job_id in self.desired:
            self.desired[job_id] = attrs.evolve(self.desired[job_id], enabled=False)
            self._reconcile()

    @rule(job_id=st.sampled_from(JOB_IDS))
    def remove(self, job_id: str) -> None:
        self.desired.pop(job_id, None)
        self._reconcile()

    @rule(job_id=st.sampled_from(JOB_IDS))
    def cancel(self, job_id: str) -> None:
        token = self.table.cancel(job_id)
        if token is not None:
            self.cancelled.add(token)
            self.tasks.pop(token, None)

    @precondition(lambda self: bool(self.tasks))
    @rule(data=st.data(), committed=st.booleans())
    def command_exits(self, data: st.DataObject, committed: bool) -> None:
        """A task's command exits; it tries to persist (``committed``: the store worked)."""
        token = data.draw(st.sampled_from(sorted(self.tasks)))
        job_id, command = self.tasks[token]
        job = self.table.begin_commit(job_id, token)
        if job is None:
            del self.tasks[token]  # lost its slot: it never persists, never fires
            return
        # Meanwhile, a reconcile may land while the commit is under way.
        if data.draw(st.booleans()):
            self.generation += 1
            self.desired[job_id] = make_job(job_id, f"gen-{self.generation}")
            self._reconcile()
            assert token in self.tasks  # a committing watcher is never cancelled by reconcile
        successor = self.table.end_commit(job_id, token, committed=committed)
        del self.tasks[token]
        if committed:
            self.fired.append((job_id, token, command))
            if job_id in self.desired:  # one-shot: the store now has the job disabled
                self.desired[job_id] = attrs.evolve(self.desired[job_id], enabled=False)
            self._reconcile()
        elif successor is not None:
            succ_job, succ_token = successor
            assert isinstance(succ_job.schedule, OnExit)
            self.tasks[succ_token] = (job_id, succ_job.schedule.command)
        elif self.table.owns(job_id, token):
            # The result is kept for a retry: model it as the same task committing again later.
            self.tasks[token] = (job_id, command)

    @invariant()
    def one_live_task_per_job(self) -> None:
        jobs = [job_id for job_id, _ in self.tasks.values()]
        assert len(jobs) == len(set(jobs))

    @invariant()
    def every_slot_has_its_task_and_no_stale_task_owns(self) -> None:
        for token, (job_id, _command) in self.tasks.items():
            assert self.table.owns(job_id, token)
            assert token not in self.cancelled
        assert set(self.table.active_job_ids()) == {job_id for job_id, _ in self.tasks.values()}

    @invariant()
    def no_watcher_for_unwanted_job(self) -> None:
        for job_id in self.table.active_job_ids():
            slot = self.table.slot(job_id)
            assert slot is not None
            if slot.state is not SlotState.COMMITTING:
                job = self.desired.get(job_id)
                assert job is not None and job.enabled
                assert isinstance(job.schedule, OnExit) and slot.target == (job.schedule.command, None)

    @invariant()
    def each_arm_fires_at_most_once(self) -> None:
        tokens = [token for _, token, _ in self.fired]
        assert len(tokens) == len(set(tokens))


TestArmTable = ArmTableMachine.TestCase
