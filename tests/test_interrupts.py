"""Signals at random moments: a process that survives its Ctrl-Cs (a notebook, a training loop
catching ``KeyboardInterrupt``) must leave the buffer usable by everyone. Real SIGINTs are sent,
hundreds of times, to a process that pushes, samples, updates priorities and clears in a loop;
afterwards the lock is free, no row is left being written by that live process, no row is torn,
and another process can push round the whole ring and sample."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import shmbuffer as sb

from .conftest import MUJOCO, seq_of, transition

Make = Callable[..., sb.ReplayBuffer]
CAPACITY = 256
SECONDS = 4.0
"""How long SIGINTs are sent for, per case."""


def _churn(handle: sb.BufferHandle, seed: int, ready: Any, stop: Any, idle: Any, done: Any, counts: Any) -> None:
    """Push (one row, many, into random lanes), sample, update priorities and clear, until
    ``stop``, catching the ``KeyboardInterrupt`` of every SIGINT; then wait, alive, for ``done``.
    Any other exception (a lock this thread still holds, a stall on its own rows, a torn row)
    ends the process with an error."""
    armed = [False]

    def interrupt(signum: int, frame: Any) -> None:  # default_int_handler, but only inside the try
        if armed[0]:
            armed[0] = False  # one KeyboardInterrupt per try: the except clause is not interrupted
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)
    buf = sb.ReplayBuffer.attach(handle, seed=seed)
    buf.ring.stall_timeout = 2.0  # fail fast on rows this process left odd (30 s by default)
    buf.ring.lock.default_timeout = 2.0
    rng = np.random.default_rng(seed)
    prioritized = buf.options.sampler != sb.Uniform()
    seq = caught = ops = 0
    ready.set()
    while not stop.is_set():
        try:
            armed[0] = True
            op = rng.integers(100)
            if op < 40:
                buf.push(transition(seq), lane=int(rng.integers(buf.lanes)))
                seq += 1
            elif op < 60:
                k = int(rng.integers(2, 40))
                lane: Any = rng.integers(buf.lanes, size=k) if buf.lanes > 1 else 0
                buf.push(transition(seq, k), lane=lane)
                seq += k
            elif op < 99 and len(buf):
                batch = buf.sample(32)
                seq_of(batch)
                if prioritized:
                    buf.update_priorities(batch, rng.random(32) + 0.1)
            elif op == 99:
                buf.clear()
            armed[0] = False
            ops += 1
        except KeyboardInterrupt:
            caught += 1
    counts[0], counts[1] = caught, ops
    idle.set()
    done.wait(60)


@pytest.mark.slow
@pytest.mark.parametrize("options", [{"lanes": 2}, {"sampler": sb.Prioritized()}], ids=["lanes", "prioritized"])
def test_random_sigints_leave_the_buffer_usable(make: Make, name: str, procs: list, options: dict[str, Any]) -> None:
    buf = make(MUJOCO, capacity=CAPACITY, name=name, **options)
    ctx = mp.get_context("spawn")
    ready, stop, idle, done = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Event()
    counts = ctx.Array("q", 2)
    p = ctx.Process(target=_churn, args=(buf.handle, 1, ready, stop, idle, done, counts))
    p.start()
    procs.append(p)
    assert ready.wait(60)
    rng = np.random.default_rng(0)
    sent = 0
    end = time.monotonic() + SECONDS
    while time.monotonic() < end and p.is_alive():
        os.kill(p.pid, signal.SIGINT)
        sent += 1
        time.sleep(rng.uniform(0, 0.004))
    stop.set()
    deadline = time.monotonic() + 30
    while p.is_alive() and not idle.wait(0.1) and time.monotonic() < deadline:
        pass
    assert p.is_alive(), f"the interrupted process failed (exit code {p.exitcode}); its traceback is above"
    caught, ops = counts[0], counts[1]
    assert caught > 100 and ops > 1000, (sent, caught, ops)  # the loop really ran and was interrupted

    # the interrupted process is alive and idle now: nothing may be left half-done by it
    ring = buf.ring
    assert not np.flatnonzero(ring.stamp & 1).size, "rows left being written by a live process"
    ring.lock.acquire(timeout=1)  # not held by the interrupted process
    ring.lock.release()
    if buf.priorities is not None:
        tree = buf.priorities.tree
        assert tree.total == pytest.approx(float(tree.leaves.sum()), rel=1e-9, abs=1e-9)
    # another process pushes round every slot and samples: no slot is stuck, no row is torn
    ring.stall_timeout = 1.0
    for lane in range(buf.lanes):
        buf.push(transition(10**6 + lane * CAPACITY, buf.lane_capacity), lane=lane)
    assert len(buf) == CAPACITY
    seq_of(buf.sample(4 * CAPACITY))
    seq_of(buf.take(ring.committed_ids()))
    done.set()
    p.join(30)
    assert p.exitcode == 0


def test_a_ctrl_c_during_the_reservation_comes_after_the_commit(make: Make, name: str, monkeypatch: Any) -> None:
    """A SIGINT that arrives while a push holds the lock is raised once its rows are committed:
    not when the lock is released, which would leave them odd under this live process."""
    buf = make(MUJOCO, capacity=16, name=name, sampler=sb.Prioritized())
    prios = buf.priorities
    assert prios is not None
    set_rows = prios.set_rows

    def interrupted(*args: Any, **kwargs: Any) -> None:  # runs inside the reservation's critical section
        signal.raise_signal(signal.SIGINT)
        set_rows(*args, **kwargs)

    monkeypatch.setattr(prios, "set_rows", interrupted)
    with pytest.raises(KeyboardInterrupt):
        buf.push(transition(0, 4))
    monkeypatch.undo()
    assert buf.ring.stamp[:4].tolist() == [2, 4, 6, 8]  # committed, none left odd
    assert (prios.tree.leaves[:4] > 0).all()  # their priorities were set
    buf.ring.lock.acquire(timeout=1)
    buf.ring.lock.release()
    buf.push(transition(4, 16))  # round the whole ring
    assert sorted(seq_of(buf.get(slice(None))).tolist()) == list(range(4, 20))
