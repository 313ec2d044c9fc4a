"""Termination of N concurrent children: cooperative (exit on SIGINT) and SIGINT-ignoring ones.

Side by side in every repeat: the service (``kill_pid`` for one child, ``kill_all`` for N) and the
supervisor's ``cancel`` (one child), each in every containment mode (one engine per mode), bare trio
(``killpg`` + wait, the same SIGINT -> grace -> SIGKILL by hand), and supervisord's ``stopProcess`` /
``stopProcessGroup`` for 1 and a small N. Children are started outside the timed part and are known to
be past ``exec`` before they are signalled.
"""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import time
from collections.abc import Awaitable, Callable

import trio

from engine import Engine, EngineConfig, Project, SpawnSpec, open_engine

from ._common import Context, Row, paired
from ._supervisord import GROUP_SIZE, IGNORING_SH

GRACE = 0.2
BASE = "bare trio killpg + wait"
COOPERATIVE = ("sleep", "600")
IGNORING = ("/bin/sh", "-c", IGNORING_SH)


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


async def _until_exec(pids: list[int]) -> None:
    """Wait until every pid runs ``sleep`` (the shell has set its trap and exec'd)."""
    pending = list(pids)
    while pending:
        pending = [p for p in pending if _comm(p) != "sleep"]
        if pending:
            await trio.sleep(0.005)


async def _bare_trio(argv: tuple[str, ...], n: int) -> float:
    procs = [await trio.lowlevel.open_process(list(argv), start_new_session=True) for _ in range(n)]
    await _until_exec([p.pid for p in procs])

    async def end(proc: trio.Process) -> None:
        os.killpg(proc.pid, signal.SIGINT)
        with trio.move_on_after(GRACE):
            await proc.wait()
        if proc.returncode is None:
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()

    t0 = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for proc in procs:
            nursery.start_soon(end, proc)
    return time.perf_counter() - t0


async def run(ctx: Context) -> list[Row]:
    ns = (1, GROUP_SIZE) if ctx.quick else (1, GROUP_SIZE, 100, 1000)
    # x1000 runs three variants in a rotating order: nine repeats put each in each place three times
    # (five did not, and their spread was wider than the row's distance from its target).
    repeats = {1: 5 if ctx.quick else 25, GROUP_SIZE: 3 if ctx.quick else 7, 100: 5, 1000: 9}
    project = Project.from_directory(ctx.scratch("terminate-project"))
    sd = ctx.supervisord
    rows: list[Row] = []
    async with contextlib.AsyncExitStack() as stack:
        engines = {}
        for mode in ctx.modes:
            config = EngineConfig(
                state_dir=ctx.scratch(f"terminate-state-{mode}"),
                grace_seconds=GRACE,
                kill_wait_seconds=5.0,
                max_processes=4000,
                max_processes_per_project=4000,
                containment=mode,
            )
            engines[mode] = await stack.enter_async_context(open_engine(config))

        def via_service(engine: Engine) -> Callable[[tuple[str, ...], int], Awaitable[float]]:
            async def run(argv: tuple[str, ...], n: int) -> float:
                service = engine.service
                sps = [await service.create(project, argv[0], argv[1:]) for _ in range(n)]
                await _until_exec([sp.pid for sp in sps])
                t0 = time.perf_counter()
                ok = await service.kill_pid(sps[0].pid) if n == 1 else await service.kill_all()
                elapsed = time.perf_counter() - t0
                assert ok, "the service did not end every child"
                return elapsed

            return run

        def via_supervisor(engine: Engine) -> Callable[[tuple[str, ...], int], Awaitable[float]]:
            async def run(argv: tuple[str, ...], n: int) -> float:
                supervisor = engine.supervisor
                managed = await supervisor.spawn(SpawnSpec(argv=argv))
                await _until_exec([managed.pid])
                t0 = time.perf_counter()
                await supervisor.cancel(managed)
                return time.perf_counter() - t0

            return run

        async def via_supervisord(argv: tuple[str, ...], n: int) -> float:
            assert sd is not None
            program = "ignoring" if argv == IGNORING else ("coop1" if n == 1 else "coop")
            if n == 1:
                sd.rpc.supervisor.startProcess(program, True)
                pids = [sd.rpc.supervisor.getProcessInfo(program)["pid"]]
            else:
                sd.rpc.supervisor.startProcessGroup(program, True)
                pids = [i["pid"] for i in sd.rpc.supervisor.getAllProcessInfo() if i["group"] == program]
            await _until_exec(pids)
            t0 = time.perf_counter()
            if n == 1:
                sd.rpc.supervisor.stopProcess(program, True)
            else:
                sd.rpc.supervisor.stopProcessGroup(program, True)
            return time.perf_counter() - t0

        for kind, argv in (("cooperative", COOPERATIVE), ("SIGINT-ignoring", IGNORING)):
            for n in ns:
                variants: dict[str, Callable[[tuple[str, ...], int], Awaitable[float]]] = {BASE: _bare_trio}
                for mode, engine in engines.items():
                    variants[f"{'service kill_pid' if n == 1 else 'service kill_all'}|{mode}"] = via_service(
                        engine
                    )
                    if n == 1:
                        variants[f"Supervisor.cancel|{mode}"] = via_supervisor(engine)
                if sd is not None and (n == 1 or (n == GROUP_SIZE and kind == "cooperative")):
                    variants["supervisord stopProcess" if n == 1 else "supervisord stopProcessGroup"] = (
                        via_supervisord
                    )
                names = list(variants)
                samples: dict[str, list[float]] = {name: [] for name in names}
                reps = repeats[n]
                if kind == "SIGINT-ignoring" and n == 1 and sd is not None:
                    reps = min(reps, 3 if ctx.quick else 8)  # supervisord's grace is 1 s at least
                for i in range(reps):
                    for name in names[i % len(names) :] + names[: i % len(names)]:
                        samples[name].append(await variants[name](argv, n))
                rows += _rows(kind, n, samples)
                print(
                    f"  {kind} x{n}: "
                    + ", ".join(f"{k} {statistics.median(v) * 1e3:.1f} ms" for k, v in samples.items()),
                    flush=True,
                )
    return rows


def _rows(kind: str, n: int, samples: dict[str, list[float]]) -> list[Row]:
    workload = f"terminate {kind} x{n}"
    if kind == "cooperative":
        ms = {k: [s * 1e3 for s in v] for k, v in samples.items()}
        unit = "ms"
    else:  # what the escalation costs beyond its grace period (supervisord's is 1 s, ours 0.2 s)
        ms = {
            k: [(s - (1.0 if k.startswith("supervisord") else GRACE)) * 1e3 for s in v]
            for k, v in samples.items()
        }
        unit = "ms over grace"
    rows = []
    for key, values in ms.items():
        name, _, mode = key.partition("|")
        row = Row(workload, name, unit, values, mode=mode)
        if name != BASE:
            row.baseline = BASE
            row.ratios = paired(values, ms[BASE])
        else:
            row.note = "baseline: the same escalation written by hand over trio" if n == 1 else ""
        if name.startswith("service"):
            med = statistics.median(values)
            if kind == "cooperative" and n == 1:
                row.target, row.met = "p50 < 1 ms", med < 1.0
            elif kind == "cooperative" and n == 1000:
                row.target, row.met = "< 1 s", med < 1000.0
            elif kind != "cooperative" and n == 1000:
                row.target = "<= 1.5x bare over grace"
                row.met = statistics.median(row.ratios) <= 1.5
            elif kind != "cooperative":
                row.target, row.met = "grace + < 100 ms", med < 100.0
        if name.startswith("supervisord"):
            row.note = (
                "anchor stopProcess 1.76 ms"
                if kind == "cooperative" and n == 1
                else "overhead beyond its stopwaitsecs=1 (its smallest grace)"
                if kind != "cooperative"
                else "stopProcessGroup with wait"
            )
        rows.append(row)
    return rows
