"""The main job for the subprocess service: a real dev server, driven the way an agent drives it.

In a temporary project it starts ``python -m http.server`` on 127.0.0.1 (port 0: the kernel picks a free
one) through the ``subprocess`` tool, learns the port from the server's own log, fetches a page over
loopback, reads the access log through the tool, halts the server (logs kept), kills it (logs removed),
and proves that no process is left: ``pgrep`` finds nothing and ``/proc/<pid>`` is gone.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import trio

from engine import EngineConfig, Project, open_engine

#: A word only our page holds, so the fetch proves it reached this server.
MARKER = "gadget-service-demo"
#: What ``pgrep -f`` looks for afterwards: the server's command line.
SERVER_PATTERN = r"http\.server 0 --bind 127\.0\.0\.1"


def say(title: str, text: str = "") -> None:
    print(f"== {title}")
    if text:
        print(text)
    print(flush=True)


def fetch(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.status, response.read().decode()


def read_port(log_path: Path) -> int | None:
    """The port the server announced in its stdout log (``Serving HTTP on ... port N``), if it has yet."""
    match = re.search(r"port (\d+)", log_path.read_text(errors="replace"))
    return int(match[1]) if match else None


async def wait_for_port(log_path: Path) -> int:
    with trio.fail_after(15):
        while True:
            port = read_port(log_path)
            if port is not None:
                return port
            await trio.sleep(0.05)


def what_is_left(pid: int, log_folder: Path) -> tuple[list[str], list[str], bool]:
    """Log files still in the folder (its ``.gitignore`` stays), matching processes (``pgrep -f``), whether
    ``/proc/<pid>`` exists."""
    out = subprocess.run(["pgrep", "-f", SERVER_PATTERN], capture_output=True, text=True, check=False)
    processes = [p for p in out.stdout.split() if int(p) != os.getpid()]
    logs = [name for name in os.listdir(log_folder) if name != ".gitignore"]
    return logs, processes, os.path.exists(f"/proc/{pid}")


async def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "demo-site"
        root.mkdir()
        (root / "index.html").write_text(f"<h1>hello from {MARKER}</h1>\n")
        project = Project.from_directory(root)
        config = EngineConfig(state_dir=str(Path(tmp) / "state"), grace_seconds=2.0)
        async with open_engine(config) as engine:
            tool = engine.tool
            created = await tool.execute(
                {
                    "cmd": "create",
                    "command": sys.executable,
                    "args": ["-u", "-m", "http.server", "0", "--bind", "127.0.0.1", "--directory", "."],
                },
                project,
            )
            say("tool: create", created)
            pid = int(re.search(r"pid: (\d+)", created)[1])  # type: ignore[index]  # the text has it
            stdout_path = Path(re.search(r"stdout: (.+)", created)[1])  # type: ignore[index]
            port = await wait_for_port(stdout_path)

            status, body = await trio.to_thread.run_sync(fetch, f"http://127.0.0.1:{port}/index.html")
            say(f"fetched http://127.0.0.1:{port}/index.html over loopback", f"HTTP {status}: {body.strip()}")
            assert status == 200 and MARKER in body

            say("tool: list", await tool.execute({"cmd": "list"}, project))
            await trio.sleep(0.2)  # the access log line is written after the response
            access = await tool.execute({"cmd": "log", "pid": pid, "which": "stderr"}, project)
            say("tool: log stderr (the server's access log)", access)
            assert "GET /index.html" in access

            halted = await tool.execute({"cmd": "halt", "pid": pid}, project)
            say("tool: halt", halted)
            summary = engine.service.summarize(engine.service.lookup(pid))
            kept = [Path(p).name for p in (summary.stdout_path, summary.stderr_path)]
            print(f"after halt: status={summary.status!r}, logs kept: {kept}")
            say(
                "tool: log stdout after halt",
                await tool.execute({"cmd": "log", "pid": pid, "which": "stdout"}, project),
            )

            killed = await tool.execute({"cmd": "kill", "pid": pid}, project)
            say("tool: kill", killed)
            logs_left, left, proc_present = what_is_left(pid, stdout_path.parent)
            print(f"log files left: {logs_left or 'none'}")
            print(f"/proc/{pid} present: {proc_present}")
            print(f"processes left: {left or 'none'}")
            say("tool: list", await tool.execute({"cmd": "list"}, project))
            ok = not left and not proc_present and not logs_left and status == 200
    print("demo:", "OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    started = time.monotonic()
    code = trio.run(main)
    print(f"took {time.monotonic() - started:.2f} s")
    sys.exit(code)
