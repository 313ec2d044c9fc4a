"""``gadget-engine top``: the live view, a Textual application over the engine's socket.

Once a second (never more often: :data:`MIN_REFRESH_SECONDS`) it asks the engine for ``status``,
``subprocess.stats`` and ``cron.list`` on one connection, and redraws what :mod:`engine._top_model` makes
of the answers; a refresh still under way when the next is due is not doubled. Kill and halt go over a
connection of their own (a kill waits out the grace period), the log screen over a third. An engine
that does not answer is named on the status line; one whose process is stopped (SIGSTOP, Ctrl-Z) with
the ``kill -CONT`` that continues it, short enough for 80 columns (:func:`suspended_line`).

Keys: arrows (and PgUp, PgDn, Home, End) select a run; ``l`` follows its log; ``h`` halts it and ``k``
kills it, each after a yes/no question; ``/`` filters the projects (Enter keeps the filter, Escape clears
it); ``q`` quits. The layout follows the terminal's size (:data:`~engine._top_model.WIDE_COLUMNS`).

Imports Textual: loaded only by ``gadget-engine top`` (``engine._top``).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any, ClassVar, Final

from rich.text import Text
from textual import on
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.widgets import Input, OptionList, Static
from textual.widgets.option_list import Option

from ._cli_output import user_message
from ._errors import EngineError
from ._top_model import EngineLine, Group, JobRow, RunRow, fit, group_runs, job_lines, run_header, run_lines
from ._top_screens import Confirm, LogScreen
from .server._client import AsyncEngineClient, EngineNotRunningError, EngineSuspendedError

__all__ = ["MIN_REFRESH_SECONDS", "TopApp", "suspended_line"]

#: The shortest time between two refreshes, in seconds.
MIN_REFRESH_SECONDS: Final = 1.0
#: The most cron jobs listed under the runs (the rest are counted).
MAX_JOB_LINES: Final = 6
KEYS: Final = "↑↓ select  l log  h halt  k kill  / filter  q quit"
_STATUS_STYLES: Final = {"running": "green", "stopping": "yellow", "restarting": "yellow", "exit 0": "dim"}
#: Where the status cell of a run's line starts, and its width (``_top_model``'s columns).
_STATUS_AT: Final = (8, 18)


def suspended_line(pid: int) -> str:
    """The status line for an engine whose process is stopped (SIGSTOP, Ctrl-Z): the ``kill -CONT`` that
    continues it, within 80 columns for any pid (``pid_max`` is at most 2**22, 7 digits)."""
    return f"engine stopped (SIGSTOP or Ctrl-Z): continue it with kill -CONT {pid}"


class RunList(OptionList):
    """The runs, one option each (one or two lines), under a disabled heading per project."""

    DEFAULT_CSS = """
    RunList, RunList:focus { border: none; padding: 0; height: 1fr; max-height: 100%; background: $surface; }
    RunList > .option-list--option { padding: 0; }
    RunList > .option-list--option-disabled { color: $text; text-style: bold; }
    """


class TopApp(App[int]):
    """The live view of one engine.

    Args:
        state_dir: the engine's state directory.
        needle: the project filter to start with (``""``: every project).
        refresh_seconds: how often to ask the engine (at least :data:`MIN_REFRESH_SECONDS`).
    """

    TITLE = "gadget-engine top"
    ENABLE_COMMAND_PALETTE = False
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("q", "quit", "quit"),
        Binding("ctrl+c", "quit", "quit", priority=True, show=False),
        Binding("l", "follow", "log"),
        Binding("h", "stop('subprocess.halt')", "halt"),
        Binding("k", "stop('subprocess.kill')", "kill"),
        Binding("slash", "filter", "filter"),
        Binding("escape", "clear_filter", "clear filter", show=False),
    ]
    CSS = """
    #title { height: 1; background: $primary; color: $text; text-style: bold; }
    #title.-error { background: $error; }
    #header, #jobs-title { height: 1; color: $text-muted; text-style: bold; }
    #jobs { height: auto; }
    #filter { display: none; height: 1; border: none; padding: 0; }
    #filter.-shown { display: block; }
    #keys { height: 1; color: $text-muted; }
    """

    def __init__(self, state_dir: str, *, needle: str = "", refresh_seconds: float = 1.0) -> None:
        super().__init__()
        self.state_dir = state_dir
        self.needle = needle
        self.refresh_seconds = max(MIN_REFRESH_SECONDS, refresh_seconds)
        self.rows: list[RunRow] = []
        self.jobs: list[JobRow] = []
        self.engine: EngineLine | None = None
        self.error = ""
        self.refreshes = 0
        self._client = AsyncEngineClient(state_dir)
        self._busy = False
        self._ids: list[str | None] = []
        self._view_mounted = False

    def compose(self) -> ComposeResult:
        yield Static(id="title", markup=False)
        yield Static(id="header", markup=False)
        yield RunList(id="runs")
        yield Static(id="jobs", markup=False)
        yield Input(placeholder="filter by project (Enter keeps it, Escape clears it)", id="filter")
        yield Static(KEYS, id="keys", markup=False)

    def on_mount(self) -> None:
        self._view_mounted = True
        self.query_one(RunList).focus()
        self.set_interval(self.refresh_seconds, self._tick)
        self._tick()

    async def on_unmount(self) -> None:
        """Close the refresh connection.

        Cancellation: the connection is closed at once (``AsyncEngineClient.aclose``).
        """
        await self._client.aclose()

    def on_resize(self) -> None:
        self.redraw()

    # ---- the data --------------------------------------------------------------------------------

    def _tick(self) -> None:
        if not self._busy:  # a slow answer is never asked for twice
            self._busy = True
            self.run_worker(self._fetch(), group="refresh", exit_on_error=False)

    async def _fetch(self) -> None:
        """Ask for ``status``, ``subprocess.stats`` and ``cron.list``, keep the answers, redraw.

        Cancellation: the connection is dropped (the next refresh opens a new one); nothing is kept.
        """
        try:
            status = await self._client.call("status")
            stats = await self._client.call("subprocess.stats")
            jobs = await self._client.call("cron.list")
        except EngineNotRunningError as exc:  # stopped: its runs were ended with it
            self.error = f"engine not running: {user_message(exc)}"
            self.engine, self.rows, self.jobs = None, [], []
        except EngineSuspendedError as exc:  # the client's whole sentence would cut the hint at 80 columns
            self.error = suspended_line(exc.pid)
        except (EngineError, OSError) as exc:
            self.error = f"engine not answering: {user_message(exc)}"
        else:
            self.error = ""
            self.engine = EngineLine.from_status(status)
            self.rows = [RunRow.from_stats(entry) for entry in stats]
            self.jobs = [JobRow.from_job(job) for job in jobs]
        finally:
            self._busy = False
        self.refreshes += 1
        self.redraw()

    # ---- drawing ---------------------------------------------------------------------------------

    def _groups(self) -> list[Group]:
        return group_runs(self.rows, self.needle)

    def _shown_jobs(self, groups: Sequence[Group]) -> list[JobRow]:
        if not self.needle:
            return self.jobs
        ids = {g.project_id for g in groups}
        return [job for job in self.jobs if job.project_id is None or job.project_id in ids]

    def redraw(self) -> None:
        """Draw the title, the runs and the jobs from the last answers, at the screen's width."""
        if not self._view_mounted:
            return
        runs = self.query_one(RunList)
        width = self.size.width
        list_width = runs.scrollable_content_region.width or width
        groups = self._groups()
        restarts = any(row.restarts is not None for row in self.rows)
        title = self.query_one("#title", Static)
        title.set_class(bool(self.error), "-error")
        if self.error:
            title.update(fit(self.error, width))
        elif self.engine is None:
            title.update(fit("gadget-engine top  asking the engine...", width))
        else:
            title.update(self.engine.text(self.rows, self.jobs, self.needle, width))
        self.query_one("#header", Static).update(run_header(width, restarts=restarts))
        self._fill(runs, groups, list_width, restarts)
        jobs = self._shown_jobs(groups)
        lines = job_lines(jobs[:MAX_JOB_LINES], width, datetime.now(UTC))
        if len(jobs) > MAX_JOB_LINES:
            lines.append(f"... and {len(jobs) - MAX_JOB_LINES} more (gadget-engine cron list)")
        text = Text("\n".join(lines[1:]))
        self.query_one("#jobs", Static).update(Text(lines[0] + "\n", style="bold dim") + text)

    def _fill(self, runs: RunList, groups: Sequence[Group], width: int, restarts: bool) -> None:
        options: list[Option] = []
        for group in groups:
            heading = Text(group.project, style="bold")
            heading.append(f"  {group.directory}", style="dim")
            heading.truncate(width, overflow="ellipsis")
            options.append(Option(heading, id=f"project:{group.project_id}", disabled=True))
            for row in group.runs:
                options.append(Option(self._run_text(row, width, restarts), id=self._run_id(row, options)))
        if not groups:
            empty = "no runs match the filter" if self.needle and self.rows else "no runs"
            options.append(Option(Text(empty, style="dim"), id="empty", disabled=True))
        ids = [option.id for option in options]
        chosen = runs.highlighted_option.id if runs.highlighted_option is not None else None
        if ids == self._ids:
            for at, option in enumerate(options):
                runs.replace_option_prompt_at_index(at, option.prompt)
        else:
            self._ids = ids
            runs.set_options(options)
            self._highlight(runs, ids, chosen)

    @staticmethod
    def _run_id(row: RunRow, options: Sequence[Option]) -> str:
        base = f"run:{row.pid}"
        taken = {option.id for option in options}
        return base if base not in taken else f"{base}:{len(options)}"

    @staticmethod
    def _highlight(runs: RunList, ids: Sequence[str | None], chosen: str | None) -> None:
        """Keep the highlight on the run it was on, else on the first run."""
        selectable = [at for at, key in enumerate(ids) if key is not None and key.startswith("run:")]
        if not selectable:
            return
        runs.highlighted = ids.index(chosen) if chosen in ids else selectable[0]
        runs.scroll_to_highlight()

    @staticmethod
    def _run_text(row: RunRow, width: int, restarts: bool) -> Text:
        first, *rest = run_lines(row, width, restarts=restarts)
        text = Text(first)
        style = _STATUS_STYLES.get(row.status, "yellow" if row.alive else "red")
        text.stylize(style, *_STATUS_AT)
        for line in rest:
            text.append("\n" + line, style="red dim" if row.last_stream == "stderr" else "dim")
        return text

    # ---- actions ---------------------------------------------------------------------------------

    def selected(self) -> RunRow | None:
        """The highlighted run, or ``None``."""
        option = self.query_one(RunList).highlighted_option
        if option is None or option.id is None or not option.id.startswith("run:"):
            return None
        pid = int(option.id.split(":")[1])
        return next((row for row in self.rows if row.pid == pid), None)

    def action_follow(self) -> None:
        row = self.selected()
        if row is None:
            self.notify("select a run first", severity="warning")
            return
        self.push_screen(LogScreen(self.state_dir, row))

    def action_stop(self, method: str) -> None:
        row = self.selected()
        if row is None:
            self.notify("select a run first", severity="warning")
            return
        verb = "kill" if method == "subprocess.kill" else "halt"
        what = "Its logs are deleted." if verb == "kill" else "Its logs are kept."
        question = f"{verb.capitalize()} {row.pid} of {row.project}?\n{fit(row.command, 60)}\n{what}"

        def answered(yes: bool | None) -> None:
            if yes:
                self.run_worker(self._stop(method, verb, row), group="actions", exit_on_error=False)

        self.push_screen(Confirm(question), answered)

    async def _stop(self, method: str, verb: str, row: RunRow) -> None:
        """Kill or halt ``row`` on a connection of its own, and say how it went.

        Cancellation: the connection is dropped; a request the engine received completes there.
        """
        try:
            async with AsyncEngineClient(self.state_dir) as client:
                result: dict[str, Any] = await client.call(method, pid=row.pid)
        except (EngineError, OSError) as exc:
            self.notify(f"{verb} {row.pid}: {user_message(exc)}", severity="error")
            return
        done = f"{verb}ed {row.pid}"
        if not result.get("stopped"):
            done += " (it had already stopped)"
        self.notify(done)

    def action_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.value = self.needle
        box.add_class("-shown")
        self.query_one("#keys").display = False
        box.focus()

    def action_clear_filter(self) -> None:
        box = self.query_one("#filter", Input)
        if box.has_class("-shown") or self.needle:
            self.needle = ""
            self._close_filter()

    def _close_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.remove_class("-shown")
        self.query_one("#keys").display = True
        self.query_one(RunList).focus()
        self.redraw()

    @on(Input.Changed, "#filter")
    def _filter_changed(self, event: Input.Changed) -> None:
        self.needle = event.value.strip()
        self.redraw()

    @on(Input.Submitted, "#filter")
    def _filter_kept(self, event: Input.Submitted) -> None:
        self.needle = event.value.strip()
        self._close_filter()

    async def action_quit(self) -> None:
        """Quit with exit code 0.

        Cancellation: not a concern (nothing is awaited).
        """
        self.exit(0)
