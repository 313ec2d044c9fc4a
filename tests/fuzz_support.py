"""Random, malformed, oversized and adversarial messages for the RPC socket and the MCP stdio server.

Every parameter gets a random value, except those that name a program, a shell command or a directory:
those stay a harmless program (``true``) and the test's project directory, so the fuzz never runs
anything but ``true`` and never touches a folder outside the test. Everything is drawn from one seeded
``random.Random``, so a failing run can be replayed from its seed.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

from engine.server._methods import _TABLE

#: Strings chosen to break things: escapes, paths, shell and format syntax, text that is not text.
NASTY_STRINGS: Final = (
    "",
    " ",
    "\n",
    "stdout",
    "stderr",
    "\u0000",
    "a\u0000b",
    "\udcff",
    "caf\udce9.txt",
    "\ud800\udc00",
    "../../../../etc/passwd",
    "$(touch /tmp/pwned)",
    "`id`",
    "%s%n%x",
    "{0}{job}",
    "-x",
    "--",
    "*/1 * * * *",
    "0 9 * * 1-5",
    "61 25 32 13 8",
    "Europe/Paris",
    "Mars/Olympus_Mons",
    "2030-01-31T09:00+01:00",
    "1999-01-01T00:00:00+00:00",
    "not a date",
    "\u202e\u2066",
    "🙂" * 40,
    "null",
    "true",
    "1e400",
)
NASTY_NUMBERS: Final = (
    0,
    -1,
    1,
    2,
    3.0,
    0.5,
    -0.0,
    1e-9,
    1e308,
    -1e308,
    2**53,
    2**53 + 1,
    2**63,
    10**400,
    7.5e15,
)

_TOOL_COMMANDS: Final = ("create", "list", "kill", "killAll", "halt", "log")
_KINDS: Final = ("at", "every", "cron", "on_exit")
_MCP_TOOLS: Final = ("subprocess", "cron_add", "cron_list", "cron_remove", "cron_events")


def random_string(rng: random.Random) -> str:
    roll = rng.random()
    if roll < 0.45:
        return rng.choice(NASTY_STRINGS)
    if roll < 0.55:
        return "A" * rng.choice((1000, 70_000, 140_000))  # around the longest argument Linux takes
    alphabet = [chr(rng.randrange(0x20, 0x3000)) for _ in range(8)] + ["\\", '"', "\t", "\udcff"]
    return "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 40)))


def random_value(rng: random.Random, depth: int = 0) -> Any:
    """Any JSON value (lone surrogates included: ``json.dumps`` escapes them), nested up to 3 deep."""
    roll = rng.randrange(10 if depth < 3 else 7)
    if roll == 0:
        return None
    if roll == 1:
        return rng.choice((True, False))
    if roll in (2, 3):
        return rng.choice(NASTY_NUMBERS) if rng.random() < 0.7 else rng.randrange(-(10**6), 10**7)
    if roll in (4, 5, 6):
        return random_string(rng)
    if roll in (7, 8):
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(0, 5))]
    return {random_string(rng): random_value(rng, depth + 1) for _ in range(rng.randrange(0, 4))}


def _maybe(rng: random.Random, value: Any) -> Any:
    """``value`` most of the time, else something random (a wrong type, a poison string)."""
    return value if rng.random() < 0.6 else random_value(rng)


def random_schedule(rng: random.Random, project: str) -> Any:
    if rng.random() < 0.2:
        return random_value(rng)
    kind = rng.choice(_KINDS) if rng.random() < 0.9 else random_string(rng)
    schedule: dict[str, Any] = {"kind": kind}
    if kind == "on_exit":
        schedule.update(command="true", cwd=project)  # the shell command and its directory stay harmless
    elif kind == "every":
        schedule["every_seconds"] = _maybe(rng, rng.choice((1, 2, 3600, 1e-3)))
    elif kind == "at":
        schedule["at"] = _maybe(rng, "2099-01-01T00:00:00+00:00")
    elif kind == "cron":
        schedule.update(expr=_maybe(rng, "0 9 * * 1-5"), tz=_maybe(rng, "UTC"))
    for _ in range(rng.randrange(0, 2)):
        schedule[random_string(rng)] = random_value(rng)
    return schedule


def random_payload(rng: random.Random, project: str) -> Any:
    if rng.random() < 0.2:
        return random_value(rng)
    if rng.random() < 0.7:
        return {"kind": "system_event", "text": _maybe(rng, "fuzz")}
    return {"kind": "command", "argv": ["true", *(random_string(rng) for _ in range(3))], "cwd": project}


def tool_params(rng: random.Random) -> Any:
    """Parameters of the ``subprocess`` tool: random, but ``command`` is always ``true``."""
    if rng.random() < 0.1:
        return random_value(rng)
    params: dict[str, Any] = {"cmd": rng.choice(_TOOL_COMMANDS) if rng.random() < 0.9 else random_value(rng)}
    for name in ("args", "pid", "which", "offset", "limit", "tail"):
        if rng.random() < 0.3:
            params[name] = random_value(rng)
    if rng.random() < 0.5:
        params["command"] = "true"
    return params


def rpc_params(rng: random.Random, method: str, project: str) -> Any:
    if rng.random() < 0.05:
        return _bound_wait(rng, method, random_value(rng))
    params: dict[str, Any] = {}
    for name in _TABLE[method].params:
        if rng.random() < 0.35:
            continue
        if name == "project":
            params[name] = project
        elif name == "command":
            params[name] = "true"
        elif name == "schedule":
            params[name] = random_schedule(rng, project)
        elif name == "payload":
            params[name] = random_payload(rng, project)
        elif name == "params":
            params[name] = tool_params(rng)
        else:
            params[name] = random_value(rng)
    if rng.random() < 0.1:
        params[random_string(rng)] = random_value(rng)
    return _bound_wait(rng, method, params)


def _bound_wait(rng: random.Random, method: str, params: Any) -> Any:
    """``params`` with the wait of a waiting method bounded (0 to 0.05 s), else each would hold the run
    for its 30 s default; values that are refused at once (not a number, negative, NaN) are kept."""
    waits = _WAITS.get(method)
    if waits is not None and isinstance(params, dict):
        value = params.get(waits)
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if value is None or (number and value > 0.05):
            params[waits] = rng.choice([0, 0.01, 0.05])
    return params


#: The methods that wait, and the parameter that bounds the wait (seconds).
_WAITS: Final = {"events.wait": "seconds", "subprocess.wait": "timeout_seconds"}


def _dumps(value: Any) -> bytes:
    return json.dumps(value).encode()


def malformed_line(rng: random.Random, max_bytes: int) -> bytes:
    """A line that is not a request: junk, cut JSON, deep nesting, bytes that are not UTF-8, too long."""
    choice = rng.randrange(9)
    if choice == 0:
        return os.urandom(rng.randrange(1, 200)).replace(b"\n", b" ")
    if choice == 1:
        return _dumps({"jsonrpc": "2.0", "method": "status", "id": 1})[: rng.randrange(1, 30)]
    if choice == 2:
        return b"[" * 100_000
    if choice == 3:
        return b'{"jsonrpc":"2.0","method":"status","id":"\xff\xfe"}'
    if choice == 4:
        return _dumps([{"jsonrpc": "2.0", "method": "status", "id": 1}] * 3)  # a batch
    if choice == 5:
        return b"x" * (max_bytes + rng.randrange(1, 1000))  # over the size limit: the connection closes
    if choice == 6:
        return b'{"jsonrpc":"2.0","method":"status","id":1e400}'
    if choice == 7:
        return b'{"jsonrpc":"2.0","method":"status","id":NaN}'
    return _dumps(random_value(rng))


#: Methods that stop the engine on purpose: a fuzz that calls them ends its own run, which is no fault.
STOPPING = frozenset({"engine.stop"})


def rpc_messages(
    rng: random.Random, project: str, count: int, max_bytes: int
) -> Iterator[tuple[bytes, bool]]:
    """``count`` request lines (without newline) and whether each expects an answer."""
    methods = sorted(set(_TABLE) - STOPPING)
    for i in range(count):
        roll = rng.random()
        if roll < 0.12:
            line = malformed_line(rng, max_bytes)
            yield line, len(line) <= max_bytes
            continue
        notification = rng.random() < 0.03
        if notification:  # a valid one, never answered (an invalid "notification" is answered: id null)
            method = rng.choice(methods)
            params = rpc_params(rng, method, project)
            request: dict[str, Any] = {
                "jsonrpc": "2.0",
                "method": method,
                "params": params if isinstance(params, dict) else _bound_wait(rng, method, {}),
            }
            yield _dumps(request), False
            continue
        request = {"jsonrpc": "2.0" if rng.random() < 0.95 else random_value(rng)}
        method = rng.choice(methods) if roll < 0.95 else random_string(rng)
        if method in STOPPING:
            method = "status"
        request["method"] = method
        if method in _TABLE:
            request["params"] = rpc_params(rng, method, project)
        request["id"] = i if rng.random() < 0.9 else random_value(rng)
        line = _dumps(request)
        yield line, len(line) <= max_bytes


def mcp_arguments(rng: random.Random, tool: str, project: str) -> Any:
    if rng.random() < 0.08:
        return random_value(rng)
    if tool == "subprocess":
        return tool_params(rng)
    if tool == "cron_add":
        args: dict[str, Any] = {"text": _maybe(rng, "fuzz")}
        when = rng.choice(("command", "at", "every_seconds", "cron", None))
        if when == "command":
            args.update(command="true", cwd=project)
        elif when is not None:
            args[when] = (
                random_value(rng)
                if rng.random() < 0.5
                else {"at": "2099-01-01T00:00:00+00:00"}.get(when, 3600)
            )
        for name in ("name", "tz"):
            if rng.random() < 0.3:
                args[name] = random_value(rng)
        return args
    if tool == "cron_remove":
        return {"id": random_value(rng)}
    if tool == "cron_events":
        return {"since": random_value(rng)} if rng.random() < 0.7 else {}
    return {} if rng.random() < 0.8 else {random_string(rng): random_value(rng)}


def mcp_message(rng: random.Random, message_id: int, project: str) -> bytes:
    """One line for the MCP server: mostly tool calls with random arguments, some junk."""
    roll = rng.random()
    if roll < 0.1:
        return malformed_line(rng, 64 * 1024)
    if roll < 0.8:
        tool = rng.choice(_MCP_TOOLS) if rng.random() < 0.95 else random_string(rng)
        params: Any = {"name": tool, "arguments": mcp_arguments(rng, tool, project)}
        return _dumps({"jsonrpc": "2.0", "id": message_id, "method": "tools/call", "params": params})
    if roll < 0.85:
        return _dumps({"jsonrpc": "2.0", "id": message_id, "method": "tools/list"})
    if roll < 0.9:
        return _dumps({"jsonrpc": "2.0", "method": random_string(rng), "params": random_value(rng)})
    return _dumps({"jsonrpc": "2.0", "id": random_value(rng), "method": random_string(rng)})


def process_rss(pid: int) -> int:
    """The resident memory of ``pid``, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")
