"""HDF5 weight files (Keras ``.weights.h5``, ``model.h5``, anything h5py writes).

Every dataset stored contiguously and unfiltered (what Keras and h5py write by default)
is a tensor: its raw bytes lie in one span of the file. Chunked or compressed datasets,
strings, big-endian data and all of HDF5's own structures are glue, kept verbatim, so
checkout is byte for byte and needs nothing but git-theta.

Finding the spans needs h5py, i.e. the HDF5 C library, parsing a file we did not write.
It runs in a child process (``hdf5_layout``): a crash on a malformed file becomes one
error line instead of taking git's filter down with it.
"""

from __future__ import annotations

import json
from typing import BinaryIO

from git_theta import proc
from git_theta.errors import CheckpointError
from git_theta.formats.base import CheckpointFormat, ReadExact, TensorSpan
from git_theta.interpreter import python_argv

SIGNATURE = b"\x89HDF\r\n\x1a\n"
NO_H5PY = 3  # exit code of hdf5_layout when h5py is not installed
READ_TIMEOUT = 120  # seconds; h5py reads only metadata (65k datasets: ~15 s)


class Hdf5Format(CheckpointFormat):
    key = "hdf5"
    head_size = len(SIGNATURE)
    needs_seek = True  # datasets can lie anywhere; h5py reads a seekable copy

    def sniff(self, head: bytes, path: str) -> bool:
        return head.startswith(SIGNATURE)

    def read_header(self, read: ReadExact) -> list[TensorSpan]:
        raise CheckpointError("HDF5 files are read from a seekable copy")

    def read_spans(self, fh: BinaryIO, size: int) -> list[TensorSpan]:
        import signal  # here: every added file is sniffed against this module
        import subprocess

        fh.flush()
        fh.seek(0)
        # Isolated: git runs us in the work tree, and a cloned repository must not be
        # able to shadow a module the reader imports (a committed json.py, h5py.py...).
        argv = python_argv("-m", "git_theta.formats.hdf5_layout")
        try:
            done = proc.run(*argv, stdin=fh, check=False, timeout=READ_TIMEOUT)
        except subprocess.TimeoutExpired:
            raise CheckpointError(
                f"HDF5 file could not be read: h5py did not finish in {READ_TIMEOUT} s"
            ) from None
        if done.returncode == NO_H5PY:
            return _without_h5py(size)
        if done.returncode < 0:
            try:
                how = signal.Signals(-done.returncode).name
            except ValueError:
                how = f"signal {-done.returncode}"
            raise CheckpointError(f"HDF5 file could not be read: the HDF5 library crashed ({how})")
        if done.returncode != 0:
            lines = done.stderr.decode(errors="replace").strip().splitlines()
            last = lines[-1][:200] if lines else "unreadable"  # h5py's words, maybe a name
            printable = "".join(c if c.isprintable() else repr(c)[1:-1] for c in last)
            raise CheckpointError(f"HDF5 file is corrupt: {printable}")
        try:
            rows = json.loads(done.stdout)
            return [TensorSpan(str(n), str(d), tuple(s), a, b) for n, d, s, a, b in rows]
        except (ValueError, TypeError) as exc:
            raise CheckpointError(f"HDF5 layout reader gave bad output: {exc}") from None


_warned: list[bool] = []  # once per process
OPAQUE_PIECE = 16 << 20  # bytes: the clean holds a few pieces at once, never the file


def _without_h5py(size: int) -> list[TensorSpan]:
    """Return the file as opaque U8 pieces of OPAQUE_PIECE bytes (exact, and added per
    tensor again once h5py is there; not one glue piece, which the clean holds whole)
    when git only looks (status, diff), warning once; raise LocalSetupError for a command
    that stores."""
    from git_theta import git_parent
    from git_theta.errors import LocalSetupError

    message = "reading an HDF5 file needs h5py, which is not installed: pip install h5py"
    if not git_parent.git_only_looks():
        raise LocalSetupError(f"{message} (checking out does not need it)")
    if not _warned:
        _warned.append(True)
        import sys

        sys.stderr.write(
            f"git-theta: warning: {message}; HDF5 files may show as modified until then\n"
        )
    pieces = []
    for start in range(0, size, OPAQUE_PIECE):
        end = min(start + OPAQUE_PIECE, size)
        pieces.append(TensorSpan(f"(file bytes {start:,})", "U8", (end - start,), start, end))
    return pieces
