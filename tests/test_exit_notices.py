"""Exit notices (issue 18): ``create(..., notify_on_exit=True)`` makes the process's own final exit a fired
event with ``job_id="subprocess:<first pid>"``, persisted before delivery; once through ``serve``, at
least once embedded (``on_fire`` failing once gets it again), none for a kill or a halt."""

from __future__ import annotations

import json
from pathlib import Path

import trio

from engine import EngineConfig, FiredEvent, RestartPolicy, SqliteJobStore, open_engine
from engine.cron._events import text_fire

from .children import kill_leftovers, mark, wait_until
from .serve_support import Served
from .serve_support import wait_until as wait_until_sync
from .service_support import make_project


async def test_embedded_on_fire_that_fails_once_gets_the_notice_again(tmp_path: Path) -> None:
    project = make_project(tmp_path)
    seen: list[FiredEvent] = []

    async def on_fire(event: FiredEvent) -> None:
        seen.append(event)
        if len(seen) == 1:
            raise RuntimeError("the host is busy (test)")

    config = EngineConfig(state_dir=str(tmp_path / "state"), grace_seconds=0.4)
    async with open_engine(config, on_fire=on_fire) as engine:
        sp = await engine.service.create(
            project, "bash", ["-c", "echo building; echo 'error: boom' >&2; exit 2"], notify_on_exit=True
        )
        await wait_until(lambda: len(seen) >= 2, seconds=15)
        await trio.sleep(0.3)
        assert len(seen) == 2  # once more, not more
        first, again = seen
        assert first.fire_id == again.fire_id
        assert (first.job_id, first.project) == (f"subprocess:{sp.first_pid}", project.id)
        assert (first.exit_code, first.signal, first.reason) == (2, None, "exit")
        assert first.stdout_tail == "building\n" and first.stderr_tail == "error: boom\n"
        assert f"Subprocess {sp.first_pid} of project project exited on its own." in first.text
        assert "exited with code 2" in first.text and "error: boom" in first.text
        events = await engine.cron.events()
        assert [e.fire_id for e in events] == [first.fire_id]


async def test_no_notice_for_a_kill_or_a_halt_and_one_after_a_crash_loop(tmp_path: Path) -> None:
    project = make_project(tmp_path)
    marker = mark("75.1")
    try:
        async with open_engine(EngineConfig(state_dir=str(tmp_path / "state"), grace_seconds=0.4)) as engine:
            service = engine.service
            killed = await service.create(project, "sleep", [marker], notify_on_exit=True)
            halted = await service.create(project, "sleep", [marker], notify_on_exit=True)
            await service.kill_pid(killed.pid)
            await service.halt_pid(halted.pid)
            looping = await service.create(
                project,
                "bash",
                ["-c", "exit 5"],
                notify_on_exit=True,
                restart=RestartPolicy("on-failure", max_restarts=2, backoff_seconds=0.01),
            )
            with trio.fail_after(20):
                await service.wait(looping.first_pid)

            async def one_event() -> bool:
                return len(await engine.cron.events()) >= 1

            await wait_until(one_event, seconds=10)
            await trio.sleep(0.3)
            events = await engine.cron.events()
            assert [e.job_id for e in events] == [f"subprocess:{looping.first_pid}"]
            assert "after 2 restarts (crash loop: 2 restarts in 60 s)" in events[0].text
            assert events[0].exit_code == 5
    finally:
        kill_leftovers(marker)


def test_serve_delivers_an_exit_notice_once_and_none_for_a_kill(served: Served, project: Path) -> None:
    marker = mark("75.2")
    try:
        with served.client() as client:
            since = client.call("status")["last_event"]
        cursor = since["cursor"] if since else 0
        quiet = served.cli("create", "--project", str(project), "--notify-on-exit", "--", "sleep", marker)
        assert served.cli("kill", quiet.stdout.strip()).returncode == 0
        out = served.cli(
            "create", "--project", str(project), "--notify-on-exit", "--", "bash", "-c", "echo done; exit 4"
        )
        pid = int(out.stdout)

        def events() -> list[dict[str, object]]:
            text = served.cli("events", "--since", str(cursor), "--json").stdout
            return [json.loads(line) for line in text.splitlines()]

        assert wait_until_sync(lambda: len(events()) >= 1)
        waited = served.cli("wait", str(pid))
        assert waited.stdout == "exited 4\n"
        found = events()
        assert [(e["job_id"], e["exit_code"]) for e in found] == [(f"subprocess:{pid}", 4)]
        assert found[0]["stdout_tail"] == "done\n"
    finally:
        kill_leftovers(marker)


async def test_a_notice_persisted_by_an_engine_that_stopped_is_recorded_at_the_next_start(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    async with open_engine(EngineConfig(state_dir=str(state))) as engine:
        store = engine.cron.store
        assert isinstance(store, SqliteJobStore)
        fire = text_fire("subprocess 4242", "exited on its own")
        await store.add_notice("subprocess:4242", "1f2e3d4c5b6a7988", fire)  # as if it stopped right here
    async with open_engine(EngineConfig(state_dir=str(state))) as engine:
        events = await engine.cron.events()
        assert [(e.fire_id, e.job_id, e.project) for e in events] == [
            (fire.fire_id, "subprocess:4242", "1f2e3d4c5b6a7988")
        ]
        assert await engine.cron.store.pending_notices() == []  # type: ignore[attr-defined]
