"""The main job of the standalone engine: a real ``gadget-engine serve`` driven through its CLI.

1. start the engine in the background with ``gadget-engine start`` on a temporary state directory (it
   returns once the engine answers);
2. run a real dev server (``python -m http.server`` on 127.0.0.1) with ``gadget-engine create`` and fetch
   a page from it;
3. arm a real test run as an on-exit job (``gadget-engine cron add --on-exit``) and wait for its fired
   event, then print its exit code and last lines;
4. stop it with ``gadget-engine stop`` (it returns once the engine has exited) and prove that no process
   is left.

Run it with ``python docs/examples/standalone_demo.py``; it exits 0 when every step worked.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

#: How long the demo waits for the test run's fired event, in seconds.
FIRE_WAIT_SECONDS = 30.0

TEST_RUN = """\
import time
print("collected 4 items")
time.sleep(0.5)
print("test_home PASSED")
print("test_login PASSED")
print("test_logout PASSED")
print("test_signup FAILED - assert 500 == 201")
print("3 passed, 1 failed in 0.50s")
raise SystemExit(1)
"""


def gadget_engine(state_dir: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run one ``gadget-engine`` client command (``python -m engine`` is the same program)."""
    argv = [sys.executable, "-m", "engine", "--state-dir", str(state_dir), *args]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    if check and out.returncode != 0:
        raise SystemExit(
            f"$ gadget-engine {shlex.join(args)} failed ({out.returncode}): {out.stderr.strip()}"
        )
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def alive(pid: int) -> bool:
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return data[data.rfind(b")") + 2 :].split()[0] != b"Z"


def wait_for(what: str, predicate: object, seconds: float) -> None:
    assert callable(predicate)
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.1)


def fetch(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            body: bytes = response.read()
            return body.decode()
    except OSError:
        return None


def main() -> int:
    tmp = Path(tempfile.mkdtemp(prefix="gadget-demo-"))
    state, app = tmp / "state", tmp / "app"
    app.mkdir()
    (app / "index.html").write_text("<h1>hello from the dev server</h1>\n")
    (app / "run_tests.py").write_text(TEST_RUN)
    serve_log = state / "engine.log"
    # On-exit commands run through ``bash -lc`` by default (the login profile's PATH); the demo's command
    # needs no profile, and one that stalls (a stale pyenv rehash lock waits 60 s) would stall the demo.
    start = ("start", "--grace-seconds", "1", "--exit-watch-shell", "bash -c --")
    print(f"$ gadget-engine --state-dir {state} {shlex.join(start)}")
    started = gadget_engine(state, *start)
    print(started.stdout, end="")
    engine_pid = int(started.stdout.split("(pid ")[1].split(")")[0])
    fired_ok = False
    try:
        port = free_port()
        create = ("create", "--project", str(app), "-e", "DEMO=1", "--")
        dev_server = (sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1")
        print(f"$ gadget-engine {shlex.join(create + dev_server)}")
        pid = int(gadget_engine(state, *create, *dev_server).stdout)
        print(f"dev server pid {pid}")
        wait_for("the dev server", lambda: fetch(f"http://127.0.0.1:{port}/") is not None, 20)
        page = fetch(f"http://127.0.0.1:{port}/index.html") or ""
        print(f"GET /index.html -> {page.strip()}")
        print("$ gadget-engine list")
        print(gadget_engine(state, "list").stdout, end="")

        command = f"{shlex.quote(sys.executable)} run_tests.py"
        arm = ("cron", "add", "--on-exit", command, "--cwd", str(app), "--name", "test-run")
        arm += ("--text", "The test run finished.")
        print(f"$ gadget-engine {shlex.join(arm)}")
        job_id = gadget_engine(state, *arm).stdout.strip()
        print(f"job {job_id} armed; waiting for its fired event")
        deadline = time.monotonic() + FIRE_WAIT_SECONDS
        event = None
        while event is None and time.monotonic() < deadline:
            lines = gadget_engine(state, "events", "--since", "0", "--json").stdout.splitlines()
            mine = [json.loads(line) for line in lines if json.loads(line)["job_id"] == job_id]
            event = mine[0] if mine else None
            if event is None:
                time.sleep(0.5)
        if event is None:
            print(
                f"on-exit: no fired event within {FIRE_WAIT_SECONDS:g} s: the test run has not ended "
                f"(gadget-engine cron get {job_id} shows its job; the engine log says why)"
            )
        else:
            fired_ok = event["exit_code"] == 1 and "3 passed, 1 failed" in event["stdout_tail"]
            print(f"fired event {event['cursor']}: exit code {event['exit_code']}, last lines:")
            for line in event["stdout_tail"].splitlines()[-3:]:
                print(f"    {line}")
    finally:
        print("$ gadget-engine stop --end-watched")  # a watched command still running ends too
        stopped = gadget_engine(state, "stop", "--end-watched", check=False)
        print(stopped.stdout + stopped.stderr, end="")
        code = stopped.returncode
    spawned = [
        int(word.split("=", 1)[1])
        for line in serve_log.read_text().splitlines()
        if "event=spawned" in line
        for word in line.split()
        if word.startswith("pid=")
    ]
    left = [p for p in [engine_pid, *spawned] if alive(p)]
    print(f"stop exited {code}; engine log: {len(serve_log.read_text().splitlines())} lines")
    print(f"processes left: {', '.join(map(str, left)) if left else 'none'}")
    shutil.rmtree(tmp, ignore_errors=True)
    return 0 if code == 0 and not left and fired_ok else 1


if __name__ == "__main__":
    os.environ.pop("GADGET_ENGINE_STATE_DIR", None)
    sys.exit(main())
