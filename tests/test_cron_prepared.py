"""Claims made ahead (``engine.cron._prepared``): a claim made before the due time stands for the
claim made at it, or is not used at all; and the SQLite store's burst claim with it, on a real file."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import attrs
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine import At, Command, Cron, CronJob, Every, SystemEvent
from engine.cron._claims import due_at, take_due
from engine.cron._events import PendingFire
from engine.cron._prepared import ClaimsAhead, claim_prepared, fire_row, prepare_claim
from engine.cron._store import SqliteJobStore

T0 = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)

schedules = st.one_of(
    st.builds(
        Every,
        st.floats(min_value=1.0, max_value=7200, allow_nan=False),
        st.one_of(st.none(), st.integers(-86400, 86400).map(lambda s: T0 + timedelta(seconds=s))),
    ),
    st.builds(
        Cron,
        st.sampled_from(
            ["*/15 * * * *", "30 1 * * *", "30 2 * * *", "0 * * * *", "*/20 1,2 * * *", "5 4 * * 0"]
        ),
        st.sampled_from(["UTC", "America/New_York", "Europe/Berlin"]),
    ),
    st.integers(1, 86400).map(lambda s: At(T0 + timedelta(seconds=s))),
)
payloads = st.one_of(
    st.builds(SystemEvent, st.sampled_from(["tick", 'é \\ " \n', "\u2028 x"])),
    st.just(Command(("true",))),
)
#: Around the DST changes of 2026 (New York, Berlin) and a quiet day.
starts = st.sampled_from(
    [
        T0,
        datetime(2026, 3, 8, 6, 0, tzinfo=UTC),
        datetime(2026, 11, 1, 5, 20, tzinfo=UTC),
        datetime(2026, 10, 25, 0, 20, tzinfo=UTC),
    ]
)


def make_job(schedule: Every | Cron | At, payload: SystemEvent | Command, start: datetime) -> CronJob:
    if isinstance(schedule, At):
        schedule = At(start + (schedule.at - T0))
    job = CronJob(
        id="job-1",
        name="name \u00e9",
        enabled=True,
        schedule=schedule,
        payload=payload,
        delete_after_run=False,
        created_at=start - timedelta(hours=1),
        updated_at=start,
        project="project-1",
        owner="engine-1",
    )
    if isinstance(schedule, At):
        return attrs.evolve(job, next_run_at=schedule.at)
    fresh = take_due(attrs.evolve(job, next_run_at=start), start)  # a job that ran once, at ``start``
    assert fresh is not None
    return fresh[0]


def assert_same_as_fresh(job: CronJob, now: datetime, made: tuple[CronJob, str] | None) -> None:
    """``made`` (a claim made ahead, put at ``now``) is what a claim made at ``now`` gives."""
    fresh = take_due(job, now)
    assert fresh is not None
    assert made is not None
    assert made[0] == fresh[0]
    assert made[1] == json.dumps(fresh[0].to_dict())


@settings(max_examples=300)
@given(
    schedule=schedules,
    payload=payloads,
    start=starts,
    late=st.lists(st.floats(min_value=0, max_value=1.0, allow_nan=False), min_size=1, max_size=5),
)
def test_a_claim_made_ahead_is_the_claim_made_at_any_time_it_allows(
    schedule: Every | Cron | At, payload: SystemEvent | Command, start: datetime, late: list[float]
) -> None:
    """Between the due time and the next run it computed, the claim made ahead is the claim made then
    (the next run of every schedule kind stays the same there, across DST changes too); outside, it is
    not used."""
    job = make_job(schedule, payload, start)
    due = due_at(job)
    assert due is not None
    prepared = prepare_claim(job)
    assert prepared is not None
    after = prepared.job
    span = None if after.next_run_at is None else (after.next_run_at - due).total_seconds()
    for fraction in late:
        now = due + timedelta(seconds=3600 * fraction if span is None else span * fraction)
        made = claim_prepared(prepared, now)
        if after.next_run_at is not None and now >= after.next_run_at:
            assert made is None
            continue
        assert_same_as_fresh(job, now, made)
        fresh = take_due(job, now)
        assert fresh is not None
        assert prepared.fire == (None if fresh[1] is None else attrs.evolve(fresh[1]))
        if fresh[1] is not None:
            assert prepared.fire_row == fire_row(job, fresh[1])
    assert claim_prepared(prepared, due - timedelta(microseconds=1)) is None  # not due yet
    if after.next_run_at is not None:
        assert claim_prepared(prepared, after.next_run_at) is None  # the run after: made afresh


class ClaimsAheadMachine(RuleBasedStateMachine):
    """A few jobs as a store holds them (each change a new object, as a row read again is), prepared
    and claimed in any order, with edits and clock steps between: a claim taken from the ones made
    ahead is always the claim made afresh, and one is never taken for a job that changed since."""

    def __init__(self) -> None:
        super().__init__()
        self.now = T0
        self.jobs: dict[str, CronJob] = {}
        self.ahead = ClaimsAhead(limit=3)
        self.prepared_from: dict[str, CronJob] = {}

    @rule(
        index=st.integers(0, 4),
        schedule=schedules,
        payload=payloads,
        offset=st.integers(-2, 4),
    )
    def add_or_replace(
        self, index: int, schedule: Every | Cron | At, payload: SystemEvent | Command, offset: int
    ) -> None:
        job = attrs.evolve(make_job(schedule, payload, self.now), id=f"job-{index}", created_at=self.now)
        at = self.now + timedelta(seconds=offset)  # due soon (or already)
        if isinstance(schedule, At):
            job = attrs.evolve(job, schedule=At(at))
        self.jobs[job.id] = attrs.evolve(job, next_run_at=at, last_run_at=self.now - timedelta(hours=1))

    @precondition(lambda self: bool(self.jobs))
    @rule(data=st.data(), how=st.sampled_from(["same", "rename", "disable", "move"]))
    def edit(self, data: st.DataObject, how: str) -> None:
        job_id = data.draw(st.sampled_from(sorted(self.jobs)))
        job = self.jobs[job_id]
        if how == "same":
            job = attrs.evolve(job)  # the same text read again after another change: a new object
        elif how == "rename":
            job = attrs.evolve(job, name=job.name + "!", updated_at=self.now)
        elif how == "disable":
            job = attrs.evolve(job, enabled=not job.enabled, updated_at=self.now)
        else:
            job = attrs.evolve(job, next_run_at=self.now + timedelta(seconds=2), updated_at=self.now)
        self.jobs[job_id] = job

    @precondition(lambda self: bool(self.jobs))
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        del self.jobs[data.draw(st.sampled_from(sorted(self.jobs)))]

    @rule(seconds=st.one_of(st.floats(0, 2, allow_nan=False), st.integers(2, 7200)))
    def tick(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)

    @rule(ahead=st.floats(0, 5, allow_nan=False))
    def prepare(self, ahead: float) -> None:
        self.ahead.prepare(self.jobs.values(), self.now + timedelta(seconds=ahead))
        self.prepared_from = dict(self.jobs)

    @rule()
    def claim(self) -> None:
        """Claim what is due, as the store does: from the claims made ahead when one stands, else
        afresh; the job written is the claimed one."""
        for job_id, job in sorted(self.jobs.items()):
            at = due_at(job)
            made = self.ahead.take(job, self.now)
            if at is None or at > self.now:
                assert made is None, "a claim made ahead was taken for a job that is not due"
                continue
            fresh = take_due(job, self.now)
            assert fresh is not None
            if made is not None:
                assert self.prepared_from.get(job_id) is job, "taken for a job changed since"
                assert made[0] is job
                assert_same_as_fresh(job, self.now, (made[1], made[2]))
                assert made[3] == fresh[1]
                assert made[4] == (None if fresh[1] is None else fire_row(job, fresh[1]))
            self.jobs[job_id] = fresh[0]

    @rule(late=st.floats(0, 1.5, allow_nan=False))
    def claim_at_the_next_due_time(self, late: float) -> None:
        """The timer's wake: the clock moves to the earliest due time (a little late), then claims."""
        due = [at for job in self.jobs.values() if (at := due_at(job)) is not None]
        if due:
            self.now = max(self.now, min(due)) + timedelta(seconds=late)
        self.claim()

    @invariant()
    def bounded(self) -> None:
        assert len(self.ahead) <= self.ahead.limit


TestClaimsAheadMachine = ClaimsAheadMachine.TestCase
TestClaimsAheadMachine.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)


def one_shot(index: int, at: datetime) -> CronJob:
    return CronJob(
        id=f"burst-{index:04d}",
        name=f"tick {index}",
        enabled=True,
        schedule=At(at),
        payload=SystemEvent(text=f"tick {index}"),
        delete_after_run=False,
        created_at=T0,
        updated_at=T0,
        next_run_at=at,
    )


async def test_store_claims_a_prepared_burst_as_a_fresh_one_and_skips_changed_jobs(tmp_path: Path) -> None:
    """Two stores on real files, the same jobs: one claims with its claims made ahead (two jobs edited
    and one removed after the preparation), the other afresh. The rows and events written are the same,
    and the edited jobs fire as edited."""
    due = T0 + timedelta(seconds=30)
    total = 40
    stores = []
    for name in ("ahead", "fresh"):
        store = SqliteJobStore(str(tmp_path / f"{name}.sqlite3"))
        await store.open()
        for i in range(total):
            await store.insert_job(one_shot(i, due))
        assert (await store.claim_due(T0, acked=False)).claims == []  # the look before the due time
        stores.append(store)
    ahead, fresh = stores
    await ahead.prepare_claims(due + timedelta(seconds=1))
    for store in stores:
        await store.update_job("burst-0003", lambda j: attrs.evolve(j, name="renamed"))
        await store.update_job("burst-0005", lambda j: attrs.evolve(j, next_run_at=due + timedelta(hours=1)))
        await store.delete_job("burst-0007")
    now = due + timedelta(milliseconds=7)
    got = [await store.claim_due(now, acked=False) for store in stores]
    assert [c.job for c in got[0].claims] == [c.job for c in got[1].claims]
    assert len(got[0].claims) == total - 2  # one moved later, one removed
    assert [c.event for c in got[0].claims] == [c.event for c in got[1].claims]
    by_id = {c.job.id: c for c in got[0].claims}
    assert by_id["burst-0003"].event is not None and by_id["burst-0003"].event.job_name == "renamed"
    assert by_id["burst-0003"].job.last_run_at == now
    for store in stores:
        assert await store.list_jobs() == await fresh.list_jobs()
        events = await store.events()
        assert [e.to_dict() for e in events] == [c.event.to_dict() for c in got[0].claims if c.event]
        assert all(isinstance(e, PendingFire) and e.cursor > 0 for e in events)
        await store.aclose()
