"""Heartbeats: each engine says who and where it is, every few seconds, in its job store.

An engine on a fleet store (PostgreSQL) writes its heartbeat, a :class:`FleetMember`, every
:data:`HEARTBEAT_SECONDS`: its id, host, pid, version, containment mode and live run count.
``gadget-engine fleet`` lists them with their age on the database's clock, and an engine whose last
heartbeat is older than ``EngineConfig.owner_lost_seconds`` is *lost*: its jobs show ``owner lost`` in
``cron list`` (nothing of theirs runs elsewhere). A SQLite store keeps the one engine's heartbeat in
memory (:class:`LocalBeats`), so ``fleet`` answers the same way for a single engine.

The heartbeat is a slow housekeeping timer (design section 2): one write every 5 s, never more often.
A failed write is logged once per outage and tried again at the next beat.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any, Final, final

import attrs
import trio

__all__ = ["HEARTBEAT_SECONDS", "FleetMember", "LocalBeats", "run_heartbeats"]

logger = logging.getLogger("engine.fleet")

#: How often an engine writes its heartbeat, in seconds (design: at least every 5 s, not more often).
HEARTBEAT_SECONDS: Final = 5.0  # EngineConfig checks owner_lost_seconds against the same period


@attrs.frozen
class FleetMember:
    """One engine's last heartbeat.

    Attributes:
        engine_id: the engine's id (``EngineConfig.engine_id``).
        host: the host name it runs on.
        pid: its process id there.
        version: its version.
        containment: ``"cgroup"`` or ``"process-group"``.
        live_runs: its live subprocesses and commands at the beat.
        started_at: when it started (aware UTC).
        beat_at: when it wrote this heartbeat, on the store's clock (aware UTC).
        age_seconds: how long ago, on the store's clock, when read (0 when written).
        lost: whether the age is over ``owner_lost_seconds`` (its owned jobs show ``owner lost``).
    """

    engine_id: str
    host: str
    pid: int
    version: str
    containment: str
    live_runs: int
    started_at: datetime
    beat_at: datetime
    age_seconds: float = 0.0
    lost: bool = False

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready values (times as ISO 8601)."""
        out = attrs.asdict(self)
        out["started_at"] = self.started_at.isoformat()
        out["beat_at"] = self.beat_at.isoformat()
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FleetMember:
        """A member from :meth:`to_dict`'s form.

        Raises:
            ValueError: a field is missing or invalid.
        """
        try:
            return cls(
                engine_id=str(data["engine_id"]),
                host=str(data["host"]),
                pid=int(data["pid"]),
                version=str(data["version"]),
                containment=str(data["containment"]),
                live_runs=int(data["live_runs"]),
                started_at=datetime.fromisoformat(data["started_at"]),
                beat_at=datetime.fromisoformat(data["beat_at"]),
                age_seconds=float(data.get("age_seconds", 0.0)),
                lost=bool(data.get("lost", False)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a valid heartbeat: {exc!r}") from exc


@final
@attrs.define(eq=False)
class LocalBeats:
    """The heartbeats of a store only one engine uses (SQLite): the last one, in memory.

    Attributes:
        lost_seconds: the age past which the engine counts as lost.
    """

    lost_seconds: float
    _last: FleetMember | None = attrs.field(init=False, default=None)

    async def beat(self, member: FleetMember) -> None:
        """Keep ``member``, stamped with the wall clock. Cancellation: safe."""
        await trio.lowlevel.checkpoint()
        self._last = attrs.evolve(member, beat_at=datetime.now(UTC), age_seconds=0.0, lost=False)

    async def fleet(self) -> list[FleetMember]:
        """The one engine's last heartbeat with its age (none before the first). Cancellation: safe."""
        await trio.lowlevel.checkpoint()
        if self._last is None:
            return []
        age = max(0.0, (datetime.now(UTC) - self._last.beat_at).total_seconds())
        return [attrs.evolve(self._last, age_seconds=age, lost=age > self.lost_seconds)]


async def run_heartbeats(
    beat: Callable[[], Any],
    *,
    seconds: float = HEARTBEAT_SECONDS,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Await ``beat()`` now and then every ``seconds``, until cancelled.

    The first heartbeat is written before :meth:`started` (``fleet`` lists the engine as soon as it
    runs), unless it fails; a failed one is logged (once per outage) and the next is tried on time.

    Cancellation: stops between or during beats; nothing is left half-written (each beat is one write).
    """
    failing = False
    started = False
    while True:
        began = trio.current_time()
        try:
            await beat()
        except OSError as exc:
            if not failing:
                logger.error(
                    "fleet: writing the heartbeat failed (%s); trying again every %s s", exc, seconds
                )
            failing = True
        else:
            if failing:
                logger.info("fleet: the heartbeat is written again")
            failing = False
        if not started:
            task_status.started()
            started = True
        await trio.sleep_until(began + seconds)  # beats start at least ``seconds`` apart
