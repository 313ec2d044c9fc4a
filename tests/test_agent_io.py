"""What agents need beyond the spec, part 1 (issue 17), on real processes: readiness, stdin, wait,
``new_only`` reads and ``grep``.

Readiness and ``grep`` have modules of their own (``engine/_readiness.py``, ``_logsearch.py``,
``_patterns.py``); their service-level behaviour is tested here, through ``SubProcessService``.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest
import trio

from engine import (
    PatternTimeoutError,
    ReadyCheck,
    RunState,
    StdinClosedError,
    SubProcessNotFoundError,
)
from engine._readiness import listening_inodes, port_ready

from .children import PY, kill_leftovers, mark, wait_for_text, wait_until
from .service_support import engine_at, make_project


def free_port(family: socket.AddressFamily = socket.AF_INET) -> int:
    host = "::1" if family == socket.AF_INET6 else "127.0.0.1"
    with socket.socket(family) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


def http_server(port: int, bind: str, marker: str) -> list[str]:
    """``python -u -m http.server`` on ``port`` (the marker rides in a harmless ``-X`` option)."""
    return ["-u", "-X", f"pycache_prefix=/tmp/m{marker}", "-m", "http.server", str(port), "--bind", bind]


# ---- readiness ---------------------------------------------------------------------------------------


async def test_ready_by_port_on_ipv4_for_a_real_http_server(tmp_path: Path) -> None:
    project = make_project(tmp_path)
    port = free_port()
    marker = mark("71.1")
    try:
        async with engine_at(tmp_path) as engine:
            started = time.monotonic()
            sp = await engine.service.create(
                project, PY, http_server(port, "127.0.0.1", marker), ready=ReadyCheck(port=port)
            )
            summary = engine.service.summarize(sp)
            assert summary.ready == "ready"
            assert summary.state is RunState.RUNNING
            assert time.monotonic() - started < 10
            with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:  # it accepts now
                conn.sendall(b"GET / HTTP/1.0\r\n\r\n")
                assert conn.recv(100).startswith(b"HTTP/1.0 200")
            assert port_ready(port, sp._run.pids())
    finally:
        kill_leftovers(marker)


async def test_ready_by_log_line_and_first_output(tmp_path: Path) -> None:
    project = make_project(tmp_path)
    port = free_port()
    marker = mark("71.2")
    try:
        async with engine_at(tmp_path) as engine:
            sp = await engine.service.create(
                project,
                PY,
                http_server(port, "127.0.0.1", marker),
                ready=ReadyCheck(log_pattern=r"^Serving HTTP on \S+ port \d+"),
            )
            summary = engine.service.summarize(sp)
            assert summary.ready == "ready"
            assert summary.first_output is not None
            assert summary.first_output.startswith("Serving HTTP on 127.0.0.1 port")
            assert summary.to_dict()["ready"] == "ready"
    finally:
        kill_leftovers(marker)


async def test_wait_ready_for_a_created_process_reads_its_logs_from_the_start(tmp_path: Path) -> None:
    project = make_project(tmp_path)
    marker = mark("71.3")
    code = (
        "import time; print('listening', flush=True); time.sleep(0.3); print('later', flush=True); "
        f"time.sleep({marker})"
    )
    try:
        async with engine_at(tmp_path) as engine:
            service = engine.service
            sp = await service.create(project, PY, ["-c", code])
            await wait_for_text(sp.stdout_path, "later")
            with trio.fail_after(10):  # the line came before the wait began: it counts
                summary = await service.wait_ready(sp.pid, ReadyCheck(log_pattern="^listening$"))
            assert (summary.ready, summary.first_output) == ("ready", "listening\nlater\n")
            with trio.move_on_after(0.2) as cancelled:  # cancelled: the process goes on
                await service.wait_ready(sp.pid, ReadyCheck(log_pattern="^never$"))
            assert cancelled.cancelled_caught and service.summarize(sp).status == "running"
            with pytest.raises(TypeError, match="ready must be a ReadyCheck"):
                await service.wait_ready(sp.pid, {"log": "x"})  # type: ignore[arg-type]
            with pytest.raises(SubProcessNotFoundError):
                await service.wait_ready(999_999_999, ReadyCheck(log_pattern="x"))
    finally:
        kill_leftovers(marker)


@pytest.mark.skipif(not has_ipv6_loopback(), reason="no IPv6 loopback on this machine")
async def test_ready_by_port_for_a_server_bound_to_ipv6_loopback_only(tmp_path: Path) -> None:
    project = make_project(tmp_path)
    port = free_port(socket.AF_INET6)
    marker = mark("71.3")
    try:
        async with engine_at(tmp_path) as engine:
            sp = await engine.service.create(
                project, PY, http_server(port, "::1", marker), ready=ReadyCheck(port=port, timeout_seconds=20)
            )
            assert engine.service.summarize(sp).ready == "ready"
            with socket.create_connection(("::1", port), timeout=5):
                pass
    finally:
        kill_leftovers(marker)


async def test_a_stale_listener_on_the_port_is_not_ready(tmp_path: Path) -> None:
    """Someone else's socket listening on the port does not make our process ready; a server of ours that
    cannot bind exits, and that is what create reports."""
    project = make_project(tmp_path)
    marker = mark("71.4")
    with socket.socket() as stale:
        stale.bind(("127.0.0.1", 0))
        stale.listen()
        port = stale.getsockname()[1]
        assert listening_inodes(port)
        try:
            async with engine_at(tmp_path) as engine:
                sleeper = await engine.service.create(
                    project, "sleep", [marker], ready=ReadyCheck(port=port, timeout_seconds=0.6)
                )
                assert engine.service.summarize(sleeper).ready == "timeout"
                assert sleeper.running  # a readiness timeout does not kill
                server = await engine.service.create(
                    project, PY, http_server(port, "127.0.0.1", marker), ready=ReadyCheck(port=port)
                )
                summary = engine.service.summarize(server)
                assert summary.ready == "exited"
                assert summary.exit_code == 1
                assert "Address already in use" in (summary.first_output or "")
        finally:
            kill_leftovers(marker)


async def test_ready_reports_an_exit_before_the_pattern(tmp_path: Path) -> None:
    project = make_project(tmp_path)
    async with engine_at(tmp_path) as engine:
        sp = await engine.service.create(
            project,
            "bash",
            ["-c", "echo starting; echo broken >&2; exit 3"],
            ready=ReadyCheck(log_pattern="ready"),
        )
        summary = engine.service.summarize(sp)
        assert summary.ready == "exited"
        assert summary.exit_code == 3
        assert summary.first_output == "starting\nbroken\n"
        # a match in what an exiting process wrote still counts as ready
        sp = await engine.service.create(
            project, "bash", ["-c", "echo ready; exit 0"], ready=ReadyCheck("ready")
        )
        assert engine.service.summarize(sp).ready == "ready"


async def test_ready_check_refuses_bad_values() -> None:
    with pytest.raises(ValueError, match="log_pattern or port"):
        ReadyCheck()
    with pytest.raises(ValueError, match="not a valid regular expression"):
        ReadyCheck(log_pattern="(unclosed")
    with pytest.raises(ValueError, match="port"):
        ReadyCheck(port=70000)
    with pytest.raises(ValueError, match="timeout_seconds"):
        ReadyCheck(port=80, timeout_seconds=float("inf"))


# ---- stdin and wait ----------------------------------------------------------------------------------


async def test_a_child_answers_a_prompt_through_stdin(tmp_path: Path) -> None:
    project = make_project(tmp_path)
    code = "answer = input('Proceed? [y/N] '); print('answered', answer)"
    async with engine_at(tmp_path) as engine:
        service = engine.service
        sp = await service.create(
            project, PY, ["-c", code], stdin=True, ready=ReadyCheck(r"Proceed\? \[y/N\]")
        )
        assert service.summarize(sp).ready == "ready"
        await service.write_stdin(sp.pid, "y\n")
        with trio.fail_after(10):
            summary = await service.wait(sp.pid)
        assert summary.status == "exited 0"
        assert (await service.read_log(sp.pid, "stdout")).text == "Proceed? [y/N] answered y\n"
        with pytest.raises(StdinClosedError, match=r"the process ended \(exited 0\); nothing was written"):
            await service.write_stdin(sp.pid, "again\n")
        halted = await service.create(project, "sleep", ["60"], stdin=True)
        await service.halt_pid(halted.pid)
        with pytest.raises(StdinClosedError, match=r"ended \(killed by signal 2 \(SIGINT\), halted\)"):
            await service.write_stdin(halted.pid, "late\n")


async def test_stdin_eof_and_bytes_and_refusals(tmp_path: Path) -> None:
    project = make_project(tmp_path)
    async with engine_at(tmp_path) as engine:
        service = engine.service
        cat = await service.create(project, "cat", stdin=True)
        await service.write_stdin(cat.pid, b"raw \xc3\xa9\n")
        await service.write_stdin(cat.pid, "text\n", eof=True)
        with trio.fail_after(10):
            summary = await service.wait(cat.pid)
        assert summary.status == "exited 0"  # cat read end of input
        assert (await service.read_log(cat.pid, "stdout")).text == "raw é\ntext\n"
        with pytest.raises(StdinClosedError, match="eof"):
            await service.write_stdin(cat.pid, "more")
        plain = await service.create(project, "cat")
        with pytest.raises(StdinClosedError, match="stdin=True"):
            await service.write_stdin(plain.pid, "x")
        with pytest.raises(ValueError, match="data"):
            await service.write_stdin(plain.pid, 42)  # type: ignore[arg-type]
        with pytest.raises(SubProcessNotFoundError):
            await service.write_stdin(2**22 + 7, "x")


async def test_a_child_that_does_not_read_blocks_a_bounded_write(tmp_path: Path) -> None:
    project = make_project(tmp_path)
    marker = mark("71.5")
    try:
        async with engine_at(tmp_path) as engine:
            sp = await engine.service.create(project, "sleep", [marker], stdin=True)
            with trio.move_on_after(0.5) as scope:
                await engine.service.write_stdin(sp.pid, "x" * (1 << 20))
            assert scope.cancelled_caught  # the pipe filled up: the caller's bound ends the wait
            await engine.service.kill_pid(sp.pid)
    finally:
        kill_leftovers(marker)


async def test_wait_returns_the_summary_once_the_process_exited(tmp_path: Path) -> None:
    project = make_project(tmp_path)
    marker = mark("71.6")
    try:
        async with engine_at(tmp_path) as engine:
            quick = await engine.service.create(project, "bash", ["-c", "sleep 0.3; exit 4"])
            with trio.fail_after(10):
                summary = await engine.service.wait(quick.pid)
            assert (summary.state, summary.exit_code) == (RunState.EXITED, 4)
            with trio.fail_after(5):  # at once for a process that already exited
                assert (await engine.service.wait(quick.pid)).exit_code == 4
            slow = await engine.service.create(project, "sleep", [marker])
            with trio.move_on_after(0.3) as scope:
                await engine.service.wait(slow.pid)
            assert scope.cancelled_caught and slow.running
    finally:
        kill_leftovers(marker)


# ---- new_only --------------------------------------------------------------------------------------------


async def test_new_only_over_three_reads_with_writes_between(tmp_path: Path) -> None:
    project = make_project(tmp_path)
    async with engine_at(tmp_path) as engine:
        service = engine.service
        cat = await service.create(project, "cat", stdin=True)
        for line in ("one\n", "two\n", "three\n"):
            await service.write_stdin(cat.pid, line)
            await wait_for_text(cat.stdout_path, line)
            got = await service.read_log(cat.pid, "stdout", new_only=True, reader="agent-a")
            assert (got.text, got.skipped_bytes) == (line, 0)
            assert got.next_offset == got.total_bytes
        nothing = await service.read_log(cat.pid, "stdout", new_only=True, reader="agent-a")
        assert nothing.text == ""
        # another reader has a cursor of its own: it starts from the start
        other = await service.read_log(cat.pid, "stdout", new_only=True, reader="agent-b")
        assert other.text == "one\ntwo\nthree\n"
        with pytest.raises(ValueError, match="leave out offset and tail"):
            await service.read_log(cat.pid, "stdout", new_only=True, tail=3)


async def test_new_only_returns_the_oldest_unread_part_within_the_budget(tmp_path: Path) -> None:
    project = make_project(tmp_path)
    async with engine_at(tmp_path) as engine:
        service = engine.service
        sp = await service.create(project, PY, ["-c", "for i in range(1000): print(f'{i:099d}')"])
        with trio.fail_after(10):
            await service.wait(sp.pid)
        first = await service.read_log(sp.pid, "stdout", new_only=True, max_bytes=32768)
        assert first.start_offset == 0 and len(first.text) == 32768
        assert first.total_bytes == 100_000 and first.next_offset == 32768
        assert first.total_bytes - first.next_offset == 100_000 - 32768  # what is still unread
        second = await service.read_log(sp.pid, "stdout", new_only=True, max_bytes=32768)
        assert second.start_offset == 32768  # the cursor moved only past what was returned
        rest = await service.read_log(sp.pid, "stdout", new_only=True, max_bytes=1 << 20)
        assert rest.next_offset == rest.total_bytes == 100_000
        assert first.text + second.text + rest.text == (await service.get_log(sp.pid, "stdout"))


async def test_new_only_after_the_log_cap_dropped_unread_bytes_restarts_and_says_so(tmp_path: Path) -> None:
    project = make_project(tmp_path)
    async with engine_at(tmp_path, log_cap_bytes=64 * 1024) as engine:
        service = engine.service
        cat = await service.create(project, "cat", stdin=True)
        await service.write_stdin(cat.pid, "seen\n")
        await wait_for_text(cat.stdout_path, "seen")
        assert (await service.read_log(cat.pid, "stdout", new_only=True)).text == "seen\n"
        await service.write_stdin(cat.pid, ("y" * 1023 + "\n") * 512)  # 512 KiB, far over the cap

        async def capped() -> bool:
            return (await service.read_log(cat.pid, "stdout", tail=1)).dropped_bytes > 5

        await wait_until(capped, seconds=10, interval=0.1)
        got = await service.read_log(cat.pid, "stdout", new_only=True, max_bytes=1 << 20)
        assert got.skipped_bytes == got.dropped_bytes - 5 > 0
        assert got.start_offset == got.dropped_bytes  # from the file's current start
        assert got.next_offset == got.total_bytes


async def test_new_only_after_an_outside_truncation_restarts_and_says_so(tmp_path: Path) -> None:
    project = make_project(tmp_path)
    async with engine_at(tmp_path) as engine:
        service = engine.service
        cat = await service.create(project, "cat", stdin=True)
        await service.write_stdin(cat.pid, "aaaa\nbbbb\n")
        await wait_for_text(cat.stdout_path, "bbbb")
        part = await service.read_log(cat.pid, "stdout", new_only=True, max_bytes=5)
        assert part.text == "aaaa\n"
        os.truncate(cat.stdout_path, 0)  # `> log` from outside: "bbbb\n" was never read
        await service.write_stdin(cat.pid, "cc\n")
        await wait_until(lambda: os.path.getsize(cat.stdout_path) == 3)
        got = await service.read_log(cat.pid, "stdout", new_only=True)
        assert got.text == "cc\n"
        assert got.skipped_bytes == 5  # the unread "bbbb\n" is gone, and the read says so


# ---- grep ------------------------------------------------------------------------------------------------


async def test_grep_numbers_matching_lines_and_pages_forward(tmp_path: Path) -> None:
    project = make_project(tmp_path)
    script = "for i in range(1, 101): print(f'ERROR {i}' if i % 10 == 0 else f'ok {i}')"
    async with engine_at(tmp_path) as engine:
        service = engine.service
        sp = await service.create(project, PY, ["-c", script])
        with trio.fail_after(10):
            await service.wait(sp.pid)
        got = await service.read_log(sp.pid, "stdout", grep=r"ERROR \d+")
        assert got.text.splitlines() == [f"{n}: ERROR {n}" for n in range(10, 101, 10)]
        assert (got.truncated, got.total_lines) == (False, 100)
        page = await service.read_log(sp.pid, "stdout", grep="ERROR", limit=3)
        assert page.text.splitlines() == ["10: ERROR 10", "20: ERROR 20", "30: ERROR 30"]
        assert page.truncated
        more = await service.read_log(sp.pid, "stdout", grep="ERROR", offset=page.next_offset, limit=3)
        assert more.text.splitlines() == ["40: ERROR 40", "50: ERROR 50", "60: ERROR 60"]
        last = await service.read_log(sp.pid, "stdout", grep="ERROR", tail=2)
        assert last.text.splitlines() == ["90: ERROR 90", "100: ERROR 100"]
        assert last.truncated  # earlier matches left out
        new = await service.read_log(sp.pid, "stdout", grep="ERROR 9", new_only=True)
        assert new.text == "90: ERROR 90\n"
        assert (await service.read_log(sp.pid, "stdout", grep="ERROR", new_only=True)).text == ""
        with pytest.raises(ValueError, match="not a valid regular expression"):
            await service.read_log(sp.pid, "stdout", grep="ERROR (")


async def test_grep_on_a_50_mib_log_stays_within_the_budget(tmp_path: Path) -> None:
    project = make_project(tmp_path)
    # 50 MiB: 524288 lines of 100 bytes, every 1000th an error
    script = (
        "import sys\n"
        "out = sys.stdout.buffer\n"
        "for i in range(524288):\n"
        "    word = 'ERROR' if i % 1000 == 999 else 'ok'\n"
        "    out.write(f'{word} line {i:08d} '.ljust(99).encode() + b'\\n')\n"
    )
    async with engine_at(tmp_path) as engine:
        service = engine.service
        sp = await service.create(project, PY, ["-c", script])
        with trio.fail_after(60):
            await service.wait(sp.pid)
        started = time.monotonic()
        got = await service.read_log(sp.pid, "stdout", grep=r"^ERROR line \d+", max_bytes=32768)
        took = time.monotonic() - started
        assert got.total_bytes == 50 * 2**20
        lines = got.text.splitlines()
        assert lines[0].startswith("1000: ERROR line 00000999")
        assert len(got.text.encode()) <= 32768 and got.truncated
        tail = await service.read_log(sp.pid, "stdout", grep="ERROR", tail=5)
        assert tail.text.splitlines()[-1].startswith("524000: ERROR line 00523999")
        assert took < 2.0, took


@pytest.mark.serial
async def test_a_catastrophic_pattern_is_an_error_within_2_s_while_other_reads_go_on(tmp_path: Path) -> None:
    slow_project = make_project(tmp_path, "slow")
    other_project = make_project(tmp_path, "other")
    async with engine_at(tmp_path) as engine:
        service = engine.service
        bad = await service.create(slow_project, "bash", ["-c", "printf 'a%.0s' {1..30000}; echo b"])
        other = await service.create(other_project, "bash", ["-c", "echo hello"])
        with trio.fail_after(10):
            await service.wait(bad.pid)
            await service.wait(other.pid)
        reads = 0
        took = 0.0

        async def catastrophic() -> None:
            nonlocal took
            started = time.monotonic()
            with pytest.raises(PatternTimeoutError, match="simplify it"):
                await service.read_log(bad.pid, "stdout", grep="(a+)+$")
            took = time.monotonic() - started
            nursery.cancel_scope.cancel()

        async def other_reads() -> None:
            nonlocal reads
            while True:
                got = await service.read_log(other.pid, "stdout", project_id=other_project.id)
                assert got.text == "hello\n"
                reads += 1
                await trio.sleep(0.05)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(catastrophic)
            nursery.start_soon(other_reads)
        assert took < 2.0, took
        assert reads >= 10  # the other project's reads went on meanwhile
