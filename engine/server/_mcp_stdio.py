"""The stdio end of ``gadget-engine mcp``: every request read before stdin closed gets its answer.

The SDK's server ends when its input ends, and its dispatcher then cancels the handlers still running
and answers their requests ``Connection closed`` (``JSONRPCDispatcher.run`` in ``mcp.shared``), even a
``create`` whose process already runs (NB-03: several requests in one write, then stdin closed). So
:func:`serve_stdio` sits between ``stdio_server`` and ``Server.run`` and relays every message both ways,
noting each request read and each answer written (:class:`Unanswered`). When stdin closes it keeps the
server's input open until every request read has its answer and no tool call runs any more (a call
whose request the client cancelled still runs: a kill ends its process whatever happens):

1. the calls get :data:`ANSWER_SECONDS` to finish on their own (most take milliseconds);
2. then ``tools.cut_short()``: the tools hurry what they wait for and, after :data:`HURRY_SECONDS`,
   answer the calls still running with their state so far (``_mcp_inflight``);
3. then the server's input ends (after :data:`FLUSH_SECONDS` at most), the server exits and the last
   answers are flushed to stdout.

So every answer is out within 1.5 s of stdin closing; MCP clients wait 2 s before SIGTERM.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, Protocol, final

import anyio
import attrs
import mcp_types as types
import trio
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server
from mcp.shared.message import SessionMessage

__all__ = ["ANSWER_SECONDS", "FLUSH_SECONDS", "HURRY_SECONDS", "ToolCalls", "Unanswered", "serve_stdio"]

#: After stdin closed: how long the calls in flight get to finish on their own, in seconds.
ANSWER_SECONDS: Final = 0.5
#: Then, once hurried: how long they get before they are cut short, in seconds.
HURRY_SECONDS: Final = 0.3
#: Then: how long the last answers get to be written before the server's input ends, in seconds.
FLUSH_SECONDS: Final = 0.2


class ToolCalls(Protocol):
    """The tool calls of the server (``McpTools``): how many run, and how to end them at stdin's end."""

    def calls_in_flight(self) -> int:
        """How many tool calls are running."""
        ...

    async def wait_calls_done(self) -> None:
        """Wait until no tool call runs."""

    async def cut_short(self, hurry_seconds: float) -> None:
        """Hurry the calls running, then cut short those still running after ``hurry_seconds``."""


@final
@attrs.define(eq=False)
class Unanswered:
    """The ids of the requests read from stdin and not answered yet."""

    _ids: set[str | int] = attrs.field(init=False, factory=set)
    _changed: trio.Event = attrs.field(init=False, factory=trio.Event)

    def __len__(self) -> int:
        return len(self._ids)

    def read(self, message: types.JSONRPCMessage) -> None:
        """Note a message read from stdin: a request waits for its answer; a cancelled one does not."""
        if isinstance(message, types.JSONRPCRequest):
            self._ids.add(message.id)
        elif isinstance(message, types.JSONRPCNotification) and message.method == "notifications/cancelled":
            request_id = (message.params or {}).get("requestId")
            if isinstance(request_id, str | int):  # the SDK answers nothing to a cancelled request
                self._answered(request_id)

    def written(self, message: types.JSONRPCMessage) -> None:
        """Note a message written to stdout: a response or an error answers its request."""
        if isinstance(message, types.JSONRPCResponse | types.JSONRPCError) and message.id is not None:
            self._answered(message.id)

    def _answered(self, request_id: str | int) -> None:
        self._ids.discard(request_id)
        self._changed.set()
        self._changed = trio.Event()

    async def wait_all_answered(self) -> None:
        """Wait until every request read has been answered.

        Cancellation: safe; nothing changes.
        """
        while self._ids:
            await self._changed.wait()
        await trio.lowlevel.checkpoint()


def _parse_error(error: Exception) -> SessionMessage:
    """JSON-RPC's answer to a line that is not a message: ``-32700`` with ``id: null``, one line."""
    reason = str(error).splitlines()[0] if str(error) else type(error).__name__
    data = types.ErrorData(code=types.PARSE_ERROR, message=f"parse error: not a JSON-RPC message ({reason})")
    return SessionMessage(types.JSONRPCError(jsonrpc="2.0", id=None, error=data))


async def serve_stdio(
    server: Server[Any], tools: ToolCalls, *, on_eof: Callable[[int], None] | None = None
) -> None:
    """Serve ``server`` on stdio until stdin closes and every request read has its answer.

    Args:
        server: the MCP server.
        tools: its tool calls (waited for, cut short at the end).
        on_eof: called when stdin closes, with the number of requests not answered yet.

    Cancellation: the server stops at once; requests not answered yet get the SDK's error.
    """
    unanswered = Unanswered()
    async with stdio_server() as (stdin, stdout):
        to_server, server_input = anyio.create_memory_object_stream[SessionMessage | Exception](0)
        server_output, from_server = anyio.create_memory_object_stream[SessionMessage](0)

        async def relay_answers() -> None:
            async with stdout, from_server:
                async for message in from_server:
                    await stdout.send(message)
                    unanswered.written(message.message)

        errors_out = server_output.clone()  # our own answers to lines that are no message at all

        async with trio.open_nursery() as nursery:
            nursery.start_soon(relay_answers)
            nursery.start_soon(
                server.run, server_input, server_output, server.create_initialization_options()
            )
            async with to_server, errors_out:
                async for item in stdin:
                    if isinstance(item, SessionMessage):
                        unanswered.read(item.message)
                        await to_server.send(item)
                    else:  # not JSON-RPC (the SDK's reader passes the parse error on; its server drops it)
                        await errors_out.send(_parse_error(item))
                if on_eof is not None:
                    on_eof(len(unanswered))
                with trio.move_on_after(ANSWER_SECONDS):
                    await unanswered.wait_all_answered()
                    await tools.wait_calls_done()
                if len(unanswered) or tools.calls_in_flight():
                    await tools.cut_short(HURRY_SECONDS)
                    with trio.move_on_after(FLUSH_SECONDS):
                        await unanswered.wait_all_answered()
