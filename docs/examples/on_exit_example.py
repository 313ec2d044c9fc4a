"""Wake me when this command exits: an on-exit job whose fire carries the exit code and last lines
(docs/guide-on-exit.md). Run: python docs/examples/on_exit_example.py [STATE_DIR]
"""

from __future__ import annotations

import sys
import tempfile

import trio

from engine import EngineConfig, FiredEvent, OnExit, SystemEvent, open_engine


async def main(state_dir: str) -> None:
    mine: set[str] = set()  # the ids of the jobs this run added
    fired = trio.Event()
    received: list[FiredEvent] = []

    async def on_fire(event: FiredEvent) -> None:  # the embedded host wakes its agent here
        if event.job_id in mine:  # an earlier run's job may fire here too (same state_dir): skip it
            received.append(event)
            fired.set()

    project = tempfile.mkdtemp()
    config = EngineConfig(state_dir=state_dir, grace_seconds=0.5)
    async with open_engine(config, on_fire=on_fire) as engine:
        job = await engine.cron.add(
            OnExit(
                command="echo running the tests; sleep 0.5; echo '3 passed, 1 failed'; exit 1", cwd=project
            ),
            SystemEvent("The test run you started has finished."),
            name="test run",
        )
        mine.add(job.id)
        print("armed:", job.name, "watched pid", engine.watchers.watched_pid(job.id))
        with trio.fail_after(30):
            await fired.wait()
        event = received[0]
        print(event.text)
        stored = await engine.cron.get(job.id)
        print("exit code:", event.exit_code, "| job enabled after firing:", stored.enabled)


if __name__ == "__main__":
    trio.run(main, sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp())
