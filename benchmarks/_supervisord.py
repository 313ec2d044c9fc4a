"""A private supervisord for the comparison rows: started on a Unix socket in a temporary dir, driven
through its XML-RPC interface, shut down at the end. Uses the installed ``supervisor`` package."""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import subprocess
import sys
import textwrap
import time
import xmlrpc.client
from typing import Any

#: How many cooperative sleepers the ``coop`` group holds (``stopProcessGroup`` of a small N).
GROUP_SIZE = 10

IGNORING_SH = "trap '' INT; exec sleep 600"


#: ``prctl(PR_SET_PDEATHSIG, ...)``: a signal the kernel sends the child when its parent thread ends.
_PR_SET_PDEATHSIG = 1


def _end_with_the_runner(prctl: Any, runner: int) -> None:
    """In supervisord's child before its exec: SIGTERM it (a clean stop of its programs) when the
    benchmark's process ends, by any death (a runner stopped with SIGTERM or SIGKILL runs no clean-up:
    supervisord and its sleepers were left running). ``prctl`` is libc's, looked up in the parent."""
    prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != runner:  # the runner ended before the prctl
        os.kill(os.getpid(), signal.SIGTERM)


class SupervisordError(RuntimeError):
    """supervisord could not be started or answered unexpectedly."""


class Supervisord:
    """One supervisord process and an XML-RPC proxy to it.

    Programs: ``true`` (spawn), ``coop1`` / ``coop`` (a group of :data:`GROUP_SIZE`) sleeping and exiting on
    SIGINT, ``ignoring`` (SIGINT ignored, ``stopwaitsecs=1``), ``writer`` (writes ``log_bytes`` to its
    captured stdout).
    """

    def __init__(self, directory: str, log_bytes: int) -> None:
        self.directory = directory
        self.log_bytes = log_bytes
        self.socket = os.path.join(directory, "supervisor.sock")
        self.writer_log = os.path.join(directory, "writer.stdout.log")
        self._proc: subprocess.Popen[bytes] | None = None
        self.rpc: Any = None

    def _config(self) -> str:
        stop = "stopsignal=INT\nstopasgroup=true\nkillasgroup=true\nautostart=false\nautorestart=false\n"
        quiet = "stdout_logfile=NONE\nstderr_logfile=NONE\n"
        return textwrap.dedent(
            f"""\
            [unix_http_server]
            file={self.socket}
            chmod=0700

            [supervisord]
            logfile={self.directory}/supervisord.log
            pidfile={self.directory}/supervisord.pid
            childlogdir={self.directory}
            nodaemon=true
            loglevel=warn

            [rpcinterface:supervisor]
            supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface

            [supervisorctl]
            serverurl=unix://{self.socket}

            [program:true]
            command=/bin/true
            autostart=false
            autorestart=false
            startsecs=0
            startretries=0
            """
        ) + (
            f"{quiet}\n"
            f"[program:coop1]\ncommand=sleep 600\nstartsecs=0\nstopwaitsecs=10\n{stop}{quiet}\n"
            f"[program:coop]\ncommand=sleep 600\nnumprocs={GROUP_SIZE}\n"
            f"process_name=%(program_name)s_%(process_num)02d\nstartsecs=0\nstopwaitsecs=10\n{stop}{quiet}\n"
            f'[program:ignoring]\ncommand=/bin/sh -c "{IGNORING_SH}"\n'
            f"startsecs=0\nstopwaitsecs=1\n{stop}{quiet}\n"
            f"[program:writer]\ncommand=head -c {self.log_bytes} /dev/zero\nautostart=false\n"
            f"autorestart=false\nstartsecs=0\nstdout_logfile={self.writer_log}\n"
            "stdout_logfile_maxbytes=0\nstdout_logfile_backups=0\nstderr_logfile=NONE\n"
        )

    def start(self) -> None:
        """Start supervisord and wait until it answers ``getState`` (at most 15 s).

        Raises:
            SupervisordError: it exited or did not answer; the benchmark run fails.
        """
        conf = os.path.join(self.directory, "supervisord.conf")
        with open(conf, "w") as f:
            f.write(self._config())
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "supervisor.supervisord", "-c", conf],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=open(os.path.join(self.directory, "supervisord.stderr"), "wb"),  # noqa: SIM115
            start_new_session=True,
            # Run before any thread of the runner's is started (sd.start() comes first in run.py).
            preexec_fn=functools.partial(_end_with_the_runner, ctypes.CDLL(None).prctl, os.getpid()),
        )
        deadline = time.monotonic() + 15
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                break
            try:
                self.rpc = self._proxy()  # a fresh connection: a failed one cannot be reused
                if self.rpc.supervisor.getState()["statename"] == "RUNNING":
                    return
            except (OSError, xmlrpc.client.Error) as exc:
                last = exc
            time.sleep(0.05)
        with open(os.path.join(self.directory, "supervisord.stderr"), "rb") as f:
            err = f.read().decode(errors="replace").strip()
        self.stop()
        raise SupervisordError(f"supervisord did not start ({last!r}); its stderr: {err[-500:]}")

    def _proxy(self) -> Any:
        from supervisor.xmlrpc import SupervisorTransport

        transport = SupervisorTransport(None, None, f"unix://{self.socket}")
        return xmlrpc.client.ServerProxy("http://127.0.0.1", transport=transport)

    # ---- the operations the workloads time -----------------------------------------------------

    def wait_state(self, name: str, states: tuple[str, ...]) -> dict[str, Any]:
        """Poll ``getProcessInfo`` back to back until the process is in one of ``states``."""
        while True:
            info: dict[str, Any] = self.rpc.supervisor.getProcessInfo(name)
            if info["statename"] in states:
                return info
            if info["statename"] in ("FATAL", "UNKNOWN"):
                raise SupervisordError(f"{name} went {info['statename']}")

    def run_to_exit(self, name: str) -> dict[str, Any]:
        """``startProcess`` then poll until it has EXITED.

        Without ``wait``: supervisord spawns inside the call, and a child that exits before supervisord
        has marked it RUNNING would make a waiting call fail with ABNORMAL_TERMINATION.
        """
        self.rpc.supervisor.startProcess(name, False)
        return self.wait_state(name, ("EXITED",))

    def stop(self) -> None:
        """Shut supervisord down (its children with it); SIGKILL after 10 s."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            try:
                self._proxy().supervisor.shutdown()
            except (OSError, xmlrpc.client.Error):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
