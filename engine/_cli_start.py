"""``gadget-engine start``, ``stop`` and ``status``: the engine as a background service.

``start`` runs ``serve`` in the background, as ``pm2 start`` or ``supervisord`` do: a new session, stdin
from ``/dev/null``, stdout and stderr appended to ``<state_dir>/engine.log``; it returns once a client call
succeeds, or with the server's own error. ``stop`` asks the engine to stop gracefully (RPC
``engine.stop``, as SIGTERM does) and waits until its process is gone, through a pidfd. ``status`` shows
what ``Engine.status()`` reports, as ``systemctl status`` does: exit 3 when no engine runs. Before it
starts one, ``start`` waits for an engine that starts or stops there (:func:`answering_engine`, which
``mcp`` shares), and refuses, naming it, an engine embedded in another program: that one never listens.

Standard library only, like every client command.
"""

from __future__ import annotations

import argparse
import os
import re
import select
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any, Final

from ._cli_output import CommandFailedError, emit_json
from ._lockfile import EMBEDDED, SERVE, SERVING
from ._termtext import escape_controls
from ._trust import open_own_file
from ._when import format_duration
from .server._client import (
    EngineClient,
    EngineNotRunningError,
    EngineSocketMissingError,
    EngineStartingError,
    EngineStoppingError,
    RpcError,
)
from .server._location import lock_state, resolve_state_dir
from .server._protocol import METHOD_NOT_FOUND

__all__ = [
    "LOG_NAME",
    "answering_engine",
    "engine_alive",
    "log_path",
    "redact_url",
    "start",
    "status",
    "stop",
    "wait_process_gone",
]

#: The log of an engine ``start`` ran, in its state directory.
LOG_NAME: Final = "engine.log"
#: A log past this size is moved to ``engine.log.1`` by the next ``start``, in bytes.
LOG_ROTATE_BYTES: Final = 10 * 2**20
#: How often ``start`` tries a client call while the engine starts, in seconds.
_START_POLL_SECONDS: Final = 0.05
#: The longest one ``status`` call of ``start`` may take, in seconds.
_CALL_SECONDS: Final = 5.0


def log_path(state_dir: str) -> str:
    """The log file of an engine started by ``start`` on ``state_dir``."""
    return os.path.join(state_dir, LOG_NAME)


def redact_url(text: str) -> str:
    """``postgresql://user:secret@host/db`` -> ``postgresql://user:***@host/db``; other text unchanged."""
    return re.sub(r"(://[^:/@\s]*:)[^@/\s]*@", r"\1***@", text)


def engine_alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie is not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return False
    return data[data.rfind(b")") + 2 :].split()[0] != b"Z"


def wait_process_gone(pid: int, seconds: float) -> bool:
    """Wait up to ``seconds`` until process ``pid`` has ended (through a pidfd); whether it has."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return bool(poller.poll(max(0.0, seconds) * 1000))
    finally:
        os.close(fd)


def _running(state_dir: str) -> dict[str, Any] | None:
    """The ``status`` of the engine answering on ``state_dir``, or ``None`` when none does; for one that
    is stopping (it refuses connections), ``{"pid": ..., "stopping": True}``; for one that does not listen
    yet (its start-up sweep), ``{"pid": ..., "starting": True}``; for one whose socket file is missing (it
    binds it again), ``{"pid": ..., "starting": True, "rebinding": True}``; for an engine embedded in
    another program (``open_engine``: it never listens), ``{"pid": ..., "embedded": True}``.

    Raises:
        CommandFailedError: a directory is at the socket path of a running engine: it cannot bind its
            socket there, so no wait would end with an answer (the client's one line says what to do).
    """
    try:
        with EngineClient(state_dir, timeout_seconds=_CALL_SECONDS) as client:
            result: dict[str, Any] = client.call("status")
            return result
    except EngineStoppingError as exc:
        return {"pid": exc.pid, "stopping": True}
    except EngineStartingError as exc:
        return {"pid": exc.pid, "starting": True}
    except EngineSocketMissingError as exc:
        if exc.blocked:  # a directory at the socket path: no wait would end with an answer
            raise CommandFailedError(str(exc)) from None
        lock = lock_state(state_dir)
        if lock is not None and lock.holder == exc.pid and lock.own_line and lock.kind == EMBEDDED:
            return {"pid": exc.pid, "embedded": True}
        if lock is not None and lock.holder == exc.pid and lock.phase == SERVING:  # it binds its socket again
            return {"pid": exc.pid, "starting": True, "rebinding": True}
        return None  # none, or a holder that says nothing (a start's serve then says who holds the lock)
    except EngineNotRunningError:
        return None


def _refuse_embedded(state_dir: str, status: dict[str, Any] | None) -> None:
    """Raise when ``status`` (:func:`_running`'s) is an engine embedded in another program.

    Raises:
        CommandFailedError: it is: it holds the state directory and no client reaches it.
    """
    if status is not None and status.get("embedded"):
        raise CommandFailedError(
            f"an engine embedded in another program is already running on {state_dir} (pid "
            f"{status['pid']}); it listens on no socket, so no client reaches it, and no other engine can "
            "run there: stop that program, or use another --state-dir"
        )


def answering_engine(state_dir: str, seconds: float) -> dict[str, Any] | None:
    """The ``status`` of the engine of ``state_dir`` once it answers, or ``None`` when none runs there.

    What ``start`` does before it starts one: an engine that is starting (its start-up sweep) or binds
    its socket again is waited for until it answers (:func:`_wait_answering`); one that is stopping, until
    it has exited (:func:`_wait_stopped`), after which another engine may have taken its place, and is
    waited for in turn. All of it is bounded by ``seconds``. ``gadget-engine mcp`` does the same when the
    state directory is held.

    Raises:
        CommandFailedError: the engine was still starting, or still stopping, after ``seconds``; or an
            engine embedded in another program holds the state directory (it never answers).
    """
    deadline = time.monotonic() + seconds
    status = _running(state_dir)
    # Until one answers or none runs: an engine that stopped may have been followed by another that
    # starts (a second client's), which is waited for in turn, all within ``seconds``.
    while status is not None and (status.get("starting") or status.get("stopping")):
        if status.get("starting"):  # another start's engine, still sweeping
            status = _wait_answering(state_dir, status, seconds, deadline=deadline)
        else:  # as systemd queues a start behind a stop
            _wait_stopped(state_dir, int(status["pid"]), seconds, deadline=deadline)
            status = _running(state_dir)
    _refuse_embedded(state_dir, status)
    return status


# ---- start ---------------------------------------------------------------------------------------------


def _serve_argv(state_dir: str, args: argparse.Namespace) -> list[str]:
    argv = [sys.executable, "-P", "-m", "engine", "--state-dir", state_dir, "serve"]
    argv += ["--grace-seconds", repr(args.grace_seconds)]
    if args.exit_watch_shell:
        argv += ["--exit-watch-shell", args.exit_watch_shell]
    argv += ["--containment", args.containment]
    argv += ["--max-processes-per-project", str(args.max_processes_per_project)]
    argv += ["--max-processes", str(args.max_processes)]
    argv += ["--max-connections", str(args.max_connections), "--idle-seconds", repr(args.idle_seconds)]
    argv += ["--max-request-bytes", str(args.max_request_bytes)]
    if args.repair:
        argv.append("--repair")
    if args.engine_id:
        argv += ["--engine-id", args.engine_id]
    argv += [
        "--owner-lost-seconds",
        repr(args.owner_lost_seconds),
        "--lease-seconds",
        repr(args.lease_seconds),
    ]
    return argv


def _open_log(state_dir: str) -> tuple[int, int]:
    """The engine's log, opened for appending (rotated once past :data:`LOG_ROTATE_BYTES`); fd and size."""
    path = log_path(state_dir)
    fd = open_own_file(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, what="the engine's log")  # no link
    if os.fstat(fd).st_size > LOG_ROTATE_BYTES:
        os.close(fd)
        os.replace(path, path + ".1")  # renames the entry itself, a checked regular file of ours
        fd = open_own_file(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, what="the engine's log")
    return fd, os.fstat(fd).st_size


def _spawn(argv: Sequence[str], log_fd: int, store: str | None = None) -> int:
    """Start ``argv`` in a session of its own, stdin ``/dev/null``, stdout and stderr on ``log_fd``."""
    actions = [
        (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
        (os.POSIX_SPAWN_DUP2, log_fd, 1),
        (os.POSIX_SPAWN_DUP2, log_fd, 2),
    ]
    defaults = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGPIPE)
    environ = dict(os.environ)
    if store:  # through the environment: a password in argv would show in ps
        environ["GADGET_ENGINE_STORE"] = store
    return os.posix_spawn(
        argv[0], list(argv), environ, file_actions=actions, setsid=True, setsigdef=defaults, setsigmask=()
    )


def _error_lines(state_dir: str, offset: int) -> str:
    """What the server wrote to its log since ``offset``: its ``gadget-engine:`` line, else its last line."""
    try:
        with os.fdopen(open_own_file(log_path(state_dir), os.O_RDONLY, what="the engine's log"), "rb") as f:
            f.seek(offset)
            lines = f.read(64 * 1024).decode(errors="replace").splitlines()
    except OSError:
        return ""
    mine = [line for line in lines if line.startswith("gadget-engine: ")]
    last = (
        mine[-1].removeprefix("gadget-engine: ")
        if mine
        else next((line for line in reversed(lines) if line.strip()), "")
    )
    return last.strip()


def _already(state_dir: str, status: dict[str, Any], as_json: bool) -> int:
    if as_json:
        emit_json(
            [{"pid": status["pid"], "state_dir": state_dir, "log": log_path(state_dir), "started": False}]
        )
    else:
        print(
            f"an engine is already running on {state_dir} (pid {status['pid']}); it keeps the options it was "
            "started with (stop it first to change them)"
        )
    return 0


def _wait_stopped(state_dir: str, pid: int, seconds: float, *, deadline: float | None = None) -> None:
    """Wait up to ``seconds`` (or until ``deadline``, on :func:`time.monotonic`, when given) for the engine
    ``pid``, which is stopping, to exit.

    Raises:
        CommandFailedError: it is still stopping after ``seconds``.
    """
    print(
        f"gadget-engine: the engine on {state_dir} (pid {pid}) is stopping; starting once it has exited",
        file=sys.stderr,
    )
    left = seconds if deadline is None else max(deadline - time.monotonic(), 0.0)
    if not wait_process_gone(pid, left):
        raise CommandFailedError(
            f"the engine on {state_dir} (pid {pid}) is still stopping after {seconds:g} s; start again once "
            "it has exited (gadget-engine status tells)"
        )


def _wait_answering(
    state_dir: str, status: dict[str, Any], seconds: float, *, deadline: float | None = None
) -> dict[str, Any] | None:
    """Wait up to ``seconds`` (or until ``deadline``, on :func:`time.monotonic`, when given) for the engine
    of ``status`` (``_running``'s), which is starting (it holds the
    state directory but does not listen yet) or binds its socket again, to answer; its ``status``, or what
    :func:`_running` finds once it no longer starts (stopping, or gone).

    Raises:
        CommandFailedError: it still does not answer after ``seconds``.
    """
    pid = int(status["pid"])
    doing = (
        "binds its socket again (its socket file was removed)"
        if status.get("rebinding")
        else "is starting (after a crash, it first ends what the crashed engine left running)"
    )
    print(
        f"gadget-engine: the engine on {state_dir} (pid {pid}) {doing}; waiting until it answers",
        file=sys.stderr,
    )
    if deadline is None:
        deadline = time.monotonic() + seconds
    while True:
        status_now = _running(state_dir)
        if status_now is None or status_now["pid"] != pid or not status_now.get("starting"):
            return status_now
        if time.monotonic() > deadline:
            raise CommandFailedError(
                f"the engine on {state_dir} (pid {pid}) is still starting and does not answer after "
                f"{seconds:g} s; see its log: {log_path(state_dir)} (an engine embedded in another program "
                "never answers here)"
            )
        time.sleep(_START_POLL_SECONDS)


def start(args: argparse.Namespace) -> int:
    """``gadget-engine start``: ``serve`` in the background; 0 once a client call succeeds.

    Raises:
        CommandFailedError: the server exited (its own error and its log's path), or did not answer
            within ``--wait-seconds``; an engine embedded in another program holds the state directory.
    """
    state_dir = resolve_state_dir(args.state_dir)
    status = answering_engine(state_dir, args.wait_seconds)
    if status is not None:
        return _already(state_dir, status, args.json)
    os.makedirs(state_dir, mode=0o700, exist_ok=True)
    log_fd, offset = _open_log(state_dir)
    try:
        pid = _spawn(_serve_argv(state_dir, args), log_fd, args.store)
    finally:
        os.close(log_fd)
    deadline = time.monotonic() + args.wait_seconds
    while True:
        status = _running(state_dir)
        # Ours, and answering: while it ends what a crashed engine left (the start-up sweep, up to grace
        # + kill-wait) it holds the lock but does not listen yet ("starting").
        if (
            status is not None
            and status["pid"] == pid
            and not status.get("starting")
            and not status.get("stopping")
        ):
            break
        ended, wait_status = os.waitpid(pid, os.WNOHANG)
        if ended:
            if status is None:
                status = _running(state_dir)
            if status is not None and status.get("starting"):
                status = _wait_answering(state_dir, status, args.wait_seconds)
            if status is not None and status.get("stopping"):  # another start's engine, stopped meanwhile
                _wait_stopped(state_dir, int(status["pid"]), args.wait_seconds)
                return start(args)
            _refuse_embedded(state_dir, status)  # a program that took the lock meanwhile
            if status is not None:
                return _already(state_dir, status, args.json)  # another start won the race
            if os.WIFSIGNALED(wait_status):
                raise CommandFailedError(
                    f"the engine (pid {pid}) was killed by {signal.Signals(os.WTERMSIG(wait_status)).name} "
                    f"before it answered; its log: {log_path(state_dir)}"
                )
            if os.waitstatus_to_exitcode(wait_status) == 0:  # serve exits 0 only when asked to stop
                raise CommandFailedError(
                    f"the engine (pid {pid}) was stopped before it answered (a stop or a signal during its "
                    f"start-up sweep); its log: {log_path(state_dir)}"
                )
            why = _error_lines(state_dir, offset) or "it exited at once"
            why = why.removeprefix("the engine could not start: ")  # serve's own words, said once
            raise CommandFailedError(f"the engine did not start: {why} (its log: {log_path(state_dir)})")
        if time.monotonic() > deadline:
            raise CommandFailedError(
                f"the engine (pid {pid}) did not answer within {args.wait_seconds:g} s; it is left running "
                f"(gadget-engine status shows when it answers, stop ends it); its log: {log_path(state_dir)}"
            )
        time.sleep(_START_POLL_SECONDS)
    if args.json:
        emit_json([{"pid": pid, "state_dir": state_dir, "log": log_path(state_dir), "started": True}])
    else:
        print(f"started the engine on {state_dir} (pid {pid}); its log: {log_path(state_dir)}")
    return 0


# ---- stop ----------------------------------------------------------------------------------------------


def _already_stopping(pid: int, end_watched: bool) -> None:
    """Say, for ``stop --end-watched``, that the stop under way is not this call's to change."""
    if end_watched:
        print(
            f"gadget-engine: the engine (pid {pid}) was already stopping; --end-watched is that stop's to "
            "apply (without it, watched on-exit commands are left running for the next engine)",
            file=sys.stderr,
        )


def _ask_to_stop(client: EngineClient, pid: int, end_watched: bool) -> None:
    """The ``engine.stop`` call, or SIGTERM to an engine of an older version that has no such method. An
    engine already stopping is waited for as if this call had stopped it (two ``stop`` at once: each
    returns 0 once it has exited)."""
    try:
        client.call("engine.stop", end_watched=end_watched)
    except EngineStoppingError:  # another stop is under way: the caller waits for the exit as for its own
        _already_stopping(pid, end_watched)
    except RpcError as exc:
        if exc.code != METHOD_NOT_FOUND:
            raise
        if end_watched:
            raise CommandFailedError(
                f"the engine (pid {pid}) is of an older version that cannot end watched commands; "
                "stop it without --end-watched"
            ) from None
        os.kill(pid, signal.SIGTERM)  # an older engine: the signal stops it the same way


def _stop_starting(state_dir: str, pid: int) -> bool:
    """Send SIGTERM to the engine ``pid``, which is starting (its start-up sweep): it closes once the sweep
    is over, without listening (``serve``'s stop before it listens). Sent through a pidfd taken before
    the lock file is read: only while ``pid`` holds the lock and wrote its own line there as a ``serve``,
    so neither another holder of the lock nor a process that got a reused pid is signalled; whether it
    was sent."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return False
    try:
        lock = lock_state(state_dir)
        # Taken while the pidfd is held: the process holds the lock and wrote its own line as a serve (a
        # process that merely holds the lock, or an engine embedded in another program, is left alone).
        if lock is None or lock.holder != pid or not lock.own_line or lock.kind != SERVE:
            return False
        signal.pidfd_send_signal(fd, signal.SIGTERM)
    except OSError:
        return False
    finally:
        os.close(fd)
    print(
        f"gadget-engine: the engine on {state_dir} (pid {pid}) is starting (it first ends what a crashed "
        "engine left running); asked it to stop: it closes once that is over, without answering",
        file=sys.stderr,
    )
    return True


def stop(client: EngineClient, args: argparse.Namespace) -> int:
    """``gadget-engine stop``: a graceful stop, waited for; 1 when it takes longer than ``--wait-seconds``.

    Raises:
        EngineNotRunningError: no engine runs (exit 3).
        CommandFailedError: the engine was still stopping at the bound, or cannot end watched commands.
    """
    try:
        pid = int(client.call("status")["pid"])
    except EngineStoppingError as exc:  # a stop already under way: wait for it as for ours
        pid = exc.pid
        _already_stopping(pid, args.end_watched)
    except EngineStartingError as exc:
        pid = exc.pid
        if args.end_watched or not _stop_starting(client.state_dir, pid):
            # --end-watched is a request of the method (or the engine went on meanwhile): once it answers
            answering = _wait_answering(client.state_dir, {"pid": pid, "starting": True}, args.wait_seconds)
            if answering is not None and answering.get("stopping"):
                pid = int(answering["pid"])
                _already_stopping(pid, args.end_watched)
            elif answering is not None:
                pid = int(answering["pid"])
                _ask_to_stop(client, pid, args.end_watched)
    else:
        _ask_to_stop(client, pid, args.end_watched)
    client.close()
    if not wait_process_gone(pid, args.wait_seconds):
        raise CommandFailedError(
            f"the engine (pid {pid}) is still stopping after {args.wait_seconds:g} s; "
            f"see its log: {log_path(client.state_dir)}"
        )
    if args.json:
        emit_json([{"pid": pid, "stopped": True}])
    else:
        print(f"stopped the engine on {client.state_dir} (pid {pid})")
    return 0


# ---- status --------------------------------------------------------------------------------------------


def _describe_event(event: dict[str, Any] | None) -> str:
    if event is None:
        return "none yet"
    if event.get("exit_code") is not None:
        outcome = f"exit code {event['exit_code']}"
    elif event.get("signal") is not None:
        outcome = f"signal {event['signal']}"
    else:
        outcome = str(event.get("reason") or "fired")
    return f"{event['cursor']}: {event['job_name']} (job {event['job_id']}), {outcome}"


def status(client: EngineClient, args: argparse.Namespace) -> int:
    """``gadget-engine status``: what the engine is and does; one JSON object with ``--json``."""
    result: dict[str, Any] = client.call("status")
    result["store"] = redact_url(str(result.get("store", "")))
    if args.json:
        emit_json([result])
        return 0
    runs: dict[str, int] = result.get("runs", {})
    run_lines = [f"{count} in {directory}" for directory, count in sorted(runs.items())] or ["none"]
    watched = result.get("watched", 0)
    rows = [
        (
            "engine",
            f"{'stopping' if result.get('stopping') else 'running'}, pid {result['pid']}, "
            f"version {result['version']}",
        ),
        ("uptime", format_duration(int(result.get("uptime_seconds", 0)))),
        ("state dir", result["state_dir"]),
        ("socket", result.get("socket", "-")),
        ("store", result["store"]),
        ("containment", f"{result['containment']} ({result.get('containment_detail') or '-'})"),
        ("runs", run_lines[0]),
        *(("", line) for line in run_lines[1:]),
        ("jobs", f"{result['jobs']} enabled, {watched} on-exit command(s) watched"),
        ("last event", _describe_event(result.get("last_event"))),
    ]
    for key, value in rows:
        print(f"{key:<12} {escape_controls(str(value))}".rstrip())
    return 0
