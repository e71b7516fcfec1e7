"""The one-call sample (``draw_gather.DrawGather``, ``native/sample.c``) against the Python path it stands
in for (``reader.draw``): the same rows for the same ids, the same distribution (chi-square tests
against the expected counts and against the Python path's counts), the same weights, the same
refusals; and what only it has: its generator, its plan's life, ``out=``."""

from __future__ import annotations

import math
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import shmbuffer as sb
from shmbuffer import native
from shmbuffer.errors import ClosedError
from shmbuffer.protocol import reader
from shmbuffer.protocol.draw_gather import MAX_COLUMNS, DrawGather, sample_for_another
from shmbuffer.sampling.samplers import importance_weights
from shmbuffer.schema import PACK_LIMIT

from .conftest import MUJOCO, seq_of, transition

Make = Callable[..., sb.ReplayBuffer]

pytestmark = pytest.mark.skipif(native.lib is None, reason="the one-call sample is the C extension's")


def p_value(chi2: float, dof: int) -> float:
    """The upper tail of a chi-square of ``dof`` degrees of freedom (Wilson-Hilferty)."""
    z = ((chi2 / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def counts(buf: sb.ReplayBuffer, ids: np.ndarray, draws: int, n: int = 256) -> np.ndarray:
    """How often each of ``ids`` was drawn in ``draws`` samples of ``n`` (every drawn id is one of them)."""
    where = {int(i): k for k, i in enumerate(ids)}
    seen = np.zeros(ids.size, np.int64)
    for _ in range(draws):
        b = buf.sample(n)
        np.add.at(seen, [where[int(i)] for i in b.index], 1)
    return seen


def uniform_on_both_paths(buf: sb.ReplayBuffer, ids: np.ndarray, draws: int) -> None:
    """Every one of ``ids`` equally likely (and no other drawn) in ``draws`` samples on the one
    call and on the Python path (a twin attached with another seed): chi-square against the
    uniform counts, and the two paths' counts against each other (homogeneity)."""
    served(buf)
    fast = counts(buf, ids, draws)
    twin = sb.ReplayBuffer.attach(buf.handle, seed=2)
    try:
        python_path(twin)
        slow = counts(twin, ids, draws)
    finally:
        twin.close()
    dof = ids.size - 1
    for seen in (fast, slow):
        expected = seen.sum() / ids.size
        assert p_value(float(((seen - expected) ** 2 / expected).sum()), dof) > 1e-4
    table = np.stack([fast, slow])
    exp = table.sum(0) * table.sum(1)[:, None] / table.sum()
    assert p_value(float(((table - exp) ** 2 / exp).sum()), dof) > 1e-4


def python_path(buf: sb.ReplayBuffer) -> None:
    """Make ``buf``'s samples take ``reader.draw`` (the reference)."""
    buf._paths.one_calls = False


def served(buf: sb.ReplayBuffer) -> DrawGather:
    buf.sample(1)
    one = buf._paths.one_call
    assert isinstance(one, DrawGather), "this buffer's samples should be one call"
    return one


# -- the same rows, the same distribution --------------------------------------------------------
@pytest.mark.parametrize("lanes", [1, 3])
def test_rows_are_the_rows_of_their_ids(lanes: int, make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=60, lanes=lanes, name=name, seed=0, episodes=True)
    for i in range(0, 150, 5):  # wraps; each lane keeps its newest rows
        buf.push(transition(i, 5), lane=(i // 5) % lanes, episode=i // 10)
    one = served(buf)
    for _ in range(20):
        batch = buf.sample(64)
        ref = buf.take(batch.index)  # the Python path's gather of the same ids
        assert np.array_equal(seq_of(batch), seq_of(ref))
        for f in MUJOCO.names:
            assert np.array_equal(batch[f], ref[f])
        assert np.array_equal(batch.episode, ref.episode)
        assert batch.block is not None and batch.block.shape == (64, buf.schema.record.itemsize)
    assert buf._paths.one_call is one


@pytest.mark.parametrize("lanes", [1, 4])
def test_uniform_draws_have_the_python_paths_distribution(lanes: int, make: Make, name: str) -> None:
    """Lanes of different sizes: every held row equally likely, on both paths (chi-square against
    the uniform counts, and the two paths' counts against each other)."""
    buf = make(MUJOCO, capacity=64, lanes=lanes, name=name, seed=1)
    for lane, k in enumerate([16, 5, 11, 2][:lanes] if lanes > 1 else [40]):
        buf.push(transition(100 * lane, k), lane=lane)
    uniform_on_both_paths(buf, buf.ring.held_ids(), 400)


def test_a_skewed_draw_fails_the_distribution_check() -> None:
    """The check above can fail: counts 10% off uniform over 40 rows do."""
    rng = np.random.default_rng(0)
    p = np.full(40, 1.0)
    p[:20] *= 1.2
    seen = rng.multinomial(102400, p / p.sum())
    expected = seen.sum() / 40
    assert p_value(float(((seen - expected) ** 2 / expected).sum()), 39) < 1e-4


def test_prioritized_draws_follow_the_priorities_with_their_weights(make: Make, name: str) -> None:
    alpha, beta = 0.7, 0.5
    buf = make(MUJOCO, capacity=32, lanes=2, name=name, seed=3, sampler=sb.Prioritized(alpha=alpha, beta=beta, eps=0.0))
    buf.push(transition(0, 12), lane=0)
    buf.push(transition(50, 8), lane=1)
    ids = buf.ring.held_ids()
    prio = 1.0 + (np.arange(ids.size) % 5)
    buf.update_priorities(ids, prio)
    mass = prio ** alpha
    served(buf)
    batch = buf.sample(64)
    low = mass.min()
    by_id = dict(zip(ids.tolist(), mass.tolist(), strict=True))
    want = importance_weights(np.array([by_id[i] for i in batch.index.tolist()]), low, beta)
    np.testing.assert_allclose(batch.weight, want, rtol=1e-6)
    seen = counts(buf, ids, 400)
    expected = seen.sum() * mass / mass.sum()
    assert p_value(float(((seen - expected) ** 2 / expected).sum()), ids.size - 1) > 1e-4
    # a stratified draw of n covers the mass evenly: a row of at least 2/n of it holds a whole segment
    b = buf.sample(4 * ids.size)
    heavy = set(ids[mass / mass.sum() >= 2 / (4 * ids.size)].tolist())
    assert heavy and set(b.index.tolist()) >= heavy


def test_a_prioritized_draw_skips_rows_of_priority_zero(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=16, name=name, seed=0, sampler=sb.Prioritized(alpha=1.0, eps=0.0))
    buf.push(transition(0, 10))
    ids = buf.ring.held_ids()
    buf.update_priorities(ids, np.where(ids % 2 == 0, 1.0, 0.0))
    served(buf)
    for _ in range(50):
        assert set(buf.sample(32).index.tolist()) <= set(ids[ids % 2 == 0].tolist())


# -- rows that are not there -----------------------------------------------------------------------
def test_rows_being_written_or_cleared_are_redrawn(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=32, name=name, seed=0)
    buf.push(transition(0, 20))
    served(buf)
    ring = buf.ring
    torn = ring.held_ids()[::3]
    slots = ring.slots(torn)
    before = ring.stamp[slots].copy()
    ring.stamp[slots] += 1  # odd: as if a writer were mid-copy of these rows
    try:
        for _ in range(30):
            batch = buf.sample(16)
            assert len(batch) == 16 and not set(batch.index.tolist()) & set(torn.tolist())
            seq_of(batch)
    finally:
        ring.stamp[slots] = before
    buf.clear()
    buf.push(transition(1000, 3))
    for _ in range(10):
        assert set(seq_of(buf.sample(8)).tolist()) <= {1000, 1001, 1002}


def test_an_empty_buffer_says_so_on_the_one_call_too(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=8, name=name, seed=0)
    buf.push(transition(0, 2))
    served(buf)
    buf.clear()
    with pytest.raises(sb.EmptyBufferError, match="empty"):
        buf.sample(4)
    pri = make(MUJOCO, capacity=8, name=name + "p", sampler=sb.Prioritized(eps=0.0))
    pri.push(transition(0, 2))
    served(pri)
    pri.update_priorities(pri.ring.held_ids(), np.zeros(2))
    with pytest.raises(sb.EmptyBufferError, match="priority 0"):
        pri.sample(4)


def test_every_row_torn_for_good_times_out_like_the_python_path(make: Make, name: str) -> None:
    """Rows that stay odd (a writer that hangs): the C rounds give up, the reader's loop waits and
    raises; nothing is returned half-written."""
    buf = make(MUJOCO, capacity=8, name=name, seed=0)
    buf.push(transition(0, 4))
    served(buf)
    slots = buf.ring.slots(buf.ring.held_ids())
    buf.ring.stamp[slots] += 1
    try:
        with pytest.raises(sb.WaitTimeout):
            buf.sample(2)
    finally:
        buf.ring.stamp[slots] -= 1


# -- the generator, the plan, out= ---------------------------------------------------------------
def test_a_seed_gives_the_same_batches_and_a_new_rng_is_followed(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=64, name=name, seed=11)
    buf.push(transition(0, 64))
    a = [buf.sample(8).index.copy() for _ in range(3)]
    twin = sb.ReplayBuffer.attach(buf.handle, seed=11)
    try:
        assert all(np.array_equal(x, twin.sample(8).index) for x in a)
        twin.rng = np.random.default_rng(11)  # a new generator: the stream starts again from it
        assert all(np.array_equal(x, twin.sample(8).index) for x in a)
    finally:
        twin.close()


def test_out_receives_the_rows_and_the_batch_views_it(make: Make, name: str) -> None:
    big = sb.Schema(obs=((4, 84, 84), "uint8"), reward=((), "float32"))
    buf = make(big, capacity=40, name=name, seed=0)
    obs = np.arange(40, dtype=np.uint8)[:, None, None, None] * np.ones((1, 4, 84, 84), np.uint8)
    buf.push(obs=obs, reward=np.arange(40, dtype=np.float32))
    served(buf)
    out = {"_block": np.empty((16, buf.schema.record.itemsize), np.uint8), "obs": np.empty((16, 4, 84, 84), np.uint8)}
    batch = buf.sample(16, out=out)
    assert np.shares_memory(batch.obs, out["obs"]) and np.shares_memory(batch.reward, out["_block"])
    assert np.array_equal(batch.obs[:, 0, 0, 0], batch.reward.astype(np.uint8))
    assert np.array_equal(batch.reward, batch.index.astype(np.float32))


def test_close_releases_the_plan_and_samples_say_closed(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=8, name=name, seed=0)
    buf.push(transition(0, 4))
    one = served(buf)
    buf.close()  # would raise BufferError while the plan held views of the block
    assert buf._paths.one_call is None
    with pytest.raises(ClosedError, match="closed"):
        buf.sample(2)
    assert native.lib.sample(one.plan, (np.empty((2, 168), np.uint8),), np.empty(2, np.int64), np.empty(2, bool), False) == -1


def test_big_samples_from_threads_while_another_thread_closes(make: Make, name: str) -> None:
    """Big gathers run without the GIL: a close meanwhile waits for none of them to crash."""
    big = sb.Schema(obs=((64, 64, 16), "uint8"))
    buf = make(big, capacity=64, name=name, seed=0)
    buf.push(obs=np.ones((64, 64, 64, 16), np.uint8))
    served(buf)
    errors: list[BaseException] = []
    go = threading.Event()

    def work() -> None:
        go.wait()
        for _ in range(200):
            try:
                assert buf.sample(32).obs.shape == (32, 64, 64, 16)
            except Exception as e:  # closed under it: the buffer's own error, nothing else
                if "closed" not in str(e):
                    errors.append(e)
                return

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    go.set()
    try:
        buf.close()
    except BufferError:  # a sample's arrays alive in a thread right now: close once they are gone
        for t in threads:
            t.join()
        buf.close()
    for t in threads:
        t.join()
    assert not errors


def test_a_next_of_buffer_samples_in_one_call(make: Make, name: str) -> None:
    frames = make(sb.Schema(obs=((2,), "float32"), next_obs=((2,), "float32"), done=((), "bool")), 8, name=name + "f",
                  next_of="obs")
    steps = np.arange(5, dtype=np.float32)[:, None] * np.ones(2, np.float32)
    frames.push(obs=steps[:-1], next_obs=steps[1:], done=np.zeros(4, bool))
    b = frames.sample(64)
    assert frames._paths.one_call is not None and frames._paths.one_calls
    assert set(b.index.tolist()) == {0, 1, 2}  # row 3 waits for its next observation
    assert np.array_equal(b.next_obs, b.obs + 1) and np.array_equal(b.obs[:, 0], b.index.astype(np.float32))


def test_a_forked_child_samples_through_its_own_plan(make: Make, name: str, procs: list) -> None:
    import multiprocessing as mp

    if "fork" not in mp.get_all_start_methods():
        pytest.skip("no fork here")
    buf = make(MUJOCO, capacity=32, name=name, seed=0)
    buf.push(transition(0, 32))
    served(buf)
    ctx = mp.get_context("fork")
    q: Any = ctx.Queue()

    def child() -> None:
        b = buf.sample(16)
        q.put(sorted(set(seq_of(b).tolist()) - set(range(32))))

    p = ctx.Process(target=child)
    procs.append(p)
    p.start()
    assert q.get(timeout=30) == []
    p.join(30)
    assert p.exitcode == 0


def test_float32_priorities_take_the_one_call_and_set_the_same_leaves(make: Make, name: str) -> None:
    """A learner's float32 TD errors: the one-call update, the leaves the float64 values give."""
    per = sb.Prioritized(alpha=0.6, eps=1e-3)
    a = make(MUJOCO, capacity=32, name=name, seed=0, sampler=per)
    b = make(MUJOCO, capacity=32, name=name + "b", seed=0, sampler=per)
    for buf in (a, b):
        buf.push(transition(0, 20))
    ids = a.ring.held_ids()
    p32 = (np.arange(ids.size, dtype=np.float32) + 0.5) / 3
    prios = a.priorities
    assert prios is not None and prios.try_update(a.ring, ids, p32) == ids.size  # the one call took it
    assert b.update_priorities(ids, p32.astype(np.float64)) == ids.size
    assert np.array_equal(prios.tree.sums, b.priorities.tree.sums)
    torch = pytest.importorskip("torch")
    assert a.update_priorities(ids, torch.from_numpy(p32 * 2)) == ids.size
    b.update_priorities(ids, (p32 * 2).astype(np.float64))
    assert np.array_equal(prios.tree.sums, b.priorities.tree.sums)


def test_a_thread_sampling_for_another_reads_whole_rows_while_rows_are_written(make: Make, name: str) -> None:
    """``sample_for_another``: the gather without the GIL, rows written meanwhile by this process."""
    buf = make(MUJOCO, capacity=64, name=name, seed=0)
    buf.push(transition(0, 64))
    served(buf)
    seen: list[np.ndarray] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def learner_side() -> None:
        sample_for_another()
        try:
            while not stop.is_set():
                seen.append(seq_of(buf.sample(32)))  # every value of every row checked
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)
        finally:
            sample_for_another(False)

    t = threading.Thread(target=learner_side)
    t.start()
    try:
        i, start = 64, len(seen)
        # until it read the rows' writes: 50 samples meanwhile, and the newest holds a row pushed
        # meanwhile (the 50 could all come before the pushes land)
        while (len(seen) - start < 50 or i < 64 * 4 or int(seen[-1].max()) < 64) and i < 64 * 100_000:
            buf.push(transition(i, 16))
            i += 16
    finally:
        stop.set()
        t.join(30)
    assert not errors and seen
    assert max(int(s.max()) for s in seen) >= 64  # it read rows pushed meanwhile


# -- max_use: each row returned counts a use, under the lock ------------------------------------------
@pytest.mark.parametrize("sampler", [sb.Uniform(), sb.Prioritized(alpha=0.5)])
def test_max_use_one_returns_every_row_once_then_says_so(sampler: Any, make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=64, lanes=2, name=name, seed=0, sampler=sampler, max_use=1)
    buf.push(transition(0, 32), lane=0)
    buf.push(transition(100, 32), lane=1)
    got = np.concatenate([seq_of(buf.sample(8)) for _ in range(8)])
    assert isinstance(buf._paths.one_call, DrawGather)
    assert sorted(got.tolist()) == list(range(32)) + list(range(100, 132))
    with pytest.raises(sb.EmptyBufferError, match="max_use=1"):
        buf.sample(1)


@pytest.mark.parametrize("one_call", [True, False])
@pytest.mark.parametrize("sampler", [sb.Uniform(), sb.Prioritized(alpha=0.5)])
def test_a_sample_that_raises_gives_back_the_uses_it_counted(one_call: bool, sampler: Any, make: Make,
                                                             name: str) -> None:
    """Asking for more rows than have uses left raises, and loses none of them: the rows the
    failed sample had counted can still be drawn, their priorities as they were."""
    buf = make(MUJOCO, capacity=16, name=name, seed=0, sampler=sampler, max_use=1)
    buf._paths.one_calls = one_call
    buf.push(transition(0, 10))
    ids = buf.ring.held_ids()
    if isinstance(sampler, sb.Prioritized):
        buf.update_priorities(ids, 1.0 + np.arange(10))
    leaves = buf.priority(ids)
    first = buf.sample(7)
    assert isinstance(buf._paths.one_call, DrawGather) == one_call
    left = np.setdiff1d(ids, first.index)
    assert left.size >= 3  # with repeats, 7 draws used up at most 7 rows
    with pytest.raises(sb.EmptyBufferError, match="max_use=1"):
        buf.sample(left.size + 1)
    assert not buf.uses(left).any()
    np.testing.assert_array_equal(buf.priority(left), leaves[np.isin(ids, left)])
    assert set(buf.sample(1).index.tolist()) <= set(left.tolist())


def test_max_use_counts_every_row_returned_and_no_other(make: Make, name: str, monkeypatch: Any) -> None:
    buf = make(MUJOCO, capacity=40, name=name, seed=1, sampler=sb.Prioritized(), max_use=3)
    buf.push(transition(0, 40))
    ids = buf.ring.held_ids()
    python_claims: list[int] = []
    real = reader.Uses.claim
    monkeypatch.setattr(reader.Uses, "claim", lambda *a: python_claims.append(1) or real(*a))
    returned: dict[int, int] = {}
    for _ in range(12):  # 120 draws of the 120 uses there are
        for i in buf.sample(10).index.tolist():
            returned[i] = returned.get(i, 0) + 1
    uses = dict(zip(ids.tolist(), buf.uses(ids).tolist(), strict=True))
    assert all(returned.get(i, 0) == uses[i] <= 3 for i in ids.tolist())
    assert sum(returned.values()) == 120 and isinstance(buf._paths.one_call, DrawGather)
    assert not python_claims  # the C call counted every use (the Python steps: test below)


def test_max_use_with_the_lock_busy_waits_for_it_and_loses_no_row(make: Make, name: str) -> None:
    """The C claim tries the lock once; held elsewhere, the Python steps wait for it: every row is
    still returned exactly once."""
    buf = make(MUJOCO, capacity=32, name=name, seed=0, max_use=1)
    buf.push(transition(0, 32))
    got: list[int] = seq_of(buf.sample(8)).tolist()  # the plan is made
    assert isinstance(buf._paths.one_call, DrawGather)
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with buf.ring.lock:
            held.set()
            release.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    held.wait(10)
    threading.Timer(0.2, release.set).start()
    got += seq_of(buf.sample(8)).tolist()  # waits for the lock in the Python steps
    t.join(10)
    for _ in range(2):
        got += seq_of(buf.sample(8)).tolist()
    assert sorted(got) == list(range(32))


# -- re-draws over the total of now, outs the C gather refuses, 65 columns, the switch --
def _later(call: Callable[[np.ndarray], None], arg: np.ndarray) -> None:
    time.sleep(0.002)
    call(arg)


def test_prioritized_redraws_use_the_total_of_now(make: Make, name: str) -> None:
    """sample.c redraw() draws masses over the total read before the first gather; the Python
    path's re-draw (tree_draw) reads tree.total again. When the total shrank meanwhile, every mass
    past it is clamped by tree_walk onto the last positive leaf."""
    w = 512 * 1024  # big rows: the first gather (nogil) runs for milliseconds
    buf = make(sb.Schema(obs=((w,), "uint8"), reward=((), "float32")), 64, name=name, seed=0,
               sampler=sb.Prioritized(alpha=1.0, eps=0.0))
    buf.push(obs=np.zeros((64, w), np.uint8), reward=np.arange(64, dtype=np.float32))
    ids = buf.ring.held_ids()
    buf.update_priorities(ids, np.ones(64))
    buf.sample(1)
    one = buf._paths.one_call
    assert isinstance(one, DrawGather)
    ring, prios = buf.ring, buf.priorities
    assert prios is not None
    remove = prios.remove
    tslots = ring.slots(ids[32:])  # rows 32..63 being written: drawn first, then re-drawn
    n, got = 128, []
    try:
        for _ in range(3):
            prios.tree.update(tslots, 1.0)
            ring.stamp[tslots] += 1
            t = threading.Thread(target=_later, args=(remove, tslots))  # meanwhile: their leaves to 0
            rec, big = np.empty(n, buf.block.record.dtype), np.empty((n, w), np.uint8)
            got_ids, ok, leaves, weight = np.empty(n, np.int64), np.empty(n, bool), np.empty(n), np.empty(n, np.float32)
            t.start()
            row = tuple(np.empty(n, dtype) for dtype in one.row.values())  # the block's per-row columns
            one.sample(one.plan, (rec, big, *row), got_ids, ok, True, leaves, weight, 0.4)
            t.join()
            ring.stamp[tslots] -= 1
            got.append(int(np.count_nonzero(got_ids[ok] == ids[31])))
    finally:
        del ring, prios, one, remove
    # re-draws over the current total (32): row 31 is drawn 2 (stratified) + ~2 (of 64 re-draws) times
    assert max(got) < 16, f"row 31 drawn {got} times of {n}: the re-draws' masses past the new total land on it"


def test_out_arrays_numpy_takes_are_taken_by_the_one_call_too(make: Make, name: str) -> None:
    """gather._gather_native falls back to numpy for outs the C gather refuses (not C-contiguous);
    DrawGather passes them to _native.sample, whose TypeError reaches the caller."""
    big = sb.Schema(obs=((4, 84, 84), "uint8"), reward=((), "float32"))
    buf = make(big, capacity=40, name=name, seed=0)
    buf.push(obs=np.arange(40, dtype=np.uint8)[:, None, None, None] * np.ones((1, 4, 84, 84), np.uint8),
             reward=np.arange(40, dtype=np.float32))
    buf.sample(1)
    assert isinstance(buf._paths.one_call, DrawGather)
    stage = np.empty((32, 4, 84, 84), np.uint8)
    out = {"_block": np.empty((16, buf.schema.record.itemsize), np.uint8), "obs": stage[::2]}
    batch = buf.sample(16, out=out)  # TypeError: sample out: expected a C-contiguous writable buffer
    assert np.array_equal(batch.obs[:, 0, 0, 0], batch.reward.astype(np.uint8))


def test_a_schema_of_65_columns_samples(make: Make, name: str) -> None:
    """The push takes 63 large fields + the record (64 sources) and the Python path gathers them
    with the episode ids (numpy past 64 columns); read_plan raises for 65 columns, out of sample()."""
    w = PACK_LIMIT + 1
    schema = sb.Schema(**{f"f{i}": ((w,), "uint8") for i in range(63)}, r=((), "float32"))
    buf = make(schema, 8, name=name, seed=0, episodes=True)
    buf.push(**{f"f{i}": np.full((4, w), i, np.uint8) for i in range(63)}, r=np.arange(4, dtype=np.float32), episode=0)
    b = buf.sample(2)  # ValueError: read_plan: expected 1 to 64 columns
    assert (np.asarray(b["f62"]) == 62).all()


def test_draw_gathers_false_takes_the_python_path(make: Make, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """buffer.py: _one_calls 'False ... to test the Python path'; the fast path at the top of
    sample() never looks at it once a one call was made."""
    buf = make(MUJOCO, 64, name=name, seed=0)
    buf.push(transition(0, 40))
    buf.sample(1)
    buf._paths.one_calls = False
    ran: list[int] = []
    real = reader.draw
    monkeypatch.setattr(reader, "draw", lambda *a, **k: (ran.append(1), real(*a, **k))[1])
    buf.sample(4)
    assert ran


def test_the_column_limit_is_the_c_gathers() -> None:
    from pathlib import Path

    header = (Path(native.__file__).parent / "native.h").read_text()
    found = re.search(r"#define MAX_COLS (\d+)", header)
    assert found and int(found.group(1)) == MAX_COLUMNS
