"""``gadget-engine top``: check what the live view needs, then run it (:mod:`engine._top_app`).

The view is built on Textual, in the optional extra ``tui``; it is imported here, only when ``top`` runs,
so every other client command starts as fast as before. Without the extra, ``top`` says how to install it
(exit 1); with no engine running it exits 3 before taking over the screen, as every client command does.

Standard library only until the view starts.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Final

from ._cli_output import EXIT_OK, CommandFailedError
from .server._client import EngineClient, EngineSuspendedError

__all__ = ["INSTALL_HINT", "top"]

#: What ``top`` says without Textual.
INSTALL_HINT: Final = "install it with: pip install 'gadget-engine[tui]'"


def top(client: EngineClient, args: argparse.Namespace) -> int:
    """``gadget-engine top [--project DIR]``: the live view until ``q``; exit 0."""
    try:
        from ._top_app import TopApp  # Textual: only here
    except ImportError as exc:
        raise CommandFailedError(
            f"top needs the terminal UI library Textual ({exc}); {INSTALL_HINT}"
        ) from None
    try:
        client.call("status")  # no engine: exit 3 now, with the usual message
    except EngineSuspendedError:
        pass  # it runs, stopped: the view names it and what continues it, and goes on once it is continued
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise CommandFailedError("top draws on a terminal and reads keys from it; run it in one")
    needle = ""
    if args.project is not None:
        needle = os.path.abspath(args.project)
    client.close()
    app = TopApp(client.state_dir, needle=needle)
    code = app.run()
    return EXIT_OK if code is None else int(code)
