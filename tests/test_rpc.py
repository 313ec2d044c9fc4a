"""The JSON-RPC protocol and method table, over the socket of a real ``gadget-engine serve``."""

from __future__ import annotations

import ast
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

import pytest

import engine
from engine import (
    InvalidArgumentError,
    InvalidScheduleError,
    JobNotFoundError,
    SpawnError,
    SubProcessNotFoundError,
)
from engine.server import _client, _location, _protocol
from engine.server._client import EngineClient, EngineNotRunningError
from engine.server._protocol import (
    APPLICATION_CODES,
    INVALID_PARAMS,
    INVALID_REQUEST,
    MAX_LINE_BYTES,
    METHOD_NOT_FOUND,
    PARSE_ERROR,
    ProtocolError,
    RpcError,
    encode_error,
    exception_from_error,
    parse_request,
)

from .children import SESSION, pgrep
from .serve_support import Served, alive, wait_until


class Raw:
    """A bare socket connection speaking lines."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(20)
        self.sock.connect(path)
        self.buffer = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def line(self) -> dict[str, Any] | None:
        while b"\n" not in self.buffer:
            chunk = self.sock.recv(65536)
            if not chunk:
                return None
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        value = json.loads(line)
        assert isinstance(value, dict)
        return value

    def ask(self, data: bytes) -> dict[str, Any]:
        self.send(data)
        answer = self.line()
        assert answer is not None
        return answer

    def close(self) -> None:
        self.sock.close()


def _request(method: str, params: object = None, request_id: object = 1) -> bytes:
    body: dict[str, object] = {"jsonrpc": "2.0", "method": method, "id": request_id}
    if params is not None:
        body["params"] = params
    return json.dumps(body).encode() + b"\n"


# ---- the protocol alone --------------------------------------------------------------------------------


def test_protocol_parse_request_refuses_what_is_not_a_request() -> None:
    cases = {
        b"{nope": PARSE_ERROR,
        b"NaN": PARSE_ERROR,
        b"\xff\xfe": PARSE_ERROR,
        b"[1]": INVALID_REQUEST,
        b"42": INVALID_REQUEST,
        b'{"jsonrpc": "1.0", "method": "status", "id": 1}': INVALID_REQUEST,
        b'{"jsonrpc": "2.0", "id": 1}': INVALID_REQUEST,
        b'{"jsonrpc": "2.0", "method": "status", "params": [1], "id": 1}': INVALID_REQUEST,
        b'{"jsonrpc": "2.0", "method": "status", "id": 1.5}': INVALID_REQUEST,
        b'{"jsonrpc": "2.0", "method": "status", "id": 1, "extra": 1}': INVALID_REQUEST,
    }
    for line, code in cases.items():
        with pytest.raises(ProtocolError) as info:
            parse_request(line)
        assert info.value.code == code, line
    request = parse_request(b'{"jsonrpc": "2.0", "method": "status"}')
    assert request.notification and request.params == {}


def test_protocol_error_codes_map_back_to_the_engine_classes() -> None:
    codes = [code for _cls, code in APPLICATION_CODES]
    assert len(codes) == len(set(codes)) and all(-32099 <= code <= -32000 for code in codes)
    for cls, code in APPLICATION_CODES:
        assert type(exception_from_error(code, "m", {"type": cls.__name__})) is cls
    spawn = exception_from_error(
        -32002, "boom", {"type": "SpawnError", "errno": 2, "path": "/x", "reason": "r"}
    )
    assert isinstance(spawn, SpawnError) and (spawn.errno, spawn.filename, spawn.reason) == (2, "/x", "r")
    other = exception_from_error(INVALID_PARAMS, "bad", None)
    assert isinstance(other, RpcError) and other.code == INVALID_PARAMS
    assert json.loads(encode_error({"not": "an id"}, INVALID_REQUEST, "x"))["id"] is None


def test_client_modules_import_no_trio() -> None:
    for module in (_client, _protocol, _location):
        tree = ast.parse(Path(module.__file__ or "").read_text())
        imported = {
            alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
        }
        imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert not any(name.split(".")[0] in ("trio", "trio_util", "attrs") for name in imported), module


def test_client_without_engine_raises_not_running(tmp_path: Path) -> None:
    with pytest.raises(EngineNotRunningError, match="no engine is running"):
        EngineClient(str(tmp_path)).call("status")


# ---- bad requests against a live engine -----------------------------------------------------------------


def test_rpc_bad_requests_get_errors_and_the_connection_goes_on(served: Served) -> None:
    raw = Raw(served.socket_path)
    try:
        assert raw.ask(b"{not json\n")["error"]["code"] == PARSE_ERROR
        assert raw.ask(b'{"jsonrpc": "2.0", "method": 7, "id": 2}\n')["error"]["code"] == INVALID_REQUEST
        unknown = raw.ask(_request("subprocess.explode", {}, 3))
        assert unknown["id"] == 3 and unknown["error"]["code"] == METHOD_NOT_FOUND
        wrong = raw.ask(_request("subprocess.kill", {"pid": "twelve"}, 4))
        assert (
            wrong["error"]["code"] == INVALID_PARAMS
            and "pid must be a whole number" in wrong["error"]["message"]
        )
        extra = raw.ask(_request("status", {"verbose": True}, 5))
        assert extra["error"]["code"] == INVALID_PARAMS and "verbose" in extra["error"]["message"]
        missing = raw.ask(_request("cron.add", {"payload": {"kind": "system_event", "text": "x"}}, 6))
        assert "missing parameter schedule" in missing["error"]["message"]
        nested = raw.ask(_request("cron.add", {"schedule": {"kind": "every"}, "payload": {}}, 7))
        assert "schedule.every_seconds" in nested["error"]["message"]
        deep = raw.ask(b"[" * 100_000 + b"\n")  # nests past the parser's recursion limit
        assert deep["error"]["code"] == PARSE_ERROR and "nests too deeply" in deep["error"]["message"]
        huge = raw.ask(
            b'{"jsonrpc": "2.0", "method": "subprocess.kill", "params": {"pid": 1e400}, "id": 8}\n'
        )
        assert huge["error"]["code"] == PARSE_ERROR and "out of range" in huge["error"]["message"]
        raw.send(b'{"jsonrpc": "2.0", "method": "status"}\n\n')  # a notification and a blank line: no answer
        status = raw.ask(_request("status", None, "after"))
        assert status["id"] == "after" and status["result"]["pid"] == served.proc.pid
    finally:
        raw.close()


def test_rpc_oversized_request_drops_only_that_connection(served: Served) -> None:
    other = Raw(served.socket_path)
    big = Raw(served.socket_path)
    try:
        big.send(b'{"jsonrpc": "2.0", "method": "status", "params": {"x": "' + b"a" * MAX_LINE_BYTES)
        answer = big.line()
        assert answer is not None and answer["error"]["code"] == INVALID_REQUEST
        assert "larger than" in answer["error"]["message"]
        assert big.line() is None  # closed
        assert other.ask(_request("status"))["result"]["pid"] == served.proc.pid
    finally:
        other.close()
        big.close()


def test_rpc_client_leaving_mid_request_affects_nobody(served: Served, project: Path) -> None:
    half = Raw(served.socket_path)
    half.send(b'{"jsonrpc": "2.0", "method": "sta')
    half.close()
    ignoring = "import signal,time; signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(60)"
    with served.client() as client:
        pid = client.call(
            "subprocess.create", project=str(project), command=sys.executable, args=["-c", ignoring]
        )["pid"]
        leaver = Raw(served.socket_path)
        leaver.send(_request("subprocess.kill", {"pid": pid}))  # takes the 0.5 s grace, then SIGKILL
        leaver.close()
        assert client.call("status")["pid"] == served.proc.pid  # served meanwhile
        assert wait_until(lambda: not alive(pid), seconds=10)  # the kill still completed
        assert wait_until(lambda: all(r["pid"] != pid for r in client.call("subprocess.list")))


# ---- the methods -----------------------------------------------------------------------------------------


def test_rpc_errors_come_back_as_the_engine_classes(served: Served, project: Path) -> None:
    with served.client() as client:
        with pytest.raises(SubProcessNotFoundError):
            client.call("subprocess.summarize", pid=999999)
        with pytest.raises(SpawnError) as spawn:
            client.call("subprocess.create", project=str(project), command="no-such-program-xyz")
        assert spawn.value.reason and "no-such-program-xyz" in str(spawn.value)
        with pytest.raises(JobNotFoundError):
            client.call("cron.get", job_id="nope")
        with pytest.raises(InvalidScheduleError):
            client.call(
                "cron.add",
                schedule={"kind": "cron", "expr": "61 * * * *"},
                payload={"kind": "system_event", "text": "x"},
            )
        with pytest.raises(RpcError) as invalid:
            client.call("subprocess.create", project="relative/dir", command="true")
        assert invalid.value.code == INVALID_PARAMS and "project" in str(invalid.value)
        assert client.call("status")["version"] == engine.__version__  # the connection is still good


def test_rpc_cron_methods_scoped_to_a_project(served: Served, tmp_path: Path) -> None:
    mine, other = tmp_path / "mine", tmp_path / "other"
    mine.mkdir()
    other.mkdir()
    every = {"kind": "every", "every_seconds": 3600}
    with served.client() as client:
        job = client.call(
            "cron.add", schedule=every, payload={"kind": "system_event", "text": "x"}, project=str(mine)
        )
        assert job["project"] == engine.Project.from_directory(mine).id
        loose = client.call("cron.add", schedule=every, payload={"kind": "system_event", "text": "y"})
        assert loose["project"] is None
        assert [j["id"] for j in client.call("cron.list", project=str(mine))] == [job["id"]]
        assert client.call("cron.list", project=str(other)) == []
        for method in ("cron.get", "cron.remove", "cron.enable", "cron.disable", "cron.run_now"):
            with pytest.raises(JobNotFoundError, match="names no cron job"):
                client.call(method, job_id=job["id"], project=str(other))
            with pytest.raises(JobNotFoundError):
                client.call(method, job_id=loose["id"], project=str(mine))
        with pytest.raises(JobNotFoundError):
            client.call("cron.update", job_id=job["id"], name="n", project=str(other))
        assert client.call("cron.update", job_id=job["id"], name="n", project=str(mine))["name"] == "n"
        client.call("cron.run_now", job_id=job["id"], project=str(mine))
        events = client.call("events", project=str(mine))
        assert [(e["job_id"], e["project"]) for e in events] == [(job["id"], job["project"])]
        assert client.call("events", project=str(other)) == []
        assert client.call("cron.remove", job_id=job["id"], project=str(mine))["removed"] is True
        client.call("cron.remove", job_id=loose["id"])


def test_rpc_status_lists_every_method(served: Served) -> None:
    with served.client() as client:
        status = client.call("status")
    assert status["state_dir"] == str(served.state_dir) and status["socket"] == served.socket_path
    assert status["uptime_seconds"] >= 0 and set(status["subprocesses"]) == {"total", "running"}
    assert {
        "subprocess.create",
        "subprocess.list",
        "subprocess.summarize",
        "subprocess.kill",
        "subprocess.kill_project",
        "subprocess.kill_all",
        "subprocess.halt",
        "subprocess.read_log",
        "tool.execute",
        "tool.definition",
        "cron.add",
        "cron.update",
        "cron.list",
        "cron.get",
        "cron.remove",
        "cron.enable",
        "cron.disable",
        "cron.run_now",
        "events",
        "status",
    } <= set(status["methods"])


def test_rpc_read_log_follows_from_an_offset(served: Served, project: Path) -> None:
    code = "import time\nfor i in range(5):\n    print(f'n{i}', flush=True); time.sleep(0.1)"
    with served.client() as client:
        pid = client.call(
            "subprocess.create", project=str(project), command=sys.executable, args=["-c", code]
        )["pid"]
        text, offset = "", 0
        while True:
            piece = client.call("subprocess.read_log", pid=pid, offset=offset, limit=2)
            text += piece["text"]
            offset = piece["next_offset"]
            if not piece["running"] and offset >= piece["total_bytes"]:
                break
        assert text == "".join(f"n{i}\n" for i in range(5))
        tail = client.call("subprocess.read_log", pid=pid, tail=2, stream="stdout")
        assert tail["text"] == "n3\nn4\n" and tail["pid"] == pid and tail["truncated"] is True
        with pytest.raises(RpcError, match="tail alone"):
            client.call("subprocess.read_log", pid=pid, tail=2, offset=0)
        client.call("subprocess.kill", pid=pid)


def test_rpc_kill_project_tool_and_cron_methods(served: Served, project: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    with served.client() as client:
        mine = client.call("subprocess.create", project=str(project), command="sleep", args=["60"])["pid"]
        theirs = client.call("subprocess.create", project=str(other), command="sleep", args=["60"])["pid"]
        assert [r["pid"] for r in client.call("subprocess.list", project=str(project))] == [mine]
        client.call("subprocess.kill_project", project=str(project))
        assert not alive(mine) and alive(theirs)
        assert client.call("subprocess.kill_all") == {"verified": True}

        assert client.call("tool.definition")["name"] == "subprocess"
        listed = client.call("tool.execute", params={"cmd": "list"}, project=str(project))
        assert listed["text"].startswith("SUBPROCESS LIST") and listed["is_error"] is False
        refused = client.call("tool.execute", params={"cmd": "kill", "pid": theirs}, project=str(project))
        assert refused["is_error"] is True

        job = client.call(
            "cron.add",
            schedule={"kind": "every", "every_seconds": 3600},
            payload={"kind": "system_event", "text": "a"},
        )
        before = client.call("events", since=0)
        client.call("cron.run_now", job_id=job["id"])
        fired = client.call("events", since=before[-1]["cursor"] if before else 0)
        assert [e["job_id"] for e in fired] == [job["id"]] and fired[0]["text"] == "a"
        renamed = client.call("cron.update", job_id=job["id"], name="renamed", enabled=False)
        assert (renamed["name"], renamed["enabled"], renamed["next_run_at"]) == ("renamed", False, None)
        assert client.call("cron.remove", job_id=job["id"]) == {"job_id": job["id"], "removed": True}
        assert client.call("events", since=0, limit=1) == client.call("events", since=0)[:1]


# ---- poison values and absurd sizes (NB-08, issue 16) ----------------------------------------------------


def test_rpc_nb08_a_non_utf8_argument_is_refused_before_anything_starts(
    served: Served, project: Path
) -> None:
    marker = f"nb08-{SESSION}"
    name = b"caf\xe9-" + marker.encode() + b".txt"
    with open(os.path.join(os.fsencode(project), name), "wb"):
        pass
    params = {"project": str(project), "command": "tail", "args": ["-f", os.fsdecode(name)]}
    line = _request("subprocess.create", params)
    assert b'"caf\\udce9-' in line  # what json.dumps(os.fsdecode(name)) sends
    raw = Raw(served.socket_path)
    try:
        refused = raw.ask(line)
        message = refused["error"]["message"]
        assert refused["error"]["code"] == INVALID_PARAMS, refused
        assert "args[1] holds the lone surrogate U+DCE9" in message and "send UTF-8 text" in message
        assert not pgrep(marker)  # nothing started
        listed = raw.ask(_request("subprocess.list", {}, 2))
        assert all(marker not in " ".join(r["args"]) for r in listed["result"])
        assert not (project / ".gadget").exists()
    finally:
        raw.close()
    assert served.cli("list").returncode == 0  # `list` answers on every surface


def test_rpc_poison_in_a_job_is_refused_and_nothing_is_stored(served: Served) -> None:
    every = {"kind": "every", "every_seconds": 3600}
    text = {"kind": "system_event", "text": "ok"}
    cases: list[tuple[dict[str, object], int, str]] = [
        ({"schedule": every, "payload": {"kind": "system_event", "text": "\udcff"}}, -32005, "text holds"),
        ({"schedule": {"kind": "on_exit", "command": "echo \udcff"}, "payload": text}, -32005, "command"),
        ({"schedule": {"kind": "cron", "expr": "0 9 * * *", "tz": "\udcff"}, "payload": text}, -32005, "tz"),
        ({"schedule": every, "payload": {"kind": "command", "argv": ["ls", "a\0"]}}, -32005, "argv[1]"),
        ({"schedule": every, "payload": text, "name": "caf\udce9"}, INVALID_PARAMS, "name holds"),
        # Absurd sizes are ordinary usage errors, never -32603 with a traceback.
        ({"schedule": {**every, "every_seconds": 10**400}, "payload": text}, INVALID_PARAMS, "401-digit"),
        ({"schedule": {"kind": "cron", "expr": "0 9 * * *", "tz": "x" * 300}, "payload": text}, -32005, "tz"),
    ]
    with served.client() as client:
        before = client.call("cron.list")
        job = client.call("cron.add", schedule=every, payload=text, name="kept")
    raw = Raw(served.socket_path)
    try:
        for i, (params, code, where) in enumerate(cases):
            answer = raw.ask(_request("cron.add", params, i))
            assert answer["error"]["code"] == code and where in answer["error"]["message"], answer
        renamed = raw.ask(_request("cron.update", {"job_id": job["id"], "name": "\udcff"}, "u"))
        assert renamed["error"]["code"] == INVALID_PARAMS and "name" in renamed["error"]["message"]
        # A request id that could not be sent back is refused too, and the connection goes on.
        raw.send(b'{"jsonrpc": "2.0", "method": "status", "id": "\\udcff"}\n')
        bad_id = raw.line()
        assert bad_id is not None and bad_id["error"]["code"] == INVALID_REQUEST and bad_id["id"] is None
        assert raw.ask(_request("status", None, "after"))["result"]["pid"] == served.proc.pid
    finally:
        raw.close()
    with served.client() as client:
        assert client.call("cron.list") == [*before, job]  # nothing stored, the good job unchanged
        client.call("cron.remove", job_id=job["id"])
    assert served.cli("cron", "list").returncode == 0
    assert "Traceback" not in served.log()


def test_rpc_library_argument_errors_travel_as_invalid_argument_error() -> None:
    code = dict((cls, code) for cls, code in APPLICATION_CODES)[InvalidArgumentError]
    error = exception_from_error(code, "name must be a non-empty string", {"type": "InvalidArgumentError"})
    assert type(error) is InvalidArgumentError and isinstance(error, ValueError)
