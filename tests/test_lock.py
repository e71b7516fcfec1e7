"""The robust lock: mutual exclusion across threads and processes, recovery from a dead holder,
time-outs and re-entry."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import shmbuffer as sb

from .conftest import MUJOCO

Make = Callable[..., sb.ReplayBuffer]


def _hold(handle: sb.BufferHandle, seconds: float, held: object) -> None:
    buf = sb.ReplayBuffer.attach(handle)
    buf.ring.lock.acquire()
    held.set()  # type: ignore[attr-defined]
    if seconds < 0:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(seconds)
    buf.ring.lock.release()


def holding(buf: sb.ReplayBuffer, seconds: float, procs: list) -> Any:
    """A spawned process that holds ``buf``'s lock for ``seconds`` (or dies holding it when
    negative); returns once it holds it."""
    ctx = mp.get_context("spawn")
    held = ctx.Event()
    p = ctx.Process(target=_hold, args=(buf.handle, seconds, held))
    p.start()
    procs.append(p)
    assert held.wait(60)
    return p


def test_threads_are_serialised(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=10, name=name)
    lock, counter = buf.ring.lock, buf.ring._stats[12:13]  # a spare counter as the shared state

    def work() -> None:
        for _ in range(20_000):
            with lock:
                value = int(counter[0])
                counter[0] = value + 1

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert counter[0] == 80_000
    counter[0] = 0


def test_a_dead_holder_is_recovered(make: Make, name: str, procs: list) -> None:
    buf = make(MUJOCO, capacity=10, name=name)
    p = holding(buf, -1, procs)
    p.join(30)
    buf.ring.lock.acquire(timeout=5)
    buf.ring.lock.release()
    assert buf.ring.lock.recovered == 1


def test_a_live_holder_times_out_others(make: Make, name: str, procs: list) -> None:
    buf = make(MUJOCO, capacity=10, name=name)
    holding(buf, 3.0, procs)
    start = time.monotonic()
    with pytest.raises(sb.WaitTimeout, match=r"waited 0\.2 s for the buffer.s lock"):
        buf.ring.lock.acquire(timeout=0.2)
    assert 0.15 < time.monotonic() - start < 2
    buf.ring.lock.acquire(timeout=30)  # released by its holder after 3 s
    buf.ring.lock.release()
    assert buf.ring.lock.recovered == 0


def test_reentry_is_an_error(make: Make, name: str) -> None:
    lock = make(MUJOCO, capacity=10, name=name).ring.lock
    with lock, pytest.raises(RuntimeError, match="already holds"):
        lock.acquire()


def test_lock_needs_aligned_memory() -> None:
    from shmbuffer.shm.lock import RobustLock

    with pytest.raises(ValueError, match="needs 64 aligned bytes"):
        RobustLock(np.zeros(8, np.uint8))


def test_ctrl_c_while_waiting_leaves_the_lock_free(make: Make, name: str, procs: list) -> None:
    """SIGINT arrives while this process waits for a lock another process holds: the
    KeyboardInterrupt comes promptly, and this process does not keep the lock afterwards."""
    import signal as sig

    buf = make(MUJOCO, capacity=10, name=name)
    p = holding(buf, 2.0, procs)
    timer = threading.Timer(0.3, lambda: os.kill(os.getpid(), sig.SIGINT))
    start = time.monotonic()
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        buf.ring.lock.acquire(timeout=30)
    assert time.monotonic() - start < 1.5  # not only once the holder lets go at 2 s
    p.join(30)
    buf.ring.lock.acquire(timeout=5)  # neither held by this thread (RuntimeError) nor by anyone
    buf.ring.lock.release()


def test_a_recovered_lock_repairs_the_priority_tree(make: Make, name: str, procs: list) -> None:
    buf = make(MUJOCO, capacity=100, name=name, sampler=sb.Prioritized(alpha=1.0, eps=0.0))
    from .conftest import transition

    buf.push(transition(0, 100), priority=np.ones(100))
    tree = buf.priorities.tree  # type: ignore[union-attr]
    tree._cum[:] = 0  # what a holder killed half-way through an update could leave
    p = holding(buf, -1, procs)
    p.join(30)
    buf.push(transition(100, 1), priority=[1.0])  # the next locker recovers the lock and repairs
    assert buf.stats["lock_recoveries"] == 1
    assert tree.total == pytest.approx(100.0) and len(buf.sample(10)) == 10



def repair_failing_once(buf: sb.ReplayBuffer, probe: Callable[[], Any]) -> list[Any]:
    """A repair (standing for ring.py's repairs of what a dead holder left half-done) that records
    ``probe()`` each time it runs and raises the first time; returns the records."""
    runs: list[Any] = []

    def repair() -> None:
        runs.append(probe())
        if len(runs) == 1:
            raise OSError("a repair that fails once")

    buf.ring.repairs.append(repair)
    return runs

def test_a_push_that_finds_the_holder_dead_runs_its_repairs(make: Make, name: str, procs: list) -> None:
    """A uniform push takes the lock in C (``_native.push``), which cannot run the repairs a dead
    holder left owed: it leaves them to the next locker, which runs them before anything else
    (and again, if one raises, at the next lock); the push itself goes on."""
    from .conftest import transition

    buf = make(MUJOCO, capacity=100, name=name)
    buf.push(transition(0, 10))
    runs = repair_failing_once(buf, lambda: len(buf))
    p = holding(buf, -1, procs)
    p.join(30)
    with pytest.raises(OSError, match="fails once"):
        buf.push(transition(10, 1))
    assert len(buf) == 10 and runs == [10]  # nothing pushed before the repairs ran
    ids = buf.push(transition(10, 1))  # the repairs are still owed: they run first, then the push
    assert runs == [10, 10] and ids.tolist() == [10] and len(buf) == 11
    assert buf.stats["lock_recoveries"] == 2
    assert int(buf.ring.lock.memory[56:64].view(np.int64)[0]) == 0  # nothing owed now
    buf.push(transition(11, 1))
    assert runs == [10, 10]


def test_a_priority_update_that_finds_the_holder_dead_runs_its_repairs(make: Make, name: str, procs: list) -> None:
    """``update_priorities`` tries the lock in C (``_native.update_priorities``): a dead holder
    found there leaves its repairs owed, the Python steps then run them first (and again, if one
    raises, with nothing updated), and the update goes on."""
    from .conftest import transition

    buf = make(MUJOCO, capacity=100, name=name, sampler=sb.Prioritized(alpha=1.0, eps=0.0))
    ids = buf.push(transition(0, 10), priority=np.ones(10))
    runs = repair_failing_once(buf, lambda: float(buf.priority(ids[:1])[0]))
    p = holding(buf, -1, procs)
    p.join(30)
    with pytest.raises(OSError, match="fails once"):
        buf.update_priorities(ids[:2], np.array([5.0, 6.0]))
    assert runs == [1.0] and buf.priority(ids[:2]).tolist() == [1.0, 1.0]  # nothing updated
    assert buf.update_priorities(ids[:2], np.array([5.0, 6.0])) == 2  # the owed repairs ran first
    assert runs == [1.0, 1.0] and buf.priority(ids[:3]).tolist() == [5.0, 6.0, 1.0]
    assert buf.stats["lock_recoveries"] == 2 and buf.priorities.max_priority == 6.0  # type: ignore[union-attr]
    assert int(buf.ring.lock.memory[56:64].view(np.int64)[0]) == 0  # nothing owed now
    assert buf.update_priorities(ids[:1], np.array([2.0])) == 1 and runs == [1.0, 1.0]


def test_a_priority_update_waits_for_a_busy_lock(make: Make, name: str, procs: list) -> None:
    """The C update only tries the lock: held by another process, the update waits for it on the
    Python path and is applied once it is free; held by this thread, it is a re-entrant call."""
    from .conftest import transition

    buf = make(MUJOCO, capacity=100, name=name, sampler=sb.Prioritized(alpha=1.0, eps=0.0))
    ids = buf.push(transition(0, 10), priority=np.ones(10))
    holding(buf, 1.0, procs)
    start = time.monotonic()
    assert buf.update_priorities(ids[3:5], np.array([3.0, 4.0])) == 2
    assert time.monotonic() - start > 0.5  # it waited for the holder
    assert buf.priority(ids[2:6]).tolist() == [1.0, 3.0, 4.0, 1.0]
    with buf.ring.lock, pytest.raises(RuntimeError, match="already holds"):
        buf.update_priorities(ids[:1], np.array([9.0]))
    assert buf.priority(ids[:1]).tolist() == [1.0] and buf.stats["lock_recoveries"] == 0


def test_a_signal_inside_the_lock_is_raised_at_release(make: Make, name: str) -> None:
    """A Ctrl-C that arrives while this process holds the lock waits for the release, even when
    the kernel hands it to another thread (the main thread blocks it here, as it would if the
    deferral blocked signals): the lock is never left held, the handler comes back."""
    lock = make(MUJOCO, capacity=10, name=name).ring.lock
    handler = signal.getsignal(signal.SIGINT)
    other = threading.Event()
    helper = threading.Thread(target=other.wait)  # a thread that may take the signal
    helper.start()
    reached = False
    try:
        with pytest.raises(KeyboardInterrupt), lock:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)  # another thread's C handler flags it meanwhile
                for _ in range(1000):  # many chances for the main thread to run the Python handler
                    np.zeros(3).sum()
            finally:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
            reached = True
    finally:
        other.set()
        helper.join()
    assert reached
    assert signal.getsignal(signal.SIGINT) is handler
    lock.acquire(timeout=1)  # not held by this thread (RuntimeError) nor by anyone
    lock.release()


def test_handlers_run_once_after_the_outermost_release(make: Make, name: str) -> None:
    lock = make(MUJOCO, capacity=10, name=name).ring.lock
    calls: list[int] = []

    def handler(signum: int, frame: Any) -> None:
        calls.append(signum)

    old = signal.signal(signal.SIGUSR1, handler)
    try:
        with lock:
            signal.raise_signal(signal.SIGUSR1)
            signal.raise_signal(signal.SIGUSR1)  # pending twice: the kernel would run it once
            assert calls == []
        assert calls == [signal.SIGUSR1]
        assert signal.getsignal(signal.SIGUSR1) is handler
        signal.raise_signal(signal.SIGUSR1)  # outside the lock: at once
        assert calls == [signal.SIGUSR1] * 2
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_other_threads_take_the_lock_without_touching_handlers(make: Make, name: str) -> None:
    lock = make(MUJOCO, capacity=10, name=name).ring.lock
    seen: list[Any] = []

    def work() -> None:
        with lock:
            seen.append(signal.getsignal(signal.SIGINT))

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert seen == [signal.getsignal(signal.SIGINT)]


@pytest.mark.parametrize("sampler", [sb.Uniform(), sb.Prioritized()], ids=["uniform", "prioritized"])
def test_a_stopped_lock_holder_does_not_hold_up_sampling(make: Make, name: str, procs: list, sampler: Any) -> None:
    """A process stopped (SIGSTOP, a debugger) while it holds the lock: samples without a rate
    limiter or max_use never take the lock, so they go on; what takes the lock waits for it."""
    from .conftest import seq_of, transition

    buf = make(MUJOCO, capacity=100, name=name, sampler=sampler)
    buf.push(transition(0, 100))  # this process has its writer entry (the first sample would take the lock)
    p = holding(buf, 60.0, procs)
    os.kill(p.pid, signal.SIGSTOP)
    buf.ring.lock.default_timeout = 0.5  # a sample that took the lock would raise WaitTimeout
    for _ in range(20):
        batch = buf.sample(32)
        seq_of(batch)
    assert buf.stats["sampled"] == 640
    with pytest.raises(sb.WaitTimeout):
        buf.clear()


def _sample(handle: sb.BufferHandle, times: int, rows: int) -> None:
    buf = sb.ReplayBuffer.attach(handle)
    for _ in range(times):
        buf.sample(rows)


def test_sampled_rows_are_counted_exactly_without_the_lock(make: Make, name: str, procs: list) -> None:
    """Processes and threads count their samples in their own entries: the total is exact, and
    an entry reclaimed from a dead process keeps its count."""
    from .conftest import transition

    buf = make(MUJOCO, capacity=100, name=name)
    buf.push(transition(0, 100))
    ctx = mp.get_context("spawn")
    for rows in (3, 7):
        p = ctx.Process(target=_sample, args=(buf.handle, 300, rows))
        p.start()
        procs.append(p)
    threads = [threading.Thread(target=lambda: [buf.sample(5) for _ in range(300)]) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert buf.stats["sampled"] == 300 * (3 + 7 + 3 * 5)
    ring = buf.ring
    ring._wstart[:] = 1.0  # every entry names a dead process (its pid reused since) ...
    ring._wpid[ring._wpid == 0] = os.getpid()  # ... and none is free
    ring._wid_pid = -1  # this process registers again: it reclaims a dead entry
    buf.sample(2)
    assert buf.stats["sampled"] == 300 * (3 + 7 + 3 * 5) + 2


def test_waits_are_counted_in_shared_memory(make: Make, name: str) -> None:
    """A locker that finds the lock held and waits counts itself once it has it, in the lock's
    own bytes, so every process (``shmbuffer top``) sees the count; an uncontended lock counts
    nothing."""
    buf = make(MUJOCO, capacity=8, name=name)
    lock = buf.ring.lock
    other = sb.ReplayBuffer.attach(buf.handle)
    try:
        with lock:
            pass
        assert lock.waits == 0
        got = threading.Event()

        def waiter() -> None:
            with other.ring.lock:
                got.set()

        with lock:
            t = threading.Thread(target=waiter)
            t.start()
            assert not got.wait(0.2)  # held: it waits
        t.join(5)
        assert got.is_set() and lock.waits == other.ring.lock.waits == 1
    finally:
        other.close()


_UNMAP = """
import gc, sys, threading
import numpy as np
import shmbuffer as sb
how, name = sys.argv[1], sys.argv[2]
a = sb.ReplayBuffer(sb.Schema(x=((3,), "float32")), 64, name=name + "a")
held, done = threading.Event(), threading.Event()

def other_thread():
    a.ring.lock.acquire()
    held.set()
    done.wait(30)
    # this thread's next robust lock writes to the list its held mutex is in
    b = sb.ReplayBuffer(sb.Schema(x=((1000,), "float32")), 5000, name=name + "t")
    b.ring.lock.acquire()
    b.ring.lock.release()
    b.close()
    b.unlink()

if how == "thread":
    t = threading.Thread(target=other_thread)
    t.start()
    held.wait(30)
else:
    a.ring.lock.acquire()
if how == "dropped":
    a.unlink()
else:
    a._close(defer=True)
    a.unlink()
del a
gc.collect()
b = sb.ReplayBuffer(sb.Schema(x=((1000,), "float32")), 5000, name=name + "b")  # mapped elsewhere
b.ring.lock.acquire()
b.ring.lock.release()
b.close()
b.unlink()
if how == "thread":
    done.set()
    t.join(30)
print("ok")
"""


@pytest.mark.parametrize("how", ["closed", "dropped", "thread"])
def test_a_held_lock_is_never_unmapped(how: str, name: str) -> None:
    """glibc links the robust mutexes a thread holds through their memory: a buffer closed (or
    dropped) while a thread of this process holds its lock must not unmap that mutex, or the
    thread's next lock of any buffer writes to unmapped memory (the process died of SIGSEGV).
    Closed by the holding thread, the lock is released; dropped, or held by another thread, its
    memory stays mapped. In a child process: a segfault must not take the test runner down."""
    import subprocess
    import sys

    got = subprocess.run([sys.executable, "-c", _UNMAP, how, name], capture_output=True, text=True, timeout=120)
    assert got.returncode == 0 and got.stdout.strip() == "ok", (got.returncode, got.stderr[-2000:])
