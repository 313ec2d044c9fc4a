"""The main job: a short, real run of the supervisor.

It starts a well-behaved child and a process tree that ignores SIGINT and hides a ``setsid`` escapee,
stops both by escalation, and proves that nothing is left running.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio

from engine import SpawnSpec, open_supervisor


def survivors(pattern: str) -> list[str]:
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True, check=False)
    return out.stdout.split()


async def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "worker.log"
        async with open_supervisor(grace_seconds=1.0) as supervisor:
            worker = await supervisor.spawn(
                SpawnSpec(
                    argv=(
                        sys.executable,
                        "-u",
                        "-c",
                        "import time\nfor i in range(3): print('tick', i)\ntime.sleep(600.11)",
                    ),
                    stdout=str(log),
                    scope_key="demo",
                )
            )
            stubborn = await supervisor.spawn(
                SpawnSpec(
                    shell_command="trap '' INT; sleep 600.12 & setsid sleep 600.13 & wait",
                    scope_key="demo",
                )
            )
            print(f"started {worker!r}")
            print(f"started {stubborn!r}")
            await trio.sleep(0.5)
            print(f"worker log so far: {log.read_text()!r}")
            t0 = time.monotonic()
            for result in await supervisor.cancel_scope("demo"):
                print(
                    f"  ended: {result.describe()}, reason={result.reason.value}, "
                    f"escalated={result.escalated}, after {result.duration_seconds:.2f} s"
                )
            print(f"cancel_scope('demo') took {time.monotonic() - t0:.2f} s")
    left = survivors(r"sleep 600\.1[23]|600\.11")
    print("processes left:", left or "none")
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(trio.run(main))
