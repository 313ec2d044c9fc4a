"""How a member of a batch of escalations (``_escalation_batch``) is ended without a task of its own.

The supervisor's runs are *detached* members: each run's task returns as soon as its escalation has
joined the batch (during the grace period), and the batch's driver ends each run in its pass
(:attr:`Detached.done`). No task wakes per run after the SIGKILLs but the ones waiting for the runs
(``kill_all``'s one). A member handed back (its leader reaped while the rest of its tree lives) gets a
new task that goes on alone (:attr:`Detached.resume`); an error gets a task that raises it
(:func:`reraise`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import attrs

from ._escalation import Escalation, Phase

__all__ = ["Detached", "Spawn", "reraise"]

#: Starts a task that runs the given async function (the supervisor's nursery, shielded).
Spawn = Callable[[Callable[[], Awaitable[object]]], None]


@attrs.frozen
class Detached:
    """How a member of a batch is ended without its task, which returns as soon as it has joined: the
    driver ends it in its pass (``kill_all`` of 1000 then wakes 1000 tasks neither after their SIGKILL nor
    after their reaping, and each run's end is done in one loop with the others').

    Attributes:
        done: called from the driver's pass with the escalation's end, or with the error that ended it
            (the error is raised by a task :attr:`spawn` starts, as it would have been by the member's
            own task); it must not block.
        resume: called when the member is handed back (its leader reaped, the rest of its tree not
            gone) with the wait's phase and deadline: it starts a task that goes on alone (see
            ``_escalation_driver.drive_escalation``) and calls :attr:`done` at the end.
        spawn: starts a task (the errors above, and a driver for the members left when a driver stops).
    """

    done: Callable[[Escalation | BaseException], None]
    resume: Callable[[Phase, float], None]
    spawn: Spawn


async def reraise(error: BaseException) -> None:
    """Raise ``error`` (in a task :attr:`Detached.spawn` starts: a detached member's error, raised as its
    own task would have raised it)."""
    raise error
