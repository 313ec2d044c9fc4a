"""The ``subprocess`` agent tool: definition, the six commands' texts, validation, errors, project scope."""

from __future__ import annotations

import math
import os
import re
import sys
import tempfile
from datetime import datetime
from pathlib import Path

import attrs
import jsonschema  # type: ignore[import-untyped]  # no stubs in the dev extra
import pytest
import trio
from hypothesis import event, given
from hypothesis import strategies as st

from engine import InvalidArgumentError, Project, SubprocessTool, open_engine
from engine._config import EngineConfig
from engine._tool import COMMANDS

from .children import SESSION, mark, pgrep, proc_exists, wait_for_text
from .service_support import engine_at, log_dir, make_project

_CREATED = re.compile(r"SUBPROCESS CREATED\npid: (\d+)\nstdout: (/\S+)\nstderr: (/\S+)")
_LIST_LINE = re.compile(r"pid: (\d+) \| project: (\S+) \| created: (\S+) \| updated: (\S+) \| status: (.+)")


# ---- the definition ---------------------------------------------------------------------------------


def _keys(node: object) -> set[str]:
    if isinstance(node, dict):
        return set(node) | {k for v in node.values() for k in _keys(v)}
    if isinstance(node, list):
        return {k for v in node for k in _keys(v)}
    return set()


def test_definition_is_a_plain_json_schema(tmp_path: Path) -> None:
    """With ``tool_extensions=False`` the definition is exactly the spec's (tests/test_tool_extensions.py
    has the extended one)."""

    async def main() -> dict[str, object]:
        async with open_engine(EngineConfig(state_dir=str(tmp_path), tool_extensions=False)) as engine:
            return engine.tool.definition

    definition = trio.run(main)
    assert set(definition) == {"name", "description", "parameters"}
    assert definition["name"] == "subprocess"
    assert isinstance(definition["description"], str) and "killAll" in definition["description"]
    schema = definition["parameters"]
    jsonschema.Draft202012Validator.check_schema(schema)
    assert not _keys(schema) & {"$schema", "$ref", "$defs", "if", "then", "else", "oneOf", "allOf"}
    assert isinstance(schema, dict)
    assert schema["type"] == "object" and schema["required"] == ["cmd"]
    props = schema["properties"]
    assert set(props) == {"cmd", "command", "args", "pid", "which", "offset", "limit", "tail"}
    assert props["cmd"]["enum"] == ["create", "list", "kill", "killAll", "halt", "log"]
    assert props["which"]["enum"] == ["stdout", "stderr"]
    assert props["args"] == {
        "type": "array",
        "items": {"type": "string"},
        "description": props["args"]["description"],
    }
    validator = jsonschema.Draft202012Validator(schema)
    assert validator.is_valid({"cmd": "create", "command": "npm", "args": ["run", "dev"]})
    assert validator.is_valid({"cmd": "log", "pid": 12, "which": "stderr", "tail": 5})
    assert not validator.is_valid({"cmd": "start"})
    assert not validator.is_valid({"cmd": "log", "which": "both"})


# ---- the six commands, byte for byte --------------------------------------------------------------------


async def test_tool_create_list_log_halt_kill_texts(tmp_path: Path) -> None:
    project = make_project(tmp_path, "my-project")
    async with engine_at(tmp_path) as engine:
        tool, service = engine.tool, engine.service
        created = await tool.execute(
            {"cmd": "create", "command": "bash", "args": ["-c", f"echo hello; sleep {mark('314.1')}"]},
            project,
        )
        match = _CREATED.fullmatch(created)
        assert match, created
        pid = int(match[1])
        folder = log_dir(project)
        assert match[2] == str(folder / f"subproc-{pid}.stdout.log")
        assert match[3] == str(folder / f"subproc-{pid}.stderr.log")
        await wait_for_text(match[2], "hello")

        listing = await tool.execute({"cmd": "list"}, project)
        header, line = listing.split("\n")
        assert header == "SUBPROCESS LIST"
        fields = _LIST_LINE.fullmatch(line)
        assert fields, line
        assert (int(fields[1]), fields[2], fields[5]) == (pid, "my-project", "running")
        for stamp in (fields[3], fields[4]):
            assert " " not in stamp and datetime.fromisoformat(stamp).tzinfo is not None

        log = await tool.execute({"cmd": "log", "pid": pid, "which": "stdout"}, project)
        assert log == f"SUBPROCESS LOG (stdout)\npid: {pid}\n---\nhello\n"
        err = await tool.execute({"cmd": "log", "pid": pid, "which": "stderr"}, project)
        assert err == f"SUBPROCESS LOG (stderr)\npid: {pid}\n---\n"

        halted = await tool.execute({"cmd": "halt", "pid": pid}, project)
        assert halted == (
            f"SUBPROCESS HALTED\npid: {pid}\n"
            "The process has been stopped. Log files are retained for inspection."
        )
        assert not pgrep(rf"sleep 314\.1{SESSION}")
        assert await tool.execute({"cmd": "log", "pid": pid, "which": "stdout"}, project) == log
        assert "status: killed by signal 2 (SIGINT)" in await tool.execute({"cmd": "list"}, project)

        killed = await tool.execute({"cmd": "kill", "pid": pid}, project)
        assert killed == f"SUBPROCESS KILLED\npid: {pid}"
        assert os.listdir(folder) == [".gitignore"]
        assert (
            await tool.execute({"cmd": "list"}, project)
            == "SUBPROCESS LIST\nNo subprocesses in this project."
        )

        await tool.execute({"cmd": "create", "command": "sleep", "args": [mark("314.2")]}, project)
        await tool.execute({"cmd": "create", "command": "sleep", "args": [mark("314.2")]}, project)
        # The spec's killAll: this test's own engine ends its own two children, nothing else on the machine.
        ended_all = await tool.execute({"cmd": "killAll"}, project)
        assert ended_all == (
            "SUBPROCESS KILLALL\nAll managed subprocesses have been terminated and their logs removed."
        )
        assert not pgrep(rf"sleep 314\.2{SESSION}") and service.ps() == []


async def test_tool_log_of_one_long_line_says_its_start_was_left_out(tmp_path: Path) -> None:
    """A log that is one line longer than a call's budget: the note says the start of that line was left
    out, not "0 earlier lines" (found by a new user)."""
    project = make_project(tmp_path)
    async with engine_at(tmp_path) as engine:
        sp = await engine.service.create(project, sys.executable, ["-c", "print('x' * 200000)"])
        with trio.fail_after(10):
            await sp.wait()
        shown = await engine.tool.execute({"cmd": "log", "pid": sp.pid, "which": "stdout"}, project)
        note = shown.rsplit("\n", 1)[1]
        assert note.startswith("[truncated") and "the start of the first line shown (" in note, note
        assert "0 earlier lines" not in note


async def test_tool_log_pages_and_says_what_was_left_out(tmp_path: Path) -> None:
    project = make_project(tmp_path)
    async with engine_at(tmp_path) as engine:
        tool = engine.tool
        sp = await engine.service.create(project, "seq", ["1", "500"])
        with trio.fail_after(10):
            await sp.wait()
        default = await tool.execute({"cmd": "log", "pid": sp.pid, "which": "stdout"}, project)
        _head, body = default.split("\n---\n", 1)
        content, note = body.rsplit("\n", 1)
        assert content.startswith("301\n") and content.endswith("\n500\n")
        assert "300 earlier lines" in note and "tail=" in note and "offset=" in note
        tail = await tool.execute({"cmd": "log", "pid": sp.pid, "which": "stdout", "tail": 2}, project)
        assert tail.split("\n---\n", 1)[1].startswith("499\n500\n\n[truncated")
        page = await tool.execute(
            {"cmd": "log", "pid": sp.pid, "which": "stdout", "offset": 0, "limit": 3}, project
        )
        text, more = page.split("\n---\n", 1)[1].rsplit("\n", 1)
        assert text == "1\n2\n3\n" and "continue with offset=6" in more.lower()
        last = await tool.execute(
            {"cmd": "log", "pid": sp.pid, "which": "stdout", "offset": 1876, "limit": 1000}, project
        )
        assert last == f"SUBPROCESS LOG (stdout)\npid: {sp.pid}\n---\n497\n498\n499\n500\n"


# ---- validation and service errors ------------------------------------------------------------------------


_BAD_PARAMS: list[object] = [
    {},
    ["cmd", "list"],
    {"cmd": "start"},
    {"cmd": None},
    {"cmd": "create"},
    {"cmd": "create", "command": ""},
    {"cmd": "create", "command": 7},
    {"cmd": "create", "command": "echo", "args": "hello"},
    {"cmd": "create", "command": "echo", "args": [1, 2]},
    {"cmd": "create", "command": "echo", "args": ["a\0b"]},
    {"cmd": "create", "command": "echo", "pid": 3},
    {"cmd": "list", "pid": 1},
    {"cmd": "list", "verbose": True},
    {"cmd": "kill"},
    {"cmd": "kill", "pid": "12"},
    {"cmd": "kill", "pid": True},
    {"cmd": "kill", "pid": -4},
    {"cmd": "kill", "pid": 2.5},
    {"cmd": "kill", "pid": 999999},
    {"cmd": "halt", "pid": 999999},
    {"cmd": "log", "pid": "PID"},
    {"cmd": "log", "pid": "PID", "which": "both"},
    {"cmd": "log", "pid": "PID", "which": "stdout", "tail": 2, "offset": 0},
    {"cmd": "log", "pid": "PID", "which": "stdout", "offset": -1},
    {"cmd": "log", "pid": "PID", "which": "stdout", "limit": 0},
    {"cmd": "log", "pid": "PID", "which": "stdout", "tail": math.inf},
    {"cmd": "log", "pid": "PID", "which": "stdout", "offset": 10**30},
    {"cmd": "killAll", "command": "echo"},
]


async def test_tool_rejects_bad_parameters_and_changes_nothing(tmp_path: Path) -> None:
    project = make_project(tmp_path)
    async with engine_at(tmp_path) as engine:
        tool, service = engine.tool, engine.service
        sp = await service.create(project, "sleep", [mark("314.3")])
        files = sorted(os.listdir(log_dir(project)))
        for raw in _BAD_PARAMS:
            params = (
                {k: (sp.pid if v == "PID" else v) for k, v in raw.items()} if isinstance(raw, dict) else raw
            )
            text = await tool.execute(params, project)  # type: ignore[arg-type]  # deliberately wrong
            assert text.startswith("SUBPROCESS ERROR: "), (raw, text)
            assert service.ps() == [sp] and sp.running, raw
            assert sorted(os.listdir(log_dir(project))) == files, raw
        assert "cmd must be one of create, list, kill, killAll, halt, log" in await tool.execute(
            {"cmd": "x"}, project
        )
        assert "needs which" in await tool.execute({"cmd": "log", "pid": sp.pid}, project)
        # a missing or bad argument is said before the pid is looked up (a tester's finding)
        unknown = {"cmd": "log", "pid": 1}
        assert await tool.execute(unknown, project) == "SUBPROCESS ERROR: cmd=log needs which"
        assert "which must be" in await tool.execute({**unknown, "which": "stdin"}, project)
        assert "give tail alone" in await tool.execute(
            {**unknown, "which": "stdout", "tail": 2, "offset": 0}, project
        )
        assert "no subprocess with pid 1" in await tool.execute({**unknown, "which": "stdout"}, project)


async def test_tool_reports_service_errors_as_text(tmp_path: Path) -> None:
    project = make_project(tmp_path)
    async with engine_at(tmp_path, max_processes_per_project=1) as engine:
        tool = engine.tool
        missing = await tool.execute({"cmd": "create", "command": "no-such-program-314"}, project)
        assert (
            missing.startswith("SUBPROCESS ERROR: ")
            and "not found" in missing
            and "no-such-program-314" in missing
        )
        await tool.execute({"cmd": "create", "command": "sleep", "args": [mark("314.4")]}, project)
        limited = await tool.execute({"cmd": "create", "command": "sleep", "args": [mark("314.4")]}, project)
        assert limited.startswith("SUBPROCESS ERROR: max_processes_per_project")
        gone = await tool.execute({"cmd": "kill", "pid": 999999}, project)
        assert gone.startswith("SUBPROCESS ERROR: no subprocess with pid 999999 in this project")
        assert len(pgrep(rf"sleep 314\.4{SESSION}")) == 1


async def test_tool_acts_on_the_calling_project_only(tmp_path: Path) -> None:
    mine, theirs = make_project(tmp_path, "mine"), make_project(tmp_path, "theirs")
    async with engine_at(tmp_path) as engine:
        tool, service = engine.tool, engine.service
        a = await service.create(mine, "sleep", [mark("314.5")])
        b = await service.create(theirs, "sleep", [mark("314.6")])
        c = await service.create(theirs, "sleep", [mark("314.6")])
        for cmd in ("kill", "halt"):
            text = await tool.execute({"cmd": cmd, "pid": b.pid}, mine)
            assert text.startswith("SUBPROCESS ERROR: no subprocess with pid"), text
        text = await tool.execute({"cmd": "log", "pid": b.pid, "which": "stdout"}, mine)
        assert text.startswith("SUBPROCESS ERROR: ")
        listing = await tool.execute({"cmd": "list"}, mine)
        assert f"pid: {a.pid} " in listing and f"pid: {b.pid} " not in listing
        assert await tool.execute({"cmd": "killAll"}, mine) == (
            "SUBPROCESS KILLALL\nAll managed subprocesses have been terminated and their logs removed."
        )
        assert not pgrep(rf"sleep 314\.5{SESSION}")
        assert len(pgrep(rf"sleep 314\.6{SESSION}")) == 2 and b.running and c.running
        assert service.ps() == [b, c]


async def test_tool_kill_cancelled_still_ends_the_process_then_propagates(tmp_path: Path) -> None:
    project = make_project(tmp_path)
    async with engine_at(tmp_path) as engine:
        sp = await engine.service.create(
            project, "bash", ["-c", f"trap '' INT; echo ready; sleep {mark('314.7')}"]
        )
        await wait_for_text(sp.stdout_path, "ready")
        with trio.move_on_after(0.05) as scope:
            await engine.tool.execute({"cmd": "kill", "pid": sp.pid}, project)
        assert scope.cancelled_caught
        assert not proc_exists(sp.pid) and not pgrep(rf"sleep 314\.7{SESSION}")
        assert engine.service.ps() == []


# ---- Hypothesis: arbitrary parameter dicts ------------------------------------------------------------

_HARMLESS = ("true", "sleep", "echo")
_PARAM_NAMES = ("cmd", "command", "args", "pid", "which", "offset", "limit", "tail")
_USES = {
    "create": {"command", "args"},
    "list": set(),
    "kill": {"pid"},
    "killAll": set(),
    "halt": {"pid"},
    "log": {"pid", "which", "offset", "limit", "tail"},
}


@attrs.frozen
class PidOf:
    """Stands for the pid of the n-th record of the project (a pid that may well exist)."""

    index: int


_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**63), st.floats(), st.text(max_size=8))
_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=5,
)
_non_strings = _values.filter(lambda v: not isinstance(v, str))
_small_ints = st.integers(-2, 40)
_field_values = {
    "cmd": st.one_of(st.sampled_from(COMMANDS), _values),
    "command": st.one_of(st.sampled_from(_HARMLESS), _non_strings),
    "args": st.one_of(
        st.lists(
            st.one_of(st.sampled_from(["0", "0.05", "30", "-n", "hi", ""]), st.text(max_size=6)), max_size=3
        ),
        _values,
    ),
    "pid": st.one_of(st.builds(PidOf, st.integers(0, 3)), _small_ints, _values),
    "which": st.one_of(st.sampled_from(["stdout", "stderr"]), _values),
    "offset": st.one_of(_small_ints, _values),
    "limit": st.one_of(_small_ints, _values),
    "tail": st.one_of(_small_ints, _values),
}


_good_values = {
    "command": st.sampled_from(_HARMLESS),
    "args": st.lists(st.sampled_from(["0", "0.05", "30", "hi", "-n"]), max_size=2),
    "pid": st.builds(PidOf, st.integers(0, 3)),
    "which": st.sampled_from(["stdout", "stderr"]),
    "offset": st.integers(0, 40),
    "limit": st.integers(1, 5),
    "tail": st.integers(1, 5),
}
_REQUIRED = {"create": {"command"}, "kill": {"pid"}, "halt": {"pid"}, "log": {"pid", "which"}}


@st.composite
def _params(draw: st.DrawFn) -> dict[str, object]:
    """Half well-formed calls, a quarter a known cmd with any values, a quarter anything anywhere."""
    cmd = draw(st.sampled_from(COMMANDS))
    style = draw(st.sampled_from([0, 0, 1, 2]))
    params: dict[str, object] = {"cmd": cmd}
    if style == 0:
        for name in sorted(_USES[cmd]):
            if name in _REQUIRED.get(cmd, ()) or draw(st.integers(0, 2)) == 0:
                params[name] = draw(_good_values[name])
        return params
    if style == 2 and draw(st.booleans()):
        params["cmd"] = draw(_field_values["cmd"])
    for name in sorted(_USES[cmd]) if style == 1 else _PARAM_NAMES[1:]:
        if draw(st.booleans()):
            params[name] = draw(_field_values[name])
    if draw(st.integers(0, 9)) == 0:
        params[draw(st.text(max_size=5))] = draw(_values)
    return params


def _whole(value: object, minimum: int) -> int | None:
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= 2**53:
        return None
    return value


def _expected(params: dict[str, object], pids: set[int]) -> str | None:
    """The header a valid call answers with, or ``None`` when the call must be rejected."""
    cmd = params.get("cmd")
    if any(k not in _PARAM_NAMES for k in params) or cmd not in COMMANDS:
        return None
    assert isinstance(cmd, str)
    if any(params.get(k) is not None and k not in _USES[cmd] for k in _PARAM_NAMES[1:]):
        return None
    if cmd == "create":
        command, args = params.get("command"), params.get("args")
        args = [] if args is None else args
        ok = isinstance(command, str) and bool(command.strip())
        ok = ok and isinstance(args, list) and all(isinstance(a, str) and "\0" not in a for a in args)
        return "SUBPROCESS CREATED" if ok else None
    if cmd in ("list", "killAll"):
        return "SUBPROCESS LIST" if cmd == "list" else "SUBPROCESS KILLALL"
    pid = _whole(params.get("pid"), 1)
    if pid is None or pid not in pids:
        return None
    if cmd in ("kill", "halt"):
        return "SUBPROCESS KILLED" if cmd == "kill" else "SUBPROCESS HALTED"
    which, offset, limit, tail = (params.get(k) for k in ("which", "offset", "limit", "tail"))
    if which not in ("stdout", "stderr"):
        return None
    if tail is not None and (offset is not None or limit is not None):
        return None
    for value, minimum in ((offset, 0), (limit, 1), (tail, 1)):
        if value is not None and _whole(value, minimum) is None:
            return None
    return f"SUBPROCESS LOG ({which})"


_first_create = st.fixed_dictionaries(
    {"cmd": st.just("create"), "command": _good_values["command"], "args": _good_values["args"]}
)


@given(calls=st.builds(lambda first, rest: [first, *rest], _first_create, st.lists(_params(), max_size=6)))
def test_tool_any_parameters_answer_with_text_and_change_only_what_valid_calls_change(
    calls: list[dict[str, object]],
) -> None:
    async def main(root: str) -> None:
        directory = Path(root) / "p"
        directory.mkdir()
        project = Project.from_directory(directory)
        config = EngineConfig(state_dir=os.path.join(root, "state"), grace_seconds=0.2, kill_wait_seconds=1.0)
        async with open_engine(config) as engine:
            tool: SubprocessTool = engine.tool
            service = engine.service
            for raw in calls:
                before = service.ps()
                pids = [sp.pid for sp in before]
                params = {
                    k: (pids[v.index % len(pids)] if pids else 999999) if isinstance(v, PidOf) else v
                    for k, v in raw.items()
                }
                live_before = {sp for sp in before if sp.running}
                with trio.fail_after(10):
                    text = await tool.execute(params, project)
                assert isinstance(text, str)
                after = service.ps()
                live_after = {sp for sp in after if sp.running}
                expected = _expected(params, set(pids))
                event(expected or "rejected")
                if expected is None:
                    assert text.startswith("SUBPROCESS ERROR: "), (params, text)
                    assert after == before and live_after <= live_before, params
                    continue
                assert text.startswith(expected), (params, text)
                if expected == "SUBPROCESS CREATED":
                    assert after[:-1] == before and len(after) == len(before) + 1
                    assert live_after - {after[-1]} <= live_before
                    continue
                assert live_after <= live_before
                target = [sp for sp in before if sp.pid == _whole(params.get("pid"), 1)]
                if expected == "SUBPROCESS KILLED":
                    assert after == [sp for sp in before if sp is not target[-1]] or len(target) > 1
                elif expected == "SUBPROCESS HALTED":
                    assert after == before and not target[-1].running
                elif expected == "SUBPROCESS KILLALL":
                    assert after == []
                else:
                    assert after == before

    with tempfile.TemporaryDirectory() as root:
        trio.run(main, root)


def test_tool_rejects_a_call_not_bound_to_a_project(tmp_path: Path) -> None:
    async def main() -> str:
        async with open_engine(EngineConfig(state_dir=str(tmp_path))) as engine:
            return await engine.tool.execute({"cmd": "list"}, "not-a-project")  # type: ignore[arg-type]

    assert trio.run(main).startswith("SUBPROCESS ERROR: ")


@pytest.mark.parametrize("mode", ["Build", "Test", "Ship", "Develop"])
def test_tool_is_registered_for_its_modes(mode: str) -> None:
    from engine import TOOL_MODES, tools_for_mode

    assert mode in TOOL_MODES and tools_for_mode(mode) == ("subprocess",)


# ---- NB-08: a value the engine could not answer with is refused before anything starts ------------------


async def test_tool_nb08_refuses_a_non_utf8_argument_and_list_still_answers(tmp_path: Path) -> None:
    project = make_project(tmp_path)
    name = b"caf\xe9-314.8" + SESSION.encode() + b".txt"
    with open(os.path.join(os.fsencode(project.directory), name), "wb"):
        pass
    arg = os.fsdecode(name)  # "caf\udce9-314.8.txt", as json.dumps sends it
    async with engine_at(tmp_path) as engine:
        tool, service = engine.tool, engine.service
        text = await tool.execute({"cmd": "create", "command": "tail", "args": ["-f", arg]}, project)
        assert text.startswith("SUBPROCESS ERROR: args[1] holds the lone surrogate U+DCE9"), text
        text.encode("utf-8")  # the refusal itself can be sent back
        for params in (
            {"cmd": "create", "command": "tail\udcff"},
            {"cmd": "create", "command": "echo", "args": ["a\0b"]},
            {"cmd": "log", "pid": 1, "which": "std\udcff"},
            {"cmd": "list", "\udcff": 1},
        ):
            refused = await tool.execute(params, project)
            assert refused.startswith("SUBPROCESS ERROR: "), (params, refused)
            refused.encode("utf-8")
        assert service.ps() == [] and not pgrep(rf"caf.-314\.8{SESSION}")
        assert not (Path(project.directory) / ".gadget").exists()
        assert await tool.execute({"cmd": "list"}, project) == (
            "SUBPROCESS LIST\nNo subprocesses in this project."
        )
        # The library refuses the same value with its typed error (a ValueError), nothing made either.
        with pytest.raises(InvalidArgumentError, match=r"args\[1\]") as info:
            await service.create(project, "tail", ["-f", arg])
        assert isinstance(info.value, ValueError)
        with pytest.raises(InvalidArgumentError, match="env"):
            await service.create(project, "true", env={"A": arg})
        assert service.ps() == []
