"""Schedule a reminder every second and a command, and print what fires (docs/guide-cron.md)."""

from __future__ import annotations

import sys
import tempfile

import trio

from engine import Command, EngineConfig, Every, FiredEvent, SystemEvent, open_engine


async def main(state_dir: str) -> None:
    fired: list[FiredEvent] = []
    two_fired = trio.Event()
    mine: set[str] = set()  # the jobs of this run: a state directory used before hands over older fires

    async def on_fire(event: FiredEvent) -> None:
        if event.job_id not in mine:
            return
        fired.append(event)
        print(f"[{event.cursor}] {event.job_name}: {event.text.splitlines()[0]}")
        if len(fired) == 2:
            two_fired.set()

    config = EngineConfig(state_dir=state_dir, grace_seconds=0.5)
    async with open_engine(config, on_fire=on_fire) as engine:
        reminder = SystemEvent("stand up and stretch")
        stretch = await engine.cron.add(Every(every_seconds=1.0), reminder, name="stretch")
        mine.add(stretch.id)  # its first fire comes a second later
        job = await engine.cron.add(Every(every_seconds=3600.0), Command(("echo", "build ok")), name="build")
        mine.add(job.id)
        await engine.cron.run_now(job.id)  # waits until the fire is delivered
        with trio.fail_after(10):
            await two_fired.wait()
        # The event log keeps every fire; read it from any cursor on.
        for event in await engine.cron.events(since=0):
            if event.job_id in mine:
                print(event.cursor, event.job_name, event.exit_code, event.stdout_tail.strip())


if __name__ == "__main__":
    trio.run(main, sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp())
