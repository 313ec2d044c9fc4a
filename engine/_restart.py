"""Restart policies: whether a subprocess that exited comes back, after how long, and when to give up.

The decisions are made here, synchronously and without I/O, by :class:`RestartTracker` (the service's
async part only sleeps, respawns and writes the marker lines). The rules, as supervisord's
``autorestart`` and systemd's ``Restart=`` / ``StartLimitBurst=`` have them, with pm2's doubling back-off:

- ``"no"`` never restarts; ``"on-failure"`` restarts after a non-zero exit or a signal the engine did not
  send; ``"always"`` after any exit of the process's own. An end asked for (a kill, a halt, the engine's
  stop) never restarts; neither does anything the guardian or the start-up sweep ends (no engine runs
  then).
- **Crash loop**: when ``max_restarts`` restarts already happened within the last ``window_seconds``, one
  more exit stops restarting, with the status ``crash loop: N restarts in S s``.
- **Back-off**: the n-th restart within the window waits ``backoff_seconds * 2**(n-1)``, at most
  :data:`MAX_BACKOFF_SECONDS`; a process that ran longer than the window starts again from
  ``backoff_seconds`` (its earlier restarts have left the window).
"""

from __future__ import annotations

import math
from typing import Final, Literal, final

import attrs

__all__ = ["MAX_BACKOFF_SECONDS", "RESTART_MODES", "RestartDecision", "RestartPolicy", "RestartTracker"]

#: The longest wait before a restart, in seconds.
MAX_BACKOFF_SECONDS: Final = 60.0
#: The modes of a :class:`RestartPolicy`.
RESTART_MODES: Final = ("no", "on-failure", "always")
#: The most restarts a policy may allow within its window.
MAX_RESTARTS: Final = 1000

RestartMode = Literal["no", "on-failure", "always"]


def _seconds(minimum: float, *, strict: bool) -> attrs._ValidatorType[float]:
    def check(_inst: object, attribute: attrs.Attribute[float], value: float) -> None:
        ok = (
            not isinstance(value, bool)
            and isinstance(value, int | float)
            and math.isfinite(value)
            and (value > minimum if strict else value >= minimum)
        )
        if not ok:
            sign = ">" if strict else ">="
            raise ValueError(
                f"{attribute.name} must be a finite number of seconds {sign} {minimum:g}, got {value!r}"
            )

    return check


def _max_restarts(_inst: object, _attr: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_RESTARTS:
        raise ValueError(f"max_restarts must be a whole number from 0 to {MAX_RESTARTS}, got {value!r}")


@attrs.frozen
class RestartPolicy:
    """When a subprocess that exited on its own is started again (see the module).

    Attributes:
        mode: ``"no"``, ``"on-failure"`` or ``"always"``.
        max_restarts: restarts allowed within ``window_seconds``; one more exit is a crash loop.
        window_seconds: the window the restarts are counted in, in seconds.
        backoff_seconds: the wait before the first restart, doubled for each further one within the
            window, at most 60 s.

    Raises:
        ValueError: a mode not in :data:`RESTART_MODES`, or a number out of range.
    """

    mode: str = attrs.field(default="no", validator=attrs.validators.in_(RESTART_MODES))
    max_restarts: int = attrs.field(default=5, validator=_max_restarts)
    window_seconds: float = attrs.field(default=60.0, validator=_seconds(0.0, strict=True))
    backoff_seconds: float = attrs.field(default=1.0, validator=_seconds(0.0, strict=False))

    def to_dict(self) -> dict[str, object]:
        """The wire form: ``{"mode", "max_restarts", "window", "backoff"}`` (what the tool and RPC take)."""
        return {
            "mode": self.mode,
            "max_restarts": self.max_restarts,
            "window": self.window_seconds,
            "backoff": self.backoff_seconds,
        }


@attrs.frozen
class RestartDecision:
    """What to do after an exit.

    Attributes:
        restart: start the process again.
        delay_seconds: after this long (when ``restart``).
        status: the record's status meanwhile, or for good when the restarts stop: ``"restarting in 2 s
            (exited 3)"``, ``"crash loop: 5 restarts in 60 s"``; ``None``: the plain exit.
    """

    restart: bool
    delay_seconds: float = 0.0
    status: str | None = None


@final
@attrs.define(eq=False)
class RestartTracker:
    """The restarts of one record under its policy: decides, and counts what it decided.

    Attributes:
        policy: the policy.
        restarts: restarts decided so far (the service counts those that happened).
        recent: the times of the restarts decided within the window (any clock, in seconds).
    """

    policy: RestartPolicy
    restarts: int = 0
    recent: list[float] = attrs.field(factory=list)

    def decide(
        self, *, exit_code: int | None, signal: int | None, asked: bool, now: float
    ) -> RestartDecision:
        """Decide what follows an exit of the record's process, and count a restart decided.

        Args:
            exit_code: its exit code (``None``: a signal ended it).
            signal: the signal that ended it, or ``None``.
            asked: the end was asked for (a kill, a halt, the engine's stop, a cancelled scope).
            now: the time of the exit (the clock :attr:`recent` uses).
        """
        policy = self.policy
        if asked or policy.mode == "no":
            return RestartDecision(restart=False)
        failed = signal is not None or exit_code != 0
        if policy.mode == "on-failure" and not failed:
            return RestartDecision(restart=False)
        if policy.max_restarts == 0:  # no restart was ever allowed: the plain exit, not a crash loop
            return RestartDecision(restart=False)
        self.recent = [t for t in self.recent if now - t < policy.window_seconds]
        if len(self.recent) >= policy.max_restarts:
            return RestartDecision(
                restart=False,
                status=f"crash loop: {len(self.recent)} restarts in {policy.window_seconds:g} s",
            )
        delay = min(policy.backoff_seconds * 2 ** len(self.recent), MAX_BACKOFF_SECONDS)
        self.recent.append(now)
        self.restarts += 1
        how = f"killed by signal {signal}" if signal is not None else f"exited {exit_code}"
        return RestartDecision(restart=True, delay_seconds=delay, status=f"restarting in {delay:g} s ({how})")

    def marker(self, *, exit_code: int | None, signal: int | None) -> str:
        """The line each log gets at a restart: ``--- restarted (exit 3), restart 2 of 5 ---``."""
        how = f"signal {signal}" if signal is not None else f"exit {exit_code}"
        return f"--- restarted ({how}), restart {len(self.recent)} of {self.policy.max_restarts} ---"
