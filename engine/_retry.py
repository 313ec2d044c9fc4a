"""One retry policy: how long to wait between attempts, and the one loop that tries, logs, waits, tries again.

Every back-off of the engine goes through :meth:`RetryPolicy.run`: the cron service persisting a run and
recording or acknowledging a fire, its timer after a store failure, the redelivery of events ``on_fire``
refused, and the exit watchers' spawn and persist. The waits are a short list whose last entry repeats
(by default 1 s, 5 s, 30 s, then every 5 min, as systemd's ``RestartSec`` steps or APScheduler 4's
``RetrySettings`` do), and the wait itself is a function, so tests under Trio's autojump clock (or a
caller that must also wake on an event) choose how to wait.

Written here rather than taken from tenacity: the engine needs a fixed list of delays, one log line per
failure on the caller's logger, a wait that can return early, and nothing else; that is one short loop,
with Trio's cancellation semantics untouched (a cancelled wait or attempt simply raises ``Cancelled``).
No jitter: one engine retries a handful of things against its own disk, there is no herd to spread.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import TypeVar

import attrs
import trio

__all__ = ["DEFAULT_RETRY_SECONDS", "RetryPolicy", "check_delays"]

_T = TypeVar("_T")

#: The default waits between attempts, in seconds; the last one repeats.
DEFAULT_RETRY_SECONDS: tuple[float, ...] = (1.0, 5.0, 30.0, 300.0)

_logger = logging.getLogger("engine")


def check_delays(
    _inst: object, attribute: attrs.Attribute[tuple[float, ...]], value: tuple[float, ...]
) -> None:
    """The ``attrs`` validator of a list of waits: one or more numbers of seconds >= 0."""
    if not value or not all(isinstance(d, int | float) and not isinstance(d, bool) and d >= 0 for d in value):
        raise ValueError(f"{attribute.name} must be one or more waits in seconds >= 0, got {value!r}")


def _to_delays(value: Iterable[float]) -> tuple[float, ...]:
    return tuple(value)


@attrs.frozen
class RetryPolicy:
    """Waits between the attempts of something that must eventually succeed.

    Attributes:
        delays_seconds: the wait after the first, second, ... failure, in seconds; the last one repeats.
        sleep: how to wait (``trio.sleep``; a test or a caller may pass another).
    """

    delays_seconds: tuple[float, ...] = attrs.field(
        default=DEFAULT_RETRY_SECONDS, converter=_to_delays, validator=check_delays
    )
    sleep: Callable[[float], Awaitable[object]] = trio.sleep

    def delay_seconds(self, failures: int) -> float:
        """The wait after ``failures`` failed attempts in a row (``failures >= 1``), in seconds."""
        return float(self.delays_seconds[min(max(failures, 1), len(self.delays_seconds)) - 1])

    async def run(
        self,
        what: str,
        attempt: Callable[[], Awaitable[_T]],
        *,
        retry_on: type[BaseException] | tuple[type[BaseException], ...] = OSError,
        logger: logging.Logger = _logger,
        failures: int = 0,
        sleep: Callable[[float], Awaitable[object]] | None = None,
    ) -> _T:
        """Await ``attempt()`` until it returns; after each failure, log it and wait the next delay.

        Only the ``retry_on`` exceptions are retried; any other propagates at once.

        Cancellation: a cancelled attempt or wait raises ``Cancelled``; nothing more is tried.

        Args:
            what: what is attempted, for the log (``"cron job ab12: persisting its run"``).
            attempt: the attempt; called again after every failure.
            retry_on: the exception types that count as a failure to retry.
            logger: where each failure is logged, at ERROR.
            failures: failures already counted before this call (``> 0``: wait before the first attempt,
                as when a failed hand-over schedules a later one).
            sleep: how to wait this time (``None``: :attr:`sleep`), e.g. a wait that ends early.

        Returns:
            What the first successful attempt returned.
        """
        wait = sleep if sleep is not None else self.sleep
        if failures > 0:
            await wait(self.delay_seconds(failures))
        while True:
            try:
                return await attempt()
            except retry_on as exc:
                failures += 1
                delay = self.delay_seconds(failures)
                logger.error("%s failed (%s); retrying in %s s", what, exc, delay)
                await wait(delay)
