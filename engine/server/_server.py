"""The standalone engine: ``open_engine`` on a state directory plus a JSON-RPC server on a Unix socket.

:func:`serve` is what ``gadget-engine serve`` runs. The socket is ``<state_dir>/engine.sock`` (mode 0600
in the 0700 state directory; see :mod:`._location` for long paths). Each connection is served by its own
task in the server's nursery, one request after the other; a connection that misbehaves (a peer of
another user, a request over ``EngineConfig.max_request_bytes``, no complete request within
``connection_idle_seconds``, a disconnect mid-request) is dropped alone, and over ``max_connections``
a new one is refused (``docs/security.md``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import socket as stdlib_socket
import struct
from typing import Final, final

import attrs
import trio

from .. import __version__
from .._config import EngineConfig
from .._engine import open_engine
from .._errors import EngineError, EngineLockedError
from .._trust import open_own_file
from ._eventlog import RunLogger, log_event, log_fired
from ._location import SOCKET_NAME, SOCKET_POINTER_NAME, choose_socket_path
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

__all__ = ["RpcServer", "serve"]

_PEERCRED: Final = struct.Struct("3i")  # struct ucred: pid, uid, gid
_RECEIVE_BYTES: Final = 64 * 1024
#: How long a start-up waits for an answer on a leftover socket before calling it stale, in seconds.
_PROBE_SECONDS: Final = 1.0
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
        """Send one error line before the connection is closed, if the peer takes it within a second."""
        with trio.move_on_after(_LAST_WORD_SECONDS):
            await stream.send_all(encode_error(None, INVALID_REQUEST, message))

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
            response = await self.respond(line)
            if response is not None:
                with trio.move_on_after(self.idle_seconds) as sending:
                    await stream.send_all(response)
                if sending.cancelled_caught:
                    log_event("connection_closed", level=logging.WARNING, reason="answer not read")
                    return
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
    if leftover:
        if await _answers(path):
            raise EngineLockedError(
                f"something already answers on {path}; stop it or use another --state-dir"
            )
        os.unlink(path)
        log_event("stale_socket_replaced", socket=path)
    _write_pointer(state_dir, path)
    sock = trio.socket.socket(stdlib_socket.AF_UNIX, stdlib_socket.SOCK_STREAM)
    try:
        await sock.bind(path)
        os.chmod(path, 0o600)  # the 0700 directory keeps everyone else out meanwhile
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
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
    try:
        fd = open_own_file(os.path.join(state_dir, "lock"), os.O_RDONLY, what="the lock")
        with os.fdopen(fd, "rb") as f:
            pid = f.read(64).decode("ascii", "replace").strip()
    except OSError:
        pid = ""
    return f"pid {pid}" if pid.isdigit() else "pid unknown"


async def serve(
    config: EngineConfig, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
) -> None:
    """Run the standalone engine on ``config``'s state directory until SIGINT or SIGTERM.

    Starts :func:`open_engine` (with an observer that logs every fire), listens on the socket, and on
    the first SIGINT or SIGTERM stops listening, ends every connection and closes the engine: every
    child is ended by escalation and reaped. Signals that arrive during the shutdown are absorbed.

    Cancellation: the same shutdown as a signal; then the cancellation propagates.

    Raises:
        EngineLockedError: another engine runs on the state directory (the message names its pid).
        OSError: the socket cannot be made.
    """
    state_dir = config.resolved_state_dir()
    config = attrs.evolve(config, fire_observers=(*config.fire_observers, log_fired))
    entered = False
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        try:
            async with open_engine(config) as engine:
                entered = True
                engine.supervisor.add_observer(RunLogger())
                listener, path = await bind_socket(state_dir)
                try:
                    server = RpcServer.from_config(Methods(engine, path, __version__), config)
                    async with trio.open_nursery() as nursery:
                        await nursery.start(trio.serve_listeners, server.handle_connection, [listener])
                        log_event(
                            "ready", pid=os.getpid(), state_dir=state_dir, socket=path, version=__version__
                        )
                        task_status.started(path)
                        async for signum in signals:
                            log_event("stopping", signal=signal.Signals(signum).name)
                            break
                        nursery.cancel_scope.cancel()
                finally:
                    _remove_socket(state_dir, path)
        except EngineLockedError:
            if entered:
                raise
            raise EngineLockedError(
                f"an engine is already running on {state_dir} ({_lock_holder(state_dir)})"
            ) from None
        log_event("stopped", pid=os.getpid(), state_dir=state_dir)
