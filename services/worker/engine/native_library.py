"""A C source of the engine compiled on the machine that runs it, once, into a cache folder, and loaded with ctypes.

A shared object is named by a hash of its source, its flags, the compiler's version and the CPU's feature flags
(``-march=native`` depends on them), in ``$XDG_CACHE_HOME/epd/kernels`` (else ``~/.cache``, else the temp folder);
several processes starting together each write their own file and rename it into place, so a reader never sees a
partial one. No compiler, no writable folder or a failed compile: None, logged, and the caller keeps torch's path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-fPIC", "-shared")
"""What every library is built with; a source adds its own (``extra_flags``)."""


def load_library(source: Path, extra_flags: Sequence[str] = ()) -> ctypes.CDLL | None:
    """``source`` compiled (or found compiled) for this machine and loaded; None, with a warning, when it cannot be."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found for %s: torch's path is used instead", source.name)
        return None
    folder = cache_folder()
    if folder is None:
        log.warning("no writable cache folder for %s: torch's path is used instead", source.name)
        return None
    library = build_library(source, compiler, folder, extra_flags)
    return None if library is None else ctypes.CDLL(str(library))


def build_library(source: Path, compiler: str, folder: Path, extra_flags: Sequence[str] = ()) -> Path | None:
    """The shared object for ``source``, these flags, ``compiler`` and this CPU in ``folder``, compiled unless
    already there; None (and a warning) when the compiler fails."""
    flags = (*FLAGS, *extra_flags)
    parts = [source.read_bytes(), " ".join(flags).encode(), _compiler_id(compiler), _cpu_id()]
    key = hashlib.sha256(b"\0".join(parts))
    target = folder / f"{source.stem}-{key.hexdigest()[:20]}.so"
    if target.exists():
        return target
    partial = folder / f".{target.name}.{os.getpid()}"
    result = subprocess.run([compiler, *flags, "-o", str(partial), str(source)], capture_output=True, text=True)
    if result.returncode != 0:
        log.warning("%s did not compile (%s): torch's path is used\n%s", source.name, compiler, result.stderr[-2000:])
        partial.unlink(missing_ok=True)
        return None
    os.replace(partial, target)  # atomic: processes building at once each rename a whole file
    return target


def cache_folder() -> Path | None:
    """The first writable ``epd/kernels`` folder under the user's cache or the temp folder, created if need be."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    for root in (Path(base), Path(tempfile.gettempdir())):
        folder = root / "epd" / "kernels"
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(folder, os.W_OK):
            return folder
    return None


def _compiler_id(compiler: str) -> bytes:
    result = subprocess.run([compiler, "--version"], capture_output=True, check=False)
    return result.stdout.split(b"\n", 1)[0]


def _cpu_id() -> bytes:
    """What ``-march=native`` depends on: the machine and its CPU feature flags."""
    flags = b""
    try:
        for line in Path("/proc/cpuinfo").read_bytes().splitlines():
            if line.startswith((b"flags", b"Features")):
                flags = line
                break
    except OSError:
        pass
    return platform.machine().encode() + b"\0" + flags
