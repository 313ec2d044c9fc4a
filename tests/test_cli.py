"""The ``gadget-engine`` command line, end to end against a real ``gadget-engine serve``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from engine import EngineConfig
from engine.server._location import default_state_dir

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
    ]
    procs = [subprocess.Popen([sys.executable, "-m", "engine", *c], stderr=subprocess.PIPE) for c in commands]
    for proc in procs:
        proc.communicate(timeout=30)
        assert proc.returncode == 2


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
    assert again.stdout == f"{pid} had already exited; its logs are kept\n"
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
        removed = served.cli_parallel(*(("cron", "rm", job_id) for job_id in ids.values()))
        assert [out.returncode for out in removed] == [0, 0, 0, 0]
        remaining = {job["id"] for job in client.call("cron.list")}
    assert not remaining & set(ids.values())
    missing = served.cli("cron", "rm", ids["every"])
    assert missing.returncode == 1 and missing.stderr.count("\n") == 1


def test_cli_cron_add_rejects_bad_schedules_on_one_line(served: Served) -> None:
    out, past = served.cli_parallel(
        ("cron", "add", "--cron", "not a cron", "--text", "x"),
        ("cron", "add", "--at", "2001-01-01T00:00:00+00:00", "--text", "x"),
    )
    assert out.returncode == 1 and out.stderr.count("\n") == 1
    assert past.returncode == 1 and "in the past" in past.stderr


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
