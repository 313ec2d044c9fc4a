"""The subcommands of ``gadget-engine``: each takes a connected client and the parsed arguments.

Each returns an exit code or raises: :class:`CommandFailedError` (exit 1, one line), the client's errors
(mapped to exit codes by ``_cli.main``). Output: readable tables by default, one JSON object per line with
``--json``. Standard library only (``serve``, ``mcp`` and ``completion`` import what they need when run).
``start``/``stop``/``status`` are in :mod:`._cli_start`, ``log``/``events`` in :mod:`._cli_follow`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final

from ._cli_follow import print_events
from ._cli_output import EXIT_FAILED, EXIT_OK, CommandFailedError, emit_json, table
from ._entry import EXIT_INTERRUPTED
from ._errors import InvalidArgumentError, SpawnError
from ._input import check_json, read_ready
from ._termtext import escape_controls
from ._when import expand_cron, read_at, read_zone, show_moment
from .server._client import EngineClient
from .server._location import resolve_state_dir
from .server._protocol import decode_line, describe_schedule

if TYPE_CHECKING:
    from ._config import EngineConfig

#: The environment variable naming the job store URL of ``serve`` and ``start`` (``--store``).
STORE_VARIABLE: Final = "GADGET_ENGINE_STORE"
#: The longest command ``list`` shows in its table, in characters.
COMMAND_COLUMN_CHARS: Final = 200


def _command_line(command: str, args: Sequence[str]) -> str:
    """The command as one line of a table, cut to :data:`COMMAND_COLUMN_CHARS` (``--json`` and
    ``subprocess.summarize`` keep the whole argv)."""
    line = " ".join(shlex.join((command, *args)).splitlines())
    if len(line) <= COMMAND_COLUMN_CHARS:
        return line
    return f"{line[: COMMAND_COLUMN_CHARS - 30]}... ({len(line.encode())} bytes in all)"


def _describe_payload(payload: dict[str, Any]) -> str:
    if payload.get("kind") == "system_event":
        return f"text {payload.get('text')!r}"
    return "command " + shlex.join(str(a) for a in payload.get("argv", []))


# ---- subcommands ---------------------------------------------------------------------------------------


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine settings of ``serve`` and an embedding ``mcp``, from their options."""
    from ._config import EngineConfig  # attrs and platformdirs: not for the client commands

    store = getattr(args, "store", None) or os.environ.get(STORE_VARIABLE) or None
    try:
        return EngineConfig(
            store_url=store,
            engine_id=getattr(args, "engine_id", None),
            owner_lost_seconds=getattr(args, "owner_lost_seconds", 60.0),
            lease_seconds=getattr(args, "lease_seconds", 30.0),
            state_dir=resolve_state_dir(args.state_dir),
            grace_seconds=args.grace_seconds,
            exit_watch_shell=shlex.split(args.exit_watch_shell) if args.exit_watch_shell else None,
            containment=args.containment,
            max_processes_per_project=args.max_processes_per_project,
            max_processes=args.max_processes,
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


def split_hint(command: str, args: object, *, tool: bool = False) -> str:
    """A hint for a command line given as one word (``"npm run dev"`` and no args), else ``""``."""
    if args or len(command.split()) < 2:
        return ""
    words = command.split()
    if tool:
        split = json.dumps({"command": words[0], "args": words[1:]})[1:-1]
        return f"; {command!r} is one word with spaces: give the program and its arguments apart ({split})"
    return (
        f"; {command!r} is one word with spaces: give the program and its arguments apart "
        f"(-- {shlex.join(words)}), or run it through a shell (-- bash -c {shlex.quote(command)})"
    )


def _create_options(args: argparse.Namespace) -> dict[str, object]:
    """``create``'s extension options as the RPC's ``stdin``, ``ready``, ``restart``, ``notify_on_exit``."""
    options: dict[str, object] = {}
    if args.stdin:
        options["stdin"] = True
    if args.ready_log is not None or args.ready_port is not None:
        ready: dict[str, object] = {}
        if args.ready_log is not None:
            ready["log"] = args.ready_log
        if args.ready_port is not None:
            ready["port"] = args.ready_port
        if args.ready_timeout is not None:
            ready["timeout"] = args.ready_timeout
        options["ready"] = ready
    elif args.ready_timeout is not None:
        args.parser.error("--ready-timeout goes with --ready-log or --ready-port")
    if args.restart is not None:
        options["restart"] = {"mode": args.restart}
        if args.max_restarts is not None:
            options["restart"] = {"mode": args.restart, "max_restarts": args.max_restarts}
    elif args.max_restarts is not None:
        args.parser.error("--max-restarts goes with --restart on-failure|always")
    if args.notify_on_exit:
        options["notify_on_exit"] = True
    return options


def create(client: EngineClient, args: argparse.Namespace) -> int:
    """``create``: the pid (the summary with ``--json``). With ``--ready-*`` it creates, prints the pid at
    once, then waits for readiness (``subprocess.wait_ready``): exit 1 when the process exited first or
    the time ran out; a Ctrl-C during that wait leaves the process running and its pid on the screen, and
    says so (exit 130)."""
    env = dict(args.env or ())
    options = _create_options(args)
    ready = options.pop("ready", None)
    if ready is not None:
        read_ready(ready)  # a bad pattern or port is refused before anything runs
    try:
        summary = client.call(
            "subprocess.create",
            project=os.path.abspath(args.project),
            command=args.argv[0],
            args=args.argv[1:],
            env=env,
            **options,
        )
    except SpawnError as exc:
        hint = split_hint(args.argv[0], args.argv[1:])
        if not hint:
            raise
        raise CommandFailedError(f"{exc}{hint}") from None
    if ready is None:
        return _print_created(args, summary, "pid")
    pid = summary["pid"]
    try:  # a Ctrl-C right after the pid is printed is this one too
        if not args.json:
            print(pid, flush=True)
        summary = client.call("subprocess.wait_ready", pid=pid, ready=ready)
    except KeyboardInterrupt:
        print(
            f"gadget-engine: interrupted while waiting for {pid} to be ready; it goes on running "
            f"(gadget-engine kill {pid} ends it)",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    if args.json:
        emit_json([summary])
    else:
        state = summary["ready"]
        detail = {"exited": f" ({summary['status']})", "timeout": " (still running)"}.get(state, "")
        print(f"ready: {state}{detail}", file=sys.stderr)
    # Not ready (it exited first, or the time ran out): exit 1, so that `create --ready-log ... && next`
    # stops there (found by a new user). The process was created all the same: its pid is printed.
    return EXIT_OK if summary["ready"] == "ready" else EXIT_FAILED


def send_input(client: EngineClient, args: argparse.Namespace) -> int:
    """``input PID TEXT [--eof] [--no-newline]``: TEXT (and a newline) to the process's stdin."""
    text = args.text if args.no_newline else args.text + "\n"
    result = client.call("subprocess.input", pid=args.pid, text=text, eof=args.eof)
    if args.json:
        emit_json([result])
    return EXIT_OK


def wait(client: EngineClient, args: argparse.Namespace) -> int:
    """``wait PID [--timeout S]``: print the status once the process has exited (exit 1: still running)."""
    summary = client.call("subprocess.wait", pid=args.pid, timeout_seconds=args.timeout)
    if args.json:
        emit_json([summary])
    elif summary["finished"]:
        status, last = summary["status"], summary.get("last_exit")
        print(f"{status}; its last run {last}" if status.startswith("crash loop") and last else status)
    if summary.get("leftovers_running"):
        raise CommandFailedError(
            f"{args.pid} exited ({summary['status']}), but what it left running is still running after "
            f"{args.timeout:g} s; it gets the grace period to end, then SIGINT, another grace period, SIGKILL"
        )
    if not summary["finished"]:
        raise CommandFailedError(f"{args.pid} is still running after {args.timeout:g} s")
    return EXIT_OK


def _print_created(args: argparse.Namespace, record: dict[str, Any], key: str) -> int:
    """What a creating subcommand prints: the new object's ``key`` (pid, job id), or it whole as JSON."""
    if args.json:
        emit_json([record])
    else:
        print(record[key])
    return EXIT_OK


def list_subprocesses(client: EngineClient, args: argparse.Namespace) -> int:
    if args.project is not None:
        records = client.call("subprocess.list", project=os.path.abspath(args.project))
    else:
        records = client.call("subprocess.list")
    if args.json:
        emit_json(records)
        return EXIT_OK
    rows = [
        [
            str(r["pid"]),
            r["project_slug"],
            r["status"],
            show_moment(r["created_at"]),
            _command_line(r["command"], r["args"]),
        ]
        for r in records
    ]
    table(["PID", "PROJECT", "STATUS", "CREATED", "COMMAND"], rows)
    return EXIT_OK


def stop(method: str, verb: str) -> Callable[[EngineClient, argparse.Namespace], int]:
    def run(client: EngineClient, args: argparse.Namespace) -> int:
        result = client.call(method, pid=args.pid)
        if args.json:
            emit_json([result])
        elif result["stopped"]:
            print(f"{verb} {args.pid}")
        else:
            kept = "its logs were deleted" if method == "subprocess.kill" else "its logs are kept"
            called_off = "; its restart is called off" if result.get("restart_called_off") else ""
            print(f"{args.pid} had already stopped{called_off}; {kept}")
        return EXIT_OK

    return run


def kill_all(client: EngineClient, args: argparse.Namespace) -> int:
    result = client.call("subprocess.kill_all")
    if args.json:
        emit_json([result])
    if not result["verified"]:
        raise CommandFailedError("some process survived SIGKILL; see `gadget-engine serve`'s log")
    if not args.json:
        print("killed every subprocess")
    return EXIT_OK


def _schedule_from(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, object]:
    if args.cwd is not None and args.on_exit is None:
        parser.error("--cwd goes with --on-exit")
    if args.tz is not None and args.cron is None and args.at is None:
        parser.error("--tz goes with --cron or --at")
    try:
        if args.on_exit is not None:
            cwd = os.path.abspath(args.cwd) if args.cwd is not None else os.getcwd()
            return {"kind": "on_exit", "command": args.on_exit, "cwd": cwd}
        if args.cron is not None:
            zone = read_zone(args.tz).key if args.tz is not None else "UTC"
            return {"kind": "cron", "expr": expand_cron(args.cron), "tz": zone}
        if args.every is not None:
            return {"kind": "every", "every_seconds": args.every}
        return {"kind": "at", "at": read_at(args.at, zone=args.tz).isoformat()}
    except InvalidArgumentError as exc:
        parser.error(str(exc))


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


def _one_shot_done(job: dict[str, Any]) -> bool:
    """An ``at`` or on-exit job that fired and is now disabled: ``cron list`` leaves it out."""
    kind = job["schedule"].get("kind")
    return kind in ("at", "on_exit") and not job["enabled"] and job.get("last_run_at") is not None


def _job_zone(job: dict[str, Any]) -> str | None:
    """The zone a job's times are shown in: a cron job's own, else the local one (``None``)."""
    return job["schedule"].get("tz") if job["schedule"].get("kind") == "cron" else None


def _owner(job: dict[str, Any]) -> str:
    """Who runs a job in a fleet: ``any`` engine (a timed text), else its owner, ``owner lost`` or not."""
    if job["payload"].get("kind") == "system_event" and job["schedule"].get("kind") != "on_exit":
        return "any"
    owner = job.get("owner") or "-"
    return f"{owner} (owner lost)" if job.get("owner_lost") else owner


def cron_list(client: EngineClient, args: argparse.Namespace) -> int:
    jobs = [job for job in client.call("cron.list") if args.all or not _one_shot_done(job)]
    if args.json:
        emit_json(jobs)
        return EXIT_OK
    # A fleet (jobs of several engines, or an owner lost) also shows who runs each job.
    fleet = any(job.get("owner_lost") for job in jobs) or len({job.get("owner") for job in jobs} - {None}) > 1
    rows = [
        [
            job["id"],
            job["name"],
            "yes" if job["enabled"] else "no",
            describe_schedule(job["schedule"], show_time=show_moment),
            _describe_payload(job["payload"]),
            show_moment(job["next_run_at"], _job_zone(job)),
            job["last_status"] or "-",
            *([_owner(job)] if fleet else []),
        ]
        for job in jobs
    ]
    table(
        ["ID", "NAME", "ENABLED", "SCHEDULE", "PAYLOAD", "NEXT RUN", "LAST", *(["OWNER"] if fleet else [])],
        rows,
    )
    return EXIT_OK


def fleet(client: EngineClient, args: argparse.Namespace) -> int:
    """``gadget-engine fleet``: the engines sharing the job store and the age of their last heartbeat."""
    members: list[dict[str, Any]] = client.call("fleet")
    if args.json:
        emit_json(members)
        return EXIT_OK
    rows = [
        [
            m["engine_id"] + (" *" if m.get("self") else ""),
            m["host"],
            str(m["pid"]),
            m["version"],
            m["containment"],
            str(m["live_runs"]),
            f"{m['age_seconds']:.1f} s",
            "lost" if m["lost"] else "live",
        ]
        for m in members
    ]
    table(["ENGINE", "HOST", "PID", "VERSION", "CONTAINMENT", "RUNS", "HEARTBEAT", "STATE"], rows)
    return EXIT_OK


def cron_get(client: EngineClient, args: argparse.Namespace) -> int:
    job = client.call("cron.get", job_id=args.job_id)
    if args.json:
        emit_json([job])
        return EXIT_OK
    zone = _job_zone(job)
    rows = [
        ("id", job["id"]),
        ("name", job["name"]),
        ("enabled", "yes" if job["enabled"] else "no"),
        ("schedule", describe_schedule(job["schedule"], show_time=show_moment)),
        ("payload", _describe_payload(job["payload"])),
        ("next run", show_moment(job["next_run_at"], zone)),
        ("last run", show_moment(job["last_run_at"], zone)),
        ("last status", job["last_status"] or "-"),
        ("last error", job["last_error"] or "-"),
        ("created", show_moment(job["created_at"], zone)),
    ]
    for key, value in rows:
        print(f"{key:<12} {escape_controls(str(value))}")
    return EXIT_OK


def cron_run(client: EngineClient, args: argparse.Namespace) -> int:
    """``cron run JOB``: run the job now, wait until its fire is delivered, print that run's event.

    A run of the job under way (another caller's ``cron run``, the timer's) is waited for first, and its
    event comes after ``since`` too: only this run's is printed. It is the one of the ``fire_id`` the
    engine answers with; without one, the newest event of the job, since the runs of a job take turns.
    """
    last = client.call("status").get("last_event")
    since = last["cursor"] if last else 0
    ran = client.call("cron.run_now", job_id=args.job_id)
    fired = [e for e in client.call("events", since=since) if e["job_id"] == args.job_id]
    fire_id = ran.get("fire_id") if isinstance(ran, dict) else None
    fired = [e for e in fired if e["fire_id"] == fire_id] if fire_id is not None else fired[-1:]
    if fired:
        print_events(fired, args.json)
    elif args.json:
        emit_json([{"job_id": args.job_id}])
    else:
        print(f"ran {args.job_id}")
    return EXIT_OK


def cron_change(method: str, verb: str) -> Callable[[EngineClient, argparse.Namespace], int]:
    def run(client: EngineClient, args: argparse.Namespace) -> int:
        enabling = method == "cron.enable" and not args.json
        before = client.call("cron.get", job_id=args.job_id) if enabling else None
        result = client.call(method, job_id=args.job_id)
        if args.json:
            emit_json([result])
            return EXIT_OK
        print(f"{verb} {args.job_id}")
        schedule = result.get("schedule") if isinstance(result, dict) else None
        if before is not None and isinstance(schedule, dict) and schedule.get("kind") == "on_exit":
            print(_on_exit_enabled(before, result))
        return EXIT_OK

    return run


def _on_exit_enabled(before: dict[str, Any], after: dict[str, Any]) -> str:
    """What ``cron enable`` did to an on-exit job: armed it afresh, or nothing (it was armed already).

    An enabled on-exit job's command has started (or is starting) and the job fires once when it exits:
    enabling it again starts nothing. A fire between the look and the enable (``last_run_at`` moved) left
    it disabled, so the enable armed it afresh.
    """
    if before["enabled"] and before["last_run_at"] == after["last_run_at"]:
        return (
            "already enabled: nothing new starts (its command started when the job was armed); the job "
            "fires once when that command exits (cron get shows a start that fails)"
        )
    again = f", again (it last ran at {after['last_run_at']})" if after.get("last_run_at") else ""
    return (
        f"its command starts now{again}; the job fires once when it exits (cron get shows a start that fails)"
    )


def tool(client: EngineClient, args: argparse.Namespace) -> int:
    parser: argparse.ArgumentParser = args.parser
    try:
        params = decode_line(args.params.encode())
    except ValueError as exc:
        parser.error(f"JSON must be a JSON object of tool parameters: {exc}")
    if not isinstance(params, dict):
        parser.error('JSON must be a JSON object of tool parameters, e.g. \'{"cmd": "list"}\'')
    try:
        check_json(params, "JSON")  # what the wire cannot carry is refused here, not half-sent
    except InvalidArgumentError as exc:
        parser.error(str(exc))
    result = client.call("tool.execute", params=params, project=os.path.abspath(args.project))
    if args.json:
        emit_json([result])
    elif result["is_error"]:
        hint = ""
        command = params.get("command")
        if params.get("cmd") == "create" and isinstance(command, str):
            hint = split_hint(command, params.get("args"), tool=True)
        raise CommandFailedError(result["text"] + hint)
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
        args.parser.error(f"argument --project: {args.project!r} is not a directory")  # as tool's: exit 2
    configure_logging(sys.stderr)  # stdout is the protocol's
    config = _engine_config(args)
    _mcp.main(config, project)
    return EXIT_OK


def completion(args: argparse.Namespace) -> int:
    """``completion SHELL``: the shell's completion script, generated from the parser by shtab."""
    try:
        import shtab  # only here: it is not needed by any other subcommand
    except ImportError as exc:
        raise CommandFailedError(f"completion needs shtab ({exc}); reinstall gadget-engine") from None
    parser = args.root_parser
    _mark_directories(parser, shtab.DIRECTORY)
    sys.stdout.write(shtab.complete(parser, shell=args.shell))
    return EXIT_OK


def _mark_directories(parser: argparse.ArgumentParser, directory: object) -> None:
    """Options whose value is a directory (metavar ``DIR``) complete directory names."""
    for action in parser._actions:  # argparse has no public walk of its actions
        if action.metavar == "DIR":
            action.complete = directory  # type: ignore[attr-defined]  # read by shtab
        if isinstance(action, argparse._SubParsersAction):
            for sub in {id(p): p for p in action.choices.values()}.values():
                _mark_directories(sub, directory)
