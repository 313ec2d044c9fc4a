"""The tool's ``log`` of a big log with the default budget (last 200 lines within 32 KiB): latency and
bytes returned, next to ``tail -n 200`` of the same file."""

from __future__ import annotations

import statistics
import subprocess
import time

from engine import EngineConfig, Project, open_engine

from ._common import Context, MiB, Row, paired


def _tail(path: str) -> int:
    return len(subprocess.run(["tail", "-n", "200", path], capture_output=True, check=True).stdout)


async def run(ctx: Context) -> list[Row]:
    size = 5 * MiB if ctx.quick else 50 * MiB
    repeats = 10 if ctx.quick else 40
    config = EngineConfig(state_dir=ctx.scratch("toollog-state"))
    project = Project.from_directory(ctx.scratch("toollog-project"))
    line = "2026-01-01T00:00:00Z INFO request served in 12 ms, path=/api/items?page=7 status=200"
    lat, tail_lat, returned, tail_bytes = [], [], [], []
    cold, cold_tail = [], []
    async with open_engine(config) as engine:
        for _ in range(3):  # the first call on a log counts its lines once (cold)
            fresh = await engine.service.create(project, "sh", ["-c", f"yes '{line}' | head -c {size}"])
            await fresh.wait()
            t0 = time.perf_counter()
            await engine.tool.execute({"cmd": "log", "pid": fresh.pid, "which": "stdout"}, project)
            cold.append((time.perf_counter() - t0) * 1e3)
            t0 = time.perf_counter()
            _tail(fresh.stdout_path)
            cold_tail.append((time.perf_counter() - t0) * 1e3)
            await engine.service.kill_subprocess(fresh)
        sp = await engine.service.create(project, "sh", ["-c", f"yes '{line}' | head -c {size}"])
        await sp.wait()
        params = {"cmd": "log", "pid": sp.pid, "which": "stdout"}
        for i in range(repeats):
            order = ("tool", "tail") if i % 2 == 0 else ("tail", "tool")
            for which in order:
                t0 = time.perf_counter()
                if which == "tool":
                    text = await engine.tool.execute(params, project)
                    lat.append((time.perf_counter() - t0) * 1e3)
                    assert text.startswith("SUBPROCESS LOG (stdout)"), text[:200]
                    returned.append(len(text.encode()) / 1024)
                else:
                    tail_bytes.append(_tail(sp.stdout_path) / 1024)
                    tail_lat.append((time.perf_counter() - t0) * 1e3)
        await engine.service.kill_subprocess(sp)
    workload = f"tool log of a {size // MiB} MiB log, default budget"
    return [
        Row(
            workload,
            "SubprocessTool.execute log",
            "ms",
            lat,
            "tail -n 200 (a process)",
            paired(lat, tail_lat),
            target="<= 2x tail",
            met=statistics.median(paired(lat, tail_lat)) <= 2.0,
            note="the tool's whole call: read the last lines, count the lines (LogSlice.total_lines), "
            "format; the log's lines were counted by an earlier call (its first, below)",
        ),
        Row(
            workload,
            "SubprocessTool.execute log, first call on the log",
            "ms",
            cold,
            "tail -n 200 (a process)",
            paired(cold, cold_tail),
            note="counts the lines of the whole file once; later calls count only what was appended",
        ),
        Row(workload, "tail -n 200 (a process)", "ms", tail_lat),
        Row(
            workload,
            "bytes returned by the tool",
            "KiB",
            returned,
            "bytes of tail -n 200",
            paired(returned, tail_bytes),
            target="<= 32 KiB + header",
            met=max(returned) <= 33,
        ),
        Row(workload, "bytes of tail -n 200", "KiB", tail_bytes),
    ]
