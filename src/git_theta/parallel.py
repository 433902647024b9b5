"""Ordered, memory-bounded parallel map: the codec and hashes release the GIL."""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

WORKERS = max(1, min(8, os.cpu_count() or 1))
BUDGET = 128 << 20  # bytes of input in flight; one larger item is always allowed
# Items in flight. Bytes are what BUDGET bounds; a small count left workers idle while the
# consumer waited on one large tensor ahead of many small ones (a model's embeddings).
MAX_AHEAD = 256


def ordered_map(
    fn: Callable[[T], R],
    items: Iterable[T],
    weight: Callable[[T], int],
    budget: int = BUDGET,
    workers: int = WORKERS,
) -> Iterator[R]:
    """Yield ``fn(item)`` for each item, in order, running up to ``workers`` at once.

    Items are pulled from ``items`` only while less than ``budget`` bytes are in flight,
    so a lazy input (a stream being read) is never far ahead of its consumer.
    """
    it = iter(items)
    pending: deque[tuple[Future[R], int]] = deque()
    inflight = 0
    with ThreadPoolExecutor(workers, thread_name_prefix="theta") as pool:
        try:
            exhausted = False
            while True:
                while (
                    not exhausted
                    and len(pending) < MAX_AHEAD
                    and (not pending or inflight < budget)
                ):
                    try:
                        item = next(it)
                    except StopIteration:
                        exhausted = True
                        break
                    w = weight(item)
                    pending.append((pool.submit(fn, item), w))
                    inflight += w
                if not pending:
                    return
                future, w = pending.popleft()
                result = future.result()
                inflight -= w
                yield result
        finally:
            for future, _ in pending:
                future.cancel()


_chunk_pool: ThreadPoolExecutor | None = None


def chunk_pool() -> ThreadPoolExecutor:
    """A shared pool for the chunks of one large tensor (separate from ordered_map's
    workers, which wait on it, so the two can never deadlock)."""
    global _chunk_pool
    if _chunk_pool is None:
        _chunk_pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="theta-chunk")
    return _chunk_pool


def pipelined(
    fn: Callable[[T], R], items: Iterable[T], pool: Executor | None, ahead: int = 2 * WORKERS
) -> Iterator[R]:
    """Yield ``fn(item)`` in order, keeping at most ``ahead`` items in flight on ``pool``
    (serially without a pool). Memory stays bounded by ``ahead`` results."""
    if pool is None:
        yield from map(fn, items)
        return
    pending: deque[Future[R]] = deque()
    try:
        for item in items:
            pending.append(pool.submit(fn, item))
            if len(pending) >= ahead:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for future in pending:
            future.cancel()
