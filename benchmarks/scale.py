"""Scale: N concurrent ``sleep`` children through the service, the supervisor and bare trio.

Per child: the engine's resident memory and open descriptors (deltas over the idle process, divided by
N; the Python heap through ``tracemalloc``). While they sleep: the engine's own CPU time over a few idle
seconds (no polling: about zero; the service's log-cap task looks at the logs once a second, as the
design allows).
"""

from __future__ import annotations

import gc
import time
import tracemalloc
from collections.abc import Awaitable, Callable

import trio

from engine import EngineConfig, Project, SpawnSpec, open_engine

from ._common import Context, Row, cpu_seconds, open_fds, paired, rss_bytes

SLEEP = ("sleep", "600")


async def run(ctx: Context) -> list[Row]:
    n = 50 if ctx.quick else 1000
    idle = 1.0 if ctx.quick else 4.0
    repeats = 1 if ctx.quick else 2
    config = EngineConfig(
        state_dir=ctx.scratch("scale-state"), max_processes=n + 10, max_processes_per_project=n + 10
    )
    project = Project.from_directory(ctx.scratch("scale-project"))
    per_rss: dict[str, list[float]] = {}
    per_heap: dict[str, list[float]] = {}
    per_fd: dict[str, list[float]] = {}
    idle_cpu: dict[str, list[float]] = {}
    async with open_engine(config) as engine:

        async def service() -> Callable[[], Awaitable[None]]:
            for _ in range(n):
                await engine.service.create(project, SLEEP[0], SLEEP[1:])

            async def end() -> None:
                await engine.service.kill_all()

            return end

        async def supervisor() -> Callable[[], Awaitable[None]]:
            runs = [await engine.supervisor.spawn(SpawnSpec(argv=SLEEP, scope_key="scale")) for _ in range(n)]
            assert len(runs) == n

            async def end() -> None:
                await engine.supervisor.cancel_scope("scale")

            return end

        async def bare_trio() -> Callable[[], Awaitable[None]]:
            procs = [await trio.lowlevel.open_process(list(SLEEP)) for _ in range(n)]

            async def end() -> None:
                for p in procs:
                    p.kill()
                for p in procs:
                    await p.wait()

            return end

        variants = {
            "SubProcessService": service,
            "Supervisor": supervisor,
            "bare trio open_process": bare_trio,
        }
        names = list(variants)
        for name in names:
            per_rss[name], per_heap[name], per_fd[name], idle_cpu[name] = [], [], [], []
        for i in range(repeats):
            for name in names[i % len(names) :] + names[: i % len(names)]:
                gc.collect()
                await trio.sleep(0.2)
                rss0, fds0 = rss_bytes(), open_fds()
                tracemalloc.start()
                end = await variants[name]()
                await trio.sleep(1.0)  # let start-up work (first log-cap pass) settle
                gc.collect()
                heap = tracemalloc.get_traced_memory()[0]
                tracemalloc.stop()
                per_heap[name].append(heap / n / 1024)
                per_rss[name].append((rss_bytes() - rss0) / n / 1024)
                per_fd[name].append((open_fds() - fds0) / n)
                c0, t0 = cpu_seconds(), time.perf_counter()
                await trio.sleep(idle)
                idle_cpu[name].append((cpu_seconds() - c0) / (time.perf_counter() - t0) * 1e3)
                await end()
    base = "bare trio open_process"
    rows: list[Row] = []
    for metric, unit, data in (
        ("Python heap per child", "KiB (tracemalloc)", per_heap),
        ("memory per child", "KiB RSS", per_rss),
        ("descriptors per child", "fds", per_fd),
        ("CPU while idle", "ms CPU per s", idle_cpu),
    ):
        workload = f"scale: {n} sleeping children, {metric}"
        for name in names:
            row = Row(workload, name, unit, data[name])
            if name != base and all(v > 0 for v in data[base]):
                row.baseline, row.ratios = base, paired(data[name], data[base])
            elif name != base:
                row.baseline = base
                row.note = "no ratio: the baseline is zero"
            if metric == "memory per child":
                row.note = "RSS grows little: earlier workloads left the heap with free arenas to reuse"
            if metric == "CPU while idle" and name == "SubProcessService":
                row.target = "~0 (no polling)"
                row.met = sorted(data[name])[len(data[name]) // 2] < 1.0
                row.note = "the log-cap task stats each log once a second (the design's floor)"
            if metric == "CPU while idle" and name == "Supervisor":
                row.target = "~0"
                row.met = sorted(data[name])[len(data[name]) // 2] < 1.0
            rows.append(row)
    return rows
