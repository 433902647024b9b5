"""Moving content objects to and from the Git LFS remote, through git-lfs itself.

Uploads use ``git lfs push --object-id REMOTE --stdin`` (one batched transfer). There is
no fetch-by-oid command, so downloads speak git's filter protocol to one
``git lfs filter-process``: each object is requested as a smudge of its LFS pointer with
``can-delay=1``, so git-lfs queues them and downloads them in batches, in parallel.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterable
from typing import IO

from git_theta import git
from git_theta.errors import CommandError, ThetaError, TransferError
from git_theta.proc import run, start
from git_theta.protocol.pktline import (
    PacketReader,
    PacketWriter,
    read_text_list,
    write_flush,
    write_text,
)
from git_theta.store import ObjectRef, ObjectStore


class LfsUnavailableError(ThetaError):
    """git-lfs is missing or could not be started."""


POINTER = "version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\nsize {size}\n"


def push(remote: str, refs: Iterable[ObjectRef], cwd: str | None = None) -> int:
    """Upload the objects to ``remote`` (the server skips those it has); return how many
    were asked for. Raises TransferError when git-lfs fails or is missing."""
    oids = sorted({ref.oid for ref in refs})
    if oids:
        try:
            run(
                "git", *git.NO_FILTER, "lfs", "push", "--object-id", remote, "--stdin",
                stdin="".join(f"{oid}\n" for oid in oids).encode(),
                cwd=cwd,
            )  # fmt: skip
        except CommandError as exc:
            if exc.returncode == 127:
                raise  # git itself is missing: its own message says so
            if b"'lfs' is not a git command" in exc.stderr:
                raise LfsUnavailableError(
                    "git-lfs is not installed, so tensor objects cannot be uploaded and no "
                    "ref was pushed (apt-get install git-lfs, or see https://git-lfs.com)"
                ) from None
            lines = exc.stderr.decode(errors="replace").strip().splitlines()
            raise TransferError(
                f"uploading {len(oids)} content object(s) to {remote!r} failed, so no ref was "
                f"pushed; push again once the server is reachable "
                f"(git-lfs: {lines[-1] if lines else f'exit code {exc.returncode}'})"
            ) from None
    return len(oids)


class Downloader:
    """One ``git lfs filter-process``, started on first use, shared by every file."""

    def __init__(self, store: ObjectStore, cwd: str | None = None):
        self.store = store
        self.cwd = cwd
        self._proc: subprocess.Popen[bytes] | None = None

    def _start(self) -> tuple[IO[bytes], IO[bytes]]:
        if self._proc is None:
            # We ask for objects by oid: the user's skip or include/exclude settings for
            # LFS files (matched against our made-up pathnames) must not apply.
            env = {k: v for k, v in os.environ.items() if k != "GIT_LFS_SKIP_SMUDGE"}
            self._proc = start(
                "git", "-c", "lfs.fetchinclude=", "-c", "lfs.fetchexclude=",
                "lfs", "filter-process", cwd=self.cwd, env=env,
            )  # fmt: skip
            assert self._proc.stdin is not None and self._proc.stdout is not None
            inp, out = self._proc.stdin, self._proc.stdout
            write_text(inp, "git-filter-client", "version=2")
            write_text(inp, "capability=clean", "capability=smudge", "capability=delay")
            inp.flush()
            try:
                if read_text_list(out)[:1] != ["git-filter-server"]:
                    raise EOFError
                read_text_list(out)
            except EOFError:
                self.close()
                raise LfsUnavailableError(
                    "git-lfs did not start (`git lfs filter-process`); is git-lfs installed? "
                    "(apt-get install git-lfs)"
                ) from None
        assert self._proc.stdin is not None and self._proc.stdout is not None
        return self._proc.stdin, self._proc.stdout

    @staticmethod
    def _receive(out: IO[bytes]) -> None:
        PacketReader(out).drain()  # the object's bytes: git-lfs has stored them already
        read_text_list(out)  # trailing status list (empty: unchanged)

    def fetch(self, refs: Iterable[ObjectRef]) -> None:
        """Download whichever of ``refs`` are missing locally. Objects the remote lacks
        stay missing: callers check the store afterwards and say what is wrong."""
        wanted = {ref.oid: ref for ref in refs if not self.store.has(ref)}
        if not wanted:
            return
        inp, out = self._start()
        try:
            delayed = 0
            for oid, ref in sorted(wanted.items()):
                write_text(inp, "command=smudge", f"pathname={oid}", "can-delay=1")
                writer = PacketWriter(inp)
                writer.write(POINTER.format(oid=oid, size=ref.size).encode())
                writer.close()
                inp.flush()
                status = read_text_list(out)
                if status == ["status=success"]:
                    self._receive(out)
                elif status == ["status=delayed"]:
                    delayed += 1
            while delayed:
                write_text(inp, "command=list_available_blobs")
                inp.flush()
                names = [line.removeprefix("pathname=") for line in read_text_list(out)]
                read_text_list(out)  # status
                if not names:
                    break
                for name in names:
                    write_text(inp, "command=smudge", f"pathname={name}")
                    write_flush(inp)
                    inp.flush()
                    if read_text_list(out) == ["status=success"]:
                        self._receive(out)
                    delayed -= 1
        except (EOFError, BrokenPipeError):
            self.close()  # git-lfs died; what it fetched is kept, the rest stays missing

    def close(self) -> None:
        if self._proc is not None:
            proc, self._proc = self._proc, None
            try:
                assert proc.stdin is not None
                proc.stdin.close()
            except BrokenPipeError:
                pass
            proc.wait()
