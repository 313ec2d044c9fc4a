"""``gadget-engine``: run the standalone engine (``serve``, ``start``) or talk to a running one.

Every subcommand but ``serve``, ``start``, ``mcp`` and ``completion`` is a client of the engine's socket
(``engine.server._client``, standard library only); a client never starts an engine. ``--state-dir`` and
``--json`` are accepted before or after the subcommand. Exit codes: 0 ok, 1 the operation failed (one line
on stderr), 2 usage, 3 no engine runs. ``docs/guide-cli.md`` has the details.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from . import _cli_commands as commands
from . import _cli_follow as follow
from . import _cli_start as service
from . import _top
from ._cli_output import EXIT_FAILED, EXIT_NO_ENGINE, EXIT_USAGE, CommandFailedError, user_message
from ._entry import EXIT_INTERRUPTED
from ._errors import EngineError, InvalidArgumentError, InvalidScheduleError
from ._escalation import MAX_GRACE_SECONDS
from ._input import MAX_INT, MAX_WAIT_SECONDS, check_env, check_json, read_seconds, read_whole, show
from ._patterns import compile_pattern
from ._version import __version__
from ._when import TEN_YEARS_SECONDS, read_duration
from .server._client import EngineClient, EngineNotRunningError, RpcError
from .server._protocol import INVALID_PARAMS

__all__ = ["build_parser", "main"]

#: Subcommands that run without a connection to an engine.
_STANDALONE = frozenset({"serve", "start", "mcp", "completion"})
#: Subcommands that end with a program and its arguments: a stray option there needs a ``--`` first.
_TRAILING_ARGV = {"create": "gadget-engine create --project DIR -- CMD [ARGS...]"}


# ---- parsing: argparse types over the reader of loose input (engine._input) ---------------------------


def _env_item(value: str) -> tuple[str, str]:
    """``KEY=VALUE`` of ``-e``: a variable name without ``=``, and its value."""
    key, sep, text = value.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {show(value)}")
    try:
        check_env({key: text}, "-e")
    except InvalidArgumentError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return key, text


def _whole(minimum: int, maximum: int = MAX_INT) -> Callable[[str], int]:
    """An argparse type: a whole number from ``minimum`` to ``maximum`` (as ``_input.read_whole``)."""

    def parse(text: str) -> int:
        try:
            value = read_whole(int(text), "the value", minimum)
        except (ValueError, InvalidArgumentError):
            value = None
        if value is None or value > maximum:
            top = "2**53" if maximum == MAX_INT else str(maximum)
            raise argparse.ArgumentTypeError(
                f"expected a whole number from {minimum} to {top}, got {show(text)}"
            )
        return value

    return parse


_positive_int = _whole(1)


def _directory(text: str) -> str:
    """A ``--project`` value: a path, never the empty string (which ``abspath`` would take for here)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a project directory, got an empty string (use . for here)")
    return text


def _port(text: str) -> int:
    """An argparse type: a TCP port number, 1 to 65535 (one wording for every value refused)."""
    try:
        return _whole(1, 65535)(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a TCP port from 1 to 65535, got {show(text)}") from None


def _finite_seconds(text: str) -> float:
    """An argparse type: a finite number of seconds >= 0 (``nan`` and ``inf`` are usage errors)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{show(text)} is not a number of seconds") from None
    try:
        return read_seconds(value, "the value")
    except InvalidArgumentError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _seconds_up_to(maximum: float, *, above_zero: bool = False) -> Callable[[str], float]:
    """An argparse type: a number of seconds from 0 (or above 0) to ``maximum``, as the engine takes it."""

    def read(text: str) -> float:
        floor = "more than 0" if above_zero else "from 0"
        refused = argparse.ArgumentTypeError(f"expected {floor} to {maximum:g} seconds, got {show(text)}")
        try:
            seconds = _finite_seconds(text)
        except argparse.ArgumentTypeError:
            raise refused from None  # one wording for every value refused (-1, nan, inf, 0, 1e9)
        if seconds > maximum or (above_zero and seconds == 0):
            raise refused
        return seconds

    return read


def _pattern(text: str) -> str:
    """An argparse type: a regular expression the engine takes (checked here, said in the CLI's words)."""
    try:
        compile_pattern(text, "the pattern")
    except InvalidArgumentError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _shell_argv(text: str) -> str:
    """An argparse type: ``--exit-watch-shell``, one string split as a shell does, whose program is found
    (an empty one would quietly mean the default, and a missing one leave every on-exit job retrying)."""
    try:
        argv = shlex.split(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{str(exc).lower()} in {show(text)}") from None
    if not argv:
        raise argparse.ArgumentTypeError("an empty argv; give one such as 'bash -lc --', or leave it out")
    if shutil.which(argv[0]) is None:
        raise argparse.ArgumentTypeError(f"{show(argv[0])} is not an installed program (looked in PATH)")
    return text


def _folder(text: str) -> str:
    """An argparse type: a folder's path, not empty (an empty one would quietly mean the default)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path; give a folder, or leave the option out")
    return text


def _duration(text: str) -> float:
    """An argparse type: seconds, or a duration such as ``5m`` or ``1h30m`` (:func:`read_duration`)."""
    try:
        return read_duration(text, "the value")
    except InvalidArgumentError:
        raise argparse.ArgumentTypeError(
            f"expected a number of seconds or a duration such as 90, 5m, 1h30m or 2d, got {show(text)}"
        ) from None


#: ``--every``'s bounds in seconds: ``Every``'s (``MIN_EVERY_SECONDS``, ``MAX_EVERY_SECONDS``), not imported
#: from ``cron._schedule`` because a client command loads no cronsim (a test holds them equal).
EVERY_BOUNDS = (1.0, TEN_YEARS_SECONDS)


def _every(text: str) -> float:
    """An argparse type: ``--every``, a duration from 1 s to ten years (said in the CLI's words)."""
    seconds = _duration(text)
    if not EVERY_BOUNDS[0] <= seconds <= EVERY_BOUNDS[1]:
        raise argparse.ArgumentTypeError(f"expected from 1 s to ten years (3652d), got {show(text)}")
    return seconds


def _check_strings(args: argparse.Namespace) -> None:
    """Refuse any string argument the engine could not carry (NUL, bytes that are not UTF-8): exit 2."""
    for name, value in vars(args).items():
        if isinstance(value, str | list):
            try:
                check_json(value, name)
            except InvalidArgumentError as exc:
                args.parser.error(str(exc))


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose errors also say how to give a value that starts with ``-`` (argparse
    takes it for an option: ``--text -x`` and ``input PID -abc`` read as a missing value)."""

    def error(self, message: str) -> NoReturn:
        option = message.partition("argument ")[2].partition(":")[0]
        if message.endswith(": expected one argument") and option.startswith("--"):
            option = option.split("/")[-1]
            message += f"; a value that starts with - is written {option}=VALUE"
        elif self.prog.endswith(" input") and "required: TEXT" in message:
            message += "; text that starts with - goes after --: input PID -- TEXT"
        super().error(message)


def _refuse_stray(
    parser: argparse.ArgumentParser, command: str | None, stray: list[str], *, dashes: bool
) -> NoReturn:
    """Refuse the arguments no option took, with the subcommand's usage line; for ``create``, say where
    the ``--`` goes when an option of the program was taken for the CLI's."""
    message = f"unrecognized arguments: {' '.join(stray)}"
    if command in _TRAILING_ARGV and not dashes and any(word.startswith("-") for word in stray):
        message += f"; put -- before the command and its options: {_TRAILING_ARGV[command]}"
    parser.error(message)


def _engine_options(p: argparse.ArgumentParser, *, embedded: bool = False) -> None:
    """The engine settings ``serve``, ``start`` and an embedding ``mcp`` take."""
    prefix = "embedded: " if embedded else ""
    p.add_argument(
        "--grace-seconds",
        type=_seconds_up_to(MAX_GRACE_SECONDS),
        default=5.0,
        metavar="S",
        help=f"{prefix}SIGINT -> SIGKILL delay (default 5)",
    )
    p.add_argument(
        "--exit-watch-shell",
        type=_shell_argv,
        metavar="ARGV",
        help=f"{prefix}the argv prefix of on-exit commands, one string (default: 'bash -lc --')",
    )
    p.add_argument(
        "--containment",
        choices=("auto", "cgroup", "process-group"),
        default="auto",
        help=f"{prefix}a cgroup v2 leaf per run, or the process group (default: auto, cgroup where writable)",
    )
    p.add_argument(
        "--max-processes-per-project",
        type=_positive_int,
        default=32,
        metavar="N",
        help=f"{prefix}live subprocesses one project may have (default 32)",
    )
    p.add_argument(
        "--max-processes",
        type=_positive_int,
        default=256,
        metavar="N",
        help=f"{prefix}live subprocesses in the whole engine (default 256)",
    )


def _server_options(p: argparse.ArgumentParser) -> None:
    """The socket's limits, the store and its repair, which ``serve`` and ``start`` take."""
    p.add_argument(
        "--store",
        metavar="URL",
        help="a PostgreSQL job store shared by a fleet of engines, postgresql://user@host/db "
        "(default: $GADGET_ENGINE_STORE, else SQLite in the state dir); keep its password out of the "
        "command line: PGPASSWORD, ~/.pgpass or $GADGET_ENGINE_STORE",
    )
    p.add_argument(
        "--engine-id",
        metavar="ID",
        help="this engine's id in the fleet (default: one generated once and kept in the state dir)",
    )
    p.add_argument(
        "--owner-lost-seconds",
        type=_finite_seconds,
        default=60.0,
        metavar="S",
        help="fleet: an engine silent this long shows 'owner lost' on its jobs (default 60)",
    )
    p.add_argument(
        "--lease-seconds",
        type=_finite_seconds,
        default=30.0,
        metavar="S",
        help="fleet: how long an undelivered event stays with the engine that logged it (default 30)",
    )
    p.add_argument(
        "--repair",
        action="store_true",
        help="if the job store is damaged: keep what can be read in a new one, move the damaged file aside",
    )
    p.add_argument(
        "--max-connections", type=_positive_int, default=128, metavar="N", help="socket connections at once"
    )
    p.add_argument(
        "--idle-seconds",
        type=_finite_seconds,
        default=60.0,
        metavar="S",
        help="close a connection that sends no complete request for S seconds",
    )
    p.add_argument(
        "--max-request-bytes",
        type=_positive_int,
        default=1024 * 1024,
        metavar="N",
        help="the longest request line, in bytes",
    )


def build_parser() -> argparse.ArgumentParser:
    """The ``gadget-engine`` parser (the completion scripts are generated from it)."""
    common = _Parser(add_help=False)
    common.add_argument(
        "--state-dir",
        type=_folder,
        metavar="DIR",
        default=argparse.SUPPRESS,
        help="the engine's state directory",
    )
    common.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help="one JSON object per line"
    )
    parser = _Parser(
        prog="gadget-engine", parents=[common], description="Run or talk to a standalone gadget-engine."
    )
    parser.add_argument("--version", action="version", version=f"gadget-engine {__version__}")
    # Not ``required``: argparse would then report a missing subcommand before a stray option, so that
    # ``gadget-engine --bogus`` said "COMMAND is required"; ``main`` says each in its turn.
    sub = parser.add_subparsers(dest="command_name", metavar="COMMAND", parser_class=_Parser)
    parser.set_defaults(handler=None, parser=parser)

    def add(name: str, handler: object, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, parents=[common], help=help_text, description=help_text)
        p.set_defaults(handler=handler, parser=p)
        return p

    p = add("start", service.start, "start the engine in the background; return once it answers")
    _engine_options(p)
    _server_options(p)
    p.add_argument(
        "--wait-seconds", type=_duration, default=30.0, metavar="S", help="how long to wait (default 30)"
    )
    p = add("stop", service.stop, "stop the engine gracefully and wait until it has exited")
    p.add_argument(
        "--end-watched",
        action="store_true",
        help="also end watched on-exit commands (each job fires once, cancelled); default: left running",
    )
    p.add_argument(
        "--wait-seconds", type=_duration, default=30.0, metavar="S", help="how long to wait (default 30)"
    )
    add("status", service.status, "show the engine's pid, version, uptime, store, runs and jobs")
    p = add("serve", commands.serve, "run the engine in the foreground until SIGINT or SIGTERM")
    _engine_options(p)
    _server_options(p)
    p = add(
        "create", commands.create, "start a subprocess: create --project DIR [-e KEY=VALUE] -- CMD [ARGS...]"
    )
    p.add_argument("--project", required=True, type=_directory, metavar="DIR")
    p.add_argument("-e", "--env", action="append", type=_env_item, metavar="KEY=VALUE")
    p.add_argument("--stdin", action="store_true", help="give it a stdin pipe (write with: input PID TEXT)")
    p.add_argument(
        "--ready-log", type=_pattern, metavar="RE", help="return once a line of its output matches RE"
    )
    p.add_argument("--ready-port", type=_port, metavar="N", help="return once it listens on TCP port N")
    p.add_argument(
        "--ready-timeout",
        type=_seconds_up_to(MAX_WAIT_SECONDS, above_zero=True),
        metavar="S",
        help="wait for ready at most S s (default 30)",
    )
    p.add_argument(
        "--restart",
        choices=("no", "on-failure", "always"),
        help="restart it when it exits on its own (default: no)",
    )
    p.add_argument(
        "--max-restarts",
        type=_whole(0),
        metavar="N",
        help="restarts within 60 s before a crash loop (default 5)",
    )
    p.add_argument(
        "--notify-on-exit", action="store_true", help="its own final exit becomes an event (see: events)"
    )
    p.add_argument("argv", nargs="+", metavar="CMD")
    p = add("list", commands.list_subprocesses, "list the subprocesses")
    p.add_argument("--project", type=_directory, metavar="DIR", help="only this project's")
    p = add("kill", commands.stop("subprocess.kill", "killed"), "kill a subprocess and delete its logs")
    p.add_argument("pid", type=_positive_int, metavar="PID")
    add("kill-all", commands.kill_all, "kill every subprocess and delete their logs")
    p = add("halt", commands.stop("subprocess.halt", "halted"), "stop a subprocess and keep its logs")
    p.add_argument("pid", type=_positive_int, metavar="PID")
    p = add("log", follow.log, "print a subprocess's log")
    p.add_argument("pid", type=_positive_int, metavar="PID")
    p.add_argument(
        "--stream",
        choices=("stdout", "stderr", "both"),
        default="stdout",
        help="both: stdout then stderr, each line prefixed with its stream",
    )
    p.add_argument(
        "-n",
        "--tail",
        type=_whole(0),
        metavar="N",
        help="only the last N lines (0: none; with -f, what comes next)",
    )
    p.add_argument("-f", "--follow", action="store_true", help="go on until the process has exited")
    p.add_argument("--new", action="store_true", help="only what is new since the last log --new")
    p.add_argument(
        "--grep", type=_pattern, metavar="RE", help="only the lines matching RE, with their numbers"
    )
    p = add("input", commands.send_input, "write TEXT and a newline to a subprocess's stdin")
    p.add_argument("pid", type=_positive_int, metavar="PID")
    p.add_argument("text", metavar="TEXT")
    p.add_argument("--eof", action="store_true", help="then close its stdin (end of input)")
    p.add_argument("--no-newline", action="store_true", help="send TEXT as it is, without a newline")
    p = add("wait", commands.wait, "wait until a subprocess has exited; print how it ended")
    p.add_argument("pid", type=_positive_int, metavar="PID")
    p.add_argument(
        "--timeout",
        type=_seconds_up_to(MAX_WAIT_SECONDS),
        default=30.0,
        metavar="S",
        help="at most S s (default 30, max 300)",
    )

    cron = add("cron", None, "scheduled and on-exit jobs")
    cron_sub = cron.add_subparsers(dest="cron_command", metavar="COMMAND")

    def add_cron(name: str, handler: object, help_text: str) -> argparse.ArgumentParser:
        p = cron_sub.add_parser(name, parents=[common], help=help_text, description=help_text)
        p.set_defaults(handler=handler, parser=p)
        return p

    p = add_cron("add", commands.cron_add, "add a job and print its id")
    when = p.add_mutually_exclusive_group(required=True)
    when.add_argument("--on-exit", metavar="CMD", help="run CMD now and fire when it exits")
    when.add_argument("--cron", metavar="EXPR", help="five cron fields, or @hourly, @daily, @weekly...")
    when.add_argument("--every", type=_every, metavar="DURATION", help="seconds, or 5m, 1h30m, 2d...")
    when.add_argument(
        "--at", metavar="TIME", help="once: ISO 8601 (local time, or --tz, [Zone] or an offset), HH:MM, +10m"
    )
    p.add_argument("--cwd", metavar="DIR", help="the on-exit command's directory (default: here)")
    p.add_argument("--tz", metavar="TZ", help="the zone of --cron (default: UTC) or of --at (default: local)")
    p.add_argument("--name", metavar="NAME")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--text", metavar="TEXT", help="deliver TEXT")
    what.add_argument(
        "--command", nargs=argparse.REMAINDER, metavar="CMD", help="run CMD... (the rest of the line)"
    )
    p = add_cron("list", commands.cron_list, "list the jobs (not the one-shot jobs that fired)")
    p.add_argument("--all", action="store_true", help="also the one-shot jobs that fired")
    for name, handler, help_text in (
        ("get", commands.cron_get, "show a job"),
        ("run", commands.cron_run, "run a job now and print its event"),
        ("rm", commands.cron_change("cron.remove", "removed"), "remove a job"),
        ("enable", commands.cron_change("cron.enable", "enabled"), "enable a job"),
        ("disable", commands.cron_change("cron.disable", "disabled"), "disable a job"),
    ):
        add_cron(name, handler, help_text).add_argument("job_id", metavar="JOB_ID")

    add("fleet", commands.fleet, "list the engines sharing the job store, with the age of their heartbeat")
    p = add("events", follow.events, "print fired events")
    p.add_argument("--since", type=_whole(0), default=0, metavar="CURSOR", help="only events after CURSOR")
    p.add_argument("-f", "--follow", action="store_true", help="wait for new events until Ctrl-C")
    p = add("top", _top.top, "a live view of the runs and cron jobs (needs the tui extra)")
    p.add_argument("--project", type=_directory, metavar="DIR", help="start filtered to this project")
    p = add("tool", commands.tool, "call the subprocess tool: tool JSON --project DIR")
    p.add_argument("params", metavar="JSON")
    p.add_argument("--project", default=".", type=_directory, metavar="DIR")
    p = add("mcp", commands.mcp, "serve the tools over MCP on stdio (embeds an engine if none runs)")
    p.add_argument(
        "--project", default=".", type=_directory, metavar="DIR", help="the tool's project (default: here)"
    )
    _engine_options(p, embedded=True)
    p = add("completion", commands.completion, "print the shell completion script: completion bash|zsh|fish")
    p.add_argument("shell", choices=("bash", "zsh", "fish"))
    return parser


def _normalise(argv: list[str]) -> list[str]:
    """Drop a ``--`` right after ``cron add --command`` (argparse's remainder would keep it)."""
    if "--command" in argv:
        at = argv.index("--command")
        if at + 1 < len(argv) and argv[at + 1] == "--":
            return argv[: at + 1] + argv[at + 2 :]
    return argv


def _not_running(error: EngineNotRunningError, state_dir: str | None) -> str:
    """The client's "no engine is running" message, pointing at ``start`` rather than ``serve``."""
    text = user_message(error)
    head, sep, _ = text.partition("; start one with: ")
    if not sep:
        return text
    where = f" --state-dir {shlex.quote(state_dir)}" if state_dir else ""
    return f"{head}; start one with: gadget-engine{where} start"


#: The exit code when standard output's reader went away, as a shell reports a process ended by SIGPIPE.
EXIT_BROKEN_PIPE = 128 + 13


#: What a Ctrl-C leaves going on in the engine, by command: a request sent is not taken back (found by a
#: new user: `kill`, `stop`, `start` and `cron run` exited 130 saying nothing while the engine went on).
_GOES_ON = {
    "kill": "the engine goes on ending the process and deletes its logs (gadget-engine list shows it)",
    "halt": "the engine goes on ending the process and keeps its logs (gadget-engine list shows it)",
    "kill-all": "the engine goes on ending every process (gadget-engine list shows them)",
    "stop": "the engine goes on stopping (gadget-engine status exits 3 once it has)",
    "start": "an engine this start spawned, if any, goes on starting (gadget-engine status tells)",
    "create": "the process may have been created (gadget-engine list shows it)",
    "input": "the text may have been written (in part) to the process's stdin",
    "cron run": "the job's run goes on in the engine (gadget-engine events shows its fire)",
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``gadget-engine`` command line and return its exit code."""
    raw = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, stray = parser.parse_known_args(_normalise(raw))
    if stray:  # said with the subcommand's usage line, not the top level's
        command = getattr(args, "command_name", None)
        _refuse_stray(getattr(args, "parser", None) or parser, command, stray, dashes="--" in raw)
    args.state_dir = getattr(args, "state_dir", None)
    args.json = getattr(args, "json", False)
    args.root_parser = parser
    if args.handler is None:
        args.parser.error("the following arguments are required: COMMAND")
    _check_strings(args)
    try:
        if args.command_name in _STANDALONE:
            return int(args.handler(args))
        with EngineClient(args.state_dir) as client:
            return int(args.handler(client, args))
    except EngineNotRunningError as exc:
        print(f"gadget-engine: {_not_running(exc, args.state_dir)}", file=sys.stderr)
        return EXIT_NO_ENGINE
    except BrokenPipeError:  # the reader stopped reading (| head): quiet, as cat is; nothing more to flush
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except (InvalidArgumentError, InvalidScheduleError, RpcError) as exc:
        if isinstance(exc, RpcError) and exc.code != INVALID_PARAMS:
            print(f"gadget-engine: {user_message(exc)}", file=sys.stderr)
            return EXIT_FAILED
        # The engine found the input wrong: a usage error, as one the CLI finds itself.
        print(f"gadget-engine: {user_message(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except (CommandFailedError, EngineError, OSError) as exc:
        print(f"gadget-engine: {user_message(exc)}", file=sys.stderr)
        return EXIT_FAILED
    except ValueError as exc:  # a value that cannot travel as JSON (e.g. a non-finite number)
        print(f"gadget-engine: invalid input: {user_message(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        said = _GOES_ON.get(args.command_name if args.command_name != "cron" else f"cron {args.cron_command}")
        if said is not None:
            print(f"gadget-engine: interrupted; {said}", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        sys.stdout.flush()
