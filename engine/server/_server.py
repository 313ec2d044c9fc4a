"""The standalone engine: ``open_engine`` on a state directory plus a JSON-RPC server on a Unix socket.

:func:`serve` is what ``gadget-engine serve`` runs. The socket is ``<state_dir>/engine.sock`` (mode 0600
in the 0700 state directory; see :mod:`._location` for long paths). Each connection is served by its own
task in the server's nursery, one request after the other; a connection that misbehaves (a peer of
another user, a request over ``EngineConfig.max_request_bytes``, no complete request within
``connection_idle_seconds``, a disconnect mid-request) is dropped alone, and over ``max_connections``
a new one is refused (``docs/security.md``).

Stopping (``docs/guide-cli.md`` has the table): SIGTERM, SIGHUP, a first SIGINT or the ``engine.stop``
method stop it gracefully (every child ended by escalation, watched on-exit commands left running for
the next engine); a second SIGINT, SIGTERM or SIGHUP during that stop sends SIGKILL to what is still
being ended (``Methods.stopping``). The connections stay open while the subprocesses are ended, so a request
waiting for one of them (a ``kill`` in its grace period, a ``wait``) gets its answer; a new request on
an open connection gets an error saying the engine is stopping. If the socket file is removed while it
runs, it is bound again (``_socket_watch``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import socket as stdlib_socket
import struct
import threading
from collections.abc import AsyncIterator
from typing import Final, final

import attrs
import trio

from .. import __version__
from .._config import EngineConfig
from .._engine import SERVE_START, Engine, ServeStart, open_engine
from .._errors import EngineError, EngineLockedError, unwrap_single
from .._lockfile import EMBEDDED, SERVING, STOPPING, mark_phase
from ._eventlog import RunLogger, log_event, log_fired
from ._location import (
    SOCKET_NAME,
    SOCKET_POINTER_NAME,
    choose_socket_path,
    lock_state,
    staging_socket_path,
)
from ._methods import InvalidParamsError, MethodNotFoundError, Methods
from ._protocol import (
    INTERNAL_ERROR,
    INVALID_PARAMS,
    INVALID_REQUEST,
    MAX_LINE_BYTES,
    METHOD_NOT_FOUND,
    ProtocolError,
    encode_error,
    encode_result,
    error_from_exception,
    parse_request,
)
from ._socket_watch import serve_socket
from ._stopping import STOP_SIGNALS, StopRequest, end_subprocesses, force_on_next_signal, stop_while_starting

__all__ = ["RpcServer", "serve"]

_PEERCRED: Final = struct.Struct("3i")  # struct ucred: pid, uid, gid
_RECEIVE_BYTES: Final = 64 * 1024
#: How long a start-up waits for an answer on a leftover socket before calling it stale, in seconds.
_PROBE_SECONDS: Final = 1.0
#: At a stop, once every subprocess has ended: how long the requests still being answered get to finish
#: before their connections close, in seconds.
_ANSWER_SECONDS: Final = 1.0
#: The methods still answered once the engine stops (they only read, and never wait): a ``log -f`` keeps
#: reading what the children write while the stop ends them, and ``status`` tells a client it stops.
READS_WHILE_STOPPING: Final = frozenset(
    {
        "status",
        "subprocess.read_log",
        "subprocess.summarize",
        "subprocess.list",
        "subprocess.stats",
        "cron.list",
        "cron.get",
        "events",
        "tool.definition",
    }
)
#: At a stop, once every subprocess has ended: how long open connections get for their last reads before
#: the answer window (a ``log -f`` reads every 0.25 s: what a process wrote as it ended is read), in seconds.
_LAST_READS_SECONDS: Final = 0.5
#: How long the error line sent before a refused connection is closed may wait for the peer, in seconds.
_LAST_WORD_SECONDS: Final = 1.0
#: Refused connections (over ``max_connections``) are logged at most once per this many seconds.
_REFUSAL_LOG_SECONDS: Final = 10.0


def peer_credentials(sock: trio.socket.SocketType) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process at the other end of a connected Unix socket (``SO_PEERCRED``)."""
    raw = sock.getsockopt(stdlib_socket.SOL_SOCKET, stdlib_socket.SO_PEERCRED, _PEERCRED.size)
    pid, uid, gid = _PEERCRED.unpack(raw)
    return pid, uid, gid


@final
@attrs.define(eq=False)
class RpcServer:
    """Serves newline-delimited JSON-RPC 2.0 over accepted connections.

    Each limit is a setting (``EngineConfig``, see :meth:`from_config`); a connection over one gets one
    error line (``INVALID_REQUEST``, id ``null``) saying which, and is closed.

    Attributes:
        methods: the method table requests are dispatched to.
        max_line_bytes: the longest request line accepted, in bytes.
        allowed_uid: the only peer uid served (``SO_PEERCRED``); others are dropped unanswered.
        max_connections: connections served at once.
        idle_seconds: how long a connection may take to send a complete request, counted from its start
            or its last answer (while a request is being answered, the clock stops), in seconds; also
            the longest an answer may wait for the peer to read it.
    """

    methods: Methods
    max_line_bytes: int = MAX_LINE_BYTES
    allowed_uid: int = attrs.field(factory=os.getuid)
    max_connections: int = 128
    idle_seconds: float = 60.0
    _active: int = attrs.field(init=False, default=0)
    _refusals: int = attrs.field(init=False, default=0)
    _refusal_logged_at: float = attrs.field(init=False, default=-math.inf)
    _answering: int = attrs.field(init=False, default=0)
    _idle: trio.Event = attrs.field(init=False, factory=trio.Event)

    def refuse_new_requests(self) -> None:
        """From now on (the engine stops), answer each new request with an error saying so, unrun, but
        the reads of :data:`READS_WHILE_STOPPING` (until the connections close).

        The requests already being answered go on. The error is an ``EngineError`` (code ``-32000``)
        with ``data: {"type": "EngineStoppingError", "pid": ...}``; the clients raise
        ``EngineStoppingError`` for it, as for a connection refused while the engine stops.
        """
        self.methods.stopping = True

    @property
    def open_connections(self) -> int:
        """How many connections are being served now."""
        return self._active

    async def wait_idle(self) -> None:
        """Wait until no request is being answered (every answer under way is sent).

        Cancellation: safe; nothing changes.
        """
        while self._answering:
            await self._idle.wait()
        await trio.lowlevel.checkpoint()

    @classmethod
    def from_config(cls, methods: Methods, config: EngineConfig) -> RpcServer:
        """A server with the socket limits of ``config`` (``max_connections``,
        ``connection_idle_seconds``, ``max_request_bytes``)."""
        return cls(
            methods,
            max_line_bytes=config.max_request_bytes,
            max_connections=config.max_connections,
            idle_seconds=config.connection_idle_seconds,
        )

    async def handle_connection(self, stream: trio.SocketStream) -> None:
        """Serve one connection until its peer closes it; never raises but ``Cancelled``.

        Cancellation: the connection is closed; a request under way is cancelled as its method is.
        """
        try:
            async with stream:
                pid, uid, _gid = peer_credentials(stream.socket)
                if uid != self.allowed_uid:  # another user hears nothing, not even the limits
                    log_event("peer_refused", level=logging.WARNING, peer_pid=pid, peer_uid=uid)
                    return
                if self._active >= self.max_connections:
                    await self._refuse_busy(stream)
                    return
                self._active += 1
                try:
                    await self._serve_requests(stream)
                finally:
                    self._active -= 1
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the peer went away, mid-request or not: only this connection ends
        except Exception:
            logging.getLogger("engine.serve").exception("a connection failed")

    async def _refuse_busy(self, stream: trio.SocketStream) -> None:
        self._refusals += 1
        now = trio.current_time()
        if now - self._refusal_logged_at >= _REFUSAL_LOG_SECONDS:  # a flood gives one line per period
            log_event(
                "connection_refused",
                level=logging.WARNING,
                reason="too many connections",
                limit=self.max_connections,
                refused=self._refusals,
            )
            self._refusal_logged_at, self._refusals = now, 0
        message = (
            f"too many connections: the engine serves at most {self.max_connections} at once "
            "(EngineConfig.max_connections); the connection is closed, try again later"
        )
        await self._send_last(stream, message)

    async def _send_last(self, stream: trio.SocketStream, message: str) -> None:
        """Send one error line, then close as a lingering close does, all within a second.

        After the line, the write side is shut and whatever the peer still sends is read and dropped
        until it closes: a client that wrote its request after the line was sent (a refusal sent at once
        on accept) then gets the line, not a broken pipe that hides it.
        """
        with trio.move_on_after(_LAST_WORD_SECONDS):
            await stream.send_all(encode_error(None, INVALID_REQUEST, message))
            await stream.send_eof()
            while await stream.receive_some(_RECEIVE_BYTES):
                pass

    async def _serve_requests(self, stream: trio.SocketStream) -> None:
        buffer = bytearray()
        scanned = 0
        deadline = trio.current_time() + self.idle_seconds
        while True:
            newline = buffer.find(b"\n", scanned)
            if newline < 0:
                if len(buffer) > self.max_line_bytes:
                    await self._refuse_too_large(stream)
                    return
                scanned = len(buffer)
                with trio.move_on_at(deadline):
                    data = await stream.receive_some(_RECEIVE_BYTES)
                    if not data:
                        return  # the peer closed; a partial request is dropped
                    buffer += data
                    continue
                await self._refuse_idle(stream, partial=bool(buffer))
                return
            if newline > self.max_line_bytes:
                await self._refuse_too_large(stream)
                return
            line = bytes(buffer[:newline])
            del buffer[: newline + 1]
            scanned = 0
            if not line.strip():
                continue
            self._answering += 1
            try:
                response = await self.respond(line)
                if response is not None:
                    with trio.move_on_after(self.idle_seconds) as sending:
                        await stream.send_all(response)
                    if sending.cancelled_caught:
                        log_event("connection_closed", level=logging.WARNING, reason="answer not read")
                        return
            finally:
                self._answering -= 1
                if not self._answering:
                    self._idle.set()
                    self._idle = trio.Event()
            deadline = trio.current_time() + self.idle_seconds

    async def _refuse_idle(self, stream: trio.SocketStream, *, partial: bool) -> None:
        what = "complete request" if partial else "request"
        log_event("connection_closed", level=logging.WARNING, reason="idle", idle_seconds=self.idle_seconds)
        message = (
            f"no {what} within {self.idle_seconds:g} s (EngineConfig.connection_idle_seconds); "
            "the connection is closed"
        )
        await self._send_last(stream, message)

    async def _refuse_too_large(self, stream: trio.SocketStream) -> None:
        log_event("request_too_large", level=logging.WARNING, limit_bytes=self.max_line_bytes)
        message = (
            f"request larger than {self.max_line_bytes} bytes (EngineConfig.max_request_bytes); "
            "the connection is closed"
        )
        await self._send_last(stream, message)

    async def respond(self, line: bytes) -> bytes | None:
        """The response line to one request line, or ``None`` for a notification.

        Cancellation: as the method called.
        """
        try:
            request = parse_request(line)
        except ProtocolError as exc:
            await trio.lowlevel.checkpoint()
            return encode_error(exc.request_id, exc.code, exc.message)
        if self.methods.stopping and request.method not in READS_WHILE_STOPPING:
            await trio.lowlevel.checkpoint()
            return None if request.notification else self._refuse_stopping(request.id, request.method)
        try:
            result = await self.methods.call(request.method, request.params)
            response = encode_result(request.id, result)
        except MethodNotFoundError as exc:
            response = encode_error(request.id, METHOD_NOT_FOUND, str(exc))
        except InvalidParamsError as exc:
            response = encode_error(request.id, INVALID_PARAMS, f"invalid params: {exc}")
        except EngineError as exc:
            response = encode_error(request.id, *error_from_exception(exc))
        except (ValueError, TypeError) as exc:  # a value the engine itself refused
            response = encode_error(request.id, INVALID_PARAMS, f"invalid params: {exc}")
        except Exception as exc:
            logging.getLogger("engine.serve").exception("method %s failed", request.method)
            message = f"internal error: {type(exc).__name__}: {exc}"
            response = encode_error(request.id, INTERNAL_ERROR, message)
        return None if request.notification else response

    def _refuse_stopping(self, request_id: str | int | None, method: str) -> bytes:
        """The error line a request gets once the engine stops (:meth:`refuse_new_requests`)."""
        pid = os.getpid()
        message = (
            f"the engine on {self.methods.engine.state_dir} (pid {pid}) is stopping and takes no new "
            f"requests ({method} was not run); try again once it has stopped"
        )
        code, message, _ = error_from_exception(EngineError(message))
        return encode_error(request_id, code, message, {"type": "EngineStoppingError", "pid": pid})


async def _answers(path: str) -> bool:
    """Whether something accepts connections on the socket ``path``."""
    with trio.socket.socket(stdlib_socket.AF_UNIX, stdlib_socket.SOCK_STREAM) as probe:
        with trio.move_on_after(_PROBE_SECONDS):
            try:
                await probe.connect(path)
            except OSError:
                return False
            return True
    return True  # connect hung: a live but busy listener


def _write_pointer(state_dir: str, path: str) -> None:
    pointer = os.path.join(state_dir, SOCKET_POINTER_NAME)
    if path == os.path.join(state_dir, SOCKET_NAME):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(pointer)
        return
    temp = pointer + ".tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(temp)  # a leftover (or a link someone put there): never written through
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(path + "\n")
    os.replace(temp, pointer)


async def bind_socket(state_dir: str) -> tuple[trio.SocketListener, str]:
    """Make the state directory private (0700) and listen on its socket (0600); return it and its path.

    Called with the state directory's lock held, so a socket file already there is a leftover of an
    engine that is gone: it is replaced, unless something still answers on it.

    Cancellation: nothing is bound if cancelled before the bind.

    Raises:
        EngineLockedError: something answers on the socket path.
        OSError: the socket cannot be made.
    """
    path, leftover = await trio.to_thread.run_sync(_prepare, state_dir)
    if leftover and await _answers(path):
        raise EngineLockedError(f"something already answers on {path}; stop it or use another --state-dir")
    staging = staging_socket_path(path)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(staging)  # left by a bind cut short
    _write_pointer(state_dir, path)
    sock = trio.socket.socket(stdlib_socket.AF_UNIX, stdlib_socket.SOCK_STREAM)
    try:
        # Bound, made private and listening under another name, then renamed over the path in one
        # step: the path never names a socket of this engine that refuses connections, so a client
        # refused there is refused by a leftover (this engine starts) or by a stop (it stopped listening).
        await sock.bind(staging)
        os.chmod(staging, 0o600)  # the 0700 directory keeps everyone else out meanwhile
        sock.listen(128)
        os.rename(staging, path)
    except BaseException:
        sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(staging)
        raise
    if leftover:
        log_event("stale_socket_replaced", socket=path)
    return trio.SocketListener(sock), path


def _prepare(state_dir: str) -> tuple[str, bool]:
    os.chmod(state_dir, 0o700)
    path = choose_socket_path(state_dir)
    return path, os.path.lexists(path)


def _remove_socket(state_dir: str, path: str) -> None:
    for leftover in (path, os.path.join(state_dir, SOCKET_POINTER_NAME)):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(leftover)


def _lock_holder(state_dir: str) -> str:
    """Who holds the state directory: the lock's holder, else the pid its line names, else unknown; an
    engine embedded in another program (``open_engine``, which listens on no socket) is named so."""
    lock = lock_state(state_dir)
    pid = None if lock is None else lock.holder or lock.written
    if not pid:
        return "pid unknown"
    embedded = lock is not None and lock.own_line and lock.kind == EMBEDDED
    return f"pid {pid}, embedded in another program" if embedded else f"pid {pid}"


async def _bind_socket_again(state_dir: str) -> trio.SocketListener:
    """:func:`bind_socket` once more, for :func:`~._socket_watch.serve_socket` when the socket file went
    away: the same path (it depends on the state directory alone); the new listener.

    Cancellation: nothing is bound if cancelled before the bind.

    Raises:
        EngineLockedError: something else answers on the socket path.
        OSError: the socket cannot be made.
    """
    listener, _ = await bind_socket(state_dir)
    return listener


async def start_listening(
    nursery: trio.Nursery,
    server: RpcServer,
    listener: trio.SocketListener,
    path: str,
    state_dir: str,
    connections: trio.Nursery,
) -> None:
    """Start answering on ``listener`` (bound at ``path`` by :func:`bind_socket`) in ``nursery``: each
    connection is ``server``'s, in ``connections``; the socket is bound again if its file is removed
    (:func:`~._socket_watch.serve_socket`, NB-06). ``serve`` and ``mcp``'s embedded engine listen so.

    Cancellation: cancel ``nursery`` to stop listening; the connections are ``connections``'.
    """
    await nursery.start(
        serve_socket,
        server.handle_connection,
        listener,
        path,
        functools.partial(_bind_socket_again, state_dir),
        connections,
    )


async def _serve_until_stopped(
    engine: Engine,
    config: EngineConfig,
    state_dir: str,
    signals: AsyncIterator[int],
    stopping: trio.Nursery,
    bound: list[str],
    task_status: trio.TaskStatus[str],
) -> None:
    """Serve the socket until a stop is asked, then close it and every connection (``serve``'s body).

    At the stop: no new connection (the listener closes) and no new request but the reads of
    :data:`READS_WHILE_STOPPING` (each other gets the stopping error); every subprocess is ended by
    escalation (:func:`end_subprocesses`) while the connections stay open, so that the requests waiting
    for those ends (a ``kill`` in its grace period, a ``wait``, a ``kill-all``) are answered and a
    follower reads what the processes wrote as they ended (:data:`_LAST_READS_SECONDS` more while a
    connection is open); the requests still under way then get up to :data:`_ANSWER_SECONDS` before
    every connection closes. A request that waits for something the stop does not end
    (``events.wait``) is ended with its connection.

    From the stop on, a further signal forces it (:func:`force_on_next_signal`, started in ``stopping``):
    the subprocesses get SIGKILL at once, and the requests waiting for them are answered right after.
    The socket's path goes into ``bound``: its file stays until the engine has closed (``serve`` removes
    it), so that meanwhile clients are refused and say the engine is stopping.
    """
    listener, path = await bind_socket(state_dir)
    bound.append(path)
    stop = StopRequest()
    server = RpcServer.from_config(Methods(engine, path, __version__, stop=stop.by_method), config)
    async with trio.open_nursery() as connections:
        async with trio.open_nursery() as listening:
            await start_listening(listening, server, listener, path, state_dir, connections)
            with contextlib.suppress(OSError):  # what clients are told (``_lockfile``), not the service
                mark_phase(state_dir, SERVING)
            log_event("ready", pid=os.getpid(), state_dir=state_dir, socket=path, version=__version__)
            task_status.started(path)
            reason = await stop.wait(signals)
            server.refuse_new_requests()
            with contextlib.suppress(OSError):
                mark_phase(state_dir, STOPPING)
            log_event("stopping", **reason, pid=os.getpid())
            engine.cron.stop_timer()  # a job due during the stop runs once on the next engine
            stopping.start_soon(force_on_next_signal, signals, engine.supervisor)
            listening.cancel_scope.cancel()
        # Bounded by the escalation (grace, SIGKILL, the wait after it), or at once by a second signal.
        await end_subprocesses(engine.service, engine.supervisor)
        if server.open_connections:  # a follower's last read of what the ended processes wrote
            await trio.sleep(_LAST_READS_SECONDS)
        with trio.move_on_after(_ANSWER_SECONDS):
            await server.wait_idle()
        connections.cancel_scope.cancel()


async def serve(
    config: EngineConfig, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
) -> None:
    """Run the standalone engine on ``config``'s state directory until asked to stop.

    Starts :func:`open_engine` (with an observer that logs every fire), listens on the socket (bound
    again if its file is removed: :func:`serve_socket`), and on the first SIGTERM, SIGHUP or SIGINT, or
    the ``engine.stop`` method, stops gracefully: it logs ``stopping``, stops listening, answers each
    new request with an error saying it stops, ends every subprocess by escalation while the requests
    waiting for those ends are answered, lets the requests still under way finish (a second at most),
    closes every connection and closes the engine. Every child is ended by escalation and reaped, but
    the commands of on-exit jobs: those are left running for the next engine (``engine.stop`` with
    ``end_watched`` first ends them on purpose). A further signal during that stop sends SIGKILL at once
    (:func:`force_on_next_signal`); more are absorbed. ``stopped`` is logged at the end.

    A stop signal before it listens (while ``open_engine`` ends what a crashed engine left: the start-up
    sweep) closes the engine as soon as the sweep is over, without listening; a further one ends the
    sweep's grace period (:func:`~._stopping.stop_while_starting`). The lock file says the engine's phase
    to clients as it goes (``_lockfile``: ``serving`` once it listens, ``stopping`` at the stop).

    Cancellation: the same stop as a signal; then the cancellation propagates.

    Raises:
        EngineLockedError: another engine runs on the state directory (the message names its pid).
        OSError: the socket cannot be made.
    """
    config = attrs.evolve(config, end_unclaimed_orphans=True)  # serve owns its whole process
    state_dir = config.resolved_state_dir()
    config = attrs.evolve(config, fire_observers=(*config.fire_observers, log_fired))
    entered = False
    bound: list[str] = []  # the socket this serve made, removed once its engine has closed
    force_sweep = threading.Event()
    SERVE_START.set(ServeStart(force_sweep))  # this task's context, which open_engine reads
    with trio.open_signal_receiver(*STOP_SIGNALS) as signals:
        try:
            try:
                async with trio.open_nursery() as stopping:  # outlives open_engine: a second signal forces
                    with trio.CancelScope() as start:  # a signal before it listens: it closes, unserved
                        watching = trio.CancelScope()

                        async def watch_while_starting() -> None:
                            with watching:
                                await stop_while_starting(signals, start, force_sweep, state_dir)

                        stopping.start_soon(watch_while_starting)
                        async with open_engine(config) as engine:
                            entered = True
                            watching.cancel()  # from here on, the stop's own signal handling
                            engine.supervisor.add_observer(RunLogger())
                            await _serve_until_stopped(
                                engine, config, state_dir, signals, stopping, bound, task_status
                            )
                    stopping.cancel_scope.cancel()
            except BaseExceptionGroup as group:
                unwrap_single(group)
            finally:
                for path in bound:
                    _remove_socket(state_dir, path)
        except EngineLockedError:
            if entered:
                raise
            raise EngineLockedError(
                f"an engine is already running on {state_dir} ({_lock_holder(state_dir)})"
            ) from None
        log_event("stopped", pid=os.getpid(), state_dir=state_dir)
