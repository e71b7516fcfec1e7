"""Many processes at once: no torn rows under load, writers killed mid-push, handles crossing
process boundaries, every start method, and no resource_tracker noise."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from typing import Any

import multiprocess
import numpy as np
import psutil
import pytest

import shmbuffer as sb
from shmbuffer.shm import segment

from .conftest import MUJOCO, START_METHODS, copy_through, seq_of, transition

Make = Callable[..., sb.ReplayBuffer]

WIDE = sb.Schema(payload=((512,), "int64"), x=((), "float64"), tag=((), "int32"))
"""Rows with a 4 KiB column of their own and a packed record: both can tear."""


def wide_rows(seq: np.ndarray) -> dict[str, np.ndarray]:
    return {
        "payload": seq[:, None] * 1000 + np.arange(512),
        "x": seq * 0.5,
        "tag": (seq % 1_000_003).astype(np.int32),
    }


def torn(batch: Any) -> np.ndarray:
    """Rows whose values do not all derive from one sequence number."""
    seq = batch.payload[:, 0] // 1000
    ok = (batch.payload == seq[:, None] * 1000 + np.arange(512)).all(axis=1)
    ok &= batch.x == seq * 0.5
    ok &= batch.tag == seq % 1_000_003
    return np.flatnonzero(~ok)


def _wide_writer(buf: sb.ReplayBuffer, writer: int, seconds: float, done: Any) -> None:
    rng = np.random.default_rng(writer)
    i, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        k = int(rng.integers(1, 9))
        buf.push(wide_rows(writer * 10**9 + np.arange(i, i + k)))
        i += k
    done.put(i)
    buf.close()


@pytest.mark.slow
@pytest.mark.parametrize("method", START_METHODS)
def test_no_torn_rows_under_load(method: str, make: Make, name: str, procs: list) -> None:
    """Two writers lap a 64-row ring in batches of 1-8 while the learner samples: on 2 cores
    writers are descheduled mid-copy all the time. Not one sampled row may be torn."""
    ctx = mp.get_context(method)
    buf = make(WIDE, capacity=64, name=name)
    done = ctx.Queue()
    for w in (1, 2):
        p = ctx.Process(target=_wide_writer, args=(buf, w, 2.5, done))  # the buffer pickles as its handle
        p.start()
        procs.append(p)
    while len(buf) == 0:
        time.sleep(0.001)
    sampled = bad = 0
    while any(p.is_alive() for p in procs):
        batch = buf.sample(32)
        bad += torn(batch).size
        sampled += len(batch)
    pushed = [done.get(timeout=30) for _ in procs]
    for p in procs:
        p.join(10)
        assert p.exitcode == 0
    assert bad == 0, f"{bad} torn rows among {sampled} sampled"
    assert sampled > 1000 and min(pushed) > 100
    # nothing lost: every row the ring holds now is committed and intact
    assert buf.stats["inserted"] == sum(pushed) and len(buf) == 64
    rows = buf.get(slice(None))
    assert torn(rows).size == 0
    assert np.array_equal(rows.index, np.arange(sum(pushed) - 64, sum(pushed)))


def _kill_at_third_field(field: str, seen: list[str] = []) -> None:  # noqa: B006 (counts across calls)
    seen.append(field)
    if len(seen) == 3:
        os.kill(os.getpid(), signal.SIGKILL)


def _die_mid_push(handle: sb.BufferHandle) -> None:
    """A writer SIGKILLed midway through its copy (two fields written, the third not)."""
    buf = sb.ReplayBuffer.attach(handle)
    copy_through(buf, _kill_at_third_field)
    buf.push(transition(1000, 4))


def _die_holding_lock(handle: sb.BufferHandle) -> None:
    buf = sb.ReplayBuffer.attach(handle)
    buf.ring.lock.acquire()
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.parametrize("method", START_METHODS)
def test_writer_killed_mid_push(method: str, make: Make, name: str, procs: list) -> None:
    ctx = mp.get_context(method)
    buf = make(MUJOCO, capacity=16, name=name)
    buf.push(transition(0, 4))
    p = ctx.Process(target=_die_mid_push, args=(buf.handle,))
    p.start()
    procs.append(p)
    deadline = time.monotonic() + 30
    while p.exitcode is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert p.exitcode == -signal.SIGKILL
    assert len(buf) == 8  # 4 committed rows and the dead writer's 4 reserved ones
    # its rows 4..7 were half written: never sampled, never read
    for _ in range(50):
        assert set(seq_of(buf.sample(64))) <= {0, 1, 2, 3}
    buf.reap()  # if sample() has not yet
    assert buf.stats["reclaimed"] == 4
    assert len(buf) == 4  # reaped: holes, which len and get's positions leave out
    with pytest.raises(sb.EmptyBufferError, match="lost: its writer died mid-push"):
        buf.take([5])
    # the lock is free and the other writers go on, over the dead rows and round the ring
    buf.ring.lock.acquire(timeout=1)
    buf.ring.lock.release()
    buf.push(transition(100, 16))
    assert seq_of(buf.get(slice(None))).tolist() == list(range(100, 116))


def test_dead_writers_rows_are_reclaimed_by_lapping(make: Make, name: str, procs: list) -> None:
    """Without anyone reaping, a reservation that comes round to a dead writer's rows takes them."""
    ctx = mp.get_context("spawn")
    buf = make(MUJOCO, capacity=8, name=name)
    p = ctx.Process(target=_die_mid_push, args=(buf.handle,))
    p.start()
    procs.append(p)
    p.join(30)
    assert p.exitcode == -signal.SIGKILL
    buf.push(transition(0, 8))
    assert buf.stats["reclaimed"] == 4
    assert seq_of(buf.get(slice(None))).tolist() == list(range(8))


def test_writer_killed_holding_the_lock(make: Make, name: str, procs: list) -> None:
    ctx = mp.get_context("spawn")
    buf = make(MUJOCO, capacity=16, name=name)
    p = ctx.Process(target=_die_holding_lock, args=(buf.handle,))
    p.start()
    procs.append(p)
    p.join(30)
    assert p.exitcode == -signal.SIGKILL
    start = time.monotonic()
    buf.push(transition(0, 3))  # would hang forever with a multiprocessing.Lock
    assert time.monotonic() - start < 5
    assert buf.stats["lock_recoveries"] == 1 and len(buf) == 3


def _mujoco_writer(buf: sb.ReplayBuffer, writer: int) -> None:
    i = 0
    while True:
        buf.push(transition((writer * 2**16 + i) % 2**23, 8))  # float32 holds integers < 2**24 exactly
        i += 8


@pytest.mark.slow
def test_random_kills_under_load(make: Make, name: str, procs: list) -> None:
    """Writers SIGKILLed at random moments while others push and the learner samples."""
    ctx = mp.get_context("fork" if "fork" in START_METHODS else "spawn")
    buf = make(MUJOCO, capacity=256, name=name)
    rng = np.random.default_rng(0)
    steady = ctx.Process(target=_mujoco_writer, args=(buf, 1))
    steady.start()
    procs.append(steady)
    kills = 0
    end = time.monotonic() + 3
    while time.monotonic() < end:
        victim = ctx.Process(target=_mujoco_writer, args=(buf, 2 + kills))
        victim.start()
        procs.append(victim)
        stop_at = time.monotonic() + rng.uniform(0.05, 0.3)
        while time.monotonic() < stop_at:
            if len(buf):
                seq_of(buf.sample(64))  # checks every value of every row
        victim.kill()
        kills += 1
    for _ in range(100):
        seq_of(buf.sample(64))
    steady.kill()
    steady.join()
    assert kills >= 5 and buf.stats["inserted"] > 1000


def test_a_zombie_counts_as_dead() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        started = psutil.Process(proc.pid).create_time()
        assert segment.process_alive(proc.pid, started)
        assert not segment.process_alive(proc.pid, started + 5)  # same pid, another process
        proc.kill()
        deadline = time.monotonic() + 10
        while psutil.Process(proc.pid).status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not segment.process_alive(proc.pid, started)  # not yet reaped: a zombie
    finally:
        proc.kill()
        proc.wait()


# -- handles crossing process boundaries -----------------------------------------------------


def _push_from(handle: sb.BufferHandle, start: int) -> int:
    with sb.ReplayBuffer.attach(handle) as buf:
        buf.push(transition(start, 10))
        return len(buf)


def _consume(queue: Any, results: Any) -> None:
    handle = queue.get()
    results.put(_push_from(handle, 500))


def test_handle_crosses_queue(make: Make, name: str, procs: list) -> None:
    ctx = mp.get_context("spawn")
    buf = make(MUJOCO, capacity=100, name=name)
    queue, results = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_consume, args=(queue, results))
    p.start()
    procs.append(p)
    queue.put(buf.handle)
    assert results.get(timeout=60) == 10
    p.join(30)
    assert sorted(seq_of(buf.get(slice(None)))) == list(range(500, 510))


@pytest.mark.parametrize("method", START_METHODS)
def test_handle_crosses_pool(method: str, make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=100, name=name)
    with mp.get_context(method).Pool(2) as pool:
        pool.starmap(_push_from, [(buf.handle, 0), (buf.handle, 10), (buf.handle, 20)])
    assert sorted(seq_of(buf.get(slice(None)))) == list(range(30))


def test_handle_crosses_multiprocess_workers(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=100, name=name)
    with multiprocess.get_context("spawn").Pool(2) as pool:
        pool.starmap(_push_from, [(buf.handle, 0), (buf.handle, 10)])
    with multiprocess.get_context("spawn").Pool(1) as pool:
        pool.map(lambda h: _push_from(h, 20), [buf.handle])  # dill: lambdas cross too
    assert sorted(seq_of(buf.get(slice(None)))) == list(range(30))


# -- cleanup: a watchdog of our own (_tracker.py), no resource tracker ----------------------------


def run_python(code: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONWARNINGS": "error"}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=os.path.dirname(os.path.dirname(__file__)))


def test_unrelated_attacher_leaves_no_trace(make: Make, name: str) -> None:
    """A process that is no child of the creator attaches, pushes and exits, with and without
    close(): no resource_tracker warning, and the segment is still there afterwards."""
    buf = make(MUJOCO, capacity=100, name=name)
    for close in ("buf.close()", "pass"):
        out = run_python(f"""
            import shmbuffer as sb, numpy as np
            from tests.conftest import transition
            buf = sb.ReplayBuffer.attach({name!r})
            buf.push(transition(0, 5))
            {close}
        """)
        assert out.returncode == 0 and out.stderr == "", out.stderr
        assert os.path.exists(segment.path_of(name))
    assert len(buf) == 10


def test_multiprocess_children_leave_no_trace(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=100, name=name)
    out = run_python(f"""
        import multiprocess
        def push(i):
            import shmbuffer as sb  # dill sends this function by value, without __main__'s globals
            from tests.conftest import transition
            b = sb.ReplayBuffer.attach({name!r})
            b.push(transition(i, 1))
            return len(b)
        if __name__ == "__main__":
            for method in ("spawn", "fork", "forkserver"):
                with multiprocess.get_context(method).Pool(2) as pool:
                    pool.map(push, range(3))
    """)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert len(buf) == 9 and os.path.exists(segment.path_of(name))


def test_creator_exit_removes_the_segment(name: str) -> None:
    out = run_python(f"""
        import shmbuffer as sb
        from tests.conftest import MUJOCO, transition
        buf = sb.ReplayBuffer(MUJOCO, 100, name={name!r})
        buf.push(transition(0, 5))
        view = buf.column("obs")  # still alive at exit: close() cannot unmap, unlink still happens
    """)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert not os.path.exists(segment.path_of(name))


def test_sigkilled_creator_is_cleaned_by_its_tracker(name: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time, shmbuffer as sb
            from tests.conftest import MUJOCO
            buf = sb.ReplayBuffer(MUJOCO, 100, name={name!r})
            print("ready", flush=True)
            time.sleep(60)
        """)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=os.path.dirname(os.path.dirname(__file__)),
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        header = segment.read_header(name)
        assert header.creator_pid == proc.pid and header.creator_alive
        proc.kill()
        proc.wait(10)
        assert not header.creator_alive
        deadline = time.monotonic() + 20
        while os.path.exists(segment.path_of(name)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(segment.path_of(name))
    finally:
        proc.kill()
        proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()
        if proc.stdout is not None:
            proc.stdout.close()
        if os.path.exists(segment.path_of(name)):
            os.unlink(segment.path_of(name))


def wait_gone(path: str, seconds: float = 10) -> bool:
    deadline = time.monotonic() + seconds
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not os.path.exists(path)


def _create_and_wait(name: str, ready: Any) -> None:
    buf = sb.ReplayBuffer(MUJOCO, 100, name=name)
    ready.set()
    time.sleep(60)
    buf.close()


@pytest.mark.parametrize("lib", ["multiprocessing", "multiprocess"])
@pytest.mark.parametrize("method", START_METHODS)
def test_a_sigkilled_child_creator_is_cleaned_by_its_watchdog(lib: str, method: str, name: str, procs: list) -> None:
    """A creator that is a spawned, forked or forkserver child (of multiprocessing or multiprocess)
    has a watchdog of its own, which removes its block when it is killed."""
    ctx = (mp if lib == "multiprocessing" else multiprocess).get_context(method)
    ready = ctx.Event()
    p = ctx.Process(target=_create_and_wait, args=(name, ready))
    procs.append(p)
    p.start()
    assert ready.wait(60)
    assert segment.read_header(name).creator_pid == p.pid
    p.kill()
    p.join(10)
    assert wait_gone(segment.path_of(name)), "the killed creator's watchdog should have removed its block"


FORKING = """
    import os, time
    import shmbuffer as sb
    from shmbuffer.shm import _tracker
    from tests.conftest import MUJOCO
    buf = sb.ReplayBuffer(MUJOCO, 100, name={name!r})
    # a child forked past Python's at-fork hooks (by C code) keeps the watchdog's pipe open
    kept = os.dup(_tracker._watch[2]) if {past_hooks} else None
    child = os.fork()
    if child == 0:
        time.sleep(60)
        os._exit(0)
    print(child, flush=True)
    time.sleep(60)
"""


@pytest.mark.parametrize("past_hooks", [False, True])
def test_a_forked_child_does_not_keep_the_block_after_its_creator_died(past_hooks: bool, name: str) -> None:
    """The creator forks a child that outlives it. The child closes its copy of the watchdog's pipe
    (an at-fork hook); one that still holds it cannot keep the watchdog waiting either, since the
    watchdog also sees that its parent, the creator, is gone."""
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(FORKING.format(name=name, past_hooks=past_hooks))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(os.path.dirname(__file__)))
    child = None
    try:
        assert proc.stdout is not None
        child = int(proc.stdout.readline())
        assert os.path.exists(segment.path_of(name))
        proc.kill()
        proc.wait(10)
        assert running(child)
        assert wait_gone(segment.path_of(name)), "the creator's watchdog should have removed its block"
        os.kill(child, signal.SIGKILL)  # it holds the stderr pipe open too
        assert proc.stderr is not None and proc.stderr.read() == ""
    finally:
        proc.kill()
        proc.wait()
        if child is not None and running(child):
            os.kill(child, signal.SIGKILL)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
        if os.path.exists(segment.path_of(name)):
            os.unlink(segment.path_of(name))


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_the_watchdog_leaves_with_its_creator(name: str) -> None:
    """It is started by the first create, and ends when its creator ends."""
    out = run_python(f"""
        import shmbuffer as sb
        from shmbuffer.shm import _tracker
        from tests.conftest import MUJOCO
        assert _tracker.watchdog_pid() is None
        buf = sb.ReplayBuffer(MUJOCO, 100, name={name!r})
        other = sb.ReplayBuffer.attach({name!r})
        other.close()
        print(_tracker.watchdog_pid())
    """)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    watchdog = int(out.stdout)
    deadline = time.monotonic() + 10
    while running(watchdog) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running(watchdog), "the watchdog outlived its creator by 10 s"
    assert not os.path.exists(segment.path_of(name))


def test_one_process_keeps_its_writer_entry_while_any_of_its_buffers_is_open(make: Make, name: str) -> None:
    """The creator and an attach in the same process share a writer entry: closing one must not
    free it, or another process would take the other's rows being written for a dead writer's."""
    buf = make(MUJOCO, capacity=16, name=name)
    buf.push(transition(0, 2))
    helper = sb.ReplayBuffer.attach(buf.handle)
    helper.push(transition(2, 2))
    assert helper.ring._wid == buf.ring._wid
    helper.close()
    w = buf.ring._wid
    assert buf.ring._wpid[w] == os.getpid()  # still registered: its rows are not anybody's to take
    res = buf.ring.reserve(2)
    try:
        assert buf.ring.owner[buf.ring.slots(res.ids)].tolist() == [w, w]
        assert not buf.ring.reap().size  # a live writer's rows are not reaped
    finally:
        buf.ring.abandon(res)


def test_an_interrupted_push_gives_its_rows_back(make: Make, name: str) -> None:
    """Ctrl-C after the copy but before the commit: the rows must not stay odd under a live owner
    (every writer coming round would wait 30 s on them); they were copied whole, so they are
    committed (never a hole)."""
    buf = make(MUJOCO, capacity=8, name=name, sampler=sb.Prioritized())
    buf.push(transition(0, 4))
    real = buf.ring.commit

    def interrupted(res: Any) -> None:
        raise KeyboardInterrupt

    buf.ring.commit = interrupted  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        buf.push(transition(4, 2))
    buf.ring.commit = real  # type: ignore[method-assign]
    assert not (buf.ring.stamp & 1).any()
    assert buf.priorities.tree.leaves[4:6].tolist() == buf.priorities.tree.leaves[:2].tolist()  # type: ignore[union-attr]
    assert set(seq_of(buf.sample(100))) == {0, 1, 2, 3, 4, 5} and seq_of(buf.get(slice(None))).tolist() == list(range(6))
    buf.ring.stall_timeout = 1.0
    start = time.monotonic()
    buf.push(transition(10, 8))  # laps over them at once
    assert time.monotonic() - start < 0.5
    assert seq_of(buf.get(slice(None))).tolist() == list(range(10, 18))
