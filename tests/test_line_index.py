"""Line counts of a growing log counted once (``engine/_logread.LineIndex``, issue 19): whatever the
sequence of appends, cap passes (hole punching or the copy fallback), truncations from outside and
reads, ``total_lines`` is the number of lines of the bytes still kept, as a full count would say."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import _logread
from engine._logs import LogFile

_STEPS = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.binary(max_size=3000).map(lambda b: b.replace(b"\0", b"x"))),
        st.tuples(st.just("lines"), st.integers(0, 200)),
        st.tuples(st.just("cap"), st.integers(1, 12_000)),
        st.tuples(st.just("read"), st.integers(1, 50)),
        st.tuples(st.just("truncate"), st.just(0)),
    ),
    max_size=40,
)


def _expected(log: LogFile) -> int:
    with open(log.path, "rb") as f:  # the bytes still kept, as they are on disk
        f.seek(log.dropped - log.base)
        kept = f.read()
    return kept.count(b"\n") + (1 if kept and not kept.endswith(b"\n") else 0)


@pytest.mark.parametrize("punch", [True, False])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=_STEPS)
def test_total_lines_match_a_full_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, punch: bool, steps: list[tuple[str, bytes | int]]
) -> None:
    monkeypatch.setattr(_logread, "_CHUNK", 4096)  # many marks: every path of the index is taken
    path = tmp_path / f"log-{punch}-{os.getpid()}-{len(steps)}"
    path.write_bytes(b"")
    try:
        log = LogFile(str(path))
        log.punch = punch
        for kind, arg in steps:
            if isinstance(arg, bytes):
                with open(path, "ab") as f:
                    f.write(arg)
            elif kind == "lines":
                with open(path, "ab") as f:
                    f.write(b"".join(b"line %06d\n" % i for i in range(arg)))
            elif kind == "cap":
                log.enforce_cap(arg)
            elif kind == "truncate":
                with open(path, "wb"):
                    pass
            tail = arg if kind == "read" and isinstance(arg, int) else 5
            got = log.read(offset=None, limit=None, tail=tail, max_bytes=2048)
            assert got.total_lines == _expected(log), (kind, steps)
    finally:
        path.unlink()


def test_a_big_log_is_counted_once_then_only_what_is_new(tmp_path: Path) -> None:
    path = tmp_path / "big.log"
    path.write_bytes(b"".join(b"row %07d\n" % i for i in range(200_000)))
    log = LogFile(str(path))
    first = log.read(offset=None, limit=None, tail=3, max_bytes=4096)
    assert first.total_lines == 200_000
    index = log._index
    assert index is not None and index.end == path.stat().st_size
    with open(path, "ab") as f:
        f.write(b"one more\nand a half")
    again = log.read(offset=None, limit=None, tail=3, max_bytes=4096)
    assert again.total_lines == 200_002 and log._index is index
