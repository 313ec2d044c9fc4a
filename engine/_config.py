"""The engine's configuration: one frozen value, every field optional."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Iterable, Mapping
from datetime import datetime
from typing import TYPE_CHECKING

import attrs
import platformdirs

from ._escalation import check_wait_seconds
from ._retry import DEFAULT_RETRY_SECONDS, check_delays

#: The values of ``containment`` (also ``_containment.CONTAINMENT_MODES``).
CONTAINMENT_MODES = ("auto", "cgroup", "process-group")

if TYPE_CHECKING:
    from .cron._events import FiredEvent
    from .cron._protocol import JobStore

__all__ = ["EngineConfig"]

_non_negative = attrs.validators.ge(0.0)


_positive = attrs.validators.gt(0.0)


def _store_url(_inst: object, attribute: attrs.Attribute[str | None], value: str | None) -> None:
    if value is not None:
        from .cron._pg_conn import check_store_url

        check_store_url(value, attribute.name)


def _shown_url(value: str | None) -> str:
    from .cron._pg_conn import redact_url

    return repr(None if value is None else redact_url(value))


def _engine_id(_inst: object, attribute: attrs.Attribute[str | None], value: str | None) -> None:
    if value is None:
        return
    if (
        not isinstance(value, str)
        or not 1 <= len(value) <= 64
        or not value.isascii()
        or not value.replace("-", "").replace("_", "").replace(".", "").isalnum()
    ):
        raise ValueError(f"{attribute.name} must be 1 to 64 letters, digits, '-', '_' or '.', got {value!r}")


def _positive_int(_inst: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{attribute.name} must be a whole number >= 1, got {value!r}")


def _optional_shell(value: Iterable[str] | None) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str) or not all(isinstance(v, str) for v in value):
        raise TypeError("exit_watch_shell must be a sequence of strings, e.g. ('bash', '-lc', '--')")
    shell = tuple(value)
    if not shell:
        raise ValueError("exit_watch_shell must not be empty")
    return shell


#: How often a fleet member writes its heartbeat, in seconds (``cron/_fleet.HEARTBEAT_SECONDS``).
_HEARTBEAT_SECONDS = 5.0


def _beyond_heartbeats(_inst: object, attribute: attrs.Attribute[float], value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > _HEARTBEAT_SECONDS:
        raise ValueError(
            f"{attribute.name} must be more than {_HEARTBEAT_SECONDS:g} s (one heartbeat period), so a live "
            f"engine never shows as lost; got {value!r}"
        )


@attrs.frozen
class EngineConfig:
    """Settings of one engine (``open_engine``) or one ``gadget-engine serve``.

    Attributes:
        state_dir: where the engine keeps its lock, socket, job store and watcher logs (``None``:
            ``platformdirs.user_state_dir("gadget-engine")``).
        grace_seconds: SIGINT -> SIGKILL delay of every escalation, in seconds.
        kill_wait_seconds: wait after SIGKILL before survivors are reported, in seconds.
        max_processes_per_project: live subprocesses one project may have.
        max_processes: live subprocesses in the whole engine.
        log_cap_bytes: per-stream log size kept on disk, in bytes (the oldest part is dropped).
        gadget_dir_name: the folder under a project that holds ``subprocess-logs/``.
        exit_watch_shell: argv prefix of on-exit commands (``None``: ``resolve_exit_watch_shell()``).
        subreaper: make the engine a child subreaper where Linux allows.
        store_factory: makes the cron job store from the state dir (``None``: SQLite at
            ``<state_dir>/cron.sqlite3``); tests pass a store that fails on purpose.
        wall_clock: returns the wall time, aware, for cron maths and job times (``None``: the system clock);
            tests steer it.
        watch_retry_seconds: waits between an exit watcher's persist (or spawn) attempts, in seconds;
            the last one repeats (design: 1 s, 5 s, 30 s, 5 min); the watchers' ``RetryPolicy``.
        watch_hooks: test hooks of the exit watchers by point name (``after_spawn``, ``before_persist``,
            ``after_persist``, ``before_fire``): ``async def hook(job_id) -> None``.
        fire_observers: called with each fired event as it is recorded in the event log (``serve`` and
            ``mcp`` log ``fired`` through one); an observer must not block.
        guardian: start the guardian process that ends the children if the engine dies (records of
            live groups are kept in the state dir either way, for the next engine's start-up sweep).
        containment: how runs are contained: ``"cgroup"`` (a cgroup v2 leaf per run; nothing a process
            does takes it out), ``"process-group"`` (its session and process group, ``/proc`` parent
            links and the run marker), or ``"auto"``: cgroup wherever a cgroup v2 hierarchy is writable
            by the engine, else process group. See ``docs/guide-escalation.md``.
        end_unclaimed_orphans: the engine owns its whole process (``serve``, ``mcp``): a child re-parented
            to it that no run claims is ended by ``kill_all`` and by the engine's exit. Embedded
            (``False``, the default), the host's own children look the same, so they are only reported.
        max_connections: connections the RPC socket of ``serve`` (or of an embedding ``mcp``) serves at
            once; one more gets an error line and is closed (default 128).
        connection_idle_seconds: how long a connection may take to send a complete request, counted from
            its start or from its last answer, before it gets an error line and is closed, in seconds
            (default 60; a follower such as ``log -f`` asks every second and is never idle).
        max_request_bytes: the longest request line the socket reads, in bytes (default 1 MiB); a longer
            one gets an error line and its connection is closed.
        repair_store: at start, when the job store is damaged (a truncated or WAL-damaged file, rows that
            cannot be read), keep what can be read in a new store and move the damaged file aside
            (``serve --repair``) instead of refusing to start.
        store_url: the job store: ``None`` for SQLite in the state directory, or ``postgresql://...``
            for the store a fleet of engines shares (``serve --store``, ``GADGET_ENGINE_STORE``;
            ``docs/guide-fleet.md``). Its password is never shown (``repr``, logs, ``status``, errors).
        engine_id: this engine's id in a fleet (``serve --engine-id``; ``None``: one generated once and
            kept in ``<state_dir>/engine-id``, so it survives a change of host name). It is the owner of
            the jobs the engine adds: only it runs their ``Command`` or on-exit command.
        lease_seconds: how long an unacknowledged event of a floating job stays with the embedded engine
            that logged it before another engine may hand it over (fleet store; default 30 s).
        owner_lost_seconds: how old an engine's last heartbeat must be for its jobs to show
            ``owner lost`` in ``cron list`` (fleet store; default 60 s; heartbeats come every 5 s).
        tool_extensions: the ``subprocess`` tool offers more than the spec (``stdin``, ``ready``,
            ``restart``, ``notify_on_exit``, ``new``, ``grep``, ``input``, ``wait``); ``False``: its
            definition is exactly the spec's six commands (``docs/guide-subprocesses.md``).
    """

    state_dir: str | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.instance_of(str))
    )
    grace_seconds: float = attrs.field(default=5.0, validator=check_wait_seconds)
    kill_wait_seconds: float = attrs.field(default=5.0, validator=check_wait_seconds)
    max_processes_per_project: int = attrs.field(default=32, validator=_positive_int)
    max_processes: int = attrs.field(default=256, validator=_positive_int)
    log_cap_bytes: int = attrs.field(default=50 * 2**20, validator=_positive_int)
    gadget_dir_name: str = attrs.field(default=".gadget", validator=attrs.validators.instance_of(str))
    exit_watch_shell: tuple[str, ...] | None = attrs.field(default=None, converter=_optional_shell)
    subreaper: bool = True
    guardian: bool = True
    store_factory: Callable[[str], JobStore] | None = None
    wall_clock: Callable[[], datetime] | None = None
    watch_retry_seconds: tuple[float, ...] = attrs.field(
        default=DEFAULT_RETRY_SECONDS, converter=tuple, validator=check_delays
    )
    watch_hooks: Mapping[str, Callable[[str], Awaitable[None]]] | None = None
    fire_observers: tuple[Callable[[FiredEvent], None], ...] = ()
    containment: str = attrs.field(default="auto", validator=attrs.validators.in_(CONTAINMENT_MODES))
    end_unclaimed_orphans: bool = False
    # Trust nothing on the wire or on disk (docs/security.md): the socket's limits, the store's repair.
    max_connections: int = attrs.field(default=128, validator=_positive_int)
    connection_idle_seconds: float = attrs.field(default=60.0, validator=attrs.validators.gt(0.0))
    max_request_bytes: int = attrs.field(default=1024 * 1024, validator=_positive_int)
    repair_store: bool = False
    # The fleet (docs/guide-fleet.md).
    store_url: str | None = attrs.field(default=None, validator=_store_url, repr=_shown_url)
    engine_id: str | None = attrs.field(default=None, validator=_engine_id)
    lease_seconds: float = attrs.field(default=30.0, validator=_positive)
    owner_lost_seconds: float = attrs.field(default=60.0, validator=_beyond_heartbeats)
    tool_extensions: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))

    def resolved_state_dir(self) -> str:
        """The absolute state directory this configuration names."""
        if self.state_dir is not None:
            return os.path.abspath(os.path.expanduser(self.state_dir))
        return platformdirs.user_state_dir("gadget-engine")
