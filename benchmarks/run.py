"""Run every benchmark workload and write ``docs/benchmarks/results.md``, ``.json`` and ``.png``.

Usage (from the repository root, after ``.venv/bin/pip install -e '.[bench]'``)::

    .venv/bin/python -m benchmarks.run                 # the full run (about 10 minutes on 2 cores)
    .venv/bin/python -m benchmarks.run --quick         # a smoke run (well under a minute)
    .venv/bin/python -m benchmarks.run --only spawn,terminate --log-bytes 256MiB

The run fails when supervisord cannot be started, unless ``--no-supervisord`` is given. It waits for a
quiet machine first: while the 1-minute load average is above ``--max-load`` (1.0), it waits (up to
``--quiet-wait`` seconds) and looks again; the load at the start and end of the run and of each workload
is recorded. The spawn, terminate and scale workloads run in every containment mode the machine has
(``cgroup`` where a cgroup v2 hierarchy is writable, and ``process-group``), side by side.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable

import trio

from . import cron, fleet, logs, report, scale, spawn, terminate, tool_log
from ._common import (
    Context,
    GiB,
    MiB,
    Row,
    containment_modes,
    cpu_probe_ms,
    file_allocation_us,
    loadavg,
    machine,
    spread_folders,
    wait_files_quiet,
    wait_quiet,
)
from ._supervisord import Supervisord

WORKLOADS: dict[str, Callable[[Context], Awaitable[list[Row]]]] = {
    "spawn": spawn.run,
    "terminate": terminate.run,
    "logs": logs.run,
    "scale": scale.run,
    "cron": cron.run,
    "tool-log": tool_log.run,
    "fleet": fleet.run,
}

_SUFFIXES = {"k": 2**10, "kib": 2**10, "m": MiB, "mib": MiB, "g": GiB, "gib": GiB, "": 1, "b": 1}


def parse_size(text: str) -> int:
    """``"1GiB"``, ``"256M"``, ``"1048576"`` -> bytes."""
    t = text.strip().lower()
    digits = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    suffix = t[len(digits) :]
    if suffix not in _SUFFIXES or not digits:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 1GiB, 256MiB, 1048576)")
    return int(float(digits) * _SUFFIXES[suffix])


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="few rounds and small sizes: a smoke run")
    p.add_argument(
        "--only",
        default=",".join(WORKLOADS),
        help=f"comma-separated workloads (default: all of {', '.join(WORKLOADS)})",
    )
    p.add_argument(
        "--log-bytes",
        type=parse_size,
        default=None,
        help="bytes the log-throughput child writes (default 1GiB, 32MiB with --quick)",
    )
    p.add_argument("--no-supervisord", action="store_true", help="skip the supervisord rows")
    p.add_argument("--no-plot", action="store_true", help="do not draw results.png (no matplotlib needed)")
    p.add_argument("--out", default=os.path.join("docs", "benchmarks"), help="output directory")
    p.add_argument("--tmp", default=None, help="scratch directory (default: a new one under $TMPDIR)")
    p.add_argument(
        "--max-load",
        type=float,
        default=1.0,
        help="wait until the 1-minute load average is at most this before starting (default 1.0)",
    )
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=None,
        help=(
            "seconds to wait for --max-load at most (default 900, 0 with --quick); then run anyway, noted. "
            "Each workload also waits (up to 120 s of it) for a quiet filesystem in the scratch directory"
        ),
    )
    p.add_argument(
        "--modes",
        default=None,
        help="comma-separated containment modes (default: every mode this machine has)",
    )
    return p


async def _main(
    ctx: Context,
    names: list[str],
    loads: dict[str, list[str]],
    files: dict[str, list[str]],
    cpus: dict[str, list[str]],
) -> list[Row]:
    rows: list[Row] = []
    for name in names:
        # A quiet disk and filesystem first, as a quiet CPU: the last workload's data written back (the
        # log workload leaves gigabytes to write: every fsync waits behind them), and its clean-up
        # (thousands of files deleted), which slows every file allocated near it for 60 s and up to
        # 6 minutes (``file_allocation_us``).
        await trio.to_thread.run_sync(os.sync)
        probe = ctx.scratch(f"fs-probe-{name}")
        allocation, waited = await trio.to_thread.run_sync(wait_files_quiet, probe, ctx.quiet_wait_seconds)
        t0 = time.perf_counter()
        start = loadavg()
        cpu_start = cpu_probe_ms()
        print(
            f"[{name}] running (load {start}; a file allocation {allocation:.0f} us, after {waited:.0f} s; "
            f"the CPU probe {cpu_start:.1f} ms)",
            flush=True,
        )
        rows += await WORKLOADS[name](ctx)
        loads[name] = [start.split()[0], loadavg().split()[0]]
        cpus[name] = [f"{cpu_start:.1f}", f"{cpu_probe_ms():.1f}"]
        files[name] = [f"{allocation:.0f}", f"{file_allocation_us(probe):.0f}", f"{waited:.0f}"]
        print(f"[{name}] done in {time.perf_counter() - t0:.1f} s", flush=True)
    return rows


def _default_signals() -> list[str]:
    """Give SIGINT and SIGQUIT back their default actions where this process was started with them
    ignored (a background job of a non-interactive shell, ``nohup``); the signals whose action changed.

    The baselines' children (``trio.lowlevel.open_process``, ``Popen``, supervisord's) inherit what is
    ignored, as a shell's children do: with SIGINT ignored, a cooperative ``sleep`` outlived its SIGINT
    and every bare baseline of the terminate workload waited the whole grace period (201 ms against
    0.3 ms), while the engine, which resets every signal in its children, did not.
    """
    changed: list[str] = []
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        changed.append("SIGINT")
    if signal.getsignal(signal.SIGQUIT) == signal.SIG_IGN:
        signal.signal(signal.SIGQUIT, signal.SIG_DFL)
        changed.append("SIGQUIT")
    return changed


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    restored = _default_signals()
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        print(
            f"unknown workload(s): {', '.join(unknown)}; choose from {', '.join(WORKLOADS)}", file=sys.stderr
        )
        return 2
    log_bytes = args.log_bytes if args.log_bytes is not None else (32 * MiB if args.quick else GiB)
    notes: list[str] = []
    modes, why = containment_modes()
    if args.modes is not None:
        asked = tuple(m.strip() for m in args.modes.split(",") if m.strip())
        missing = [m for m in asked if m not in modes]
        if missing:
            print(f"containment mode(s) not available here: {', '.join(missing)} ({why})", file=sys.stderr)
            return 2
        modes = asked
    elif why:
        notes.append(f"cgroup rows skipped: {why}")
    if restored:
        notes.append(f"{' and '.join(restored)} set back to the default action (started ignored)")
    quiet_wait = args.quiet_wait if args.quiet_wait is not None else (0.0 if args.quick else 900.0)
    load_now, waited = wait_quiet(args.max_load, quiet_wait)
    if waited >= 1:
        print(f"waited {waited:.0f} s for a 1-minute load average <= {args.max_load}", flush=True)
    if load_now > args.max_load:
        notes.append(
            f"the 1-minute load average was {load_now:.2f} at the start (above {args.max_load}) after "
            f"waiting {waited:.0f} s for a quieter machine: ratios are less steady than usual"
        )
    tmp = tempfile.mkdtemp(prefix="gadget-bench-", dir=args.tmp)
    notes.append(spread_folders(tmp))
    started = datetime.datetime.now(datetime.UTC)
    load_start = loadavg()
    t0 = time.perf_counter()
    sd: Supervisord | None = None
    loads: dict[str, list[str]] = {}
    files: dict[str, list[str]] = {}
    cpus: dict[str, list[str]] = {}
    try:
        if "logs" in names:
            logs.check_disk(tmp, log_bytes)
        if not args.no_supervisord:
            sd = Supervisord(tempfile.mkdtemp(prefix="supervisord-", dir=tmp), min(log_bytes, logs.SD_MAX))
            sd.start()  # raises: the run fails when supervisord cannot start
        else:
            notes.append("supervisord rows skipped (--no-supervisord)")
        ctx = Context(
            quick=args.quick,
            log_bytes=log_bytes,
            tmp=tmp,
            supervisord=sd,
            notes=notes,
            modes=modes,
            quiet_wait_seconds=min(quiet_wait, 120.0),  # per workload
        )
        rows = trio.run(_main, ctx, names, loads, files, cpus)
        meta: dict[str, object] = {
            "command": " ".join(["python -m benchmarks.run", *(argv if argv is not None else sys.argv[1:])]),
            "mode": "quick" if args.quick else "full",
            "started": started.strftime("%Y-%m-%d %H:%M UTC"),
            "duration": f"{time.perf_counter() - t0:.0f} s",
            "machine": machine(tmp),
            "load_start": load_start,
            "load_end": loadavg(),
            "workload_loads": loads,
            "workload_files": files,
            "workload_cpu_probe": cpus,
            "waited_for_quiet": f"{waited:.0f} s",
            "modes": list(modes),
            "notes": notes,
        }
        for path in report.write_all(rows, meta, args.out, with_plot=not args.no_plot):
            print(f"wrote {path}")
        for n in notes:
            print(f"note: {n}")
        return 0
    except Exception:
        traceback.print_exc()
        print("benchmark run FAILED", file=sys.stderr)
        return 1
    finally:
        if sd is not None:
            sd.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
