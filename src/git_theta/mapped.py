"""A tensor value kept in a file of ours, mapped read-only once it is checked.

Used for the values the merge driver leaves for the checkout after it (merged_values.py)
and the values an add leaves for the next add of the file (previous_values.py).
"""

from __future__ import annotations

import mmap
import os
import stat


def map_checked(fd: int, size: int, digest: str) -> memoryview | None:
    """The regular file open as ``fd`` (closed here), mapped read-only, when it has
    ``size`` bytes (more than none), one name, and the content hash ``digest``; else None.

    Not copied: a copy is as much fresh memory again (a page fault and zeroing per page).
    A second name (a hard link someone made) could change or truncate the mapped bytes
    after their hash is checked, so such a file is not used; the mapping stays valid after
    the file's name is removed, and is unmapped when the last view of it goes.
    """
    from git_theta.content import content_hash

    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size != size or info.st_nlink != 1 or not size:
            return None
        value = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    view = memoryview(value)
    if content_hash(view) != digest:
        view.release()
        value.close()
        return None
    return view
