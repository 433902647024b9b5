"""Moving content objects to and from the Git LFS remote, through git-lfs itself.

Uploads use ``git lfs push --object-id REMOTE --stdin`` (one batched transfer). There is
no fetch-by-oid command, so downloads speak git's filter protocol to one
``git lfs filter-process``: each object is requested as a smudge of its LFS pointer with
``can-delay=1``, so git-lfs queues them and downloads them in batches, in parallel.

When git-lfs's endpoint is a ``file://`` URL, objects are first copied straight from that
repository's LFS store, several at once and hash-checked: git-lfs moves such objects one at
a time through a helper process, ~5 ms each, which dominated clones of many-tensor models.
Whatever that misses (an object it lacks, a corrupt copy) still goes through git-lfs, so
it is a shortcut, never a second code path with its own failure modes.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import IO, TYPE_CHECKING

from git_theta import git
from git_theta.errors import CommandError, ThetaError, TransferError
from git_theta.parallel import Pool
from git_theta.proc import Helper, run, run_shown, start
from git_theta.progress import enabled as progress_enabled
from git_theta.protocol.pktline import (
    PacketReader,
    PacketWriter,
    read_text_list,
    write_flush,
    write_text,
)
from git_theta.store import OWN_DIR, ObjectRef, ObjectStore


class LfsUnavailableError(ThetaError):
    """git-lfs is missing or could not be started."""


POINTER = "version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\nsize {size}\n"


def push(remote: str, refs: Iterable[ObjectRef], cwd: str | None = None) -> int:
    """Upload the objects to ``remote`` (the server skips those it has); return how many
    were asked for. Raises TransferError when git-lfs fails or is missing."""
    oids = sorted({ref.oid for ref in refs})
    if oids and progress_enabled():
        # On a terminal git-lfs shows its own upload meter, and its own words on failure.
        argv = ("git", *git.NO_FILTER, "lfs", "push", "--object-id", remote, "--stdin")
        feed = "".join(f"{oid}\n" for oid in oids).encode()
        if run_shown(*argv, stdin=feed, cwd=cwd) != 0:
            raise TransferError(
                f"uploading {len(oids)} content object(s) to {remote!r} failed, so no ref "
                "was pushed (git-lfs says why above); push again once the server is reachable"
            )
    elif oids:
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


def local_remote_objects(cwd: str | None = None) -> Path | None:
    """The LFS object directory of git-lfs's download endpoint when that is a ``file://``
    repository on this machine; None otherwise (or when git-lfs cannot say)."""
    try:
        env = run("git", "lfs", "env", cwd=cwd).stdout.decode(errors="replace")
    except CommandError:
        return None
    # The first Endpoint line is the remote git-lfs itself would download from.
    url = next((ln[9:] for ln in env.splitlines() if ln.startswith("Endpoint=")), "")
    return file_store(url.rsplit(" (auth=", 1)[0])


def file_store(url: str) -> Path | None:
    """The LFS object directory of the repository a ``file://`` endpoint names (its own
    ``lfs.storage`` honoured); None for another kind of URL or no repository there."""
    import urllib.parse

    if not url.startswith("file://"):
        return None
    root = Path(urllib.parse.unquote(urllib.parse.urlsplit(url).path))
    for git_dir in (root / ".git", root):
        if (git_dir / "HEAD").is_file() and (git_dir / "objects").is_dir():
            # Pushes honour the remote's own lfs.storage, so downloads must too (git-lfs
            # 3.3's download side does not, and cannot clone from such a remote).
            done = run("git", f"--git-dir={git_dir}", "config", "--get", "lfs.storage",
                       check=False)  # fmt: skip
            storage = done.stdout.decode().strip() if done.returncode == 0 else ""
            base = git_dir / Path(os.path.expanduser(storage)) if storage else git_dir / "lfs"
            return base / "objects"
    return None


COPY_WORKERS = 4  # hashing releases the GIL; more than this only adds disk contention


class Downloader:
    """One ``git lfs filter-process``, started on first use, shared by every file."""

    def __init__(self, store: ObjectStore, cwd: str | None = None):
        self.store = store
        self.cwd = cwd
        self._proc: Helper | None = None
        self._local: Path | bool | None = False  # False: not looked up yet
        # git-lfs's stderr: its per-object errors and progress are ours to summarise, in
        # one line naming the file, not a screen of its own before that line.
        self._stderr: IO[bytes] | None = None

    def _copy_local(self, wanted: dict[str, ObjectRef], progress: Progress) -> None:
        """Copy what a ``file://`` remote holds of ``wanted`` (removing those entries);
        ``copy_in`` puts a plain Git LFS object in git-lfs's directory, not ours."""
        if self._local is False:
            self._local = local_remote_objects(self.cwd)
        source = self._local
        if not isinstance(source, Path):
            return
        refs = sorted(wanted.values(), key=lambda ref: -ref.size)  # big ones start first

        # A pushed-to repository has them where git-lfs put them; one that git-theta
        # itself used (a clone of a work tree) keeps them in its own directory.
        roots = (source, source.parent / OWN_DIR / "objects")

        def copy(ref: ObjectRef) -> bool:
            tail = (ref.oid[:2], ref.oid[2:4], ref.oid)
            return any(self.store.copy_in(root.joinpath(*tail), ref) for root in roots)

        pool = Pool(COPY_WORKERS, "theta-copy")
        try:
            for ref, done in zip(refs, pool.map(copy, refs), strict=True):
                if done:
                    del wanted[ref.oid]
                    progress.advance(ref.size)
        finally:
            pool.shutdown()

    def _start(self) -> tuple[IO[bytes], IO[bytes]]:
        if self._proc is None:
            # We ask for objects by oid: the user's skip or include/exclude settings for
            # LFS files (matched against our made-up pathnames) must not apply.
            env = {k: v for k, v in os.environ.items() if k != "GIT_LFS_SKIP_SMUDGE"}
            import tempfile  # only when something must be downloaded

            # Kept open past this function: failure() reads it after the downloads.
            self._stderr = tempfile.TemporaryFile(dir=self.store.tmp_dir())  # noqa: SIM115
            self._proc = start(
                "git", "-c", "lfs.fetchinclude=", "-c", "lfs.fetchexclude=",
                "lfs", "filter-process", cwd=self.cwd, env=env, may_prompt=True,
                stderr=self._stderr.fileno(),
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

    def failure(self) -> str:
        """Return why git-lfs could not download something, in a few words ("" when it
        said nothing): the last error line it wrote, without its object ids."""
        if self._stderr is None:
            return ""
        self._stderr.seek(0)
        text = self._stderr.read(1 << 20).decode(errors="replace")
        return lfs_failure(text)

    def fetch(self, refs: Iterable[ObjectRef]) -> None:
        """Download whichever of ``refs`` are missing locally. Objects the remote lacks
        stay missing: callers check the store afterwards and say what is wrong (with
        ``failure()``)."""
        from git_theta.progress import Progress

        # present(), not has(): a plain Git LFS object is never taken into our directory.
        wanted = {ref.oid: ref for ref in refs if not self.store.present(ref)}
        if not wanted:
            return
        progress = Progress(
            "downloading", sum(ref.size for ref in wanted.values()), len(wanted), unit="objects"
        )
        try:
            self._copy_local(wanted, progress)
            if wanted:
                self._download(wanted, progress)
        finally:
            progress.close()

    def _download(self, wanted: dict[str, ObjectRef], progress: Progress) -> None:
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
                    progress.advance(ref.size)
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
                        got = wanted.get(name)
                        progress.advance(got.size if got is not None else 0)
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
            proc.wait()  # its captured stderr stays readable for failure()


def lfs_failure(text: str) -> str:
    """Return the reason in git-lfs's stderr ``text`` as a few words with a next step, or
    "" when it holds no error."""
    import re

    lines = [
        ln.strip()
        for ln in text.splitlines()
        if ("error" in ln.lower() or "fatal" in ln) and not ln.startswith("Errors logged")
    ]
    if not lines:
        return ""
    last = lines[-1]
    if "missing protocol" in last:
        return (
            "this repository has no Git LFS remote (no git remote, no lfs.url); add one "
            "with `git remote add origin URL` and retry"
        )
    # "Error downloading object: OID (short): Smudge error: Error downloading OID (OID): why"
    last = re.sub(r"[0-9a-f]{64}( \([0-9a-f]{7,64}\))?:?", "", last)
    why = last.rsplit(": ", 1)[-1].strip() or last
    return f"git-lfs: {why[:200]}"


if TYPE_CHECKING:
    from git_theta.progress import Progress
