"""A real PostgreSQL for the fleet tests: one server per test session, one fresh database per test.

The server is the one the ``pgserver`` package ships (the ``dev`` extra): ``initdb`` in a folder of this
session and ``pg_ctl start``, listening on a Unix socket only (as root, pgserver runs it as a system user
of its own). :func:`pg_server` starts it at most once per session; each test that asks for
:func:`fresh_database` gets a database of its own, dropped at the end, so stores never see each
other's rows.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import tempfile
import warnings
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

__all__ = ["admin_connection", "database_url", "drop_database", "fresh_database", "pg_server"]

_server: Any = None
_base_url: str | None = None
_names = itertools.count(1)


def pg_server() -> str:
    """Start the session's PostgreSQL (once) and return the URL of its ``postgres`` database."""
    global _server, _base_url
    if _base_url is not None:
        return _base_url
    with warnings.catch_warnings():
        # pgserver asks platformdirs for a runtime dir at import; without XDG_RUNTIME_DIR that warns.
        warnings.simplefilter("ignore")
        from pgserver.postgres_server import get_server

        root = tempfile.mkdtemp(prefix=f"gadget-engine-pg-{os.getpid()}-")
        _server = get_server(os.path.join(root, "data"), cleanup_mode="delete")
        _base_url = str(_server.get_uri())
    atexit.register(_stop)
    return _base_url


def _stop() -> None:
    global _server
    if _server is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _server.cleanup()
        _server = None


def database_url(name: str) -> str:
    """The URL of database ``name`` on the session's server."""
    base = pg_server()
    head, _, query = base.partition("?")
    return f"{head.rsplit('/', 1)[0]}/{quote(name)}?{query}"


def admin_connection() -> Any:
    """An autocommit connection to the server's ``postgres`` database."""
    import psycopg

    return psycopg.connect(pg_server(), autocommit=True)


def drop_database(name: str) -> None:
    """Drop database ``name``, ending the sessions still on it."""
    with admin_connection() as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextlib.contextmanager
def fresh_database(prefix: str = "t") -> Iterator[str]:
    """A new, empty database for the block; its URL. Dropped (sessions ended) afterwards."""
    name = f"{prefix}_{os.getpid()}_{next(_names)}"
    with admin_connection() as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield database_url(name)
    finally:
        drop_database(name)
