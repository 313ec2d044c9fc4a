"""The ``gadget-engine`` command line, end to end against a real ``gadget-engine serve``."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from engine import EngineConfig
from engine._cli import EVERY_BOUNDS
from engine._cli_output import user_message
from engine._when import show_moment
from engine.cron._schedule import MAX_EVERY_SECONDS, MIN_EVERY_SECONDS
from engine.server._client import RpcError
from engine.server._location import default_state_dir
from engine.server._protocol import INVALID_PARAMS, METHOD_NOT_FOUND

from .children import SESSION, mark, pgrep
from .serve_support import Served, alive, cli, env_without_state_dir, start_serve, wait_until


def _json_lines(text: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in text.splitlines()]


def _create(served: Served, project: Path, *argv: str, env: tuple[str, ...] = ()) -> int:
    options = [item for pair in (("-e", e) for e in env) for item in pair]
    out = served.cli("create", "--project", str(project), *options, "--", *argv)
    assert out.returncode == 0, out.stderr
    return int(out.stdout)


def test_cli_without_engine_exits_3_with_one_line(tmp_path: Path) -> None:
    out = cli("--state-dir", str(tmp_path / "none"), "list")
    assert out.returncode == 3
    assert out.stdout == ""
    assert out.stderr.count("\n") == 1
    assert "no engine is running on" in out.stderr


def test_cli_usage_errors_exit_2(tmp_path: Path) -> None:
    state = ("--state-dir", str(tmp_path))
    commands = [
        ("frobnicate",),
        ("create", *state, "--", "true"),  # no --project
        ("create", *state, "--project", ".", "-e", "NOEQUALS", "--", "true"),
        ("cron", "add", *state, "--every", "5"),  # no payload
        # Bounds the engine holds, said by the CLI before it asks (found by a new user):
        ("start", *state, "--grace-seconds", "1e9"),  # a grace nothing outlives
        ("cron", "add", *state, "--at", "+99999999999d", "--text", "x"),  # a traceback before
        ("cron", "add", *state, "--every", "1h1h", "--text", "x"),
        (
            "cron",
            "add",
            *state,
            "--at",
            "2030-03-31T02:30",
            "--tz",
            "Europe/Paris",
            "--text",
            "x",
        ),  # no such time
        ("create", *state, "--project", ".", "--ready-timeout", "301", "--", "true"),
        ("wait", *state, "1", "--timeout", "1e9"),
        ("status", "--state-dir", ""),  # not the default state dir, quietly
        ("log", *state, "99999999999999999999999"),
    ]
    procs = [subprocess.Popen([sys.executable, "-m", "engine", *c], stderr=subprocess.PIPE) for c in commands]
    for proc in procs:
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 2, err
        assert b"Traceback" not in err


def test_cli_a_stray_option_is_named_before_a_missing_subcommand(tmp_path: Path) -> None:
    """``gadget-engine --bogus`` and ``cron --bogus`` name the option they did not know, with the usage
    line of the command they were given to; a missing subcommand is still said when nothing is stray."""
    state = ("--state-dir", str(tmp_path))
    cases = {
        ("--bogus",): ("usage: gadget-engine [", "gadget-engine: error: unrecognized arguments: --bogus"),
        ("cron", *state, "--bogus"): (
            "usage: gadget-engine cron [",
            "gadget-engine cron: error: unrecognized arguments: --bogus",
        ),
        (*state,): ("usage: gadget-engine [", "error: the following arguments are required: COMMAND"),
        ("cron", *state): (
            "usage: gadget-engine cron [",
            "error: the following arguments are required: COMMAND",
        ),
    }
    procs = {
        argv: subprocess.Popen(
            [sys.executable, "-m", "engine", *argv], stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        for argv in cases
    }
    for argv, proc in procs.items():
        out, err = proc.communicate(timeout=30)
        usage, error = cases[argv]
        assert proc.returncode == 2 and out == "", (argv, err)
        assert err.startswith(usage) and err.rstrip("\n").endswith(error), (argv, err)


def test_cli_says_how_to_give_a_value_that_starts_with_a_dash_and_checks_the_exit_watch_shell(
    tmp_path: Path,
) -> None:
    """argparse reads ``--text -x`` as a missing value: the error says ``--text=VALUE`` (and for ``input``,
    ``--``); ``--exit-watch-shell`` is split and its program looked up before an engine starts."""
    state = ("--state-dir", str(tmp_path / "state"))
    cases = {
        ("cron", "add", *state, "--every", "5", "--text", "-x"): "argument --text: expected one argument; "
        "a value that starts with - is written --text=VALUE",
        ("cron", "add", *state, "--on-exit", "-x", "--text", "t"): "a value that starts with - is written "
        "--on-exit=VALUE",
        (
            "input",
            *state,
            "5",
            "-abc",
        ): "required: TEXT; text that starts with - goes after --: input PID -- TEXT",
        ("create", *state, "--bogus", "--project", ".", "--", "true"): "unrecognized arguments: --bogus",
        ("serve", *state, "--exit-watch-shell", ""): "argument --exit-watch-shell: an empty argv",
        (
            "serve",
            *state,
            "--exit-watch-shell",
            '"bash -c',
        ): "argument --exit-watch-shell: no closing quotation",
        ("start", *state, "--exit-watch-shell", "/nonexistent/sh -c"): "argument --exit-watch-shell: "
        "'/nonexistent/sh' is not an installed program (looked in PATH)",
        ("cron", "add", *state, "--every", "0", "--text", "t"): "argument --every: expected from 1 s to ten "
        "years (3652d), got '0'",  # not the library's field name, every_seconds
        # An empty --project is not taken for here (abspath("") is the current directory).
        (
            "create",
            *state,
            "--project",
            "",
            "--",
            "true",
        ): "argument --project: expected a project directory, got an empty string (use . for here)",
        ("list", *state, "--project", " "): "argument --project: expected a project directory, got an empty",
    }
    procs = {
        argv: subprocess.Popen([sys.executable, "-m", "engine", *argv], stderr=subprocess.PIPE, text=True)
        for argv in cases
    }
    for argv, proc in procs.items():
        _, err = proc.communicate(timeout=30)
        last = err.rstrip("\n").splitlines()[-1]
        assert proc.returncode == 2 and cases[argv] in last, (argv, err)
        assert "put --" not in err  # the -- was there already, or no command was given
    assert not (tmp_path / "state").exists()  # nothing started
    assert EVERY_BOUNDS == (MIN_EVERY_SECONDS, MAX_EVERY_SECONDS)  # the CLI's bounds are Every's


def test_cli_out_of_range_port_and_seconds_are_said_in_one_wording(tmp_path: Path) -> None:
    state = ("--state-dir", str(tmp_path))
    for port in ("0", "99999", "x"):
        out = cli("create", *state, "--project", ".", "--ready-port", port, "--", "true")
        assert out.returncode == 2
        assert out.stderr.splitlines()[-1].endswith(f"expected a TCP port from 1 to 65535, got '{port}'")
    for seconds in ("0", "-1", "nan", "inf", "1e9"):  # one wording for a bounded duration too
        out = cli(
            "create", *state, "--project", ".", "--ready-log", "x", f"--ready-timeout={seconds}", "--", "true"
        )
        assert out.returncode == 2
        assert out.stderr.splitlines()[-1].endswith(f"expected more than 0 to 300 seconds, got '{seconds}'")


def test_cli_bad_patterns_are_said_with_the_option_before_asking_the_engine(tmp_path: Path) -> None:
    state = ("--state-dir", str(tmp_path))  # no engine runs there: refused before any connection
    ready = cli("create", *state, "--project", ".", "--ready-log", "(", "--", "true")
    grep = cli("log", *state, "1", "--grep", "[")
    assert (ready.returncode, grep.returncode) == (2, 2)
    assert "argument --ready-log: the pattern '(' is not a valid regular expression" in ready.stderr
    assert "argument --grep: the pattern '[' is not a valid regular expression" in grep.stderr
    assert "log_pattern" not in ready.stderr


def test_cli_state_dir_before_after_and_from_the_environment(served: Served) -> None:
    env = {**env_without_state_dir(), "GADGET_ENGINE_STATE_DIR": str(served.state_dir)}
    before = subprocess.Popen([sys.executable, "-m", "engine", "--state-dir", str(served.state_dir), "list"])
    from_env = subprocess.Popen([sys.executable, "-m", "engine", "list"], env=env)
    assert served.cli("list").returncode == 0  # --state-dir after the subcommand
    assert before.wait(timeout=30) == 0 and from_env.wait(timeout=30) == 0


def test_cli_default_state_dir_is_the_configs() -> None:
    assert default_state_dir() == EngineConfig().resolved_state_dir()


def test_cli_create_passes_env_and_lists_logs_halts_kills(served: Served, project: Path) -> None:
    code = "import os,time; print('FOO=' + os.environ['FOO'], flush=True); time.sleep(60)"
    pid = _create(served, project, sys.executable, "-c", code, env=("FOO=bar baz", "EMPTY="))
    with served.client() as client:
        assert wait_until(lambda: client.call("subprocess.read_log", pid=pid)["text"] == "FOO=bar baz\n")

    table, listed, tail, stderr = served.cli_parallel(
        ("list",),
        ("list", "--json"),
        ("log", str(pid), "--tail", "1", "--stream", "stdout"),
        ("log", str(pid), "--stream", "stderr"),
    )
    assert table.returncode == 0
    assert table.stdout.splitlines()[0].split() == ["PID", "PROJECT", "STATUS", "CREATED", "COMMAND"]
    assert any(line.startswith(f"{pid} ") and "running" in line for line in table.stdout.splitlines())
    records = {r["pid"]: r for r in _json_lines(listed.stdout)}
    assert records[pid]["state"] == "running" and records[pid]["project_slug"] == "app"
    assert tail.stdout == "FOO=bar baz\n"
    assert (stderr.returncode, stderr.stdout) == (0, "")

    halted = served.cli("halt", str(pid))
    assert (halted.returncode, halted.stdout) == (0, f"halted {pid}\n")
    again = served.cli("halt", str(pid))
    assert again.stdout == f"{pid} had already stopped; its logs are kept\n"
    assert served.cli("log", str(pid)).stdout == "FOO=bar baz\n"  # a halted process keeps its logs
    killed = served.cli("kill", str(pid), "--json")
    assert _json_lines(killed.stdout) == [{"pid": pid, "stopped": False}]
    gone = served.cli("kill", str(pid))
    assert gone.returncode == 1
    assert gone.stderr.count("\n") == 1 and f"no managed subprocess has pid {pid}" in gone.stderr


def test_cli_kill_all_ends_every_process(served: Served, project: Path) -> None:
    pids = [_create(served, project, "sleep", "60") for _ in range(2)]
    out = served.cli("kill-all")
    assert (out.returncode, out.stdout) == (0, "killed every subprocess\n")
    assert not any(alive(pid) for pid in pids)
    assert served.cli("list", "--json").stdout == ""


def test_cli_create_reports_spawn_errors_on_one_line(served: Served, project: Path) -> None:
    out = served.cli("create", "--project", str(project), "--", "no-such-program-xyz")
    assert out.returncode == 1
    assert out.stderr.count("\n") == 1 and "no-such-program-xyz" in out.stderr


def test_cli_log_follow_prints_everything_until_exit(served: Served, project: Path) -> None:
    code = "import time\nfor i in range(6):\n    print('line', i, flush=True); time.sleep(0.15)"
    pid = _create(served, project, sys.executable, "-c", code)
    out = served.cli("log", str(pid), "--follow", timeout=20)
    assert out.returncode == 0
    assert out.stdout == "".join(f"line {i}\n" for i in range(6))
    served.cli("kill", str(pid))


def test_cli_create_ready_prints_the_pid_first_and_a_ctrl_c_in_the_wait_says_it_runs_on(
    served: Served, project: Path
) -> None:
    # Found by a new user: a Ctrl-C while `create --ready-log` waited left the process running and
    # printed nothing, so its pid was unknown. The pid comes first now, then the wait.
    up, never = mark("8801.5"), mark("8801.6")
    shown = served.cli(
        "create",
        "--project",
        str(project),
        "--ready-log",
        "^listening$",
        "--",
        "sh",
        "-c",
        f"echo starting; sleep 0.3; echo listening; exec sleep {up}",
    )
    assert shown.returncode == 0, shown.stderr
    pid = int(shown.stdout)
    assert shown.stderr == "ready: ready\n"
    waiting = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "engine",
            "create",
            "--state-dir",
            str(served.state_dir),
            "--project",
            str(project),
            "--ready-log",
            "never",
            "--",
            "sleep",
            never,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert waiting.stdout is not None
    other = int(waiting.stdout.readline())  # printed before the wait
    waiting.send_signal(signal.SIGINT)
    out, err = waiting.communicate(timeout=10)
    assert (waiting.returncode, out) == (130, "")
    assert err == (
        f"gadget-engine: interrupted while waiting for {other} to be ready; it goes on running "
        f"(gadget-engine kill {other} ends it)\n"
    )
    listed = {run["pid"]: run for run in _json_lines(served.cli("list", "--json").stdout)}
    assert listed[other]["status"] == "running" and listed[pid]["status"] == "running"
    died, slow = served.cli_parallel(
        (
            "create",
            "--project",
            str(project),
            "--ready-log",
            "READY",
            "--",
            "sh",
            "-c",
            "echo oops >&2; exit 7",
        ),
        (
            "create",
            "--project",
            str(project),
            "--ready-log",
            "READY",
            "--ready-timeout",
            "0.3",
            "--",
            "sleep",
            up,
        ),
    )
    assert (died.returncode, died.stderr) == (1, "ready: exited (exited 7)\n") and int(died.stdout) > 0
    assert (slow.returncode, slow.stderr) == (1, "ready: timeout (still running)\n") and int(slow.stdout) > 0
    served.cli_parallel(("kill", died.stdout.strip()), ("kill", slow.stdout.strip()))
    with served.client() as client:
        summary = client.call("subprocess.wait_ready", pid=pid, ready={"log": "^listening$"})
        assert (summary["ready"], summary["first_output"]) == ("ready", "starting\nlistening\n")
    assert served.cli_parallel(("kill", str(pid)), ("kill", str(other)))[1].returncode == 0


def test_cli_cron_add_every_kind_then_list_disable_enable_rm(served: Served, tmp_path: Path) -> None:
    at = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    added = served.cli_parallel(
        ("cron", "add", "--every", "3600", "--text", "hourly", "--name", "every-job"),
        ("cron", "add", "--cron", "0 9 * * 1", "--tz", "Europe/Paris", "--text", "weekly"),
        ("cron", "add", "--at", at, "--command", "--", sys.executable, "-c", "print(1)"),
        ("cron", "add", "--on-exit", "sleep 30", "--cwd", str(tmp_path), "--text", "done"),
    )
    ids = {}
    for kind, out in zip(("every", "cron", "at", "on_exit"), added, strict=True):
        assert out.returncode == 0, out.stderr
        ids[kind] = out.stdout.strip()
        assert len(ids[kind]) == 12
    listed, table = served.cli_parallel(("cron", "list", "--json"), ("cron", "list"))
    jobs = {job["id"]: job for job in _json_lines(listed.stdout)}
    for kind, job_id in ids.items():
        assert jobs[job_id]["schedule"]["kind"] == kind  # type: ignore[index]
    assert jobs[ids["every"]]["name"] == "every-job"
    argv = [sys.executable, "-c", "print(1)"]
    assert jobs[ids["at"]]["payload"] == {"kind": "command", "argv": argv, "cwd": os.getcwd()}
    assert jobs[ids["on_exit"]]["schedule"] == {
        "kind": "on_exit",
        "command": "sleep 30",
        "cwd": str(tmp_path),
    }
    assert "every 3600 s" in table.stdout and "cron '0 9 * * 1' Europe/Paris" in table.stdout

    with served.client() as client:
        assert served.cli("cron", "disable", ids["every"]).stdout == f"disabled {ids['every']}\n"
        assert client.call("cron.get", job_id=ids["every"])["enabled"] is False
        assert served.cli("cron", "enable", ids["every"]).stdout == f"enabled {ids['every']}\n"
        assert client.call("cron.get", job_id=ids["every"])["enabled"] is True
        # an on-exit job enabled again runs its command again: `enable` says so (found by a new user)
        assert served.cli("cron", "disable", ids["on_exit"]).returncode == 0
        enabled = served.cli("cron", "enable", ids["on_exit"]).stdout
        assert enabled == (
            f"enabled {ids['on_exit']}\nits command starts now; the job fires once when it exits "
            "(cron get shows a start that fails)\n"
        )
        removed = served.cli_parallel(*(("cron", "rm", job_id) for job_id in ids.values()))
        assert [out.returncode for out in removed] == [0, 0, 0, 0]
        remaining = {job["id"] for job in client.call("cron.list")}
    assert not remaining & set(ids.values())
    missing = served.cli("cron", "rm", ids["every"])
    assert missing.returncode == 1 and missing.stderr.count("\n") == 1


def test_cli_cron_enable_of_an_armed_on_exit_job_starts_nothing_and_says_so(
    served: Served, tmp_path: Path
) -> None:
    """A tester's finding: ``enable`` on an on-exit job whose command runs said "its command starts now"."""
    marker = mark("8830.1")
    added = served.cli("cron", "add", "--on-exit", f"sleep {marker}", "--cwd", str(tmp_path), "--text", "x")
    job_id = added.stdout.strip()
    assert wait_until(lambda: len(pgrep(rf"^sleep {marker}$")) == 1)
    running = pgrep(rf"^sleep {marker}$")
    enabled = served.cli("cron", "enable", job_id)
    assert enabled.stdout == (
        f"enabled {job_id}\nalready enabled: nothing new starts (its command started when the job was "
        "armed); the job fires once when that command exits (cron get shows a start that fails)\n"
    ), enabled.stderr
    assert pgrep(rf"^sleep {marker}$") == running  # one run, one fire
    assert served.cli("cron", "rm", job_id).returncode == 0
    assert wait_until(lambda: not pgrep(rf"^sleep {marker}$"))


def test_cli_cron_run_at_once_each_prints_the_event_of_its_own_run(tmp_path: Path) -> None:
    """A tester's finding: of two ``cron run`` of one job at once, the second printed both events. (An
    engine of its own: the module's keeps no events for ``test_cli_events_since_json_and_follow``.)"""
    engine = start_serve(tmp_path / "state")
    try:
        added = engine.cli("cron", "add", "--every", "1h", "--command", "bash", "-c", "echo run-$$; sleep 1")
        job_id = added.stdout.strip()
        argv = [sys.executable, "-m", "engine", "cron", "run", job_id, "--state-dir", str(engine.state_dir)]
        first = subprocess.Popen([*argv, "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(0.3)  # the first run is under way: the second waits for it, then runs its own
        second = engine.cli("cron", "run", job_id, "--json")
        out, err = first.communicate(timeout=30)
        assert first.returncode == 0 and second.returncode == 0, (err, second.stderr)
        events = [_json_lines(out), _json_lines(second.stdout)]
        assert [len(printed) for printed in events] == [1, 1], events
        assert events[0][0]["fire_id"] != events[1][0]["fire_id"]
        assert events[0][0]["stdout_tail"] != events[1][0]["stdout_tail"]  # two runs, each its own pid
    finally:
        assert engine.stop() == 0


def test_cli_cron_add_rejects_bad_schedules_on_one_line(served: Served) -> None:
    out, past = served.cli_parallel(
        ("cron", "add", "--cron", "not a cron", "--text", "x"),
        ("cron", "add", "--at", "2001-01-01T00:00:00+00:00", "--text", "x"),
    )
    # 2: a value the engine refuses is a usage error, as one the CLI refuses itself (README's exit codes)
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert past.returncode == 2 and "in the past" in past.stderr


def test_cli_events_since_json_and_follow(served: Served) -> None:
    added = served.cli("cron", "add", "--every", "1", "--text", "tick")  # 1 s: the shortest interval
    assert added.returncode == 0, added.stderr  # (else the follower below would wait for ever)
    job = added.stdout.strip()
    follower = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "engine",
            "events",
            "--follow",
            "--json",
            "--state-dir",
            str(served.state_dir),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert follower.stdout is not None
    followed = [json.loads(follower.stdout.readline()) for _ in range(2)]
    follower.send_signal(signal.SIGINT)
    assert follower.wait(timeout=10) == 0
    follower.stdout.close()
    served.cli("cron", "rm", job)
    everything, readable = served.cli_parallel(("events", "--since", "0", "--json"), ("events",))
    events = _json_lines(everything.stdout)
    cursors = [e["cursor"] for e in events]
    assert cursors == sorted(set(cursors))  # type: ignore[type-var]
    mine = [e for e in events if e["job_id"] == job]
    assert len(mine) >= 2 and all(e["text"] == "tick" for e in mine)
    later = _json_lines(served.cli("events", "--since", str(cursors[0]), "--json").stdout)
    assert [e["cursor"] for e in later] == cursors[1:]
    assert f"(job {job})" in readable.stdout and "tick" in readable.stdout
    assert [e["fire_id"] for e in followed] == [e["fire_id"] for e in events[: len(followed)]]


def test_cli_tool_json_runs_the_tool(served: Served, project: Path) -> None:
    out = served.cli(
        "tool", json.dumps({"cmd": "create", "command": "sleep", "args": ["60"]}), "--project", str(project)
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("SUBPROCESS CREATED\npid: ")
    pid = int(out.stdout.splitlines()[1].split()[1])
    listed, bad, usage = served.cli_parallel(
        ("tool", '{"cmd": "list"}', "--project", str(project)),
        ("tool", '{"cmd": "nope"}', "--project", str(project)),
        ("tool", "[1, 2]", "--project", str(project)),
    )
    assert f"pid: {pid} | project: app" in listed.stdout
    assert bad.returncode == 1 and bad.stderr.startswith("gadget-engine: SUBPROCESS ERROR: ")
    assert usage.returncode == 2
    assert (
        served.cli("tool", json.dumps({"cmd": "kill", "pid": pid}), "--project", str(project)).returncode == 0
    )


def test_cli_mcp_is_registered(tmp_path: Path) -> None:
    assert "--project" in cli("mcp", "--help").stdout
    # stdin at end-of-file: the MCP server starts, sees its client gone, stops; stdout stays the protocol's.
    out = subprocess.run(
        [sys.executable, "-m", "engine", "--state-dir", str(tmp_path), "mcp"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert (out.returncode, out.stdout) == (0, ""), out.stderr
    assert "event=stopped" in out.stderr  # the engine's log goes to stderr


def test_cli_second_serve_is_refused_with_the_pid(served: Served) -> None:
    out = cli("--state-dir", str(served.state_dir), "serve", "--grace-seconds", "0.5", timeout=20)
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert (
        last == f"gadget-engine: an engine is already running on {served.state_dir} (pid {served.proc.pid})"
    )
    assert served.cli("list").returncode == 0  # the first one is untouched


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_cli_serve_stops_on_signal_leaving_no_child(tmp_path: Path, project: Path, signum: int) -> None:
    engine = start_serve(tmp_path / "state")
    ignoring = (
        "import signal,time; signal.signal(signal.SIGINT, signal.SIG_IGN); print('up', flush=True); "
        + ("time.sleep(60)")
    )
    with engine.client() as client:
        pids = [
            client.call("subprocess.create", project=str(project), command=argv[0], args=list(argv[1:]))[
                "pid"
            ]
            for argv in (
                ("sleep", "60"),
                (sys.executable, "-c", ignoring),
                ("bash", "-c", "sleep 60 & sleep 60 & wait"),
            )
        ]
        assert wait_until(lambda: client.call("subprocess.read_log", pid=pids[1])["text"] == "up\n")
    tree = [int(p) for p in Path(f"/proc/{pids[2]}/task/{pids[2]}/children").read_text().split()]
    assert engine.stop(signum) == 0
    assert not [pid for pid in [*pids, *tree] if alive(pid)]
    log = engine.log()
    assert f"event=stopping signal={signal.Signals(signum).name}" in log and "event=stopped" in log
    assert "event=escalated" in log  # the one ignoring SIGINT needed SIGKILL
    assert not os.path.exists(engine.state_dir / "engine.sock")
    assert cli("--state-dir", str(engine.state_dir), "list").returncode == 3


@pytest.mark.parametrize(
    "args",
    [
        ("tool", '{"cmd": "kill", "pid": 1e400}', "--project", "."),
        ("tool", '{"cmd": "kill", "pid": NaN}', "--project", "."),
        ("cron", "add", "--every", "nan", "--text", "x"),
        ("cron", "add", "--every", "inf", "--text", "x"),
    ],
)
def test_cli_non_finite_numbers_are_usage_errors(served: Served, args: tuple[str, ...]) -> None:
    result = served.cli(*args)
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("gadget-engine")


def test_cli_nb08_refuses_arguments_it_could_not_send_and_list_answers(served: Served, project: Path) -> None:
    marker = f"nb08-cli-{SESSION}"
    name = os.fsdecode(b"caf\xe9-" + marker.encode() + b".txt")  # the bytes reach the CLI as they are
    created, tool, env, since = served.cli_parallel(
        ("create", "--project", str(project), "--", "tail", "-f", name),
        ("tool", json.dumps({"cmd": "create", "command": "tail", "args": ["-f", name]}), "--project", "."),
        ("create", "--project", str(project), "-e", f"A={name}", "--", "true"),
        ("events", "--since", "-1"),
    )
    for out in (created, tool, env, since):
        assert out.returncode == 2, out
        assert "Traceback" not in out.stderr
    assert "argv[2] holds the lone surrogate U+DCE9" in created.stderr
    assert "JSON.args[1] holds the lone surrogate" in tool.stderr
    assert not pgrep(marker)
    listed = served.cli("list", "--json")
    assert listed.returncode == 0 and marker not in listed.stdout


# ---- for people at a terminal (issue 21) -----------------------------------------------------------


def test_cli_log_both_streams_tail_and_follow(served: Served, project: Path) -> None:
    code = (
        "import sys,time\n"
        "for i in range(4):\n"
        "    print('out', i, flush=True); print('err', i, file=sys.stderr, flush=True); time.sleep(0.1)"
    )
    pid = _create(served, project, sys.executable, "-c", code)
    followed = served.cli("log", str(pid), "-f", "--stream", "both", timeout=20)
    assert followed.returncode == 0, followed.stderr
    lines = followed.stdout.splitlines()
    assert [line for line in lines if line.startswith("stdout | ")] == [f"stdout | out {i}" for i in range(4)]
    assert [line for line in lines if line.startswith("stderr | ")] == [f"stderr | err {i}" for i in range(4)]
    assert len(lines) == 8
    history, tail = served.cli_parallel(("log", str(pid), "--stream", "both"), ("log", str(pid), "-n", "2"))
    assert history.stdout.splitlines() == [
        *(f"stdout | out {i}" for i in range(4)),
        *(f"stderr | err {i}" for i in range(4)),
    ]
    assert tail.stdout == "out 2\nout 3\n"
    served.cli("kill", str(pid))


def test_cli_log_both_streams_prints_the_log_left_when_the_other_was_removed(
    served: Served, project: Path
) -> None:
    """Noted by a fresh tester: ``--stream both`` stopped at a gone stdout log, stderr unprinted."""
    code = (
        "import sys,time\nprint('out', flush=True); print('err', file=sys.stderr, flush=True); time.sleep(30)"
    )
    pid = _create(served, project, sys.executable, "-c", code)
    stdout_log = project / ".gadget" / "subprocess-logs" / f"subproc-{pid}.stdout.log"
    assert wait_until(lambda: stdout_log.exists() and stdout_log.stat().st_size > 0)
    stdout_log.unlink()  # behind the engine's back
    both = served.cli("log", str(pid), "--stream", "both")
    assert both.returncode == 1, both
    assert both.stdout.splitlines() == ["stderr | err"]
    assert "stdout" in both.stderr and "Traceback" not in both.stderr
    served.cli("kill", str(pid))


def test_cli_log_tail_zero_prints_nothing_and_follows_what_comes_next(served: Served, project: Path) -> None:
    go = project / "go"
    code = (
        "import os,sys,time\n"
        "print('old', flush=True)\n"
        f"while not os.path.exists({str(go)!r}): time.sleep(0.02)\n"
        "print('new', flush=True)"
    )
    pid = _create(served, project, sys.executable, "-c", code)
    with served.client() as client:
        assert wait_until(lambda: client.call("subprocess.read_log", pid=pid)["text"] == "old\n")
    none = served.cli("log", str(pid), "-n", "0")
    assert (none.returncode, none.stdout, none.stderr) == (0, "", "")
    follow = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "engine",
            "log",
            "--state-dir",
            str(served.state_dir),
            str(pid),
            "-n",
            "0",
            "-f",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(2.0)  # the follower has read where the log ends (as tail -n 0 -f: nothing before it)
    go.touch()
    out, err = follow.communicate(timeout=30)
    assert (follow.returncode, out) == (0, "new\n"), err
    served.cli("kill", str(pid))


def test_cli_wait_and_follow_include_what_the_leaders_leftovers_write(served: Served, project: Path) -> None:
    """A leader that exits on its own leaves a background job writing: ``wait`` returns, and ``log -f``
    ends, once that is gone too (found by a new user: both stopped at the leader's exit)."""
    script = "(sleep 0.3; echo late) & echo early"
    follow_pid = _create(served, project, "sh", "-c", script)
    followed = served.cli("log", str(follow_pid), "-f", timeout=20)
    assert (followed.returncode, followed.stdout) == (0, "early\nlate\n"), followed.stderr
    wait_pid = _create(served, project, "sh", "-c", script)
    waited = served.cli("wait", str(wait_pid), timeout=20)
    assert waited.returncode == 0, waited.stderr
    assert served.cli("log", str(wait_pid)).stdout == "early\nlate\n"
    served.cli_parallel(("kill", str(follow_pid)), ("kill", str(wait_pid)))


def test_cli_wait_timeout_says_an_exited_leaders_leftovers_still_run(tmp_path: Path, project: Path) -> None:
    """Found by a new user: ``wait --timeout`` printed ``exited 0`` and exited 0 while what the leader
    left running still ran (and ``--json`` said ``finished: true``)."""
    marker = mark("8812.31")
    served = start_serve(tmp_path / "state", "--grace-seconds", "10")
    try:
        pid = _create(served, project, "bash", "-c", f"sleep {marker} & echo parent done")
        with served.client() as client:
            assert wait_until(lambda: client.call("subprocess.summarize", pid=pid)["status"] == "exited 0")
        waited = served.cli("wait", str(pid), "--timeout", "0.3")
        assert waited.returncode == 1 and waited.stdout == "", waited
        assert waited.stderr.strip() == (
            f"gadget-engine: {pid} exited (exited 0), but what it left running is still running after 0.3 s; "
            "it gets the grace period to end, then SIGINT, another grace period, SIGKILL"
        )
        shown = json.loads(served.cli("wait", str(pid), "--timeout", "0.3", "--json").stdout)
        assert (shown["finished"], shown["leftovers_running"]) == (False, True)
        assert pgrep(rf"^sleep {marker}$")
        assert served.cli("kill", str(pid)).returncode == 0
        assert not pgrep(rf"^sleep {marker}$")
    finally:
        assert served.stop() == 0


def test_cli_log_of_a_capped_log_says_the_cap_dropped_its_start(served: Served, project: Path) -> None:
    """Found by a new user: ``log`` of a log past the 50 MiB cap began in the middle of a line and did
    not say that anything was dropped."""
    pid = _create(served, project, "seq", "1", "8000000")  # 68 MB
    with served.client() as client:
        assert wait_until(
            lambda: client.call("subprocess.read_log", pid=pid, stream="stdout", tail=1)["dropped_bytes"] > 0,
            seconds=20,
        )
    found = served.cli("log", str(pid), "--grep", "^7999999$")
    assert found.returncode == 0, found.stderr
    assert re.fullmatch(r"\d+: 7999999\n", found.stdout), found.stdout
    assert re.fullmatch(
        r"gadget-engine: the log cap dropped the oldest \d+ bytes of stdout; what follows starts after them, "
        r"perhaps in the middle of a line; line numbers count from there\n",
        found.stderr,
    ), found.stderr
    served.cli("kill", str(pid))


def test_cli_list_project_shows_that_projects_only(served: Served, tmp_path: Path) -> None:
    mine, other = tmp_path / "mine", tmp_path / "other"
    mine.mkdir()
    other.mkdir()
    pids = [_create(served, directory, "sleep", "60") for directory in (mine, other)]
    listed = _json_lines(served.cli("list", "--project", str(mine), "--json").stdout)
    assert [r["pid"] for r in listed] == [pids[0]]
    table = served.cli("list", "--project", str(other)).stdout.splitlines()
    assert len(table) == 2 and table[1].startswith(f"{pids[1]} ") and "UTC" in table[1]
    served.cli_parallel(*(("kill", str(pid)) for pid in pids))


def test_cli_cron_durations_nicknames_zones_get_run_and_list_all(served: Served, tmp_path: Path) -> None:
    every, nick, at, once = served.cli_parallel(
        ("cron", "add", "--every", "1h30m", "--text", "x", "--json"),
        ("cron", "add", "--cron", "@daily", "--tz", "Europe/Paris", "--text", "x", "--json"),
        ("cron", "add", "--at", "2040-07-01T09:00[Asia/Tokyo]", "--text", "x", "--json"),
        ("cron", "add", "--on-exit", "exit 4", "--cwd", str(tmp_path), "--text", "x", "--name", "once"),
    )
    jobs: list[dict[str, Any]] = [json.loads(out.stdout) for out in (every, nick, at)]
    assert jobs[0]["schedule"]["every_seconds"] == 5400
    assert jobs[1]["schedule"] == {"kind": "cron", "expr": "0 0 * * *", "tz": "Europe/Paris"}
    assert jobs[2]["schedule"]["at"] == "2040-07-01T09:00:00+09:00"
    once_id = once.stdout.strip()
    with served.client() as client:
        assert wait_until(lambda: client.call("cron.get", job_id=once_id)["last_run_at"] is not None)
    shown, everything = served.cli_parallel(("cron", "list"), ("cron", "list", "--all"))
    assert once_id not in shown.stdout and once_id in everything.stdout  # a fired one-shot job
    row = next(line for line in shown.stdout.splitlines() if line.startswith(jobs[1]["id"]))
    assert "cron '0 0 * * *' Europe/Paris" in row
    assert re.search(r" 00:00:00 CES?T  -$", row), row  # the next run, in the job's zone
    at_row = next(line for line in shown.stdout.splitlines() if line.startswith(jobs[2]["id"]))
    assert f"at {show_moment('2040-07-01T09:00:00+09:00')} " in at_row  # in the local zone, named

    got = served.cli("cron", "get", once_id)
    fields = {line[:12].strip(): line[13:] for line in got.stdout.splitlines()}
    assert fields["name"] == "once" and fields["enabled"] == "no" and fields["last status"] == "error"
    assert _json_lines(served.cli("cron", "get", once_id, "--json").stdout)[0]["id"] == once_id
    with served.client() as client:
        last = client.call("cron.get", job_id=once_id)["last_run_at"]
        again = served.cli("cron", "enable", once_id).stdout.splitlines()
        assert again == [
            f"enabled {once_id}",
            f"its command starts now, again (it last ran at {last}); the job fires once when it exits "
            "(cron get shows a start that fails)",
        ]
        assert wait_until(lambda: client.call("cron.get", job_id=once_id)["last_run_at"] != last)

    ran = served.cli("cron", "run", jobs[0]["id"])
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.startswith("--- event ") and f"(job {jobs[0]['id']}) ---\nx\n" in ran.stdout
    served.cli_parallel(*(("cron", "rm", job["id"]) for job in jobs), ("cron", "rm", once_id))


def test_cli_messages_hint_at_the_fix_in_the_clis_words(served: Served, project: Path) -> None:
    one_word, no_dashes, blank, tool = served.cli_parallel(
        ("create", "--project", str(project), "sleep 30"),
        ("create", "--project", str(project), "ls", "-la"),
        ("cron", "get", " "),
        ("tool", '{"cmd": "create", "command": "sleep 30"}', "--project", str(project)),
    )
    assert one_word.returncode == 1 and one_word.stderr.count("\n") == 1
    assert "'sleep 30' is one word with spaces" in one_word.stderr
    assert "(-- sleep 30), or run it through a shell (-- bash -c 'sleep 30')" in one_word.stderr
    assert no_dashes.returncode == 2
    assert (
        "gadget-engine create: error: unrecognized arguments: -la; put -- before the command"
        in no_dashes.stderr
    )
    assert no_dashes.stderr.startswith(
        "usage: gadget-engine create "
    )  # the subcommand's usage, not the top's
    assert blank.returncode == 2 and "job_id must be a non-empty string" in blank.stderr  # refused: usage
    assert tool.returncode == 1 and '("command": "sleep", "args": ["30"])' in tool.stderr
    for out in (one_word, no_dashes, blank, tool):
        assert "invalid params" not in out.stderr and "Traceback" not in out.stderr


def test_cli_serve_takes_the_process_limits(tmp_path: Path, project: Path) -> None:
    """A standalone engine's limits are options of serve and start, as pm2 users would look for them."""
    engine = start_serve(tmp_path / "state", "--max-processes-per-project", "2", "--max-processes", "3")
    try:
        marker = mark("338.1")
        pids = [_create(engine, project, "sleep", marker) for _ in range(2)]
        third = engine.cli("create", "--project", str(project), "--", "sleep", marker)
        assert third.returncode == 1
        assert "max_processes_per_project reached" in third.stderr and "(limit 2)" in third.stderr
        other = tmp_path / "other"
        other.mkdir()
        pids.append(_create(engine, other, "sleep", marker))
        fourth = engine.cli("create", "--project", str(other), "--", "sleep", marker)
        assert fourth.returncode == 1 and "max_processes reached" in fourth.stderr
        engine.cli_parallel(*(("kill", str(pid)) for pid in pids))
        assert not pgrep(marker)
    finally:
        engine.stop()


@pytest.mark.parametrize("how", ["stop", "sigkill"])
def test_cli_followers_end_with_the_engine(tmp_path: Path, project: Path, how: str) -> None:
    engine = start_serve(tmp_path / "state")
    try:
        pid = _create(engine, project, "bash", "-c", "while true; do echo tick; sleep 0.1; done")
        job = engine.cli("cron", "add", "--every", "1h", "--text", "tick").stdout.strip()
        assert engine.cli("cron", "run", job).returncode == 0  # an event for the events follower to print
        argv = [sys.executable, "-m", "engine", "--state-dir", str(engine.state_dir)]
        followers = [
            subprocess.Popen([*argv, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for args in (("log", str(pid), "-f"), ("events", "-f", "--json"))
        ]
        for follower in followers:  # each is following before the engine goes
            assert follower.stdout is not None and "tick" in follower.stdout.readline()
        if how == "stop":
            assert engine.cli("stop").returncode == 0
        else:
            engine.kill_hard()
        for follower, stopped_err in zip(followers, ("", "gadget-engine: engine stopped\n"), strict=True):
            _out, err = follower.communicate(timeout=20)
            if how == "stop":  # the log follower reads on until the stop has ended its process
                assert (follower.returncode, err) == (0, stopped_err)
            else:
                assert follower.returncode == 3 and "ended without stopping gracefully" in err
    finally:
        engine.stop()


def test_cli_client_commands_import_nothing_heavy(tmp_path: Path) -> None:
    """A client command loads neither Trio nor attrs, platformdirs, cronsim or shtab (~0.1 s to start)."""
    code = (
        "import json, sys, time\n"
        "began = time.perf_counter()\n"
        "from engine._cli import main\n"
        f"code = main(['--state-dir', {str(tmp_path)!r}, 'status'])\n"
        "heavy = {'trio', 'attrs', 'platformdirs', 'cronsim', 'shtab', 'sqlite3'} & set(sys.modules)\n"
        "print(json.dumps({'code': code, 'heavy': sorted(heavy), 'seconds': time.perf_counter() - began}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=True)
    result = json.loads(out.stdout)
    assert (result["code"], result["heavy"]) == (3, [])
    print(f"import and run of a client command: {result['seconds']:.3f} s")


@pytest.mark.parametrize("trap", ["", "trap '' INT; "], ids=["cooperative", "sigint-ignoring"])
def test_cli_log_follow_ends_when_the_process_is_killed(served: Served, project: Path, trap: str) -> None:
    """A kill deletes the logs once SIGINT is sent; a follower that finds them gone while the kill is under
    way (a SIGINT-ignoring process: the whole grace period) waits for its end and says it was killed."""
    pid = _create(served, project, "bash", "-c", f"{trap}while true; do echo tick; sleep 0.1; done")
    argv = [sys.executable, "-m", "engine", "log", str(pid), "-f", "--state-dir", str(served.state_dir)]
    follower = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert follower.stdout is not None and follower.stdout.readline() == "tick\n"
    assert served.cli("kill", str(pid)).returncode == 0
    _out, err = follower.communicate(timeout=20)
    assert follower.returncode == 0, err
    assert err in (
        "",
        f"gadget-engine: {pid} was killed; its logs are deleted\n",
    )


def test_cli_errors_have_no_json_rpc_words() -> None:
    unknown = RpcError("unknown method 'engine.stop'; methods: status", code=METHOD_NOT_FOUND)
    assert user_message(unknown).startswith("the running engine does not know this command")
    invalid = RpcError("invalid params: job_id must be a non-empty string, got ' '", code=INVALID_PARAMS)
    assert user_message(invalid) == "job_id must be a non-empty string, got ' '"
    assert user_message(OSError("disk\nfull")) == "disk full"


def test_cli_list_line_caps_a_huge_argv_and_json_keeps_it(served: Served, project: Path) -> None:
    """A 128 KiB argument does not make a 128 KiB ``list`` line; ``--json`` (the summary) keeps it."""
    huge = "h" * (128 * 1024 - 1)
    pid = _create(served, project, "sh", "-c", f"sleep {mark('340.95')}", huge)
    try:
        table = served.cli("list")
        (line,) = [row for row in table.stdout.splitlines() if row.startswith(f"{pid} ")]
        assert len(line) < 400 and "bytes in all)" in line
        (record,) = [r for r in _json_lines(served.cli("list", "--json").stdout) if r["pid"] == pid]
        assert record["args"] == ["-c", f"sleep {mark('340.95')}", huge]
    finally:
        served.cli("kill", str(pid))


def test_control_characters_in_names_and_paths_are_escaped_not_drawn(served: Served, tmp_path: Path) -> None:
    """Found by a new user: a job named ``bad<newline>name<ESC>[2J`` broke ``cron list`` and cleared the
    screen from ``cron get``, ``events`` and ``status``; a project folder's name did the same."""
    name = "bad\nname\x1b[2J"
    added = served.cli("cron", "add", "--every", "1h", "--text", "t\x1b[31mred\u202e", "--name", name)
    assert added.returncode == 0, added
    job = added.stdout.strip()
    folder = tmp_path / "weird\nproj \x1b[7mX"
    folder.mkdir()
    created = served.cli("create", "--project", str(folder), "--", "sleep", mark("6112.5"))
    assert created.returncode == 0, created
    assert served.cli("cron", "run", job).returncode == 0
    assert wait_until(lambda: served.cli("events").stdout != "")
    shown = [
        served.cli(*c) for c in (("cron", "list"), ("cron", "get", job), ("events",), ("status",), ("list",))
    ]
    for out in shown:
        assert out.returncode == 0, out
        assert "\x1b" not in out.stdout and "\u202e" not in out.stdout, out.stdout  # nor the event's text
    [row] = [line for line in shown[0].stdout.splitlines() if line.startswith(job)]
    assert "bad\\nname\\x1b[2J" in row
    assert "name         bad\\nname\\x1b[2J\n" in shown[1].stdout
    assert any(
        re.fullmatch(rf"--- event \d+: bad\\nname\\x1b\[2J \(job {job}\) ---", line)
        for line in shown[2].stdout.splitlines()
    ), shown[2].stdout
    assert "weird\\nproj \\x1b[7mX" in shown[3].stdout
    assert served.cli("kill", created.stdout.strip()).returncode == 0


def test_a_reader_that_stops_reading_is_no_error(served: Served, project: Path) -> None:
    """Found by a new user: ``log --json | head -c 400`` printed ``[Errno 32] Broken pipe``."""
    out = served.cli("create", "--project", str(project), "--", "seq", "200000")
    assert out.returncode == 0, out
    pid = out.stdout.strip()
    assert wait_until(lambda: "exited 0" in served.cli("list").stdout)
    piped = subprocess.run(
        f"{sys.executable} -m engine --state-dir {served.state_dir} log {pid} --json | head -c 400; "
        'echo "rc=${PIPESTATUS[0]}" >&2',
        shell=True,
        executable="/bin/bash",
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert len(piped.stdout) == 400
    assert piped.stderr in ("rc=0\n", "rc=141\n"), piped.stderr  # 0: it had written all before head left
    served.cli("kill", pid)


def test_os_errors_are_said_in_the_clis_words(tmp_path: Path) -> None:
    """Found by a new user: ``--state-dir /proc/nope start`` printed ``[Errno 2] No such file ...``."""
    assert user_message(FileNotFoundError(2, "No such file or directory", "/proc/nope")) == (
        "/proc/nope: no such file or directory"
    )
    out = cli("--state-dir", "/proc/nope", "start")
    assert out.returncode == 1 and "[Errno" not in out.stderr and "/proc/nope" in out.stderr, out


def test_long_intervals_and_a_file_as_state_dir_are_said_plainly(tmp_path: Path) -> None:
    """Found by a new user: ``every 3.15446e+08 s``; and ``chmod 700`` offered to fix a file."""
    from engine.server._protocol import describe_schedule

    assert describe_schedule({"kind": "every", "every_seconds": 3651 * 86400}) == "every 315446400 s"
    assert describe_schedule({"kind": "every", "every_seconds": 1.5}) == "every 1.5 s"
    afile = tmp_path / "afile"
    afile.write_text("")
    out = cli("--state-dir", str(afile), "start")
    assert out.returncode == 1 and "is a regular file, not a directory; give a folder" in out.stderr, out


_CTRL_C_WHILE_LOADING = """
import importlib.abc, os, signal, sys

MODULE = sys.argv[1]

class CtrlC(importlib.abc.MetaPathFinder):
    # a real SIGINT to this process while one of the command line's modules is being imported
    def find_spec(self, name, path=None, target=None):
        if name == MODULE:
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, CtrlC())
sys.argv[1:] = ["--state-dir", sys.argv[2], "status"]
from engine._entry import main
raise SystemExit(main())
"""


@pytest.mark.parametrize("module", ["engine._cli", "engine._cli_commands", "engine.server._client"])
def test_ctrl_c_while_the_command_line_loads_exits_130_quietly(tmp_path: Path, module: str) -> None:
    """Found by a new user: Ctrl-C in the first tenth of a second of a command printed a traceback."""
    done = subprocess.run(
        [sys.executable, "-c", _CTRL_C_WHILE_LOADING, module, str(tmp_path / "state")],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert (done.returncode, done.stderr, done.stdout) == (130, "", "")
