"""Logs under a project trust nothing there (``engine/_logdir.py``, ``_logs.py``): issue 16, NB-05, NB-09.

A cloned repository may hold a symlinked ``.gadget``; a child (same uid) may swap its log for a link or a
FIFO. The engine follows no link, acts only on the inode it made, and never blocks on a special file.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import threading
import time
from pathlib import Path

import pytest
import trio

from engine import SpawnError, SubProcessNotFoundError, UntrustedPathError
from engine._logdir import LogFolder

from .children import PY, mark, open_fds, pgrep, py, wait_until
from .serve_support import start_serve
from .service_support import engine_at, log_dir, make_project

KiB = 1024


def _digest(path: Path) -> tuple[str, int]:
    return hashlib.sha256(path.read_bytes()).hexdigest(), os.stat(path).st_blocks


# ---- the folder ------------------------------------------------------------------------------------


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o077, 0o277])
def test_log_folder_is_0700_with_a_gitignore_whatever_the_umask(tmp_path: Path, umask: int) -> None:
    project = tmp_path / "p"
    project.mkdir()
    old = os.umask(umask)
    try:
        folder = LogFolder.make(str(project / ".gadget" / "subprocess-logs"), base=str(project))
    finally:
        os.umask(old)
    for path in (project / ".gadget", project / ".gadget" / "subprocess-logs"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700
        assert (path / ".gitignore").read_text().splitlines()[-1] == "*"
    assert folder.made == 2 and folder.wrote_ignores == (1, 2)
    folder.unmake()
    assert os.listdir(project) == []


def test_existing_gadget_folder_gets_no_gitignore_but_the_log_folder_does(tmp_path: Path) -> None:
    project = tmp_path / "p"
    (project / ".gadget").mkdir(parents=True, mode=0o755)
    (project / ".gadget" / "settings.json").write_text("{}")
    LogFolder.make(str(project / ".gadget" / "subprocess-logs"), base=str(project))
    assert sorted(os.listdir(project / ".gadget")) == ["settings.json", "subprocess-logs"]
    assert stat.S_IMODE((project / ".gadget").stat().st_mode) == 0o755  # the user's folder is left as it is
    assert (project / ".gadget" / "subprocess-logs" / ".gitignore").exists()


_ENGINE_IGNORE = "# written by gadget-engine: logs may hold secrets\n*\n"


@pytest.mark.parametrize("kind", ["its own text", "a link to a file", "a negation", "a FIFO", "a hard link"])
def test_a_log_folder_gitignore_that_is_not_the_engines_is_replaced(
    tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by a new user: a repository that committed its own ``.gadget/subprocess-logs/.gitignore``
    (or a link in its place) put the logs, which may hold secrets, into ``git status``."""
    project = tmp_path / "p"
    logs = project / ".gadget" / "subprocess-logs"
    logs.mkdir(parents=True)
    outside = tmp_path / "outside.txt"
    outside.write_text("not the engine's\n")
    ignore = logs / ".gitignore"
    if kind == "its own text":
        ignore.write_text("# keep this folder\n")
    elif kind == "a link to a file":
        ignore.symlink_to(outside)
    elif kind == "a negation":
        ignore.write_text("*\n!*.log\n")
    elif kind == "a hard link":  # the engine's very text, but its other name could change it
        outside.write_text(_ENGINE_IGNORE)
        os.link(outside, ignore)
    else:
        os.mkfifo(ignore)
    folder = LogFolder.make(str(logs), base=str(project))
    assert not ignore.is_symlink() and stat.S_ISREG(ignore.lstat().st_mode)
    assert ignore.read_text() == _ENGINE_IGNORE and stat.S_IMODE(ignore.stat().st_mode) == 0o600
    kept = _ENGINE_IGNORE if kind == "a hard link" else "not the engine's\n"
    assert outside.read_text() == kept and outside.stat().st_nlink == 1  # replaced, never written through
    assert folder.wrote_ignores == ()  # a failed create does not undo a replacement (nor restore the old)
    assert sorted(os.listdir(logs)) == [".gitignore"]  # no temporary file left
    assert "event=gitignore_replaced" in caplog.text


def test_a_log_folder_gitignore_that_is_a_folder_refuses_the_create(tmp_path: Path) -> None:
    project = tmp_path / "p"
    logs = project / ".gadget" / "subprocess-logs"
    (logs / ".gitignore").mkdir(parents=True)
    with pytest.raises(SpawnError, match=r"\.gitignore ignore the logs \(they may hold secrets\)") as caught:
        LogFolder.make(str(logs), base=str(project))
    assert caught.value.reason == "bad log folder"
    assert sorted(os.listdir(logs)) == [".gitignore"]


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
async def test_logs_stay_out_of_git_status_whatever_gitignore_the_repo_committed(tmp_path: Path) -> None:
    project = make_project(tmp_path)
    logs = log_dir(project)
    logs.mkdir(parents=True)
    (logs / ".gitignore").write_text("# keep\n")
    subprocess.run(["git", "init", "-q", project.directory], check=True)
    async with engine_at(tmp_path) as engine:
        sp = await engine.service.create(project, "sh", ["-c", "echo API_KEY=not-a-secret"])
        await sp.wait()
        git_status = ["git", "-C", project.directory, "status", "--porcelain"]
        status = subprocess.run(git_status, capture_output=True, text=True, check=True)
        assert status.stdout == ""  # before: ?? .gadget/
        # Rewritten behind the engine's back while its folder is cached: the next create puts it back.
        (logs / ".gitignore").write_text("!*\n")
        sp = await engine.service.create(project, "true")
        await sp.wait()
        assert (logs / ".gitignore").read_text() == _ENGINE_IGNORE
        await engine.service.kill_all()


@pytest.mark.parametrize(("mode", "refused"), [(0o777, True), (0o775, True), (0o1777, False), (0o755, False)])
def test_a_gadget_folder_others_can_write_in_is_refused(tmp_path: Path, mode: int, refused: bool) -> None:
    """Found by a new user: in a world-writable ``.gadget``, another user moved the log folder away and
    put a link in its place; the engine's kill then left the real logs on disk for good."""
    project = tmp_path / "p"
    gadget = project / ".gadget"
    gadget.mkdir(parents=True)
    os.chmod(gadget, mode)
    logs = gadget / "subprocess-logs"
    if refused:
        with pytest.raises(UntrustedPathError, match=rf"mode {mode:04o}\).*run `chmod go-w {gadget}`"):
            LogFolder.make(str(logs), base=str(project))
        assert os.listdir(gadget) == []  # nothing made
    else:
        LogFolder.make(str(logs), base=str(project))
        assert stat.S_IMODE(logs.stat().st_mode) == 0o700
    assert stat.S_IMODE(gadget.stat().st_mode) == mode  # the user's folder is left as it is


async def test_create_in_a_world_writable_gadget_is_a_clear_error_and_loses_nothing(tmp_path: Path) -> None:
    project = make_project(tmp_path)
    fresh = make_project(tmp_path, "fresh")
    os.mkdir(log_dir(fresh).parent, 0o700)
    os.chmod(log_dir(fresh).parent, 0o777)
    async with engine_at(tmp_path) as engine:
        running = await engine.service.create(project, "sh", ["-c", f"echo up; exec sleep {mark('77.1')}"])
        with pytest.raises(UntrustedPathError, match="can be written by other users"):
            await engine.service.create(fresh, "true")
        assert [sp.pid for sp in engine.service.ps()] == [running.pid]  # the other process goes on
        os.chmod(log_dir(project).parent, 0o777)  # made writable by others after a create: the next sees it
        with pytest.raises(UntrustedPathError, match="can be written by other users"):
            await engine.service.create(project, "true")
        os.chmod(log_dir(project).parent, 0o755)

        async def said_up() -> bool:
            return "up" in await engine.service.get_log(running.pid, "stdout")

        await wait_until(said_up)
        assert os.listdir(log_dir(fresh).parent) == []
        await engine.service.kill_all()


async def test_symlinked_gadget_is_refused_and_its_target_untouched(tmp_path: Path) -> None:
    """Tried: a ``.gadget`` symlink committed in a cloned repository made the engine chmod the target
    0700 and write into it."""
    project = make_project(tmp_path)
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o755)
    (target / "keep.txt").write_text("mine")
    os.symlink(target, Path(project.directory) / ".gadget")
    marker = mark("340.71")
    async with engine_at(tmp_path) as engine:
        with pytest.raises(UntrustedPathError, match=r"\.gadget is a symbolic link"):
            await engine.service.create(project, "sleep", [marker])
        text = await engine.tool.execute({"cmd": "create", "command": "sleep", "args": [marker]}, project)
        assert text.startswith("SUBPROCESS ERROR: ") and "symbolic link" in text
        assert engine.service.ps() == [] and pgrep(f"sleep {marker}") == []
    assert stat.S_IMODE(target.stat().st_mode) == 0o755 and os.listdir(target) == ["keep.txt"]


async def test_symlinked_log_folder_is_refused(tmp_path: Path) -> None:
    project = make_project(tmp_path)
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o755)
    (Path(project.directory) / ".gadget").mkdir()
    os.symlink(target, log_dir(project))
    async with engine_at(tmp_path) as engine:
        with pytest.raises(UntrustedPathError, match="subprocess-logs is a symbolic link"):
            await engine.service.create(project, "true")
    assert stat.S_IMODE(target.stat().st_mode) == 0o755 and os.listdir(target) == []


async def test_gadget_that_is_a_fifo_is_named_as_one(tmp_path: Path) -> None:
    """Found by a new user: a FIFO at ``.gadget`` was called "a file"; the open never blocks on it."""
    project = make_project(tmp_path)
    os.mkfifo(Path(project.directory) / ".gadget")
    async with engine_at(tmp_path) as engine:
        expected = r"\.gadget is a FIFO, not a folder; rename or remove it"
        with trio.fail_after(10), pytest.raises(SpawnError, match=expected) as got:
            await engine.service.create(project, "true")
        assert got.value.reason == "bad log folder"
        assert engine.service.ps() == []


async def test_gadget_that_is_a_file_is_a_usage_error_naming_it(tmp_path: Path) -> None:
    """Tried: a ``.gadget`` that is a file answered ``-32603`` and logged a traceback."""
    project = make_project(tmp_path)
    (Path(project.directory) / ".gadget").write_text("a file")
    async with engine_at(tmp_path) as engine:
        with pytest.raises(SpawnError, match=r"\.gadget is a file, not a folder; rename or remove it") as got:
            await engine.service.create(project, "true")
        assert got.value.reason == "bad log folder"
    served = start_serve(tmp_path / "served")
    try:
        with served.client() as client, pytest.raises(SpawnError, match="is a file, not a folder"):
            client.call("subprocess.create", project=project.directory, command="true")
        result = served.cli("create", "--project", project.directory, "--", "true")
        assert result.returncode == 1 and "is a file, not a folder" in result.stderr
    finally:
        assert served.stop() == 0
    assert "Traceback" not in served.log() and "level=error" not in served.log()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give .gadget to another uid (nobody, 65534)")
async def test_log_folder_of_another_user_is_refused(tmp_path: Path) -> None:
    project = make_project(tmp_path)
    gadget = Path(project.directory) / ".gadget"
    gadget.mkdir()
    os.chown(gadget, 65534, 65534)
    async with engine_at(tmp_path) as engine:
        with pytest.raises(UntrustedPathError, match="owned by uid 65534, not by this engine's uid 0"):
            await engine.service.create(project, "true")
    assert os.listdir(gadget) == []


# ---- the files ---------------------------------------------------------------------------------------

_SWAP = """
import os, sys, time
sys.stdout.write("x" * 200_000 + "\\n"); sys.stdout.flush()
log = os.path.join(".gadget", "subprocess-logs", f"subproc-{{os.getpid()}}.stdout.log")
os.unlink(log)
{swap}
print("swapped", file=sys.stderr, flush=True)
time.sleep({marker})
"""


async def test_log_replaced_by_a_symlink_is_never_capped_nor_read(tmp_path: Path) -> None:
    """Tried: a log replaced by a symlink made the cap punch holes in the target (3 MiB of an outside
    file zeroed) and ``log`` read it."""
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"precious data\n" * (3 * 1024 * 1024 // 14))
    before = _digest(outside)
    project = make_project(tmp_path)
    marker = mark("340.72")
    code = _SWAP.format(swap=f"os.symlink({str(outside)!r}, log)", marker=marker)
    async with engine_at(tmp_path, log_cap_bytes=64 * KiB) as engine:
        sp = await engine.service.create(project, PY, py(code)[1:])
        with trio.fail_after(10):
            while "swapped" not in Path(sp.stderr_path).read_text():
                await trio.sleep(0.05)
        await trio.sleep(2.5)  # two passes of the cap task
        assert _digest(outside) == before
        with pytest.raises(SubProcessNotFoundError, match="no longer the file the engine made"):
            await engine.service.read_log(sp.pid, "stdout", tail=5)
        text = await engine.tool.execute({"cmd": "log", "pid": sp.pid, "which": "stdout"}, project)
        assert text.startswith("SUBPROCESS ERROR: ") and "precious" not in text
        assert (await engine.service.get_log(sp.pid, "stderr")) == "swapped\n"  # the other log is fine
        await engine.service.kill_subprocess(sp)
    assert _digest(outside) == before  # kill removed the link, never its target
    assert sorted(os.listdir(log_dir(project))) == [".gitignore"]


async def test_fifo_in_place_of_a_log_never_blocks_reads_cap_or_halt(tmp_path: Path) -> None:
    """Tried: a child that replaced its log with a FIFO hung every log read, ``halt`` and the cap."""
    project = make_project(tmp_path)
    other = make_project(tmp_path, "other")
    marker = mark("340.73")
    code = _SWAP.format(swap="os.mkfifo(log)", marker=marker)
    async with engine_at(tmp_path, log_cap_bytes=64 * KiB) as engine:
        sp = await engine.service.create(project, PY, py(code)[1:])
        neighbour = await engine.service.create(other, "sh", ["-c", f"echo hello; sleep {marker}"])
        with trio.fail_after(10):
            while "swapped" not in Path(sp.stderr_path).read_text():
                await trio.sleep(0.05)
        with trio.fail_after(3):
            await trio.sleep(1.5)  # the cap passes over the FIFO
            with pytest.raises(SubProcessNotFoundError):
                await engine.service.read_log(sp.pid, "stdout")
            text = await engine.tool.execute({"cmd": "log", "pid": sp.pid, "which": "stdout"}, project)
            assert text.startswith("SUBPROCESS ERROR: ")
            assert await engine.service.get_log(neighbour.pid, "stdout") == "hello\n"
            summary = engine.service.summarize(sp)
            assert summary.state.value == "running"
        with trio.fail_after(5):
            assert await engine.service.halt_pid(sp.pid) is True
        assert stat.S_ISFIFO(os.lstat(sp.stdout_path).st_mode)  # halt keeps what is there
        with trio.fail_after(5):
            await engine.service.kill_pid(sp.pid)
        assert not os.path.lexists(sp.stdout_path)  # the FIFO in the engine's folder went with the kill
    assert pgrep(marker) == []


def test_fifo_log_does_not_stop_serve_from_ending_on_sigterm(tmp_path: Path) -> None:
    project = tmp_path / "app"
    project.mkdir()
    marker = mark("340.74")
    served = start_serve(tmp_path / "state")
    try:
        code = _SWAP.format(swap="os.mkfifo(log)", marker=marker)
        created = served.cli("create", "--project", str(project), "--", *py(code))
        assert created.returncode == 0, created.stderr
        pid = created.stdout.strip()
        stderr_log = project / ".gadget" / "subprocess-logs" / f"subproc-{pid}.stderr.log"
        deadline = time.monotonic() + 10
        while "swapped" not in stderr_log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        started = time.monotonic()
        result = served.cli("log", pid, timeout=10)
        assert result.returncode == 1 and "gone" in result.stderr and time.monotonic() - started < 5
        assert served.cli("list").returncode == 0
        started = time.monotonic()
        assert served.stop() == 0 and time.monotonic() - started < 10
    finally:
        if served.proc.poll() is None:
            served.kill_hard()
    assert pgrep(marker) == [] and "Traceback" not in served.log()


# ---- NB-05 and NB-09 ---------------------------------------------------------------------------------

_NB05 = """
import sys, time
sys.stdout.write("y" * 299_999 + "\\n"); sys.stdout.flush()
i = 0
while True:
    i += 1
    print(f"line {i}", flush=True)
    time.sleep(0.2)
"""


async def test_nb05_reads_after_an_outside_truncation_show_the_new_lines(tmp_path: Path) -> None:
    project = make_project(tmp_path)
    async with engine_at(tmp_path, log_cap_bytes=64 * KiB) as engine:
        sp = await engine.service.create(project, PY, py(_NB05 + f"# {mark('340.75')}")[1:])
        await trio.sleep(3.0)
        first = await engine.service.read_log(sp.pid, "stdout", tail=1)
        assert first.dropped_bytes > 0  # the cap dropped the oldest bytes before the truncation
        os.truncate(sp.stdout_path, 0)
        at_truncation = int(first.text.split()[1])
        await trio.sleep(3.0)
        got = await engine.service.read_log(sp.pid, "stdout", tail=3)
        tool = await engine.tool.execute({"cmd": "log", "pid": sp.pid, "which": "stdout", "tail": 3}, project)
        on_disk = Path(sp.stdout_path).read_bytes().decode()
        assert "y" not in on_disk
        newest = int(on_disk.splitlines()[-1].split()[1])
        for text in (got.text, tool.split("---\n", 1)[1]):
            numbers = [int(line.split()[1]) for line in text.splitlines()[:3]]
            assert len(numbers) == 3 and numbers == list(range(numbers[0], numbers[0] + 3)), text
            assert at_truncation < numbers[0] and newest - 3 <= numbers[-1] <= newest  # written after it
        assert got.next_offset >= first.next_offset  # offsets handed out before still come before
        later = await engine.service.read_log(sp.pid, "stdout", offset=first.next_offset, limit=1000)
        assert later.text.startswith("line ")  # a follower at its old offset reads the new lines
        await engine.service.kill_subprocess(sp)


def test_a_follower_whose_log_is_removed_says_so_and_that_the_process_goes_on(tmp_path: Path) -> None:
    """Found by a new user: ``log -f`` said the process was killed when only its log file was removed."""
    project = tmp_path / "p"
    project.mkdir()
    served = start_serve(tmp_path / "state")
    try:
        made = served.cli(
            "create",
            "--project",
            str(project),
            "--",
            "sh",
            "-c",
            f"while :; do echo line; sleep {mark('0.2')}; done",
        )
        pid = made.stdout.split()[0]
        follower = subprocess.Popen(
            [PY, "-m", "engine", "log", "--state-dir", str(served.state_dir), pid, "-f"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        log = project / ".gadget" / "subprocess-logs" / f"subproc-{pid}.stdout.log"
        time.sleep(1.0)
        log.unlink()
        out, err = follower.communicate(timeout=20)
        assert follower.returncode == 1, err
        (line,) = err.splitlines()
        assert "log of subprocess" in line and "is gone" in line and "still listed, running" in line, line
        assert "was killed" not in line and out.startswith("line")
        assert "running" in served.cli("list").stdout
        assert served.cli("kill", pid).returncode == 0
    finally:
        assert served.stop() == 0


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
@pytest.mark.parametrize("gadget_exists", [False, True])
async def test_nb09_logs_never_show_in_git_status(tmp_path: Path, gadget_exists: bool) -> None:
    project = make_project(tmp_path)
    root = Path(project.directory)
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t"}
    env["GIT_COMMITTER_EMAIL"] = "t@t"

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=root, env=env, capture_output=True, text=True, check=True
        ).stdout

    git("init", "-q")
    (root / "README").write_text("hi\n")
    if gadget_exists:
        (root / ".gadget").mkdir()
        (root / ".gadget" / "notes.md").write_text("tracked\n")
    git("add", "-A")
    git("commit", "-qm", "one")
    async with engine_at(tmp_path) as engine:
        sp = await engine.service.create(project, "sh", ["-c", f"echo TOKEN=abc123; sleep {mark('340.76')}"])
        with trio.fail_after(10):
            while "TOKEN" not in Path(sp.stdout_path).read_text():
                await trio.sleep(0.05)
        assert git("status", "--porcelain", "-uall") == ""
        git("add", "-A")
        assert git("diff", "--cached", "--name-only") == ""
        assert (root / ".gadget" / ".gitignore").exists() is not gadget_exists
        await engine.service.kill_subprocess(sp)


# ---- the inode the engine made -------------------------------------------------------------------------


async def test_cap_and_reads_skip_a_log_replaced_by_another_regular_file(tmp_path: Path) -> None:
    project = make_project(tmp_path)
    async with engine_at(tmp_path, log_cap_bytes=16 * KiB) as engine:
        sp = await engine.service.create(project, "sh", ["-c", f"echo mine; sleep {mark('340.77')}"])
        with trio.fail_after(10):
            while "mine" not in Path(sp.stdout_path).read_text():
                await trio.sleep(0.05)
        impostor = Path(sp.stdout_path + ".new")
        impostor.write_bytes(b"z" * (64 * KiB))
        os.replace(impostor, sp.stdout_path)  # another file under the log's name
        await trio.sleep(1.5)
        assert Path(sp.stdout_path).read_bytes() == b"z" * (64 * KiB)  # never capped: not ours
        with pytest.raises(SubProcessNotFoundError):
            await engine.service.get_log(sp.pid, "stdout")
        await engine.service.kill_subprocess(sp)
        assert Path(sp.stdout_path).exists()  # a regular file the engine did not make is left alone


# ---- the folder cache: walked once, checked again at each create -------------------------------------


async def test_cached_log_folder_moved_and_replaced_by_a_symlink_is_not_followed(tmp_path: Path) -> None:
    """The service keeps each project's log folder open after the first walk (``FolderCache``); a folder
    moved away and replaced by a link to it is refused as a walk refuses it, and no file goes into it."""
    project = make_project(tmp_path)
    async with engine_at(tmp_path) as engine:
        for _ in range(3):  # made, walked and cached, then from the cache
            sp = await engine.service.create(project, "true")
            await sp.wait()
        await engine.service.kill_all()
        moved = tmp_path / "moved-logs"
        os.rename(log_dir(project), moved)
        os.symlink(moved, log_dir(project))
        with pytest.raises(UntrustedPathError, match="subprocess-logs is a symbolic link"):
            await engine.service.create(project, "true")
        assert engine.service.ps() == []
    assert os.listdir(moved) == [".gitignore"]


async def test_cached_gadget_folder_replaced_by_a_symlink_is_not_followed(tmp_path: Path) -> None:
    project = make_project(tmp_path)
    target = tmp_path / "elsewhere"
    async with engine_at(tmp_path) as engine:
        for _ in range(3):
            sp = await engine.service.create(project, "true")
            await sp.wait()
        await engine.service.kill_all()
        os.rename(Path(project.directory) / ".gadget", target)
        os.symlink(target, Path(project.directory) / ".gadget")
        with pytest.raises(UntrustedPathError, match=r"\.gadget is a symbolic link"):
            await engine.service.create(project, "true")
    assert sorted(os.listdir(target / "subprocess-logs")) == [".gitignore"]


def _made_log_folder(tmp_path: Path) -> tuple[Path, Path]:
    """A project folder ``p`` and its log folder, made as the engine makes it."""
    project = tmp_path / "p"
    project.mkdir()
    logs = project / ".gadget" / "subprocess-logs"
    LogFolder.make(str(logs), base=str(project))
    return project, logs


def _cache_threads() -> list[threading.Thread]:
    """The folder caches' threads alive now."""
    return [t for t in threading.enumerate() if t.name == "engine log files"]


def test_folder_cache_checks_again_and_restores_mode_and_gitignore(tmp_path: Path) -> None:
    from engine._folder_cache import FolderCache
    from engine._logpair import make_unnamed

    project, logs = _made_log_folder(tmp_path)
    cache = FolderCache()
    before = open_fds()
    folder, fd, spare = cache.open(str(logs), base=str(project))  # walked, kept
    os.close(fd)
    assert spare == [] and folder.identity == (logs.stat().st_dev, logs.stat().st_ino)
    cache.prepare(str(logs), base=str(project), make=make_unnamed, count=2)
    assert os.listdir(logs) == [".gitignore"]  # the files made ahead have no name
    os.chmod(logs, 0o755)
    (logs / ".gitignore").unlink()
    folder, fd, spare = cache.open(str(logs), base=str(project))  # from the cache, checked again
    os.close(fd)
    assert len(spare) == 2 and folder.wrote_ignores == (2,)  # written again: a failed create undoes it
    for opened, _ in spare:
        os.close(opened)
    assert stat.S_IMODE(logs.stat().st_mode) == 0o700 and (logs / ".gitignore").exists()
    cache.prepare(str(logs), base=str(project), make=make_unnamed, count=2)
    shutil.rmtree(logs)  # gone: the check fails, the files made ahead are closed, the walk makes it again
    folder, fd, spare = cache.open(str(logs), base=str(project))
    os.close(fd)
    assert spare == [] and folder.made == 1 and (logs / ".gitignore").exists()
    cache.close()
    assert open_fds() == before


@pytest.mark.parametrize("slow", [True, False])
def test_folder_cache_in_the_background_makes_the_files_ahead_in_its_thread_while_slow(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, slow: bool
) -> None:
    """With ``background``, once making a file took longer than ``SLOW_FILE_SECONDS``, ``prepare`` returns
    at once and the cache's thread makes the files (unnamed, 0600, in the very folder); the next ``open``
    hands them over; ``close`` ends the thread and closes what it made, also a job still queued or under
    way: no descriptor and no thread is left. While files are fast to make, no thread is started."""
    from engine import _folder_cache
    from engine._folder_cache import FolderCache
    from engine._logpair import make_unnamed

    monkeypatch.setattr(_folder_cache, "SLOW_FILE_SECONDS", -1.0 if slow else 10.0)

    project, logs = _made_log_folder(tmp_path)
    before = open_fds()
    cache = FolderCache(background=True)
    folder, fd, spare = cache.open(str(logs), base=str(project))
    os.close(fd)
    assert spare == []
    ident = (logs.stat().st_dev, logs.stat().st_ino)
    for _ in range(3):
        cache.prepare(str(logs), base=str(project), make=make_unnamed, count=2)
        cache.prepare(str(logs), base=str(project), make=make_unnamed, count=2)  # no second job
        deadline = time.monotonic() + 10
        while True:
            folder, fd, spare = cache.open(str(logs), base=str(project))
            os.close(fd)
            if spare or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        assert len(spare) == 2 and folder.identity == ident
        for opened, identity in spare:
            info = os.fstat(opened)
            assert (info.st_dev, info.st_ino) == identity and stat.S_IMODE(info.st_mode) == 0o600
            assert info.st_nlink == 0  # unnamed
            os.close(opened)
    assert bool(_cache_threads()) == slow
    assert os.listdir(logs) == [".gitignore"]
    cache.prepare(str(logs), base=str(project), make=make_unnamed, count=2)  # queued or under way: closed
    cache.close()
    assert not _cache_threads()
    assert open_fds() == before
    folder, fd, spare = cache.open(str(logs), base=str(project))  # usable again after close
    os.close(fd)
    cache.prepare(str(logs), base=str(project), make=make_unnamed, count=2)
    cache.close()
    assert open_fds() == before


def test_folder_cache_released_keeps_its_thread_and_no_descriptor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``release`` (the service's last record removed) closes every folder and file made ahead at once,
    also what the thread is making then (closed once made: their entry is closed), but keeps the thread,
    idle, for the next ``prepare``: the same thread serves every round. ``close`` then ends it."""
    from engine import _folder_cache
    from engine._folder_cache import FolderCache
    from engine._logpair import make_unnamed

    monkeypatch.setattr(_folder_cache, "SLOW_FILE_SECONDS", -1.0)
    project, logs = _made_log_folder(tmp_path)
    before = open_fds()
    cache = FolderCache(background=True)
    threads: set[threading.Thread] = set()
    for _ in range(3):
        _, fd, _ = cache.open(str(logs), base=str(project))
        os.close(fd)
        cache.prepare(str(logs), base=str(project), make=make_unnamed, count=1)  # made here: found slow
        cache.prepare(str(logs), base=str(project), make=make_unnamed, count=50)  # under way at release
        threads.update(_cache_threads())
        cache.release()
        deadline = time.monotonic() + 10
        while open_fds() != before and time.monotonic() < deadline:
            time.sleep(0.01)
        assert open_fds() == before
        assert len(threads) == 1 and _cache_threads() == list(threads)
    assert os.listdir(logs) == [".gitignore"]
    cache.close()
    assert not _cache_threads()
    assert open_fds() == before


def test_a_crash_after_create_leaves_no_unnamed_log_on_disk(tmp_path: Path) -> None:
    """Files made ahead (``FolderCache.prepare``) and a pair created but never named have no name: a
    process that dies there leaves nothing in the log folder."""
    project = tmp_path / "p"
    project.mkdir()
    logs = project / ".gadget" / "subprocess-logs"
    code = (
        "import os, sys\n"
        "from engine._folder_cache import FolderCache\n"
        "from engine._logpair import LogPair\n"
        "cache = FolderCache()\n"
        "d, base = sys.argv[1], sys.argv[2]\n"
        "for _ in range(2):\n"
        "    pair = LogPair.create(d, base=base, folders=cache)\n"
        "    LogPair.prepare(d, base=base, folders=cache)\n"
        "with pair.open_for_child() as (out, err):\n"
        "    os.write(out, b'written, never named')\n"
        "os.kill(os.getpid(), 9)\n"
    )
    done = subprocess.run([PY, "-c", code, str(logs), str(project)], check=False, timeout=60)
    assert done.returncode == -9
    assert os.listdir(logs) == [".gitignore"]


def test_folder_cache_hands_out_only_the_files_asked_for_and_keeps_the_rest(tmp_path: Path) -> None:
    """Two pairs made ahead: each create takes one pair, the next pair waits for the next create."""
    from engine._folder_cache import FolderCache
    from engine._logpair import make_unnamed

    project, logs = _made_log_folder(tmp_path)
    cache = FolderCache()
    before = open_fds()
    _, fd, _ = cache.open(str(logs), base=str(project))
    os.close(fd)
    cache.prepare(str(logs), base=str(project), make=make_unnamed, count=4)
    taken = []
    for _ in range(2):
        _, fd, spare = cache.open(str(logs), base=str(project), want=2)
        os.close(fd)
        assert len(spare) == 2
        taken.extend(spare)
    _, fd, spare = cache.open(str(logs), base=str(project), want=2)
    os.close(fd)
    assert spare == []
    assert len({identity for _, identity in taken}) == 4  # four distinct files, none handed out twice
    for opened, _ in taken:
        os.close(opened)
    cache.close()
    assert open_fds() == before
