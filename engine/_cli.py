"""``gadget-engine``: run the standalone engine (``serve``) or talk to a running one.

Every subcommand but ``serve`` is a client of the engine's socket (``engine.server._client``, standard
library only); a client never starts an engine. ``--state-dir`` and ``--json`` are accepted before or after
the subcommand. Exit codes: 0 ok, 1 the operation failed (one line on stderr), 2 usage, 3 no engine runs.
``docs/guide-cli.md`` has the details.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from . import _cli_commands as commands
from ._cli_commands import EXIT_FAILED, EXIT_NO_ENGINE, EXIT_USAGE, CommandFailedError
from ._errors import EngineError, InvalidArgumentError
from ._input import check_env, check_json, read_seconds, read_whole, show
from .server._client import EngineClient, EngineNotRunningError

__all__ = ["main"]

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


def _whole(minimum: int) -> Callable[[str], int]:
    """An argparse type: a whole number ``>= minimum`` (as :func:`engine._input.read_whole`)."""

    def parse(text: str) -> int:
        try:
            return read_whole(int(text), "the value", minimum)
        except (ValueError, InvalidArgumentError):
            raise argparse.ArgumentTypeError(
                f"expected a whole number >= {minimum}, got {show(text)}"
            ) from None

    return parse


_positive_int = _whole(1)


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


def _check_strings(args: argparse.Namespace) -> None:
    """Refuse any string argument the engine could not carry (NUL, bytes that are not UTF-8): exit 2."""
    for name, value in vars(args).items():
        if isinstance(value, str | list):
            try:
                check_json(value, name)
            except InvalidArgumentError as exc:
                args.parser.error(str(exc))


def _build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--state-dir", metavar="DIR", default=argparse.SUPPRESS, help="the engine's state directory"
    )
    common.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help="one JSON object per line"
    )
    parser = argparse.ArgumentParser(
        prog="gadget-engine", parents=[common], description="Run or talk to a standalone gadget-engine."
    )
    sub = parser.add_subparsers(dest="command_name", required=True, metavar="COMMAND")

    def add(name: str, handler: object, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, parents=[common], help=help_text, description=help_text)
        p.set_defaults(handler=handler, parser=p)
        return p

    p = add("serve", commands.serve, "run the engine in the foreground until SIGINT or SIGTERM")
    p.add_argument(
        "--grace-seconds", type=_finite_seconds, default=5.0, metavar="S", help="SIGINT -> SIGKILL delay"
    )
    p.add_argument(
        "--exit-watch-shell",
        metavar="ARGV",
        help="the argv prefix of on-exit commands, one string (default: 'bash -lc --')",
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
    p = add(
        "create", commands.create, "start a subprocess: create --project DIR [-e KEY=VALUE] -- CMD [ARGS...]"
    )
    p.add_argument("--project", required=True, metavar="DIR")
    p.add_argument("-e", "--env", action="append", type=_env_item, metavar="KEY=VALUE")
    p.add_argument("argv", nargs="+", metavar="CMD")
    add("list", commands.list_subprocesses, "list the subprocesses")
    p = add("kill", commands.stop("subprocess.kill", "killed"), "kill a subprocess and delete its logs")
    p.add_argument("pid", type=_positive_int)
    add("kill-all", commands.kill_all, "kill every subprocess and delete their logs")
    p = add("halt", commands.stop("subprocess.halt", "halted"), "stop a subprocess and keep its logs")
    p.add_argument("pid", type=_positive_int)
    p = add("log", commands.log, "print a subprocess's log")
    p.add_argument("pid", type=_positive_int)
    p.add_argument("--stream", choices=("stdout", "stderr"), default="stdout")
    p.add_argument("--tail", type=_positive_int, metavar="N", help="only the last N lines")
    p.add_argument("--follow", action="store_true", help="go on until the process has exited")

    cron = add("cron", None, "scheduled and on-exit jobs")
    cron_sub = cron.add_subparsers(dest="cron_command", required=True, metavar="COMMAND")

    def add_cron(name: str, handler: object, help_text: str) -> argparse.ArgumentParser:
        p = cron_sub.add_parser(name, parents=[common], help=help_text, description=help_text)
        p.set_defaults(handler=handler, parser=p)
        return p

    p = add_cron("add", commands.cron_add, "add a job and print its id")
    when = p.add_mutually_exclusive_group(required=True)
    when.add_argument("--on-exit", metavar="CMD", help="run CMD now and fire when it exits")
    when.add_argument("--cron", metavar="EXPR", help="a cron expression")
    when.add_argument("--every", type=_finite_seconds, metavar="SECONDS")
    when.add_argument("--at", metavar="ISO", help="once, at this time (local time unless it has an offset)")
    p.add_argument("--cwd", metavar="DIR", help="the on-exit command's directory (default: here)")
    p.add_argument("--tz", metavar="TZ", help="the cron expression's time zone (default: UTC)")
    p.add_argument("--name", metavar="NAME")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--text", metavar="TEXT", help="deliver TEXT")
    what.add_argument(
        "--command", nargs=argparse.REMAINDER, metavar="CMD", help="run CMD... (the rest of the line)"
    )
    add_cron("list", commands.cron_list, "list the jobs")
    for name, method, verb, help_text in (
        ("rm", "cron.remove", "removed", "remove a job"),
        ("enable", "cron.enable", "enabled", "enable a job"),
        ("disable", "cron.disable", "disabled", "disable a job"),
    ):
        add_cron(name, commands.cron_change(method, verb), help_text).add_argument("job_id", metavar="JOB_ID")

    p = add("events", commands.events, "print fired events")
    p.add_argument("--since", type=_whole(0), default=0, metavar="CURSOR", help="only events after CURSOR")
    p.add_argument("--follow", action="store_true", help="wait for new events until Ctrl-C")
    p = add("tool", commands.tool, "call the subprocess tool: tool JSON --project DIR")
    p.add_argument("params", metavar="JSON")
    p.add_argument("--project", default=".", metavar="DIR")
    p = add("mcp", commands.mcp, "serve the tools over MCP on stdio (embeds an engine if none runs)")
    p.add_argument("--project", default=".", metavar="DIR", help="the tool's project (default: here)")
    p.add_argument(
        "--grace-seconds",
        type=_finite_seconds,
        default=5.0,
        metavar="S",
        help="embedded: SIGINT -> SIGKILL delay",
    )
    p.add_argument("--exit-watch-shell", metavar="ARGV", help="embedded: the argv prefix of on-exit commands")
    return parser


def _normalise(argv: list[str]) -> list[str]:
    """Drop a ``--`` right after ``cron add --command`` (argparse's remainder would keep it)."""
    if "--command" in argv:
        at = argv.index("--command")
        if at + 1 < len(argv) and argv[at + 1] == "--":
            return argv[: at + 1] + argv[at + 2 :]
    return argv


def _one_line(message: str) -> str:
    return " ".join(message.split())


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``gadget-engine`` command line and return its exit code."""
    raw = list(sys.argv[1:] if argv is None else argv)
    parser = _build_parser()
    args = parser.parse_args(_normalise(raw))
    args.state_dir = getattr(args, "state_dir", None)
    args.json = getattr(args, "json", False)
    if args.handler is None:
        args.parser.error("a subcommand is required")
    _check_strings(args)
    try:
        if args.handler in (commands.serve, commands.mcp):
            return int(args.handler(args))
        with EngineClient(args.state_dir) as client:
            return int(args.handler(client, args))
    except EngineNotRunningError as exc:
        print(f"gadget-engine: {_one_line(str(exc))}", file=sys.stderr)
        return EXIT_NO_ENGINE
    except (CommandFailedError, EngineError, OSError) as exc:
        print(f"gadget-engine: {_one_line(str(exc)) or type(exc).__name__}", file=sys.stderr)
        return EXIT_FAILED
    except ValueError as exc:  # a value that cannot travel as JSON (e.g. a non-finite number)
        print(f"gadget-engine: invalid input: {_one_line(str(exc))}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    finally:
        sys.stdout.flush()
