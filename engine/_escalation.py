"""The escalation algorithm, once: SIGINT -> grace -> SIGKILL -> kill wait -> survivors.

Two drivers run it: the Trio one in ``_termination`` (a supervisor ending a run's tree, waking on the
leader's pidfd) and the blocking one in ``_sweep`` (the guardian and the start-up sweep, polling with
``time.sleep``). The decisions live here, in a synchronous generator that does no I/O and never
sleeps, in the style of a sans-I/O protocol core such as h11's:

- it acts on an :class:`EscalationTarget` (look, signal, kill, ask what is left);
- when it needs time to pass it yields a :class:`WaitGone` request ("wait until the target is gone, at
  most this long") and the driver sends back whether the target is gone;
- it returns an :class:`Escalation` (``escalated``, ``survivors``).

The steps (systemd stops a unit the same way, with SIGTERM where we send SIGINT):

1. look for the target's members; SIGINT, then SIGCONT (a stopped process acts on SIGINT only once
   continued); wait up to the grace period for all of them to be gone. Whenever the driver reports
   "gone", look again (a member may have forked or left the group while handling SIGINT) and signal
   what the new look found, within the same grace period;
2. look again (a look shared with other escalations will do: it only aims SIGKILL, and the fresh looks
   of the kill wait find what it missed); if anything is left, kill it (SIGKILL) and wait up to the
   kill wait the same way;
3. if the kill wait ran out, look afresh and kill what that finds (the look of step 2 may have missed
   it); report what is still alive as survivors, never hiding it.

A driver may end a grace wait early (``force``: straight to SIGKILL) by answering "not gone".

The target protocol is what differs between kinds of containment. A process tree (``_termination``)
walks ``/proc`` and signals its group and escapees; a set of recorded processes (``_sweep``) signals
pids with their start times checked; a cgroup v2 leaf would signal every pid of ``cgroup.procs``, kill
through ``cgroup.kill`` and be gone when ``cgroup.events`` says ``populated 0`` and its zombies are
reaped. None of that touches this module.

Standard library only: the guardian imports it without the engine's third-party dependencies.
"""

from __future__ import annotations

import enum
import signal
from collections.abc import Callable, Generator, Sequence
from typing import Final, NamedTuple, Protocol

__all__ = [
    "MAX_GRACE_SECONDS",
    "Escalation",
    "EscalationTarget",
    "Phase",
    "Steps",
    "WaitGone",
    "advance",
    "check_wait_seconds",
    "escalate",
]

#: The longest grace period or kill wait an escalation takes, in seconds (an hour): a longer one would
#: let a child that ignores SIGINT outlive ``kill``, ``stop`` and the guardian for practical purposes.
MAX_GRACE_SECONDS: Final = 3600.0


def check_wait_seconds(_inst: object, attribute: _Named, value: float) -> None:
    """An attrs validator: a grace period or kill wait, a number of seconds from 0 to
    :data:`MAX_GRACE_SECONDS` (``EngineConfig``, ``SpawnSpec``).

    Raises:
        ValueError: anything else, the field named.
    """
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value <= MAX_GRACE_SECONDS:
        raise ValueError(
            f"{attribute.name} must be a number of seconds from 0 to {MAX_GRACE_SECONDS:g} (an hour), "
            f"got {value!r}"
        )


class _Named(Protocol):
    """What a validator reads of an attrs attribute."""

    @property
    def name(self) -> str: ...


class EscalationTarget(Protocol):
    """What escalation acts on: something with members that can be looked for, signalled and killed.

    Every method is synchronous and must not block for long (a ``/proc`` walk, a few ``kill`` calls, a
    small file write); the drivers do all the waiting.
    """

    def snapshot(self, *, fresh: bool) -> None:
        """Look for members that appeared since the last look (children forked, group escapees).

        Args:
            fresh: ``False`` lets the target reuse facts read a moment ago (many escalations starting
                together); the look that decides the target is gone is always fresh.
        """

    def send(self, sig: int) -> None:
        """Send ``sig`` to every member still alive (``ProcessLookupError`` is "already gone")."""

    def kill(self) -> None:
        """Kill every member still alive (SIGKILL, or ``cgroup.kill`` for a cgroup leaf)."""

    def gone(self) -> bool:
        """Whether nothing of the target is alive; cheap enough to ask at every poll step.

        It may reap what the engine owns (the leader, adopted zombies) on the way.
        """

    def remaining(self) -> Sequence[int]:
        """The pids of the target still alive, found afresh (zombies the engine owns are reaped)."""


class Phase(enum.Enum):
    """Which wait a :class:`WaitGone` request is: the grace period (``force`` may cut it short) or the
    wait after SIGKILL (nothing cuts it short)."""

    GRACE = "grace"
    KILL = "kill"


class WaitGone(NamedTuple):
    """A request to the driver: wait until the target is gone, at most ``seconds``.

    The driver answers ``True`` when the target is gone (:meth:`EscalationTarget.gone`), ``False``
    when the time ran out or it ends the wait early (a forced cancel during :attr:`Phase.GRACE`). With
    ``seconds`` at 0 it looks once and answers.

    Attributes:
        phase: the grace period or the wait after SIGKILL.
        seconds: the longest the driver may wait (>= 0).
    """

    phase: Phase
    seconds: float


class Escalation(NamedTuple):
    """How an escalation ended.

    Attributes:
        escalated: whether the target had to be killed (SIGKILL) after the grace period.
        survivors: pids still alive after the kill wait (normally empty).
    """

    escalated: bool
    survivors: tuple[int, ...]


#: The generator :func:`escalate` returns: it yields requests, is sent "gone?" answers, returns the end.
Steps = Generator[WaitGone, bool, Escalation]


def escalate(
    target: EscalationTarget,
    *,
    grace_seconds: float,
    kill_wait_seconds: float,
    force: bool,
    now: Callable[[], float],
) -> Steps:
    """The escalation of ``target``, as a generator of wait requests (see the module).

    Args:
        target: what to end.
        grace_seconds: the longest wait after SIGINT before SIGKILL.
        kill_wait_seconds: the longest wait after SIGKILL before survivors are reported.
        force: skip SIGINT and the grace period: straight to SIGKILL.
        now: the driver's clock in seconds (``trio.current_time``, ``time.monotonic``); the grace and
            kill waits are deadlines on it, shared by every look and re-signal inside one phase.

    Returns:
        The generator; drive it with :func:`advance`.
    """
    target.snapshot(fresh=False)
    if not force:
        target.send(signal.SIGINT)
        target.send(signal.SIGCONT)  # a stopped process acts on SIGINT only once continued
        deadline = now() + grace_seconds
        if (yield from _settle(target, Phase.GRACE, deadline, now, lambda: target.send(signal.SIGINT))):
            return Escalation(escalated=False, survivors=())
    # Children forked while handling SIGINT. A shared look is enough to aim SIGKILL: what it misses is
    # found by the fresh look that settles the kill wait, and killed then. Only "gone" needs a fresh look.
    target.snapshot(fresh=False)
    if target.gone():
        target.snapshot(fresh=True)
        if not target.remaining():
            return Escalation(escalated=False, survivors=())
    target.kill()
    if (yield from _settle(target, Phase.KILL, now() + kill_wait_seconds, now, target.kill)):
        return Escalation(escalated=True, survivors=())  # the settling look found nothing left
    # Something outlived the kill wait. The look that aimed SIGKILL may have been shared: a fresh one
    # now finds what it missed, which is killed and, if it outlives that, reported too.
    target.snapshot(fresh=True)
    target.kill()
    return Escalation(escalated=True, survivors=tuple(target.remaining()))


def _settle(
    target: EscalationTarget,
    phase: Phase,
    deadline: float,
    now: Callable[[], float],
    resignal: Callable[[], None],
) -> Generator[WaitGone, bool, bool]:
    """Wait until the target is gone by a fresh look, re-signalling what each look finds; ``False``
    when the driver gives up (the deadline passed, or force)."""
    while True:
        if not (yield WaitGone(phase, max(deadline - now(), 0.0))):
            return False
        target.snapshot(fresh=True)
        if not target.remaining():
            return True
        resignal()


def advance(steps: Steps, gone: bool | None) -> WaitGone | Escalation:
    """Resume ``steps`` with the driver's answer (``None`` to start it): the next request, or the end."""
    try:
        return next(steps) if gone is None else steps.send(gone)
    except StopIteration as stop:
        result: Escalation = stop.value
        return result
