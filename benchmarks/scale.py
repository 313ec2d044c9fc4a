"""Scale: N concurrent ``sleep`` children through the service, the supervisor and bare trio.

The service and the supervisor run in each containment mode (one engine per mode). Per child: the
engine's resident memory and open descriptors (deltas over the idle process, divided by N; the Python heap
through ``tracemalloc``). While they sleep: the engine's own CPU time over a few idle seconds, with every
timer the engine runs going (the log cap, the cron timer with a job armed, ``serve``'s socket and its
watch): no polling should leave it about zero.
"""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import time
import tracemalloc
from collections.abc import Awaitable, Callable

import trio

from engine import Engine, EngineConfig, Project, SpawnSpec, open_engine
from engine.cron import Every, SystemEvent
from engine.server._socket_watch import serve_socket

from ._common import Context, Row, cpu_seconds, open_fds, paired, rss_bytes

SLEEP = ("sleep", "600")
BASE = "bare trio open_process"


async def _serve_socket(
    path: str, nursery: trio.Nursery, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """``serve``'s socket (and its watch of the socket file) on ``path``, answering nothing."""

    async def bind() -> trio.SocketListener:
        sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        await sock.bind(path)
        sock.listen()
        return trio.SocketListener(sock)

    async def handler(stream: trio.SocketStream) -> None:
        await stream.aclose()

    await serve_socket(handler, await bind(), path, bind, nursery, task_status=task_status)


class _Wakes(trio.abc.Instrument):
    """Counts the loop's wake-ups (returns from its I/O wait) and task steps while :attr:`counting`."""

    def __init__(self) -> None:
        self.counting = False
        self.wakes = 0
        self.steps = 0

    def after_io_wait(self, timeout: float) -> None:
        if self.counting:
            self.wakes += 1

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if self.counting:
            self.steps += 1


async def run(ctx: Context) -> list[Row]:
    n = 50 if ctx.quick else 1000
    idle = 1.0 if ctx.quick else 6.0
    repeats = 1 if ctx.quick else 3
    project = Project.from_directory(ctx.scratch("scale-project"))
    per_rss: dict[str, list[float]] = {}
    per_heap: dict[str, list[float]] = {}
    per_fd: dict[str, list[float]] = {}
    idle_cpu: dict[str, list[float]] = {}
    idle_wakes: dict[str, list[float]] = {}
    wakes = _Wakes()
    trio.lowlevel.add_instrument(wakes)
    async with contextlib.AsyncExitStack() as stack:
        stack.callback(trio.lowlevel.remove_instrument, wakes)
        timers = await stack.enter_async_context(trio.open_nursery())
        engines: dict[str, Engine] = {}
        for mode in ctx.modes:
            config = EngineConfig(
                state_dir=ctx.scratch(f"scale-state-{mode}"),
                max_processes=n + 10,
                max_processes_per_project=n + 10,
                containment=mode,
            )
            engine = engines[mode] = await stack.enter_async_context(open_engine(config))
            # every timer the engine runs: the cron timer armed (a job due in an hour), the socket and
            # its watch as under ``serve``; the log cap runs while the service has children
            await engine.cron.add(Every(every_seconds=3600.0), SystemEvent("hourly"))
            await timers.start(_serve_socket, os.path.join(engine.state_dir, "bench.sock"), timers)

        def service(engine: Engine) -> Callable[[], Awaitable[Callable[[], Awaitable[None]]]]:
            async def start() -> Callable[[], Awaitable[None]]:
                for _ in range(n):
                    await engine.service.create(project, SLEEP[0], SLEEP[1:])

                async def end() -> None:
                    await engine.service.kill_all()

                return end

            return start

        def supervisor(engine: Engine) -> Callable[[], Awaitable[Callable[[], Awaitable[None]]]]:
            async def start() -> Callable[[], Awaitable[None]]:
                runs = [
                    await engine.supervisor.spawn(SpawnSpec(argv=SLEEP, scope_key="scale")) for _ in range(n)
                ]
                assert len(runs) == n

                async def end() -> None:
                    await engine.supervisor.cancel_scope("scale")

                return end

            return start

        async def bare_trio() -> Callable[[], Awaitable[None]]:
            procs = [await trio.lowlevel.open_process(list(SLEEP)) for _ in range(n)]

            async def end() -> None:
                for p in procs:
                    p.kill()
                for p in procs:
                    await p.wait()

            return end

        variants: dict[str, Callable[[], Awaitable[Callable[[], Awaitable[None]]]]] = {}
        for mode, engine in engines.items():
            variants[f"SubProcessService|{mode}"] = service(engine)
            variants[f"Supervisor|{mode}"] = supervisor(engine)
        variants[BASE] = bare_trio
        names = list(variants)
        for name in names:
            per_rss[name], per_heap[name], per_fd[name], idle_cpu[name] = [], [], [], []
            idle_wakes[name] = []
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
                wakes.wakes = 0
                wakes.counting = True
                c0, t0 = cpu_seconds(), time.perf_counter()
                await trio.sleep(idle)
                idle_cpu[name].append((cpu_seconds() - c0) / (time.perf_counter() - t0) * 1e3)
                wakes.counting = False
                idle_wakes[name].append(max(0, wakes.wakes - 1) / idle)  # less the window's own end
                await end()
        timers.cancel_scope.cancel()
    rows: list[Row] = []
    for metric, unit, data in (
        ("Python heap per child", "KiB (tracemalloc)", per_heap),
        ("memory per child", "KiB RSS", per_rss),
        ("descriptors per child", "fds", per_fd),
        ("CPU while idle", "ms CPU per s", idle_cpu),
        ("loop wake-ups while idle", "per s", idle_wakes),
    ):
        workload = f"scale: {n} sleeping children, {metric}"
        for key in names:
            name, _, mode = key.partition("|")
            row = Row(workload, name, unit, data[key], mode=mode)
            if key != BASE and all(v > 0 for v in data[BASE]):
                row.baseline, row.ratios = BASE, paired(data[key], data[BASE])
            elif key != BASE:
                row.baseline = BASE
                row.note = "no ratio: the baseline is zero"
            if metric == "memory per child":
                row.note = "RSS grows little: earlier workloads left the heap with free arenas to reuse"
            if metric == "CPU while idle" and name == "SubProcessService":
                row.target = "<= 0.5 ms/s"
                row.met = statistics.median(data[key]) <= 0.5
                row.note = "every timer running: the log cap, the cron timer, the socket watch"
            if metric == "loop wake-ups while idle":
                row.note = (
                    "the process's trio loop (every engine of the run open, each with its heartbeat every "
                    "5 s, cron timer and socket watch); counted by a trio Instrument"
                )
            if metric == "CPU while idle" and name == "Supervisor":
                row.target = "~0 (< 1 ms/s)"
                row.met = statistics.median(data[key]) < 1.0
            rows.append(row)
    return rows
