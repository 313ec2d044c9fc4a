"""The ``subprocess`` tool beyond the spec (``EngineConfig.tool_extensions``): the definition in both
settings, ``create`` with ``stdin``/``ready``, ``input``, ``wait``, ``log`` with ``new``/``grep``, and the
refusals. The spec's own texts are tested in tests/test_tool.py, with the extensions on (the default)."""

from __future__ import annotations

import re
import socket
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]  # no stubs in the dev extra
import mcp.types
import pytest
import trio

from .children import PY, kill_leftovers, mark, pgrep, wait_for_text
from .service_support import engine_at, make_project

SPEC_PARAMETERS = {"cmd", "command", "args", "pid", "which", "offset", "limit", "tail"}
_CREATED = re.compile(r"SUBPROCESS CREATED\npid: (\d+)\nstdout: (/\S+)\nstderr: (/\S+)")


async def definition(tmp_path: Path, *, extensions: bool) -> dict[str, Any]:
    async with engine_at(tmp_path, tool_extensions=extensions) as engine:
        return engine.tool.definition


@pytest.mark.parametrize("extensions", [False, True])
async def test_definition_in_both_settings_is_valid_and_taken_by_the_mcp_sdk(
    tmp_path: Path, extensions: bool
) -> None:
    tool = await definition(tmp_path, extensions=extensions)
    schema = tool["parameters"]
    jsonschema.Draft202012Validator.check_schema(schema)
    mcp.types.Tool(name=tool["name"], description=tool["description"], input_schema=schema)
    props = schema["properties"]
    validator = jsonschema.Draft202012Validator(schema)
    assert validator.is_valid({"cmd": "log", "pid": 3, "which": "stdout", "tail": 5})
    if not extensions:
        assert set(props) == SPEC_PARAMETERS
        assert props["cmd"]["enum"] == ["create", "list", "kill", "killAll", "halt", "log"]
        assert not validator.is_valid({"cmd": "wait", "pid": 3})
        return
    assert set(props) == SPEC_PARAMETERS | {
        "stdin",
        "ready",
        "restart",
        "notify_on_exit",
        "new",
        "grep",
        "text",
        "eof",
        "timeout",
    }
    assert props["cmd"]["enum"] == ["create", "list", "kill", "killAll", "halt", "log", "input", "wait"]
    assert validator.is_valid(
        {"cmd": "create", "command": "npm", "stdin": True, "ready": {"port": 3000, "timeout": 60}}
    )
    assert validator.is_valid({"cmd": "create", "command": "x", "restart": {"mode": "on-failure"}})
    assert validator.is_valid({"cmd": "log", "pid": 3, "which": "stdout", "new": True, "grep": "ERR"})
    assert validator.is_valid({"cmd": "input", "pid": 3, "text": "y\n", "eof": True})
    assert not validator.is_valid({"cmd": "wait", "pid": 3, "timeout": 301})
    assert not validator.is_valid({"cmd": "create", "command": "x", "ready": {"port": 0}})
    spec = await definition(tmp_path / "spec", extensions=False)
    assert tool["description"].startswith(spec["description"])  # the spec's description, then more


async def test_without_extensions_their_parameters_and_commands_are_refused(tmp_path: Path) -> None:
    project = make_project(tmp_path)
    async with engine_at(tmp_path, tool_extensions=False) as engine:
        tool = engine.tool
        for params in (
            {"cmd": "wait", "pid": 1},
            {"cmd": "input", "pid": 1, "text": "x"},
            {"cmd": "create", "command": "true", "stdin": True},
            {"cmd": "log", "pid": 1, "which": "stdout", "new": True},
        ):
            text = await tool.execute(params, project)
            assert text.startswith("SUBPROCESS ERROR: "), text
        assert engine.service.ps() == []


async def test_create_with_ready_and_stdin_then_input_and_wait(tmp_path: Path) -> None:
    project = make_project(tmp_path)
    async with engine_at(tmp_path) as engine:
        tool = engine.tool
        code = "import sys; print('ready for input', flush=True); print('got', sys.stdin.readline().strip())"
        created = await tool.execute(
            {
                "cmd": "create",
                "command": PY,
                "args": ["-c", code],
                "stdin": True,
                "ready": {"log": "ready for"},
            },
            project,
        )
        head = "\n".join(created.split("\n")[:4])
        match = _CREATED.fullmatch(head)
        assert match, created
        pid = int(match[1])
        assert created.split("\n")[4:] == [
            "stdin: open; send text with cmd=input",
            "ready: ready",
            "--- first output ---",
            "ready for input",
        ]
        sent = await tool.execute({"cmd": "input", "pid": pid, "text": "yes\n"}, project)
        assert sent == f"SUBPROCESS INPUT\npid: {pid}\nsent: 4 bytes"
        waited = await tool.execute({"cmd": "wait", "pid": pid, "timeout": 10}, project)
        assert waited == f"SUBPROCESS WAIT\npid: {pid}\nstatus: exited 0"
        log = await tool.execute({"cmd": "log", "pid": pid, "which": "stdout"}, project)
        assert log == f"SUBPROCESS LOG (stdout)\npid: {pid}\n---\nready for input\ngot yes\n"
        late = await tool.execute({"cmd": "input", "pid": pid, "text": "more\n"}, project)
        assert late.startswith("SUBPROCESS ERROR: cannot write to the stdin") and "ended (exited 0)" in late


async def test_create_ready_timeout_and_wait_timeout_say_it_still_runs(tmp_path: Path) -> None:
    project = make_project(tmp_path)
    marker = mark("72.1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        async with engine_at(tmp_path) as engine:
            tool = engine.tool
            created = await tool.execute(
                {
                    "cmd": "create",
                    "command": "sleep",
                    "args": [marker],
                    "ready": {"port": port, "timeout": 0.3},
                },
                project,
            )
            assert created.endswith("\nready: timeout, not ready after 0.3 s; it is still running")
            pid = int(created.split("\n")[1].removeprefix("pid: "))
            waited = await tool.execute({"cmd": "wait", "pid": pid, "timeout": 0.2}, project)
            assert waited == (
                f"SUBPROCESS WAIT\npid: {pid}\nstatus: running\n"
                "[still running after 0.2 s; call wait again, or read its log]"
            )
            nothing = await tool.execute({"cmd": "input", "pid": pid, "text": "x"}, project)
            assert "create it with stdin=True" in nothing
    finally:
        kill_leftovers(marker)


async def test_wait_on_an_exited_leader_whose_leftovers_still_run_says_so(tmp_path: Path) -> None:
    """Found by a new user: ``wait`` with a timeout said "exited 0" and nothing more while what the
    leader left running was still running (the wait itself waits for it, SP-03)."""
    project = make_project(tmp_path)
    marker = mark("72.3")
    try:
        async with engine_at(tmp_path, grace_seconds=10.0) as engine:
            tool = engine.tool
            created = await tool.execute(
                {"cmd": "create", "command": "bash", "args": ["-c", f"sleep {marker} & echo parent done"]},
                project,
            )
            pid = int(created.split("\n")[1].removeprefix("pid: "))
            with trio.fail_after(10):
                while engine.service.summarize(engine.service.lookup(pid)).status != "exited 0":
                    await trio.sleep(0.05)
            waited = await tool.execute({"cmd": "wait", "pid": pid, "timeout": 0.3}, project)
            assert waited == (
                f"SUBPROCESS WAIT\npid: {pid}\nstatus: exited 0\n[exited, but what it left running is "
                "still running after 0.3 s (it gets the grace period, then SIGINT, another grace period, "
                "SIGKILL); call wait again, or read its log]"
            )
            assert pgrep(rf"^sleep {marker}$")
            killed = await tool.execute({"cmd": "kill", "pid": pid}, project)
            assert killed.startswith("SUBPROCESS KILLED"), killed
            assert not pgrep(rf"^sleep {marker}$")
    finally:
        kill_leftovers(marker)


async def test_log_new_and_grep_texts(tmp_path: Path) -> None:
    project = make_project(tmp_path)
    async with engine_at(tmp_path) as engine:
        tool = engine.tool
        created = await tool.execute({"cmd": "create", "command": "cat", "stdin": True}, project)
        pid = int(created.split("\n")[1].removeprefix("pid: "))
        path = created.split("\n")[2].removeprefix("stdout: ")
        await tool.execute({"cmd": "input", "pid": pid, "text": "ok 1\nERROR disk full\n"}, project)
        await wait_for_text(path, "disk full")
        header = f"SUBPROCESS LOG (stdout)\npid: {pid}\n---\n"
        new = {"cmd": "log", "pid": pid, "which": "stdout", "new": True}
        assert await tool.execute(new, project) == header + "ok 1\nERROR disk full\n"
        assert (
            await tool.execute(new, project)
            == header + "\n[no new output since your last read with new=true]"
        )
        await tool.execute({"cmd": "input", "pid": pid, "text": "ok 2\n"}, project)
        await wait_for_text(path, "ok 2")
        assert await tool.execute(new, project) == header + "ok 2\n"
        grep = {"cmd": "log", "pid": pid, "which": "stdout", "grep": "ERROR"}
        assert await tool.execute(grep, project) == header + "2: ERROR disk full\n"
        none = await tool.execute({**grep, "grep": "panic"}, project)
        assert none == header + "\n[no line matches 'panic' in bytes 0-26]"
        bad = await tool.execute({**grep, "grep": "ERROR ("}, project)
        assert bad.startswith("SUBPROCESS ERROR: grep 'ERROR (' is not a valid regular expression")
        both = await tool.execute({**new, "tail": 3}, project)
        assert both == "SUBPROCESS ERROR: new=true reads on from your last read; leave out offset and tail"


async def test_extension_values_are_refused_with_what_to_send(tmp_path: Path) -> None:
    project = make_project(tmp_path)
    async with engine_at(tmp_path) as engine:
        tool = engine.tool
        cases: list[tuple[dict[str, object], str]] = [
            ({"cmd": "create", "command": "true", "stdin": "yes"}, "stdin must be true or false"),
            ({"cmd": "create", "command": "true", "ready": {}}, 'ready needs "log"'),
            ({"cmd": "create", "command": "true", "ready": {"port": 70000}}, "ready.port must be a TCP port"),
            ({"cmd": "create", "command": "true", "ready": {"port": 80, "timeout": 999}}, "at most 300"),
            ({"cmd": "create", "command": "true", "ready": {"log": "(x"}}, "not a valid regular expression"),
            ({"cmd": "create", "command": "true", "ready": {"url": "x"}}, "unknown member"),
            ({"cmd": "create", "command": "true", "restart": {"mode": "sometimes"}}, "restart.mode must be"),
            # the arguments are read before the pid is looked up (a tester's finding)
            ({"cmd": "wait", "pid": 1, "timeout": 301}, "timeout must be at most 300 seconds"),
            ({"cmd": "input", "pid": 1}, "cmd=input needs text"),
            ({"cmd": "log", "pid": 1, "which": "stdout", "new": "yes"}, "new must be true or false"),
            ({"cmd": "wait", "pid": 1}, "no subprocess with pid 1"),
            ({"cmd": "input", "pid": 1, "text": "y\n"}, "no subprocess with pid 1"),
            ({"cmd": "list", "timeout": 3}, "cmd=list does not take timeout"),
            ({"cmd": "log", "pid": 1, "which": "stdout", "text": "x"}, "cmd=log does not take text"),
        ]
        for params, expected in cases:
            text = await tool.execute(params, project)
            assert text.startswith("SUBPROCESS ERROR: ") and expected in text, (params, text)
        assert engine.service.ps() == []
        sp = await engine.service.create(project, "true")
        with trio.fail_after(10):
            await engine.service.wait(sp.pid)
        text = await tool.execute({"cmd": "wait", "pid": sp.pid, "timeout": 301}, project)
        assert text.startswith("SUBPROCESS ERROR: timeout must be at most 300 seconds")
        text = await tool.execute({"cmd": "input", "pid": sp.pid}, project)
        assert text.startswith("SUBPROCESS ERROR: cmd=input needs text")


async def test_create_with_restart_and_notify_on_exit_says_so_and_list_shows_restarts(tmp_path: Path) -> None:
    project = make_project(tmp_path)
    async with engine_at(tmp_path) as engine:
        tool = engine.tool
        created = await tool.execute(
            {
                "cmd": "create",
                "command": "bash",
                "args": ["-c", "exit 3"],
                "restart": {"mode": "on-failure", "max_restarts": 1, "window": 30, "backoff": 0.01},
                "notify_on_exit": True,
            },
            project,
        )
        assert created.split("\n")[4:] == [
            "restart: on-failure (at most 1 restarts in 30 s)",
            "notify on exit: yes",
        ]
        first = int(created.split("\n")[1].removeprefix("pid: "))
        waited = await tool.execute({"cmd": "wait", "pid": first, "timeout": 20}, project)
        current = engine.service.lookup(first).pid
        assert waited == f"SUBPROCESS WAIT\npid: {current}\nstatus: crash loop: 1 restarts in 30 s"
        listing = await tool.execute({"cmd": "list"}, project)
        assert listing.split("\n")[1].endswith(
            "| status: crash loop: 1 restarts in 30 s | restarts: 1 | "
            f"first pid: {first} | last exit: exited 3"
        )
