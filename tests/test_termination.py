"""Escalation over the whole tree (cases.md SP-01 and SP-02) with the 5 s default grace.

The default-grace kills of one test run concurrently, each timed on its own, so the acceptance bounds are
checked without paying 5 s per case.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import trio

from engine import ManagedRun, RunExit, SpawnSpec, Supervisor, open_supervisor
from engine._procfs import scan_processes

from .children import (
    SESSION,
    ignoring_sigint,
    kill_leftovers,
    mark,
    pgrep,
    proc_exists,
    proc_state,
    py,
    wait_for_state,
    wait_for_text,
    wait_until,
)

Check = Callable[[], Awaitable[None]]


async def _timed_cancel(sup: Supervisor, run: ManagedRun) -> tuple[float, RunExit]:
    t0 = time.monotonic()
    result = await sup.cancel(run)
    return time.monotonic() - t0, result


MARKERS = {"bash": rf"301\.1{SESSION}", "python": rf"301\.2{SESSION}", "stopped": rf"301\.3{SESSION}"}


@pytest.mark.serial
async def test_cancel_default_grace_sp01_sigint_ignored_and_stopped(tmp_path: Path, containment: str) -> None:
    inputs = {
        "bash": ("bash", "-c", f"trap '' INT; echo ready; sleep {mark('301.1')}"),
        "python": ignoring_sigint(mark("301.2")),
        "stopped": py(
            "import os,signal,time; print('ready', flush=True); "
            f"os.kill(os.getpid(), signal.SIGSTOP); time.sleep({mark('301.3')})"
        ),
    }
    results: dict[str, tuple[float, RunExit, int]] = {}
    try:
        async with open_supervisor(containment=containment) as sup:
            bystander = await sup.spawn(SpawnSpec(argv=("sleep", mark("301.9"))))
            runs = {}
            for name, argv in inputs.items():
                out = tmp_path / f"{name}.out"
                runs[name] = await sup.spawn(SpawnSpec(argv=argv, stdout=str(out)))
                await wait_for_text(out, "ready")
            await wait_for_state(runs["stopped"].pid, "T")

            async def kill(name: str) -> None:
                elapsed, result = await _timed_cancel(sup, runs[name])
                results[name] = (elapsed, result, runs[name].pid)
                # Right after the call, with no sleep: gone and reaped.
                assert not pgrep(MARKERS[name])
                assert not proc_exists(runs[name].pid)

            with trio.fail_after(20):
                async with trio.open_nursery() as nursery:
                    for name in inputs:
                        nursery.start_soon(kill, name)
            assert bystander.exit is None  # the unrelated run goes on
            assert pgrep(rf"sleep 301\.9{SESSION}")
    finally:
        kill_leftovers(rf"301\.[1239]{SESSION}")
    for name, (elapsed, result, _pid) in results.items():
        assert elapsed <= 6.0, name
        if name != "stopped":
            assert elapsed >= 4.9, name
            assert result.signal == signal.SIGKILL, name
            assert result.escalated
        assert result.exit_code != 0


SP02 = {
    "a": ("bash", "-c", f"sleep {mark('302.1')} & sleep {mark('302.2')} & wait"),
    "b": ("bash", "-c", f"yes {mark('302.3')} | cat > /dev/null"),
    "c": ("bash", "-c", f"bash -c 'sleep {mark('302.4')}; echo never' & wait"),
    # The issue's own case: `&` jobs ignore SIGINT, so SIGKILL after the 5 s grace is needed.
    "issue": ("bash", "-c", f"sleep {mark('321.1')} & sleep {mark('321.2')} & wait"),
    "d": (
        "bash",
        "-c",
        f"setsid sleep {mark('302.5')} </dev/null >/dev/null 2>&1 & "
        f"setsid sh -c 'exec sleep {mark('302.6')}' & echo spawned; wait",
    ),
}


@pytest.mark.serial
async def test_cancel_default_grace_sp02_grandchildren(tmp_path: Path, containment: str) -> None:
    timings: dict[str, float] = {}
    try:
        async with open_supervisor(containment=containment) as sup:
            runs = {}
            for name, argv in SP02.items():
                out = tmp_path / f"{name}.out"
                runs[name] = await sup.spawn(SpawnSpec(argv=argv, stdout=str(out), stderr=str(out)))
            await wait_for_text(tmp_path / "d.out", "spawned")
            await wait_until(lambda: len(pgrep(rf"^sleep (302\.[12456]|321\.[12]){SESSION}")) >= 7)
            assert pgrep(rf"sleep 302\.5{SESSION}") and pgrep(rf"sleep 302\.6{SESSION}")
            sleeps = pgrep(rf"^sleep 321\.[12]{SESSION}")
            assert len(sleeps) == 2

            async def kill(name: str) -> None:
                elapsed, result = await _timed_cancel(sup, runs[name])
                timings[name] = elapsed
                assert result.survivors == ()

            with trio.fail_after(20):
                async with trio.open_nursery() as nursery:
                    for name in SP02:
                        nursery.start_soon(kill, name)
            assert not pgrep(rf"30[2]\.[1-6]{SESSION}")
            assert not pgrep(rf"321\.[12]{SESSION}")
            assert not any(proc_exists(p) for p in [*sleeps, *(r.pid for r in runs.values())])
            assert sup.runs() == []  # the engine is alive and answers
    finally:
        kill_leftovers(rf"302\.[1-6]{SESSION}|321\.[12]{SESSION}")
    assert timings["b"] <= 1.5
    for name in ("a", "c", "d", "issue"):
        assert timings[name] <= 6.0
    assert timings["issue"] >= 5.0  # SIGKILL after the full grace
    assert os.getpgid(0) == os.getpgrp()  # our own group was never signalled (we are still here)


async def test_cancel_group_leaves_no_reparented_survivor(containment: str) -> None:
    async with open_supervisor(containment=containment, grace_seconds=0.3) as sup:
        argv = ("bash", "-c", f"sleep {mark('321.1')} & sleep {mark('321.2')} & wait")
        run = await sup.spawn(SpawnSpec(argv=argv))
        await wait_until(lambda: len(pgrep(rf"^sleep 321\.[12]{SESSION}")) == 2)
        with trio.fail_after(10):
            result = await sup.cancel(run)
    assert result.escalated
    assert not pgrep(rf"sleep 321\.[12]{SESSION}")


async def test_cancel_setsid_escapee_is_ended(supervisor: Supervisor) -> None:
    run = await supervisor.spawn(SpawnSpec(argv=("bash", "-c", f"setsid sleep {mark('321.3')} & wait")))
    await wait_until(lambda: bool(pgrep(rf"sleep 321\.3{SESSION}")))
    with trio.fail_after(10):
        await supervisor.cancel(run)
    assert not pgrep(rf"sleep 321\.3{SESSION}")


@pytest.mark.parametrize("subreaper", [True, False])
async def test_cancel_double_forked_daemon_found_by_marker(subreaper: bool, containment: str) -> None:
    async with open_supervisor(containment=containment, grace_seconds=0.3, subreaper=subreaper) as sup:
        run = await sup.spawn(
            SpawnSpec(
                argv=("bash", "-c", f"(setsid sleep {mark('321.4')} &) ; echo forked; sleep {mark('321.5')}")
            )
        )
        await wait_until(lambda: bool(pgrep(rf"sleep 321\.4{SESSION}")))
        with trio.fail_after(10):
            await sup.cancel(run)
    try:
        assert not pgrep(rf"sleep 321\.[45]{SESSION}")
    finally:
        kill_leftovers(rf"sleep 321\.[45]{SESSION}")


async def test_leader_exit_racing_setsid_child_leaves_nothing(supervisor: Supervisor) -> None:
    # The child may call setsid() after it was seen as a group member: it is still tracked by pid.
    runs = [
        await supervisor.spawn(SpawnSpec(argv=("bash", "-c", f"setsid sleep {mark(f'338.{n}')} & exit 0")))
        for n in range(1, 21)
    ]
    try:
        with trio.fail_after(20):
            for run in runs:
                await run.wait()
        assert not pgrep(rf"^sleep 338\.[0-9]+{SESSION}")
    finally:
        kill_leftovers(rf"sleep 338\.[0-9]+{SESSION}")


DOUBLE_FORK = (
    "import os,time\n"
    "if os.fork()==0:\n"
    "    os.setsid()\n"
    f"    if os.fork()==0: time.sleep({mark('339.1')}); os._exit(0)\n"
    "    os._exit(0)\n"
    "time.sleep(0.3)"
)


@pytest.mark.parametrize(
    "argv",
    [
        py(DOUBLE_FORK),
        ("bash", "-c", f"(setsid bash -c 'sleep {mark('339.2')} & exit' &) ; sleep 0.3"),
    ],
)
async def test_leader_exit_reaps_adopted_zombies_of_double_fork(
    supervisor: Supervisor, argv: tuple[str, ...]
) -> None:
    me = os.getpid()
    # Zombies an earlier test of this process left (a Popen it did not wait for) are not this run's.
    before = {p.pid for p in scan_processes() if p.ppid == me and p.zombie}
    run = await supervisor.spawn(SpawnSpec(argv=argv))
    try:
        with trio.fail_after(10):
            await run.wait()
        zombies = [p for p in scan_processes() if p.ppid == me and p.zombie and p.pid not in before]
        assert zombies == []  # the middle process of the double fork was reaped, not left defunct
        # The sleeps, and the Python grandchild too (a forked child keeps its parent's argv).
        assert not pgrep(rf"339\.[12]{SESSION}")
    finally:
        kill_leftovers(rf"339\.[12]{SESSION}")


async def test_a_held_look_answers_alive_without_a_waitpid_until_dropped(supervisor: Supervisor) -> None:
    """``hold_leader_look`` (a batch driver's pass, synchronous: no task runs meanwhile): one look, then
    the leader counts as alive, though it has exited since (it stays a zombie, unreaped); once the look is
    dropped, the run's own look reaps it and the run ends as a kill."""
    marker = mark("7777.1")
    try:
        run = await supervisor.spawn(SpawnSpec(argv=("sleep", marker)))
        tree = run._tree
        tree.hold_leader_look()
        os.kill(run.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10.0
        while proc_state(run.pid) != "Z":  # no checkpoint: the run's own task does not look meanwhile
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert tree.poll_leader() is False and tree.status is None
        assert proc_state(run.pid) == "Z"  # not reaped by the held look
        tree.drop_leader_look()  # the run's own task, waiting on the pidfd, reaps it now
        with trio.fail_after(10):
            exit = await run.wait()
        assert exit.signal == signal.SIGKILL
    finally:
        kill_leftovers(rf"^sleep {marker}")
