"""Files named like the modules Python and git-theta import, as a cloned repository may hold.

Each one, when imported, creates a marker file outside the repository (through ``posix``,
a built-in module nothing can shadow, so that it works even as ``encodings`` while the
interpreter starts) and then fails, as a hostile module would go unnoticed only by luck.
"""

from __future__ import annotations

from pathlib import Path

# What the interpreter imports while it starts (encodings, site's customize hooks), what
# ``-m`` and the filter import (runpy's, argparse's, the codec's), extension modules a .py
# may shadow, and git-theta itself.
MODULES = (
    "encodings/__init__.py",
    "sitecustomize.py",
    "usercustomize.py",
    "contextlib.py",
    "types.py",
    "functools.py",
    "operator.py",
    "collections/__init__.py",
    "importlib/__init__.py",
    "re/__init__.py",
    "enum.py",
    "typing.py",
    "json/__init__.py",
    "os.py",
    "zipfile.py",
    "argparse.py",
    "shlex.py",
    "subprocess.py",
    "tempfile.py",
    "pathlib.py",
    "signal.py",
    "socket.py",
    "select.py",
    "threading.py",
    "struct.py",
    "hashlib.py",
    "weakref.py",
    "resource.py",
    "_socket.py",
    "_blake2.py",
    "zstandard.py",
    "blake3.py",
    "zlib_ng.py",
    "numpy/__init__.py",
    "h5py.py",
    "git_theta/__init__.py",
)
PYTHONPATHS = (":", "/nonexistent:")  # an empty entry is the working directory


def plant(where: Path, markers: Path, label: str) -> None:
    """Write every module of MODULES under ``where``; importing one creates
    ``markers/LABEL-NAME``."""
    for name in MODULES:
        path = where / name
        path.parent.mkdir(parents=True, exist_ok=True)
        marker = str(markers / f"{label}-{name.replace('/', '.')}")
        path.write_text(
            "import posix as _p\n"
            f"_p.close(_p.open({marker!r}, _p.O_WRONLY | _p.O_CREAT, 0o644))\n"
            "raise ImportError('a module from the work tree')\n"
        )


def markers_left(markers: Path) -> list[str]:
    """The markers created so far: each names a module imported from a work tree."""
    return sorted(p.name for p in markers.iterdir())
