"""Child output made safe to draw: no terminal escapes, no control characters.

What a child prints goes to a person's terminal through ``gadget-engine top`` (its last line, its followed
log). A colour code is harmless, but a cursor move, a title change or a bell from a child would redraw
the viewer's screen, so escape sequences are removed and the other control characters replaced. A
carriage return overwrites the line, as a terminal shows it: a progress bar leaves its last state.

Standard library only.
"""

from __future__ import annotations

import re
from typing import Final

__all__ = ["LAST_LINE_CHARS", "escape_controls", "last_line", "printable", "printable_line"]

#: The longest last line :func:`last_line` keeps, in characters.
LAST_LINE_CHARS: Final = 400

# CSI (ESC [ ... final), OSC (ESC ] ... BEL or ST), the other two-character escapes, and the 8-bit CSI.
_ESCAPES = re.compile(
    r"\x1b\[[0-?]*[ -/]*[@-~]"
    r"|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?"
    r"|\x1b[ -/]*[0-~]"
    r"|\x9b[0-?]*[ -/]*[@-~]"
)
# The bidirectional controls (marks, embeddings, overrides, isolates) reorder what follows on a terminal
# that draws right-to-left text: U+202E makes "txt.exe" of "exe.txt".
_BIDI = "\u200e\u200f\u202a-\u202e\u2066-\u2069"
_CONTROLS = re.compile(rf"[\x00-\x08\x0b-\x1f\x7f-\x9f{_BIDI}]")
_ANY_CONTROL = re.compile(rf"[\x00-\x1f\x7f-\x9f{_BIDI}]")


def escape_controls(text: str) -> str:
    """``text`` with each control character (newlines, tabs, ESC and the bidirectional controls) written
    as Python writes it in a string (``\\n``, ``\\t``, ``\\x1b``, ``\\u202e``): for one cell or value of a
    table, where a name or a path that holds one would break the line, move the cursor or reorder the
    text. Other text is left as it is."""
    return _ANY_CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


def printable_line(line: str) -> str:
    """One line as a terminal would leave it, escapes removed: the text after its last carriage return
    (that is not at its end), tabs as spaces, other control characters as ``?``."""
    text = _ESCAPES.sub("", line).rstrip("\r")
    text = text.rpartition("\r")[2]
    return _CONTROLS.sub("?", text.replace("\t", "    ").replace("\n", " "))


def printable(text: str) -> str:
    """Many lines, each made :func:`printable_line`; the line breaks are kept."""
    return "\n".join(printable_line(line) for line in text.split("\n"))


def last_line(text: str) -> str:
    """The last line of ``text`` that is not blank once printable, cut to :data:`LAST_LINE_CHARS`
    (``""`` when there is none)."""
    for line in reversed(text.split("\n")):
        shown = printable_line(line).rstrip()
        if shown.strip():
            return shown[:LAST_LINE_CHARS]
    return ""
