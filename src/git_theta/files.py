"""One way to write a file, and one way to open a file git-theta did not create.

A repository is untrusted: a clone can hold a symlink under any name we might use, a FIFO
where a checkpoint should be, a device behind a settings file. So:

- every write goes to a temporary created exclusively (``O_CREAT|O_EXCL|O_NOFOLLOW``) under
  an unguessable name, in a directory opened without following a symlink, and is renamed
  over its destination only when that is absent or a regular file;
- every read of a work-tree or committed path opens regular files only, never through a
  symlink (git hands drivers regular files or temporaries of its own, and checks symlinks
  out as symlinks), and never blocks on a FIFO;
- logs live in a private per-user directory.

Imports stay at os, stat, errno, time (and contextlib, which the store has loaded
already): the filter imports this module at start.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import time
from typing import IO, TYPE_CHECKING, BinaryIO

from git_theta.errors import ThetaError

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable
    from types import TracebackType

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
# errnos an open with O_NOFOLLOW/O_DIRECTORY gives for something that is not what we asked.
_WRONG_KIND = (errno.ELOOP, errno.ENOTDIR, errno.ENXIO, errno.EOPNOTSUPP)
# errnos of a failed write that name no file of their own: the writer adds its path.
_WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO)
LOG_CAP = 1 << 20  # an error log over this is started afresh: it keeps recent failures
# A temporary (``...theta-PID-RANDOM``) is stale when its process is gone and it was
# untouched this long (a writer touches it continuously; the wait spares one whose pid
# lives in another pid namespace or on another host sharing the directory), or when
# untouched for a day whatever its pid (which may have been reused).
DEAD_WRITER_GRACE = 60.0
STALE_AGE = 86400.0
_HEX = frozenset("0123456789abcdef")


class UnsafeFileError(ThetaError, OSError):
    """A path git-theta refuses to read or write: not a regular file (a symlink, a FIFO, a
    device, a directory), a directory reached through a symlink, or over a size cap."""


def kind_of(mode: int) -> str:
    """Return what a file of ``st_mode`` is, as words for a message."""
    for test, name in (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a device"),
        (stat.S_ISBLK, "a device"),
        (stat.S_ISREG, "a regular file"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _lstat(path: str, dir_fd: int | None = None) -> os.stat_result | None:
    try:
        return os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def check_replaceable(path: str, dir_fd: int | None = None, shown: str = "") -> None:
    """Raise UnsafeFileError unless ``path`` (``shown`` in the message) is absent or a
    regular file: what a rename may replace. Callers writing several files check them
    all first, so that a refusal leaves none half done."""
    st = _lstat(path, dir_fd)
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise UnsafeFileError(
            f"{shown or path} is {kind_of(st.st_mode)}; git-theta replaces only regular files "
            "(move it aside and retry)"
        )


def _refuse(
    name: str, dir_fd: int | None, shown: str, wanted: str, exc: OSError
) -> UnsafeFileError | OSError:
    """The error for an open of ``name`` (``shown`` in messages) that failed with ``exc``:
    UnsafeFileError when it is something other than ``wanted``, else ``exc``, named."""
    st = _lstat(name, dir_fd) if exc.errno in _WRONG_KIND else None
    if st is not None:
        return UnsafeFileError(
            f"{shown} is {kind_of(st.st_mode)}, not {wanted}; git-theta does not go through "
            "it (replace it, or move it aside)"
        )
    exc.filename = shown
    return exc


def name_error(exc: BaseException | None, path: str) -> None:
    """Make a failed write's OSError, which names no file (ENOSPC from a write or a
    flush), name ``path``, so the one-line report says which file."""
    if (
        isinstance(exc, OSError)
        and not isinstance(exc, ThetaError)
        and exc.filename is None
        and exc.errno in _WRITE_ERRNOS
    ):
        exc.filename = path


def open_dir(path: str, within: str | None = None) -> int:
    """Open the directory ``path`` and return its descriptor (close it yourself).

    Its last component is never followed as a symlink; with ``within``, no component below
    ``within`` is (``within`` itself is the caller's: a work tree may be reached through
    links of the user's own). Raises UnsafeFileError when one is a symlink or not a
    directory, OSError (named) when it cannot be opened.
    """
    if within is None:
        try:
            return os.open(path, _DIR_FLAGS)
        except OSError as exc:
            raise _refuse(path, None, path, "a directory", exc) from None
    rel = os.path.relpath(path, within)
    if rel == os.pardir or rel.startswith(os.pardir + os.sep):
        raise UnsafeFileError(f"{path} is outside {within}; git-theta does not write there")
    fd = os.open(within, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    here = within
    for part in [] if rel == os.curdir else rel.split(os.sep):
        here = os.path.join(here, part)
        try:
            step = os.open(part, _DIR_FLAGS, dir_fd=fd)
        except OSError as exc:
            raise _refuse(part, fd, here, "a directory", exc) from None
        finally:
            os.close(fd)
        fd = step
    return fd


class TempFile:
    """A new file in ``directory``, created exclusively under an unguessable name
    (``PREFIXPID-RANDOM``: the pid tells a sweep whether its writer lives), that
    becomes a real file only by ``commit``. As a context manager it is removed on exit
    unless committed; an OSError leaving the block is made to name the file.

    ``mode`` None: the umask's default (0666 & ~umask, applied by the kernel); otherwise
    the file is created 0600 and given ``mode`` before it is renamed.
    """

    def __init__(
        self,
        directory: str,
        prefix: str,
        within: str | None = None,
        mode: int | None = None,
        label: str = "",
    ):
        self.directory = directory
        self.label = label  # the path a failed write names (default: the temporary's)
        # Open for the file's life: the temporary is made, renamed and removed in this
        # very directory, whatever its path comes to point at meanwhile.
        self._mode = mode
        self.dir_fd = open_dir(directory, within)
        try:
            self.name, fd = self._create(prefix, 0o666 if mode is None else 0o600)
        except BaseException:
            os.close(self.dir_fd)
            raise
        self.file: BinaryIO = os.fdopen(fd, "wb")
        self.committed = False

    def _create(self, prefix: str, mode: int) -> tuple[str, int]:
        for _ in range(16):  # a clash of 64 random bits is a hostile name or a broken RNG
            name = f"{prefix}{os.getpid()}-{os.urandom(8).hex()}"
            try:
                return name, os.open(name, _CREATE_FLAGS, mode, dir_fd=self.dir_fd)
            except FileExistsError:
                continue
            except OSError as exc:
                exc.filename = os.path.join(self.directory, name)
                raise
        raise UnsafeFileError(f"cannot create a temporary file in {self.directory}")

    @property
    def path(self) -> str:
        return os.path.join(self.directory, self.name)

    def _close(self) -> None:
        if self._mode is not None:
            os.fchmod(self.file.fileno(), self._mode)
        self.file.close()

    def commit(self, dest: str, dest_dir_fd: int | None = None, dest_name: str = "") -> None:
        """Close the file and rename it to ``dest``, which must be absent or a regular file
        (``dest_name`` relative to ``dest_dir_fd`` when given; ``dest`` is then only for
        messages). Raises UnsafeFileError for anything else at ``dest``."""
        target = dest_name or dest
        try:
            self._close()
            check_replaceable(target, dest_dir_fd, dest)
            os.replace(self.name, target, src_dir_fd=self.dir_fd, dst_dir_fd=dest_dir_fd)
        except UnsafeFileError:
            raise
        except OSError as exc:
            if exc.filename2 is not None:  # the rename's: name both files in full
                exc.filename, exc.filename2 = self.path, dest
            name_error(exc, self.label or self.path)
            raise
        self.committed = True

    def discard(self) -> None:
        """Close and remove the temporary (nothing happens when it was committed)."""
        if not self.file.closed:
            with contextlib.suppress(OSError):  # a failed flush of bytes thrown away
                self.file.close()
        if not self.committed:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.name, dir_fd=self.dir_fd)

    def __enter__(self) -> TempFile:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self.discard()
        finally:
            os.close(self.dir_fd)
        if exc is not None:
            name_error(exc, self.label or self.path)


class AtomicWriter:
    """``with AtomicWriter(dest) as fh:`` write ``fh``; on a clean exit ``dest`` is replaced
    in one rename, on any failure it is untouched and the temporary removed.

    The temporary (``.NAME.theta-PID-RANDOM``) is made in ``dest``'s directory, reached as
    ``open_dir`` says (pass ``within`` as the work tree's top); stale ones of the same
    destination (a killed writer's) are removed first. ``mode`` None keeps the
    permission bits of the file it replaces (the umask's default for a new one).
    Raises UnsafeFileError when ``dest`` or its directory is not what it should be.
    """

    def __init__(
        self, dest: str | os.PathLike[str], mode: int | None = None, within: str | None = None
    ):
        self.dest = os.fspath(dest)
        directory, self._name = os.path.split(os.path.abspath(self.dest))
        self._directory = directory
        self._within = within
        self._mode = mode
        self._tmp: TempFile | None = None

    def __enter__(self) -> BinaryIO:
        mode = self._mode
        if mode is None:
            st = _lstat(os.path.join(self._directory, self._name))
            if st is not None and stat.S_ISREG(st.st_mode):
                mode = stat.S_IMODE(st.st_mode)
        prefix = f".{self._name[:200]}.theta-"
        self._tmp = TempFile(self._directory, prefix, self._within, mode, label=self.dest)
        with contextlib.suppress(OSError):  # a sweep that fails must not fail the write
            remove_stale(self._tmp.dir_fd, lambda name: name.startswith(prefix))
        return self._tmp.file

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        tmp = self._tmp
        assert tmp is not None, "AtomicWriter used outside a with block"
        name_error(exc, self.dest)
        with tmp:
            if exc is None:
                tmp.commit(self.dest, tmp.dir_fd, self._name)


def atomic_write(
    dest: str | os.PathLike[str],
    data: bytes | Iterable[bytes],
    mode: int | None = None,
    within: str | None = None,
) -> None:
    """Replace ``dest`` with ``data`` (bytes, or parts written as they come) in one rename,
    as AtomicWriter does; raises what it raises."""
    with AtomicWriter(dest, mode, within) as fh:
        for part in [data] if isinstance(data, bytes | bytearray | memoryview) else data:
            fh.write(part)


def _own_regular(fd: int, path: str) -> os.stat_result:
    """Return the status of the file open as ``fd`` (at ``path``, for messages); raise
    UnsafeFileError unless it is a regular file that belongs to us: an append-only file we
    keep (a log, a record) that someone else planted or replaced is not written to."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeFileError(f"{path} is {kind_of(st.st_mode)}, not a regular file; refused")
    if st.st_uid != os.getuid():
        raise UnsafeFileError(f"{path} belongs to uid {st.st_uid}, not to us; refused")
    return st


def append_record(path: str, data: bytes, cap: int) -> None:
    """Append ``data`` (a few small records) to the regular file ``path`` of ours in one
    ``O_APPEND`` write, creating it 0600: processes appending at once never interleave
    their bytes. A file that would grow past ``cap`` is replaced by ``data`` alone (its
    records are state that may be lost, never wrong). Raises UnsafeFileError when
    ``path`` is not a regular file of ours, OSError when it cannot be written."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        fd = os.open(path, flags | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise _refuse(path, None, path, "a regular file", exc) from None
    try:
        st = _own_regular(fd, path)
        if st.st_size + len(data) <= cap:
            os.write(fd, data)
            return
    finally:
        os.close(fd)
    atomic_write(path, data, 0o600)


def writer_alive(pid: int) -> bool:
    """Whether process ``pid`` (a temporary's writer) still runs; a zombie does not."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, as another user's
        return True
    # A zombie answers signal 0 too: killed, but not reaped (a container whose pid 1 does
    # not reap). Its temporaries are as stale as a vanished process's.
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            state = fh.read(4096).rpartition(b")")[2].split()[:1]
    except OSError:
        return True  # no /proc here: assume alive, the age rule still applies
    return state != [b"Z"]


def writer_pid(name: str) -> int | None:
    """The pid in the name of a temporary TempFile made (``theta-PID-RANDOM``, after
    ``.NAME.`` in a work tree), or None when ``name`` is not one."""
    before, sep, tail = name.rpartition("theta-")
    pid, _, rand = tail.partition("-")
    if not sep or not pid.isdigit() or not rand:
        return None
    if before:  # in a work tree only our exact form: a user's file may look alike
        exact = before.endswith(".") and len(rand) == 16 and set(rand) <= _HEX
        return int(pid) if exact else None
    return int(pid)  # in the store's tmp, also an older version's theta-PID-TID-N


def remove_stale(
    directory: str | int, ours: Callable[[str], bool], dry_run: bool = False
) -> tuple[int, int]:
    """Remove the stale temporaries (see DEAD_WRITER_GRACE) in ``directory`` (a path or a
    descriptor) whose names ``ours`` accepts and ``writer_pid`` reads; return how many
    and their bytes. Only regular files are touched."""
    now = time.time()
    count = size = 0
    dir_fd = directory if isinstance(directory, int) else None
    with os.scandir(directory) as entries:
        found = [entry for entry in entries if ours(entry.name)]
    for entry in found:
        pid = writer_pid(entry.name)
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        age = now - st.st_mtime
        if pid is None or not stat.S_ISREG(st.st_mode) or age < DEAD_WRITER_GRACE:
            continue
        if age < STALE_AGE and writer_alive(pid):
            continue
        if not dry_run:
            try:
                os.unlink(entry.name if dir_fd is not None else entry.path, dir_fd=dir_fd)
            except FileNotFoundError:
                continue
        count += 1
        size += st.st_size
    return count, size


def open_regular(path: str | os.PathLike[str]) -> BinaryIO:
    """Open ``path`` for reading if it is a regular file, not followed as a symlink.

    A FIFO or device is refused without blocking on it. Raises UnsafeFileError for
    anything but a regular file, FileNotFoundError (and other OSErrors) as open does.
    """
    name = os.fspath(path)
    try:
        fd = os.open(name, _READ_FLAGS)
    except OSError as exc:
        raise _refuse(name, None, name, "a regular file", exc) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFileError(
                f"{name} is {kind_of(st.st_mode)}, not a regular file; git-theta does not read "
                "it (replace it, or move it aside)"
            )
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_capped(path: str | os.PathLike[str], cap: int) -> bytes:
    """Return the bytes of the regular file ``path`` when it holds at most ``cap`` of them.

    Raises UnsafeFileError when it is larger or not a regular file, OSError as open does.
    """
    with open_regular(path) as fh:
        data = fh.read(cap + 1)
    if len(data) > cap:
        raise UnsafeFileError(
            f"{os.fspath(path)} is over {cap:,} bytes, more than such a file needs; refused "
            "(check what it holds)"
        )
    return data


def _private_dir(path: str) -> int:
    """Open ``path`` (created 0700 if absent) as a directory only we can use; return its
    descriptor. Raises UnsafeFileError naming what is wrong with it."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    fd = open_dir(path)
    st = os.fstat(fd)
    problem = ""
    if st.st_uid != os.getuid():
        problem = f"belongs to uid {st.st_uid}, not to us"
    elif st.st_mode & 0o077:
        problem = f"is open to other users (mode {stat.S_IMODE(st.st_mode):o}): chmod 700 it"
    if problem:
        os.close(fd)
        raise UnsafeFileError(f"{path} {problem}")
    return fd


def state_dir() -> str:
    """Return git-theta's per-user state directory: ``$XDG_STATE_HOME/git-theta``, else
    ``~/.local/state/git-theta`` (only the path: ``open_log`` checks and creates it)."""
    base = os.environ.get("XDG_STATE_HOME", "")
    if not os.path.isabs(base):  # the XDG spec: a relative value is ignored
        base = os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "git-theta")


def open_log(name: str = "errors.log") -> tuple[IO[str], str]:
    """Open the log ``name`` in the private state directory for appending; return it
    and its path. A log over LOG_CAP is emptied first.

    Raises UnsafeFileError when the directory is not ours alone or the log is not a
    regular file of ours (a symlink, a FIFO: refused without blocking), OSError when
    neither can be made.
    """
    directory = state_dir()
    if not os.path.isabs(directory):
        raise UnsafeFileError("no HOME or XDG_STATE_HOME to keep a log in")
    os.makedirs(os.path.dirname(directory), mode=0o700, exist_ok=True)
    dir_fd = _private_dir(directory)
    path = os.path.join(directory, name)
    try:
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
        try:
            fd = os.open(name, flags | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
        except OSError as exc:
            raise _refuse(name, dir_fd, path, "a regular file", exc) from None
    finally:
        os.close(dir_fd)
    try:
        st = _own_regular(fd, path)
        if st.st_size > LOG_CAP:
            os.ftruncate(fd, 0)
        log = os.fdopen(fd, "a", encoding="utf-8", errors="backslashreplace")
    except BaseException:
        os.close(fd)
        raise
    return log, path
