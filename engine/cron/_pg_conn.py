"""PostgreSQL connections of the fleet store: the URL and its password, connecting, and listening.

**The driver and concurrency.** psycopg 3, in two ways chosen for what each connection does:

- queries run as blocking calls in Trio worker threads, one call at a time per connection behind a
  ``trio.CapacityLimiter(1)``, exactly as the SQLite store does. A transaction is a few statements with
  Python decisions between them (the claims' schedule maths); in a thread it is straight-line code with
  psycopg's tested blocking API, and a cancelled caller waits for the transaction to end, so a
  transaction that has begun always commits or rolls back whole (the store's cancellation contract);
- the listening connection (``LISTEN/NOTIFY``) is idle almost all the time, so it holds no thread: it
  waits on its socket with ``trio.lowlevel.wait_readable`` and reads the notifications with libpq's
  non-blocking ``consume_input``, and a cancellation ends the wait at once.

**The password** never leaves this module: :func:`redact_url` is what every message, log line and
``describe()`` shows, and every driver error passes through :func:`redact_error`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any, Final, final

import attrs
import trio

from .._errors import InvalidArgumentError, StoreError
from .._retry import RetryPolicy

__all__ = [
    "EVENTS_CHANNEL",
    "JOBS_CHANNEL",
    "PG_SCHEMES",
    "Listener",
    "check_store_url",
    "connect",
    "redact_error",
    "redact_url",
]

logger = logging.getLogger("engine.cron")

#: The URL schemes of a PostgreSQL store.
PG_SCHEMES: Final = ("postgresql://", "postgres://")
#: ``NOTIFY`` channels: a job changed; an event was appended.
JOBS_CHANNEL: Final = "gadget_engine_jobs"
EVENTS_CHANNEL: Final = "gadget_engine_events"
#: How long a connection attempt may take, in seconds.
CONNECT_SECONDS: Final = 10

_PASSWORD = re.compile(r"(://[^:/@\s]*:)[^@/\s]*@")
_PASSWORD_PARAM = re.compile(r"(password=)[^&\s]*", re.IGNORECASE)


def redact_url(url: str) -> str:
    """``url`` with its password shown as ``***`` (in the user part, or a ``password=`` parameter)."""
    return _PASSWORD_PARAM.sub(r"\1***", _PASSWORD.sub(r"\1***@", url))


def _password(url: str) -> str | None:
    found = _PASSWORD.search(url) or None
    if found is None:
        return None
    text = url[found.end(1) : found.end() - 1]
    return text or None


def redact_error(exc: BaseException, url: str) -> str:
    """The text of a driver error, without ``url``'s password wherever it might appear."""
    text = redact_url(str(exc).strip().replace("\n", "; "))
    secret = _password(url)
    return text.replace(secret, "***") if secret else text


def check_store_url(url: object, field: str = "store_url") -> str:
    """``url`` if it names a PostgreSQL store (``postgresql://...``).

    Raises:
        InvalidArgumentError: it is not text starting with ``postgresql://`` or ``postgres://`` (the
            message shows it without its password).
    """
    if not isinstance(url, str) or not url.startswith(PG_SCHEMES):
        shown = redact_url(url) if isinstance(url, str) else type(url).__name__
        raise InvalidArgumentError(
            f"{field} must be a PostgreSQL URL such as postgresql://user@host/db, got {shown!r}; "
            "leave it unset for the SQLite store in the state directory"
        )
    return url


def connect(url: str) -> Any:
    """A new autocommit connection to ``url`` (blocking: call it in a worker thread).

    Raises:
        StoreError: the server cannot be reached or refused us (the message without the password).
    """
    import psycopg  # only a fleet store needs the driver

    try:
        return psycopg.connect(
            url,
            autocommit=True,
            connect_timeout=CONNECT_SECONDS,
            application_name="gadget-engine",
            keepalives=1,
            keepalives_idle=10,
            keepalives_interval=5,
            keepalives_count=3,
        )
    except psycopg.Error as exc:
        raise StoreError(
            f"cannot connect to the job store {redact_url(url)}: {redact_error(exc, url)}"
        ) from None


@final
@attrs.define(eq=False)
class Listener:
    """``LISTEN`` on the store's channels and call a handler per channel, reconnecting after a loss.

    Attributes:
        url: the store's URL.
        handlers: what to call (with no argument) for a notification on each channel. After a
            reconnection every handler is called once: a notification may have been missed meanwhile.
        retry: the waits between connection attempts.
    """

    url: str
    handlers: dict[str, Callable[[], None]]
    retry: RetryPolicy = attrs.field(factory=RetryPolicy)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen until cancelled (``started`` at once: the handlers are called when ``LISTEN`` is in place).

        Cancellation: ends the wait at once and closes the connection.
        """
        task_status.started()
        while True:
            conn = await self.retry.run(
                f"job store {redact_url(self.url)}: listening", self._connect, logger=logger
            )
            try:
                await self._listen(conn)
            except OSError as exc:
                logger.error(
                    "job store %s: the listening connection was lost (%s)", redact_url(self.url), exc
                )
            finally:
                conn.close()
            await self.retry.sleep(self.retry.delay_seconds(1))

    async def _connect(self) -> Any:
        conn = await trio.to_thread.run_sync(connect, self.url)
        try:
            for channel in self.handlers:
                conn.execute(f"LISTEN {channel}")
        except Exception as exc:
            conn.close()
            raise StoreError(f"job store {redact_url(self.url)}: {redact_error(exc, self.url)}") from None
        for handler in self.handlers.values():  # what happened while not listening
            handler()
        return conn

    async def _listen(self, conn: Any) -> None:
        import psycopg

        pgconn = conn.pgconn
        while True:
            await trio.lowlevel.wait_readable(pgconn.socket)
            try:
                pgconn.consume_input()
            except psycopg.Error as exc:
                raise StoreError(redact_error(exc, self.url)) from None
            if pgconn.status != psycopg.pq.ConnStatus.OK:
                raise StoreError("the connection closed")
            seen = set()
            while (note := pgconn.notifies()) is not None:
                seen.add(note.relname.decode())
            for channel in seen:
                handler = self.handlers.get(channel)
                if handler is not None:
                    handler()
