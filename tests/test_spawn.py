"""Spawn failures (cases.md SP-11) and executable resolution, against the supervisor."""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import pytest
import trio

from engine import SpawnError, SpawnSpec, Supervisor

from .children import open_fds


@pytest.fixture
def sp11(project_dir: Path) -> Path:
    script = project_dir / "script.sh"
    script.write_text("#!/bin/sh\necho hi\n")
    script.chmod(0o644)
    (project_dir / "subdir").mkdir()
    bad = project_dir / "bad-interp.sh"
    bad.write_text("#!/nonexistent/interpreter\necho hi\n")
    bad.chmod(0o755)
    return project_dir


@pytest.mark.serial
@pytest.mark.parametrize(
    ("command", "err", "words"),
    [
        ("definitely-not-a-command-308", errno.ENOENT, ["not found", "definitely-not-a-command-308"]),
        ("./script.sh", errno.EACCES, ["permission denied", "not executable", "./script.sh"]),
        ("./subdir", errno.EACCES, ["permission denied", "is a directory", "./subdir"]),
        ("./bad-interp.sh", errno.ENOENT, ["./bad-interp.sh", "/nonexistent/interpreter", "interpreter"]),
    ],
)
@pytest.mark.serial  # a time bound: measured alone (make test runs the rest two at a time)
async def test_spawn_failure_names_cause_and_path(
    supervisor: Supervisor, sp11: Path, command: str, err: int, words: list[str]
) -> None:
    fds = open_fds()
    log = sp11 / "out.log"
    t0 = time.monotonic()
    with pytest.raises(SpawnError) as info:
        await supervisor.spawn(SpawnSpec(argv=(command,), cwd=str(sp11), stdout=str(log)))
    assert time.monotonic() - t0 < 1.0
    message = str(info.value)
    for word in words:
        assert word in message
    assert "working directory" not in message  # never blames the cwd
    assert info.value.errno == err
    assert info.value.filename == command
    assert supervisor.runs() == []
    assert open_fds() == fds


async def test_spawn_exit_127_is_a_real_exit_not_a_spawn_failure(supervisor: Supervisor, sp11: Path) -> None:
    run = await supervisor.spawn(SpawnSpec(argv=("sh", "-c", "exit 127"), cwd=str(sp11)))
    with trio.fail_after(10):
        result = await run.wait()
    assert (result.exit_code, result.signal) == (127, None)


async def test_spawn_resolves_bare_name_in_child_path(supervisor: Supervisor, tmp_path: Path) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    tool = bindir / "my-tool-329"
    tool.write_text("#!/bin/sh\necho from-my-tool\n")
    tool.chmod(0o755)
    out = tmp_path / "out"
    env = {"PATH": f"{bindir}:{os.environ.get('PATH', '')}"}
    run = await supervisor.spawn(SpawnSpec(argv=("my-tool-329",), env=env, stdout=str(out)))
    with trio.fail_after(10):
        assert (await run.wait()).exit_code == 0
    assert out.read_text() == "from-my-tool\n"


async def test_spawn_shell_command_runs_through_sh(supervisor: Supervisor, tmp_path: Path) -> None:
    out = tmp_path / "out"
    run = await supervisor.spawn(SpawnSpec.shell("printf '%s|' a 'b c'; exit 5", stdout=str(out)))
    with trio.fail_after(10):
        assert (await run.wait()).exit_code == 5
    assert out.read_text() == "a|b c|"


@pytest.mark.parametrize("program", ["true", "./no-such-program", "no-such-program-anywhere"])
@pytest.mark.parametrize("cwd_kind", ["missing", "a file"])
async def test_spawn_in_a_bad_cwd_says_so_whatever_the_program(
    supervisor: Supervisor, tmp_path: Path, program: str, cwd_kind: str
) -> None:
    """The working directory is looked at only when the spawn failed (the child's ``chdir`` fails as its
    exec would); the error still names the directory, not the program, and nothing is left running."""
    cwd = tmp_path / "cwd"
    if cwd_kind == "a file":
        cwd.write_text("not a folder")
    before = len(supervisor.runs())
    with pytest.raises(SpawnError) as caught:
        await supervisor.spawn(SpawnSpec(argv=(program,), cwd=str(cwd)))
    assert caught.value.reason == "bad cwd" and caught.value.errno == errno.ENOENT
    assert "working directory" in str(caught.value) and str(cwd) in str(caught.value)
    assert len(supervisor.runs()) == before
