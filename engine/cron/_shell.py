"""The shell an on-exit command runs in, the argv of a watched command, and the shim that records its exit."""

from __future__ import annotations

import functools
import os
import shutil
import stat
import sys
import time
from typing import Final

from .._input import MAX_ARG_BYTES
from .._trust import ours_or_roots

__all__ = [
    "MAX_COMMAND_BYTES",
    "STARTED_VAR",
    "resolve_exit_watch_shell",
    "runs_user_files_first",
    "shell_installed",
    "shim_argv",
    "watch_argv",
    "what_runs_first",
]

_HERE = os.path.dirname(os.path.abspath(__file__))
#: The exit-recording shim, compiled from ``_shim.c`` at install time where a C compiler is found
#: (``setup.py``; its command starts ~0.5 ms after the spawn); the same shim in Perl (~2-5 ms), run where
#: it was not built; and in Python (~10 ms or more), the fallback where no perl is found either.
SHIM_BIN = os.path.join(_HERE, "_shim.bin")
SHIM_PL = os.path.join(_HERE, "_shim.pl")
SHIM_PY = os.path.join(_HERE, "_shim.py")

#: The POSIX default: a login shell, so the agent's PATH and tools are there; ``--`` so that a command
#: starting with ``-`` is a command, not a bash option.
POSIX_SHELL = ("bash", "-lc", "--")

#: Environment variables of a watched command under bash: the first line reads the first and the last; the
#: command string is in the second, where its processes can be found by it (docs/guide-on-exit.md).
CWD_VAR = "GADGET_WATCH_CWD"
COMMAND_VAR = "GADGET_WATCH_COMMAND"
STARTED_VAR = "GADGET_WATCH_STARTED"

# After the login profile has run (it may `cd` anywhere, print, or `exec` another shell), mark that the
# command is about to run and re-enter the job's cwd: a line of its own, run before bash reads the next
# one. The command string follows it unchanged, so bash parses it as it parses any `bash -c STRING`
# (quotes, newlines, heredocs, `exit N`, one line at a time), and runs its last simple command with
# `exec`, not in a forked child. (The wrapper ran the string with `eval` until the fourteenth performance
# round: bash forks the last command of an `eval`, one more bash per watched command, and a command killed
# by a signal showed as bash's `exit 128+N`.)
# A redirection alone (no command to look up) makes the mark, and `builtin` keeps a profile's `cd`
# function out of it. The line costs one in bash's count (`$LINENO`, `line N` of a syntax error is one more
# than under `bash -c`): ended by `;` instead, it would be parsed with the command's first line, so a
# syntax error there would stop the mark too (read as `not_started`) and bash's message would quote the
# wrapper; and bash before 5.1 execs only a lone last command, so a one-line command would be forked.
_MARK_STARTED = '> "$GADGET_WATCH_STARTED" || exit 125; '
_BACK_TO_CWD = 'builtin cd -- "$GADGET_WATCH_CWD" || exit 125\n'
#: The longest on-exit command string, in bytes: one argument of a program (``MAX_ARG_STRLEN``) less the
#: wrapper's first line, which travels in the same argument.
MAX_COMMAND_BYTES: Final = MAX_ARG_BYTES - len((_MARK_STARTED + _BACK_TO_CWD).encode())

#: Short options of bash that make it read a file of the user's before the command: ``l`` (a login
#: shell: the profile), ``i`` (interactive: ``.bashrc``).
_READS_USER_FILES = frozenset("li")
#: Long options of bash that make it read no file of the user's.
_QUIET_LONG_OPTIONS = frozenset({"--noprofile", "--norc", "--posix", "--restricted", "--verbose"})


def resolve_exit_watch_shell(platform: str = sys.platform, comspec: str | None = None) -> tuple[str, ...]:
    """The argv prefix on-exit commands run with; the command string is appended as one argument.

    ``("bash", "-lc", "--")`` on POSIX; ``(comspec or "cmd.exe", "/d", "/s", "/c")`` on Windows, where a
    blank ``comspec`` counts as none (the spec's ``cmd.exe /d /s /c``).

    Args:
        platform: a ``sys.platform`` value.
        comspec: the ``COMSPEC`` environment variable's value, if any.
    """
    if platform.startswith("win"):
        shell = comspec.strip() if comspec is not None and comspec.strip() else "cmd.exe"
        return (shell, "/d", "/s", "/c")
    return POSIX_SHELL


def _is_bash(shell: tuple[str, ...]) -> bool:
    return os.path.basename(shell[0]) == "bash"


def runs_user_files_first(shell: tuple[str, ...]) -> bool:
    """Whether bash started as ``shell`` may run a file of the user's before the command string.

    A login shell (``-l``, ``--login``) runs the profile, an interactive one (``-i``) ``.bashrc``, and any
    non-interactive bash the file named by ``BASH_ENV`` (from the engine's environment, which the command
    inherits); such a file may ``exec`` another shell, so the command's start must be marked. Options are
    read as bash reads them, up to ``--`` or the first operand: clusters (``-euo pipefail -lc``), each
    ``o`` or ``O`` in one taking the next argument as its value; a long option this does not know counts
    as one that reads files.
    """
    if os.environ.get("BASH_ENV"):  # set and empty: bash reads no file
        return True
    args = iter(shell[1:])
    for arg in args:
        if arg == "--" or not arg.startswith(("-", "+")) or arg in ("-", "+"):
            return False
        if arg.startswith("--"):
            if arg not in _QUIET_LONG_OPTIONS:
                return True
            continue
        letters = arg[1:]
        if _READS_USER_FILES & set(letters):
            return True
        for _ in range(letters.count("o") + letters.count("O")):
            next(args, None)  # its value (``-o pipefail``, ``-euo pipefail``, ``+O extglob``)
    return False


def what_runs_first() -> tuple[str, str]:
    """For a message on a watched command held back: what its bash runs before the command string, and
    how to run none, as ``(what, remedy)``. ``BASH_ENV`` (in the engine's environment, which the command
    inherits) is named first: every non-interactive bash reads it, ``('bash', '-c', '--')`` too."""
    bash_env = os.environ.get("BASH_ENV")
    if bash_env:
        return (
            f"the file BASH_ENV names, {bash_env!r}",
            "unset BASH_ENV in the engine's environment to run none",
        )
    return "a login profile", "`exit_watch_shell` ('bash', '-c', '--') runs no profile"


def watch_argv(
    shell: tuple[str, ...], command: str, cwd: str, started_file: str
) -> tuple[tuple[str, ...], dict[str, str]]:
    """The argv and extra environment of a watched command.

    With a bash prefix the command string follows a fixed first line that bash runs after the profile:
    it goes back to ``cwd`` (CR-01: a profile's ``cd`` or noise does not change where the command runs)
    and, where a file of the user's runs first (:func:`runs_user_files_first`), creates ``started_file``,
    so that a profile that replaced the shell is noticed (``STARTED_VAR`` is then in the environment
    returned, and only then). Elsewhere nothing runs before that line, and the mark would cost each arm a
    file. The command string also travels in ``GADGET_WATCH_COMMAND``, where its processes (and their
    children, who inherit it) can be found by it. Any other shell gets ``shell + (command,)`` as is.
    """
    if _is_bash(shell):
        env = {CWD_VAR: cwd, COMMAND_VAR: command}
        if not runs_user_files_first(shell):
            return (*shell, _BACK_TO_CWD + command), env
        env[STARTED_VAR] = started_file
        return (*shell, _MARK_STARTED + _BACK_TO_CWD + command), env
    return (*shell, command), {}


#: How long a shell found in ``PATH`` is believed there without looking again (seconds): a reconcile that
#: arms a hundred jobs looks once, not a hundred times (~60 us each).
SHELL_SEEN_SECONDS = 1.0
_shells_seen: dict[tuple[str, str | None], float] = {}


def shell_installed(name: str) -> bool:
    """Whether the shell ``name`` is found (as ``shutil.which`` finds it, in ``PATH``).

    A shell found is believed for :data:`SHELL_SEEN_SECONDS` per ``PATH`` value; one not found is looked
    for again at each call, so a retry sees it as soon as it is installed. (A shell removed meanwhile is
    what the shim then cannot run: the command's end is recorded as exit 127, as for any spawn that
    loses that race.)
    """
    key = (name, os.environ.get("PATH"))
    now = time.monotonic()
    seen = _shells_seen.get(key)
    if seen is not None and now - seen < SHELL_SEEN_SECONDS:
        return True
    if shutil.which(name) is None:
        _shells_seen.pop(key, None)
        return False
    _shells_seen[key] = now
    return True


@functools.cache
def _perl_at(path: str | None) -> str | None:
    found = shutil.which("perl", path=path)
    return os.path.realpath(found) if found is not None else None


def find_perl() -> str | None:
    """The perl the shim runs in (looked up in ``PATH``, once per ``PATH`` value), or ``None``."""
    return _perl_at(os.environ.get("PATH"))


def find_compiled_shim() -> str | None:
    """The compiled shim (``_shim.bin``, built at install), when it is there and ours to run, or ``None``.

    It runs commands with the engine's rights, so it is run only when nobody else can have put it there:
    a regular file (not a symbolic link), executable, owned by this user or root and not writable by group
    or others, in the package's own folder, which is held to the same owner and mode. It is never looked
    for anywhere else (not in a state directory, not in ``PATH``). Two ``stat`` calls, each time.
    """
    try:
        info = os.lstat(SHIM_BIN)
        folder = os.stat(_HERE)
    except OSError:
        return None
    if not stat.S_ISREG(info.st_mode) or not info.st_mode & stat.S_IXUSR:
        return None
    return SHIM_BIN if ours_or_roots(info) and ours_or_roots(folder) else None


def shim_argv(exit_file: str, argv: tuple[str, ...]) -> tuple[str, ...]:
    """The argv that runs ``argv`` under the exit-recording shim, which records its end in ``exit_file``.

    The compiled shim (``_shim.bin``) when it was built and is ours to run (:func:`find_compiled_shim`);
    else the Perl shim (``_shim.pl`` under ``perl -t``: no ``PERL5OPT``, no ``PERL5LIB``) when a perl is
    found and the script is there; else the Python shim (``_shim.py`` under ``python -I -S``). All three
    take ``EXIT_FILE -- ARGV...``, write the same record and end the same way. Not a shell: a shell's
    ``wait`` gives 130 both for ``exit 130`` and for a death by SIGINT, and the record must say which.
    """
    compiled = find_compiled_shim()
    if compiled is not None:
        return (compiled, exit_file, "--", *argv)
    perl = find_perl()
    if perl is not None and os.path.isfile(SHIM_PL):
        return (perl, "-t", SHIM_PL, exit_file, "--", *argv)
    return (sys.executable, "-I", "-S", SHIM_PY, exit_file, "--", *argv)
