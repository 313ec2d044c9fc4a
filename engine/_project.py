"""The project a subprocess belongs to: a stable id, a readable slug and an absolute directory."""

from __future__ import annotations

import hashlib
import os
import re

import attrs

from ._input import check_text, read_directory

__all__ = ["Project"]

_SLUG_JUNK = re.compile(r"[^a-z0-9._-]+")


def _absolute(_inst: object, attribute: attrs.Attribute[str], value: str) -> None:
    read_directory(value, attribute.name)


def _non_blank(_inst: object, attribute: attrs.Attribute[str], value: str) -> None:
    check_text(value, attribute.name)


@attrs.frozen
class Project:
    """A project an agent works in; every subprocess runs in its directory.

    Every field must be text the engine can store and send back (no NUL, no lone surrogate): a directory
    whose real path is not UTF-8 cannot be a project.

    Raises:
        InvalidArgumentError: a field is blank, or ``directory`` is not an absolute path.

    Attributes:
        id: a stable identifier; the supervisor scope of the project's children is ``project:<id>``.
        slug: a short readable name (the ``project:`` column of the tool's ``list``).
        directory: the absolute project directory; children start there and their logs live under
            ``<directory>/<gadget_dir_name>/subprocess-logs/``.
    """

    id: str = attrs.field(validator=_non_blank)
    slug: str = attrs.field(validator=_non_blank)
    directory: str = attrs.field(validator=_absolute)

    @classmethod
    def from_directory(cls, path: str | os.PathLike[str]) -> Project:
        """The project of directory ``path``: the slug from its folder name, the id from its real path.

        The id is the first 16 hex digits of the SHA-256 of the resolved path, so the same folder gives
        the same id in every engine and every run, and a symlinked path gives the id of its target.

        Raises:
            ValueError: ``path`` is not an existing directory (or its real path is not UTF-8 text:
                :class:`~engine.InvalidArgumentError`).
        """
        real = os.path.realpath(os.fspath(path))
        if not os.path.isdir(real):
            raise ValueError(f"project directory {os.fspath(path)!r} does not exist or is not a directory")
        digest = hashlib.sha256(os.fsencode(real)).hexdigest()[:16]
        name = os.path.basename(real.rstrip(os.sep)) or "root"
        slug = _SLUG_JUNK.sub("-", name.lower()).strip("-") or "project"
        return cls(id=digest, slug=slug, directory=real)

    @property
    def scope_key(self) -> str:
        """The supervisor scope of this project's children: ``project:<id>``."""
        return f"project:{self.id}"
