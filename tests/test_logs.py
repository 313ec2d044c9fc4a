"""Log files: paging reads, UTF-8 handling, the cap by hole punching and its copy fallback; SP-07."""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import tempfile
import time
from pathlib import Path

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from engine import LogSlice, _logpair
from engine._logpair import LogPair
from engine._logs import LogFile, check_stream, final_log_paths

from .children import py
from .service_support import engine_at, make_project

MiB = 2**20


def _log(tmp_path: Path, data: bytes, name: str = "x.log") -> LogFile:
    path = tmp_path / name
    path.write_bytes(data)
    return LogFile(str(path))


def _read(log: LogFile, **kw: int) -> LogSlice:
    args: dict[str, int | None] = {"offset": None, "limit": None, "tail": None}
    max_bytes = kw.pop("max_bytes", 32768)
    args.update(kw)
    return log.read(offset=args["offset"], limit=args["limit"], tail=args["tail"], max_bytes=max_bytes)


# ---- names and streams ------------------------------------------------------------------------------


def test_log_names_follow_the_spec() -> None:
    assert final_log_paths("/p/.gadget/subprocess-logs", 12345) == (
        "/p/.gadget/subprocess-logs/subproc-12345.stdout.log",
        "/p/.gadget/subprocess-logs/subproc-12345.stderr.log",
    )
    assert final_log_paths("/d", 7, 2) == ("/d/subproc-7-2.stdout.log", "/d/subproc-7-2.stderr.log")


def test_check_stream_names_allowed_values() -> None:
    assert check_stream("stderr") == "stderr"
    for bad in ("STDOUT", "", None, 1):
        try:
            check_stream(bad)
        except ValueError as exc:
            assert '"stdout" or "stderr"' in str(exc)
        else:
            raise AssertionError(bad)


# ---- the pair -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("unnamed", [True, False], ids=["O_TMPFILE", "temporary names"])
def test_log_pair_create_rename_read_delete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, unnamed: bool
) -> None:
    if not unnamed:  # a filesystem without O_TMPFILE: temporary names, renamed

        def no_tmpfile(folder_fd: int) -> tuple[int, tuple[int, int]]:
            raise OSError(errno.EOPNOTSUPP, "O_TMPFILE is not supported here")

        monkeypatch.setattr(_logpair, "make_unnamed", no_tmpfile)
    folder = tmp_path / "project" / ".gadget" / "subprocess-logs"
    pair = LogPair.create(str(folder))
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    if unnamed:
        assert os.listdir(folder) == [".gitignore"]  # no name at all until the pid is known
    else:
        assert all(os.path.basename(p).startswith(".subproc-") for p in pair.paths)
        assert all(stat.S_IMODE(os.stat(p).st_mode) == 0o600 for p in pair.paths)
    with pair.open_for_child() as fds:
        assert all(stat.S_IMODE(os.fstat(fd).st_mode) == 0o600 for fd in fds)
        if unnamed:  # never inherited by another child than the one they are handed to
            assert all(fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC for fd in fds)
        out = os.dup(fds[0])  # the child's copy
    try:  # the child's descriptor follows the naming
        pair.rename(4242)
        os.write(out, b"one\ntwo\n")
    finally:
        os.close(out)
    assert pair.paths == final_log_paths(str(folder), 4242)
    assert sorted(os.listdir(folder)) == [".gitignore", "subproc-4242.stderr.log", "subproc-4242.stdout.log"]
    assert pair.read("stdout").text == "one\ntwo\n"
    assert pair.read("stdout", tail=1, max_bytes=100).text == "two\n"
    assert pair.read("stderr").total_bytes == 0
    modified = pair.modified_at()
    assert modified is not None and modified.tzinfo is not None
    pair.delete()
    assert os.listdir(folder) == [".gitignore"] and pair.modified_at() is None
    with pytest.raises(FileNotFoundError):
        pair.read("stdout")


def test_log_pair_discard_removes_only_the_folders_it_made(tmp_path: Path) -> None:
    (tmp_path / "project").mkdir()
    pair = LogPair.create(str(tmp_path / "project" / ".gadget" / "subprocess-logs"))
    pair.discard()
    assert os.listdir(tmp_path) == ["project"] and os.listdir(tmp_path / "project") == []
    existing = tmp_path / "logs"
    existing.mkdir()
    (existing / "other.log").write_text("kept")
    LogPair.create(str(existing)).discard()
    assert os.listdir(existing) == ["other.log"]


def test_log_pair_create_failure_leaves_nothing(tmp_path: Path) -> None:
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / ".gadget").write_text("a file where the folder should be")
    with pytest.raises(OSError):
        LogPair.create(str(tmp_path / "project" / ".gadget" / "subprocess-logs"))
    assert os.listdir(tmp_path / "project") == [".gadget"]


# ---- reading ------------------------------------------------------------------------------------------


def test_read_tail_counts_lines_with_and_without_final_newline(tmp_path: Path) -> None:
    log = _log(tmp_path, b"a\nb\nc\n")
    assert _read(log, tail=2).text == "b\nc\n"
    assert _read(log, tail=9).text == "a\nb\nc\n"
    unterminated = _log(tmp_path, b"a\nb\nc", "u.log")
    got = _read(unterminated, tail=2)
    assert (got.text, got.start_offset, got.next_offset, got.total_lines) == ("b\nc", 2, 5, 3)
    assert got.truncated


def test_read_forward_with_limit_and_offset(tmp_path: Path) -> None:
    log = _log(tmp_path, b"one\ntwo\nthree\n")
    first = _read(log, offset=0, limit=2)
    assert (first.text, first.next_offset, first.truncated) == ("one\ntwo\n", 8, True)
    rest = _read(log, offset=first.next_offset)
    assert (rest.text, rest.next_offset, rest.truncated) == ("three\n", 14, True)
    beyond = _read(log, offset=10**6)
    assert (beyond.text, beyond.start_offset) == ("", 14)
    whole = _read(log)
    assert (whole.text, whole.truncated, whole.total_bytes, whole.total_lines) == (
        log_text := "one\ntwo\nthree\n",
        False,
        14,
        3,
    )
    assert log.read_all() == log_text


def test_read_replaces_invalid_utf8_and_never_splits_a_character(tmp_path: Path) -> None:
    log = _log(tmp_path, "é€x\n".encode() + b"\xff\xfe\n")
    assert _read(log).text == "é€x\n\ufffd\ufffd\n"
    cut = _read(log, max_bytes=4)  # 'é' (2 bytes) + 2 of the 3 bytes of '€'
    assert cut.text == "é" and cut.next_offset == 2
    tail_cut = _read(log, tail=1, max_bytes=3)  # the last line alone is longer than 3 bytes? no: 3 bytes
    assert tail_cut.text == "\ufffd\ufffd\n"
    long_line = _log(tmp_path, "€€€€".encode(), "l.log")
    end = _read(long_line, tail=1, max_bytes=4)  # lands inside a character: skip its continuation bytes
    assert end.text == "€" and end.start_offset == 9


@given(
    lines=st.lists(st.text(alphabet=st.characters(blacklist_categories=["Cs"]), max_size=30), max_size=40),
    max_bytes=st.integers(4, 200),
    limit=st.one_of(st.none(), st.integers(1, 5)),
)
def test_read_paging_by_next_offset_rebuilds_the_log(
    lines: list[str], max_bytes: int, limit: int | None
) -> None:
    content = "".join(line.replace("\n", " ") + "\n" for line in lines)
    with tempfile.TemporaryDirectory() as d:
        log = _log(Path(d), content.encode())
        pieces, offset = [], 0
        while True:
            got = _read(
                log, offset=offset, max_bytes=max_bytes, **({} if limit is None else {"limit": limit})
            )
            if got.next_offset == offset:
                break
            pieces.append(got.text)
            offset = got.next_offset
        assert "".join(pieces) == content
        tail = _read(log, tail=3, max_bytes=10**6)
        expected_tail = "".join(part + "\n" for part in content.split("\n")[:-1][-3:])
        assert tail.text == expected_tail


# ---- the cap ------------------------------------------------------------------------------------------


def test_enforce_cap_punches_a_hole_and_keeps_offsets(tmp_path: Path) -> None:
    data = b"".join(f"line {i:07d}\n".encode() for i in range(300_000))  # 3.6 MB
    log = _log(tmp_path, data)
    dropped = log.enforce_cap(MiB)
    st = os.stat(log.path)
    assert st.st_size == len(data)  # the length stays: offsets keep their meaning
    assert st.st_blocks * 512 <= MiB + 2 * st.st_blksize
    assert dropped == log.dropped and log.dropped % st.st_blksize == 0
    assert len(data) - MiB - st.st_blksize < log.dropped <= len(data) - MiB
    got = _read(log, tail=1)
    assert got.text == "line 0299999\n" and got.dropped_bytes == log.dropped
    start = _read(log, offset=0, limit=2)
    assert start.start_offset == log.dropped and "\0" not in start.text
    assert start.text == data[log.dropped : start.next_offset].decode()
    assert "\0" not in log.read_all() and log.read_all().endswith("line 0299999\n")
    assert log.enforce_cap(MiB) == 0  # nothing new: nothing more to drop


def test_enforce_cap_copy_fallback_bounds_the_file_and_keeps_logical_offsets(tmp_path: Path) -> None:
    data = b"".join(f"row {i:07d}\n".encode() for i in range(200_000))  # 2.4 MB
    log = _log(tmp_path, data)
    log.punch = False
    log.enforce_cap(MiB)
    assert os.path.getsize(log.path) == MiB
    assert log.base == log.dropped == len(data) - MiB
    got = _read(log, tail=1)
    assert got.text == "row 0199999\n"
    assert got.total_bytes == len(data) and got.next_offset == len(data)
    with open(log.path, "ab") as f:  # the child appends on: logical offsets continue
        f.write(b"after\n")
    more = _read(log, offset=len(data))
    assert (more.text, more.start_offset) == ("after\n", len(data))
    assert _read(log, offset=0, limit=1).start_offset == log.dropped


def test_enforce_cap_missing_file_is_ignored(tmp_path: Path) -> None:
    assert LogFile(str(tmp_path / "gone.log")).enforce_cap(10) == 0


async def test_log_cap_bounds_disk_of_a_20_mib_writer(tmp_path: Path) -> None:
    """A child writes 20 MiB under a 1 MiB cap: blocks stay near 1 MiB, the last lines are intact."""
    project = make_project(tmp_path)
    writer = py(
        "import sys,time\n"
        "for i in range(20):\n"
        "    rows = (f'chunk {i:02d} line {j:05d} '.ljust(63, '.') + '\\n' for j in range(16384))\n"
        "    sys.stdout.write(''.join(rows))\n"
        "    sys.stdout.flush(); time.sleep(0.12)\n"
        "sys.stdout.write('END-OF-OUTPUT\\n')\n"
    )
    async with engine_at(tmp_path, log_cap_bytes=MiB) as engine:
        sp = await engine.service.create(project, writer[0], writer[1:])
        peak = 0
        with trio.fail_after(30):
            while sp.running:
                peak = max(peak, os.stat(sp.stdout_path).st_blocks * 512)
                await trio.sleep(0.05)
        assert sp.exit is not None and sp.exit.exit_code == 0
        size = os.stat(sp.stdout_path).st_size
        assert size == 20 * 16384 * 64 + len("END-OF-OUTPUT\n")
        t0 = time.monotonic()
        with trio.fail_after(5):  # the cap task's last pass over a finished child
            while os.stat(sp.stdout_path).st_blocks * 512 > MiB + 64 * 1024:
                await trio.sleep(0.05)
        allocated = os.stat(sp.stdout_path).st_blocks * 512
        print(
            f"log cap: peak {peak / MiB:.2f} MiB while writing, {allocated / MiB:.3f} MiB after "
            f"({time.monotonic() - t0:.2f} s after exit)"
        )
        assert peak < 16 * MiB  # one poll period (1 s) of output over the cap, at most
        got = await engine.service.read_log(sp.pid, "stdout", tail=2)
        assert got.text.endswith("chunk 19 line 16383 " + "." * 43 + "\nEND-OF-OUTPUT\n")
        assert got.dropped_bytes >= size - MiB - 64 * 1024 and got.total_bytes == size
        assert got.dropped_bytes + (got.total_lines * 64) >= size - 64  # what is left is whole lines, mostly
        whole = await engine.service.get_log(sp.pid, "stdout")
        assert "\0" not in whole and whole.endswith("END-OF-OUTPUT\n") and len(whole) <= MiB + 64 * 1024
        first = await engine.service.read_log(sp.pid, "stdout", offset=0, limit=1)
        assert first.start_offset == got.dropped_bytes


# ---- SP-07: huge output --------------------------------------------------------------------------------

_SP07 = {
    "a": ("python3", "-c", "import sys; sys.stdout.write('y'*10_000_000); sys.stdout.flush()"),
    "b": ("bash", "-c", 'for i in $(seq 1 200000); do echo "line $i"; done'),
    "c": (
        "python3",
        "-c",
        "import sys\nfor _ in range(5000):\n"
        "    sys.stdout.write('o'*1000+'\\n'); sys.stderr.write('e'*1000+'\\n')",
    ),
    "d": (
        "python3",
        "-c",
        "import sys\nfor i in range(100001): sys.stdout.write(f'\\rprogress {i}%')\nsys.stdout.write('\\n')",
    ),
}


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


async def test_huge_output_is_byte_exact_and_bounded_for_agents(tmp_path: Path) -> None:
    project = make_project(tmp_path)
    async with engine_at(tmp_path) as engine:
        service, tool = engine.service, engine.tool
        sps = {key: await service.create(project, argv[0], argv[1:]) for key, argv in _SP07.items()}
        with trio.fail_after(10):
            for sp in sps.values():
                result = await sp.wait()
                assert result.exit_code == 0
        sizes = {
            key: (os.path.getsize(sp.stdout_path), os.path.getsize(sp.stderr_path)) for key, sp in sps.items()
        }
        assert sizes == {
            "a": (10_000_000, 0),
            "b": (2_288_895, 0),
            "c": (5_005_000, 5_005_000),
            "d": (1_588_908, 0),
        }
        with open(sps["a"].stdout_path, "rb") as f:
            assert f.read().strip(b"y") == b""
        whole = await service.get_log(sps["a"].pid, "stdout")
        assert len(whole) == 10_000_000
        del whole
        before = _rss_bytes()
        for _ in range(20):
            assert len(await service.get_log(sps["a"].pid, "stdout")) == 10_000_000
        assert _rss_bytes() - before < 50 * MiB  # soft check: each read is freed
        b_text = await tool.execute({"cmd": "log", "pid": sps["b"].pid, "which": "stdout"}, project)
        body, note = b_text.rsplit("\n", 1)
        assert body.endswith("line 200000\n") and "line 199801\n" in body and "line 199800\n" not in body
        assert "199800 earlier lines" in note and "of 2288895" in note and note.startswith("[truncated")
        assert len(b_text.encode()) < 32 * 1024 + 1024
        d_text = await tool.execute({"cmd": "log", "pid": sps["d"].pid, "which": "stdout"}, project)
        d_body, d_note = d_text.rsplit("\n", 1)
        assert d_body.endswith("progress 100000%\n") and "of 1588908" in d_note
        assert len(d_text.encode()) < 32 * 1024 + 1024
        summary = service.summarize(sps["a"])
        assert len(repr(summary.to_dict())) < 4096
