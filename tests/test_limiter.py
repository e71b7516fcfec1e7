"""The rate limiter: Reverb's window on samples per insert, in one process and across several."""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Callable

import numpy as np
import pytest

import shmbuffer as sb

from .conftest import MUJOCO, transition

Make = Callable[..., sb.ReplayBuffer]


def test_window_arithmetic() -> None:
    lim = sb.RateLimiter(samples_per_insert=2.0, min_size=10, error=20)
    assert lim.offset == 20
    assert not lim.can_sample(10, 0, 9, 1)  # the buffer holds fewer than min_size rows
    assert lim.can_sample(10, 0, 10, 1)  # diff 20 - 1 >= 0
    assert lim.can_sample(10, 20, 10, 0) and not lim.can_sample(10, 20, 10, 1)  # diff 0 is the floor
    assert lim.can_insert(100, 0, 100, 5)  # only when it blocks writers
    block = sb.RateLimiter(samples_per_insert=2.0, min_size=10, error=20, block_writers=True)
    assert block.can_insert(10, 0, 10, 10) and not block.can_insert(10, 0, 10, 11)  # 2 * 21 - 0 > 40
    assert sb.RateLimiter(min_size=3).can_sample(3, 10**9, 3, 10**6)  # no ratio: only min_size
    with pytest.raises(ValueError, match="samples_per_insert must be a positive number"):
        sb.RateLimiter(samples_per_insert=0)
    with pytest.raises(ValueError, match="min_size must be an int >= 1"):
        sb.RateLimiter(min_size=0)
    with pytest.raises(ValueError, match="never fit the window"):
        sb.RateLimiter(samples_per_insert=1.0, error=10, block_writers=True).check_sample_size(100)
    sb.RateLimiter(samples_per_insert=1.0, error=10).check_sample_size(100)  # writers catch up


def test_min_size_holds_samples_back(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=100, name=name, limiter=sb.RateLimiter(min_size=10, timeout=0.2))
    buf.push(transition(0, 9))
    start = time.monotonic()
    with pytest.raises(sb.WaitTimeout, match=r"sample of 4 rows waited 0\.2 s for the rate limiter: 9 rows inserted"):
        buf.sample(4)
    assert time.monotonic() - start >= 0.2
    assert buf.stats["sampled"] == 0  # a sample that never happened is not counted
    buf.push(**transition(9))
    assert len(buf.sample(4)) == 4 and buf.stats["sampled"] == 4


def test_samples_per_insert_window(make: Make, name: str) -> None:
    lim = sb.RateLimiter(samples_per_insert=1.0, min_size=10, error=50, timeout=0.1)
    buf = make(MUJOCO, capacity=1000, name=name, limiter=lim)
    buf.push(transition(0, 100))
    for _ in range(14):
        buf.sample(10)  # up to sampled = inserted - offset + error = 140
    with pytest.raises(sb.WaitTimeout, match=r"diff -40 vs window 10 \+- 50"):
        buf.sample(1)
    buf.push(**transition(100))
    buf.sample(1)  # one more insert, one more sample


def test_blocked_writers(make: Make, name: str) -> None:
    lim = sb.RateLimiter(samples_per_insert=2.0, min_size=4, error=8, block_writers=True, timeout=0.1)
    buf = make(MUJOCO, capacity=1000, name=name, limiter=lim)
    buf.push(transition(0, 8))  # diff 16 = offset 8 + error 8: full
    with pytest.raises(sb.WaitTimeout, match=r"push of 1 rows waited 0\.1 s for the rate limiter"):
        buf.push(**transition(8))
    assert buf.stats["inserted"] == 8 and len(buf) == 8  # the refused push changed nothing
    buf.sample(2)  # diff 14: room for one row
    buf.push(**transition(8))
    with pytest.raises(sb.WaitTimeout):
        buf.push(**transition(9))


def test_the_limiter_is_read_by_attaching_processes(make: Make, name: str) -> None:
    lim = sb.RateLimiter(samples_per_insert=1.0, min_size=5, error=5, block_writers=True, timeout=0.1)
    buf = make(MUJOCO, capacity=100, name=name, limiter=lim)
    other = sb.ReplayBuffer.attach(buf.handle)
    try:
        assert other.options.limiter == lim
        other.push(transition(0, 10))
        with pytest.raises(sb.WaitTimeout):
            other.push(**transition(10))
    finally:
        other.close()


def _writer(handle: sb.BufferHandle, seconds: float, k: int) -> None:
    buf = sb.ReplayBuffer.attach(handle)
    end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < end:
        try:
            buf.push(transition(i % 2**20, k), timeout=0.05)
            i += k
        except sb.WaitTimeout:
            pass
    buf.close()


@pytest.mark.slow
def test_ratio_stays_in_the_window_across_processes(make: Make, name: str, procs: list) -> None:
    """Two writer processes push as fast as the limiter lets them while the learner samples:
    every time the learner looks, samples per insert is inside the window."""
    spi, min_size, error = 4.0, 100, 400.0
    lim = sb.RateLimiter(samples_per_insert=spi, min_size=min_size, error=error, block_writers=True, timeout=10)
    buf = make(MUJOCO, capacity=10_000, name=name, limiter=lim)
    ctx = mp.get_context("spawn")
    for _ in range(2):
        p = ctx.Process(target=_writer, args=(buf.handle, 3.0, 8))
        p.start()
        procs.append(p)
    offset = spi * min_size
    seen = []
    while any(p.is_alive() for p in procs):
        try:
            buf.sample(32, timeout=0.2)
        except sb.WaitTimeout:
            continue
        stats = buf.stats
        diff = spi * stats["inserted"] - stats["sampled"]
        seen.append(diff)
        assert offset - error <= diff <= offset + error, (stats, diff)
    for p in procs:
        p.join(10)
    assert len(seen) > 100
    assert buf.stats["inserted"] > 1000


def test_min_size_counts_rows_held(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=100, name=name, limiter=sb.RateLimiter(min_size=10, timeout=0.1))
    buf.push(transition(0, 20))
    buf.sample(5)
    buf.clear()
    buf.push(transition(20, 5))
    with pytest.raises(sb.WaitTimeout, match="min_size=10"):
        buf.sample(1)  # 25 rows were inserted, but the buffer holds 5


NOT_SECONDS = [float("nan"), np.float32("nan"), "0.5", True, -1.0, float("inf")]
"""Timeouts refused wherever one is taken: NaN (a wait bounded by it never ends), text, a bool,
a negative or an endless one."""


def state(buf: sb.ReplayBuffer) -> tuple[dict, dict]:
    return buf.export(), dict(buf.stats)


def same(a: tuple[dict, dict], b: tuple[dict, dict]) -> bool:
    return a[1] == b[1] and a[0].keys() == b[0].keys() and all(np.array_equal(a[0][k], b[0][k]) for k in a[0])


@pytest.mark.parametrize("bad", NOT_SECONDS, ids=repr)
def test_a_timeout_that_is_not_seconds_is_refused_at_once(make: Make, name: str, bad: object) -> None:
    with pytest.raises(ValueError, match=r"RateLimiter: timeout: expected seconds, a finite number > 0, got"):
        sb.RateLimiter(timeout=bad)  # type: ignore[arg-type]
    gated = make(MUJOCO, capacity=100, name=name + "g",
                 limiter=sb.RateLimiter(samples_per_insert=1.0, min_size=1, error=8, block_writers=True, timeout=5))
    plain = make(MUJOCO, capacity=100, name=name + "p")
    for buf in (gated, plain):
        buf.push(transition(0, 3))
        before = state(buf)
        start = time.monotonic()
        with pytest.raises(ValueError, match=r"push: timeout: expected seconds, a finite number >= 0, got"):
            buf.push(transition(3, 1), timeout=bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"sample: timeout: expected seconds"):
            buf.sample(2, timeout=bad)  # type: ignore[arg-type]
        assert time.monotonic() - start < 1.0, "refused before any wait"
        assert same(state(buf), before)
        assert buf.ring.sampled == 0
