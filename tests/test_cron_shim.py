"""The exit-recording shim (``engine/cron/_shim.bin``, compiled from ``_shim.c`` at install time; else
``_shim.pl``, where it was not built; and ``_shim.py``, the fallback when no perl is found either): how the
command ended, recorded and passed on the same way by all three; on a full disk, the command's exit code
is its own.

Tried: with the state dir full, an on-exit command that exited 0 was reported as exit 120 (the shim's
own failure). The full disk is a small tmpfs the test mounts (as root; skipped with the reason where
``mount`` is not allowed). Every shim test runs every shim; the compiled one must have been built
wherever a C compiler is found (a broken build fails here rather than falling back quietly).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import pytest
import trio

from engine import EngineConfig, OnExit, SystemEvent, open_engine
from engine.cron import _shell
from engine.cron._exit_record import read_exit_record

from .children import mark, pgrep_env

#: The three shims' argv prefixes: compiled (the default where it was built), Perl and Python (the fallbacks).
SHIMS = {
    "c": (_shell.SHIM_BIN,),
    "pl": (_shell.find_perl() or "perl", "-t", _shell.SHIM_PL),
    "py": (sys.executable, "-I", "-S", _shell.SHIM_PY),
}


def c_compiler() -> str | None:
    """The C compiler ``setup.py`` would use (``$CC``, else cc, gcc or clang on PATH), or ``None``."""
    if os.environ.get("CC", "").strip():
        return os.environ["CC"]
    return next((found for name in ("cc", "gcc", "clang") if (found := shutil.which(name))), None)


@pytest.fixture(params=sorted(SHIMS))
def kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which shim the test runs: ``c``, ``pl`` or ``py``; an engine in this test uses the same one (``pl``:
    as when no compiler was found at install time; ``py``: and no perl either)."""
    name: str = request.param
    if name == "c" and _shell.find_compiled_shim() is None:
        pytest.skip("no compiled shim (no C compiler at install time): the pl and py cases test the others")
    if name == "pl" and _shell.find_perl() is None:
        pytest.skip("no perl on PATH: engines here use the Python shim, which the py case tests")
    if name in ("pl", "py"):
        monkeypatch.setattr(_shell, "find_compiled_shim", lambda: None)
    if name == "py":
        monkeypatch.setattr(_shell, "find_perl", lambda: None)
    return name


def test_the_compiled_shim_is_built_wherever_a_c_compiler_is_found() -> None:
    if c_compiler() is None:
        pytest.skip("no C compiler on PATH: the engine runs the Perl or Python shim")
    folder = os.path.dirname(_shell.SHIM_BIN)
    assert os.path.exists(_shell.SHIM_BIN), (
        f"{_shell.SHIM_BIN} is missing although a C compiler is found: the install's build step "
        "(setup.py build_shim) failed; run `rm -f .venv/.installed-stamp; make setup` and read its warning"
    )
    assert _shell.find_compiled_shim() == _shell.SHIM_BIN, (
        f"{_shell.SHIM_BIN} is built but not run: it or its folder is writable by group or others, or "
        f"owned by another user (`chmod go-w {folder} {_shell.SHIM_BIN}` as their owner)"
    )
    assert _shell.shim_argv("x", ("y",)) == (_shell.SHIM_BIN, "x", "--", "y")


def _dynamically_linked(path: str | Path) -> bool:
    """Whether the ELF executable at ``path`` names a program interpreter (``PT_INTERP``: the dynamic
    loader); a static one does not."""
    data = Path(path).read_bytes()
    assert data[:4] == b"\x7fELF" and data[4] == 2, f"{path} is not a 64-bit ELF file"
    order: Literal["little", "big"] = "little" if data[5] == 1 else "big"
    phoff = int.from_bytes(data[0x20:0x28], order)
    phentsize = int.from_bytes(data[0x36:0x38], order)
    phnum = int.from_bytes(data[0x38:0x3A], order)
    types = [
        int.from_bytes(data[phoff + i * phentsize : phoff + i * phentsize + 4], order) for i in range(phnum)
    ]
    return 3 in types  # PT_INTERP


def _links_statically(compiler: str, folder: Path) -> bool:
    source = folder / "probe.c"
    source.write_text("int main(void) { return 0; }\n")
    done = subprocess.run(
        [compiler, "-static", "-o", str(folder / "probe"), str(source)], capture_output=True, check=False
    )
    return done.returncode == 0


def test_the_compiled_shim_is_linked_statically_where_the_c_library_allows_it(tmp_path: Path) -> None:
    compiler = c_compiler()
    if compiler is None or _shell.find_compiled_shim() is None:
        pytest.skip("no C compiler on PATH: the engine runs the Perl or Python shim")
    # No dynamic loader's work before the command starts (about 0.3 ms of CPU per watched command here).
    assert _dynamically_linked(_shell.SHIM_BIN) is not _links_statically(compiler, tmp_path)


def test_the_shim_is_built_linked_dynamically_where_no_static_c_library_is_installed(tmp_path: Path) -> None:
    compiler = c_compiler()
    if compiler is None:
        pytest.skip("no C compiler on PATH: nothing is compiled")
    refusing = tmp_path / "cc"
    refusing.write_text(
        "#!/bin/sh\n"
        'for a in "$@"; do [ "$a" = -static ] && { echo "no static C library (test)" >&2; exit 1; }; done\n'
        f'exec {compiler} "$@"\n'
    )
    refusing.chmod(0o755)
    root = Path(__file__).resolve().parent.parent
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "wheel"), str(root)],
        env={**os.environ, "CC": str(refusing)},
        capture_output=True,
        text=True,
        check=False,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "wheel").glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        shim = archive.read("engine/cron/_shim.bin")
    (tmp_path / "shim").write_bytes(shim)
    assert _dynamically_linked(tmp_path / "shim")


@pytest.mark.parametrize("mode", [0o775, 0o757, 0o644])
def test_a_compiled_shim_others_can_write_or_not_executable_is_not_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: int
) -> None:
    planted = tmp_path / "_shim.bin"
    if _shell.find_compiled_shim() is not None:
        shutil.copy(_shell.SHIM_BIN, planted)
    else:
        planted.write_text("#!/bin/sh\n")
    monkeypatch.setattr(_shell, "SHIM_BIN", str(planted))
    monkeypatch.setattr(_shell, "_HERE", str(tmp_path))
    tmp_path.chmod(0o755)
    planted.chmod(0o755)
    assert _shell.find_compiled_shim() == str(planted)  # the copy alone is fine
    planted.chmod(mode)
    assert _shell.find_compiled_shim() is None
    assert _shell.shim_argv("x", ("y",))[0] != str(planted)
    planted.chmod(0o755)
    tmp_path.chmod(0o777 | stat.S_ISVTX)  # a folder others can write to (a sticky /tmp-like one too)
    assert _shell.find_compiled_shim() is None
    tmp_path.chmod(0o755)
    link = tmp_path / "link"
    link.symlink_to(planted)
    monkeypatch.setattr(_shell, "SHIM_BIN", str(link))
    assert _shell.find_compiled_shim() is None  # a symbolic link is not followed


def fill(folder: Path) -> Path:
    """Write a file in ``folder`` until the filesystem is full; the file."""
    filler = folder / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return filler


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs (mode 0700) mounted for this test."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs as a full disk")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def shim(kind: str, exit_file: Path, *command: str) -> subprocess.Popen[str]:
    """The ``kind`` shim running ``command``, in a session of its own (so a failing test ends its whole
    group)."""
    return subprocess.Popen(
        [*SHIMS[kind], str(exit_file), "--", *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def end_group(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=10)


def test_shim_records_the_exit_in_reserved_space_when_the_disk_fills_meanwhile(
    kind: str, small_disk: Path, tmp_path: Path
) -> None:
    go = tmp_path / "go"
    proc = shim(
        kind, small_disk / "exit.json", "sh", "-c", f"while [ ! -e {go} ]; do sleep 0.02; done; exit 3"
    )
    try:
        deadline = time.monotonic() + 10
        while not any(name.startswith("exit.json.tmp.") for name in os.listdir(small_disk)):
            assert time.monotonic() < deadline, "the shim made no reserve"
            time.sleep(0.02)
        fill(small_disk)
        go.touch()
        _, err = proc.communicate(timeout=10)
    finally:
        end_group(proc)
    assert proc.returncode == 3 and err == ""
    record = json.loads((small_disk / "exit.json").read_text())
    assert record["exit_code"] == 3


def test_shim_ends_with_the_commands_status_when_nothing_can_be_recorded(kind: str, small_disk: Path) -> None:
    fill(small_disk)
    for code in (0, 7):
        proc = shim(kind, small_disk / "exit.json", "sh", "-c", f"exit {code}")
        try:
            _, err = proc.communicate(timeout=10)
        finally:
            end_group(proc)
        assert proc.returncode == code, err  # never Python's 120 for a failed flush, never 1
        assert "could not be recorded" in err and "the command's own status" in err
        assert not (small_disk / "exit.json").exists()


async def test_on_exit_job_on_a_full_state_dir_fires_with_the_commands_own_exit_code(
    kind: str, small_disk: Path, tmp_path: Path
) -> None:
    go = tmp_path / "go"
    marker = mark("340.91")
    config = EngineConfig(
        state_dir=str(small_disk / "state"),
        grace_seconds=0.3,
        kill_wait_seconds=2.0,
        exit_watch_shell=("bash", "-c", "--"),
        watch_retry_seconds=(0.2,),  # type: ignore[arg-type]  # attrs converter=tuple: mypy sees Iterable[_T_co]
    )
    command = f"while [ ! -e {go} ]; do sleep 0.02; done; echo done-{marker}; exit 0"
    async with open_engine(config) as engine:
        job = await engine.cron.add(OnExit(command=command, cwd=str(tmp_path)), SystemEvent("finished"))
        with trio.fail_after(10):
            while not pgrep_env("GADGET_WATCH_COMMAND", f"done-{marker}"):
                await trio.sleep(0.05)
            while (await engine.cron.get(job.id)).enabled and not engine.watchers.active_job_ids():
                await trio.sleep(0.05)
        await trio.sleep(0.3)  # the watch state is saved
        filler = fill(small_disk)
        go.touch()
        await trio.sleep(2.0)
        assert await engine.cron.events() == []  # fail closed while the store cannot be written
        filler.unlink()
        with trio.fail_after(15):
            while not (events := await engine.cron.events()):
                await trio.sleep(0.1)
        (event,) = events
        assert event.exit_code == 0 and event.signal is None, event
        assert event.job_id == job.id


def run_shim(kind: str, exit_file: Path, *command: str) -> tuple[int, str, str, dict[str, object]]:
    """Run ``command`` under the ``kind`` shim to its end: the shim's return code, stdout, stderr, record."""
    proc = shim(kind, exit_file, *command)
    try:
        out, err = proc.communicate(timeout=10)
    finally:
        end_group(proc)
    record = read_exit_record(str(exit_file)).record
    assert record is not None, err
    return proc.returncode, out, err, record


@pytest.mark.parametrize(
    ("script", "returncode", "outcome"),
    [
        ("exit 0", 0, ("exit_code", 0)),
        ("exit 3", 3, ("exit_code", 3)),
        ("exit 130", 130, ("exit_code", 130)),  # not SIGINT, although a shell's $? says 130 for both
        ("exit 143", 143, ("exit_code", 143)),
        ("kill -INT $$", -2, ("signal", 2)),
        ("kill -TERM $$", -15, ("signal", 15)),
        ("kill -SEGV $$", -11, ("signal", 11)),
        ("kill -KILL $$", -9, ("signal", 9)),
        ("kill -USR1 $$", -10, ("signal", 10)),
    ],
)
def test_shim_records_how_the_command_ended_and_ends_the_same_way(
    kind: str, tmp_path: Path, script: str, returncode: int, outcome: tuple[str, int]
) -> None:
    exit_file = tmp_path / "exit.json"
    before = time.time()
    code, _, err, record = run_shim(kind, exit_file, "sh", "-c", script)
    assert code == returncode and err == ""
    key, value = outcome
    assert record[key] == value and ({"exit_code", "signal"} - {key}).isdisjoint(record)
    assert isinstance(record["pid"], int) and record["pid"] > 0
    ended_at = record["ended_at"]
    assert isinstance(ended_at, float) and before <= ended_at <= time.time()
    assert [p.name for p in tmp_path.iterdir()] == ["exit.json"]  # no temp file left


@pytest.mark.parametrize("name", ["INT", "TERM", "QUIT", "HUP"])
def test_shim_outlives_a_signal_to_the_group_and_records_it(kind: str, tmp_path: Path, name: str) -> None:
    number = int(getattr(signal, f"SIG{name}"))
    ready = tmp_path / "ready"
    exit_file = tmp_path / "exit.json"
    proc = shim(kind, exit_file, "sh", "-c", f"touch {ready}; while :; do sleep 0.02; done")
    try:
        deadline = time.monotonic() + 10
        while not ready.exists():
            assert time.monotonic() < deadline, "the command did not start"
            time.sleep(0.01)
        os.killpg(proc.pid, number)  # the whole group: the shim and its command
        _, err = proc.communicate(timeout=10)
    finally:
        end_group(proc)
    assert proc.returncode == -number, err
    record = read_exit_record(str(exit_file)).record
    assert record is not None and record["signal"] == number and "exit_code" not in record


def test_the_command_runs_with_default_signal_dispositions(kind: str, tmp_path: Path) -> None:
    _, out, _, _ = run_shim(kind, tmp_path / "exit.json", "grep", "-E", "^Sig(Ign|Blk):", "/proc/self/status")
    masks = {line.split(":")[0]: int(line.split()[1], 16) for line in out.splitlines()}
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGQUIT, signal.SIGHUP, signal.SIGPIPE, signal.SIGXFSZ):
        bit = 1 << (int(sig) - 1)
        assert not masks["SigIgn"] & bit and not masks["SigBlk"] & bit, (sig, masks)


def test_the_command_gets_its_argv_stdin_and_environment_as_given(kind: str, tmp_path: Path) -> None:
    args = ["a b", "", "$HOME", "it's", '"q"', "-n", "l1\nl2", "*", "\\", "--"]
    env_script = "import os, sys; print(repr((sys.argv[1:], sys.stdin.read(), os.environ.get('SHLVL'), "
    env_script += "os.environ.get('GADGET_SHIM_PROBE'), os.environ.get('BASH_ENV'))))"
    environ = {**os.environ, "SHLVL": "4", "GADGET_SHIM_PROBE": "x y", "BASH_ENV": str(tmp_path / "env.sh")}
    (tmp_path / "env.sh").write_text(f"touch {tmp_path}/bash_env_ran\n")
    proc = subprocess.run(
        [
            *SHIMS[kind],
            str(tmp_path / "exit.json"),
            "--",
            sys.executable,
            "-I",
            "-S",
            "-c",
            env_script,
            *args,
        ],
        input="from stdin\n",
        capture_output=True,
        text=True,
        env=environ,
        timeout=10,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == repr((args, "from stdin\n", "4", "x y", str(tmp_path / "env.sh"))) + "\n"
    assert not (tmp_path / "bash_env_ran").exists()  # no shell of ours reads BASH_ENV (the command may)


def test_a_reserved_record_reads_back_with_its_padding(kind: str, tmp_path: Path) -> None:
    exit_file = tmp_path / "exit.json"
    _, _, _, record = run_shim(kind, exit_file, "true")
    assert record["exit_code"] == 0
    assert exit_file.read_bytes().lstrip().startswith(b"{")


@pytest.mark.parametrize(
    ("command", "exit_code", "number"), [("exit 130", 130, None), ("kill -TERM $$", None, 15)]
)
async def test_an_on_exit_job_fires_what_either_shim_recorded(
    kind: str, tmp_path: Path, command: str, exit_code: int | None, number: int | None
) -> None:
    assert _shell.shim_argv("x", ("y",)) == (*SHIMS[kind], "x", "--", "y")  # the shim the engine runs
    config = EngineConfig(state_dir=str(tmp_path / "state"), exit_watch_shell=("bash", "-c", "--"))
    async with open_engine(config) as engine:
        await engine.cron.add(OnExit(command=command, cwd=str(tmp_path)), SystemEvent("finished"))
        with trio.fail_after(15):
            while not (events := await engine.cron.events()):
                await trio.sleep(0.05)
    (event,) = events
    assert (event.exit_code, event.signal) == (exit_code, number), event
    assert event.stderr_tail == ""


def test_a_command_that_cannot_run_is_recorded_as_exit_127(kind: str, tmp_path: Path) -> None:
    missing = str(tmp_path / "no-such-program")
    code, _, err, record = run_shim(kind, tmp_path / "exit.json", missing, "arg")
    assert code == 127 and f"cannot run {missing!r}" in err
    assert record["pid"] is None and record["exit_code"] == 127


def test_the_shim_ignores_the_interpreters_startup_variables_and_a_path_taint_mode_dislikes(
    kind: str, tmp_path: Path
) -> None:
    environ = {
        **os.environ,
        "PATH": f".:relative/bin:/tmp:{os.environ['PATH']}",  # relative and world-writable folders
        "PERL5OPT": "-MNoSuchModuleOfGadget",
        "PERL5LIB": str(tmp_path),
        "PYTHONSTARTUP": str(tmp_path / "nothing.py"),
    }
    proc = subprocess.run(
        [*SHIMS[kind], str(tmp_path / "exit.json"), "--", "sh", "-c", "echo ran; exit 4"],
        capture_output=True,
        text=True,
        env=environ,
        timeout=10,
        check=False,
    )
    assert (proc.returncode, proc.stdout, proc.stderr) == (4, "ran\n", "")
    record = read_exit_record(str(tmp_path / "exit.json")).record
    assert record is not None and record["exit_code"] == 4
