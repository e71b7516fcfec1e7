"""The copy threads of big gathers (``shmbuffer/native/pool.c``): a gather or a read of frame stacks
big enough to use them gives the same bytes and the same intact marks with one thread and with
several, rows not intact and ids that name no row included; the threads start at the first big
gather only (never for small ones) and not at all with ``set_threads(1)`` or
``SHMBUFFER_THREADS=1``; a forked child gathers big batches on threads of its own; big samples on
two threads while a writer laps the ring are never torn."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

import shmbuffer as sb
from shmbuffer import frames, native
from shmbuffer.protocol import ring

Make = Callable[..., sb.ReplayBuffer]
LIB = native.lib
pytestmark = pytest.mark.skipif(LIB is None, reason=f"the C extension is not loaded: {native.REASON}")

CAP, LANES = 64, 2
LC = CAP // LANES
WIDE = 64 * 1024
"""Rows of 64 KiB: 200 of them are 12.5 MiB, well past the pool's threshold (POOL_BYTES, 4 MiB)."""


@pytest.fixture(autouse=True)
def restore_threads() -> Iterator[None]:
    """Every test leaves no pool thread behind (a later test that forks would get Python 3.12's
    warning about forking with threads) and the count as the environment set it."""
    yield
    if LIB is not None:
        LIB.set_threads(1)
        LIB.set_threads(native.THREADS or 0)


def threads(k: int) -> None:
    """Use k threads for big gathers, or skip where the process may not use that many CPUs."""
    assert LIB is not None
    if LIB.set_threads(k) != k:
        pytest.skip(f"this process may use fewer than {k} CPUs")


def slot(i: int) -> int:
    """rows.slot_of_id for CAP slots in LANES lanes (ids >= 0)."""
    return (i % LANES) * LC + (i // LANES) % LC


def ring_of(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Stamps of a full ring whose slots hold rows of random laps, and the ids of those rows."""
    stamp = np.empty(CAP, np.int64)
    held = []
    for lane in range(LANES):
        for j in range(LC):
            n = j + LC * int(rng.integers(0, 4))
            stamp[lane * LC + j] = 2 * n + 2  # rows.committed(n)
            held.append(n * LANES + lane)
    return stamp, np.array(held, np.int64)


def gather(k: int, ids: np.ndarray, stamp: np.ndarray, sources: tuple[np.ndarray, ...]) -> tuple[int, list[np.ndarray], np.ndarray]:
    """``_native.gather`` with k threads, into outs filled with a byte no row holds."""
    assert LIB is not None
    threads(k)
    outs = [np.full((ids.size, s.shape[1]), 0xEE, np.uint8) for s in sources]
    ok = np.zeros(ids.size, np.bool_)
    lowest = LIB.gather(ids, LANES, stamp, sources, tuple(outs), ok)
    return lowest, outs, ok


@pytest.mark.parametrize("n", [200, 257, 1000])
def test_a_big_gather_is_the_same_on_one_thread_and_on_several(n: int) -> None:
    """Intact rows, rows being written (odd stamps), overwritten rows (stamps of another lap),
    INVALID and ids that name no row: the same bytes, ok marks and smallest id with 1, 2 and 4
    threads, and the bytes of every id's slot (the copies all finished before the gather returns)."""
    rng = np.random.default_rng(n)
    stamp, held = ring_of(rng)
    odd = rng.choice(held, 6, replace=False)
    for i in odd:
        stamp[slot(int(i))] -= 1  # rows.writing: being written again
    stale = rng.choice(np.setdiff1d(held, odd), 6, replace=False) - CAP  # the lap before: overwritten
    weird = np.array([ring.INVALID, 2**62, -(2**63), 2**63 - 1, -5], np.int64)
    ids = np.concatenate([rng.choice(held, n - 17), odd[:3], stale, weird, held[:3]])
    rng.shuffle(ids)
    # a wide column (pages prefetched ahead), an 8-byte one and an odd width
    sources = tuple(rng.integers(0, 0xEE, (CAP, w), dtype=np.uint8) for w in (WIDE, 8, 100))
    want_ok = np.isin(ids, np.setdiff1d(held, odd))
    lowest, outs, ok = gather(1, ids, stamp, sources)
    assert np.array_equal(ok, want_ok)
    assert lowest == ids.min()
    fine = ids >= 0
    slots = np.array([slot(int(i)) for i in ids[fine]])
    for src, out in zip(sources, outs, strict=True):
        assert np.array_equal(out[fine], src[slots])
    for k in (2, 4):
        if LIB is not None and LIB.set_threads(k) != k:
            continue
        for _ in range(5):  # a join that does not wait for every copy shows as rows not yet written
            got_lowest, got, got_ok = gather(k, ids, stamp, sources)
            assert got_lowest == lowest
            assert np.array_equal(got_ok, ok)
            for a, b in zip(outs, got, strict=True):
                assert np.array_equal(a, b)  # every row, those not intact and the weird ids' too


def test_a_sample_of_wide_rows_is_the_same_on_one_thread_and_on_two(make: Make, name: str) -> None:
    """A buffer of 64 KiB rows, the same ids gathered by the reader with 1 and 2 threads; rows
    being written read as not intact either way."""
    from shmbuffer.protocol.gather import gather as read

    schema = sb.Schema(obs=((WIDE,), "uint8"), step=((), "int64"))
    buf = make(schema, capacity=48, lanes=2, name=name)
    rng = np.random.default_rng(1)
    for i in range(30):
        k = int(rng.integers(1, 4))
        buf.push(obs=rng.integers(0, 255, (k, WIDE), dtype=np.uint8), step=np.arange(k) + 10 * i, lane=i % 2)
    res = buf.ring.reserve(2, 0)
    try:
        held = np.setdiff1d(buf.ring.held_ids(), res.ids)
        ids = np.concatenate([rng.choice(held, 300), res.ids, [ring.INVALID]])
        threads(1)
        a = read(buf.block, buf.ring, ids.copy())
        threads(2)
        b = read(buf.block, buf.ring, ids.copy())
        assert a.ok[:300].all() and not a.ok[300:].any()
        assert np.array_equal(a.ok, b.ok)
        assert np.array_equal(a.large["obs"][a.ok], b.large["obs"][b.ok])
        assert np.array_equal(a.large["obs"][a.ok], buf.block.large["obs"][buf.ring.slots(ids[a.ok])])
    finally:
        buf.ring.commit(res)


def _lapper(handle: sb.BufferHandle, seconds: float) -> None:
    """Push wide rows, every byte of a row its step mod 251, as fast as it can: the ring laps."""
    buf = sb.ReplayBuffer.attach(handle)
    step, stop = 0, time.monotonic() + seconds
    while time.monotonic() < stop:
        steps = np.arange(step, step + 4)
        buf.push(obs=np.repeat((steps % 251).astype(np.uint8)[:, None], WIDE, axis=1), step=steps)
        step += 4
    buf.close()


def test_big_samples_on_two_threads_while_a_writer_laps_the_ring(make: Make, name: str, procs: list) -> None:
    """A writer overwrites rows as fast as it can while big samples (96 rows of 64 KiB, 6 MiB)
    copy on two threads: every row sampled is whole (each byte its step's), none torn."""
    threads(2)
    buf = make(sb.Schema(obs=((WIDE,), "uint8"), step=((), "int64")), capacity=160, name=name)
    p = mp.get_context("spawn").Process(target=_lapper, args=(buf.handle, 4.0))
    p.start()
    procs.append(p)
    deadline = time.monotonic() + 60
    while len(buf) < 160 and time.monotonic() < deadline:
        time.sleep(0.01)
    checked = 0
    while p.is_alive():
        batch = buf.sample(96)
        want = (batch.step % 251).astype(np.uint8)
        assert (batch.obs == want[:, None]).all(), "a torn row"
        checked += 96
    p.join(30)
    assert p.exitcode == 0 and checked > 96 * 20


FRAME = (84, 84)
BIG_FRAMED = sb.Schema(obs=((4, *FRAME), "uint8"), action=((), "int64"), next_obs=((4, *FRAME), "uint8"),
                       done=((), "bool"))
"""Stacks of 4 Atari-sized frames (7,056 bytes): 256 transitions' two stacks are 14 MiB."""


def framed_episode(lane: int, ep: int, length: int) -> dict[str, np.ndarray]:
    """One episode as a frame-stacking wrapper gives it (padding: copies of the first frame)."""
    fr = [np.full((1, *FRAME), (lane * 50 + ep * 7 + t) % 250 + 1, np.uint8) for t in range(length + 1)]
    history = [fr[0]] * 4
    obs, nxt = [], []
    for t in range(length):
        obs.append(np.concatenate(history[-4:]))
        history.append(fr[t + 1])
        nxt.append(np.concatenate(history[-4:]))
    return dict(obs=np.stack(obs), action=np.arange(length), next_obs=np.stack(nxt), done=np.arange(length) == length - 1)


def test_frame_stacks_are_the_same_on_one_thread_and_on_two(make: Make, name: str) -> None:
    """``_native.stacks`` of 256 transitions (two stacks of 4 frames each) against
    ``frames.stack_plan``, with 1 and 2 threads: the same transitions refused (by the plan and, with
    rows being written among the frames, by the stamp checks) and the same bytes."""
    assert LIB is not None
    buf = make(BIG_FRAMED, capacity=64, lanes=2, next_of="obs", stack="obs", name=name)
    for ep in range(8):
        buf.push(framed_episode(ep % 2, ep, 9), lane=ep % 2)
    col = buf.block.large["obs"]
    rng = np.random.default_rng(0)
    m, k, width = 256, 4, 6
    lasts = (4, 5)
    win = rng.choice(buf.ring.held_ids(), (m, width))
    ok = rng.random((m, width)) < 0.95
    kind = (rng.integers(0, 8, (m, width)) * (rng.random((m, width)) < 0.2)).astype(np.uint8)
    valid = rng.random(m) < 0.95

    def stacks(t: int) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
        assert LIB is not None
        threads(t)
        outs = tuple(np.full((m, k, *col.shape[1:]), 255, np.uint8) for _ in lasts)
        got = valid.copy()
        LIB.stacks(win, ok, kind, 2, buf.block.stamp, col, k, lasts, outs, got)
        return got, outs

    want = valid.copy()
    refs = []
    for last in lasts:
        cols, zero, fine = frames.stack_plan(ok, kind, last, k)
        want &= fine
        ref = col[buf.ring.slots(win[np.arange(m)[:, None], cols])]
        ref[zero] = 0
        refs.append(ref)
    for t in (1, 2):
        got, outs = stacks(t)
        assert np.array_equal(got, want)
        for out, ref in zip(outs, refs, strict=True):
            assert np.array_equal(out[want], ref[want])
    # rows being written: their frames fail the stamp check, the same transitions on 1 and 2 threads
    res = buf.ring.reserve(3, 0)
    try:
        win[rng.integers(0, m, 40), rng.integers(0, width, 40)] = rng.choice(res.ids, 40)
        got1, outs1 = stacks(1)
        got2, outs2 = stacks(2)
        assert np.array_equal(got1, got2)
        for a, b in zip(outs1, outs2, strict=True):
            assert np.array_equal(a[got1], b[got2])
        plan = valid.copy()
        for last in lasts:
            plan &= frames.stack_plan(ok, kind, last, k)[2]
        assert (plan & ~got1).any() and not (got1 & ~plan).any()  # some refused by the stamps alone
    finally:
        buf.ring.commit(res)


SCRIPT = textwrap.dedent("""
    import os, sys
    import numpy as np
    from shmbuffer.native import lib

    def tasks():
        # a joined thread's task can linger in /proc for a moment after its join returned: a count
        # is taken once it has held still for 20 ms (2 s at most)
        import time
        n, until = len(os.listdir("/proc/self/task")), time.monotonic() + 2
        while time.monotonic() < until:
            time.sleep(0.02)
            again = len(os.listdir("/proc/self/task"))
            if again == n:
                break
            n = again
        return n

    cap, n = 64, 200
    stamp = np.arange(cap, dtype=np.int64) * 2 + 2
    ids = np.random.default_rng(0).integers(0, cap, n).astype(np.int64)
    src = np.random.default_rng(1).integers(0, 255, (cap, 64 * 1024), dtype=np.uint8)
    small = np.random.default_rng(2).integers(0, 255, (cap, 168), dtype=np.uint8)

    def gather(source):
        out = np.zeros((n, source.shape[1]), np.uint8)
        ok = np.zeros(n, np.bool_)
        lib.gather(ids, 1, stamp, (source,), (out,), ok)
        assert ok.all() and np.array_equal(out, source[ids]), "wrong rows"
""")


def run(code: str, env: dict[str, str] | None = None) -> str:
    """The script above, then code, in a fresh interpreter (a pool of its own); its stdout."""
    proc = subprocess.run([sys.executable, "-c", SCRIPT + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs /proc/self/task")
def test_threads_start_at_the_first_big_gather_only() -> None:
    """No thread for small gathers, nor with set_threads(1) or SHMBUFFER_THREADS=1; one worker
    (two threads in all) at the first big gather with two, and no more after many; set_threads(1)
    ends it, and the next big gather with two starts one again."""
    if LIB is None or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs")
    out = run("""
        lib.set_threads(2)
        before = tasks()
        for _ in range(20):
            gather(small)  # 256 x 168 bytes: under the threshold
        print(tasks() - before)
        for _ in range(20):
            gather(src)
        print(tasks() - before)
        lib.set_threads(1)  # ends the worker
        print(tasks() - before)
        gather(src)
        print(tasks() - before)
        lib.set_threads(2)
        print(tasks() - before)  # started by the next big gather only
        gather(src)
        print(tasks() - before)
    """, {"SHMBUFFER_THREADS": ""})
    assert out.split() == ["0", "1", "0", "0", "0", "1"]
    out = run("""
        before = tasks()
        gather(src)
        print(lib.threads(), tasks() - before)
    """, {"SHMBUFFER_THREADS": "1"})
    assert out.split() == ["1", "0"]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_gathers_big_batches() -> None:
    """A child forked after the parent's pool started (and one forked while another thread of
    the parent gathers) has no pool threads: it starts its own and gathers the right rows; the
    parent's pool still works after. A deadlock fails the test by its timeout."""
    out = run("""
        import threading
        lib.set_threads(2)
        gather(src)  # the parent's pool
        for rounds in range(3):
            stop = threading.Event()
            def busy():
                while not stop.is_set():
                    gather(src)
            t = threading.Thread(target=busy)
            t.start()
            pid = os.fork()
            if pid == 0:
                try:
                    for _ in range(10):
                        gather(src)
                    code = 0
                except BaseException:
                    code = 1
                os._exit(code)
            _, status = os.waitpid(pid, 0)
            stop.set()
            t.join()
            assert os.waitstatus_to_exitcode(status) == 0, status
        gather(src)
        print("ok")
    """, {"SHMBUFFER_THREADS": ""})
    assert out.split() == ["ok"]


@pytest.mark.skipif(not hasattr(os, "fork") or not os.path.isdir("/proc/self/task"), reason="needs fork and /proc")
def test_a_fork_ends_the_copy_threads_first() -> None:
    """The workers are joined before os.fork(): the parent forks with no thread of ours (Python
    3.12 warns about forking a process with threads, counting every one), and the next big gather
    starts them again."""
    if LIB is None or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs")
    out = run("""
        import warnings
        warnings.simplefilter("error")  # Python 3.12's DeprecationWarning about threads, raised
        lib.set_threads(2)

        def ours():  # the pool's workers, by name (numpy's BLAS has threads of its own)
            names = []
            for tid in os.listdir("/proc/self/task"):
                try:
                    with open(f"/proc/self/task/{tid}/comm") as f:
                        names.append(f.read().strip())
                except FileNotFoundError:
                    pass
            return names.count("shmbuffer-copy")

        gather(src)
        print(ours())
        pid = os.fork()
        if pid == 0:
            gather(src)
            os._exit(0)
        print(ours())  # joined before the fork
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
        gather(src)
        print(ours())
    """, {"SHMBUFFER_THREADS": ""})
    assert out.split() == ["1", "0", "1"]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_worker_that_cannot_be_created_leaves_the_pool_usable() -> None:
    """pthread_create fails (no address space for a thread stack) at the first big gather: the
    gather copies alone, and then set_threads, the next big gather and os.fork() still return."""
    if LIB is None or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs")
    code = textwrap.dedent("""
        import os, resource, numpy as np
        from shmbuffer.native import lib
        lib.set_threads(2)
        cap, n = 64, 200
        stamp = np.arange(cap, dtype=np.int64) * 2 + 2
        ids = np.random.default_rng(0).integers(0, cap, n).astype(np.int64)
        src = np.random.default_rng(1).integers(0, 255, (cap, 64 * 1024), dtype=np.uint8)
        out = np.zeros((n, src.shape[1]), np.uint8); ok = np.zeros(n, np.bool_)
        vm = [int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmSize")][0]
        resource.setrlimit(resource.RLIMIT_AS, (vm + 4 * 2**20, resource.RLIM_INFINITY))
        lib.gather(ids, 1, stamp, (src,), (out,), ok)
        resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        assert ok.all() and np.array_equal(out, src[ids])
        lib.set_threads(1); lib.set_threads(2)
        lib.gather(ids, 1, stamp, (src,), (out,), ok)
        pid = os.fork()
        if pid == 0: os._exit(0)
        os.waitpid(pid, 0)
        print("ok")
    """)
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail("deadlock: pool_run left `mu` locked when grow() created no worker")
    assert proc.returncode == 0 and proc.stdout.split() == ["ok"], proc.stderr


@pytest.mark.parametrize("value", [str(2**70), "-1", "two"])
def test_a_bad_threads_setting_is_ignored_with_a_warning(value: str) -> None:
    """``SHMBUFFER_THREADS`` out of range or not a number: ``import shmbuffer`` works, says why
    on the log, and the copy threads stay automatic."""
    proc = subprocess.run([sys.executable, "-c", "import logging; logging.basicConfig(); import shmbuffer.native as n; "
                           "print(n.THREADS)"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "SHMBUFFER_THREADS": value})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["None"]
    if LIB is not None:
        assert f"SHMBUFFER_THREADS={value!r} ignored" in proc.stderr
