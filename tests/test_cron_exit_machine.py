"""The exit watchers of a real engine under a Hypothesis state machine, with short real commands.

Trio runs on a helper thread (``hypothesis-trio`` does not import with current Hypothesis); each rule
calls into it with ``trio.from_thread.run``. Rules: add, edit, disable, enable, remove, reconcile,
cancel, store fails/recovers, let time pass (commands exit), restart the engine.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import trio
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from engine import Engine, OnExit, SystemEvent
from engine.cron._arming import SlotState

from .watch_support import FlakyStore, end_left_commands, engine_with

T = TypeVar("T")


class EngineThread:
    """An engine in a Trio loop on its own thread, restartable, reachable with :meth:`call`."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.store = FlakyStore(str(state_dir / "cron.sqlite3"))
        self.engine: Engine | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._up = threading.Event()
        self._down: trio.Event | None = None
        self._quit = False
        self._thread = threading.Thread(target=trio.run, args=(self._host,), daemon=True)
        self._thread.start()
        assert self._up.wait(30)

    async def _host(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        while not self._quit:
            self.store = FlakyStore(str(self.state_dir / "cron.sqlite3"))
            async with engine_with(self.state_dir, store=self.store, watch_retry_seconds=(0.1,)) as engine:
                self.engine = engine
                self._down = trio.Event()
                self._up.set()
                await self._down.wait()
            self.engine = None

    def call(self, fn: Callable[[Engine], Awaitable[T]]) -> T:
        async def run() -> T:
            assert self.engine is not None
            return await fn(self.engine)

        return trio.from_thread.run(run, trio_token=self._token)

    def restart(self, *, quit: bool = False) -> None:
        self._up.clear()
        self._quit = quit
        assert self._down is not None
        trio.from_thread.run_sync(self._down.set, trio_token=self._token)
        if quit:
            self._thread.join(30)
            assert not self._thread.is_alive()
        else:
            assert self._up.wait(30)


NAMES = ["j1", "j2", "j3"]


class WatcherEngineMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp())
        self.host = EngineThread(self.tmp / "state")
        self.ids: dict[str, str] = {}
        self.enable_periods: dict[str, int] = {}
        self.generation = 0

    def _command(self, name: str) -> str:
        self.generation += 1
        return f"sleep 0.0{self.generation % 10}; echo {name}-gen-{self.generation}"

    @rule(name=st.sampled_from(NAMES))
    def add(self, name: str) -> None:
        if name in self.ids:
            return
        command = self._command(name)

        async def add(engine: Engine) -> str:
            return (await engine.cron.add(OnExit(command=command), SystemEvent(name), name=name)).id

        try:
            self.ids[name] = self.host.call(add)
        except OSError:  # the store is failing: nothing was added
            return
        self.enable_periods[name] = self.enable_periods.get(name, 0) + 1

    def _job_call(self, name: str, method: str, **kwargs: Any) -> None:
        if name not in self.ids:
            return
        job_id = self.ids[name]

        async def run(engine: Engine) -> None:
            await getattr(engine.cron, method)(job_id, **kwargs)

        try:
            self.host.call(run)
        except (OSError, LookupError):
            pass

    @rule(name=st.sampled_from(NAMES))
    def edit(self, name: str) -> None:
        self._job_call(name, "update", schedule=OnExit(command=self._command(name)))

    @rule(name=st.sampled_from(NAMES))
    def disable(self, name: str) -> None:
        self._job_call(name, "disable")

    @rule(name=st.sampled_from(NAMES))
    def enable(self, name: str) -> None:
        if name not in self.ids:
            return

        async def enable(engine: Engine) -> bool:
            job = await engine.cron.get(self.ids[name])
            if job.enabled:
                return False
            await engine.cron.enable(job.id)
            return True

        try:
            if self.host.call(enable):
                self.enable_periods[name] += 1
        except (OSError, LookupError):
            pass

    @rule(name=st.sampled_from(NAMES))
    def remove(self, name: str) -> None:
        self._job_call(name, "remove")
        self.ids.pop(name, None)

    @rule()
    def reconcile(self) -> None:
        async def run(engine: Engine) -> None:
            await engine.watchers.reconcile(await engine.cron.list())

        self.host.call(run)

    @rule(name=st.sampled_from(NAMES))
    def cancel(self, name: str) -> None:
        if name in self.ids:
            job_id = self.ids[name]

            async def run(engine: Engine) -> None:
                await engine.watchers.cancel(job_id)

            self.host.call(run)

    @rule(failing=st.booleans())
    def store_fails(self, failing: bool) -> None:
        if failing:
            self.host.store.failing.add("*")
        else:
            self.host.store.failing.clear()

    @rule(seconds=st.sampled_from([0.0, 0.05, 0.2]))
    def time_passes(self, seconds: float) -> None:
        async def run(engine: Engine) -> None:
            await trio.sleep(seconds)

        self.host.call(run)

    @rule()
    def restart(self) -> None:
        self.host.restart()

    def _events(self) -> list[Any]:
        async def run(engine: Engine) -> list[Any]:
            return await engine.cron.events()

        return self.host.call(run)

    @invariant()
    def no_watcher_for_disabled_or_removed_job(self) -> None:
        async def check(engine: Engine) -> None:
            jobs = {job.id: job for job in await engine.cron.list()}
            table = engine.watchers._table
            for job_id in engine.watchers.active_job_ids():
                slot = table.slot(job_id)
                if slot is None or slot.state is not SlotState.RUNNING:
                    continue  # committing / retrying: the exit is being persisted
                assert job_id in jobs and jobs[job_id].enabled, job_id

        self.host.call(check)

    @invariant()
    def at_most_one_fire_per_enabled_period(self) -> None:
        events = self._events()
        fire_ids = [e.fire_id for e in events]
        assert len(fire_ids) == len(set(fire_ids))  # no arm fires twice
        for name, job_id in self.ids.items():
            count = sum(1 for e in events if e.job_id == job_id)
            assert count <= self.enable_periods[name], (name, count)

    def teardown(self) -> None:
        try:
            self.host.store.failing.clear()

            async def settle(engine: Engine) -> list[str]:
                # `cancel` leaves a job enabled and unwatched until the next reconcile: do one.
                await engine.watchers.reconcile(await engine.cron.list())
                with trio.move_on_after(10):
                    while engine.watchers.active_job_ids():
                        await trio.sleep(0.02)
                return engine.watchers.active_job_ids()

            assert self.host.call(settle) == []  # every exit of a current arm fired once the store works

            async def jobs(engine: Engine) -> list[Any]:
                return [j for j in await engine.cron.list() if j.enabled]

            assert self.host.call(jobs) == []
            events = self._events()
            for e in events:
                gen = e.stdout_tail.strip()
                assert gen.startswith(e.job_name + "-gen-"), e
        finally:
            self.host.restart(quit=True)
            end_left_commands(self.tmp)  # a graceful stop leaves them running, children of this process
            shutil.rmtree(self.tmp, ignore_errors=True)


TestWatcherEngine = WatcherEngineMachine.TestCase
