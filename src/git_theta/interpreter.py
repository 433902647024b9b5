"""How git-theta starts Python, and what its entry point does first.

git runs every git-theta command it configures (filters, drivers, hooks) with the work
tree as the working directory, and the work tree is a repository anyone may have
written. Python puts the working directory on ``sys.path`` in two ways: without ``-P``
(the directory of ``-m``/``-c``), and through an empty or relative entry of
``PYTHONPATH`` (``PYTHONPATH=/opt/lib:`` is a common slip), which ``-P`` leaves alone.
Either way a committed ``contextlib.py`` or ``encodings/`` runs before any of our code:
the interpreter imports such modules while it starts. Only flags fix that, so every
Python we start, and every command line we write for git, runs with ``FLAGS``.

``-E`` ignores every ``PYTHON*`` variable (``PYTHONPATH``, ``PYTHONHOME``,
``PYTHONUSERBASE``...), ``-P`` keeps the working directory out. Not ``-I``: it also
drops the user site directory, where ``pip install --user`` puts git-theta.
"""

from __future__ import annotations

import os
import sys

FLAGS = ("-E", "-P")


def python_argv(*args: str) -> list[str]:
    """Return the argv that runs this interpreter, isolated as above, with ``args``."""
    return [sys.executable, *FLAGS, *args]


def untrusted_paths() -> set[str]:
    """Return the ``sys.path`` entries that may name the working directory or a place
    relative to it: ``''`` and other relative entries, what the interpreter made of each
    relative ``PYTHONPATH`` entry (an empty one is the working directory, made absolute),
    and the working directory as ``-m`` without ``-P`` puts it first."""
    relative = [p for p in sys.path if not os.path.isabs(p)]
    bad = {"", ".", *relative}
    try:
        here = os.getcwd()
    except OSError:  # removed under us: relative entries name nothing
        return bad
    if not sys.flags.ignore_environment:
        relative += os.environ.get("PYTHONPATH", "").split(os.pathsep)
    bad.update(os.path.normpath(os.path.join(here, p)) for p in relative if not os.path.isabs(p))
    if not sys.flags.safe_path and sys.path and sys.path[0] == here:
        bad.add(here)
    return bad


def drop_untrusted_paths() -> list[str]:
    """Remove ``untrusted_paths()`` from ``sys.path``; return the names of the modules
    already loaded from them (by the interpreter's start-up, before any code of ours),
    git-theta's own aside.

    Defence in depth behind ``FLAGS``, for a ``python -m git_theta`` started without them.
    """
    bad = untrusted_paths()
    sys.path[:] = [p for p in sys.path if p not in bad]
    loaded = []
    for name, module in list(sys.modules.items()):
        where = getattr(module, "__file__", None)
        if "." in name or name in ("__main__", "git_theta") or not isinstance(where, str):
            continue  # a submodule came with its package, and __main__ is ours
        entry = os.path.dirname(where)  # the sys.path entry a top-level module came from
        if os.path.basename(where).startswith("__init__."):
            entry = os.path.dirname(entry)
        if entry in bad:
            loaded.append(name)
    return sorted(loaded)
