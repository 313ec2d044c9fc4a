"""Fleet: 1000 text jobs due in the same second, fired by 3 engines sharing a PostgreSQL store, next to
one engine on its SQLite store: fires per second and lateness (p50, p99) from the due time to the
moment the event is logged.

The engines run embedded in this process (one Trio loop; each store's queries in worker threads), on a
PostgreSQL server from the ``pgserver`` package (the ``dev`` extra). Each engine records when its claims
log an event (``fire_observers``); lateness is that wall time minus the job's due time.

Run it alone: ``.venv/bin/python -m benchmarks.run --only fleet``.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import uuid
import warnings
from contextlib import AsyncExitStack
from datetime import UTC, datetime, timedelta
from typing import Any

import trio

from engine import EngineConfig, open_engine
from engine.cron import At, CronJob, FiredEvent, SystemEvent
from engine.cron._claims import due_at, floats
from engine.cron._pg_conn import JOBS_CHANNEL
from engine.cron._pg_store import PostgresJobStore

from ._common import Context, Row, pct

JOBS = 1000
#: Seconds between adding the jobs and their common due time.
LEAD_SECONDS = 60.0


async def _insert_all(store: object, jobs: list[CronJob]) -> None:
    """Add ``jobs`` to ``store``: on PostgreSQL in one transaction (the rows ``insert_job`` writes, one
    ``NOTIFY``), since a round trip and a commit per job made adding 1000 jobs outlast the lead time on a
    loaded machine; on SQLite one ``insert_job`` each (a local commit, about a millisecond)."""
    if isinstance(store, PostgresJobStore):

        def run(cur: Any) -> None:
            cur.executemany(
                "INSERT INTO gadget_jobs (id, data, project, owner, floats, due_at) "
                "VALUES (%s, %s, %s, %s, %s, %s)",
                [(j.id, json.dumps(j.to_dict()), j.project, j.owner, floats(j), due_at(j)) for j in jobs],
            )
            cur.execute(f"NOTIFY {JOBS_CHANNEL}")

        await store._call(run, write=True)
        return
    for job in jobs:
        await store.insert_job(job)  # type: ignore[attr-defined]


def _postgres(root: str) -> tuple[Any, str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from pgserver.postgres_server import get_server

        server = get_server(os.path.join(root, "pg"), cleanup_mode="delete")
    return server, str(server.get_uri())


async def _fire(ctx: Context, engines: int, store_url: str | None, jobs: int) -> tuple[float, list[float]]:
    """Fires per second and the lateness of each fire (seconds), ``engines`` engines on one store."""
    logged: list[tuple[float, str]] = []
    all_logged = trio.Event()

    def observe(event: FiredEvent) -> None:
        logged.append((time.time(), event.job_id))
        if len(logged) >= jobs:
            all_logged.set()

    async with AsyncExitStack() as stack:
        running = []
        for n in range(engines):
            config = EngineConfig(
                state_dir=ctx.scratch(f"fleet-{n}"),
                store_url=store_url,
                engine_id=f"bench-{n}",
                guardian=False,
                fire_observers=(observe,),
            )
            running.append(await stack.enter_async_context(open_engine(config)))
        due = datetime.now(UTC) + timedelta(seconds=LEAD_SECONDS)
        due_times: dict[str, float] = {}
        now = datetime.now(UTC)
        made: list[CronJob] = []
        for i in range(jobs):  # straight into the store (as many `cron add` would), then one wake-up
            at = due + timedelta(milliseconds=i % 1000)  # all within one second
            job = CronJob(
                id=uuid.uuid4().hex[:12],
                name=f"job {i}",
                enabled=True,
                schedule=At(at),
                payload=SystemEvent(f"job {i}"),
                delete_after_run=False,
                created_at=now,
                updated_at=now,
                next_run_at=at,
                owner="bench-0",
            )
            made.append(job)
            due_times[job.id] = at.timestamp()
        await _insert_all(running[0].cron.store, made)
        await running[0].cron.notify_jobs_changed()
        if time.time() > due.timestamp():
            raise RuntimeError(f"adding {jobs} jobs took longer than {LEAD_SECONDS} s")
        with trio.fail_after(LEAD_SECONDS + 120):
            await all_logged.wait()
    late = [when - due_times[job] for when, job in logged if job in due_times]
    span = max(when for when, _ in logged) - due.timestamp()
    return jobs / max(span, 1.0), late


async def run(ctx: Context) -> list[Row]:
    jobs = 200 if ctx.quick else JOBS
    root = tempfile.mkdtemp(prefix="fleet-pg-", dir=ctx.tmp)
    server, url = _postgres(root)
    try:
        pg_rate, pg_late = await _fire(ctx, 3, url, jobs)
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            server.cleanup()
    lite_rate, lite_late = await _fire(ctx, 1, None, jobs)
    workload = f"fleet: {jobs} jobs due in one second"
    rows = []
    for variant, rate, late in (
        ("3 engines on PostgreSQL", pg_rate, pg_late),
        ("1 engine on SQLite", lite_rate, lite_late),
    ):
        rows.append(Row(workload, f"{variant}: fires per second", "fires/s", [rate]))
        rows.append(
            Row(
                workload,
                f"{variant}: lateness p50 / p99",
                "ms",
                [pct(late, 0.5) * 1000, pct(late, 0.99) * 1000],
                note=f"p50 {pct(late, 0.5) * 1000:.0f} ms, p99 {pct(late, 0.99) * 1000:.0f} ms",
            )
        )
    return rows


if __name__ == "__main__":  # a quick look without the runner

    async def _main() -> None:
        with tempfile.TemporaryDirectory() as tmp:
            ctx = Context(quick=False, log_bytes=0, tmp=tmp, supervisord=None)
            for row in await run(ctx):
                print(row.workload, "|", row.variant, "|", [round(v, 1) for v in row.values], row.unit)

    trio.run(_main)
