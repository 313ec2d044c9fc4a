"""Spawn-to-exit of ``true``: the service, the supervisor, bare trio, subprocess.Popen and supervisord.

Every round runs each variant once, in a rotating order, so drift and background load hit them alike;
ratios are medians over blocks of rounds (one ratio per block).
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Awaitable, Callable

import trio

from engine import EngineConfig, Project, SpawnSpec, open_engine

from ._common import Context, Row, block_ratios

TRUE = "/bin/true"
WORKLOAD = "spawn-to-exit of `true`"


def _popen_true() -> None:
    subprocess.Popen([TRUE]).wait()


async def run(ctx: Context) -> list[Row]:
    rounds = 60 if ctx.quick else 400
    blocks = 5 if ctx.quick else 10
    project_dir = ctx.scratch("spawn-project")
    config = EngineConfig(state_dir=ctx.scratch("spawn-state"))
    async with open_engine(config) as engine:
        project = Project.from_directory(project_dir)

        async def service() -> None:
            sp = await engine.service.create(project, TRUE)
            await sp.wait()

        async def supervisor() -> None:
            run = await engine.supervisor.spawn(SpawnSpec(argv=(TRUE,)))
            await run.wait()

        async def bare_trio() -> None:
            proc = await trio.lowlevel.open_process([TRUE])
            await proc.wait()

        async def popen() -> None:
            _popen_true()
            await trio.lowlevel.checkpoint()

        variants: dict[str, Callable[[], Awaitable[None]]] = {
            "SubProcessService.create + wait": service,
            "Supervisor.spawn + wait": supervisor,
            "trio.lowlevel.open_process": bare_trio,
            "subprocess.Popen": popen,
        }
        sd = ctx.supervisord
        if sd is not None:

            async def supervisord() -> None:
                sd.run_to_exit("true")
                await trio.lowlevel.checkpoint()

            variants["supervisord startProcess"] = supervisord
        samples: dict[str, list[float]] = {name: [] for name in variants}
        names = list(variants)
        for _warm in range(10):
            for name in names:
                await variants[name]()
        await engine.service.kill_all()
        for i in range(rounds):
            order = names[i % len(names) :] + names[: i % len(names)]
            for name in order:
                t0 = time.perf_counter()
                await variants[name]()
                samples[name].append(time.perf_counter() - t0)
            if i % 50 == 49:  # drop the finished records (and their logs) outside the timed part
                await engine.service.kill_all()
        await engine.service.kill_all()

    ms = {name: [s * 1e3 for s in values] for name, values in samples.items()}
    trio_ms = ms["trio.lowlevel.open_process"]
    rows = [
        Row(
            WORKLOAD,
            "subprocess.Popen",
            "ms",
            ms["subprocess.Popen"],
            "trio.lowlevel.open_process",
            block_ratios(ms["subprocess.Popen"], trio_ms, blocks),
            note="anchor 0.53 ms",
        ),
        Row(WORKLOAD, "trio.lowlevel.open_process", "ms", trio_ms, note="baseline; anchor 0.67 ms"),
        Row(
            WORKLOAD,
            "Supervisor.spawn + wait",
            "ms",
            ms["Supervisor.spawn + wait"],
            "trio.lowlevel.open_process",
            block_ratios(ms["Supervisor.spawn + wait"], trio_ms, blocks),
        ),
    ]
    svc = ms["SubProcessService.create + wait"]
    svc_row = Row(
        WORKLOAD,
        "SubProcessService.create + wait",
        "ms",
        svc,
        "trio.lowlevel.open_process",
        block_ratios(svc, trio_ms, blocks),
        target="<= 1.0x trio",
        note="includes creating and renaming two log files",
    )
    svc_row.met = sorted(svc_row.ratios)[len(svc_row.ratios) // 2] <= 1.0
    rows.insert(0, svc_row)
    if "supervisord startProcess" in ms:
        sdv = ms["supervisord startProcess"]
        rows.append(
            Row(
                WORKLOAD,
                "supervisord startProcess",
                "ms",
                sdv,
                "trio.lowlevel.open_process",
                block_ratios(sdv, trio_ms, blocks),
                note="anchor 6.4 ms; XML-RPC start, then getProcessInfo until EXITED",
            )
        )
        speedup = block_ratios(sdv, svc, blocks)
        rows.append(
            Row(
                WORKLOAD,
                "service speed-up over supervisord",
                "x",
                speedup,
                "supervisord startProcess",
                speedup,
                target=">= 10x",
                met=sorted(speedup)[len(speedup) // 2] >= 10,
                note="supervisord time / service time (higher is better)",
            )
        )
    return rows
