"""Wake me when this command exits: an on-exit job whose fire carries the exit code and last lines
(docs/guide-on-exit.md). Run: python docs/examples/on_exit_example.py [STATE_DIR]
"""

from __future__ import annotations

import math
import sys
import tempfile

import trio

from engine import EngineConfig, FiredEvent, OnExit, SystemEvent, open_engine


async def main(state_dir: str) -> None:
    send_fire, fires = trio.open_memory_channel[FiredEvent](math.inf)  # every fire, kept until read

    async def on_fire(event: FiredEvent) -> None:  # the embedded host wakes its agent here
        send_fire.send_nowait(event)

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
        print("armed:", job.name, "watched pid", engine.watchers.watched_pid(job.id))
        with trio.fail_after(30):  # its fire waits in the channel even if it came before `add` returned
            event = await fires.receive()
            while event.job_id != job.id:  # an earlier run's job may fire here too (same state_dir): skip it
                event = await fires.receive()
        print(event.text)
        stored = await engine.cron.get(job.id)
        print("exit code:", event.exit_code, "| job enabled after firing:", stored.enabled)


if __name__ == "__main__":
    trio.run(main, sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp())
