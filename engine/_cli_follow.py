"""``gadget-engine log`` and ``events``: what is there, then (``-f``) what comes, until the end.

``log -f`` asks for more at a fixed pace (:data:`LOG_FOLLOW_SECONDS`); ``events -f`` waits in the engine
for the next event (``events.wait``, up to :data:`EVENTS_WAIT_SECONDS` a call; an older engine is asked
at a fixed pace, :data:`EVENTS_FOLLOW_SECONDS`). A follower ends with exit 0 on Ctrl-C, when the
followed process has exited and its log is drained, and when the engine stops gracefully ("engine
stopped" on stderr): a graceful stop removes the engine's socket before the process ends, a crash leaves
it, so a broken connection is told apart by looking at the socket file while the engine's process is
still there (:func:`engine_went_away`). It ends with exit 141 when the reader of its output went away
(``| head``): it watches standard output while it waits (:func:`idle`, and
``EngineClient.call_watching`` during an ``events.wait``), so it notices at once, not at its next write.

Standard library only, like every client command.
"""

from __future__ import annotations

import argparse
import errno
import os
import select
import sys
import time
from typing import Any, Final

from ._cli_output import EXIT_FAILED, EXIT_OK, emit_json
from ._cli_start import engine_alive
from ._errors import SubProcessNotFoundError
from ._termtext import escape_controls, printable
from .server._client import (
    OUTPUT_GONE_EVENTS,
    EngineClient,
    EngineConnectionError,
    EngineNotRunningError,
    EngineSocketMissingError,
    EngineStoppingError,
    RpcError,
)
from .server._protocol import METHOD_NOT_FOUND

__all__ = [
    "EVENTS_FOLLOW_SECONDS",
    "LOG_FOLLOW_SECONDS",
    "engine_went_away",
    "events",
    "idle",
    "log",
    "print_events",
]

#: How often ``log --follow`` asks for more output, in seconds.
LOG_FOLLOW_SECONDS: Final = 0.25
#: How often ``events --follow`` asks for new events of an engine without ``events.wait``, in seconds.
EVENTS_FOLLOW_SECONDS: Final = 0.5
#: How long one ``events.wait`` call of ``events --follow`` waits for an event, in seconds: the engine
#: answers as soon as one is logged (woken by the event's arrival, and by LISTEN/NOTIFY on a fleet store),
#: so an event is never late, and an idle follower costs the engine one call (one store query) each time.
#: Under the engine's cap (``EVENTS_WAIT_MAX_SECONDS``, 50). Standard output is watched during the call
#: (``EngineClient.call_watching``): a reader that went away ends it at once all the same.
EVENTS_WAIT_SECONDS: Final = 30.0
#: How long a follower whose connection broke watches for the socket to go (graceful) or the engine's
#: process to end with it still there (a crash), in seconds.
GONE_SECONDS: Final = 5.0
#: The same when the engine said it is stopping (its stop ends every child by escalation first, a
#: grace period and more): as long as ``stop`` waits by default, in seconds.
STOPPING_SECONDS: Final = 30.0
_PAGE_BYTES: Final = 1024 * 1024
#: The ``new_only`` reader of ``log --new`` (each reader has a cursor of its own in the engine).
CLI_READER: Final = "cli"


def engine_went_away(client: EngineClient, socket_path: str, engine_pid: int, error: Exception) -> int:
    """Exit 0 with "engine stopped" when the engine stopped gracefully; raise otherwise.

    Raises:
        EngineNotRunningError: the engine's process ended and left its socket (killed or crashed).
        EngineConnectionError, EngineNotRunningError: ``error``, when neither is seen within
            :data:`GONE_SECONDS` (:data:`STOPPING_SECONDS` when ``error`` says the engine is stopping).
    """
    seconds = STOPPING_SECONDS if isinstance(error, EngineStoppingError) else GONE_SECONDS
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not os.path.lexists(socket_path):
            print("gadget-engine: engine stopped", file=sys.stderr)
            return EXIT_OK
        if not engine_alive(engine_pid):
            raise EngineNotRunningError(
                f"the engine on {client.state_dir} (pid {engine_pid}) ended without stopping gracefully "
                "(killed or crashed)"
            ) from None
        time.sleep(0.02)
    raise error


def _output_fd() -> int | None:
    """Standard output's descriptor, or ``None`` when it was replaced by an object with none, or closed."""
    try:
        return sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return None


def idle(seconds: float) -> None:
    """Wait ``seconds`` between two looks of a follower, ending early when its output's reader went away.

    A follower that only writes when something comes would otherwise notice ``| head`` ending only at its
    next write, perhaps never; GNU ``tail -f`` watches its output in the same way. Standard output that is
    not a pipe, socket or terminal (a file, or none) is never "gone": this is a plain sleep then.

    Args:
        seconds: how long to wait (0: only look).

    Raises:
        BrokenPipeError: standard output's reader went away (the CLI exits 141, as for a failed write).
    """
    fd = _output_fd()
    if fd is None:
        time.sleep(seconds)
        return
    poller = select.poll()
    poller.register(fd, 0)  # no event asked for: POLLERR, POLLHUP and POLLNVAL are reported all the same
    for _fd, events in poller.poll(seconds * 1000):
        if events & OUTPUT_GONE_EVENTS:
            raise BrokenPipeError(errno.EPIPE, "standard output's reader went away")
        if events & select.POLLNVAL:  # not an open descriptor: the next write says so
            time.sleep(seconds)


class _Lines:
    """Writes log text; with both streams, whole lines only, each prefixed with its stream."""

    def __init__(self, prefixed: bool, as_json: bool) -> None:
        self.prefixed = prefixed
        self.as_json = as_json
        self._partial: dict[str, str] = {}

    def write(self, piece: dict[str, Any]) -> None:
        if self.as_json:
            emit_json([piece])
        elif not self.prefixed:
            sys.stdout.write(piece["text"])
        else:
            stream = piece["stream"]
            text = self._partial.pop(stream, "") + piece["text"]
            lines = text.split("\n")
            if lines[-1]:
                self._partial[stream] = lines[-1]
            sys.stdout.writelines(f"{stream} | {line}\n" for line in lines[:-1])
        sys.stdout.flush()

    def flush(self, stream: str | None = None) -> None:
        """Write what is left of a last line without its newline (of ``stream``, or of each)."""
        for name in [stream] if stream is not None else list(self._partial):
            rest = self._partial.pop(name, "")
            if rest:
                sys.stdout.write(f"{name} | {rest}\n")
        sys.stdout.flush()


def _history(client: EngineClient, args: argparse.Namespace, stream: str, out: _Lines) -> dict[str, Any]:
    """Print what the log of ``stream`` holds (or its last ``--tail`` lines; ``--new``: what is new to the
    CLI's reader; ``--grep``: the matching lines); the last slice read."""
    common: dict[str, Any] = {"pid": args.pid, "stream": stream, "max_bytes": _PAGE_BYTES}
    piece: dict[str, Any]
    if args.new:
        common.update(new_only=True, reader=CLI_READER)
    if args.grep is not None:
        common["grep"] = args.grep
    if args.tail == 0:  # as ``tail -n 0``: nothing printed; a follow starts at the end
        piece = client.call("subprocess.read_log", tail=1, **common)
        return {**piece, "text": "", "next_offset": piece["total_bytes"]}
    if args.tail is not None:
        piece = client.call("subprocess.read_log", tail=args.tail, **common)
        out.write(piece)
        return piece
    piece = client.call("subprocess.read_log", **common)
    if piece.get("dropped_bytes") and not args.new:  # a new user saw a capped log begin mid-line, unsaid
        counted = "; line numbers count from there" if args.grep is not None else ""
        print(
            f"gadget-engine: the log cap dropped the oldest {piece['dropped_bytes']} bytes of {stream}; what "
            f"follows starts after them, perhaps in the middle of a line{counted}",
            file=sys.stderr,
        )
    out.write(piece)
    while piece["next_offset"] < piece["total_bytes"] and (args.grep is None or piece["truncated"]):
        at = {} if args.new else {"offset": piece["next_offset"]}
        piece = client.call("subprocess.read_log", **at, **common)
        out.write(piece)
    if piece.get("skipped_bytes"):
        print(
            f"gadget-engine: {piece['skipped_bytes']} bytes of {stream} written since the last --new read "
            "are gone (the log cap dropped them, or the log was truncated)",
            file=sys.stderr,
        )
    return piece


def log(client: EngineClient, args: argparse.Namespace) -> int:
    """``gadget-engine log PID [-n N] [-f] [--stream stdout|stderr|both] [--new] [--grep RE]``."""
    if args.new and (args.tail is not None or args.follow):
        args.parser.error("--new reads what is new since the last --new read; leave out -n and -f")
    if args.grep is not None and args.follow:
        args.parser.error("--grep searches what is there; leave out -f")
    streams = ("stdout", "stderr") if args.stream == "both" else (args.stream,)
    out = _Lines(prefixed=len(streams) > 1, as_json=args.json)
    engine_pid = int(client.call("status")["pid"]) if args.follow else 0
    socket_path = client.socket_path
    last: dict[str, dict[str, Any]] = {}
    try:
        gone: list[SubProcessNotFoundError] = []
        for stream in streams:
            try:
                last[stream] = _history(client, args, stream, out)
            except SubProcessNotFoundError as exc:
                if args.follow or len(streams) == 1:
                    raise
                gone.append(exc)  # one log removed behind the engine's back: the other is still printed
            out.flush(stream)  # stdout's history ends before stderr's starts
        if len(gone) == len(streams):
            raise gone[0]  # no such process (or both logs gone): as for one stream
        for error in gone:
            print(f"gadget-engine: {error}", file=sys.stderr)
        if not args.follow:
            return EXIT_FAILED if gone else EXIT_OK
        common = {"pid": args.pid, "max_bytes": _PAGE_BYTES}
        while not all(not p["running"] and p["next_offset"] >= p["total_bytes"] for p in last.values()):
            idle(LOG_FOLLOW_SECONDS)
            for stream in streams:
                offset = last[stream]["next_offset"]
                piece = client.call("subprocess.read_log", stream=stream, offset=offset, **common)
                if piece["text"]:
                    out.write(piece)
                last[stream] = piece
        return EXIT_OK
    except (EngineConnectionError, EngineNotRunningError, EngineSocketMissingError) as exc:
        if not args.follow:
            raise
        return engine_went_away(client, socket_path, engine_pid, exc)
    except SubProcessNotFoundError as exc:
        if not last:
            raise

        def listed_now() -> list[dict[str, Any]]:
            return [r for r in client.call("subprocess.list") if r["pid"] == args.pid]

        listed = listed_now()
        while listed and listed[0]["status"] == "exiting":  # a kill deletes the logs once SIGINT is sent
            idle(LOG_FOLLOW_SECONDS)
            listed = listed_now()
        if listed:  # the record is there: its log file was removed or replaced behind the engine's back
            print(
                f"gadget-engine: {exc}; the process is still listed, {listed[0]['status']} "
                "(gadget-engine list)",
                file=sys.stderr,
            )
            return EXIT_FAILED
        print(f"gadget-engine: {args.pid} was killed; its logs are deleted", file=sys.stderr)
        return EXIT_OK
    except KeyboardInterrupt:
        return EXIT_OK
    finally:
        out.flush()


def print_events(events: list[dict[str, Any]], as_json: bool) -> None:
    """Print fired events: one JSON object each, or a header line and the event's text."""
    if as_json:
        emit_json(events)
    else:
        for event in events:
            head = escape_controls(
                f"--- event {event['cursor']}: {event['job_name']} (job {event['job_id']}) ---"
            )
            sys.stdout.write(head + "\n")
            sys.stdout.write(printable(event["text"].rstrip("\n")) + "\n")  # no escape reaches the terminal
    sys.stdout.flush()


def _wait_events(client: EngineClient, output: int | None, since: int) -> list[dict[str, Any]]:
    """One ``events.wait`` for the events after ``since``, ended at once when ``output``'s reader goes.

    Raises:
        BrokenPipeError: ``output``'s reader went away during the wait.
    """
    if output is None:
        found: list[dict[str, Any]] = client.call("events.wait", since=since, seconds=EVENTS_WAIT_SECONDS)
    else:
        found = client.call_watching(output, "events.wait", since=since, seconds=EVENTS_WAIT_SECONDS)
    return found


def events(client: EngineClient, args: argparse.Namespace) -> int:
    """``gadget-engine events [--since CURSOR] [-f]``."""
    since = args.since
    engine_pid = int(client.call("status")["pid"]) if args.follow else 0
    socket_path = client.socket_path
    waits = True  # the engine has ``events.wait`` (an older one is asked every EVENTS_FOLLOW_SECONDS)
    output = _output_fd()
    try:
        found = client.call("events", since=since)
        while True:
            print_events(found, args.json)
            if found:
                since = found[-1]["cursor"]
            if not args.follow:
                return EXIT_OK
            if waits:
                try:
                    idle(0)
                    found = _wait_events(client, output, since)
                    continue
                except RpcError as exc:
                    if exc.code != METHOD_NOT_FOUND:
                        raise
                    waits = False
            idle(EVENTS_FOLLOW_SECONDS)
            found = client.call("events", since=since)
    except (EngineConnectionError, EngineNotRunningError, EngineSocketMissingError) as exc:
        if not args.follow:
            raise
        return engine_went_away(client, socket_path, engine_pid, exc)
    except KeyboardInterrupt:
        return EXIT_OK
