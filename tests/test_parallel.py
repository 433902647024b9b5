"""The thread pools: order, errors, and cancellation."""

from __future__ import annotations

import threading
import time

import pytest

from git_theta.parallel import Pool, ordered_map, pipelined


def test_ordered_map_keeps_order_under_uneven_work() -> None:
    def slow_first(i: int) -> int:
        time.sleep(0.02 if i % 3 == 0 else 0)
        return i * i

    assert list(ordered_map(slow_first, range(40), lambda _: 1, workers=4)) == [
        i * i for i in range(40)
    ]


def test_ordered_map_raises_the_error_and_skips_what_had_not_started() -> None:
    started: list[int] = []
    lock = threading.Lock()

    def work(i: int) -> int:
        with lock:
            started.append(i)
        if i == 2:
            raise ValueError("tensor 2 is bad")
        time.sleep(0.01)
        return i

    with pytest.raises(ValueError, match="tensor 2 is bad"):
        for _ in ordered_map(work, range(1000), lambda _: 1, workers=2):
            pass
    # All work is done once ordered_map has returned: nothing still runs in the background.
    count = len(started)
    time.sleep(0.05)
    assert len(started) == count < 1000


def test_ordered_map_bounds_bytes_in_flight() -> None:
    pulled: list[int] = []

    def items() -> object:
        for i in range(10):
            pulled.append(i)
            yield i

    it = ordered_map(lambda i: i, items(), lambda _: 40, budget=100, workers=2)
    assert next(it) == 0
    assert len(pulled) <= 4  # 3 items reach the 100-byte budget; one more at most
    assert list(it) == list(range(1, 10))


def test_pool_map_and_pipelined_give_results_in_order_and_raise_errors() -> None:
    pool = Pool(3, "test")
    try:
        assert list(pool.map(lambda i: i + 1, range(50))) == list(range(1, 51))
        assert list(pipelined(lambda i: -i, range(50), pool, ahead=4)) == [-i for i in range(50)]
        assert list(pipelined(lambda i: -i, range(5), None)) == [0, -1, -2, -3, -4]

        def boom(i: int) -> int:
            if i == 7:
                raise KeyError(i)
            return i

        with pytest.raises(KeyError):
            list(pool.map(boom, range(20)))
    finally:
        pool.shutdown()


def test_submit_from_many_threads_starts_at_most_the_pool_size() -> None:
    pool = Pool(2, "test")
    try:
        callers = [
            threading.Thread(target=lambda: pool.submit(time.sleep, 0.01).result())
            for _ in range(16)
        ]
        for t in callers:
            t.start()
        for t in callers:
            t.join()
        assert len([t for t in threading.enumerate() if t.name.startswith("test-")]) == 2
    finally:
        pool.shutdown()
    assert not [t for t in threading.enumerate() if t.name.startswith("test-")]


def test_a_pool_without_workers_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one worker"):
        Pool(0)
