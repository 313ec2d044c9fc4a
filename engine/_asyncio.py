"""Embedding in asyncio: the engine runs on the host's own thread as a Trio guest.

::

    async def main() -> None:
        async with open_asyncio_engine(EngineConfig(state_dir="/tmp/state")) as engine:
            summary = await engine.create("/my/app", "npm", ["run", "dev"])
            print((await engine.read_log(summary.pid, tail=20)).text)
            async for event in engine.events():
                print(event.text)

    asyncio.run(main())

:func:`open_asyncio_engine` starts :func:`~engine.open_engine` with
``trio.lowlevel.start_guest_run`` (Trio's guest mode: Trio's scheduler runs its ticks as callbacks of the
host's loop, through ``loop.call_soon_threadsafe``, and waits for I/O in a helper thread), so engine code
and asyncio code take turns on one thread. A call such as :meth:`AsyncioEngine.kill` hands a Trio
function to a task of the guest run (through the run's ``TrioToken``) and awaits an asyncio future that
task resolves. Cancelling the asyncio caller cancels that Trio task; the caller then waits until it has
finished (a kill still ends and reaps its process) before its ``CancelledError`` propagates.

The guest run belongs to an asyncio task. Leaving the ``async with`` block stops the engine (every child
ended and reaped, but the commands of on-exit jobs: a graceful stop leaves them running for the next
engine to adopt) before the block's exit returns; so does the end of ``asyncio.run`` (it cancels that
task and waits for it) if the block was never left.
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, Final, TypeVar, final

import attrs
import outcome
import trio

from ._config import EngineConfig
from ._engine import Engine, open_engine
from ._errors import EngineError
from ._logs import LogSlice
from ._project import Project
from ._readiness import ReadyCheck
from ._restart import RestartPolicy
from ._subprocesses import SubProcessSummary
from .cron._events import FiredEvent
from .cron._job import CronJob, Payload
from .cron._schedule import Schedule

__all__ = ["AsyncioEngine", "EngineClosedError", "open_asyncio_engine"]

T = TypeVar("T")

_CLOSED: Final = None  # the events queue's end marker


class EngineClosedError(EngineError, RuntimeError):
    """Raised by :class:`AsyncioEngine` methods called after the engine stopped (or while it stops)."""


async def _wait_through_cancellation(future: asyncio.Future[Any]) -> None:
    """Wait until ``future`` is done even if the caller is cancelled meanwhile; then re-raise that.

    For shutdown paths that must not be cut short: asyncio's counterpart of a shielded cancel scope.
    """
    interrupted = False
    while not future.done():
        try:
            await asyncio.wait([future])
        except asyncio.CancelledError:
            interrupted = True
    if interrupted:
        raise asyncio.CancelledError


@final
@attrs.define(eq=False)
class AsyncioEngine:
    """An engine running as a Trio guest on an asyncio loop, as yielded by :func:`open_asyncio_engine`.

    Every method is called from asyncio code on the loop that opened it. Values come back frozen
    (:class:`SubProcessSummary`, :class:`LogSlice`, :class:`CronJob`, :class:`FiredEvent`), safe to keep.

    Attributes:
        config: the :class:`EngineConfig` in force.
    """

    config: EngineConfig
    _loop: asyncio.AbstractEventLoop = attrs.field(alias="loop")
    _events: asyncio.Queue[FiredEvent | None] = attrs.field(init=False, factory=asyncio.Queue)
    _engine: Engine | None = attrs.field(init=False, default=None)
    _token: trio.lowlevel.TrioToken | None = attrs.field(init=False, default=None)
    _nursery: trio.Nursery | None = attrs.field(init=False, default=None)
    _stop: trio.CancelScope = attrs.field(init=False, factory=trio.CancelScope)

    def __repr__(self) -> str:
        state = "running" if self._nursery is not None else "stopped"
        return f"<AsyncioEngine {self.config.resolved_state_dir()!r}: {state}>"

    @property
    def state_dir(self) -> str:
        """The absolute state directory the engine holds."""
        return self.config.resolved_state_dir()

    # ---- the bridge --------------------------------------------------------------------------------

    async def _guest_main(self, started: asyncio.Future[None]) -> None:
        async def deliver(event: FiredEvent) -> None:
            self._events.put_nowait(event)  # no lock needed: this is the host loop's own thread
            await trio.lowlevel.checkpoint()

        try:
            async with open_engine(self.config, on_fire=deliver) as engine, trio.open_nursery() as nursery:
                self._engine, self._nursery = engine, nursery
                self._token = trio.lowlevel.current_trio_token()
                if not started.done():
                    started.set_result(None)
                with self._stop:
                    await trio.sleep_forever()
                self._nursery = None
                nursery.cancel_scope.cancel()  # calls still under way: cancelled, each resolved
        finally:
            self._nursery = None
            self._events.put_nowait(_CLOSED)

    def _request_stop(self) -> None:
        if self._token is not None:
            try:
                self._token.run_sync_soon(self._stop.cancel)
            except trio.RunFinishedError:
                pass  # already over
        else:
            self._stop.cancel()  # not started yet: the guest run stops as soon as it enters

    def _start_call(
        self,
        fn: Callable[[Engine], Awaitable[T]],
        future: asyncio.Future[T],
        scope: trio.CancelScope,
    ) -> None:
        """In the guest run: start the Trio task of one call (or fail it if the engine is stopping)."""
        if self._nursery is None or self._engine is None:
            if not future.done():
                future.set_exception(EngineClosedError("the engine is stopping; no new calls"))
            return
        self._nursery.start_soon(self._run_call, fn, self._engine, future, scope)

    @staticmethod
    async def _run_call(
        fn: Callable[[Engine], Awaitable[T]],
        engine: Engine,
        future: asyncio.Future[T],
        scope: trio.CancelScope,
    ) -> None:
        finished = False
        value: Any = None
        try:
            with scope:
                value = await fn(engine)
                finished = True
        except Exception as exc:
            if not future.done():
                future.set_exception(exc)
        finally:
            if not future.done():
                if finished:
                    future.set_result(value)
                else:  # cancelled: by the asyncio caller, or by the engine stopping
                    future.cancel()

    async def run(self, fn: Callable[[Engine], Awaitable[T]]) -> T:
        """Run the Trio function ``fn(engine)`` in the engine's Trio run and return its result.

        The building block of the other methods, open to hosts that need the full :class:`Engine` API:
        ``await engine.run(lambda e: e.cron.run_now(job_id))``.

        Cancellation: cancels the Trio task; waits until it has finished (cleanup such as a kill's
        escalation completes), then ``CancelledError`` propagates.

        Raises:
            EngineClosedError: the engine has stopped, or stopped during the call.
            Exception: what ``fn`` raised.
        """
        token = self._token
        if token is None or self._nursery is None:
            raise EngineClosedError(f"the engine on {self.state_dir} is not running")
        future: asyncio.Future[T] = self._loop.create_future()
        scope = trio.CancelScope()
        try:
            token.run_sync_soon(self._start_call, fn, future, scope)
        except trio.RunFinishedError:
            raise EngineClosedError(f"the engine on {self.state_dir} has stopped") from None
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            if future.done() and future.cancelled():
                raise EngineClosedError(f"the engine on {self.state_dir} stopped during the call") from None
            try:
                token.run_sync_soon(scope.cancel)
            except trio.RunFinishedError:
                pass
            await _wait_through_cancellation(future)
            raise

    # ---- the service -------------------------------------------------------------------------------

    async def create(
        self,
        project: Project | str | os.PathLike[str],
        command: str,
        args: Sequence[str] = (),
        *,
        env: Mapping[str, str] | None = None,
        stdin: bool = False,
        ready: ReadyCheck | None = None,
        restart: RestartPolicy | None = None,
        notify_on_exit: bool = False,
    ) -> SubProcessSummary:
        """Start ``command args...`` in ``project`` (a :class:`Project` or its directory).

        See ``SubProcessService.create`` (``stdin``, ``ready``, ``restart``, ``notify_on_exit`` too).
        Cancellation: as :meth:`run`.

        Raises:
            SpawnError, LimitExceededError: as ``SubProcessService.create``.
            ValueError: ``project`` is not an absolute directory path.
        """
        chosen = _project(project)

        async def create(engine: Engine) -> SubProcessSummary:
            sp = await engine.service.create(
                chosen,
                command,
                tuple(args),
                env=env,
                stdin=stdin,
                ready=ready,
                restart=restart,
                notify_on_exit=notify_on_exit,
            )
            return engine.service.summarize(sp)

        return await self.run(create)

    async def write_stdin(self, pid: int, data: str | bytes, *, eof: bool = False) -> None:
        """``SubProcessService.write_stdin``: send ``data`` to ``pid``'s stdin (``eof``: then close it).

        Cancellation: as :meth:`run`; wrap the call in ``asyncio.timeout`` for a process that may not read.
        """
        await self.run(lambda engine: engine.service.write_stdin(pid, data, eof=eof))

    async def wait(self, pid: int) -> SubProcessSummary:
        """``SubProcessService.wait``: the summary once ``pid`` has exited for good.

        Cancellation: as :meth:`run`; bound it with ``asyncio.timeout``.
        """
        return await self.run(lambda engine: engine.service.wait(pid))

    async def ps(self) -> list[SubProcessSummary]:
        """Every managed subprocess (live and halted), summarized. Cancellation: as :meth:`run`."""

        async def ps(engine: Engine) -> list[SubProcessSummary]:
            await trio.lowlevel.checkpoint()
            return [engine.service.summarize(sp) for sp in engine.service.ps()]

        return await self.run(ps)

    async def kill(self, pid: int) -> bool:
        """``SubProcessService.kill_pid``: end ``pid``'s tree, delete its logs; ``True`` if it was live.

        Cancellation: as :meth:`run` (the tree is still ended and reaped).
        """
        return await self.run(lambda engine: engine.service.kill_pid(pid))

    async def halt(self, pid: int) -> bool:
        """``SubProcessService.halt_pid``: end ``pid``'s tree, keep its logs. Cancellation: as :meth:`run`."""
        return await self.run(lambda engine: engine.service.halt_pid(pid))

    async def kill_all(self) -> bool:
        """``SubProcessService.kill_all``; ``True`` when every group was verified empty.

        Cancellation: as :meth:`run` (every tree is still ended and reaped).
        """
        return await self.run(lambda engine: engine.service.kill_all())

    async def read_log(
        self,
        pid: int,
        stream: str = "stdout",
        *,
        offset: int | None = None,
        limit: int | None = None,
        tail: int | None = None,
        max_bytes: int = 32768,
        new_only: bool = False,
        grep: str | None = None,
        reader: str = "default",
    ) -> LogSlice:
        """``SubProcessService.read_log``: a bounded slice of one log (``new_only``, ``grep`` too).

        Cancellation: as :meth:`run`.
        """
        return await self.run(
            lambda engine: engine.service.read_log(
                pid,
                stream,
                offset=offset,
                limit=limit,
                tail=tail,
                max_bytes=max_bytes,
                new_only=new_only,
                grep=grep,
                reader=reader,
            )
        )

    async def tool(self, params: Mapping[str, object], project: Project | str | os.PathLike[str]) -> str:
        """The ``subprocess`` agent tool's :meth:`~engine.SubprocessTool.execute`, for ``project``.

        Cancellation: as :meth:`run`.
        """
        chosen = _project(project)
        return await self.run(lambda engine: engine.tool.execute(params, chosen))

    # ---- cron --------------------------------------------------------------------------------------

    async def cron_add(
        self,
        schedule: Schedule,
        payload: Payload,
        *,
        name: str | None = None,
        enabled: bool = True,
        delete_after_run: bool = False,
        project: Project | str | os.PathLike[str] | None = None,
    ) -> CronJob:
        """``CronService.add``; ``project`` (a :class:`Project` or its directory) is stored as its id.

        Cancellation: as :meth:`run`.
        """
        project_id = _project(project).id if project is not None else None
        add = functools.partial(
            _cron_add,
            schedule=schedule,
            payload=payload,
            name=name,
            enabled=enabled,
            once=delete_after_run,
            project=project_id,
        )
        return await self.run(add)

    async def cron_list(self, *, include_disabled: bool = True) -> list[CronJob]:
        """``CronService.list``. Cancellation: as :meth:`run`."""
        return await self.run(lambda engine: engine.cron.list(include_disabled=include_disabled))

    async def cron_remove(self, job_id: str) -> None:
        """``CronService.remove`` (an on-exit job's command ends without firing).

        Cancellation: as :meth:`run`.
        """
        await self.run(lambda engine: engine.cron.remove(job_id))

    async def cron_events(self, since: int = 0) -> list[FiredEvent]:
        """``CronService.events``: the logged events after cursor ``since``. Cancellation: as :meth:`run`."""
        return await self.run(lambda engine: engine.cron.events(since))

    async def events(self) -> AsyncIterator[FiredEvent]:
        """Each event as it fires, from the engine's start until it stops (then the iteration ends).

        Every event is delivered once, to whichever iterator takes it first; events fired before the
        first iteration wait in a queue. After a crash an event can come again (same ``fire_id``).

        Cancellation: safe; an event not yet taken stays queued.
        """
        while True:
            event = await self._events.get()
            if event is None:
                self._events.put_nowait(_CLOSED)  # for any other iterator
                return
            yield event


def _project(project: Project | str | os.PathLike[str]) -> Project:
    return project if isinstance(project, Project) else Project.from_directory(os.fspath(project))


async def _cron_add(
    engine: Engine,
    *,
    schedule: Schedule,
    payload: Payload,
    name: str | None,
    enabled: bool,
    once: bool,
    project: str | None,
) -> CronJob:
    return await engine.cron.add(
        schedule, payload, name=name, enabled=enabled, delete_after_run=once, project=project
    )


async def _guest_run(engine: AsyncioEngine, started: asyncio.Future[None]) -> outcome.Outcome[None]:
    """The task owning the guest run: start it, wait for its end; on cancellation stop it first."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[outcome.Outcome[None]] = loop.create_future()

    def finished(result: outcome.Outcome[None]) -> None:
        if not done.done():
            done.set_result(result)
        if not started.done():
            started.set_exception(EngineClosedError("the engine stopped while starting"))

    trio.lowlevel.start_guest_run(
        engine._guest_main,
        started,
        run_sync_soon_threadsafe=loop.call_soon_threadsafe,
        done_callback=finished,
        # asyncio's Unix loops use signal.set_wakeup_fd for add_signal_handler; Trio must leave it alone.
        host_uses_signal_set_wakeup_fd=True,
    )
    try:
        return await asyncio.shield(done)
    except asyncio.CancelledError:
        engine._request_stop()
        await _wait_through_cancellation(done)
        raise


@asynccontextmanager
async def open_asyncio_engine(config: EngineConfig | None = None) -> AsyncIterator[AsyncioEngine]:
    """Start an engine as a Trio guest on the running asyncio loop; stop it when the block is left.

    Args:
        config: the settings (``None``: all defaults).

    Cancellation: leaving the block by cancellation or error still stops the engine (every child ended
    and reaped, on-exit commands left running for the next engine) before the exception propagates.

    Raises:
        EngineLockedError: another engine holds the state directory.
        RuntimeError: a Trio run is already going on this thread.
    """
    loop = asyncio.get_running_loop()
    engine = AsyncioEngine(config if config is not None else EngineConfig(), loop=loop)
    started: asyncio.Future[None] = loop.create_future()
    owner = loop.create_task(_guest_run(engine, started), name=f"gadget-engine guest {engine.state_dir}")
    try:
        await asyncio.shield(started)
    except BaseException:
        engine._request_stop()
        await _wait_through_cancellation(owner)
        _raise_failure(owner)
        raise
    try:
        yield engine
    finally:
        engine._request_stop()
        await _wait_through_cancellation(owner)
        _raise_failure(owner)


def _raise_failure(owner: asyncio.Task[outcome.Outcome[None]]) -> None:
    """Raise what the engine's Trio run raised, if anything (a failed start or shutdown)."""
    if owner.cancelled():
        return
    result = owner.result()
    if isinstance(result, outcome.Error):
        result.unwrap()
