"""Clients of a running ``gadget-engine serve``, synchronous and asyncio, on the standard library only.

::

    with EngineClient("/path/to/state") as client:
        pid = client.call("subprocess.create", project="/my/app", command="npm", args=["run", "dev"])["pid"]
        print(client.call("subprocess.read_log", pid=pid, tail=20)["text"])

    async with AsyncEngineClient("/path/to/state") as client:
        print(await client.call("subprocess.list"))

Errors come back as the engine's own exception classes (``SubProcessNotFoundError``, ``SpawnError``...),
mapped from the JSON-RPC error code; the standard JSON-RPC errors raise :class:`RpcError`. A client never
starts an engine: with none running, :class:`EngineNotRunningError` is raised.

Nothing here imports Trio (see ``docs/rpc.md`` for importing the clients where Trio is not installed).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import select
import socket
import stat
import struct
import time
from types import TracebackType
from typing import Any

from .._errors import EngineError, UntrustedPathError
from .._lockfile import EMBEDDED, OPEN, STARTING, STOPPING
from .._trust import what_it_is
from ._location import (
    SOCKET_NAME,
    SOCKET_POINTER_NAME,
    LockState,
    find_socket_path,
    lock_holder,
    lock_state,
    resolve_state_dir,
)
from ._protocol import RpcError, decode_line, encode_request, exception_from_error

__all__ = [
    "OUTPUT_GONE_EVENTS",
    "SUSPENDED_LOOK_SECONDS",
    "AsyncEngineClient",
    "EngineClient",
    "EngineConnectionError",
    "EngineNotRunningError",
    "EngineSocketMissingError",
    "EngineStartingError",
    "EngineStoppingError",
    "EngineSuspendedError",
    "RpcError",
]

#: The longest response line the client accepts, in bytes.
MAX_RESPONSE_BYTES = 256 * 1024 * 1024
#: How often a blocking read looks again, so that a Ctrl-C is raised (``EngineClient._wait_readable``).
_SIGNAL_LOOK_SECONDS = 0.25
#: How long a call waits for its answer before it looks whether the engine's process is stopped, in
#: seconds (:class:`EngineSuspendedError`).
SUSPENDED_LOOK_SECONDS = 1.0
#: What ``poll`` reports on an output descriptor once its reader went away: ``POLLERR`` on the write end of
#: a pipe whose reader closed (Linux), ``POLLHUP`` on a socket or terminal that hung up
#: (:meth:`EngineClient.call_watching`).
OUTPUT_GONE_EVENTS = select.POLLERR | select.POLLHUP


class EngineNotRunningError(EngineError, ConnectionError):
    """Raised by :meth:`EngineClient.connect` when no engine answers on the state directory's socket."""


class EngineConnectionError(EngineError, ConnectionError):
    """Raised by :meth:`EngineClient.call` when the connection breaks before the answer arrives.

    The engine closes the connection of a client of another user at once, and every connection when it
    stops.
    """


class EngineSuspendedError(EngineError):
    """Raised by :meth:`EngineClient.call` when the engine's process is stopped (SIGSTOP, Ctrl-Z in its
    terminal) while the call waits for its answer: it answers nothing until it is continued (``kill -CONT``).
    Looked at after :data:`SUSPENDED_LOOK_SECONDS` of waiting, then every 0.25 s.

    Attributes:
        pid: the engine's pid.
    """

    def __init__(self, message: str, pid: int) -> None:
        super().__init__(message)
        self.pid = pid


_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def check_peer(sock: socket.socket, path: str, state_dir: str | None = None) -> int:
    """Refuse a socket whose listener runs as another user (``SO_PEERCRED``), or is not the engine of
    ``state_dir`` (the process holding its lock, ``lock_holder``), before anything is sent; the
    listener's pid.

    A request can carry secrets (``-e API_TOKEN=...``): it goes only to an engine of this user. And a
    ``stop`` or ``kill`` goes only to the engine of the state directory it names: a copied state
    directory's ``engine.sock.path`` (or an ``engine.sock`` link) names another engine's socket.

    Raises:
        UntrustedPathError: the engine at ``path`` runs as another uid, or is not ``state_dir``'s.
    """
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    pid, uid, _gid = _PEERCRED.unpack(raw)
    if uid != os.geteuid():
        raise UntrustedPathError(
            f"the socket {path} is served by pid {pid} of uid {uid}, not by this user (uid "
            f"{os.geteuid()}); a client talks only to an engine of its own user: use your own --state-dir"
        )
    if state_dir is not None and (holder := lock_holder(state_dir)) != pid:
        if holder is not None:
            raise UntrustedPathError(
                f"the socket {path} is served by pid {pid}, not by the engine of {state_dir} (pid {holder}): "
                f"its {SOCKET_POINTER_NAME} or {SOCKET_NAME} names another engine's socket; remove it, and "
                "that engine binds its own socket again within 5 s"
            )
        raise UntrustedPathError(
            f"the socket {path} is served by pid {pid}, not by the engine of {state_dir} (no engine runs "
            f"there): its {SOCKET_POINTER_NAME} or {SOCKET_NAME} names another engine's socket (a copied "
            "state directory?); remove it, then start the engine again (or, if pid "
            f"{pid} is this state directory's engine and its lock file was removed, stop it by its pid)"
        )
    return int(pid)


def _stale(sock: Any) -> bool:
    """Whether a kept connection is readable between calls: the engine closed it (its idle timeout,
    with a line saying so) or sent something nobody asked for. Either way: reconnect before sending."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)


class EngineSocketMissingError(EngineError, ConnectionError):
    """Raised by :meth:`EngineClient.connect` when an engine holds the state directory but nothing answers
    on its socket (its socket file was removed, or something that is not a socket took its place: the
    engine binds it again within seconds of the path being free).

    Attributes:
        pid: the engine's pid.
        blocked: a directory is at the socket path: the engine cannot bind its socket over it (it
            replaces a file, a FIFO or a link at once), so waiting for it to answer is in vain until the
            directory is removed.
    """

    def __init__(self, message: str, pid: int, *, blocked: bool = False) -> None:
        super().__init__(message)
        self.pid = pid
        self.blocked = blocked


class EngineStoppingError(EngineSocketMissingError, EngineConnectionError):
    """Raised by :meth:`EngineClient.connect` when the engine that holds the state directory refuses
    connections on its socket file: it is stopping (it stops listening first, and removes the file last);
    and by :meth:`EngineClient.call` when the engine answers a request sent on a connection opened before
    its stop with an error saying it stops (the request was not run). It is an
    :class:`EngineConnectionError` too: the engine is going away, as when it closes the connection.

    Attributes:
        pid: the engine's pid.
    """


class EngineStartingError(EngineSocketMissingError):
    """Raised by :meth:`EngineClient.connect` when the engine that holds the state directory does not
    listen yet: its lock file says it is starting, or the socket file there refused and is older than the
    lock file's last write (a leftover of an engine that ended without removing it: a crash, ``kill -9``).
    An engine that starts after a crash first ends what the crashed one left running (the start-up sweep:
    up to its grace period, then SIGKILL and the kill wait) and binds its socket after that;
    ``gadget-engine start`` waits for it to answer, ``stop`` asks it to stop once the sweep is over. An
    engine embedded in another program (``open_engine``) never listens.

    Attributes:
        pid: the engine's pid.
    """


def _socket_made(path: str) -> int | None:
    """The change time of the socket file at ``path`` (ns), or ``None``: read before a connect, so that a
    refusal is told by the file that refused (an engine that starts renames its own over it)."""
    try:
        return os.stat(path, follow_symlinks=False).st_ctime_ns
    except OSError:
        return None


def _not_a_socket(path: str) -> tuple[str, bool] | None:
    """What is at ``path`` when it is not a socket, for a message (``"is a directory"``, ``"is a symbolic
    link to a FIFO"``), and whether it is a directory itself (an engine cannot bind its socket over one;
    it replaces anything else at once); ``None``: a socket, a symbolic link to one, or nothing at all.

    One ``lstat``: a symbolic link is named as one, with what it leads to. A link to a socket is left to
    the connect and :func:`check_peer`, as before (they follow it and judge who answers there).
    """
    try:
        info = os.lstat(path)
    except OSError:
        return None
    if stat.S_ISSOCK(info.st_mode):
        return None
    if not stat.S_ISLNK(info.st_mode):
        return f"is {what_it_is(info.st_mode)}", stat.S_ISDIR(info.st_mode)
    try:
        target = os.stat(path)
    except OSError:
        return "is a symbolic link that leads to nothing", False
    if stat.S_ISSOCK(target.st_mode):
        return None
    return f"is a symbolic link to {what_it_is(target.st_mode)}", False


def _phase(lock: LockState, *, refused: bool) -> str:
    """The lock holder's phase (``_lockfile``). Before it has written its pid: ``starting`` when a socket
    file refused (an engine that has just taken the lock, the crashed one's socket still there), else
    unknown (``""``: a holder that writes nothing is not an engine that starts)."""
    if lock.own_line:
        return lock.phase
    return STARTING if refused else ""


def _kind(lock: LockState) -> str:
    """The lock holder's kind (``serve``, ``embedded``), or ``""`` when the line is not its own."""
    return lock.kind if lock.own_line else ""


def _not_running(
    state_dir: str, path: str, *, refused: bool = False, made: int | None = None
) -> EngineNotRunningError | EngineSocketMissingError | EngineSuspendedError:
    """What a failed connect to ``path`` means; ``made``: the socket file's change time read before it
    (:func:`_socket_made`).

    The lock file says the holder's phase and kind: an engine embedded in another program never listens;
    ``starting`` (its start-up sweep) and ``stopping`` hold whether the socket file is there or not. A
    ``serve`` that is open but not listening yet (``open``, or an earlier version's pid alone) is starting
    when the file that refused is older than the lock file's last write: a leftover of an engine that
    ended without removing it (``serve`` binds its own after that write).

    Something other than a socket at ``path`` (a directory, a file, a FIFO: each refuses a connect as a
    stopping engine's socket does) is named, unless the engine says it stops: with an engine holding the
    state directory, :class:`EngineSocketMissingError` (it runs, but no client reaches it until the path
    is free: exit 1, as for its socket missing), else :class:`EngineNotRunningError` (exit 3).
    """
    lock = lock_state(state_dir)
    pid = None if lock is None else lock.holder
    if pid is not None and _suspended(pid):  # starting, stopping or its socket lost: it does nothing now
        return _suspended_error(state_dir, pid, sent=False)
    phase = "" if lock is None or pid is None else _phase(lock, refused=refused)
    leftover = refused and made is not None and lock is not None and made < lock.written_ns
    if lock is not None and pid is not None and _kind(lock) == EMBEDDED and phase != STOPPING:
        return EngineSocketMissingError(
            f"an engine embedded in another program runs on {state_dir} as pid {pid} and listens on no "
            "socket: this client cannot reach it (stop that program, or use another --state-dir)",
            pid,
        )
    found = _not_a_socket(path)
    if found is not None and phase != STOPPING:
        there, blocked = found
        if pid is not None:
            return EngineSocketMissingError(
                f"{path} {there}, not an engine's socket: the engine on {state_dir} (pid {pid}) cannot be "
                "reached through it; remove it, and the engine binds its socket there again within 5 s",
                pid,
                blocked=blocked,
            )
        return EngineNotRunningError(
            f"{path} {there}, not an engine's socket, and no engine is running on {state_dir}: remove it "
            f"(serve refuses to start beside it); start one with: gadget-engine --state-dir {state_dir} start"
        )
    if pid is not None and (phase == STARTING or (phase in (OPEN, "") and leftover)):
        return EngineStartingError(
            f"the engine on {state_dir} (pid {pid}) is starting and does not answer yet (after a crash it "
            "first ends what the crashed engine left running: up to its grace period, then SIGKILL); try "
            "again once it answers (gadget-engine start waits for it)",
            pid,
        )
    if pid is not None and (refused or phase == STOPPING):
        return EngineStoppingError(
            f"the engine on {state_dir} (pid {pid}) is stopping and no longer answers; "
            "try again once it has stopped",
            pid,
        )
    if pid is not None:
        return EngineSocketMissingError(
            f"an engine is running on {state_dir} as pid {pid}, but its socket {path} is missing; "
            "it binds it again within 5 s: try again",
            pid,
        )
    return EngineNotRunningError(
        f"no engine is running on {state_dir} (nothing answers on {path}); "
        f"start one with: gadget-engine --state-dir {state_dir} start"
    )


#: ``PF_EXITING`` in ``/proc/<pid>/stat`` field 9: the process is exiting (its files are being closed).
_PF_EXITING = 0x4


def _suspended(pid: int) -> bool:
    """Whether process ``pid`` is stopped by a signal (state ``T``; not ``t``, the stops of a tracer such as
    ``strace``, which come and go)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"T"
    except (OSError, IndexError):
        return False


def _suspended_error(state_dir: str, pid: int, *, sent: bool) -> EngineSuspendedError:
    then = " (the request was sent: the engine runs it then)" if sent else ""
    return EngineSuspendedError(
        f"the engine on {state_dir} (pid {pid}) is stopped (SIGSTOP, or Ctrl-Z in its terminal) and answers "
        f"nothing until it is continued: kill -CONT {pid}{then}",
        pid,
    )


def _engine_gone(holder: int | None) -> bool:
    """Whether the engine is gone or exiting: its state directory's lock is free (``holder`` is ``None``),
    or held by a process that is exiting (the lock goes with the last of its files, after the
    connection's)."""
    if holder is None:
        return True
    try:
        with open(f"/proc/{holder}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return bool(int(fields[6]) & _PF_EXITING)
    except (OSError, IndexError, ValueError):
        return True


def _broken(state_dir: str, method: str) -> EngineConnectionError:
    """The connection closed before the answer: the engine is gone (its lock is free) or still there."""
    holder = lock_holder(state_dir)
    if _engine_gone(holder):  # found by a new user: "another user" misled after a kill -9
        return EngineConnectionError(
            f"the engine on {state_dir} stopped before answering ({method}): it was stopped or died; what "
            "the call did may be unfinished (its guardian, or the next engine on this state dir, ends what "
            "it left running)"
        )
    try:
        owner: int | None = os.stat(f"/proc/{holder}").st_uid
    except OSError:
        owner = None
    if owner is not None and owner != os.getuid():
        return EngineConnectionError(
            f"the engine on {state_dir} (pid {holder}) closed the connection before answering ({method}): "
            f"it runs as uid {owner} and refuses clients of another user"
        )
    return EngineConnectionError(
        f"the engine on {state_dir} (pid {holder}) closed the connection before answering ({method}): it "
        "is stopping, and a stop closes the connections still waiting once it has ended the processes; "
        "what the call did may be unfinished"
    )


class _OutputGoneError(BrokenPipeError):
    """The reader of the descriptor a call watched went away (:meth:`EngineClient.call_watching`)."""


class _UnusableResponseError(EngineConnectionError):
    """A response that is not JSON or answers another request: the connection must be dropped."""


def _result(line: bytes, request_id: int) -> Any:
    """The result of the response ``line`` to ``request_id``, or the error it carries, raised.

    Raises:
        _UnusableResponseError: the line is not JSON or not the answer to ``request_id``.
        EngineError: the engine's error (see :func:`exception_from_error`).
    """
    try:
        response = decode_line(line)
    except ValueError as exc:
        raise _UnusableResponseError(f"the engine sent a response that is not JSON: {exc}") from None
    if isinstance(response, dict) and response.get("id") is None and isinstance(response.get("error"), dict):
        # Not an answer but the engine's last word on this connection (too many connections, idle too long).
        said = str(response["error"].get("message") or "no reason given")
        raise _UnusableResponseError(f"the engine refused the connection: {said}")
    if not isinstance(response, dict) or response.get("id") != request_id:
        raise _UnusableResponseError(f"the engine sent an unexpected response: {line[:200]!r}")
    if "error" in response:
        error = response["error"]
        if not isinstance(error, dict):
            raise RpcError(f"malformed error response: {error!r}", code=-32603)
        data = error.get("data")
        if isinstance(data, dict) and data.get("type") == EngineStoppingError.__name__:
            pid = data.get("pid")  # the request came after the engine's stop began: it was not run
            raise EngineStoppingError(str(error.get("message")), pid if isinstance(pid, int) else 0)
        raise exception_from_error(error.get("code"), error.get("message"), data)
    return response.get("result")


class EngineClient:
    """One connection to the engine of a state directory; calls are sent one at a time.

    The connection is opened by the first :meth:`call` (or :meth:`connect`) and kept for the next ones.
    Not thread-safe: use one client per thread.

    Args:
        state_dir: the engine's state directory (``None``: ``$GADGET_ENGINE_STATE_DIR``, else the default
            state directory).
        timeout_seconds: the longest a call may wait for its answer, in seconds (``None``: no limit;
            ``kill`` waits out the engine's grace period).
    """

    def __init__(self, state_dir: str | None = None, *, timeout_seconds: float | None = None) -> None:
        self.state_dir = resolve_state_dir(state_dir)
        self.timeout_seconds = timeout_seconds
        self._sock: socket.socket | None = None
        self._peer = 0  # the engine's pid, once connected
        self._buffer = bytearray()
        self._next_id = 1

    def __repr__(self) -> str:
        state = "connected" if self._sock is not None else "not connected"
        return f"<EngineClient {self.state_dir!r}: {state}>"

    @property
    def socket_path(self) -> str:
        """The socket this client connects to (see :func:`find_socket_path`)."""
        return find_socket_path(self.state_dir)

    def connect(self) -> None:
        """Open the connection if it is not open yet.

        A connection kept from an earlier call that the engine has closed meanwhile (its idle timeout)
        is replaced by a new one.

        Raises:
            EngineNotRunningError: no socket, or nobody answers on it, and no engine holds the state
                directory.
            EngineSocketMissingError: an engine holds the state directory, but its socket is missing;
                its kinds :class:`EngineStartingError` (it does not listen yet: its start-up sweep) and
                :class:`EngineStoppingError` (it stopped listening: a stop) when the socket refuses.
            PermissionError: the socket belongs to another user.
            UntrustedPathError: the state directory or its pointer file is not this user's, or the
                engine on the socket runs as another user.
        """
        if self._sock is not None:
            if not _stale(self._sock):
                return
            self.close()
        path = self.socket_path
        made = _socket_made(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout_seconds)
        try:
            sock.connect(path)
            self._peer = check_peer(sock, path, self.state_dir)
        except (FileNotFoundError, ConnectionRefusedError, NotADirectoryError) as exc:
            sock.close()
            raise _not_running(
                self.state_dir, path, refused=isinstance(exc, ConnectionRefusedError), made=made
            ) from None
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._buffer.clear()

    def close(self) -> None:
        """Close the connection (a later call opens a new one)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def call(self, method: str, /, **params: Any) -> Any:
        """Call ``method`` with named ``params`` and return its result.

        Raises:
            EngineNotRunningError: no engine is running on the state directory.
            EngineConnectionError: the connection broke before the answer (the connection is closed).
            TimeoutError: no answer within ``timeout_seconds`` (the connection is closed).
            EngineStoppingError: the engine is stopping; the request was not run.
            EngineError: the engine's error, as its own class (``SpawnError``, ``JobNotFoundError``, ...)
                or :class:`RpcError` for the standard JSON-RPC errors.
        """
        return self._call(method, params, None)

    def call_watching(self, output_fd: int, method: str, /, **params: Any) -> Any:
        """:meth:`call`, ended as soon as the reader of ``output_fd`` goes away while the answer is awaited.

        For a follower that waits long for each answer (``events --follow``: ``events.wait`` for up to
        30 s) and must still notice at once that ``| head`` has ended, as GNU ``tail -f`` watches its
        output: ``output_fd`` is polled with the connection for ``POLLERR`` (the write end of a pipe whose
        reader closed, on Linux) and ``POLLHUP`` (a socket or terminal that hung up). A descriptor that
        reports neither (a regular file, ``/dev/null``) never ends a call; one that is not open is not
        watched.

        Args:
            output_fd: the descriptor whose reader is watched (standard output's).
            method: as for :meth:`call`.
            **params: as for :meth:`call`.

        Raises:
            BrokenPipeError: ``output_fd``'s reader went away; the connection is closed (the request was
                sent: it completes in the engine, its answer unread).
            EngineError: as :meth:`call`.
        """
        return self._call(method, params, output_fd)

    def _call(self, method: str, params: dict[str, Any], watched: int | None) -> Any:
        self.connect()
        assert self._sock is not None
        request_id = self._next_id
        self._next_id += 1
        try:
            self._sock.sendall(encode_request(method, params, request_id))
            line = self._read_line(watched)
        except _OutputGoneError:
            self.close()  # the answer would come out of turn for the next call
            raise
        except (BrokenPipeError, ConnectionResetError, EngineConnectionError) as exc:
            said = self._last_word()
            self.close()
            if said is not None:  # the engine said why it closed the connection (too many connections)
                _result(said, request_id)
            raise _broken(self.state_dir, method) from exc
        except BaseException:
            self.close()
            raise
        try:
            return _result(line, request_id)
        except _UnusableResponseError:
            self.close()
            raise

    def _last_word(self) -> bytes | None:
        """A line the engine sent before it closed the connection, still unread (or ``None``)."""
        assert self._sock is not None
        with contextlib.suppress(OSError):
            self._sock.setblocking(False)
            while b"\n" not in self._buffer and len(self._buffer) <= MAX_RESPONSE_BYTES:
                chunk = self._sock.recv(65536)
                if not chunk:
                    break
                self._buffer += chunk
        newline = self._buffer.find(b"\n")
        return bytes(self._buffer[:newline]) if newline >= 0 else None

    def _read_line(self, watched: int | None = None) -> bytes:
        assert self._sock is not None
        while True:
            newline = self._buffer.find(b"\n")
            if newline >= 0:
                line = bytes(self._buffer[:newline])
                del self._buffer[: newline + 1]
                return line
            if len(self._buffer) > MAX_RESPONSE_BYTES:
                raise EngineConnectionError(f"a response is longer than {MAX_RESPONSE_BYTES} bytes")
            self._wait_readable(watched)
            chunk = self._sock.recv(1024 * 1024)
            if not chunk:
                raise EngineConnectionError("end of stream")
            self._buffer += chunk

    def _wait_readable(self, watched: int | None = None) -> None:
        """Wait until the socket has something to read, looking again every 0.25 s.

        CPython runs a signal's Python handler between bytecodes: a Ctrl-C that came just before a
        blocking ``recv`` began would wait there for the answer (a ``create --ready-log`` waits up to
        300 s). Looking again in a loop raises its ``KeyboardInterrupt`` within 0.25 s.

        Args:
            watched: a descriptor polled with the socket (:meth:`call_watching`), or ``None``.

        Raises:
            TimeoutError: nothing came within ``timeout_seconds``.
            _OutputGoneError: ``watched`` reported its reader gone.
        """
        assert self._sock is not None
        sock_fd = self._sock.fileno()
        poller = select.poll()
        poller.register(sock_fd, select.POLLIN)
        if watched is not None:
            poller.register(watched, 0)  # no event asked for: POLLERR, POLLHUP, POLLNVAL come all the same
        began = time.monotonic()
        deadline = None if self.timeout_seconds is None else began + self.timeout_seconds
        while True:
            ready = poller.poll(_SIGNAL_LOOK_SECONDS * 1000)
            if any(fd == sock_fd for fd, _events in ready):
                return
            for fd, events in ready:  # ``watched`` alone
                if events & OUTPUT_GONE_EVENTS:
                    raise _OutputGoneError(errno.EPIPE, "the output's reader went away")
                poller.unregister(fd)  # POLLNVAL: not an open descriptor, nobody's reader to watch
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise TimeoutError(
                    f"the engine on {self.state_dir} (pid {self._peer}) did not answer within "
                    f"{self.timeout_seconds:g} s"
                )
            if now - began >= SUSPENDED_LOOK_SECONDS and _suspended(self._peer):
                raise _suspended_error(self.state_dir, self._peer, sent=True)


class AsyncEngineClient:
    """The asyncio twin of :class:`EngineClient`: one connection, calls answered one at a time.

    Concurrent calls on one client wait for each other (a lock keeps request and answer together); open
    several clients for parallel calls. Use it on one event loop.

    Args:
        state_dir: the engine's state directory (``None``: ``$GADGET_ENGINE_STATE_DIR``, else the default
            state directory).
    """

    def __init__(self, state_dir: str | None = None) -> None:
        self.state_dir = resolve_state_dir(state_dir)
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._lock = asyncio.Lock()
        self._peer = 0  # the engine's pid, once connected
        self._next_id = 1

    def __repr__(self) -> str:
        state = "connected" if self._writer is not None else "not connected"
        return f"<AsyncEngineClient {self.state_dir!r}: {state}>"

    @property
    def socket_path(self) -> str:
        """The socket this client connects to (see :func:`find_socket_path`)."""
        return find_socket_path(self.state_dir)

    async def connect(self) -> None:
        """Open the connection if it is not open yet.

        Cancellation: nothing stays open.

        Raises:
            EngineNotRunningError: no socket, or nobody answers on it, and no engine holds the state
                directory.
            EngineSocketMissingError: an engine holds the state directory, but its socket is missing;
                its kinds :class:`EngineStartingError` (it does not listen yet: its start-up sweep) and
                :class:`EngineStoppingError` (it stopped listening: a stop) when the socket refuses.
            PermissionError: the socket belongs to another user.
            UntrustedPathError: as :meth:`EngineClient.connect`.
        """
        if self._writer is not None:
            if not _stale(self._writer.get_extra_info("socket")):
                return
            await self.aclose()
        path = self.socket_path
        made = _socket_made(path)
        try:
            reader, writer = await asyncio.open_unix_connection(path, limit=MAX_RESPONSE_BYTES)
        except (FileNotFoundError, ConnectionRefusedError, NotADirectoryError) as exc:
            raise _not_running(
                self.state_dir, path, refused=isinstance(exc, ConnectionRefusedError), made=made
            ) from None
        try:
            self._peer = check_peer(writer.get_extra_info("socket"), path, self.state_dir)
        except BaseException:
            writer.close()
            raise
        self._reader, self._writer = reader, writer

    async def aclose(self) -> None:
        """Close the connection (a later call opens a new one).

        Cancellation: the connection is closed at once; only the wait for the close is cut short.
        """
        writer, self._reader, self._writer = self._writer, None, None
        if writer is not None:
            writer.close()
            try:
                await writer.wait_closed()
            except (ConnectionError, OSError):
                pass  # closed it is, whatever the peer did meanwhile

    async def __aenter__(self) -> AsyncEngineClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def call(self, method: str, /, **params: Any) -> Any:
        """Call ``method`` with named ``params`` and return its result.

        Cancellation: the connection is closed (the answer would come late, out of turn); a request the
        engine already received completes there (``docs/rpc.md``). The next call reconnects.

        Raises:
            EngineNotRunningError: no engine is running on the state directory.
            EngineConnectionError: the connection broke before the answer (the connection is closed).
            EngineStoppingError: the engine is stopping; the request was not run.
            EngineError: the engine's error, as its own class (``SpawnError``, ``JobNotFoundError``, ...)
                or :class:`RpcError` for the standard JSON-RPC errors.
        """
        async with self._lock:
            await self.connect()
            assert self._reader is not None and self._writer is not None
            request_id = self._next_id
            self._next_id += 1
            try:
                self._writer.write(encode_request(method, params, request_id))
                await self._writer.drain()
                line = await self._answer(self._reader)
            except (asyncio.IncompleteReadError, ConnectionError) as exc:
                await self.aclose()
                raise _broken(self.state_dir, method) from exc
            except asyncio.LimitOverrunError:
                await self.aclose()
                raise EngineConnectionError(f"a response is longer than {MAX_RESPONSE_BYTES} bytes") from None
            except BaseException:
                await self._abandon()
                raise
            try:
                return _result(line[:-1], request_id)
            except _UnusableResponseError:
                await self.aclose()
                raise

    async def _answer(self, reader: asyncio.StreamReader) -> bytes:
        """The answer's line, read while looking, after :data:`SUSPENDED_LOOK_SECONDS` and then every 0.25
        s, whether the engine's process is stopped (:class:`EngineSuspendedError`), as the blocking
        client does."""
        reading = asyncio.ensure_future(reader.readuntil(b"\n"))
        try:
            wait = SUSPENDED_LOOK_SECONDS
            while not (await asyncio.wait({reading}, timeout=wait))[0]:
                wait = _SIGNAL_LOOK_SECONDS
                if _suspended(self._peer):
                    raise _suspended_error(self.state_dir, self._peer, sent=True)
            return reading.result()
        finally:
            if not reading.done():
                reading.cancel()

    async def _abandon(self) -> None:
        """Drop the connection without waiting (a cancelled call): its answer would come out of turn."""
        writer, self._reader, self._writer = self._writer, None, None
        if writer is not None:
            writer.close()
