"""``gadget-engine mcp`` driven by the MCP SDK's own stdio client, as an agent platform runs it.

The client starts ``python -m engine mcp`` with pipes, lists the tools, calls them, and on leaving closes
the server's stdin, waits up to 2 s, then SIGTERM: the embedded engine must be gone before that.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import attrs
import jsonschema  # type: ignore[import-untyped]  # no stubs in the dev extra
import mcp_types as types
import pytest
import trio
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

from engine import EngineConfig, EngineError, Every, Project, SystemEvent, open_engine
from engine._input import read_schedule
from engine._lockfile import STOPPING
from engine.server._client import EngineClient
from engine.server._location import lock_state
from engine.server._mcp import SHUTDOWN_GRACE_SECONDS
from engine.server._mcp_tools import CRON_TOOLS, EmbeddedBackend, McpTools
from engine.server._methods import Methods, to_wire

from .children import ignoring_sigint, kill_leftovers, kill_pids, mark, pgrep, wait_for_text, wait_until
from .serve_support import GRACE, SHELL, alive, cli, start_serve
from .serve_support import wait_until as wait_until_sync

TOOL_NAMES = ["subprocess", "cron_add", "cron_list", "cron_remove", "cron_events"]
#: MCP clients wait this long after closing stdin before SIGTERM (the SDK's stdio client does).
CLIENT_WINDOW_SECONDS = 2.0
#: NB-03 writes every request and closes stdin before the server has started: its exit counts the
#: start-up, which no case bounds (NB-04's 2.0 s is from a server already up); this catches a hang.
NB03_HANG_SECONDS = 15.0


def server_params(state_dir: Path, cwd: Path, *project: str) -> StdioServerParameters:
    return StdioServerParameters(
        command=sys.executable,
        args=[
            "-m",
            "engine",
            "mcp",
            "--state-dir",
            str(state_dir),
            *project,
            "--grace-seconds",
            GRACE,
            *SHELL,
        ],
        cwd=str(cwd),
    )


@asynccontextmanager
async def mcp_client(params: StdioServerParameters, errlog: Path) -> AsyncIterator[ClientSession]:
    with open(errlog, "w") as err:
        async with stdio_client(params, errlog=err) as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            yield session


async def call(session: ClientSession, name: str, arguments: dict[str, Any]) -> tuple[str, bool]:
    result = await session.call_tool(name, arguments)
    [block] = result.content
    assert isinstance(block, types.TextContent)
    return block.text, result.is_error


async def wait_for_event(session: ClientSession, job_id: str) -> str:
    with trio.fail_after(10):
        while True:
            text, is_error = await call(session, "cron_events", {})
            assert not is_error, text
            if f"(job {job_id})" in text:
                return text
            await trio.sleep(0.05)


async def reference_parameters(tmp_path: Path) -> object:
    config = EngineConfig(state_dir=str(tmp_path / "reference-state"), guardian=False, subreaper=False)
    async with open_engine(config) as engine:
        return engine.tool.definition["parameters"]


async def check_tools(session: ClientSession, tmp_path: Path) -> None:
    tools = (await session.list_tools()).tools
    assert [tool.name for tool in tools] == TOOL_NAMES
    by_name = {tool.name: tool for tool in tools}
    assert by_name["subprocess"].input_schema == await reference_parameters(tmp_path)
    for definition in CRON_TOOLS:
        schema = by_name[definition["name"]].input_schema
        assert schema == definition["inputSchema"]
        jsonschema.Draft202012Validator.check_schema(schema)
        assert "$schema" not in schema and "oneOf" not in schema
    for tool in tools:
        assert tool.description


def log_paths(project: Path, pid: int) -> tuple[str, str]:
    folder = project / ".gadget" / "subprocess-logs"
    return str(folder / f"subproc-{pid}.stdout.log"), str(folder / f"subproc-{pid}.stderr.log")


async def run_subprocess_tool(session: ClientSession, project: Path, marker: str) -> int:
    """create / list / log / halt / kill through MCP; returns the pid of a SIGINT-ignoring child left live."""
    text, is_error = await call(
        session,
        "subprocess",
        {"cmd": "create", "command": "bash", "args": ["-c", f"echo out-{marker}; sleep {marker}"]},
    )
    assert not is_error, text
    pid = int(re.fullmatch(r"SUBPROCESS CREATED\npid: (\d+)\nstdout: .*\nstderr: .*", text)[1])  # type: ignore[index]
    stdout, stderr = log_paths(project, pid)
    assert text == f"SUBPROCESS CREATED\npid: {pid}\nstdout: {stdout}\nstderr: {stderr}"

    text, is_error = await call(session, "subprocess", {"cmd": "list"})
    assert not is_error
    stamp = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ"
    line = (
        rf"pid: {pid} \| project: {project.name} \| created: {stamp} \| updated: {stamp} \| status: running"
    )
    assert re.fullmatch(rf"SUBPROCESS LIST\n{line}", text), text

    with trio.fail_after(10):
        while f"out-{marker}" not in Path(stdout).read_text():
            await trio.sleep(0.02)
    text, is_error = await call(session, "subprocess", {"cmd": "log", "pid": pid, "which": "stdout"})
    assert (text, is_error) == (f"SUBPROCESS LOG (stdout)\npid: {pid}\n---\nout-{marker}\n", False)

    text, is_error = await call(session, "subprocess", {"cmd": "halt", "pid": pid})
    halted = (
        f"SUBPROCESS HALTED\npid: {pid}\nThe process has been stopped. Log files are retained for inspection."
    )
    assert (text, is_error) == (halted, False)
    assert os.path.exists(stdout)
    text, is_error = await call(session, "subprocess", {"cmd": "kill", "pid": pid})
    assert (text, is_error) == (f"SUBPROCESS KILLED\npid: {pid}", False)
    assert not os.path.exists(stdout)

    # Errors: the tool's own text, flagged.
    text, is_error = await call(session, "subprocess", {"cmd": "kill", "pid": pid})
    assert is_error and text.startswith("SUBPROCESS ERROR: no subprocess with pid"), text
    text, is_error = await call(session, "subprocess", {"cmd": "create", "command": f"no-such-{marker}"})
    assert is_error and text.startswith("SUBPROCESS ERROR: "), text
    text, is_error = await call(session, "subprocess", {"cmd": "bogus"})
    assert is_error and text.startswith("SUBPROCESS ERROR: cmd must be one of"), text

    # A child that reads stdin gets /dev/null, one that writes stdout writes its log: the protocol is intact.
    text, is_error = await call(session, "subprocess", {"cmd": "create", "command": "cat"})
    assert not is_error
    argv = ignoring_sigint(marker)
    text, is_error = await call(
        session, "subprocess", {"cmd": "create", "command": argv[0], "args": list(argv[1:])}
    )
    assert not is_error, text
    return int(text.split("\n")[1].removeprefix("pid: "))


async def run_cron_tools(session: ClientSession, project: Path, marker: str) -> None:
    text, is_error = await call(
        session, "cron_add", {"command": f"echo done-{marker}; exit 3", "text": "tests ran"}
    )
    assert not is_error, text
    job_id = re.fullmatch(r"CRON ADDED\nid: (\w+)\nname: tests ran\nschedule: on-exit .*\nnext run: -", text)[
        1
    ]  # type: ignore[index]
    assert f"in {project}" in text
    event = await wait_for_event(session, job_id)
    assert "exited with code 3" in event and f"done-{marker}" in event, event

    text, is_error = await call(
        session, "cron_add", {"every_seconds": 3600, "text": "hourly", "name": "tick"}
    )
    assert not is_error, text
    tick = text.split("\n")[1].removeprefix("id: ")
    text, is_error = await call(session, "cron_list", {})
    assert not is_error and text.startswith("CRON LIST\n")
    assert f"id: {job_id} | name: tests ran | enabled: no" in text and f"id: {tick} | name: tick" in text
    assert (await call(session, "cron_remove", {"id": tick})) == (f"CRON REMOVED\nid: {tick}", False)

    text, is_error = await call(session, "cron_add", {"text": "x", "cron": "0 9 * * *", "every_seconds": 5})
    assert (
        is_error
        and text
        == "CRON ERROR: give exactly one of command, at, every_seconds, cron; got every_seconds, cron"
    )
    text, is_error = await call(session, "cron_add", {"text": "x", "cron": "not a cron"})
    assert is_error and text.startswith("CRON ERROR: "), text
    text, is_error = await call(session, "cron_remove", {"id": "nope"})
    assert is_error and text.startswith("CRON ERROR: "), text
    text, is_error = await call(session, "no_such_tool", {})
    assert is_error and text.startswith("ERROR: unknown tool 'no_such_tool'")


@pytest.mark.serial
async def test_mcp_embedded_engine_serves_the_tools_and_stops_within_the_window(
    tmp_path: Path, marker: str
) -> None:
    state, project = tmp_path / "state", tmp_path / "app"
    project.mkdir()
    errlog = tmp_path / "mcp.log"
    try:
        async with mcp_client(server_params(state, project), errlog) as session:  # --project: the cwd
            await check_tools(session, tmp_path)
            live = await run_subprocess_tool(session, project, marker)
            await run_cron_tools(session, project, marker)
            # The embedded engine serves the socket too: the CLI reaches it.
            listed = await trio.to_thread.run_sync(lambda: cli("list", "--state-dir", str(state)))
            assert listed.returncode == 0 and str(live) in listed.stdout, listed
            server_pid = int((state / "lock").read_text().split()[0])
            # It listens: the lock says so, for the clients that cannot connect (not "embedded").
            assert (state / "lock").read_text() == f"{server_pid} serving mcp\n"
            assert pgrep(marker)
            closed_at = time.monotonic()
        stopped_seconds = time.monotonic() - closed_at
        assert "mode=embedded" in errlog.read_text()
        assert "event=stopped" in errlog.read_text(), errlog.read_text()
        print(f"embedded mcp: stdin closed -> exited in {stopped_seconds:.3f} s")
        assert stopped_seconds < CLIENT_WINDOW_SECONDS - 0.3, errlog.read_text()
        assert stopped_seconds > SHUTDOWN_GRACE_SECONDS  # the SIGINT-ignoring child had its grace
        assert not alive(server_pid)
        assert pgrep(marker) == [] and pgrep(str(state)) == []
    finally:
        kill_leftovers(marker)


@pytest.mark.serial
async def test_mcp_forwards_to_a_running_serve(tmp_path: Path, marker: str) -> None:
    state, project = tmp_path / "state", tmp_path / "app"
    project.mkdir()
    served = await trio.to_thread.run_sync(start_serve, state)
    try:
        with served.client() as client:
            async with mcp_client(
                server_params(state, tmp_path, "--project", str(project)), tmp_path / "mcp.log"
            ) as session:
                await check_tools(session, tmp_path)
                live = await run_subprocess_tool(session, project, marker)
                # The calls went to serve: its own list and tool give the same texts, byte for byte.
                assert [r["pid"] for r in client.call("subprocess.list")][-1] == live
                for params in ({"cmd": "list"}, {"cmd": "log", "pid": live, "which": "stderr"}):
                    direct = client.call("tool.execute", params=params, project=str(project))["text"]
                    assert await call(session, "subprocess", dict(params)) == (direct, False)
                await run_cron_tools(session, project, marker)
                assert any(e["job_name"] == "tests ran" for e in client.call("events"))
                closed_at = time.monotonic()
            assert time.monotonic() - closed_at < 1.0  # nothing to stop: the engine is serve's
            assert "mode=forward" in (tmp_path / "mcp.log").read_text()
            assert live in [r["pid"] for r in client.call("subprocess.list")]  # serve's, still running
            assert served.stop() == 0
            assert pgrep(marker) == []
    finally:
        if served.proc.poll() is None:
            served.kill_hard()
        kill_leftovers(marker)


@pytest.mark.serial
async def test_mcp_forwarding_outlives_its_serve_and_finds_the_next_one(tmp_path: Path) -> None:
    # A doc gap a new user found: what a forwarding session does when its `serve` stops.
    state, project = tmp_path / "state", tmp_path / "app"
    project.mkdir()
    served = await trio.to_thread.run_sync(start_serve, state)
    again = None
    try:
        async with mcp_client(
            server_params(state, tmp_path, "--project", str(project)), tmp_path / "mcp.log"
        ) as session:
            listed = ("SUBPROCESS LIST\nNo subprocesses in this project.", False)
            assert await call(session, "subprocess", {"cmd": "list"}) == listed
            assert await trio.to_thread.run_sync(served.stop) == 0
            text, is_error = await call(session, "subprocess", {"cmd": "list"})
            assert text == (
                f"SUBPROCESS ERROR: no engine is running on {state} (nothing answers on "
                f"{state}/engine.sock); start one with: gadget-engine --state-dir {state} start"
            )
            assert is_error
            again = await trio.to_thread.run_sync(start_serve, state)
            assert await call(session, "subprocess", {"cmd": "list"}) == listed
        assert "mode=forward" in (tmp_path / "mcp.log").read_text()
        assert await trio.to_thread.run_sync(again.stop) == 0
    finally:
        for each in (served, again):
            if each is not None and each.proc.poll() is None:
                each.kill_hard()


async def test_mcp_cron_tools_are_scoped_to_the_session_project(tmp_path: Path, marker: str) -> None:
    state, a, b = tmp_path / "state", tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    try:
        # A embeds the engine; B, a second agent on the same state dir, forwards to it.
        async with mcp_client(server_params(state, a), tmp_path / "a.log") as sa:
            text, is_error = await call(
                sa, "cron_add", {"command": f"sleep {marker}; echo a-{marker}", "text": "a done"}
            )
            assert not is_error, text
            a_job = text.split("\n")[1].removeprefix("id: ")
            await wait_until(lambda: bool(pgrep(rf"^sleep {marker}$")))
            async with mcp_client(server_params(state, b), tmp_path / "b.log") as sb:
                assert await call(sb, "cron_list", {}) == ("CRON LIST\nNo cron jobs.", False)
                text, is_error = await call(sb, "cron_remove", {"id": a_job})
                assert is_error and text == (
                    f"CRON ERROR: job_id {a_job!r} names no cron job; list the jobs to see their ids"
                )
                assert pgrep(rf"^sleep {marker}$")  # A's command runs on, unfired
                text, is_error = await call(sb, "cron_add", {"every_seconds": 3600, "text": "b tick"})
                assert not is_error, text
                b_job = text.split("\n")[1].removeprefix("id: ")
                text, _ = await call(sb, "cron_list", {})
                assert f"id: {b_job}" in text and a_job not in text
                text, _ = await call(sa, "cron_list", {})
                assert f"id: {a_job}" in text and b_job not in text
                text, is_error = await call(sa, "cron_remove", {"id": b_job})
                assert is_error and "names no cron job" in text
                kill_leftovers(rf"^sleep {marker}$")  # A's command ends: A's job fires
                event = await wait_for_event(sa, a_job)
                assert f"a-{marker}" in event
                text, is_error = await call(sb, "cron_events", {})
                assert (text, is_error) == ("CRON EVENTS\nNo events after cursor 0.\nnext since: 0", False)
            assert "mode=forward" in (tmp_path / "b.log").read_text()
            # Jobs and events carry the project id for every surface.
            with EngineClient(str(state)) as client:
                jobs = {job["id"]: job["project"] for job in client.call("cron.list")}
                assert jobs == {a_job: Project.from_directory(a).id, b_job: Project.from_directory(b).id}
                events = client.call("events", project=str(a))
                assert [(e["job_id"], e["project"]) for e in events] == [
                    (a_job, Project.from_directory(a).id)
                ]
                assert client.call("events", project=str(b)) == []
                with pytest.raises(EngineError, match="belongs to an MCP session"):
                    client.call("engine.stop")  # the session's engine stops with its stdin
    finally:
        kill_leftovers(rf"^sleep {marker}$")


def test_mcp_refuses_a_missing_project(tmp_path: Path) -> None:
    result = cli("mcp", "--state-dir", str(tmp_path / "state"), "--project", str(tmp_path / "nope"))
    assert result.returncode == 2 and result.stdout == ""  # a usage error, as `tool --project` gives
    assert result.stderr.splitlines()[-1].endswith(
        f"argument --project: '{tmp_path / 'nope'}' is not a directory"
    )


# ---- the tools read their arguments once and pass typed values -------------------------------------------


@attrs.define
class RecordingBackend:
    """The embedded backend, recording what each call was given (a fake only at the edge it watches)."""

    inner: EmbeddedBackend
    calls: list[tuple[str, dict[str, Any]]] = attrs.Factory(list)

    @property
    def remote(self) -> bool:
        return self.inner.remote

    async def hurry(self) -> None:
        await self.inner.hurry()

    async def call(self, method: str, params: Mapping[str, Any]) -> Any:
        self.calls.append((method, dict(params)))
        return await self.inner.call(method, params)


async def test_mcp_tools_read_once_pass_typed_values_and_refuse_poison(tmp_path: Path) -> None:
    project = tmp_path / "app"
    project.mkdir()
    config = EngineConfig(state_dir=str(tmp_path / "state"), grace_seconds=0.2)
    async with open_engine(config) as engine:
        backend = RecordingBackend(EmbeddedBackend(Methods(engine, "unused.sock", "test")))
        tools = McpTools(backend=backend, project_dir=str(project))
        text, is_error = await tools.call("cron_add", {"every_seconds": 3600, "text": "hourly", "name": "t"})
        assert not is_error, text
        method, params = backend.calls[-1]
        # Typed once here; Methods.run takes them as they are (the socket backend sends their JSON form).
        assert (method, params) == (
            "cron.add",
            {
                "schedule": Every(3600.0),
                "payload": SystemEvent("hourly"),
                "project": Project.from_directory(project),
                "name": "t",
            },
        )
        assert read_schedule(to_wire(params)["schedule"]) == Every(3600.0)
        seen = len(backend.calls)
        for args in (
            {"every_seconds": 3600, "text": "\udcff"},
            {"command": "echo \udcff", "text": "x"},
            {"cron": "0 9 * * *", "tz": "\udcff", "text": "x"},
            {"cron": "0 9 * * *", "tz": "x" * 300, "text": "x"},
            {"every_seconds": 10**400, "text": "x"},
            {"every_seconds": 60, "text": "x", "name": "caf\udce9"},
            {"every_seconds": 60, "text": "x", "\udcff": 1},
        ):
            text, is_error = await tools.call("cron_add", args)
            assert is_error and text.startswith("CRON ERROR: "), (args, text)
            text.encode("utf-8")
        others: list[tuple[str, dict[str, object]]] = [
            ("cron_remove", {"id": "\udcff"}),
            ("cron_events", {"since": -1}),
        ]
        for name, other in others:
            text, is_error = await tools.call(name, other)
            assert is_error and text.startswith("CRON ERROR: "), text
        assert len(backend.calls) == seen  # refused before any call
        assert [job.name for job in await engine.cron.list()] == ["t"]
        nb08 = {"cmd": "create", "command": "tail", "args": ["-f", os.fsdecode(b"caf\xe9.txt")]}
        text, is_error = await tools.call("subprocess", nb08)
        assert is_error and text.startswith("SUBPROCESS ERROR: args[1] holds the lone surrogate"), text
        assert engine.service.ps() == []
        text, is_error = await tools.call("subprocess", {"cmd": "list"})
        assert (text, is_error) == ("SUBPROCESS LIST\nNo subprocesses in this project.", False)


# ---- stdin closes: every request read gets its answer (NB-03, NB-04) ---------------------------------


def _initialize(request_id: int = 1) -> list[dict[str, Any]]:
    return [
        {
            "jsonrpc": "2.0",
            "id": request_id,
            "method": "initialize",
            "params": {
                "protocolVersion": "2025-06-18",
                "capabilities": {},
                "clientInfo": {"name": "raw-test", "version": "1"},
            },
        },
        {"jsonrpc": "2.0", "method": "notifications/initialized"},
    ]


def _tool_call(request_id: int, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {
        "jsonrpc": "2.0",
        "id": request_id,
        "method": "tools/call",
        "params": {"name": name, "arguments": arguments},
    }


@attrs.define
class RawMcp:
    """``gadget-engine mcp`` on plain pipes: several requests in one write, stdin closed at will."""

    proc: subprocess.Popen[bytes]
    errlog: Path
    closed_at: float = 0.0

    @classmethod
    def start(cls, state: Path, project: Path, errlog: Path, *extra: str) -> RawMcp:
        args = ["--grace-seconds", GRACE] if "--grace-seconds" not in extra else []
        argv = [sys.executable, "-m", "engine", "mcp", "--state-dir", str(state), "--project", str(project)]
        with open(errlog, "wb") as err:
            proc = subprocess.Popen(
                [*argv, *args, *SHELL, *extra],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
            )
        return cls(proc, errlog)

    def send(self, *messages: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"".join(json.dumps(m).encode() + b"\n" for m in messages))  # one write
        self.proc.stdin.flush()

    def receive(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, self.errlog.read_text()
        message: dict[str, Any] = json.loads(line)
        return message

    def close_stdin(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.closed_at = time.monotonic()

    def finish(self, seconds: float = 10.0) -> tuple[dict[Any, dict[str, Any]], float]:
        """Every message left on stdout (by id) and how long after stdin closed the process exited."""
        assert self.proc.stdout is not None
        out = self.proc.stdout.read()
        self.proc.stdout.close()
        self.proc.wait(timeout=seconds)
        exited = time.monotonic() - self.closed_at
        return {m.get("id"): m for m in map(json.loads, out.splitlines())}, exited

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


def _text(answer: dict[str, Any]) -> tuple[str, bool]:
    assert "result" in answer, answer  # never a JSON-RPC error ("Connection closed")
    result = answer["result"]
    [block] = result["content"]
    return block["text"], result["isError"]


def test_mcp_answers_a_line_that_is_not_json_rpc_with_a_parse_error(tmp_path: Path, project: Path) -> None:
    """A line that is not a JSON-RPC message gets ``-32700`` with ``id: null`` (it was dropped without a
    word, found by a new user); the session goes on answering the requests around it."""
    mcp = RawMcp.start(tmp_path / "state", project, tmp_path / "mcp.log")
    try:
        mcp.send(*_initialize())
        assert "result" in mcp.receive()
        assert mcp.proc.stdin is not None
        mcp.proc.stdin.write(b"this is not json\n")
        mcp.proc.stdin.flush()
        error = mcp.receive()
        assert error["id"] is None and error["error"]["code"] == -32700, error
        assert error["error"]["message"].startswith("parse error: not a JSON-RPC message ("), error
        mcp.send(_tool_call(2, "subprocess", {"cmd": "list"}))
        assert _text(mcp.receive()) == ("SUBPROCESS LIST\nNo subprocesses in this project.", False)
        mcp.close_stdin()
        _rest, _exited = mcp.finish()
    finally:
        mcp.kill()
    assert mcp.proc.returncode == 0
    assert "Traceback" not in mcp.errlog.read_text()


@pytest.mark.serial
def test_nb03a_embedded_answers_every_request_written_before_stdin_closed(
    tmp_path: Path, project: Path
) -> None:
    mcp = RawMcp.start(tmp_path / "state", project, tmp_path / "mcp.log")
    try:
        calls = [
            _tool_call(n + 2, *(("subprocess", {"cmd": "list"}) if n % 2 == 0 else ("cron_list", {})))
            for n in range(8)
        ]
        mcp.send(*_initialize(), *calls)
        mcp.close_stdin()
        answers, exited = mcp.finish()
    finally:
        mcp.kill()
    assert sorted(answers) == list(range(1, 10))
    assert "result" in answers[1]
    for n in range(2, 10):
        text, is_error = _text(answers[n])
        expected = (
            "SUBPROCESS LIST\nNo subprocesses in this project." if n % 2 == 0 else "CRON LIST\nNo cron jobs."
        )
        assert (text, is_error) == (expected, False)
    # NB-03 bounds no time: stdin closed before the server had even started, so this counts its start-up
    # (the MCP SDK's import alone is about 1.1 s on a quiet machine); the bound only catches a hang.
    assert mcp.proc.returncode == 0 and exited < NB03_HANG_SECONDS
    log = mcp.errlog.read_text()
    assert 'event=stopping reason="stdin closed" mode=embedded' in log and "event=stopped" in log
    assert not (tmp_path / "state" / "engine.sock").exists()


@pytest.mark.serial
def test_nb03b_forwarding_creates_written_before_stdin_closed_are_all_answered(
    tmp_path: Path, project: Path
) -> None:
    marker = mark("8812.25")
    served = start_serve(tmp_path / "state")
    mcp = RawMcp.start(tmp_path / "state", project, tmp_path / "mcp.log")
    try:
        creates = [
            _tool_call(n, "subprocess", {"cmd": "create", "command": "sleep", "args": [marker]})
            for n in (2, 3, 4)
        ]
        mcp.send(*_initialize(), *creates)
        mcp.close_stdin()
        answers, exited = mcp.finish()
        assert sorted(answers) == [1, 2, 3, 4]
        pids = []
        for n in (2, 3, 4):
            text, is_error = _text(answers[n])
            assert not is_error and text.startswith("SUBPROCESS CREATED\npid: "), text
            pids.append(int(text.split("\n")[1].removeprefix("pid: ")))
        assert sorted(pgrep(rf"^sleep {marker}$")) == sorted(pids)  # serve's, running on
        assert mcp.proc.returncode == 0 and exited < NB03_HANG_SECONDS  # start-up included, as in (a)
        assert "mode=forward" in mcp.errlog.read_text() and "event=stopped" in mcp.errlog.read_text()
        assert served.stop() == 0
        assert not pgrep(rf"^sleep {marker}$")
    finally:
        mcp.kill()
        if served.proc.poll() is None:
            served.kill_hard()
        kill_leftovers(rf"^sleep {marker}$")


def _create_sigint_ignoring(mcp: RawMcp, marker: str, request_id: int = 2) -> int:
    argv = ignoring_sigint(marker)
    mcp.send(
        _tool_call(request_id, "subprocess", {"cmd": "create", "command": argv[0], "args": list(argv[1:])})
    )
    text, is_error = _text(mcp.receive())
    assert not is_error, text
    stdout = Path(text.split("\n")[2].removeprefix("stdout: "))
    assert wait_until_sync(lambda: stdout.read_text() == "ready\n")  # SIGINT is ignored from now on
    return int(text.split("\n")[1].removeprefix("pid: "))


@pytest.mark.serial
def test_nb04_embedded_stdin_closes_while_a_kill_waits_out_its_grace(
    tmp_path: Path, project: Path, marker: str
) -> None:
    state = tmp_path / "state"
    mcp = RawMcp.start(state, project, tmp_path / "mcp.log", "--grace-seconds", "5")
    try:
        mcp.send(*_initialize())
        assert "result" in mcp.receive()
        pid = _create_sigint_ignoring(mcp, marker)
        mcp.send(_tool_call(3, "subprocess", {"cmd": "kill", "pid": pid}))
        time.sleep(0.3)
        mcp.close_stdin()
        answers, exited = mcp.finish()
    finally:
        mcp.kill()
        kill_leftovers(marker)
    print(f"NB-04 embedded: stdin closed -> exited in {exited:.3f} s")
    assert mcp.proc.returncode == 0 and exited < 2.0
    # The kill was hurried to SIGKILL and answered as itself.
    assert _text(answers[3]) == (f"SUBPROCESS KILLED\npid: {pid}", False)
    assert not alive(pid) and not pgrep(marker)
    assert not (state / "engine.sock").exists()
    log = mcp.errlog.read_text()
    assert "event=stopping" in log and "event=stopped" in log


@pytest.mark.serial
def test_nb04_forwarding_a_kill_cut_short_continues_in_the_engine(
    tmp_path: Path, project: Path, marker: str
) -> None:
    state = tmp_path / "state"
    served = start_serve(state, "--grace-seconds", "5")
    mcp = RawMcp.start(state, project, tmp_path / "mcp.log")
    try:
        mcp.send(*_initialize())
        assert "result" in mcp.receive()
        pid = _create_sigint_ignoring(mcp, marker)
        mcp.send(_tool_call(3, "subprocess", {"cmd": "kill", "pid": pid}))
        time.sleep(0.3)
        mcp.close_stdin()
        answers, exited = mcp.finish()
        assert mcp.proc.returncode == 0 and exited < 2.0
        text, is_error = _text(answers[3])
        assert not is_error, text
        assert (
            text.startswith(f"SUBPROCESS KILL UNDER WAY\npid: {pid}\n") and "continues in the engine" in text
        ), text
        assert alive(pid)  # serve is still waiting out the grace period
        assert wait_until_sync(lambda: not alive(pid), 8.0)  # ... and then ends it
        with served.client() as client:
            assert all(r["pid"] != pid for r in client.call("subprocess.list"))
        assert served.stop() == 0
    finally:
        mcp.kill()
        if served.proc.poll() is None:
            served.kill_hard()
        kill_leftovers(marker)


@pytest.mark.serial
async def test_nb04_sdk_client_leaves_while_a_kill_waits_and_the_server_exits_by_itself(
    tmp_path: Path, project: Path, marker: str
) -> None:
    state = tmp_path / "state"
    params = server_params(state, project)
    params.args = [*params.args, "--grace-seconds", "5"]
    errlog = tmp_path / "mcp.log"
    try:
        async with mcp_client(params, errlog) as session:
            argv = ignoring_sigint(marker)
            text, _ = await call(
                session, "subprocess", {"cmd": "create", "command": argv[0], "args": list(argv[1:])}
            )
            pid = int(text.split("\n")[1].removeprefix("pid: "))
            await wait_for_text(text.split("\n")[2].removeprefix("stdout: "), "ready")
            server_pid = int((state / "lock").read_text().split()[0])
            async with trio.open_nursery() as nursery:
                nursery.start_soon(call, session, "subprocess", {"cmd": "kill", "pid": pid})
                await trio.sleep(0.3)
                nursery.cancel_scope.cancel()
            closed_at = time.monotonic()
        left = time.monotonic() - closed_at  # the SDK closes stdin, waits up to 2 s, then SIGTERM
        assert left < CLIENT_WINDOW_SECONDS - 0.2, errlog.read_text()
        assert not alive(server_pid) and not alive(pid)
        assert "event=stopped" in errlog.read_text()
    finally:
        kill_leftovers(marker)


async def test_mcp_subprocess_extensions_and_an_exit_notice(tmp_path: Path) -> None:
    """Issues 17 and 18 through MCP (embedded engine): create with stdin and ready, input, wait, log new
    and grep, and a notify_on_exit process whose notice cron_events shows."""
    project = tmp_path / "app"
    project.mkdir()
    params = server_params(tmp_path / "state", project, "--project", str(project))
    async with mcp_client(params, tmp_path / "mcp.log") as session:
        code = "import sys; print('name?', flush=True); print('hi', sys.stdin.readline().strip())"
        text, is_error = await call(
            session,
            "subprocess",
            {
                "cmd": "create",
                "command": sys.executable,
                "args": ["-c", code],
                "stdin": True,
                "ready": {"log": "name"},
            },
        )
        assert not is_error and text.endswith("\nready: ready\n--- first output ---\nname?"), text
        pid = int(text.split("\n")[1].removeprefix("pid: "))
        text, is_error = await call(session, "subprocess", {"cmd": "input", "pid": pid, "text": "bob\n"})
        assert (text, is_error) == (f"SUBPROCESS INPUT\npid: {pid}\nsent: 4 bytes", False)
        text, _ = await call(session, "subprocess", {"cmd": "wait", "pid": pid, "timeout": 10})
        assert text == f"SUBPROCESS WAIT\npid: {pid}\nstatus: exited 0"
        text, _ = await call(
            session, "subprocess", {"cmd": "log", "pid": pid, "which": "stdout", "new": True}
        )
        assert text == f"SUBPROCESS LOG (stdout)\npid: {pid}\n---\nname?\nhi bob\n"
        text, _ = await call(
            session, "subprocess", {"cmd": "log", "pid": pid, "which": "stdout", "grep": "^hi"}
        )
        assert text == f"SUBPROCESS LOG (stdout)\npid: {pid}\n---\n2: hi bob\n"
        text, is_error = await call(session, "subprocess", {"cmd": "wait", "pid": pid, "timeout": 999})
        assert is_error and "at most 300" in text
        text, _ = await call(
            session,
            "subprocess",
            {
                "cmd": "create",
                "command": "bash",
                "args": ["-c", "echo built; exit 6"],
                "notify_on_exit": True,
            },
        )
        build = int(text.split("\n")[1].removeprefix("pid: "))
        event = await wait_for_event(session, f"subprocess:{build}")
        assert "exited with code 6" in event and "built" in event


# ---- the embedded engine's socket, and an engine on the state directory that is not answering yet --------


def test_mcp_embedded_engine_binds_its_socket_again_when_the_file_is_removed(
    tmp_path: Path, project: Path, marker: str
) -> None:
    # A gap found in review: serve bound its socket again when the file was removed (NB-06), mcp's own
    # engine did not; the CLI then named an engine it could never reach, for the rest of the session.
    state = tmp_path / "state"
    mcp = RawMcp.start(state, project, tmp_path / "mcp.log")
    try:
        mcp.send(*_initialize())
        assert "result" in mcp.receive()
        assert (state / "lock").read_text() == f"{mcp.proc.pid} serving mcp\n"
        mcp.send(_tool_call(2, "subprocess", {"cmd": "create", "command": "sleep", "args": [marker]}))
        text, is_error = _text(mcp.receive())
        assert not is_error, text
        pid = int(text.split("\n")[1].removeprefix("pid: "))
        (state / "engine.sock").unlink()
        assert wait_until_sync(lambda: (state / "engine.sock").exists(), 6.0)  # inotify: at once; else 5 s
        listed = cli("--state-dir", str(state), "list", "--json")
        assert listed.returncode == 0, listed.stderr
        assert pid in [json.loads(line)["pid"] for line in listed.stdout.splitlines()]
        mcp.send(_tool_call(3, "subprocess", {"cmd": "list"}))  # the session goes on, as before
        assert f"pid: {pid} " in _text(mcp.receive())[0]
        mcp.close_stdin()
        mcp.finish()
    finally:
        mcp.kill()
        kill_leftovers(rf"^sleep {marker}$")
    assert mcp.proc.returncode == 0
    log = mcp.errlog.read_text()
    assert "event=socket_lost" in log and "event=socket_bound" in log, log
    assert "event=stopped" in log
    assert not (state / "engine.sock").exists()  # the socket bound again is removed at the end
    assert not pgrep(rf"^sleep {marker}$")


@contextmanager
def _mcp_beside_a_sweeping_serve(
    tmp_path: Path, project: Path, child_base: str, grace_seconds: float
) -> Iterator[tuple[Path, str, subprocess.Popen[bytes], RawMcp]]:
    """An engine crashed leaving a child that ignores SIGINT; a ``serve`` is sweeping it (its grace
    period ``grace_seconds``), not answering yet; an ``mcp`` starts on the same state directory.

    Yields:
        The state directory, the child's marker, the sweeping ``serve`` and the ``mcp``.
    """
    from .test_cli_start import _crash_leaving_a_child, _serve_sweeping, _start

    state, child = tmp_path / "state", mark(child_base)
    try:
        _crash_leaving_a_child(state, _start(state), project, child)
        with _serve_sweeping(state, grace_seconds=grace_seconds) as serve:
            mcp = RawMcp.start(state, project, tmp_path / "mcp.log")
            try:
                yield state, child, serve, mcp
            finally:
                mcp.kill()
    finally:
        kill_pids(pgrep(str(state)))


def test_mcp_waits_for_an_engine_in_its_start_up_sweep_then_forwards_to_it(
    tmp_path: Path, project: Path
) -> None:
    # Found in review: a second mcp started while a serve ended what a crashed engine had left (its
    # start-up sweep, before it listens) waited 5 s for a socket, then exited 1 saying the socket was
    # missing; `start` waits for such an engine to answer.
    # The child ignores SIGINT: the sweep takes the whole 8 s.
    with _mcp_beside_a_sweeping_serve(tmp_path, project, "8812.31", 8.0) as (state, child, serve, mcp):
        mcp.send(*_initialize())
        assert "result" in mcp.receive()  # once serve answers
        assert not pgrep(child)  # serve's sweep ended it first
        mcp.send(_tool_call(2, "subprocess", {"cmd": "list"}))
        assert _text(mcp.receive()) == ("SUBPROCESS LIST\nNo subprocesses in this project.", False)
        mcp.close_stdin()
        mcp.finish()
        assert mcp.proc.returncode == 0
        assert serve.poll() is None  # the engine is serve's: it runs on
        assert cli("--state-dir", str(state), "stop").returncode == 0
        assert serve.wait(timeout=20) == 0
    log = mcp.errlog.read_text()
    assert f"the engine on {state} (pid {serve.pid}) is starting" in log and "until it answers" in log
    assert "mode=forward" in log and "mode=embedded" not in log


def _lock_phase(state_dir: Path) -> str | None:
    lock = lock_state(str(state_dir))
    return None if lock is None else lock.phase


def test_mcp_embeds_the_engine_when_the_one_starting_stops_before_answering(
    tmp_path: Path, project: Path
) -> None:
    # As "nobody answers" at start-up: the engine it waited for closed without answering (a stop during
    # its start-up sweep), so this server embeds the engine.
    # A grace period no start-up of mcp outlasts, even on a loaded machine (with 4 s, the sweep was
    # sometimes over, and serve answering, before mcp looked); the second signal ends it at once.
    with _mcp_beside_a_sweeping_serve(tmp_path, project, "8812.32", 60.0) as (state, child, serve, mcp):
        assert wait_until_sync(lambda: "until it answers" in mcp.errlog.read_text(), 30.0)
        serve.send_signal(signal.SIGTERM)  # it closes after its sweep, never answering
        assert wait_until_sync(lambda: _lock_phase(state) == STOPPING, 10.0)
        serve.send_signal(signal.SIGTERM)  # and the sweep's grace ends now: SIGKILL
        mcp.send(*_initialize())
        assert "result" in mcp.receive()
        assert serve.wait(timeout=20) == 0
        assert (state / "lock").read_text() == f"{mcp.proc.pid} serving mcp\n"
        mcp.send(_tool_call(2, "subprocess", {"cmd": "list"}))
        assert _text(mcp.receive()) == ("SUBPROCESS LIST\nNo subprocesses in this project.", False)
        mcp.close_stdin()
        mcp.finish()
        assert mcp.proc.returncode == 0
        assert not pgrep(child)  # before the clean-up ends what is left
    assert "mode=embedded" in mcp.errlog.read_text()
