"""``gadget-engine mcp``: the engine's tools over MCP on stdio, for agent clients.

Built on the official ``mcp`` SDK (the ``mcp`` extra), which is anyio-based: it runs here under Trio, the
engine's own loop (``trio.run``; anyio picks its Trio backend). Only this mode imports the SDK.

Two ways to reach an engine, chosen at start-up:

- **forward**: a ``serve`` (or another ``mcp``) answers on the state directory's socket; every tool call
  goes there (:class:`~._mcp_tools.SocketBackend`).
- **embedded**: nobody answers, so this process opens the engine itself and also serves the RPC socket,
  so the CLI and a second ``mcp`` on the same state directory reach it; the socket is bound again if its
  file is removed, as ``serve``'s is (:func:`~._socket_watch.serve_socket`).

An engine that holds the state directory but does not answer yet (its start-up sweep after a crash, a
socket being bound again, a second client starting at the same moment) is waited for, as
``gadget-engine start`` waits (:data:`START_WAIT_SECONDS`), then forwarded to; one that stops or dies
before it answers leaves nobody answering, and this process embeds the engine.

An MCP client ends a stdio server by closing its stdin, waiting 2 s, then SIGTERM (and SIGKILL 2 s
later). When stdin closes (``stopping`` is logged), every request read before gets its answer within
1.5 s, calls still running cut short with their state so far (``_mcp_stdio``, ``_mcp_inflight``); then an
embedded engine stops in what is left of :data:`STOP_BY_SECONDS` (SIGINT, at most
:data:`SHUTDOWN_GRACE_SECONDS` of grace, SIGKILL), the socket is removed and ``stopped`` logged: the
process exits well inside the client's 2 s. Watched on-exit commands are left running, as at any
graceful stop, for the next engine. A kill requested by the agent keeps the configured grace.

The protocol owns stdin and stdout. Every child the engine starts gets ``/dev/null`` as its stdin and its
own log files (the guardian a pipe and its log file); the SDK also points fds 0 and 1 at ``/dev/null`` and
stderr while it serves. The engine's own log lines go to stderr.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
from typing import Any, Final

import attrs
import mcp_types as types
import trio
from mcp.server.lowlevel import Server

from .. import __version__
from .._cli_output import CommandFailedError
from .._cli_start import answering_engine
from .._config import EngineConfig
from .._engine import SERVE_START, Engine, ServeStart, open_engine
from .._errors import EngineLockedError
from .._lockfile import MCP, SERVING, mark_phase
from .._supervisor import RunState
from ._client import EngineClient
from ._eventlog import RunLogger, log_event, log_fired
from ._location import find_socket_path, lock_holder
from ._mcp_stdio import serve_stdio
from ._mcp_tools import EmbeddedBackend, McpTools, RpcBackend, SocketBackend
from ._methods import Methods
from ._server import RpcServer, _answers, _remove_socket, bind_socket, start_listening

__all__ = ["SHUTDOWN_GRACE_SECONDS", "START_WAIT_SECONDS", "STOP_BY_SECONDS", "serve_mcp"]

#: At shutdown (stdin closed): how long the engine's children get after SIGINT before SIGKILL, in seconds.
SHUTDOWN_GRACE_SECONDS: Final = 0.5
#: After stdin closed: by when every child has had SIGKILL, whatever the calls in flight took, in seconds.
STOP_BY_SECONDS: Final = 1.5
#: How long a start-up that lost the state directory's lock waits for the winner's socket, in seconds.
_LOCK_WAIT_SECONDS: Final = 5.0
#: How long a start-up waits for an engine that holds the state directory but does not answer yet (its
#: start-up sweep, a socket bound again) to answer, or for one that stops to exit, in seconds: what
#: ``gadget-engine start`` waits by default (``--wait-seconds``).
START_WAIT_SECONDS: Final = 30.0
#: How many times a start-up tries to embed the engine when each time another engine held the state
#: directory and went away before answering.
_EMBED_ATTEMPTS: Final = 3
_SERVER_NAME: Final = "gadget-engine"
_INSTRUCTIONS: Final = (
    "Process management for this project: start dev servers, watchers and test runs with the subprocess "
    "tool and read their logs; schedule follow-ups with cron_add (an on-exit job fires when a command "
    "ends) and read them with cron_events."
)


def _server(tools: McpTools) -> Server[Any]:
    async def list_tools(ctx: Any, params: types.PaginatedRequestParams | None) -> types.ListToolsResult:
        definitions = await tools.definitions()
        return types.ListToolsResult(
            tools=[
                types.Tool(name=d["name"], description=d["description"], input_schema=d["inputSchema"])
                for d in definitions
            ]
        )

    async def call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        text, is_error = await tools.call(params.name, params.arguments)
        return types.CallToolResult(content=[types.TextContent(text=text)], is_error=is_error)

    return Server(
        _SERVER_NAME,
        version=__version__,
        instructions=_INSTRUCTIONS,
        on_list_tools=list_tools,
        on_call_tool=call_tool,
    )


async def _serve_stdio(backend: RpcBackend, project_dir: str, mode: str) -> float:
    """Serve the tools on stdio until stdin closed and every request read is answered; when stdin
    closed, on the Trio clock."""
    tools = McpTools(backend=backend, project_dir=project_dir)
    closed_at = [0.0]

    def on_eof(unanswered: int) -> None:
        closed_at[0] = trio.current_time()
        log_event("stopping", reason="stdin closed", mode=mode, unanswered=unanswered)

    await serve_stdio(_server(tools), tools, on_eof=on_eof)
    return closed_at[0] or trio.current_time()


async def stop_quickly(engine: Engine, grace_seconds: float = SHUTDOWN_GRACE_SECONDS) -> None:
    """End every child of ``engine`` within about ``grace_seconds`` plus a reap, but the watched ones.

    Every subprocess is killed by the usual escalation; whatever still runs after ``grace_seconds`` gets
    SIGKILL at once (``Supervisor.cancel(force=True)``). ``open_engine`` then has nothing left to wait for.
    The commands of on-exit jobs are left running, unsignalled: leaving ``open_engine`` detaches them for
    the next engine (a graceful stop); one being ended on purpose (its job removed) gets SIGKILL too.

    Cancellation: shielded; the children are ended and reaped either way.
    """
    with trio.CancelScope(shield=True):
        async with trio.open_nursery() as nursery:

            async def force_after_grace() -> None:
                await trio.sleep(grace_seconds)
                for run in engine.supervisor.runs():
                    if not run.outlive_engine_crash or run.state is RunState.EXITING:  # ended on purpose
                        nursery.start_soon(functools.partial(engine.supervisor.cancel, run, force=True))

            nursery.start_soon(force_after_grace)
            await engine.service.kill_all()
            nursery.cancel_scope.cancel()


async def _serve_embedded(config: EngineConfig, project_dir: str) -> None:
    config = attrs.evolve(config, end_unclaimed_orphans=True)  # mcp owns its whole process
    state_dir = config.resolved_state_dir()
    SERVE_START.set(ServeStart(threading.Event(), kind=MCP))  # the lock says it listens once open
    async with open_engine(config) as engine:
        engine.supervisor.add_observer(RunLogger())  # spawned / exited lines on stderr, as serve logs them
        stop_by = None
        try:
            listener, path = await bind_socket(state_dir)
            with contextlib.suppress(OSError):  # what clients are told, not the service
                mark_phase(state_dir, SERVING, MCP)
            try:
                async with trio.open_nursery() as nursery:
                    server = RpcServer.from_config(Methods(engine, path, __version__), config)
                    # As serve does: the socket is bound again if its file is removed (NB-06).
                    await start_listening(nursery, server, listener, path, state_dir, nursery)
                    log_event("ready", pid=os.getpid(), mode="embedded", state_dir=state_dir, socket=path)
                    backend = EmbeddedBackend(Methods(engine, path, __version__))
                    stop_by = await _serve_stdio(backend, project_dir, "embedded") + STOP_BY_SECONDS
                    nursery.cancel_scope.cancel()
            finally:
                _remove_socket(state_dir, path)
        finally:
            left = SHUTDOWN_GRACE_SECONDS if stop_by is None else stop_by - trio.current_time()
            await stop_quickly(engine, max(0.0, min(SHUTDOWN_GRACE_SECONDS, left)))


async def _wait_for_socket(path: str) -> bool:
    with trio.move_on_after(_LOCK_WAIT_SECONDS):
        # Another process's socket gives no event to wait on: a bounded start-up poll.
        while not await _answers(path):  # noqa: ASYNC110
            await trio.sleep(0.05)
        return True
    return False


async def _wait_for_holder(state_dir: str) -> bool:
    """Wait for the engine that holds ``state_dir`` (this server could not take its lock) to answer, as
    ``gadget-engine start`` does (:func:`~engine._cli_start.answering_engine`): one in its start-up sweep
    or binding its socket again, up to :data:`START_WAIT_SECONDS`; one that stops, until it has exited.
    Whether it answers now; ``False`` when no engine holds the state directory any more (it stopped or
    died before answering): nobody answers, so the caller embeds the engine, as at any start-up.

    Cancellation: the wait is abandoned (its thread only looks at the state directory).

    Raises:
        EngineLockedError: it still does not answer after the wait (the message names it), or it is an
            engine embedded in another program, which never answers.
    """
    try:
        status = await trio.to_thread.run_sync(
            answering_engine, state_dir, START_WAIT_SECONDS, abandon_on_cancel=True
        )
    except CommandFailedError as exc:
        raise EngineLockedError(str(exc)) from None
    if status is not None:
        return True
    if lock_holder(state_dir) is None:
        return False
    # A holder that says nothing of itself: an engine between its open and its bind, or of an earlier version.
    if await _wait_for_socket(find_socket_path(state_dir)):
        return True
    holder = lock_holder(state_dir)
    if holder is None:
        return False
    raise EngineLockedError(
        f"an engine is running on {state_dir} as pid {holder}, but its socket is missing; "
        "it binds it again within 5 s: try again"
    )


async def serve_mcp(config: EngineConfig, project_dir: str) -> str:
    """Serve MCP on stdio until stdin closes; return the mode used: ``"forward"`` or ``"embedded"``.

    Forwards when an engine answers on the state directory's socket; else embeds one. When another
    engine holds the state directory without answering yet (a second client starting at the same moment,
    an engine in its start-up sweep, a serve binding its removed socket again), waits for it to answer
    (:func:`_wait_for_holder`) and forwards to it; should it stop or die first, embeds the engine.

    Args:
        config: the embedded engine's settings (its ``state_dir`` also locates a running engine).
        project_dir: the absolute project directory of the ``subprocess`` tool.

    Cancellation: the embedded engine stops as at the end of stdin.

    Raises:
        EngineLockedError: an engine holds the state directory but never answered on its socket, or it
            is an engine embedded in another program.
    """
    state_dir = config.resolved_state_dir()
    embedded = attrs.evolve(config, fire_observers=(*config.fire_observers, log_fired))
    attempts = 0
    while not await _answers(find_socket_path(state_dir)):
        attempts += 1
        try:
            await _serve_embedded(embedded, project_dir)
        except EngineLockedError:
            if await _wait_for_holder(state_dir):
                break
            # It ended without answering: nobody answers, so this server embeds the engine after all
            # (a lock nobody is seen holding, taken again each time, ends it: no busy loop).
            if attempts >= _EMBED_ATTEMPTS:
                raise
        else:
            log_event("stopped", pid=os.getpid(), mode="embedded")
            return "embedded"
    socket_path = find_socket_path(state_dir)
    # The engine answering must be this state directory's (``check_peer``): a copied state directory's
    # pointer names another engine's socket, and every call would then fail, each with a traceback.
    await trio.to_thread.run_sync(_connect_once, state_dir)
    log_event("ready", pid=os.getpid(), mode="forward", state_dir=state_dir, socket=socket_path)
    await _serve_stdio(SocketBackend(state_dir), project_dir, "forward")
    log_event("stopped", pid=os.getpid(), mode="forward")
    return "forward"


def _connect_once(state_dir: str) -> None:
    """Connect to the engine of ``state_dir`` and close.

    Raises:
        UntrustedPathError: the socket is not this user's engine's, or not ``state_dir``'s engine's.
        EngineNotRunningError: nobody answers any more.
    """
    with EngineClient(state_dir) as client:
        client.connect()


def main(config: EngineConfig, project_dir: str) -> str:
    """Run :func:`serve_mcp` in a new Trio run (the ``mcp`` subcommand); the mode it used."""
    sys.stdout.flush()
    return trio.run(serve_mcp, config, project_dir)
