"""Ordered, memory-bounded parallel maps on small thread pools: the codec and the hashes
release the GIL, so threads give real parallelism.

The pool is ours rather than concurrent.futures': that package imports logging, 7 ms
on every filter start, for features (process pools, timeouts, callbacks) never used.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from queue import SimpleQueue
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")

WORKERS = max(1, min(8, os.cpu_count() or 1))
BUDGET = 128 << 20  # bytes of input in flight; one larger item is always allowed
# Items in flight. Bytes are what BUDGET bounds; a small count left workers idle while the
# consumer waited on one large tensor ahead of many small ones (a model's embeddings).
MAX_AHEAD = 256


class Task(Generic[R]):
    """The pending result of one submitted call."""

    __slots__ = ("_done", "_error", "_result", "cancelled")

    def __init__(self) -> None:
        self._done = threading.Lock()
        self._done.acquire()  # released by the worker when the call has finished
        self._result: R | None = None
        self._error: BaseException | None = None
        self.cancelled = False

    def _run(self, fn: Callable[[T], R], arg: T) -> None:
        if not self.cancelled:
            try:
                self._result = fn(arg)
            except BaseException as exc:  # handed to whoever waits on the result
                self._error = exc
        self._done.release()

    def result(self) -> R:
        """Wait for the call; return its value or raise its exception."""
        with self._done:
            pass
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]  # set: the call returned

    def cancel(self) -> None:
        """Skip the call if no worker has started it yet."""
        self.cancelled = True


_Job = tuple[Task, Callable, object]  # type: ignore[type-arg]


def _work(jobs: SimpleQueue[_Job | None]) -> None:
    while (job := jobs.get()) is not None:
        task, fn, arg = job
        task._run(fn, arg)
        del job, task, fn, arg  # the argument (a tensor's bytes) is freed now, not later


class Pool:
    """A fixed number of daemon worker threads serving one queue of calls. Call
    ``shutdown`` when done (idle workers otherwise wait for work until the process ends)."""

    def __init__(self, workers: int = WORKERS, name: str = "theta"):
        if workers < 1:
            raise ValueError("a pool needs at least one worker")
        self._jobs: SimpleQueue[_Job | None] = SimpleQueue()
        self._workers = workers
        self._name = name
        self._threads: list[threading.Thread] = []
        self._starting = threading.Lock()  # submit runs on several threads at once

    def submit(self, fn: Callable[[T], R], arg: T) -> Task[R]:
        task: Task[R] = Task()
        self._jobs.put((task, fn, arg))
        if len(self._threads) < self._workers:  # workers start as work arrives
            with self._starting:
                if len(self._threads) < self._workers:
                    self._start_worker()
        return task

    def _start_worker(self) -> None:
        thread = threading.Thread(
            target=_work, args=(self._jobs,), name=f"{self._name}-{len(self._threads)}",
            daemon=True,  # an idle worker never holds up the exit
        )  # fmt: skip
        thread.start()
        self._threads.append(thread)

    def map(self, fn: Callable[[T], R], items: Iterable[T]) -> Iterator[R]:
        """Yield ``fn(item)`` for every item, in order; all are submitted at once."""
        tasks = [self.submit(fn, item) for item in items]
        try:
            for task in tasks:
                yield task.result()
        finally:
            for task in tasks:
                task.cancel()

    def shutdown(self) -> None:
        """Let queued calls finish, then stop and join the workers."""
        for _ in self._threads:
            self._jobs.put(None)
        for thread in self._threads:
            thread.join()
        self._threads = []


def ordered_map(
    fn: Callable[[T], R],
    items: Iterable[T],
    weight: Callable[[T], int],
    budget: int = BUDGET,
    workers: int = WORKERS,
) -> Iterator[R]:
    """Yield ``fn(item)`` for each item, in order, running up to ``workers`` at once.

    Items are pulled from ``items`` only while less than ``budget`` bytes are in flight,
    so a lazy input (a stream being read) is never far ahead of its consumer. When the
    consumer stops early or a call raises, calls not yet started are skipped and running
    ones are waited for before this returns.
    """
    it = iter(items)
    pending: deque[tuple[Task[R], int]] = deque()
    inflight = 0
    pool = Pool(workers)
    try:
        exhausted = False
        while True:
            while not exhausted and len(pending) < MAX_AHEAD and (not pending or inflight < budget):
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
            task, w = pending.popleft()
            result = task.result()
            inflight -= w
            yield result
    finally:
        for task, _ in pending:
            task.cancel()
        pool.shutdown()


_chunk_pool: Pool | None = None
_chunk_lock = threading.Lock()


def chunk_pool() -> Pool:
    """A shared pool for the chunks of one large tensor (separate from ordered_map's
    workers, which wait on it, so the two can never deadlock)."""
    global _chunk_pool
    if _chunk_pool is None:
        with _chunk_lock:
            if _chunk_pool is None:
                _chunk_pool = Pool(WORKERS, "theta-chunk")
    return _chunk_pool


def pipelined(
    fn: Callable[[T], R], items: Iterable[T], pool: Pool | None, ahead: int = 2 * WORKERS
) -> Iterator[R]:
    """Yield ``fn(item)`` in order, keeping at most ``ahead`` items in flight on ``pool``
    (serially without a pool). Memory stays bounded by ``ahead`` results."""
    if pool is None:
        yield from map(fn, items)
        return
    pending: deque[Task[R]] = deque()
    try:
        for item in items:
            pending.append(pool.submit(fn, item))
            if len(pending) >= ahead:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for task in pending:
            task.cancel()
