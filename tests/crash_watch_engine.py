"""A real engine process for on-exit crash tests: it arms one on-exit job and SIGKILLs itself at a
named watcher point (or, with point ``on_fire``, inside the embedded host's fire handler after noting
the fire id in ``<state_dir>/received``).

Usage: python -m tests.crash_watch_engine STATE_DIR POINT COMMAND [CONTAINMENT]
"""

from __future__ import annotations

import os
import signal
import sys

import trio

from engine import FiredEvent, OnExit, SystemEvent, open_engine

from .watch_support import config


def crash(point: str) -> None:
    print(f"at {point}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


async def main(state_dir: str, point: str, command: str, containment: str) -> None:
    async def hook(job_id: str) -> None:
        crash(point)

    async def on_fire(event: FiredEvent) -> None:
        with open(os.path.join(state_dir, "received"), "a") as f:
            f.write(event.fire_id + "\n")
        crash(point)

    from pathlib import Path

    cfg = config(Path(state_dir), guardian=True, watch_hooks={point: hook}, containment=containment)
    async with open_engine(cfg, on_fire=on_fire if point == "on_fire" else None) as engine:
        if not await engine.cron.list():
            await engine.cron.add(OnExit(command=command), SystemEvent("crash-test"))
        print("armed", flush=True)
        await trio.sleep_forever()


if __name__ == "__main__":
    state_dir, point, command = sys.argv[1:4]
    trio.run(main, state_dir, point, command, sys.argv[4] if len(sys.argv) > 4 else "auto")
