"""Restart policies (issue 18): the decision core (``engine/_restart.py``) under Hypothesis, then the
service on real processes: restarts up to the crash loop, ``always``, kill and halt never restart, the
first pid still answers, the marker lines in both logs, the tool's list line."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from engine import RestartPolicy, RunState, SubProcessNotFoundError
from engine._restart import MAX_BACKOFF_SECONDS, RestartTracker

from .children import kill_leftovers, mark, pgrep, wait_until
from .service_support import engine_at, make_project

# ---- the core --------------------------------------------------------------------------------------------

exits = st.tuples(
    st.one_of(st.none(), st.integers(0, 3)),  # exit code (None: a signal)
    st.booleans(),  # asked for (kill, halt, stop)
    st.floats(0.0, 90.0),  # seconds since the previous exit
)
policies = st.builds(
    RestartPolicy,
    mode=st.sampled_from(["no", "on-failure", "always"]),
    max_restarts=st.integers(0, 6),
    window_seconds=st.floats(0.5, 120.0),
    backoff_seconds=st.floats(0.0, 40.0),
)


@given(policy=policies, history=st.lists(exits, max_size=30))
def test_restart_decisions_follow_the_policy(
    policy: RestartPolicy, history: list[tuple[int | None, bool, float]]
) -> None:
    tracker = RestartTracker(policy)
    now = 0.0
    restart_times: list[float] = []
    for code, asked, gap in history:
        now += gap
        signal = 9 if code is None else None
        decision = tracker.decide(exit_code=code, signal=signal, asked=asked, now=now)
        failed = code != 0
        if asked or policy.mode == "no" or (policy.mode == "on-failure" and not failed):
            assert not decision.restart and decision.status is None
            continue
        if policy.max_restarts == 0:  # the plain exit
            assert not decision.restart and decision.status is None
            continue
        in_window = [t for t in restart_times if now - t < policy.window_seconds]
        if len(in_window) >= policy.max_restarts:
            assert not decision.restart
            assert decision.status == f"crash loop: {len(in_window)} restarts in {policy.window_seconds:g} s"
            break  # the service stops following the record
        assert decision.restart
        assert decision.delay_seconds == min(
            policy.backoff_seconds * 2 ** len(in_window), MAX_BACKOFF_SECONDS
        )
        assert decision.delay_seconds <= MAX_BACKOFF_SECONDS
        restart_times.append(now)
        assert len([t for t in restart_times if now - t < policy.window_seconds]) <= policy.max_restarts
    assert tracker.restarts == len(restart_times)


def test_restart_policy_refuses_bad_values() -> None:
    with pytest.raises(ValueError, match="mode"):
        RestartPolicy(mode="sometimes")
    with pytest.raises(ValueError, match="max_restarts"):
        RestartPolicy(mode="always", max_restarts=-1)
    with pytest.raises(ValueError, match="window_seconds"):
        RestartPolicy(mode="always", window_seconds=0)
    with pytest.raises(ValueError, match="backoff_seconds"):
        RestartPolicy(mode="always", backoff_seconds=float("nan"))
    assert RestartPolicy("on-failure").to_dict() == {
        "mode": "on-failure",
        "max_restarts": 5,
        "window": 60.0,
        "backoff": 1.0,
    }


# ---- the service, on real processes ---------------------------------------------------------------------

FAST: dict[str, Any] = {"window_seconds": 60.0, "backoff_seconds": 0.01}


async def test_on_failure_restarts_until_the_crash_loop_stop(tmp_path: Path) -> None:
    project = make_project(tmp_path)
    async with engine_at(tmp_path) as engine:
        service = engine.service
        sp = await service.create(
            project,
            "bash",
            ["-c", "echo run; echo oops >&2; exit 3"],
            restart=RestartPolicy("on-failure", max_restarts=3, **FAST),
        )
        first = sp.first_pid
        with trio.fail_after(20):
            summary = await service.wait(first)
        assert summary.restarts == 3  # it ran max_restarts + 1 times
        assert summary.status == "crash loop: 3 restarts in 60 s"
        assert (summary.exit_code, summary.first_pid, summary.last_exit) == (3, first, "exited 3")
        assert summary.pid != first and summary.stdout_path.endswith(f"subproc-{first}.stdout.log")
        markers = [f"--- restarted (exit 3), restart {n} of 3 ---" for n in (1, 2, 3)]
        out = (await service.get_log(first, "stdout")).splitlines()
        err = (await service.get_log(first, "stderr")).splitlines()
        assert out == ["run", markers[0], "run", markers[1], "run", markers[2], "run"]
        assert err == ["oops", markers[0], "oops", markers[1], "oops", markers[2], "oops"]
        assert service.lookup(summary.pid) is sp and service.lookup(first) is sp


async def test_always_restarts_after_exit_0_and_on_failure_does_not(tmp_path: Path) -> None:
    project = make_project(tmp_path)
    async with engine_at(tmp_path) as engine:
        service = engine.service
        always = await service.create(
            project, "true", restart=RestartPolicy("always", max_restarts=2, **FAST)
        )
        failure = await service.create(project, "true", restart=RestartPolicy("on-failure", **FAST))
        with trio.fail_after(20):
            done = await service.wait(always.first_pid)
            once = await service.wait(failure.first_pid)
        assert (done.restarts, done.status) == (2, "crash loop: 2 restarts in 60 s")
        assert (once.restarts, once.status) == (0, "exited 0")


@pytest.mark.parametrize("how", ["kill", "halt"])
async def test_kill_and_halt_never_restart(tmp_path: Path, how: str) -> None:
    project = make_project(tmp_path)
    marker = mark("74.1" if how == "kill" else "74.2")
    try:
        async with engine_at(tmp_path) as engine:
            service = engine.service
            sp = await service.create(project, "sleep", [marker], restart=RestartPolicy("always", **FAST))
            await wait_until(lambda: bool(pgrep(marker)))
            stopped = await (service.kill_pid(sp.pid) if how == "kill" else service.halt_pid(sp.pid))
            assert stopped
            await trio.sleep(0.5)  # more than the back-off: nothing comes back
            assert not pgrep(marker)
            assert sp.restarts == 0 and sp.finished
            if how == "halt":
                assert (
                    service.summarize(sp).status.startswith("killed by signal") or sp.state is RunState.EXITED
                )
            else:
                with pytest.raises(SubProcessNotFoundError):
                    service.lookup(sp.first_pid)
    finally:
        kill_leftovers(marker)


async def test_a_kill_during_the_back_off_calls_the_restart_off(tmp_path: Path) -> None:
    project = make_project(tmp_path)
    async with engine_at(tmp_path) as engine:
        service = engine.service
        sp = await service.create(
            project, "bash", ["-c", "exit 1"], restart=RestartPolicy("on-failure", backoff_seconds=30.0)
        )
        await wait_until(lambda: (service.summarize(sp).status or "").startswith("restarting in 30 s"))
        assert not await service.halt_subprocess(sp)  # it had exited; the restart is called off
        with trio.fail_after(5):
            summary = await service.wait(sp.first_pid)
        assert (summary.restarts, summary.status) == (0, "exited 1")


async def test_the_first_pid_still_answers_kill_and_list_shows_the_current_one(tmp_path: Path) -> None:
    project = make_project(tmp_path)
    marker = mark("74.3")
    flag = tmp_path / "crashed-once"
    script = f"if [ ! -e {flag} ]; then touch {flag}; exit 1; fi; exec sleep {marker}"
    try:
        async with engine_at(tmp_path) as engine:
            service = engine.service
            sp = await service.create(
                project, "bash", ["-c", script], restart=RestartPolicy("on-failure", **FAST)
            )
            first = sp.first_pid
            await wait_until(lambda: sp.restarts == 1 and sp.running)
            assert sp.pid != first and pgrep(marker) == [sp.pid]
            listing = await engine.tool.execute({"cmd": "list"}, project)
            assert f"pid: {sp.pid} | project: project |" in listing
            assert listing.endswith(
                f" | status: running | restarts: 1 | first pid: {first} | last exit: exited 1"
            )
            killed = await engine.tool.execute({"cmd": "kill", "pid": first}, project)
            assert killed == f"SUBPROCESS KILLED\npid: {sp.pid}"
            assert not pgrep(marker)
            assert not os.path.exists(sp.stdout_path)
    finally:
        kill_leftovers(marker)
