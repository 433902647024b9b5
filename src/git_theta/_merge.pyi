from typing_extensions import Buffer

def threeway(
    out: Buffer,
    base: Buffer | None,
    ours: Buffer,
    theirs: Buffer,
    kind: int,
    unit: int,
    strategy: int,
    params: tuple[float, float, float, float, bool, bool, int, float, int, int, float, int] | None,
    /,
) -> tuple[tuple[int, int, int, int, int], int]: ...
def cut(base: Buffer, side: Buffer, kind: int, k: int, /) -> tuple[float, int]: ...
def narrow(values: Buffer, kind: int, /) -> bytes: ...
def conflicts(base: Buffer, ours: Buffer, theirs: Buffer, unit: int, /) -> bool: ...
def add_delta(out: Buffer, base: Buffer, z: Buffer, word: int, /) -> None: ...
