"""Docs that cannot drift: every fenced shell and Python block of README.md and docs/*.md runs as written.

Each page runs in a folder of its own: ``HOME`` is a fresh folder holding the project ``~/app`` (a page's
commands run there) with a small test file and a link to the virtual environment the tests run in, and a
login profile that puts that environment on ``PATH`` (as a reader's would; on-exit commands run in a login
shell). ``GADGET_ENGINE_STATE_DIR`` is ``~/.local/state/gadget-engine`` of that home, so no block touches
the user's engine. How blocks are read, run and compared: ``tests/docs_runner.py``.

Blocks that do not run are the README's test command (this test is part of it) and those in
:data:`NOT_RUN`, each with its reason; the test asserts the list's length, so a block cannot join it
quietly.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine._cli import build_parser

from .children import SESSION, kill_pids, pgrep
from .docs_runner import (
    DOC_HOME,
    RUN_KINDS,
    SHOWN_KINDS,
    Block,
    Values,
    bounded,
    commands,
    hidden_command,
    matches,
    read_blocks,
    run_python,
    run_shell,
)
from .pg_support import fresh_database

ROOT = Path(__file__).parent.parent
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]

#: The page whose engines share a PostgreSQL store (``GADGET_ENGINE_STORE`` names a fresh database).
FLEET_PAGE = "docs/guide-fleet.md"
#: The README's test command: this test is part of what it runs.
TEST_COMMAND = ("README.md", "make test")

#: Runnable blocks that do not run here, by page and first line, each with its reason.
NOT_RUN: dict[tuple[str, str], str] = {
    ("README.md", "make demo"): (
        "runs docs/examples/demo.py, service_demo.py and standalone_demo.py, which "
        "tests/test_examples.py and test_docs_service_demo_runs below run"
    ),
    ("README.md", "pipx install ."): "installs the package for the user, outside the test's folders",
    ("docs/guide-mcp.md", "pip install 'gadget-engine[mcp]'"): (
        "installs from the package index; the dev extra the tests run with holds the mcp SDK"
    ),
}

#: The project a page's commands run in: a test run with one pass and one failure, and a page to serve.
PROJECT_FILES = {
    "test_app.py": "def test_home():\n    assert True\n\n\ndef test_login():\n    assert 1 + 1 == 3\n",
    "index.html": "<h1>hello from the dev server</h1>\n",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _home(tmp_path: Path) -> Path:
    home = tmp_path / "home"
    app = home / "app"
    app.mkdir(parents=True)
    for name, text in PROJECT_FILES.items():
        (app / name).write_text(text)
    venv = Path(sys.executable).parent.parent
    (app / ".venv").symlink_to(venv)  # the README's reader is in the checkout, where .venv is
    (home / ".bash_profile").write_text(f'export PATH="{venv / "bin"}:$PATH"\n')
    return home


def _env(home: Path) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith(("XDG_", "PYTEST_"))}
    env.update(
        HOME=str(home),
        PATH=f"{Path(sys.executable).parent}:{env.get('PATH', os.defpath)}",
        GADGET_ENGINE_STATE_DIR=str(home / ".local" / "state" / "gadget-engine"),
    )
    return env


def _clean_up(tmp_path: Path, env: dict[str, str]) -> None:
    """Stop an engine a page left running, end what is left of the page's processes, reap them."""
    subprocess.run(
        [sys.executable, "-m", "engine", "stop", "--end-watched"],
        env=env,
        capture_output=True,
        timeout=60,
        check=False,
    )
    kill_pids(pgrep(str(tmp_path)))
    for entry in os.listdir("/proc"):  # engines that `start` ran were adopted if this process is a subreaper
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                state, ppid = stat[stat.rfind(")") + 2 :].split()[:2]
                if state == "Z" and int(ppid) == os.getpid():
                    with contextlib.suppress(ChildProcessError):
                        os.waitpid(int(entry), os.WNOHANG)


def _diff(shown: str, printed: str) -> str:
    return "\n".join(
        difflib.unified_diff(shown.splitlines(), printed.splitlines(), "page", "printed", lineterm="")
    )


def _runnable(block: Block) -> bool:
    key = (block.page, block.first_line)
    return block.kind in RUN_KINDS and key != TEST_COMMAND and key not in NOT_RUN


def test_docs_not_run_list_holds_its_entries_and_no_more() -> None:
    assert len(NOT_RUN) == 3
    blocks = {(b.page, b.first_line): b for page in PAGES for b in read_blocks(ROOT / page, ROOT)}
    for key, reason in [*NOT_RUN.items(), (TEST_COMMAND, "")]:
        assert key in blocks, f"{key} names no block"
        assert blocks[key].kind in RUN_KINDS and (reason or key == TEST_COMMAND)


@pytest.mark.parametrize("page", PAGES)
def test_docs_block_labels(page: str) -> None:
    """Every fence says what it is, and nothing that runs hides as ``text`` or ``usage``."""
    for block in read_blocks(ROOT / page, ROOT):
        assert block.kind in RUN_KINDS | SHOWN_KINDS, f"{block.where}: label the block ({block.kind!r})"
        problem = hidden_command(block)
        assert problem is None, problem


@pytest.mark.parametrize("page", PAGES)
def test_docs_python_blocks_name_no_example_home(page: str) -> None:
    """A Python block runs for a reader as written: this test puts its own home for ``/home/me``, but a
    reader has no such folder (``project directory '/home/me/app' does not exist``)."""
    for block in read_blocks(ROOT / page, ROOT):
        if block.kind == "python":
            assert DOC_HOME not in block.text, f"{block.where}: use os.getcwd() or a folder the block makes"


def test_docs_cli_engine_usage_shows_every_option() -> None:
    """The usage of ``start``, ``stop``, ``status`` and ``serve`` in guide-cli.md names the options of their
    ``--help``, in its order (``--state-dir``, ``--json`` and ``-h`` are the common ones)."""
    usage = next(
        b.text
        for b in read_blocks(ROOT / "docs/guide-cli.md", ROOT)
        if b.kind == "usage" and " start " in b.text
    )
    shown: dict[str, list[str]] = {}
    for line in usage.splitlines():
        if line.startswith("gadget-engine [--state-dir DIR] "):
            name = line.split()[3]
            shown[name] = []
        shown[name] += re.findall(r"\[(--[a-z-]+)", line)
    common = ("--help", "--state-dir", "--json")
    subcommands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name in ("start", "stop", "status", "serve"):
        options = [
            option
            for action in subcommands.choices[name]._actions
            for option in action.option_strings
            if option.startswith("--") and option not in common
        ]
        assert [o for o in shown.get(name, []) if o not in common] == options, name


@pytest.fixture
def short_tmp_path() -> Iterator[Path]:
    """A scratch folder with a short path: under pytest's (``/tmp/pytest-of-root/pytest-1123/
    test_docs_page_runs_as_written12``, longer as the runs add up) a state directory's socket would pass
    the 108-byte ``sun_path`` limit and move to the runtime folder, which the pages do not show."""
    base = Path(tempfile.mkdtemp(prefix=f"gd{SESSION}-", dir="/tmp"))  # the session's: pgrep may look
    yield base
    shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("page", PAGES)
def test_docs_page_runs_as_written(page: str, short_tmp_path: Path) -> None:
    tmp_path = short_tmp_path
    blocks = read_blocks(ROOT / page, ROOT)
    home = _home(tmp_path)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = _env(home)
    values = Values(home=home, scratch=scratch, port=_free_port())
    cwd = home / "app"
    pages = contextlib.ExitStack()
    if page == FLEET_PAGE:  # its engines share a store: a fresh database on the session's PostgreSQL
        env["GADGET_ENGINE_STORE"] = pages.enter_context(fresh_database("docs"))
    try:
        for at, block in enumerate(blocks):
            if not _runnable(block):
                continue
            if block.kind == "python":
                out, err, status = run_python(block, values, env, cwd, sys.executable)
                assert status == 0, f"{block.where} exited {status}:\n{out}\n{err}"
                after = blocks[at + 1] if at + 1 < len(blocks) else None
                if after is not None and after.kind == "output":
                    printed = values.from_run(out)
                    assert matches(after.text, printed, values), (
                        f"{after.where}:\n{_diff(after.text, printed)}"
                    )
                continue
            for command, out, status in run_shell(block, values, env, cwd):
                printed = values.from_run(out)
                where = f"{block.where}: $ {command.text}"
                if command.shown is None:
                    assert status == 0, f"{where} exited {status}:\n{printed}"
                else:
                    assert matches(command.shown, printed, values), (
                        f"{where}\n{_diff(command.shown, printed)}"
                    )
    finally:
        _clean_up(tmp_path, env)
        for name in ("engine-a", "engine-b"):  # the fleet page's engines
            if (home / name).is_dir():
                _clean_up(tmp_path, {**env, "GADGET_ENGINE_STATE_DIR": str(home / name)})
        pages.close()


@pytest.mark.machine_wide  # the demo looks for its server with a machine-wide `pgrep -f`
def test_docs_service_demo_runs() -> None:
    """The README's ``make demo`` runs this one too (the other two are in tests/test_examples.py)."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "examples" / "service_demo.py")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "demo: OK" in out.stdout


# ---- the rules of reading and comparing (tests/docs_runner.py) -------------------------------------


def _values(tmp_path: Path) -> Values:
    return Values(home=tmp_path / "home", scratch=tmp_path / "tmp", port=40123)


def test_docs_matching_binds_example_values_and_holds_them(tmp_path: Path) -> None:
    values = _values(tmp_path)
    shown = "PID   PROJECT  CREATED\n4242  app      2026-05-01 12:00:00 UTC\njob ab12cd34ef56\n"
    printed = "PID    PROJECT  CREATED\n31441  app      2026-11-30 16:39:27 CET\njob 4ce97357fce2\n"
    assert matches(shown, printed, values)
    assert values.bound == {"4242": "31441", "ab12cd34ef56": "4ce97357fce2"}
    assert values.into_run("gadget-engine log 4242; cron get ab12cd34ef56") == (
        "gadget-engine log 31441; cron get 4ce97357fce2"
    )
    assert matches("halted 4242\n", "halted 31441\n", values)
    assert not matches("halted 4242\n", "halted 31442\n", values)  # 4242 stands for 31441 now
    assert not matches("exited 0\n", "exited 1\n", values)  # small numbers are compared as they are


def test_docs_matching_ellipsis_times_decimals_durations(tmp_path: Path) -> None:
    values = _values(tmp_path)
    assert matches("a\n...\nz\n", "a\nb\nc\nz\n", values)
    assert matches("a\n...\nz\n", "a\nz\n", values)
    assert matches("took 1.5 s, up 1m5s\n", "took 0.02 s, up 4s\n", values)
    assert matches("Serving on port 8000 ...\n", "Serving on port 8000 (http://x:8000/) ...\n", values)
    assert not matches("a\nz\n", "a\nb\nz\n", values)


def test_docs_real_paths_and_port_read_as_the_pages(tmp_path: Path) -> None:
    values = _values(tmp_path)
    printed = f"{tmp_path}/home/app and {tmp_path}/tmp/x on port 40123\n"
    assert values.from_run(printed) == "/home/me/app and /tmp/x on port 8000\n"
    assert values.into_run("cd /home/me/app; ls /tmp/x; curl :8000") == (
        f"cd {tmp_path}/home/app; ls {tmp_path}/tmp/x; curl :40123"
    )


def test_docs_blocks_commands_and_bounds(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# t\n\n```console\n$ echo a \\\n> b\na b\n$ gadget-engine events -f\n```\n\n"
        "  ```bash\n  # a comment\n  gadget-engine serve\n  ```\n\n```text\n$ rm -rf /\n```\n"
    )
    console, bash, text = read_blocks(page, tmp_path)
    assert [(c.text, c.shown) for c in commands(console)] == [
        ("echo a \\\nb", "a b\n"),
        ("gadget-engine events -f", None),
    ]
    assert [c.text for c in commands(bash)] == ["gadget-engine serve"]
    assert [bounded(c.text) for c in (*commands(console), *commands(bash))] == [False, True, True]
    assert hidden_command(text) is not None
