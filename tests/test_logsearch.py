"""``grep`` over a log (``engine/_logsearch.py``): lines longer than the 1 MiB piece it reads at a time,
written by real children to their real log files.

Found by a tester: a line of 40,000,000 ``x`` was shown as ``[line cut: 1046576 more characters]``, the
count of one 1 MiB piece; with a large ``max_bytes`` each piece was a "line" of its own.
"""

from __future__ import annotations

from pathlib import Path

import trio

from engine import SubProcessService
from engine._logsearch import CHUNK_BYTES, LINE_CHARS

from .children import PY
from .service_support import engine_at, make_project


async def _log_of(service: SubProcessService, tmp_path: Path, code: str) -> int:
    """The pid of a finished child that ran ``code`` (its stdout is the log searched)."""
    sp = await service.create(make_project(tmp_path), PY, ["-c", code])
    with trio.fail_after(60):
        await service.wait(sp.pid)
    return sp.pid


def _cut(line: str, chars: int) -> str:
    return f"{line}... [line cut: {chars - LINE_CHARS} more characters]"


async def test_grep_counts_the_cut_characters_of_lines_of_any_length(tmp_path: Path) -> None:
    sizes = (1_000_000, 3 * 2**20, 40_000_000)  # within a piece, over three pieces, over 38 pieces
    code = (
        "import sys\n"
        f"for n in {sizes!r}:\n"
        "    sys.stdout.write('x' * n + '\\n')\n"
        "    sys.stdout.write('short\\n')\n"
    )
    async with engine_at(tmp_path) as engine:
        service = engine.service
        pid = await _log_of(service, tmp_path, code)
        head = "x" * LINE_CHARS
        expected = [f"{number}: {_cut(head, size)}" for number, size in zip((1, 3, 5), sizes, strict=True)]
        for max_bytes in (32768, 1 << 30):  # the default budget, and one that shows every match
            got = await service.read_log(pid, "stdout", grep="x", max_bytes=max_bytes)
            assert got.text.splitlines() == expected
            assert (got.total_lines, got.truncated) == (6, False)
        short = await service.read_log(pid, "stdout", grep="short")
        assert short.text.splitlines() == ["2: short", "4: short", "6: short"]
        last = await service.read_log(pid, "stdout", grep="x", tail=1)
        assert last.text == f"5: {_cut(head, 40_000_000)}\n"
        page = await service.read_log(pid, "stdout", grep="x", limit=1)
        assert page.text == f"{expected[0]}\n" and page.truncated
        more = await service.read_log(pid, "stdout", grep="x", offset=page.next_offset, limit=1)
        assert more.text == f"{expected[1]}\n"


async def test_grep_shows_a_long_line_once_from_its_start_when_a_later_piece_matches(tmp_path: Path) -> None:
    # 'é' is two bytes from an odd offset: the line's 1 MiB pieces end inside a character, counted once
    chars = 2 * CHUNK_BYTES
    code = (
        "import sys\n"
        "out = sys.stdout.buffer\n"
        "out.write(b'before\\n')\n"
        f"out.write(('é' * {chars - 8} + 'NEEDLE' + 'éé' + '\\n').encode())\n"
        "out.write(b'after NEEDLE\\n')\n"
        "out.write(b'ends without a newline NEEDLE')\n"
    )
    async with engine_at(tmp_path) as engine:
        service = engine.service
        pid = await _log_of(service, tmp_path, code)
        got = await service.read_log(pid, "stdout", grep="NEEDLE", max_bytes=1 << 20)
        assert got.text.splitlines() == [
            f"2: {_cut('é' * LINE_CHARS, chars)}",
            "3: after NEEDLE",
            "4: ends without a newline NEEDLE",
        ]
        assert got.total_lines == 4
