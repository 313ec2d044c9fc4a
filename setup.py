"""The one build step pyproject.toml cannot say: the compiled exit-recording shim and the compiled spawn.

``engine/cron/_shim.c`` is compiled with the C compiler found (``$CC``, else ``cc``, ``gcc``, ``clang``)
into ``engine/cron/_shim.bin``, and ``engine/_spawn_direct.c`` into the shared library
``engine/_spawn_direct.bin``: into the build folder for a wheel (``pip install .``), into the source tree
for an editable install (``pip install -e .``, ``make setup``), where the package is read from. Where no
compiler is found, or it fails, the install goes on without them: the engine runs the Perl shim, else the
Python one (``engine/cron/_shell.py``), and spawns through glibc's ``posix_spawn`` (``engine/_spawn.py``).
Everything else is in pyproject.toml.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from typing import ClassVar

from setuptools import Command, setup
from setuptools.command.build import build
from setuptools.dist import Distribution

SOURCE = os.path.join("engine", "cron", "_shim.c")
TARGET = os.path.join("engine", "cron", "_shim.bin")
FLAGS = ("-O2", "-Wall", "-Wextra", "-Werror")
#: The compiled spawn: a shared library loaded with ctypes (named ``.bin``: a ``.so`` of the name of a
#: module next to it would be taken for an extension module).
SPAWN_SOURCE = os.path.join("engine", "_spawn_direct.c")
SPAWN_TARGET = os.path.join("engine", "_spawn_direct.bin")
SPAWN_FLAGS = (*FLAGS, "-shared", "-fPIC")
#: The shim is linked statically where the C library allows it: a watched command's start then skips
#: the dynamic loader's work in the shim (about 0.3 ms of CPU per start here), and falls back to a
#: dynamic link where no static C library is installed.
SHIM_FLAGS = ((*FLAGS, "-static"), FLAGS)
#: What is compiled: ``(source, target, the flags to try in turn, what it is)``.
BUILDS = (
    (SOURCE, TARGET, SHIM_FLAGS, "the exit-recording shim (perl or Python runs it)"),
    (SPAWN_SOURCE, SPAWN_TARGET, (SPAWN_FLAGS,), "the compiled spawn (posix_spawn is used)"),
)


def find_compiler() -> list[str] | None:
    """The C compiler's argv prefix: ``$CC`` when set, else the first of cc, gcc, clang on PATH."""
    if os.environ.get("CC", "").strip():
        return shlex.split(os.environ["CC"])
    for name in ("cc", "gcc", "clang"):
        found = shutil.which(name)
        if found is not None:
            return [found]
    return None


class BuildShim(Command):
    """Compile the exit-recording shim and the compiled spawn; a missing or failing compiler is a warning,
    never a failure."""

    description = "compile engine/cron/_shim.c and engine/_spawn_direct.c (optional: the engine falls back)"
    user_options: ClassVar[list[tuple[str, str | None, str]]] = []

    def initialize_options(self) -> None:
        self.build_lib: str | None = None
        self.editable_mode = False

    def finalize_options(self) -> None:
        self.set_undefined_options("build_py", ("build_lib", "build_lib"))

    def _target(self, target: str) -> str:
        return target if self.editable_mode else os.path.join(self.build_lib or "build", target)

    def run(self) -> None:
        for source, target, variants, what in BUILDS:
            built = self._target(target)
            last = len(variants) - 1
            if not any(
                self._compile(source, built, flags, what, quiet=i < last) for i, flags in enumerate(variants)
            ) and os.path.exists(built):
                os.unlink(built)  # built from another source: never left behind, never shipped

    def _compile(self, source: str, target: str, flags: tuple[str, ...], what: str, *, quiet: bool) -> bool:
        """Compile ``source`` into ``target`` (through a temp name, so a running engine sees the old one or
        the new one); whether it was compiled. ``quiet``: a failure is not warned of (another variant of
        the flags is tried next)."""
        compiler = find_compiler()
        if compiler is None:
            self.warn(f"no C compiler found: {what} is not compiled")
            return False
        os.makedirs(os.path.dirname(target), exist_ok=True)
        partial = f"{target}.tmp.{os.getpid()}"
        argv = [*compiler, *flags, "-o", partial, source]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, check=False)
        except OSError as exc:
            self.warn(f"cannot run {argv[0]}: {exc}; {what} is not compiled")
            return False
        if done.returncode != 0:
            if not quiet:
                self.warn(f"{shlex.join(argv)} failed; {what} is not compiled:\n{done.stderr}")
            if os.path.exists(partial):
                os.unlink(partial)
            return False
        os.chmod(partial, 0o755)  # whatever the umask: the engine uses it only when no one else can write it
        os.replace(partial, target)
        return True

    def get_source_files(self) -> list[str]:
        return [source for source, _, _, _ in BUILDS]

    def get_outputs(self) -> list[str]:
        return [self._target(target) for _, target, _, _ in BUILDS]

    def get_output_mapping(self) -> dict[str, str]:
        return {self._target(target): source for source, target, _, _ in BUILDS}


class BinaryDistribution(Distribution):
    """A wheel with the compiled shim in it is for this platform only (not ``py3-none-any``)."""

    def has_ext_modules(self) -> bool:
        return True


class BuildWithShim(build):
    """``build``, and then ``build_shim``."""

    sub_commands: ClassVar[list[tuple[str, None]]] = [*build.sub_commands, ("build_shim", None)]


setup(cmdclass={"build": BuildWithShim, "build_shim": BuildShim}, distclass=BinaryDistribution)
