"""Agent-mode prompts: which modes get the ``subprocess`` tool, and the Process Management block.

The block ships as the package resource ``engine/prompts/process-management-block.md``; a mode's system
prompt template names it with the variable ``{{process_management_block}}``.
"""

from __future__ import annotations

import functools
from importlib import resources
from typing import Final

__all__ = [
    "PROCESS_MANAGEMENT_VARIABLE",
    "TOOL_MODES",
    "process_management_block",
    "render_mode_prompt",
    "tools_for_mode",
]

#: The agent modes in which the ``subprocess`` tool is registered.
TOOL_MODES: Final = frozenset({"Build", "Test", "Ship", "Develop"})

#: The template variable the Process Management block replaces.
PROCESS_MANAGEMENT_VARIABLE: Final = "{{process_management_block}}"

_BY_LOWER: Final = {mode.lower(): mode for mode in TOOL_MODES}


@functools.cache
def process_management_block(*, extensions: bool = True) -> str:
    """The Process Management block (Markdown), without a trailing newline.

    Args:
        extensions: also describe what the tool offers beyond the spec (``ready``, ``restart``, ``new``,
            ``grep``, ``input``, ``wait``: ``EngineConfig.tool_extensions``, on by default); ``False``:
            the spec's block alone.
    """
    folder = resources.files("engine").joinpath("prompts")
    text = folder.joinpath("process-management-block.md").read_text("utf-8").rstrip("\n")
    if extensions:
        text += "\n\n" + folder.joinpath("process-management-extensions.md").read_text("utf-8").rstrip("\n")
    return text


def _known(mode: str) -> str | None:
    if not isinstance(mode, str):
        raise TypeError(f"mode must be a string such as 'Build', got {mode!r}")
    return _BY_LOWER.get(mode.strip().lower())


def tools_for_mode(mode: str) -> tuple[str, ...]:
    """The engine's tools registered for ``mode`` (case-insensitive): ``("subprocess",)`` or ``()``."""
    return ("subprocess",) if _known(mode) is not None else ()


def render_mode_prompt(mode: str, template: str, *, extensions: bool = True) -> str:
    """Fill ``{{process_management_block}}`` in a mode's system prompt template.

    In a mode that has the ``subprocess`` tool (:data:`TOOL_MODES`) the variable becomes the block; in any
    other mode it becomes empty, so no prompt describes a tool the agent cannot call. Other text, other
    ``{{...}}`` variables included, is left as it is. ``extensions`` as for :func:`process_management_block`
    (pass ``EngineConfig.tool_extensions``).
    """
    if not isinstance(template, str):
        raise TypeError(f"template must be a string, got {template!r}")
    block = process_management_block(extensions=extensions) if _known(mode) is not None else ""
    return template.replace(PROCESS_MANAGEMENT_VARIABLE, block)
