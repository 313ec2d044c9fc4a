"""The retry policy (``engine/_retry.py``) under Trio's autojump clock."""

from __future__ import annotations

import errno
import logging

import pytest
import trio
import trio.testing

from engine import EngineConfig
from engine._retry import DEFAULT_RETRY_SECONDS, RetryPolicy


def test_retry_policy_last_delay_repeats() -> None:
    policy = RetryPolicy()
    assert policy.delays_seconds == DEFAULT_RETRY_SECONDS == (1.0, 5.0, 30.0, 300.0)
    assert [policy.delay_seconds(n) for n in range(1, 7)] == [1.0, 5.0, 30.0, 300.0, 300.0, 300.0]
    assert RetryPolicy([0.5]).delay_seconds(9) == 0.5


@pytest.mark.parametrize("delays", [(), (-1.0,), ("1",), (True,)])
def test_retry_policy_refuses_bad_delays(delays: tuple[object, ...]) -> None:
    with pytest.raises(ValueError, match="delays_seconds"):
        RetryPolicy(delays)  # type: ignore[arg-type]  # the wrong types are the point
    with pytest.raises(ValueError, match="watch_retry_seconds"):
        EngineConfig(watch_retry_seconds=delays)  # type: ignore[arg-type]


async def test_retry_run_waits_each_delay_then_returns(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[float] = []

    async def attempt() -> str:
        calls.append(trio.current_time())
        if len(calls) <= 5:
            raise OSError(errno.ENOSPC, "No space left on device")
        return "stored"

    logger = logging.getLogger("engine.test_retry")
    start = trio.current_time()
    assert await RetryPolicy().run("writing x", attempt, logger=logger) == "stored"
    assert [round(t - start, 6) for t in calls] == [0.0, 1.0, 6.0, 36.0, 336.0, 636.0]
    lines = [r.getMessage() for r in caplog.records if r.name == "engine.test_retry"]
    assert len(lines) == 5 and all(line.startswith("writing x failed (") for line in lines)
    assert lines[0].endswith("retrying in 1.0 s") and lines[-1].endswith("retrying in 300.0 s")


async def test_retry_run_lets_other_errors_through(autojump_clock: trio.testing.MockClock) -> None:
    calls = 0

    async def attempt() -> None:
        nonlocal calls
        calls += 1
        raise LookupError("gone")

    with pytest.raises(LookupError, match="gone"):
        await RetryPolicy().run("x", attempt)
    assert calls == 1


async def test_retry_run_after_failures_waits_first_and_uses_the_given_sleep(
    autojump_clock: trio.testing.MockClock,
) -> None:
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)
        await trio.sleep(seconds)

    tries = 0

    async def attempt() -> int:
        nonlocal tries
        tries += 1
        if tries == 1:
            raise KeyError("once more")
        return tries

    policy = RetryPolicy((2.0, 7.0), sleep=sleep)
    assert await policy.run("x", attempt, retry_on=KeyError, failures=1) == 2
    assert waits == [2.0, 7.0]  # the wait owed to the earlier failure, then the one after the first try
    waits.clear()
    tries = 0
    other: list[float] = []

    async def wake_early(seconds: float) -> None:
        other.append(seconds)
        await trio.lowlevel.checkpoint()

    assert await policy.run("x", attempt, retry_on=KeyError, sleep=wake_early) == 2
    assert other == [2.0] and waits == []


async def test_retry_run_is_cancellable_while_waiting(autojump_clock: trio.testing.MockClock) -> None:
    async def attempt() -> None:
        raise OSError("down")

    with trio.move_on_after(10) as scope:
        await RetryPolicy().run("x", attempt)
    assert scope.cancelled_caught
