"""The ``gadget-engine`` command's entry point: a Ctrl-C while the command line is still loading ends it
as one during a command does (exit 130, no traceback).

The command line's modules take a tenth of a second to import; a ``KeyboardInterrupt`` raised then would
reach the interpreter's top level and print a traceback. This module imports nothing of the engine's
until :func:`main` runs.
"""

from __future__ import annotations

__all__ = ["main"]

#: The exit code of a command ended by Ctrl-C, as a shell reports SIGINT (128 + 2).
EXIT_INTERRUPTED = 130


def main() -> int:
    """Run the ``gadget-engine`` command line (``engine._cli.main``) and return its exit code.

    Returns:
        The command's exit code; 130 when Ctrl-C came while it was loading or parsing.
    """
    try:
        from ._cli import main as run_command_line  # imported here, inside the try

        return run_command_line()
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
