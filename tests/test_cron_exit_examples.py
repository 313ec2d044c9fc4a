"""The docs' on-exit examples wake their reader however fast the command exits.

Every example that adds an on-exit job (a Python block of README.md or docs/*.md, a file of docs/examples)
runs here with ``CronService.add`` returning only once that job's event was delivered, as it does when
the command exits before ``add`` returns (the pages' ``pytest -q`` is slow enough not to). An example that
starts looking for its job's fire once it knows the job id skips the fire and waits for ever; one whose
fires were kept from the start finds it. (tests/test_docs.py and tests/test_examples.py run them as
written; the pages' test run is ``echo 1 passed`` here: how it ends is not the point.)
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from .children import SESSION, kill_pids, pgrep_env
from .docs_runner import Values, read_blocks

ROOT = Path(__file__).parent.parent
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
EXAMPLES = sorted((ROOT / "docs" / "examples").glob("*.py"))
#: How long one example may take with its fire there before ``add`` returned, in seconds.
EXAMPLE_SECONDS = 40.0
#: Inherited by every process an example starts (its engine's children too): found by it, and ended.
RUN_VAR = "GADGET_TEST_EXAMPLE_RUN"
LATE = "add returned after its on-exit job's event was delivered"

#: Runs the example at ``argv[1]`` (its own arguments after it) with ``CronService.add`` made late.
RUNNER = f"""
import runpy
import sys

import trio

from engine import OnExit
from engine.cron._service import CronService

add = CronService.add


async def delivered(service, job_id):
    logged = {{event.cursor for event in await service.store.events(0) if event.job_id == job_id}}
    waiting = {{event.cursor for event in await service.store.unacked_events()}}
    return bool(logged) and not logged & waiting


async def late_add(self, schedule, payload, **changes):
    job = await add(self, schedule, payload, **changes)
    if isinstance(schedule, OnExit):
        with trio.fail_after(30):
            while not await delivered(self, job.id):
                await trio.sleep(0.02)
        print({LATE!r}, file=sys.stderr, flush=True)
    return job


CronService.add = late_add
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _on_exit_examples() -> dict[str, str]:
    """Where each on-exit example is (``page:line`` or a file's path) -> its program."""
    found = {
        block.where: block.text
        for page in PAGES
        for block in read_blocks(ROOT / page, ROOT)
        if block.kind == "python" and "OnExit(" in block.text
    }
    for path in EXAMPLES:
        if "OnExit(" in (text := path.read_text()):
            found[str(path.relative_to(ROOT))] = text
    return found


EXAMPLES_FOUND = _on_exit_examples()


def test_cron_exit_examples_are_all_found() -> None:
    pages = {where.partition(":")[0] for where in EXAMPLES_FOUND}
    assert {
        "README.md",
        "docs/guide-on-exit.md",
        "docs/tutorial.md",
        "docs/examples/on_exit_example.py",
    } <= pages


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture
def short_tmp_path() -> Iterator[Path]:
    """A scratch folder with a short path (a state directory's socket must fit ``sun_path``)."""
    base = Path(tempfile.mkdtemp(prefix=f"gx{SESSION}-", dir="/tmp"))
    yield base
    shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("where", sorted(EXAMPLES_FOUND))
def test_cron_exit_example_finds_a_fire_that_came_before_add_returned(
    where: str, short_tmp_path: Path
) -> None:
    home, scratch = short_tmp_path / "home", short_tmp_path / "tmp"
    app = home / "app"
    app.mkdir(parents=True)
    scratch.mkdir()
    values = Values(home=home, scratch=scratch, port=_free_port())
    program = short_tmp_path / "example.py"
    program.write_text(values.into_run(EXAMPLES_FOUND[where].replace('"pytest -q"', '"echo 1 passed"')))
    runner = short_tmp_path / "late_add.py"
    runner.write_text(RUNNER)
    env = {key: value for key, value in os.environ.items() if not key.startswith(("XDG_", "PYTEST_"))}
    env.update(HOME=str(home), PYTHONPATH=str(ROOT), **{RUN_VAR: str(short_tmp_path)})
    try:
        out = subprocess.run(
            [sys.executable, str(runner), str(program), str(scratch / "state")],
            cwd=app,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=EXAMPLE_SECONDS,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"{where}: still waiting for its fire after {EXAMPLE_SECONDS:g} s") from exc
    finally:
        kill_pids(pgrep_env(RUN_VAR, str(short_tmp_path)))  # what a hung example's engine left
    assert out.returncode == 0, f"{where}:\n{out.stdout}\n{out.stderr}"
    assert LATE in out.stderr, where  # the example did wait for an on-exit job's fire
