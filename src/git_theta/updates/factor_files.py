"""Reading the tensors of a factors file (``--update-path``) in any format git-theta reads.

A factors file is read the way a checkpoint is (format detection, the same parsers, the
same checks of every span), so a ``.pt``/``.bin`` adapter is read through the pickle
reader that runs nothing, never ``torch.load``. Every failure names the factors file.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from git_theta.errors import ThetaError, UsageError

if TYPE_CHECKING:
    from git_theta.tensor_files import FileTensor

# The names a PEFT ``save_pretrained`` directory holds its adapter under, preferred first.
ADAPTER_FILES = ("adapter_model.safetensors", "adapter_model.bin")
ADAPTER_CONFIG = "adapter_config.json"


def resolve(path: str) -> str:
    """Return the factors file ``path`` names: itself, or for a directory the PEFT adapter
    file in it. Raises UsageError (naming ``path``) when there is none."""
    if os.path.isdir(path):
        for name in ADAPTER_FILES:
            candidate = os.path.join(path, name)
            if os.path.isfile(candidate):
                return candidate
        raise UsageError(
            f"--update-path {path}: a directory without {' or '.join(ADAPTER_FILES)}; "
            "give the factors file itself"
        )
    if not os.path.isfile(path):
        raise UsageError(f"--update-path {path}: no such file")
    return path


def read_tensors(
    path: str, wanted: Callable[[str], bool] = lambda _name: True
) -> dict[str, FileTensor]:
    """Return the tensors of the file ``path`` whose names are ``wanted``, as name ->
    (dtype, shape, bytes); only those are copied out of the file (a whole model given by
    mistake costs its header, not its size).

    Raises UsageError naming the file and the cause when it is not a file git-theta
    reads (or is corrupt).
    """
    from git_theta.files import UnsafeFileError
    from git_theta.tensor_files import read_tensors as read_file

    try:
        if os.path.getsize(path) == 0:
            raise UsageError(f"--update-path {path}: the file is empty")
        found = read_file(path, wanted)
    except UnsafeFileError as exc:
        raise UsageError(f"--update-path {path}: {exc}") from None
    except OSError as exc:
        raise UsageError(f"--update-path {path}: cannot read it ({exc.strerror})") from None
    except UsageError:
        raise
    except ThetaError as exc:
        raise UsageError(f"--update-path {path}: {exc}") from None
    if not found.total and found.format == "npz":
        raise UsageError(
            f"--update-path {path}: no uncompressed arrays in it (members written by "
            "np.savez_compressed are not read); save the factors with np.savez"
        )
    return found.tensors
