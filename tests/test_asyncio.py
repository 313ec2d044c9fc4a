"""``open_asyncio_engine``: asyncio programs (``asyncio.run``) embed the engine as a Trio guest."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from pathlib import Path

import pytest
import trio

from engine import (
    Engine,
    EngineConfig,
    EngineLockedError,
    OnExit,
    SubProcessNotFoundError,
    SystemEvent,
)
from engine._asyncio import AsyncioEngine, EngineClosedError, open_asyncio_engine

from .children import cooperative, ignoring_sigint, kill_leftovers, pgrep
from .conftest import SHORT_GRACE
from .watch_support import end_left_commands


def config(tmp_path: Path) -> EngineConfig:
    return EngineConfig(
        state_dir=str(tmp_path / "state"),
        grace_seconds=SHORT_GRACE,
        kill_wait_seconds=2.0,
        exit_watch_shell=("bash", "-c", "--"),
    )


def split(argv: tuple[str, ...]) -> tuple[str, list[str]]:
    return argv[0], list(argv[1:])


async def trio_thread_id(_engine: Engine) -> int:
    """A Trio function: :meth:`AsyncioEngine.run` runs it in the guest run."""
    await trio.lowlevel.checkpoint()
    return threading.get_ident()


async def wait_for_log(engine: AsyncioEngine, pid: int, text: str) -> str:
    async with asyncio.timeout(10):
        while text not in (got := (await engine.read_log(pid)).text):
            await asyncio.sleep(0.02)
    return got


def test_asyncio_engine_runs_create_log_kill_and_delivers_the_on_exit_event(
    tmp_path: Path, project: Path, marker: str
) -> None:
    async def main() -> list[str]:
        seen: list[str] = []
        host_thread = threading.get_ident()
        async with open_asyncio_engine(config(tmp_path)) as engine:
            assert "running" in repr(engine)
            # The engine's Trio code runs on the host's own thread.
            assert await engine.run(trio_thread_id) == host_thread

            sp = await engine.create(str(project), *split(cooperative(marker)))
            assert sp.status == "running" and sp.project_slug == "app"
            assert await wait_for_log(engine, sp.pid, "ready") == "ready\n"
            assert [s.pid for s in await engine.ps()] == [sp.pid]
            assert await engine.tool({"cmd": "list"}, str(project)) != ""
            assert await engine.halt(sp.pid) is True
            assert (await engine.read_log(sp.pid)).text == "ready\nbye\n"
            assert await engine.kill(sp.pid) is False  # already halted: its logs go
            with pytest.raises(SubProcessNotFoundError):
                await engine.kill(sp.pid)

            job = await engine.cron_add(
                OnExit(command=f"echo done-{marker}; exit 4", cwd=str(project)), SystemEvent("tests ran")
            )
            assert [j.id for j in await engine.cron_list()] == [job.id]
            async with asyncio.timeout(10):
                async for event in engine.events():
                    assert event.job_id == job.id and event.exit_code == 4
                    assert f"done-{marker}" in event.text
                    seen.append(event.fire_id)
                    break
            assert [e.fire_id for e in await engine.cron_events()] == seen
            await engine.cron_remove(job.id)
            assert await engine.cron_list() == []

            live = await engine.create(project, *split(ignoring_sigint(marker)))
            await wait_for_log(engine, live.pid, "ready")
        # Leaving the block stopped the engine: the SIGINT-ignoring child was ended and reaped.
        assert "stopped" in repr(engine)
        with pytest.raises(EngineClosedError):
            await engine.ps()
        assert [e async for e in engine.events()] == []  # the iterator ends
        return seen

    try:
        assert len(asyncio.run(main())) == 1
        assert pgrep(marker) == [] and pgrep(str(tmp_path / "state")) == []
    finally:
        kill_leftovers(marker)


def test_asyncio_engine_cancelling_a_caller_cancels_its_trio_side(
    tmp_path: Path, project: Path, marker: str
) -> None:
    async def main() -> None:
        async with open_asyncio_engine(config(tmp_path)) as engine:
            # A cancellable Trio call: cancelled at once.
            sleeper = asyncio.ensure_future(engine.run(lambda _e: trio.sleep_forever()))
            await asyncio.sleep(0.05)
            sleeper.cancel()
            with pytest.raises(asyncio.CancelledError):
                await sleeper

            # A kill: its escalation completes (the child is reaped) before the caller sees the cancel.
            sp = await engine.create(project, *split(ignoring_sigint(marker)))
            await wait_for_log(engine, sp.pid, "ready")
            killer = asyncio.ensure_future(engine.kill(sp.pid))
            await asyncio.sleep(0.05)
            killer.cancel()
            started = time.monotonic()
            with pytest.raises(asyncio.CancelledError):
                await killer
            assert time.monotonic() - started > SHORT_GRACE / 2  # it waited for the SIGKILL
            assert pgrep(marker) == []
            assert await engine.ps() == []  # kill finished: the record and its logs are gone

    try:
        asyncio.run(main())
    finally:
        kill_leftovers(marker)


def test_asyncio_engine_stops_when_the_loop_ends_without_leaving_the_block(
    tmp_path: Path, project: Path, marker: str
) -> None:
    stack = contextlib.AsyncExitStack()

    async def main() -> int:
        engine = await stack.enter_async_context(open_asyncio_engine(config(tmp_path)))
        sp = await engine.create(project, *split(ignoring_sigint(marker)))
        await wait_for_log(engine, sp.pid, "ready")
        return sp.pid  # returns with the engine still open: asyncio.run must stop it

    try:
        pid = asyncio.run(main())
        assert pid > 0
        assert pgrep(marker) == [] and pgrep(str(tmp_path / "state")) == []
    finally:
        kill_leftovers(marker)


def test_asyncio_engine_refuses_a_locked_state_dir(tmp_path: Path) -> None:
    async def second() -> None:
        async with open_asyncio_engine(config(tmp_path)):
            raise AssertionError("a second engine on the same state dir")

    async def main() -> None:
        async with open_asyncio_engine(config(tmp_path)) as engine:
            # Another thread, another loop (one guest run per thread): the state dir's lock refuses it.
            with pytest.raises(EngineLockedError):
                await asyncio.to_thread(asyncio.run, second())
            assert await engine.ps() == []

    asyncio.run(main())


def test_asyncio_engine_closing_leaves_watched_commands_for_the_next_engine(
    tmp_path: Path, project: Path, marker: str
) -> None:
    """Closing the wrapper is a graceful stop: the on-exit command runs on, unsignalled, and the next
    engine adopts it and fires it once when it ends."""

    async def first() -> str:
        async with open_asyncio_engine(config(tmp_path)) as engine:
            job = await engine.cron_add(
                OnExit(command=f"sleep {marker}", cwd=str(project)), SystemEvent("done"), project=project
            )
            async with asyncio.timeout(10):
                while not pgrep(rf"^sleep {marker}$"):
                    await asyncio.sleep(0.02)
            assert job.project is not None
            return job.id

    async def second() -> tuple[str, str | None, str | None]:
        async with open_asyncio_engine(config(tmp_path)) as engine:
            assert await engine.cron_events() == []
            kill_leftovers(rf"^sleep {marker}$")  # the command ends: the adopting engine fires it
            async for event in engine.events():
                return event.job_id, event.reason, event.project
        raise AssertionError("no event")

    try:
        job_id = asyncio.run(first())
        assert len(pgrep(rf"^sleep {marker}$")) == 1  # left running
        job, reason, project_id = asyncio.run(second())
        assert (job, reason) == (job_id, "signal") and project_id is not None  # the sleep itself, killed
        assert not pgrep(rf"^sleep {marker}$")
    finally:
        end_left_commands(tmp_path)
        kill_leftovers(rf"^sleep {marker}$")
