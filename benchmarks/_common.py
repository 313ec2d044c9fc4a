"""What every workload shares: result rows, paired ratios, timing and process-level measurements."""

from __future__ import annotations

import fcntl
import os
import platform
import resource
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from ._supervisord import Supervisord

MiB = 2**20
GiB = 2**30


@dataclass
class Row:
    """One line of the results table: a variant of a workload, measured next to its baseline.

    ``values`` are absolute samples (context only). ``ratios`` are paired samples of
    ``variant / baseline``, each taken from the same repeat (or block of interleaved rounds), so the
    machine's speed and load cancel out; the baseline row itself has none.
    """

    workload: str
    variant: str
    unit: str
    values: list[float]
    baseline: str | None = None
    ratios: list[float] = field(default_factory=list)
    target: str = ""
    met: bool | None = None
    note: str = ""
    #: the containment mode the variant ran in (``"cgroup"``, ``"process-group"``), or ``""``
    mode: str = ""
    #: the target is below what this machine allows (``met`` then shows ``floor``; see analysis.md)
    floor: bool = False

    def to_dict(self) -> dict[str, object]:
        return {
            "workload": self.workload,
            "variant": self.variant,
            "mode": self.mode,
            "unit": self.unit,
            "values": self.values,
            "baseline": self.baseline,
            "ratios": self.ratios,
            "target": self.target,
            "met": self.met,
            "floor": self.floor,
            "note": self.note,
        }


@dataclass
class Context:
    """Options and shared resources of one benchmark run."""

    quick: bool
    log_bytes: int
    tmp: str
    supervisord: Supervisord | None
    notes: list[str] = field(default_factory=list)
    #: the containment modes measured side by side (``"cgroup"`` only where a cgroup v2 is writable)
    modes: tuple[str, ...] = ("process-group",)
    #: how long a workload may wait for a quiet filesystem in its folders (``--quiet-wait``)
    quiet_wait_seconds: float = 0.0

    def scratch(self, name: str) -> str:
        path = tempfile.mkdtemp(prefix=f"{name}-", dir=self.tmp)
        return path


def pct(samples: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) by linear interpolation between order statistics."""
    ordered = sorted(samples)
    if not ordered:
        return float("nan")
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def spread(samples: Sequence[float]) -> tuple[float, float, float]:
    """``(median, p10, p90)``."""
    if not samples:
        return float("nan"), float("nan"), float("nan")
    return statistics.median(samples), pct(samples, 0.1), pct(samples, 0.9)


def block_ratios(variant: Sequence[float], baseline: Sequence[float], blocks: int) -> list[float]:
    """Ratios of medians over consecutive blocks of interleaved rounds (one ratio per block)."""
    n = min(len(variant), len(baseline))
    blocks = max(1, min(blocks, n))
    size = n // blocks
    out = []
    for b in range(blocks):
        lo, hi = b * size, (b + 1) * size if b < blocks - 1 else n
        out.append(statistics.median(variant[lo:hi]) / statistics.median(baseline[lo:hi]))
    return out


def paired(variant: Sequence[float], baseline: Sequence[float]) -> list[float]:
    """Per-repeat ratios of samples taken in the same repeat."""
    return [v / b for v, b in zip(variant, baseline, strict=True) if b > 0]


def cpu_seconds() -> float:
    """User + system CPU time of this process so far (children excluded)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def rss_bytes() -> int:
    """This process's resident set size, from ``/proc/self/status``."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@contextmanager
def stopwatch() -> Iterator[list[float]]:
    """``with stopwatch() as t: ...`` then ``t[0]`` is the elapsed wall time in seconds."""
    box: list[float] = []
    t0 = time.perf_counter()
    try:
        yield box
    finally:
        box.append(time.perf_counter() - t0)


def loadavg() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


def cpu_probe_ms(repeats: int = 5) -> float:
    """The median time of a fixed piece of pure Python work (a sum over 300,000 integers), in
    milliseconds: how fast this VM gives this process a CPU now. The load average does not see a host
    that runs the VM slower (a run whose every absolute time doubled had a load of 0.45 at its start),
    and ``/proc/stat`` showed no steal meanwhile; this does."""
    times: list[float] = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        sum(range(300_000))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def wait_quiet(max_load: float, max_wait_seconds: float) -> tuple[float, float]:
    """Wait (up to ``max_wait_seconds``) until the 1-minute load average is at most ``max_load``.

    Returns:
        ``(load when the wait ended, seconds waited)``.
    """
    t0 = time.monotonic()
    while True:
        one = os.getloadavg()[0]
        waited = time.monotonic() - t0
        if one <= max_load or waited >= max_wait_seconds:
            return one, waited
        time.sleep(min(10.0, max_wait_seconds - waited))


#: A file allocation at most this long counts as a quiet filesystem, in microseconds.
QUIET_FILE_US = 50.0


def file_allocation_us(directory: str, files: int = 8) -> float:
    """The median time to allocate one unnamed file (``O_TMPFILE``) in ``directory``, in microseconds.

    On an ext4 without a journal (this machine's), allocating an inode skips every free inode of its
    block group that was freed less than 60 s ago, or less than 360 s ago while the inode table block
    holding it is not written back yet (``recently_deleted`` in the kernel's ``fs/ext4/ialloc.c``:
    ``RECENTCY_MIN`` 60, ``RECENTCY_DIRTY`` 300; each new inode dirties its block again). A file made
    after many deletions near it costs 0.1-0.5 us per deleted file: a few microseconds on a quiet
    filesystem, up to a millisecond after a test suite's clean-up. A few files in one new folder are a
    lottery: a new folder may sit in another inode group than the next one. The files are closed (freed)
    at once.
    """
    times: list[float] = []
    for _ in range(files):
        t0 = time.perf_counter()
        fd = os.open(directory, os.O_TMPFILE | os.O_WRONLY, 0o600)
        times.append(time.perf_counter() - t0)
        os.close(fd)
    return statistics.median(times) * 1e6


#: ``FS_IOC_GETFLAGS`` / ``FS_IOC_SETFLAGS`` and ``FS_TOPDIR_FL`` (``linux/fs.h``, as ``chattr +T`` sets it).
_FS_IOC_GETFLAGS: Final = 0x80086601
_FS_IOC_SETFLAGS: Final = 0x40086602
_FS_TOPDIR_FL: Final = 0x00020000


def spread_folders(directory: str) -> str:
    """Mark ``directory`` the top of a hierarchy for ext4's Orlov allocator (``chattr +T``), so that each
    folder made in it (each workload's scratch) goes to an inode group of its own, as folders made at
    the filesystem's root do, rather than next to its siblings: one workload's deleted files then do not
    slow the next one's new files (:func:`file_allocation_us`). Returns a note for the results; a
    filesystem without the flag is left as it is (and said so).
    """
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        return f"scratch folders not spread over inode groups ({exc.strerror})"
    try:
        buf = bytearray(struct.pack("i", 0))
        fcntl.ioctl(fd, _FS_IOC_GETFLAGS, buf)
        (flags,) = struct.unpack("i", buf)
        fcntl.ioctl(fd, _FS_IOC_SETFLAGS, struct.pack("i", flags | _FS_TOPDIR_FL))
    except OSError as exc:
        return f"scratch folders not spread over inode groups (FS_TOPDIR_FL: {exc.strerror})"
    finally:
        os.close(fd)
    return (
        "each workload's scratch folders are spread over inode groups (FS_TOPDIR_FL, as `chattr +T` sets it, "
        "on the scratch root): on this ext4 without a journal a file freed less than 60-360 s ago slows each "
        "new file of its inode group (analysis.md, twenty-second round), and the earlier workloads free "
        "some 20,000"
    )


def wait_files_quiet(directory: str, max_wait_seconds: float) -> tuple[float, float]:
    """Wait (up to ``max_wait_seconds``) until a file allocation in ``directory`` takes at most
    :data:`QUIET_FILE_US`; the filesystem's counterpart of :func:`wait_quiet`.

    Returns:
        ``(the last allocation time in microseconds, seconds waited)``.
    """
    t0 = time.monotonic()
    while True:
        now = file_allocation_us(directory)
        waited = time.monotonic() - t0
        if now <= QUIET_FILE_US or waited >= max_wait_seconds:
            return now, waited
        time.sleep(min(10.0, max_wait_seconds - waited))


def containment_modes() -> tuple[tuple[str, ...], str]:
    """The containment modes this machine can run (``cgroup`` where a cgroup v2 is writable), and why
    ``cgroup`` is missing when it is."""
    from engine._cgroup import EngineCgroup, find_cgroup2

    found, why = find_cgroup2()
    if found is None:
        return ("process-group",), why
    probe = tempfile.mkdtemp(prefix="gadget-bench-probe-")
    try:
        cgroup = EngineCgroup.open(found, probe, record=False)
    except OSError as exc:
        return ("process-group",), str(exc)
    finally:
        shutil.rmtree(probe, ignore_errors=True)
    cgroup.close()
    return ("cgroup", "process-group"), ""


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_total() -> str:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return f"{int(line.split()[1]) / 2**20:.1f} GiB"
    except OSError:
        pass
    return "unknown"


def _version(module: str) -> str:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:
        return "not installed"


def machine(tmp: str) -> dict[str, str]:
    """What the numbers were measured on."""
    fs = subprocess.run(["df", "-T", tmp], capture_output=True, text=True, check=False).stdout.splitlines()
    return {
        "nproc": str(os.cpu_count()),
        "cpu": _cpu_model(),
        "memory": _mem_total(),
        "kernel": platform.release(),
        "python": sys.version.split()[0],
        "trio": _version("trio"),
        "supervisor": _version("supervisor"),
        "scratch filesystem": fs[-1].split()[1] if len(fs) > 1 else "unknown",
        "free disk": f"{shutil.disk_usage(tmp).free / GiB:.1f} GiB",
    }
