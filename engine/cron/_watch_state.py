"""The watch state: what an exit watcher keeps in the store to find its command again after a crash.

Written on the job's row (``watch_state``) in two steps, cleared when the watcher is done:

- before the spawn, an :class:`ArmIntent`: the arm and its exit file, with no process yet. An engine
  killed between the spawn and the next step leaves this much, and the next engine finds the shim by its
  exit file in ``/proc`` (the shim's argv names it), reads its exit record, or, when neither is there but
  the shim had started (the record it reserves, output in the logs), reports the watch lost: it never
  runs the command a second time.
- once the command runs, a :class:`WatchState`: the shim's pid, session and start time (so a reused pid is
  never mistaken for it), the run marker of its tree, its cgroup leaf, and the exit file.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any, TypeVar

import attrs

from .._procfs import is_alive
from .._sweep import GroupRecord
from ._schedule import OnExit

__all__ = ["ArmIntent", "StoredWatch", "WatchState", "stored_watch_from_dict"]


def _whole(_inst: object, attribute: attrs.Attribute[int], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TypeError(f"{attribute.name} must be a whole number >= 0, got {value!r}")


_str = attrs.validators.instance_of(str)
_started_at = attrs.validators.instance_of(datetime)


_Form = TypeVar("_Form", "ArmIntent", "WatchState")


def _json_form(inst: ArmIntent | WatchState) -> dict[str, Any]:
    """``inst``'s fields as JSON values (``started_at`` in ISO form)."""
    return attrs.asdict(
        inst, value_serializer=lambda _i, _f, v: v.isoformat() if isinstance(v, datetime) else v
    )


def _from_json_form(cls: type[_Form], data: Mapping[str, Any], what: str) -> _Form:
    """``cls`` from :func:`_json_form`'s form: each field from its key (one with a default may be
    missing), ``started_at`` an aware ISO time.

    Raises:
        ValueError: a field is missing or invalid (``what`` names the record).
    """
    try:
        values: dict[str, Any] = {}
        for field in attrs.fields(cls):
            if field.name in data:
                values[field.name] = data[field.name]
            elif field.default is attrs.NOTHING:
                raise KeyError(field.name)
        started_at = datetime.fromisoformat(values["started_at"])
        if started_at.tzinfo is None:
            raise ValueError(f"started_at must be an aware time, got {values['started_at']!r}")
        return cls(**{**values, "started_at": started_at})
    except (KeyError, TypeError) as exc:
        raise ValueError(f"not a valid {what}: {exc}") from exc


@attrs.frozen
class ArmIntent:
    """An arm whose command is being spawned: stored before the spawn, replaced by the command's
    :class:`WatchState` once it runs (see the module).

    Attributes:
        arm_id: the arm (names its log and exit files).
        exit_file: where the shim will record how the command ended; the shim's argv names it, so the
            next engine finds a shim spawned by an engine killed before it stored the :class:`WatchState`.
        command: the job's command.
        cwd: the job's working directory (``None``: the engine's).
        started_at: aware UTC time the arm was stored (just before the spawn).
        marks_start: as in :class:`WatchState`.
    """

    arm_id: str = attrs.field(validator=_str)
    exit_file: str = attrs.field(validator=_str)
    command: str = attrs.field(validator=_str)
    cwd: str | None = attrs.field(validator=attrs.validators.optional(_str))
    started_at: datetime = attrs.field(validator=_started_at)
    marks_start: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))

    def targets(self, schedule: OnExit) -> bool:
        """Whether this arm is of ``schedule``'s command in its working directory."""
        return (self.command, self.cwd) == (schedule.command, schedule.cwd)

    def spawned(
        self,
        *,
        pid: int,
        start_time: int,
        marker: str,
        cgroup: str | None,
        started_at: datetime | None = None,
    ) -> WatchState:
        """The :class:`WatchState` of this arm's shim, running as ``pid`` (the leader of its session) with
        that start time, run marker and cgroup leaf, spawned at ``started_at`` (``None``: the arm's time,
        where the spawn's own is not known)."""
        return WatchState(
            arm_id=self.arm_id,
            pid=pid,
            sid=pid,
            start_time=start_time,
            marker=marker,
            exit_file=self.exit_file,
            command=self.command,
            cwd=self.cwd,
            started_at=self.started_at if started_at is None else started_at,
            cgroup=cgroup,
            marks_start=self.marks_start,
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON form the store keeps (``"spawning": true`` tells it from a :class:`WatchState`)."""
        return {"spawning": True, **_json_form(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ArmIntent:
        """An arm from :meth:`to_dict`'s form (other keys are ignored).

        Raises:
            ValueError: a field is missing or invalid.
        """
        return _from_json_form(cls, data, "arm")


@attrs.frozen
class WatchState:
    """One watched command, as its watcher stored it.

    Attributes:
        arm_id: the arm this command belongs to (names its log and exit files).
        pid: the shim's pid (it leads the command's process group and session).
        sid: its session id.
        start_time: its start time in clock ticks since boot (``/proc/<pid>/stat`` field 22).
        marker: the run marker in its tree's environment.
        exit_file: where the shim records how the command ended.
        command: the job's command when it was started.
        cwd: the job's working directory then (``None``: the engine's).
        started_at: aware UTC time of the spawn.
        cgroup: the command's cgroup v2 leaf (``w-...``) in cgroup containment, else ``None``: kept across
            an engine stop or crash, ended with the command's leftovers once it is over.
        marks_start: whether the command's shell writes a mark just before the command runs (a login
            shell's profile runs first, and may replace the shell): its absence then means the command
            never ran (``not_started``), whichever engine sees the end. ``False`` in states stored before
            the field existed (no engine looked then).
    """

    arm_id: str = attrs.field(validator=_str)
    pid: int = attrs.field(validator=_whole)
    sid: int = attrs.field(validator=_whole)
    start_time: int = attrs.field(validator=_whole)
    marker: str = attrs.field(validator=_str)
    exit_file: str = attrs.field(validator=_str)
    command: str = attrs.field(validator=_str)
    cwd: str | None = attrs.field(validator=attrs.validators.optional(_str))
    started_at: datetime = attrs.field(validator=_started_at)
    cgroup: str | None = attrs.field(default=None, validator=attrs.validators.optional(_str))
    marks_start: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))

    def targets(self, schedule: OnExit) -> bool:
        """Whether this state watches ``schedule``'s command in its working directory."""
        return (self.command, self.cwd) == (schedule.command, schedule.cwd)

    def group_record(self) -> GroupRecord:
        """The command's process group, as the start-up sweep and the escalation find it."""
        return GroupRecord(self.pid, self.sid, self.start_time, self.marker)

    def alive(self) -> bool:
        """Whether the shim still runs (same pid, same start time, not a zombie)."""
        return is_alive(self.pid, self.start_time)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form the store keeps."""
        return _json_form(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> WatchState:
        """A watch state from :meth:`to_dict`'s form (other keys are ignored; a field with a default may
        be missing: a state stored before the field existed).

        Raises:
            ValueError: a field is missing or invalid.
        """
        return _from_json_form(cls, data, "watch state")


#: What a job's ``watch_state`` column holds: the arm before its spawn, or the running command's state.
StoredWatch = WatchState | ArmIntent


def stored_watch_from_dict(data: Mapping[str, Any]) -> StoredWatch:
    """The :class:`ArmIntent` or :class:`WatchState` of a ``watch_state`` column's JSON form.

    Raises:
        ValueError: it is neither.
    """
    if not isinstance(data, Mapping):
        raise ValueError(f"not a valid watch state: {data!r}")
    if data.get("spawning") is True:
        return ArmIntent.from_dict(data)
    return WatchState.from_dict(data)
