"""Spawn-to-exit of `true`, side by side: the supervisor, bare trio, and subprocess.Popen.

Run: .venv/bin/python benchmarks/bench_spawn.py [--rounds N]
Prints the median and the 10th-90th percentile spread of each, and the ratio to Popen, measured in
the same run so the machine's speed cancels out.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time
from collections.abc import Awaitable, Callable

import trio

from engine import SpawnSpec, open_supervisor

TRUE = "/bin/true"


def summary(samples: list[float]) -> tuple[float, float, float]:
    ordered = sorted(samples)
    n = len(ordered)
    return statistics.median(ordered), ordered[n // 10], ordered[(9 * n) // 10]


async def measure(rounds: int, once: Callable[[], Awaitable[None]]) -> list[float]:
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        await once()
        samples.append(time.perf_counter() - t0)
    return samples


async def main(rounds: int) -> None:
    results: dict[str, list[float]] = {}

    async def popen() -> None:
        subprocess.Popen([TRUE]).wait()  # noqa: ASYNC220  # the blocking baseline is the point

    async def bare_trio() -> None:
        proc = await trio.lowlevel.open_process([TRUE])
        await proc.wait()

    async with open_supervisor() as sup:

        async def supervisor() -> None:
            run = await sup.spawn(SpawnSpec(argv=(TRUE,)))
            await run.wait()

        for name, fn in (
            ("subprocess.Popen", popen),
            ("trio open_process", bare_trio),
            ("Supervisor", supervisor),
        ):
            await measure(20, fn)  # warm-up
            results[name] = await measure(rounds, fn)
    base = statistics.median(results["subprocess.Popen"])
    print(f"spawn-to-exit of {TRUE}, {rounds} rounds each")
    print(f"{'workload':<20} {'median ms':>10} {'p10 ms':>8} {'p90 ms':>8} {'vs Popen':>9}")
    for name, samples in results.items():
        med, p10, p90 = summary(samples)
        print(f"{name:<20} {med * 1e3:>10.3f} {p10 * 1e3:>8.3f} {p90 * 1e3:>8.3f} {med / base:>8.2f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=300)
    trio.run(main, parser.parse_args().rounds)
