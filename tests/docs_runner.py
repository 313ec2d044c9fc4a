"""Running the fenced blocks of the docs: reading pages, running shell and Python blocks, comparing output.

A page's fenced blocks are read by their info string:

- ``console``: a terminal session. Lines starting with ``$ `` are commands (a line ending in ``\\`` goes
  on); the lines after one, up to the next, are what it prints (stdout and stderr). A command must exit 0
  unless the page shows what it printed.
- ``bash`` (``sh``, ``shell``): commands without their output; each must exit 0.
- ``python``: a whole program, run with the test's interpreter; it must exit 0. An ``output`` block right
  after it is what it prints on stdout.
- ``output``, ``text``, ``usage``, ``json``: shown, never run (``text`` and ``usage`` are checked not to
  hide a command: see :func:`hidden_command`).

Example values stand for real ones. In what a block runs: a path under ``/tmp/`` is one of the page's
scratch folders (under the test's ``tmp_path``), ``/home/me`` is the test's home folder (``~``), port
``8000`` is a free port, and a value a page showed
in an earlier output (a pid, a job id) is the value the product printed there. In what a page shows,
before comparing: a time (``2026-05-01 12:00:00 UTC``, ISO 8601), a decimal (``1.5``) and a duration
(``1m5s``) match any; a number of three digits or more and a 12-hex-digit id match any value the first
time (binding it) and the bound value after that; ``...`` alone on a line matches any lines, ``...`` in a
line any text; runs of blanks match runs of blanks. The real home, scratch folder and port are written
back as ``/home/me``, ``/tmp`` and ``8000`` first.
"""

from __future__ import annotations

import os
import re
import select
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Final

import attrs

#: Info strings of the blocks that run.
SHELL_KINDS: Final = frozenset({"console", "bash", "sh", "shell"})
RUN_KINDS: Final = SHELL_KINDS | {"python"}
#: Info strings of the blocks that are only shown.
SHOWN_KINDS: Final = frozenset({"output", "text", "usage", "json"})

#: How long a follower (``-f``, ``--follow``) or a foreground ``serve`` runs before SIGINT, in seconds.
FOLLOW_SECONDS: Final = 3.0
#: How long a follower may run while the lines its page shows have not all come yet, in seconds.
FOLLOW_MAX_SECONDS: Final = 30.0
_FOLLOW_UNTIL: Final = Path(__file__).with_name("follow_until.py")
#: How long any one block may run, in seconds.
BLOCK_SECONDS: Final = 90.0
#: The home folder and port pages show.
DOC_HOME: Final = "/home/me"
DOC_PORT: Final = "8000"

_MARK = "@@docs-test-exit@@"
_FENCE = re.compile(r"^(?P<indent> *)```(?P<info>[^`]*)$")


@attrs.frozen
class Block:
    """One fenced block of a page.

    Attributes:
        page: the page's path, relative to the checkout.
        line: the line of its opening fence (1-based).
        kind: its info string's first word (``""`` when it has none).
        text: its content, the fence's indentation removed.
    """

    page: str
    line: int
    kind: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def first_line(self) -> str:
        return next((line.strip() for line in self.text.splitlines() if line.strip()), "")


def read_blocks(path: Path, root: Path) -> list[Block]:
    """Every fenced block of the Markdown page at ``path``, in order."""
    blocks: list[Block] = []
    lines = path.read_text().splitlines()
    at = 0
    while at < len(lines):
        opening = _FENCE.match(lines[at])
        if opening is None:
            at += 1
            continue
        indent = len(opening["indent"])
        body: list[str] = []
        end = at + 1
        while end < len(lines) and lines[end].strip() != "```":
            body.append(lines[end][indent:] if lines[end][:indent].strip() == "" else lines[end])
            end += 1
        info = opening["info"].strip().split()
        text = "\n".join(body) + "\n"
        blocks.append(Block(str(path.relative_to(root)), at + 1, info[0] if info else "", text))
        at = end + 1
    return blocks


def hidden_command(block: Block) -> str | None:
    """Why a ``text`` or ``usage`` block looks like something to run, or ``None``.

    A ``text`` block may not start with a prompt, a ``gadget-engine`` command or Python code; a ``usage``
    line must show a metavariable (``DIR``, ``[--json]``) so that it is a synopsis, not a command.
    """
    first = block.first_line
    if block.kind == "text" and first.startswith(("$ ", "gadget-engine ", "import ", "from ", "python")):
        return (
            f"{block.where}: a text block that starts like a command ({first!r}); label it console or python"
        )
    if block.kind == "usage":
        for line in block.text.splitlines():
            if line.strip() and not re.search(r"\[|\b[A-Z][A-Z_]+\b", line):
                return f"{block.where}: a usage line without a metavariable ({line.strip()!r}): a command?"
    return None


# ---- commands --------------------------------------------------------------------------------------


@attrs.frozen
class Command:
    """One command of a shell block and what the page shows it printing (``None``: nothing shown)."""

    text: str
    shown: str | None


def commands(block: Block) -> list[Command]:
    """The commands of a ``console`` or ``bash`` block (comments and blank lines of ``bash`` skipped)."""
    found: list[Command] = []
    lines = block.text.splitlines()
    at = 0
    while at < len(lines):
        line = lines[at]
        at += 1
        if block.kind == "console":
            if not line.startswith("$ "):
                raise ValueError(f"{block.where}: output before the first command: {line!r}")
            line = line[2:]
        elif not line.strip() or line.lstrip().startswith("#"):
            continue
        while line.endswith("\\") and at < len(lines):
            line += "\n" + lines[at].removeprefix("> ")  # bash reads the backslash-newline itself
            at += 1
        shown: list[str] = []
        while block.kind == "console" and at < len(lines) and not lines[at].startswith("$ "):
            shown.append(lines[at])
            at += 1
        text = "\n".join(shown).rstrip("\n")
        found.append(Command(line, text + "\n" if text else None))
    return found


def bounded(command: str) -> bool:
    """Whether ``command`` runs until stopped: a follower (``-f``, ``--follow``) or a foreground ``serve``."""
    try:
        words = shlex.split(command, comments=True)
    except ValueError:
        return False
    return bool({"-f", "--follow"} & set(words)) or (words[:1] == ["gadget-engine"] and "serve" in words)


# ---- example values ---------------------------------------------------------------------------------


@attrs.define
class Values:
    """The page's example values and the real ones they stand for.

    Attributes:
        home: the real home folder (shown as ``/home/me``).
        scratch: where the page's ``/tmp/...`` folders really are.
        port: the real port of the page's ``8000``.
        bound: example value -> real value, from the outputs compared so far.
    """

    home: Path
    scratch: Path
    port: int
    bound: dict[str, str] = attrs.Factory(dict)

    def into_run(self, text: str) -> str:
        """``text`` as it runs: scratch folders, the port and bound values replaced."""
        text = re.sub(r"(?<![\w.~])/tmp/(?=[\w.-])", f"{self.scratch}/", text)
        text = re.sub(rf"(?<![\w.~]){DOC_HOME}(?=/|\b)", str(self.home), text)
        text = re.sub(rf"(?<!\d){DOC_PORT}(?!\d)", str(self.port), text)
        for example, real in sorted(self.bound.items(), key=lambda item: -len(item[0])):
            text = re.sub(rf"(?<![\w]){re.escape(example)}(?![\w])", real, text)
        return text

    def from_run(self, text: str) -> str:
        """What the product printed, with the real home, scratch folder and port as a page shows them."""
        text = text.replace(str(self.scratch), "/tmp").replace(str(self.home), DOC_HOME)
        return re.sub(rf"(?<!\d){self.port}(?!\d)", DOC_PORT, text)


_TIME = (
    r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d(?::\d\d(?:\.\d+)?)?"  # a date and a time, then a zone if any:
    r"(?:Z|[+-]\d\d:?\d\d|\s[A-Z][A-Za-z]{1,4}(?:[+-]\d\d?(?::\d\d)?)?)?"  # Z, +01:00, UTC, CEST, UTC+02:00
)
_TOKENS = re.compile(
    rf"(?P<time>{_TIME})"
    r"|(?P<duration>(?<![\w.])(?:\d+(?:\.\d+)?[dhms])+(?![\w]))"
    r"|(?P<decimal>(?<![\w.])\d+\.\d+(?!\w|\.\d))"
    r"|(?P<hexid>(?<![\w])(?=[0-9a-f]{0,11}[a-f])(?=[0-9a-f]{0,11}\d)[0-9a-f]{12}(?![\w]))"
    r"|(?P<number>(?<!\d)(?<!\d\.)\d{3,}(?!\d|\.\d))"
    r"|(?P<ellipsis>\.\.\.)"
    r"|(?P<blank>[ \t]+)"
)
_VARIABLE = {
    "time": _TIME,
    "duration": r"(?:\d+(?:\.\d+)?[dhms])+",
    "decimal": r"\d+(?:\.\d+)?",
    "ellipsis": r".*?",
    "blank": r"[ \t]+",
}


def _line_pattern(line: str, values: Values, order: list[str]) -> str:
    out: list[str] = []
    at = 0
    for token in _TOKENS.finditer(line):
        out.append(re.escape(line[at : token.start()]))
        kind = token.lastgroup
        assert kind is not None
        if kind in ("hexid", "number"):
            example = token.group()
            if example in values.bound:
                out.append(re.escape(values.bound[example]))
            else:
                order.append(example)
                out.append(r"([0-9a-f]{12})" if kind == "hexid" else r"(\d+)")
        else:
            out.append(_VARIABLE[kind])
        at = token.end()
    out.append(re.escape(line[at:]))
    return "".join(out)


def matches(shown: str, printed: str, values: Values) -> bool:
    """Whether ``printed`` (already through :meth:`Values.from_run`) is what a page ``shown``.

    On a match, the example values first met in ``shown`` are bound to what was printed in their place.
    """
    order: list[str] = []
    parts = []
    for line in shown.rstrip("\n").split("\n"):
        if line.strip() == "...":
            parts.append(r"(?:[^\n]*\n)*?")
        else:
            parts.append(_line_pattern(line.rstrip(), values, order) + r"[ \t]*\n")
    normal = "\n".join(line.rstrip() for line in printed.rstrip("\n").split("\n")) + "\n"
    found = re.fullmatch("".join(parts), normal)
    if found is None:
        return False
    for example, real in zip(order, found.groups(), strict=True):
        values.bound.setdefault(example, real)
    return True


# ---- running ------------------------------------------------------------------------------------------


@attrs.frozen
class Ran:
    """One command as it ran: what it printed (stdout and stderr) and its exit status."""

    command: Command
    printed: str
    status: int


def run_shell(
    block: Block, values: Values, env: Mapping[str, str], cwd: Path
) -> Iterator[tuple[Command, str, int]]:
    """Run a shell block's commands one by one in one bash (in ``cwd``); yield each, its output and status.

    A command is made runnable (:meth:`Values.into_run`) only when the one before it has been yielded, so
    it can use the values bound from that one's output. A bounded command (:func:`bounded`) gets SIGINT
    once it printed as many lines as the page shows and :data:`FOLLOW_SECONDS` passed, or at
    :data:`FOLLOW_MAX_SECONDS` (``tests/follow_until.py``); that ending counts as 0. Commands read
    ``/dev/null``.
    """
    shell = subprocess.Popen(
        ["bash"],
        cwd=cwd,
        env=dict(env),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    assert shell.stdin is not None and shell.stdout is not None
    deadline = time.monotonic() + BLOCK_SECONDS
    try:
        for cmd in commands(block):
            text = values.into_run(cmd.text)
            if bounded(text):
                # Until it printed the lines the page shows (a fire may take a while on a busy machine),
                # at least FOLLOW_SECONDS, at most FOLLOW_MAX_SECONDS; then Ctrl-C, as the reader's.
                shown = len((cmd.shown or "").splitlines())
                text = (
                    f"{shlex.quote(sys.executable)} {shlex.quote(str(_FOLLOW_UNTIL))} {shown} "
                    f"{FOLLOW_SECONDS:g} {FOLLOW_MAX_SECONDS:g} -- bash -c {shlex.quote(text)}; s=$?"
                )
            else:
                text = f"{text}\ns=$?"
            shell.stdin.write(f"{{ {text}\n}} </dev/null\nprintf '\\n{_MARK} %d\\n' \"$s\"\n".encode())
            shell.stdin.flush()
            printed, status = _read_until_mark(shell.stdout, deadline, block)
            yield cmd, printed, status
    finally:
        shell.stdin.close()
        try:
            shell.wait(timeout=10)
        except subprocess.TimeoutExpired:
            shell.kill()
            shell.wait()
        shell.stdout.close()


def _read_until_mark(stream: IO[bytes], deadline: float, block: Block) -> tuple[str, int]:
    data = b""
    mark = re.compile(rf"\n{_MARK} (\d+)\n".encode())
    while (found := mark.search(data)) is None:
        ready, _, _ = select.select([stream], [], [], max(0.0, deadline - time.monotonic()))
        chunk = os.read(stream.fileno(), 65536) if ready else b""
        if not chunk:
            raise AssertionError(f"{block.where}: the block ended or ran past {BLOCK_SECONDS:g} s: {data!r}")
        data += chunk
    text = data[: found.start()].decode(errors="replace")
    return text, int(found.group(1))


def run_python(
    block: Block, values: Values, env: Mapping[str, str], cwd: Path, python: str
) -> tuple[str, str, int]:
    """Run a Python block as a program (in ``cwd``); its stdout, stderr and exit status."""
    path = values.scratch / f"block-{block.line}.py"
    path.write_text(values.into_run(block.text))
    out = subprocess.run(
        [python, str(path)],
        env=dict(env),
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=BLOCK_SECONDS,
        check=False,
    )
    return out.stdout, out.stderr, out.returncode
