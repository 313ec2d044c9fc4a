"""A real engine in a process of its own, for crash tests: it starts the children named on the command
line (one shell command each, in its own project directory), prints ``ready <pid> ...`` and waits to be
killed.

Usage: python -m tests.crash_engine STATE_DIR GRACE CONTAINMENT PROJECT_DIR COMMAND [PROJECT_DIR COMMAND ...]
"""

from __future__ import annotations

import sys

import trio

from engine import EngineConfig, SpawnSpec, open_engine


async def main(argv: list[str]) -> None:
    state_dir, grace, containment = argv[0], float(argv[1]), argv[2]
    pairs = list(zip(argv[3::2], argv[4::2], strict=True))
    config = EngineConfig(state_dir=state_dir, grace_seconds=grace, containment=containment)
    async with open_engine(config) as engine:
        pids = []
        for n, (project, command) in enumerate(pairs):
            spec = SpawnSpec(argv=("bash", "-c", command), cwd=project, scope_key=f"project:{n}")
            pids.append((await engine.supervisor.spawn(spec)).pid)
        print("ready", *pids, flush=True)
        await trio.sleep_forever()


if __name__ == "__main__":
    trio.run(main, sys.argv[1:])
