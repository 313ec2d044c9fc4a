"""``gadget-engine top``: the model's text, the tree usage behind ``subprocess.stats``, and the live view
driven in a terminal by Textual's own pilot against a real ``serve`` with two projects.

``docs/guide-cli.md`` shows a capture of the screen; :func:`test_top_screen_matches_the_guide` draws the
same scene and compares, pids, times, CPU and memory normalised.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

import pytest
from rich.console import Console
from textual.app import App
from textual.widgets import Log

from engine._termtext import last_line, printable, printable_line
from engine._top import INSTALL_HINT
from engine._top_app import MIN_REFRESH_SECONDS, TopApp, suspended_line
from engine._top_model import (
    WIDE_COLUMNS,
    JobRow,
    RunRow,
    format_cpu,
    format_duration,
    format_memory,
    group_runs,
    job_lines,
    run_header,
    run_lines,
)
from engine._top_screens import Confirm, LogScreen
from engine._usage import CpuMeter, ProcSample, tree_members

from .children import SESSION, mark
from .conftest import cgroup_unusable
from .docs_runner import read_blocks
from .serve_support import Served, alive, cli, start_serve, wait_until

ROOT = Path(__file__).parent.parent
T = TypeVar("T")


# ---- the text of the view (engine._top_model, engine._termtext) --------------------------------------


def test_top_formats_durations_sizes_and_cpu() -> None:
    assert [format_duration(s) for s in (None, 0, 59.9, 61, 3600 * 3 + 300, 86400 * 2 + 3600 * 4)] == [
        "-",
        "0s",
        "59s",
        "1m01s",
        "3h05m",
        "2d04h",
    ]
    sizes = [None, 512, 812 * 1024, int(21.3 * 2**20), 150 * 2**20, int(1.2 * 2**30)]
    assert [format_memory(s) for s in sizes] == ["-", "512B", "812K", "21.3M", "150M", "1.2G"]
    assert [format_cpu(p) for p in (None, 0.04, 12.345, 180.2)] == ["-", "0.0", "12.3", "180"]


def _entry(pid: int, slug: str, **extra: object) -> dict[str, object]:
    entry: dict[str, object] = {
        "pid": pid,
        "project_id": f"id-{slug}",
        "project_slug": slug,
        "project_directory": f"/home/me/{slug}",
        "command": "python3",
        "args": ["-u", "serve.py"],
        "state": "running",
        "status": "running",
        "exit_code": None,
        "signal": None,
        "uptime_seconds": 75.0,
        "cpu_percent": 3.25,
        "memory_bytes": 20 * 2**20,
        "last_line": "listening",
        "last_stream": "stdout",
    }
    entry.update(extra)
    return entry


def test_top_rows_say_status_in_a_word_and_restarts_only_where_the_engine_does() -> None:
    exited = RunRow.from_stats(_entry(5, "app", state="exited", status="exited 1", exit_code=1))
    killed = RunRow.from_stats(
        _entry(6, "app", state="exited", status="killed by signal 9 (SIGKILL)", signal=9)
    )
    stopping = RunRow.from_stats(_entry(7, "app", state="exiting", status="exiting"))
    restarting = RunRow.from_stats(_entry(8, "app", status="restarting (2 of 5)", restarts=2))
    assert [r.status for r in (exited, killed, stopping, restarting)] == [
        "exit 1",
        "SIGKILL",
        "stopping",
        "restarting",
    ]
    assert (exited.restarts, restarting.restarts) == (None, 2)
    # A newline is shown as \n, as `cron list` shows it (found in review: joined with a space, the
    # command read as another one).
    assert RunRow.from_stats(_entry(9, "app", args=["-c", "a\nb"])).command == "python3 -c 'a\\nb'"


def test_top_groups_runs_by_project_and_filters_by_name_or_directory() -> None:
    rows = [RunRow.from_stats(_entry(pid, slug)) for pid, slug in ((3, "web"), (1, "api"), (2, "web"))]
    assert [(g.project, [r.pid for r in g.runs]) for g in group_runs(rows)] == [
        ("api", [1]),
        ("web", [3, 2]),
    ]
    assert [g.project for g in group_runs(rows, "WE")] == ["web"]
    assert [g.project for g in group_runs(rows, "/home/me/api")] == ["api"]
    assert group_runs(rows, "nothing") == []


@pytest.mark.parametrize("width", [60, 80, 119, 120, 200])
def test_top_run_lines_fit_the_width_and_line_up_under_the_header(width: int) -> None:
    row = RunRow.from_stats(_entry(4242, "app", args=["-u", "serve.py", "--port", "8000", *["x"] * 40]))
    lines = run_lines(row, width, restarts=False)
    header = run_header(width, restarts=False)
    assert all(len(line) <= width for line in [*lines, header])
    assert len(lines) == (1 if width >= WIDE_COLUMNS else 2)
    assert header.index("PID") + 3 == lines[0].index("4242") + 4  # right-aligned under the title
    assert lines[0][header.index("COMMAND") :].startswith("python3 -u se")
    assert "listening" in lines[-1]
    with_restarts = run_lines(RunRow.from_stats(_entry(1, "app", restarts=3)), width, restarts=True)
    assert " 3  python3" in with_restarts[0]


def test_top_job_lines_say_next_run_and_last_result() -> None:
    now = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)
    jobs = [
        JobRow.from_job(
            {
                "id": "a1",
                "name": "stretch",
                "enabled": True,
                "schedule": {"kind": "every", "every_seconds": 5400},
                "next_run_at": (now + timedelta(minutes=89)).isoformat(),
            }
        ),
        JobRow.from_job(
            {
                "id": "b2",
                "name": "quick",
                "enabled": False,
                "schedule": {"kind": "on_exit", "command": "exit 3"},
                "last_status": "error",
                "last_run_at": (now - timedelta(seconds=12)).isoformat(),
            }
        ),
    ]
    lines = job_lines(jobs, 80, now)
    assert re.sub(" +", " ", lines[1]) == "stretch in 1h29m - every 1h30m"
    assert re.sub(" +", " ", lines[2]) == "quick off error 12s ago on exit of exit 3"
    assert job_lines([], 80, now)[1] == "(no cron jobs)"
    # Found in review: a multi-line on-exit command (or name) spilled its lines into the table.
    multi = JobRow.from_job(
        {
            "id": "c3",
            "name": "two\nlines",
            "enabled": True,
            "schedule": {"kind": "on_exit", "command": "echo a\nexit 4"},
        }
    )
    (_title, line) = job_lines([multi], 80, now)
    assert "\n" not in line and line.endswith("on exit of echo a\\nexit 4") and line.startswith("two\\nlines")


def test_top_child_output_is_drawn_without_terminal_escapes() -> None:
    assert printable_line("\x1b[31mred\x1b[0m and \x1b]0;title\x07plain\tx\x07") == "red and plain    x?"
    assert printable_line("10%\r50%\r100%\r") == "100%"
    assert printable("a\x1b[2J\nb\x1b[H") == "a\nb"
    assert last_line("first\nsecond\n\n   \n") == "second"
    assert last_line("") == ""


# ---- the usage of a tree (engine._usage) -------------------------------------------------------------


def test_tree_members_follow_group_parents_and_roots_but_not_older_pids() -> None:
    samples = [
        ProcSample(pid=10, ppid=1, pgid=10, start_time=100, cpu_ticks=5, rss_pages=1),  # the leader
        ProcSample(pid=11, ppid=10, pgid=10, start_time=101, cpu_ticks=1, rss_pages=1),  # its child
        ProcSample(pid=12, ppid=11, pgid=12, start_time=102, cpu_ticks=1, rss_pages=1),  # setsid grandchild
        ProcSample(pid=13, ppid=1, pgid=10, start_time=103, cpu_ticks=1, rss_pages=1),  # orphan in the group
        ProcSample(pid=14, ppid=99, pgid=14, start_time=104, cpu_ticks=1, rss_pages=1),  # adopted escapee
        ProcSample(pid=15, ppid=10, pgid=15, start_time=50, cpu_ticks=1, rss_pages=1),  # older: reused pid
        ProcSample(pid=16, ppid=1, pgid=16, start_time=105, cpu_ticks=1, rss_pages=1),  # someone else's
    ]
    assert [s.pid for s in tree_members(samples, 10, 100)] == [10, 11, 12, 13]
    assert [s.pid for s in tree_members(samples, 10, 100, roots=[14])] == [10, 11, 12, 13, 14]
    assert tree_members(samples, 42, 100) == []


def test_cpu_meter_measures_since_the_reference_look() -> None:
    meter = CpuMeter(min_interval_seconds=0.5)
    assert meter.percent("run", 10.0, now=100.0) is None  # the first look
    assert meter.percent("run", 10.5, now=101.0) == pytest.approx(50.0)
    assert meter.percent("run", 10.6, now=101.2) == pytest.approx(50.0)  # sooner: same reference
    assert meter.percent("run", 11.5, now=102.0) == pytest.approx(100.0)
    assert meter.percent("run", 11.0, now=103.0) == 0.0  # a total that went down
    assert meter.percent("run", None, now=104.0) is None
    meter.percent("other", 1.0, now=104.0)
    meter.keep_only(["run"])
    assert set(meter.statistics()) == set()


# ---- subprocess.stats on a real engine ---------------------------------------------------------------


@pytest.fixture(params=["process-group", "cgroup"])
def contained(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Served]:
    """A ``serve`` in each containment mode (cgroup skipped where it cannot be used)."""
    if request.param == "cgroup" and (why := cgroup_unusable()):
        pytest.skip(f"cgroup containment is not usable here: {why}")
    engine = start_serve(tmp_path / "state", "--containment", request.param)
    yield engine
    assert engine.stop() == 0


def _cpu_seconds(pid: int) -> float:
    """User plus system CPU time of ``pid`` so far, from ``/proc/<pid>/stat``, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_stats_measure_the_whole_tree_escapees_included(contained: Served, project: Path) -> None:
    """A busy child, a child holding 64 MiB and an escapee that ``setsid`` and was re-parented to the
    engine all count, on top of the leader; the last line is the newest output."""
    hold = "import time\nb = bytearray(64 * 2**20)\nfor i in range(0, len(b), 4096): b[i] = 1\ntime.sleep(60)"
    script = (
        "python3 -c 'while True: pass' & "
        f"(setsid python3 -c '{hold}' &); "
        "sleep 0.5; echo tree is up; echo warming >&2; "
        f"exec sleep {mark('301.3')}"
    )
    with contained.client() as client:
        pid = client.call("subprocess.create", project=str(project), command="bash", args=["-c", script])[
            "pid"
        ]
        try:

            def busy_loop() -> int | None:
                """The busy loop once it runs python (a loaded machine may still show bash's fork)."""
                found = []
                for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
                    with contextlib.suppress(OSError):
                        if b"\0while True: pass\0" in Path(f"/proc/{child}/cmdline").read_bytes():
                            found.append(int(child))
                return found[0] if len(found) == 1 else None

            def measured() -> dict[str, Any] | None:
                entry: dict[str, Any] = next(e for e in client.call("subprocess.stats") if e["pid"] == pid)
                ready = entry["cpu_percent"] and entry["processes"] >= 3 and busy_loop() is not None
                return entry if ready else None

            assert wait_until(measured, 15), client.call("subprocess.stats")
            busy = busy_loop()
            assert busy is not None
            busy_seconds = _cpu_seconds(busy)  # what the busy loop alone has used by now
            time.sleep(MIN_REFRESH_SECONDS)
            entry = next(e for e in client.call("subprocess.stats") if e["pid"] == pid)
            assert entry["processes"] == 3  # the leader (sleep), the busy loop, the escapee
            # The busy loop's CPU counts in the tree's (found on a loaded VM: a fixed "> 20 %" saw 8.2 %).
            assert entry["cpu_percent"] > 0 and entry["cpu_seconds"] >= busy_seconds
            assert entry["memory_bytes"] > 64 * 2**20
            assert entry["cpu_seconds"] > 0 and entry["uptime_seconds"] > 0.5
            assert entry["project_directory"] == str(project)
            assert (entry["last_line"], entry["last_stream"]) in (
                ("warming", "stderr"),
                ("tree is up", "stdout"),
            )
            only = client.call("subprocess.stats", project=str(project.parent))
            assert only == []
        finally:
            client.call("subprocess.kill", pid=pid)
        assert not any(e["pid"] == pid for e in client.call("subprocess.stats"))


def test_stats_of_an_exited_run_keep_its_uptime_and_last_line(served: Served, project: Path) -> None:
    with served.client() as client:
        pid = client.call(
            "subprocess.create", project=str(project), command="bash", args=["-c", "echo done; sleep 0.3"]
        )["pid"]
        assert wait_until(lambda: client.call("subprocess.summarize", pid=pid)["state"] == "exited")
        entry = next(e for e in client.call("subprocess.stats") if e["pid"] == pid)
        client.call("subprocess.kill", pid=pid)
    assert 0.3 <= entry["uptime_seconds"] < 5
    assert (entry["cpu_percent"], entry["memory_bytes"], entry["processes"]) == (None, None, 0)
    assert (entry["last_line"], entry["last_stream"]) == ("done", "stdout")


# ---- the command ------------------------------------------------------------------------------------


def test_top_without_textual_says_how_to_install_it(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('textual', 'rich'):\n"
        "            raise ImportError(f'No module named {name!r}')\n"
        "sys.meta_path.insert(0, Block())\n"
        "from engine._cli import main\n"
        f"sys.exit(main(['--state-dir', {str(tmp_path)!r}, 'top']))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.returncode == 1, out.stderr
    assert INSTALL_HINT in out.stderr and "pip install 'gadget-engine[tui]'" in out.stderr


def test_top_exits_3_without_an_engine_and_1_without_a_terminal(served: Served, tmp_path: Path) -> None:
    none = cli("top", "--state-dir", str(tmp_path / "none"))
    assert none.returncode == 3 and "no engine is running" in none.stderr
    piped = served.cli("top")
    assert piped.returncode == 1 and "run it in one" in piped.stderr


def test_client_commands_load_no_terminal_ui(tmp_path: Path) -> None:
    code = (
        "import json, sys\n"
        "from engine._cli import main\n"
        f"code = main(['--state-dir', {str(tmp_path)!r}, 'list'])\n"
        "print(json.dumps(sorted({'textual', 'rich'} & set(sys.modules))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=True)
    assert json.loads(out.stdout) == []


# ---- the live view in a terminal (Textual's pilot) ----------------------------------------------------


def screen_text(app: App[Any]) -> str:
    """What the terminal shows now, as text: the screen (and any screen under a modal) as drawn."""
    width, height = app.size
    console = Console(width=width, height=height, file=io.StringIO(), record=True, force_terminal=True)
    console.print(app.screen._compositor.render_update(full=True, screen_stack=app._background_screens))
    return console.export_text()


async def _until(pilot: Any, condition: Callable[[], object], seconds: float = 15.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {seconds} s:\n{screen_text(pilot.app)}")
        await pilot.pause(0.05)


async def _select(pilot: Any, app: TopApp, pid: int) -> None:
    for key in ["home"] + ["down"] * 20:
        await pilot.press(key)
        if (row := app.selected()) is not None and row.pid == pid:
            return
    raise AssertionError(f"run {pid} cannot be selected:\n{screen_text(app)}")


def _drive(scenario: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run a pilot scenario on its own asyncio loop (the test runner's loop is Trio's)."""
    return asyncio.run(scenario())


def test_top_lists_follows_and_kills_in_a_terminal(served: Served, project: Path) -> None:
    api = project.parent / "api"
    api.mkdir()
    waiter = (
        "import os, time\n"
        "print('waiting for go', flush=True)\n"
        "while not os.path.exists('go'):\n"
        "    time.sleep(0.05)\n"
        "print('printed after top started', flush=True)\n"
        f"time.sleep({mark('301.4')})\n"
    )
    with served.client() as client:
        web = client.call(
            "subprocess.create",
            project=str(project),
            command="bash",
            args=["-c", f"echo serving; exec sleep {mark('301.5')}"],
        )["pid"]
        worker = client.call(
            "subprocess.create", project=str(api), command="python3", args=["-u", "-c", waiter]
        )["pid"]
    try:

        async def scenario() -> None:
            app = TopApp(str(served.state_dir))
            async with app.run_test(size=(80, 24)) as pilot:
                shown = [f" {web} ", f" {worker} ", "└ serving", "└ waiting for go"]
                await _until(pilot, lambda: all(text in screen_text(app) for text in shown))
                screen = screen_text(app)
                # A project's heading is cut at the list's width: a pytest-xdist worker's tmp path alone
                # can be 76 characters long.
                assert f"api  {api}"[:60] in screen and f"app  {project}"[:60] in screen
                assert all(len(line) <= 80 for line in screen.splitlines())

                await _select(pilot, app, worker)
                await pilot.press("l")
                await _until(pilot, lambda: isinstance(app.screen, LogScreen))
                (api / "go").touch()  # the child prints its line now, after top started
                log = app.screen.query_one(Log)
                await _until(pilot, lambda: "printed after top started" in log.lines)
                assert "printed after top started" in screen_text(app)
                await pilot.press("escape")
                await _until(pilot, lambda: not isinstance(app.screen, LogScreen))

                await _select(pilot, app, web)
                await pilot.press("k")
                await _until(pilot, lambda: isinstance(app.screen, Confirm))
                assert f"Kill {web} of app?" in screen_text(app)
                await pilot.press("n")  # no: nothing happens
                await pilot.pause(0.3)
                assert alive(web)
                await pilot.press("k")
                await _until(pilot, lambda: isinstance(app.screen, Confirm))
                await pilot.press("y")
                await _until(pilot, lambda: f" {web} " not in screen_text(app))
                await pilot.press("q")
            assert app.return_value == 0

        _drive(scenario)
        listed = served.cli("list").stdout
        assert str(web) not in listed and str(worker) in listed
        assert not alive(web)
    finally:
        with served.client() as client:
            for pid in (web, worker):
                try:
                    client.call("subprocess.kill", pid=pid)
                except LookupError:
                    pass


def test_top_filters_halts_resizes_and_refreshes_no_faster_than_once_a_second(
    served: Served, project: Path
) -> None:
    other = project.parent / "other"
    other.mkdir()
    with served.client() as client:
        pids = [
            client.call("subprocess.create", project=str(d), command="sleep", args=[mark(f"301.{6 + n}")])[
                "pid"
            ]
            for n, d in enumerate((project, other))
        ]
    try:

        async def scenario() -> None:
            app = TopApp(str(served.state_dir), refresh_seconds=0.1)  # asked for less: one second
            async with app.run_test(size=(80, 24)) as pilot:
                await _until(pilot, lambda: all(f" {pid} " in screen_text(app) for pid in pids))
                began, count = time.monotonic(), app.refreshes
                await pilot.pause(2.5)
                assert app.refreshes - count <= (time.monotonic() - began) / MIN_REFRESH_SECONDS + 1
                await pilot.press("slash", "o", "t", "h")
                await _until(pilot, lambda: f" {pids[0]} " not in screen_text(app))
                assert f" {pids[1]} " in screen_text(app) and "filter: oth" in screen_text(app)
                await pilot.press("enter")
                await pilot.press("escape")  # clears the filter
                await _until(pilot, lambda: f" {pids[0]} " in screen_text(app))
                await _select(pilot, app, pids[1])
                await pilot.press("h")
                await _until(pilot, lambda: isinstance(app.screen, Confirm))
                assert f"Halt {pids[1]} of other?" in screen_text(
                    app
                ) and "Its logs are kept." in screen_text(app)
                await pilot.press("y")
                await _until(pilot, lambda: any(r.pid == pids[1] and r.status == "SIGINT" for r in app.rows))
                await pilot.resize_terminal(130, 30)
                await _until(pilot, lambda: "LAST OUTPUT" in screen_text(app))
                assert all(len(line) <= 130 for line in screen_text(app).splitlines())
                await pilot.press("q")

        _drive(scenario)
    finally:
        with served.client() as client:
            for pid in pids:
                client.call("subprocess.kill", pid=pid)


# ---- the capture in docs/guide-cli.md ---------------------------------------------------------------

_WATCH = "import time\nprint('build ok: 12 modules')\nprint('watching src/ for changes')\ntime.sleep(3600)\n"
_WORKER = "import time\nprint('worker ready: 0 jobs queued')\ntime.sleep(3600)\n"
_TESTS = (
    "import unittest\n\n\nclass Pages(unittest.TestCase):\n"
    "    def test_home(self):\n        self.assertTrue(True)\n\n"
    "    def test_login(self):\n        self.assertEqual(1 + 1, 3)\n"
)


def normalise(screen: str, *, home: str = "/home/me") -> str:
    """A screen with what changes from run to run made alike: the home folder, pids, times, CPU, memory,
    the containment mode, and runs of blanks."""
    text = screen.replace(home, "/home/me")
    text = re.sub(r"\((cgroup|process-group)\)", "(MODE)", text)
    text = re.sub(r"\b\d+(\.\d)?[BKMG]\b", "MEM", text)
    text = re.sub(r"\b(\d+d\d\dh|\d+h\d\dm|\d+m\d\ds|\d+s)\b", "TIME", text)
    text = re.sub(r"(?<![\w.])\d+\.\d\b|(?<=  )-(?=  )", "CPU", text)
    text = re.sub(r"\b\d{3,}\b", "PID", text)
    return "\n".join(re.sub(r" +", " ", line).rstrip() for line in text.rstrip("\n").split("\n"))


def _guide_capture() -> str:
    found = [
        b.text
        for b in read_blocks(ROOT / "docs" / "guide-cli.md", ROOT)
        if b.kind == "output" and b.first_line.startswith("top · engine")
    ]
    assert len(found) == 1, "docs/guide-cli.md shows one capture of top"
    return found[0]


def test_top_screen_matches_the_guide() -> None:
    """The scene of the guide's capture, drawn at 80x24: two projects, an exited test run, two jobs;
    then the engine stops, and the view says so."""
    base = tempfile.mkdtemp(prefix=f"top-{SESSION}-")  # short: the headings show the directories whole
    engine = start_serve(Path(base) / "state")
    try:
        app_dir, api_dir = Path(base, "app"), Path(base, "api")
        for folder, files in (
            (app_dir, {"watch.py": _WATCH, "test_pages.py": _TESTS}),
            (api_dir, {"worker.py": _WORKER}),
        ):
            folder.mkdir()
            for name, text in files.items():
                (folder / name).write_text(text)
        run = [
            ("create", "--project", str(app_dir), "--", "python3", "-u", "watch.py"),
            ("create", "--project", str(app_dir), "--", "python3", "-m", "unittest", "-q"),
            ("create", "--project", str(api_dir), "--", "python3", "-u", "worker.py"),
            ("cron", "add", "--every", "1h30m", "--text", "stretch", "--name", "stretch"),
            (
                "cron",
                "add",
                "--on-exit",
                "exit 3",
                "--cwd",
                str(app_dir),
                "--text",
                "done",
                "--name",
                "quick",
            ),
        ]
        for args in run:
            assert cli("--state-dir", str(engine.state_dir), *args).returncode == 0
        time.sleep(1.5)  # the test run has exited, the on-exit job has fired, every run has printed

        async def scenario() -> str:
            app = TopApp(str(engine.state_dir))
            async with app.run_test(size=(80, 24)) as pilot:

                def ready() -> bool:
                    alive_rows = [r for r in app.rows if r.alive]
                    return (
                        len(app.rows) == 3
                        and all(r.last_line for r in app.rows)
                        and all(r.cpu_percent is not None for r in alive_rows)
                        and any(j.last_status for j in app.jobs)
                    )

                await _until(pilot, ready)
                await pilot.pause(0.2)
                shown = screen_text(app)
                assert await asyncio.to_thread(engine.stop) == 0  # and the view says so
                await _until(pilot, lambda: screen_text(app).startswith("engine not running: "))
                assert "no runs" in screen_text(app) and "(no cron jobs)" in screen_text(app)
                return shown

        shown = _drive(scenario)
        printed = normalise(shown, home=base)
        if os.environ.get("GADGET_SHOW_TOP"):
            print(shown.replace(base, "/home/me"))
        assert printed == normalise(_guide_capture()), f"\n{printed}\n---\n{normalise(_guide_capture())}"
        assert all(len(line) <= 80 for line in shown.splitlines()) and len(shown.splitlines()) == 24
    finally:
        engine.stop()
        shutil.rmtree(base, ignore_errors=True)


# ---- an engine whose process is stopped ------------------------------------------------------------


def test_top_names_a_stopped_engine_with_its_kill_cont_hint_within_80_columns(tmp_path: Path) -> None:
    # Found in review: the status line was the client's whole sentence ("the engine on <state dir> (pid N)
    # is stopped (SIGSTOP, or Ctrl-Z ...) ... kill -CONT N"), cut at 80 columns before the hint.
    engine = start_serve(tmp_path / "state")
    pid = engine.proc.pid
    try:

        async def scenario() -> str:
            app = TopApp(str(engine.state_dir))
            async with app.run_test(size=(80, 24)) as pilot:
                await _until(pilot, lambda: app.engine is not None)
                os.kill(pid, signal.SIGSTOP)
                try:
                    await _until(pilot, lambda: f"kill -CONT {pid}" in screen_text(app).splitlines()[0])
                    title = screen_text(app).splitlines()[0]
                finally:
                    os.kill(pid, signal.SIGCONT)
                await _until(pilot, lambda: not app.error)  # continued, it answers again
                assert "kill -CONT" not in screen_text(app)
                await pilot.press("q")
            return title

        title = _drive(scenario)
    finally:
        os.kill(pid, signal.SIGCONT)
        assert engine.stop() == 0
    assert title.rstrip() == f"engine stopped (SIGSTOP or Ctrl-Z): continue it with kill -CONT {pid}"
    assert len(title) <= 80
    assert len(suspended_line(4194304)) <= 80  # the largest pid Linux gives (pid_max, 2**22)


def test_top_goes_on_to_its_view_when_the_engine_is_stopped_at_its_start(tmp_path: Path) -> None:
    # Found in review: top started while the engine was SIGSTOPped exited 1 with the client's sentence,
    # where the view (which names it and goes on once it is continued) was what it needed. Without a
    # terminal it now gets past that look, to the terminal check.
    engine = start_serve(tmp_path / "state")
    try:
        os.kill(engine.proc.pid, signal.SIGSTOP)
        try:
            piped = cli("top", "--state-dir", str(engine.state_dir))
        finally:
            os.kill(engine.proc.pid, signal.SIGCONT)
        assert piped.returncode == 1 and "run it in one" in piped.stderr, piped.stderr
    finally:
        engine.stop()
