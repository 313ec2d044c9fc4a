"""The subcommands of ``gadget-engine``: each takes a connected client and the parsed arguments.

Each returns an exit code or raises: :class:`CommandFailedError` (exit 1, one line), the client's errors
(mapped to exit codes by ``_cli.main``). Output: readable tables by default, one JSON object per line with
``--json``. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, Final

from ._errors import InvalidArgumentError
from ._input import check_json
from .server._client import EngineClient
from .server._location import resolve_state_dir
from .server._protocol import decode_line, describe_schedule

if TYPE_CHECKING:
    from ._config import EngineConfig

EXIT_OK: Final = 0
EXIT_FAILED: Final = 1
EXIT_USAGE: Final = 2
EXIT_NO_ENGINE: Final = 3

#: How often ``log --follow`` asks for more output, in seconds.
LOG_FOLLOW_SECONDS: Final = 0.25
#: How often ``events --follow`` asks for new events, in seconds.
EVENTS_FOLLOW_SECONDS: Final = 0.5
_PAGE_BYTES: Final = 1024 * 1024
#: The longest command ``list`` shows in its table, in characters.
COMMAND_COLUMN_CHARS: Final = 200


class CommandFailedError(Exception):
    """Raised by a subcommand for a failure reported on one line with exit code 1."""


# ---- output ------------------------------------------------------------------------------------------


def _emit_json(values: Iterable[object]) -> None:
    for value in values:
        sys.stdout.write(json.dumps(value, ensure_ascii=False, separators=(",", ":")) + "\n")


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    for row in (headers, *rows):
        cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=True)]
        sys.stdout.write("  ".join(cells).rstrip() + "\n")


def _short_time(value: object) -> str:
    if not isinstance(value, str):
        return "-"
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        return value
    return moment.strftime("%Y-%m-%d %H:%M:%S")


def _command_line(command: str, args: Sequence[str]) -> str:
    """The command as one line of a table, cut to :data:`COMMAND_COLUMN_CHARS` (``--json`` and
    ``subprocess.summarize`` keep the whole argv)."""
    line = " ".join(" ".join((command, *args)).splitlines())
    if len(line) <= COMMAND_COLUMN_CHARS:
        return line
    return f"{line[: COMMAND_COLUMN_CHARS - 30]}... ({len(line.encode())} bytes in all)"


def _describe_payload(payload: dict[str, Any]) -> str:
    if payload.get("kind") == "system_event":
        return f"text {payload.get('text')!r}"
    return "command " + " ".join(str(a) for a in payload.get("argv", []))


# ---- subcommands ---------------------------------------------------------------------------------------


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine settings of ``serve`` and an embedding ``mcp``, from their options."""
    from ._config import EngineConfig  # attrs and platformdirs: not for the client commands

    try:
        return EngineConfig(
            state_dir=resolve_state_dir(args.state_dir),
            grace_seconds=args.grace_seconds,
            exit_watch_shell=shlex.split(args.exit_watch_shell) if args.exit_watch_shell else None,
            repair_store=getattr(args, "repair", False),
            max_connections=getattr(args, "max_connections", 128),
            connection_idle_seconds=getattr(args, "idle_seconds", 60.0),
            max_request_bytes=getattr(args, "max_request_bytes", 1024 * 1024),
        )
    except ValueError as exc:
        raise CommandFailedError(str(exc)) from None


def serve(args: argparse.Namespace) -> int:
    import trio  # only `serve` needs it

    from ._errors import EngineLockedError
    from .server._eventlog import configure_logging, log_event
    from .server._server import serve

    configure_logging(sys.stderr)
    config = _engine_config(args)
    try:
        trio.run(serve, config)
    except EngineLockedError as exc:
        raise CommandFailedError(str(exc)) from None
    except OSError as exc:
        log_event("failed", error=str(exc))
        raise CommandFailedError(f"the engine could not start: {exc}") from None
    return EXIT_OK


def create(client: EngineClient, args: argparse.Namespace) -> int:
    env = dict(args.env or ())
    summary = client.call(
        "subprocess.create",
        project=os.path.abspath(args.project),
        command=args.argv[0],
        args=args.argv[1:],
        env=env,
    )
    return _print_created(args, summary, "pid")


def _print_created(args: argparse.Namespace, record: dict[str, Any], key: str) -> int:
    """What a creating subcommand prints: the new object's ``key`` (pid, job id), or it whole as JSON."""
    if args.json:
        _emit_json([record])
    else:
        print(record[key])
    return EXIT_OK


def list_subprocesses(client: EngineClient, args: argparse.Namespace) -> int:
    records = client.call("subprocess.list")
    if args.json:
        _emit_json(records)
        return EXIT_OK
    rows = [
        [
            str(r["pid"]),
            r["project_slug"],
            r["status"],
            _short_time(r["created_at"]),
            _command_line(r["command"], r["args"]),
        ]
        for r in records
    ]
    _table(["PID", "PROJECT", "STATUS", "CREATED", "COMMAND"], rows)
    return EXIT_OK


def stop(method: str, verb: str) -> Callable[[EngineClient, argparse.Namespace], int]:
    def run(client: EngineClient, args: argparse.Namespace) -> int:
        result = client.call(method, pid=args.pid)
        if args.json:
            _emit_json([result])
        elif result["stopped"]:
            print(f"{verb} {args.pid}")
        else:
            kept = "its logs were deleted" if method == "subprocess.kill" else "its logs are kept"
            print(f"{args.pid} had already exited; {kept}")
        return EXIT_OK

    return run


def kill_all(client: EngineClient, args: argparse.Namespace) -> int:
    result = client.call("subprocess.kill_all")
    if args.json:
        _emit_json([result])
    if not result["verified"]:
        raise CommandFailedError("some process survived SIGKILL; see `gadget-engine serve`'s log")
    if not args.json:
        print("killed every subprocess")
    return EXIT_OK


def _write_slice(piece: dict[str, Any], as_json: bool) -> None:
    if as_json:
        _emit_json([piece])
    else:
        sys.stdout.write(piece["text"])
    sys.stdout.flush()


def log(client: EngineClient, args: argparse.Namespace) -> int:
    common = {"pid": args.pid, "stream": args.stream, "max_bytes": _PAGE_BYTES}
    if args.tail is not None:
        piece = client.call("subprocess.read_log", tail=args.tail, **common)
        _write_slice(piece, args.json)
    else:
        piece = client.call("subprocess.read_log", **common)
        _write_slice(piece, args.json)
        while piece["next_offset"] < piece["total_bytes"]:
            piece = client.call("subprocess.read_log", offset=piece["next_offset"], **common)
            _write_slice(piece, args.json)
    if not args.follow:
        return EXIT_OK
    offset = piece["next_offset"]
    try:
        while True:
            drained = not piece["running"] and piece["next_offset"] >= piece["total_bytes"]
            if drained:
                return EXIT_OK
            time.sleep(LOG_FOLLOW_SECONDS)
            piece = client.call("subprocess.read_log", offset=offset, **common)
            if piece["text"]:
                _write_slice(piece, args.json)
            offset = piece["next_offset"]
    except KeyboardInterrupt:
        return EXIT_OK


def _schedule_from(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, object]:
    if args.cwd is not None and args.on_exit is None:
        parser.error("--cwd goes with --on-exit")
    if args.tz is not None and args.cron is None:
        parser.error("--tz goes with --cron")
    if args.on_exit is not None:
        cwd = os.path.abspath(args.cwd) if args.cwd is not None else os.getcwd()
        return {"kind": "on_exit", "command": args.on_exit, "cwd": cwd}
    if args.cron is not None:
        return {"kind": "cron", "expr": args.cron, "tz": args.tz or "UTC"}
    if args.every is not None:
        return {"kind": "every", "every_seconds": args.every}
    try:
        moment = datetime.fromisoformat(args.at)
    except ValueError:
        parser.error(f"--at must be an ISO 8601 date and time, got {args.at!r}")
    if moment.tzinfo is None:
        moment = moment.astimezone()  # a local time, as `at` takes it
    return {"kind": "at", "at": moment.isoformat()}


def cron_add(client: EngineClient, args: argparse.Namespace) -> int:
    schedule = _schedule_from(args, args.parser)
    if args.text is not None:
        payload: dict[str, object] = {"kind": "system_event", "text": args.text}
    else:
        if not args.command:
            args.parser.error("--command needs the program to run, e.g. --command make test")
        payload = {"kind": "command", "argv": args.command, "cwd": os.getcwd()}
    params: dict[str, object] = {"schedule": schedule, "payload": payload}
    if args.name is not None:
        params["name"] = args.name
    return _print_created(args, client.call("cron.add", **params), "id")


def cron_list(client: EngineClient, args: argparse.Namespace) -> int:
    jobs = client.call("cron.list")
    if args.json:
        _emit_json(jobs)
        return EXIT_OK
    rows = [
        [
            job["id"],
            job["name"],
            "yes" if job["enabled"] else "no",
            describe_schedule(job["schedule"], show_time=_short_time),
            _describe_payload(job["payload"]),
            _short_time(job["next_run_at"]),
            job["last_status"] or "-",
        ]
        for job in jobs
    ]
    _table(["ID", "NAME", "ENABLED", "SCHEDULE", "PAYLOAD", "NEXT RUN", "LAST"], rows)
    return EXIT_OK


def cron_change(method: str, verb: str) -> Callable[[EngineClient, argparse.Namespace], int]:
    def run(client: EngineClient, args: argparse.Namespace) -> int:
        result = client.call(method, job_id=args.job_id)
        if args.json:
            _emit_json([result])
        else:
            print(f"{verb} {args.job_id}")
        return EXIT_OK

    return run


def _print_events(events: list[dict[str, Any]], as_json: bool) -> None:
    if as_json:
        _emit_json(events)
    else:
        for event in events:
            sys.stdout.write(
                f"--- event {event['cursor']}: {event['job_name']} (job {event['job_id']}) ---\n"
            )
            sys.stdout.write(event["text"].rstrip("\n") + "\n")
    sys.stdout.flush()


def events(client: EngineClient, args: argparse.Namespace) -> int:
    since = args.since
    try:
        while True:
            events = client.call("events", since=since)
            _print_events(events, args.json)
            if events:
                since = events[-1]["cursor"]
            if not args.follow:
                return EXIT_OK
            time.sleep(EVENTS_FOLLOW_SECONDS)
    except KeyboardInterrupt:
        return EXIT_OK


def tool(client: EngineClient, args: argparse.Namespace) -> int:
    try:
        params = decode_line(args.params.encode())
    except ValueError as exc:
        args.parser.error(f"JSON must be a JSON object of tool parameters: {exc}")
    if not isinstance(params, dict):
        args.parser.error('JSON must be a JSON object of tool parameters, e.g. \'{"cmd": "list"}\'')
    try:
        check_json(params, "JSON")  # what the wire cannot carry is refused here, not half-sent
    except InvalidArgumentError as exc:
        args.parser.error(str(exc))
    result = client.call("tool.execute", params=params, project=os.path.abspath(args.project))
    if args.json:
        _emit_json([result])
    elif result["is_error"]:
        raise CommandFailedError(result["text"])
    else:
        print(result["text"])
    return EXIT_FAILED if result["is_error"] else EXIT_OK


def mcp(args: argparse.Namespace) -> int:
    try:
        from .server import _mcp  # the SDK loads only in this mode (~0.4 s)
    except ImportError as exc:
        raise CommandFailedError(
            f"mcp needs the MCP SDK ({exc}); install it with: pip install 'gadget-engine[mcp]'"
        ) from None
    from .server._eventlog import configure_logging

    project = os.path.abspath(args.project)
    if not os.path.isdir(project):
        raise CommandFailedError(f"--project {args.project!r} is not a directory")
    configure_logging(sys.stderr)  # stdout is the protocol's
    config = _engine_config(args)
    _mcp.main(config, project)
    return EXIT_OK
