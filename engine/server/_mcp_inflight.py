"""Tool calls in flight when ``gadget-engine mcp``'s stdin closes, and their answers when cut short.

An MCP client ends a stdio server by closing its stdin, then waits 2 s before SIGTERM. Every request
read before that gets an answer (``_mcp_stdio``): most calls finish on their own within a second. One
that does not, a ``kill`` of a process that ignores SIGINT waiting out its grace period, say, is *cut
short* (:meth:`InFlight.cut_short`), and answered with what is true so far; nothing that happened is
answered as a failure:

- **embedded** (the engine runs in this process and stops with it): what a kill is ending gets SIGKILL
  at once (``Supervisor.cancel(run, force=True)``), so the kill usually finishes with its own answer; one
  that still does not is answered ``SUBPROCESS KILL UNDER WAY`` (the engine's stop ends the process).
  Only calls that wait for an escalation are cut here (``kill``, ``halt``, ``killAll``, ``cron_remove``);
  the others never wait long.
- **forwarding** (a ``serve`` runs the engine): every call still running is cut; the request goes on in
  the engine, and the answer says so: ``SUBPROCESS KILL UNDER WAY`` (the kill continues in the engine),
  ``SUBPROCESS CREATE UNDER WAY`` (the engine may have started the process), ``CRON ADD UNDER WAY``...
  A read (``list``, ``log``, ``cron_list``, ``cron_events``) that did not come back is an error:
  nothing happened.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Final, final

import attrs
import trio

__all__ = ["Call", "InFlight", "cut_answer"]

_STOPPED: Final = "The MCP server stopped (its stdin closed)"
#: The calls an embedded engine cuts short: those that wait for an escalation.
_WAITING: Final = frozenset({"kill", "halt", "killAll"})


@attrs.define(eq=False)
class Call:
    """One tool call under way.

    Attributes:
        name: the tool.
        args: its arguments, as the client sent them.
        scope: cancelled to cut the call short.
    """

    name: str
    args: Mapping[str, Any]
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)

    @property
    def command(self) -> str | None:
        """The ``subprocess`` tool's ``cmd``, if this is that tool."""
        cmd = self.args.get("cmd") if self.name == "subprocess" else None
        return cmd if isinstance(cmd, str) else None

    def waits_for_an_escalation(self) -> bool:
        """Whether this call waits for a process to be ended (a kill, a halt, a job's removal)."""
        return self.command in _WAITING or self.name == "cron_remove"


@final
@attrs.define(eq=False)
class InFlight:
    """The tool calls of one MCP server that have not answered yet."""

    _calls: set[Call] = attrs.field(init=False, factory=set)
    _changed: trio.Event = attrs.field(init=False, factory=trio.Event)

    def __len__(self) -> int:
        return len(self._calls)

    @contextmanager
    def track(self, name: str, args: Mapping[str, Any]) -> Iterator[Call]:
        """Count a call as in flight for the duration of the block."""
        call = Call(name, args)
        self._calls.add(call)
        try:
            yield call
        finally:
            self._calls.discard(call)
            self._changed.set()
            self._changed = trio.Event()

    async def wait_done(self) -> None:
        """Wait until no call is in flight.

        Cancellation: safe; nothing changes.
        """
        while self._calls:
            await self._changed.wait()
        await trio.lowlevel.checkpoint()

    async def cut_short(
        self, hurry: Callable[[], Awaitable[None]], *, remote: bool, hurry_seconds: float
    ) -> None:
        """Hurry the calls in flight, then cut short those still running (each answers its state so far).

        ``hurry()`` runs first (embedded: SIGKILL to what is being ended); the calls get
        ``hurry_seconds`` to finish with their own answers; then every call still in flight is cancelled
        (``remote``: all of them; embedded: those waiting for an escalation).

        Cancellation: the calls already cut stay cut.
        """
        async with trio.open_nursery() as nursery:
            nursery.start_soon(hurry)
            with trio.move_on_after(hurry_seconds):
                await self.wait_done()
            for call in list(self._calls):
                if remote or call.waits_for_an_escalation():
                    call.scope.cancel()
            nursery.cancel_scope.cancel()


def cut_answer(call: Call, *, remote: bool) -> tuple[str, bool]:
    """The ``(text, is_error)`` of ``call``, cut short while the server stopped.

    Args:
        call: the call.
        remote: whether the engine runs in another process (a ``serve``), where the request goes on.
    """
    pid = call.args.get("pid")
    where = (
        "it continues in the engine (SIGINT, the grace period, SIGKILL)"
        if remote
        else "the engine sent SIGKILL and ends the process as it stops"
    )
    if call.command in ("kill", "halt"):
        logs = "removes its logs" if call.command == "kill" else "keeps its logs"
        return (
            f"SUBPROCESS {call.command.upper()} UNDER WAY\npid: {pid}\n"
            f"{_STOPPED} before the {call.command} finished; {where}, and {logs}.",
            False,
        )
    if call.command == "killAll":
        return (
            f"SUBPROCESS KILLALL UNDER WAY\n{_STOPPED} before every process was ended; {where}.",
            False,
        )
    if call.command == "create":
        return (
            f"SUBPROCESS CREATE UNDER WAY\n{_STOPPED} before the engine answered; the engine may have "
            "started the process: the subprocess tool's list shows it.",
            False,
        )
    if call.name == "cron_add":
        return (
            f"CRON ADD UNDER WAY\n{_STOPPED} before the engine answered; the engine may have added the job "
            "(an on-exit job's command may be running): cron_list shows it.",
            False,
        )
    if call.name == "cron_remove":
        return (
            f"CRON REMOVE UNDER WAY\nid: {call.args.get('id')}\n{_STOPPED} before the job was removed; "
            "the removal continues in the engine (an on-exit job's command is stopped, without firing).",
            False,
        )
    prefix = "SUBPROCESS ERROR: " if call.name == "subprocess" else "CRON ERROR: "
    return f"{prefix}the MCP server stopped (its stdin closed) before the engine answered", True
