"""A synchronous client of a running ``gadget-engine serve``, on the standard library only.

::

    with EngineClient("/path/to/state") as client:
        pid = client.call("subprocess.create", project="/my/app", command="npm", args=["run", "dev"])["pid"]
        print(client.call("subprocess.read_log", pid=pid, tail=20)["text"])

Errors come back as the engine's own exception classes (``SubProcessNotFoundError``, ``SpawnError``...),
mapped from the JSON-RPC error code; the standard JSON-RPC errors raise :class:`RpcError`. A client never
starts an engine: with none running, :class:`EngineNotRunningError` is raised.
"""

from __future__ import annotations

import socket
from types import TracebackType
from typing import Any

from .._errors import EngineError
from ._location import find_socket_path, resolve_state_dir
from ._protocol import RpcError, decode_line, encode_request, exception_from_error

__all__ = ["EngineClient", "EngineConnectionError", "EngineNotRunningError", "RpcError"]

#: The longest response line the client accepts, in bytes.
MAX_RESPONSE_BYTES = 256 * 1024 * 1024


class EngineNotRunningError(EngineError, ConnectionError):
    """Raised by :meth:`EngineClient.connect` when no engine answers on the state directory's socket."""


class EngineConnectionError(EngineError, ConnectionError):
    """Raised by :meth:`EngineClient.call` when the connection breaks before the answer arrives.

    The engine closes the connection of a client of another user at once, and every connection when it
    stops.
    """


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

        Raises:
            EngineNotRunningError: no socket, or nobody answers on it.
            PermissionError: the socket belongs to another user.
        """
        if self._sock is not None:
            return
        path = self.socket_path
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout_seconds)
        try:
            sock.connect(path)
        except (FileNotFoundError, ConnectionRefusedError, NotADirectoryError):
            sock.close()
            raise EngineNotRunningError(
                f"no engine is running on {self.state_dir} (nothing answers on {path}); "
                f"start one with: gadget-engine --state-dir {self.state_dir} serve"
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
            EngineError: the engine's error, as its own class (``SpawnError``, ``JobNotFoundError``, ...)
                or :class:`RpcError` for the standard JSON-RPC errors.
        """
        self.connect()
        assert self._sock is not None
        request_id = self._next_id
        self._next_id += 1
        try:
            self._sock.sendall(encode_request(method, params, request_id))
            line = self._read_line()
        except (BrokenPipeError, ConnectionResetError, EngineConnectionError) as exc:
            self.close()
            raise EngineConnectionError(
                f"the engine on {self.state_dir} closed the connection before answering ({method}); "
                "it refuses clients of another user, or it is stopping"
            ) from exc
        except BaseException:
            self.close()
            raise
        try:
            response = decode_line(line)
        except ValueError as exc:
            self.close()
            raise EngineConnectionError(f"the engine sent a response that is not JSON: {exc}") from None
        if not isinstance(response, dict) or response.get("id") != request_id:
            self.close()
            raise EngineConnectionError(f"the engine sent an unexpected response: {line[:200]!r}")
        if "error" in response:
            error = response["error"]
            if not isinstance(error, dict):
                raise RpcError(f"malformed error response: {error!r}", code=-32603)
            raise exception_from_error(error.get("code"), error.get("message"), error.get("data"))
        return response.get("result")

    def _read_line(self) -> bytes:
        assert self._sock is not None
        while True:
            newline = self._buffer.find(b"\n")
            if newline >= 0:
                line = bytes(self._buffer[:newline])
                del self._buffer[: newline + 1]
                return line
            if len(self._buffer) > MAX_RESPONSE_BYTES:
                raise EngineConnectionError(f"a response is longer than {MAX_RESPONSE_BYTES} bytes")
            chunk = self._sock.recv(1024 * 1024)
            if not chunk:
                raise EngineConnectionError("end of stream")
            self._buffer += chunk
