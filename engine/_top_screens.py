"""The screens ``gadget-engine top`` opens over its list: a run's log, followed, and a yes/no question.

The log screen follows one stream of one run full-screen as ``gadget-engine log -f`` does: the last
:data:`TAIL_LINES` lines, then ``subprocess.read_log`` from the previous ``next_offset`` every
:data:`~engine._cli_follow.LOG_FOLLOW_SECONDS`, until the run has exited and its log is drained, it is
killed (its logs deleted) or the engine goes away. Output is drawn without the terminal escapes it may
hold (:mod:`engine._termtext`).

Imports Textual: loaded only by ``gadget-engine top``.
"""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar, Final

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen, Screen
from textual.widgets import Log, Static

from ._cli_follow import LOG_FOLLOW_SECONDS
from ._cli_output import user_message
from ._errors import SubProcessNotFoundError
from ._termtext import printable
from ._top_model import RunRow, fit
from .server._client import AsyncEngineClient, EngineConnectionError, EngineNotRunningError

__all__ = ["TAIL_LINES", "Confirm", "LogScreen"]

#: How many lines of history the log screen starts with.
TAIL_LINES: Final = 500
#: The most a read asks for, in bytes.
_PAGE_BYTES: Final = 1024 * 1024
#: The most lines the log screen keeps.
_MAX_LINES: Final = 20000


class Confirm(ModalScreen[bool]):
    """A question answered with ``y`` (yes) or ``n`` / Escape (no)."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("y", "answer(True)", "yes"),
        Binding("n,escape", "answer(False)", "no"),
    ]
    DEFAULT_CSS = """
    Confirm { align: center middle; }
    Confirm > Vertical {
        width: 64; max-width: 100%; height: auto;
        border: thick $error; background: $surface; padding: 0 1;
    }
    Confirm .answer { color: $text-muted; }
    """

    def __init__(self, question: str) -> None:
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static(self.question, markup=False)
            yield Static("y: yes   n: no", classes="answer")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)


class LogScreen(Screen[None]):
    """One run's log, followed full-screen (``s`` switches stdout and stderr, Escape goes back)."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,q,l", "back", "back"),
        Binding("s", "switch", "stdout/stderr"),
    ]
    DEFAULT_CSS = """
    LogScreen #log-title { height: 1; background: $primary; color: $text; text-style: bold; }
    LogScreen #log-keys { height: 1; color: $text-muted; }
    LogScreen Log { height: 1fr; border: none; padding: 0; }
    """

    def __init__(self, state_dir: str, row: RunRow, stream: str = "stdout") -> None:
        super().__init__()
        self.state_dir = state_dir
        self.row = row
        self.stream = stream
        self.ended = ""
        self._partial = ""

    def compose(self) -> ComposeResult:
        yield Static(id="log-title", markup=False)
        yield Log(max_lines=_MAX_LINES, id="log")
        yield Static("esc back   s stdout/stderr   ↑↓ PgUp PgDn scroll", id="log-keys", markup=False)

    def on_mount(self) -> None:
        self._show_title()
        self.query_one(Log).focus()
        self._start()

    def on_resize(self) -> None:
        self._show_title()

    def _show_title(self) -> None:
        state = f"  [{self.ended}]" if self.ended else "  following"
        head = f"log {self.row.pid} {self.stream} ({self.row.project}): {self.row.command}"
        width = max(0, self.size.width - len(state))
        self.query_one("#log-title", Static).update(fit(head, width) + state)

    def _start(self) -> None:
        self.ended = ""
        self._partial = ""
        self.query_one(Log).clear()
        self._show_title()
        self.run_worker(self._follow(self.stream), group="follow", exclusive=True, exit_on_error=False)

    def action_back(self) -> None:
        self.dismiss(None)

    def action_switch(self) -> None:
        self.stream = "stderr" if self.stream == "stdout" else "stdout"
        self._start()

    def _write(self, text: str, *, flush: bool) -> None:
        """Write the whole lines of ``text``; a last line without its newline is held until the next
        read, and written as it is when that read brought nothing (``flush``): a prompt shows too."""
        log = self.query_one(Log)
        body, newline, rest = (self._partial + text).rpartition("\n")
        if newline:
            log.write(printable(body) + "\n")
        if rest and flush:
            log.write(printable(rest))  # the log's last line stays open: what follows goes on it
            rest = ""
        self._partial = rest

    async def _follow(self, stream: str) -> None:
        """Read the tail, then on from each ``next_offset``, until the end; the reason in the title.

        Cancellation: the connection is closed (leaving the screen, switching the stream).
        """
        async with AsyncEngineClient(self.state_dir) as client:
            try:
                piece: dict[str, Any] = await client.call(
                    "subprocess.read_log",
                    pid=self.row.pid,
                    stream=stream,
                    tail=TAIL_LINES,
                    max_bytes=_PAGE_BYTES,
                )
                self._write(piece["text"], flush=False)
                while piece["running"] or piece["next_offset"] < piece["total_bytes"]:
                    await asyncio.sleep(LOG_FOLLOW_SECONDS)
                    piece = await client.call(
                        "subprocess.read_log",
                        pid=self.row.pid,
                        stream=stream,
                        offset=piece["next_offset"],
                        max_bytes=_PAGE_BYTES,
                    )
                    self._write(piece["text"], flush=not piece["text"])
                self._write("", flush=True)
                self.ended = "exited"
            except SubProcessNotFoundError:
                self.ended = "killed; its logs are deleted"
            except (EngineConnectionError, EngineNotRunningError) as exc:
                self.ended = f"engine gone: {user_message(exc)}"
        self._show_title()
