"""A real ``gadget-engine serve`` process for the CLI, RPC and server tests, and the CLI run against it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import attrs

from engine.server._client import EngineClient
from engine.server._location import find_socket_path

#: The grace period of every test engine.
GRACE = "0.5"
#: Watchers of test engines use a plain shell (design section 7: a login shell only where it is the point).
SHELL = ("--exit-watch-shell", "bash -c --")
#: Start-up and shutdown bound of a test engine, in seconds.
START_SECONDS = 20.0


def cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 30.0
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m engine ARGS...`` and capture its output."""
    return subprocess.run(
        [sys.executable, "-m", "engine", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


def answers(path: str) -> bool:
    """Whether something accepts connections on the Unix socket ``path``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except OSError:
            return False
        return True


@attrs.define
class Served:
    """One ``serve`` process on ``state_dir``; its stderr (the event log) goes to ``log_path``."""

    state_dir: Path
    proc: subprocess.Popen[bytes]
    log_path: Path

    @property
    def socket_path(self) -> str:
        return find_socket_path(str(self.state_dir))

    def cli(self, *args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        """Run a client subcommand against this engine (``--state-dir`` right after the subcommand)."""
        return cli(args[0], "--state-dir", str(self.state_dir), *args[1:], timeout=timeout)

    def cli_parallel(self, *commands: tuple[str, ...]) -> list[subprocess.CompletedProcess[str]]:
        """Run several client subcommands at once (each as :meth:`cli`); their results in order."""
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "engine", args[0], "--state-dir", str(self.state_dir), *args[1:]],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for args in commands
        ]
        results = []
        for args, proc in zip(commands, procs, strict=True):
            out, err = proc.communicate(timeout=30)
            results.append(subprocess.CompletedProcess(list(args), proc.returncode, out, err))
        return results

    def client(self) -> EngineClient:
        return EngineClient(str(self.state_dir), timeout_seconds=30.0)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"serve exited with {self.proc.returncode}: {self.log()}")
            if "event=ready" in self.log() and answers(self.socket_path):
                return
            time.sleep(0.02)
        raise AssertionError(f"serve did not become ready: {self.log()}")

    def stop(self, signum: int = signal.SIGTERM) -> int:
        """Signal the engine and wait for it to exit; its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signum)
        return self.proc.wait(timeout=START_SECONDS)

    def kill_hard(self) -> None:
        """SIGKILL the engine (its guardian ends the children) and wait for it."""
        self.proc.kill()
        self.proc.wait(timeout=START_SECONDS)


def start_serve(state_dir: Path, *extra: str, wait: bool = True) -> Served:
    """Start ``python -m engine --state-dir DIR serve --grace-seconds 0.5 EXTRA...``."""
    log_path = state_dir.parent / f"{state_dir.name}-serve-{time.monotonic_ns()}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "engine",
                "--state-dir",
                str(state_dir),
                "serve",
                "--grace-seconds",
                GRACE,
                *SHELL,
                *extra,
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
    served = Served(state_dir=state_dir, proc=proc, log_path=log_path)
    if wait:
        served.wait_ready()
    return served


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live (not zombie) process."""
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return data[data.rfind(b")") + 2 :].split()[0] != b"Z"


def wait_until(predicate: object, seconds: float = 10.0) -> bool:
    """Poll ``predicate()`` every 20 ms until it is true or ``seconds`` pass."""
    assert callable(predicate)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return bool(predicate())


def env_without_state_dir() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("GADGET_ENGINE_STATE_DIR", None)
    return env
