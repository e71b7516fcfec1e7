"""The C extension (``shmbuffer.native._native``) against the Python reference: the same tree after the
same updates and the same slots found, the same bytes and intact masks gathered, the same bytes
and stamps pushed; its entry points refuse bad input instead of crashing; and a few protocol
checks run on both paths (``path`` fixture; ``SHMBUFFER_PURE=1`` forces Python for a process)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shmbuffer as sb
from shmbuffer import native
from shmbuffer.protocol import push, ring
from shmbuffer.protocol.gather import gather
from shmbuffer.protocol.layout import Counter, Lane
from shmbuffer.sampling import sumtree
from shmbuffer.sampling.sumtree import SumTree

from .conftest import MUJOCO, seq_of, transition

Make = Callable[..., sb.ReplayBuffer]
LIB = native.lib
needs_lib = pytest.mark.skipif(LIB is None, reason=f"the C extension is not loaded: {native.REASON}")


def python_tree(capacity: int, sums: np.ndarray | None = None, mins: np.ndarray | None = None) -> SumTree:
    """A SumTree that runs the numpy code whatever is loaded."""
    saved = native.lib
    native.lib = None
    try:
        return SumTree(capacity, sums, mins)
    finally:
        native.lib = saved


@pytest.fixture(params=["native", "python"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Run a test on the C path and on the Python path (buffers made inside see the choice)."""
    if request.param == "native":
        if LIB is None:
            pytest.skip(f"the C extension is not loaded: {native.REASON}")
    else:
        monkeypatch.setattr(native, "lib", None)
    yield request.param


def test_active_path_is_reported_and_can_be_forced() -> None:
    code = "import shmbuffer.native as n; print(n.ACTIVE, '|', n.REASON)"
    env = {**os.environ, "SHMBUFFER_PURE": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.startswith("python |") and "SHMBUFFER_PURE" in out
    assert native.ACTIVE == ("native" if LIB is not None else "python")
    if os.environ.get("SHMBUFFER_PURE", "") in ("", "0"):
        # on a machine that built the package, the extension must load (CI has a compiler)
        assert LIB is not None, native.REASON


# -- the tree ------------------------------------------------------------------------------------
CAPACITIES = [1, 15, 16, 4096, 4097, 70_001, 1_000_000]


@needs_lib
@pytest.mark.parametrize("capacity", CAPACITIES)
def test_tree_native_equals_python(capacity: int) -> None:
    rng = np.random.default_rng(capacity)
    fast, ref = SumTree(capacity), python_tree(capacity)
    assert fast.sums.shape == ref.sums.shape  # the same layout
    for _ in range(6):
        k = int(rng.integers(1, 400))
        slots = rng.integers(0, capacity, k)  # repeats included: the last value wins
        # dyadic values (multiples of 1/64 below 1024): every sum is exact in either order
        values = np.floor(rng.random(k) * 65536) / 64 * (rng.random(k) < 0.8)
        fast.update(slots, values)
        ref.update(slots, values)
        assert np.array_equal(fast.sums, ref.sums) and np.array_equal(fast.mins, ref.mins)
        assert fast.total == ref.total and fast.min == ref.min
    fast.update(rng.integers(0, capacity, 5), 2.5)  # a scalar value
    ref.update(fast.leaves.nonzero()[0][:0], 0.0)  # an empty update changes nothing
    ref.update(np.flatnonzero(fast.leaves != ref.leaves), fast.leaves[fast.leaves != ref.leaves])
    assert np.array_equal(fast.sums, ref.sums) and np.array_equal(fast.mins, ref.mins)
    if fast.total <= 0:
        return
    # the same points on the same tree land on the same slots; points at and past the total too
    mass = np.concatenate([rng.random(2000) * fast.total, [0.0, fast.total, fast.total * 2, np.nextafter(fast.total, 0)]])
    reader = python_tree(capacity, fast.sums, fast.mins)
    got, want = fast.find(mass), reader.find(mass)
    assert got.dtype == np.int64 and np.array_equal(got, want)
    assert (fast.leaves[got] > 0).all()


@needs_lib
def test_tree_mins_follow_every_change() -> None:
    """The C update carries a min up (a parent takes a smaller new value, keeps its min when the
    child was not the smallest, looks at the 16 again when the smallest grew), or for a run of
    consecutive slots recomputes it from the children: many small updates in a few blocks, with
    ties, zeros and repeats, give exactly the mins numpy recomputes."""
    rng = np.random.default_rng(5)
    capacity = 70_001  # three levels: ties and changes reach the top
    fast, ref = SumTree(capacity), python_tree(capacity)
    for step in range(300):
        k = int(rng.integers(1, 9))
        slots = rng.integers(0, 600, k) if step % 3 else rng.integers(0, 40, k) * 16 * 16  # a few leaf and level-1 blocks
        if step % 5 == 0:  # a run of consecutive slots (a push): its mins are recomputed block by block
            k = int(rng.integers(1, 40))
            slots = np.arange(k) + int(rng.integers(0, 600))
        values = rng.integers(0, 4, k).astype(float)  # 0 leaves (min +inf) and ties
        fast.update(slots, values)
        ref.update(slots, values)
        assert np.array_equal(fast.mins, ref.mins), step
        assert np.array_equal(fast.sums, ref.sums), step  # small integers: every sum is exact
    ref.rebuild()
    assert np.array_equal(fast.mins, ref.mins) and fast.min == ref.min


@needs_lib
def test_tree_random_floats_agree_with_python() -> None:
    """Random float priorities: leaves and mins are bit-equal; inner sums may differ in the last
    bits (C adds 16 children in order, numpy through BLAS); finds agree away from boundaries."""
    rng = np.random.default_rng(7)
    capacity = 200_000
    fast, ref = SumTree(capacity), python_tree(capacity)
    for _ in range(5):
        slots = rng.integers(0, capacity, 5000)
        values = rng.random(5000) ** 3
        fast.update(slots, values)
        ref.update(slots, values)
    assert np.array_equal(fast.leaves, ref.leaves) and np.array_equal(fast.mins, ref.mins)
    np.testing.assert_allclose(fast.sums, ref.sums, rtol=1e-12, atol=0)
    mass = rng.random(4096) * min(fast.total, ref.total) * 0.999
    same = fast.find(mass) == ref.find(mass)
    assert same.mean() > 0.999


@needs_lib
def test_tree_rebuild_and_native_update_are_interchangeable() -> None:
    rng = np.random.default_rng(3)
    fast = SumTree(50_000)
    fast.update(rng.integers(0, 50_000, 3000), rng.integers(0, 100, 3000).astype(float))
    ref = python_tree(50_000, fast.sums.copy(), fast.mins.copy())
    ref.rebuild()  # the tree is a function of its leaves: the C-made tree is the rebuilt one
    assert np.array_equal(fast.sums, ref.sums) and np.array_equal(fast.mins, ref.mins)


@needs_lib
def test_tree_kernels_refuse_bad_input() -> None:
    assert LIB is not None
    tree = SumTree(5000)
    plan = tuple(sumtree._plan(5000))
    slots = np.array([0, 4999], np.int64)
    for bad in ([5000], [-1]):
        with pytest.raises(IndexError):
            LIB.tree_update(tree.sums, tree.mins, plan, 5000, np.array(bad, np.int64), 1.0)
    with pytest.raises(ValueError, match="plan"):
        LIB.tree_update(tree.sums, tree.mins, (5000, 313), 5000, slots, 1.0)
    with pytest.raises(ValueError, match="plan"):
        LIB.tree_update(tree.sums, tree.mins, plan, 6000, slots, 1.0)
    with pytest.raises(ValueError, match="plan"):
        LIB.tree_find(tree.sums[:-1], plan, 5000, np.zeros(2), np.empty(2, np.int64))
    with pytest.raises(ValueError):
        LIB.tree_update(tree.sums, tree.mins, plan, 5000, slots, np.ones(3))
    with pytest.raises(ValueError):
        LIB.tree_find(tree.sums, plan, 5000, np.zeros(3), np.empty(2, np.int64))
    with pytest.raises(TypeError):
        LIB.tree_find(tree.sums[::2], plan, 5000, np.zeros(2), np.empty(2, np.int64))  # not contiguous
    with pytest.raises(TypeError):
        LIB.tree_update(tree.sums, tree.mins, plan, 5000, np.array([0, 1], np.int32), 1.0)
    with pytest.raises(TypeError):
        LIB.tree_find(tree.sums, plan, 5000, np.zeros(2), np.empty(2, np.int64)[:1].repeat(2)[::1].view(np.int32))
    readonly = np.empty(2, np.int64)
    readonly.flags.writeable = False
    with pytest.raises(TypeError):
        LIB.tree_find(tree.sums, plan, 5000, np.zeros(2), readonly)
    assert tree.total == 0  # nothing was written


# -- gather ---------------------------------------------------------------------------------------
def gathered(block: Any, rg: Any, ids: np.ndarray, use_native: bool, monkeypatch: pytest.MonkeyPatch,
             **kw: Any) -> Any:
    with monkeypatch.context() as m:
        if not use_native:
            m.setattr(native, "lib", None)
        return gather(block, rg, ids.copy(), **kw)


def same_rows(a: Any, b: Any) -> None:
    assert np.array_equal(a.ok, b.ok)
    ok = a.ok
    if a.packed is not None:
        assert np.array_equal(a.packed[ok], b.packed[ok])
    assert a.large.keys() == b.large.keys()
    for name in a.large:
        assert np.array_equal(a.large[name][ok], b.large[name][ok])
    if a.episode is not None:
        assert np.array_equal(a.episode[ok], b.episode[ok])


ATARI_SMALL = sb.Schema(obs=((4, 21, 21), "uint8"), action=((), "int64"), reward=((), "float32"), done=((), "bool"))
# large rows wider than a 4 KiB page and not a multiple of it (the gather prefetches rows ahead page by page)
PAGES = sb.Schema(obs=((3, 50, 50), "uint8"), feat=((1100,), "float32"), reward=((), "float32"))


@needs_lib
@pytest.mark.parametrize("lanes", [1, 3])
@pytest.mark.parametrize("schema", [MUJOCO, ATARI_SMALL, PAGES], ids=["mujoco", "atari", "pages"])
def test_gather_native_equals_python(make: Make, name: str, monkeypatch: pytest.MonkeyPatch, lanes: int,
                                     schema: sb.Schema) -> None:
    rng = np.random.default_rng(lanes)
    buf = make(schema, capacity=60, lanes=lanes, episodes=True, name=name)
    for i in range(40):  # laps every lane
        k = int(rng.integers(1, 5))
        row = {f.name: rng.integers(0, 200, (k, *f.shape)).astype(f.dtype) for f in schema}
        buf.push(row, lane=int(rng.integers(0, lanes)), episode=i)
    res = buf.ring.reserve(2, 0)  # two rows being written: odd stamps
    held = np.setdiff1d(buf.ring.held_ids(), res.ids)
    try:
        stale = held[:5] - 60 * lanes  # overwritten rows' ids (some negative: never existed)
        ids = np.concatenate([rng.choice(held, 200), stale, [ring.INVALID], res.ids])
        a = gathered(buf.block, buf.ring, ids, True, monkeypatch)
        b = gathered(buf.block, buf.ring, ids, False, monkeypatch)
        same_rows(a, b)
        assert a.ok[:200].all() and not a.ok[200:].any()
        # windows keep their shape; a subset of large fields; into given arrays
        win = rng.choice(held, (7, 3))
        same_rows(gathered(buf.block, buf.ring, win, True, monkeypatch), gathered(buf.block, buf.ring, win, False, monkeypatch))
        assert gathered(buf.block, buf.ring, win, True, monkeypatch).ok.shape == (7, 3)
        if schema is not MUJOCO:
            part = gathered(buf.block, buf.ring, ids, True, monkeypatch, large=())
            assert part.large == {} and np.array_equal(part.ok, a.ok)
        out = {"_block": np.zeros((ids.size, buf.block.record.itemsize), np.uint8)}
        out.update({n: np.zeros((ids.size, *c.shape[1:]), c.dtype) for n, c in buf.block.large.items()})
        into = gathered(buf.block, buf.ring, ids, True, monkeypatch, out=out)
        assert into.packed is out["_block"]
        same_rows(into, a)
        buf.clear()  # cleared rows keep their stamps but do not count
        assert not gathered(buf.block, buf.ring, ids, True, monkeypatch).ok.any()
    finally:
        buf.ring.commit(res)


@needs_lib
def test_gather_of_a_few_rows_wider_than_a_page_equals_python(make: Make, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fewer rows than the gather looks ahead (it prefetches rows wider than a page ahead of the
    copy), repeated rows, and the first and last slots."""
    buf = make(PAGES, capacity=16, name=name)
    rng = np.random.default_rng(3)
    buf.push({f.name: rng.integers(0, 250, (16, *f.shape)).astype(f.dtype) for f in PAGES})
    for ids in ([15], [0, 15], [15, 0, 15], [3, 15, 0, 7, 15], list(range(15, -1, -1))):
        a = gathered(buf.block, buf.ring, np.array(ids), True, monkeypatch)
        same_rows(a, gathered(buf.block, buf.ring, np.array(ids), False, monkeypatch))
        assert a.ok.all()
        assert np.array_equal(a.large["obs"], buf.block.large["obs"][ids])
        assert np.array_equal(a.large["feat"], buf.block.large["feat"][ids])


@needs_lib
def test_gather_refuses_bad_input(make: Make, name: str) -> None:
    assert LIB is not None
    buf = make(MUJOCO, capacity=10, name=name)
    buf.push(transition(0, 4))
    packed, stamp = buf.block.packed, buf.block.stamp
    assert packed is not None
    # any id is safe to read at (callers check ids first: ring.check_ids; 2**63 - 1's stamp
    # would wrap to an empty slot's 0, as in numpy)
    ids = np.array([0, 1, 2 ** 62, -(2 ** 63), 2 ** 63 - 1], np.int64)
    ok = np.empty(5, np.bool_)
    LIB.gather(ids, 1, stamp, (packed,), (np.empty((5, packed.shape[1]), np.uint8),), ok)
    assert ok.tolist()[:4] == [True, True, False, False]
    with pytest.raises(ValueError):  # an out of the wrong size
        LIB.gather(ids, 1, stamp, (packed,), (np.empty((4, packed.shape[1]), np.uint8),), ok)
    with pytest.raises(ValueError):  # outs and sources differ
        LIB.gather(ids, 1, stamp, (packed,), (), ok)
    with pytest.raises(ValueError):  # lanes that do not divide the capacity
        LIB.gather(ids, 3, stamp, (), (), ok)
    with pytest.raises(ValueError):
        LIB.gather(ids, 0, stamp, (), (), ok)
    with pytest.raises(ValueError):  # a source that is not (capacity, w)
        LIB.gather(ids, 1, stamp, (packed[:9],), (np.empty((5, packed.shape[1]), np.uint8),), ok)
    with pytest.raises(ValueError):  # an ok of the wrong size
        LIB.gather(ids, 1, stamp, (), (), np.empty(4, np.bool_))
    with pytest.raises(TypeError):  # not contiguous
        LIB.gather(ids[::2], 1, stamp, (), (), np.empty(3, np.bool_))


FRAMED = sb.Schema(obs=((4, 40, 40), "uint8"), action=((), "int64"), next_obs=((4, 40, 40), "uint8"),
                   done=((), "bool"), truncated=((), "bool"))
"""Stacks of 4 frames of 1,600 bytes: a column of their own, read by ``_native.stacks``."""


def framed_episode(lane: int, ep: int, length: int, zero: bool, truncated: bool) -> dict[str, np.ndarray]:
    """One episode's transitions as a frame-stacking wrapper gives them (padding: copies of the
    first frame, or zeros)."""
    frames = [np.full((1, 40, 40), (lane * 50 + ep * 7 + t) % 250 + 1, np.uint8) for t in range(length + 1)]
    history = [np.zeros_like(frames[0]) if zero else frames[0]] * 3 + [frames[0]]
    obs, nxt = [], []
    for t in range(length):
        obs.append(np.concatenate(history[-4:]))
        history.append(frames[t + 1])
        nxt.append(np.concatenate(history[-4:]))
    end = np.arange(length) == length - 1
    return dict(obs=np.stack(obs), action=np.arange(length), next_obs=np.stack(nxt),
                done=end & (not truncated), truncated=end & truncated)


@needs_lib
@pytest.mark.parametrize("lanes", [1, 3])
def test_frame_stacks_native_equal_python(make: Make, name: str, monkeypatch: pytest.MonkeyPatch, lanes: int) -> None:
    """The C read of stacks (plan and frames in one pass) against frames.stack_plan and the
    Python gathers: the same intact mask and the same bytes, also for ids of end rows, a lane's
    newest row, rows being written, overwritten rows and INVALID, and after a clear."""
    rng = np.random.default_rng(lanes)
    buf = make(FRAMED, capacity=48 * lanes, lanes=lanes, next_of="obs", stack="obs", name=name)
    assert "obs" in buf.block.large  # the frames have a column: the C kernel reads them
    eps = [0] * lanes
    for _ in range(30):  # laps every lane: episodes cut at their start by the ring
        lane = int(rng.integers(lanes))
        buf.push(framed_episode(lane, eps[lane], int(rng.integers(1, 7)), bool(rng.integers(2)), bool(rng.integers(2))),
                 lane=lane)
        eps[lane] += 1
    held = buf.ring.held_ids()
    stale = held[:6] - 48 * lanes
    ids = np.concatenate([held, rng.choice(held, 100), stale, [ring.INVALID]])
    a = gathered(buf.block, buf.ring, ids, True, monkeypatch)
    b = gathered(buf.block, buf.ring, ids, False, monkeypatch)
    same_rows(a, b)
    assert 0 < a.ok.sum() < ids.size - stale.size  # some transitions, some end rows and newest rows
    assert not a.ok[-stale.size - 1:].any()
    sub = gathered(buf.block, buf.ring, ids, True, monkeypatch, large=("obs",))  # one stack only
    assert sub.large.keys() == {"obs"} and np.array_equal(sub.ok, a.ok)
    assert np.array_equal(sub.large["obs"][a.ok], a.large["obs"][a.ok])
    res = buf.ring.reserve(2, 0)  # rows being written (odd stamps) in the middle of lane 0's stacks
    try:
        same_rows(gathered(buf.block, buf.ring, ids, True, monkeypatch),
                  gathered(buf.block, buf.ring, ids, False, monkeypatch))
    finally:
        buf.ring.commit(res)
    buf.clear()
    assert not gathered(buf.block, buf.ring, ids, True, monkeypatch).ok.any()


@needs_lib
def test_stacks_follow_the_plan_on_random_windows(make: Make, name: str) -> None:
    """``_native.stacks`` against ``frames.stack_plan`` on random stamp checks and kinds (not
    only those pushes make): the same transitions refused, the same frames, zeros and copies."""
    from shmbuffer import frames

    assert LIB is not None
    buf = make(FRAMED, capacity=64, lanes=2, next_of="obs", stack="obs", name=name)
    for ep in range(6):
        buf.push(framed_episode(ep % 2, ep, 9, False, False), lane=ep % 2)
    col = buf.block.large["obs"]
    rng = np.random.default_rng(0)
    for _ in range(200):
        m, k = int(rng.integers(1, 12)), int(rng.integers(1, 6))
        width = k + int(rng.integers(0, 3))
        lasts = tuple(int(x) for x in rng.integers(k - 1, width, int(rng.integers(1, 3))))
        win = rng.choice(buf.ring.held_ids(), (m, width))  # committed rows: every stamp check passes
        ok = rng.random((m, width)) < 0.9
        kind = (rng.integers(0, 8, (m, width)) * (rng.random((m, width)) < 0.4)).astype(np.uint8)
        valid = rng.random(m) < 0.9
        outs = tuple(np.full((m, k, *col.shape[1:]), 255, np.uint8) for _ in lasts)
        got = valid.copy()
        LIB.stacks(win, ok, kind, 2, buf.block.stamp, col, k, lasts, outs, got)
        want = valid.copy()
        for last, out in zip(lasts, outs, strict=True):
            cols, zero, fine = frames.stack_plan(ok, kind, last, k)
            want &= fine
            ref = col[buf.ring.slots(win[np.arange(m)[:, None], cols])]
            ref[zero] = 0
            assert np.array_equal(out[want], ref[want])
        assert np.array_equal(got, want)


@needs_lib
def test_stacks_refuses_bad_input(make: Make, name: str) -> None:
    assert LIB is not None
    buf = make(FRAMED, capacity=12, next_of="obs", stack="obs", name=name)
    buf.push(framed_episode(0, 0, 5, False, False))
    col, stamp = buf.block.large["obs"], buf.block.stamp
    m, width = 3, 5
    win = np.array([[0, 1, 2, 3, 4], [ring.INVALID, -5, 2 ** 62, -(2 ** 63), 2 ** 63 - 1], [1, 2, 3, 4, 5]], np.int64)
    ok = np.ones((m, width), np.bool_)
    kind = np.zeros((m, width), np.uint8)
    outs = (np.zeros((m, 4, *col.shape[1:]), np.uint8),)
    valid = np.ones(m, np.bool_)
    LIB.stacks(win, ok, kind, 1, stamp, col, 4, (3,), outs, valid)  # any id is safe to read at
    assert valid.tolist() == [True, False, True]
    assert np.array_equal(outs[0][0], col[0:4]) and np.array_equal(outs[0][2], col[1:5])

    def refused(error: type[Exception], *args: Any) -> None:
        before = valid.copy()
        with pytest.raises(error):
            LIB.stacks(*args)
        assert np.array_equal(valid, before)

    refused(ValueError, win, ok, kind, 1, stamp, col, 4, (2,), outs, valid)  # last < k - 1
    refused(ValueError, win, ok, kind, 1, stamp, col, 4, (5,), outs, valid)  # last >= W
    refused(ValueError, win, ok, kind, 1, stamp, col, 4, (3, 4), outs, valid)  # lasts and outs differ
    refused(ValueError, win, ok, kind, 1, stamp, col, 4, (), (), valid)
    refused(ValueError, win, ok, kind, 1, stamp, col, 4, (3,), (outs[0][:2],), valid)  # an out too small
    refused(ValueError, win, ok, kind, 5, stamp, col, 4, (3,), outs, valid)  # lanes do not divide
    refused(ValueError, win, ok, kind, 1, stamp, col[:11], 4, (3,), outs, valid)  # not (capacity, w)
    refused(ValueError, win[:2], ok, kind, 1, stamp, col, 4, (3,), outs, valid)  # win not (m, W)
    refused(ValueError, win, ok[:, :4].copy(), kind, 1, stamp, col, 4, (3,), outs, valid)
    refused(ValueError, win, ok, kind, 1, stamp, col, 0, (3,), outs, valid)  # k < 1
    refused(TypeError, win[:, ::2], ok, kind, 1, stamp, col, 4, (3,), outs, valid)  # not contiguous
    refused(TypeError, win, ok, kind, 1, stamp, col, 4, (3,), (outs[0][::2],), valid)
    readonly = valid.copy()
    readonly.flags.writeable = False
    refused(TypeError, win, ok, kind, 1, stamp, col, 4, (3,), outs, readonly)


# -- push -------------------------------------------------------------------------------------------
def block_bytes(buf: sb.ReplayBuffer) -> dict[str, bytes]:
    return {k: v.tobytes() for k, v in buf.block.arrays.items() if k not in ("_mutex", "_writer_pid", "_writer_start")}


@needs_lib
@pytest.mark.parametrize("lanes", [1, 4])
def test_push_native_equals_python(make: Make, name: str, monkeypatch: pytest.MonkeyPatch, lanes: int) -> None:
    """The same pushes (one row, k rows, wrapping, lanes per row, casts, priorities, episodes)
    leave the same bytes in every column, whichever path copies."""
    schema = sb.Schema(obs=((3, 5), "float32"), img=((2, 32, 32), "uint8"), action=((), "int64"),
                       reward=((), "float32"), flag=((2,), "bool"))
    bufs = []
    for use_native in (True, False):
        if not use_native:
            monkeypatch.setattr(native, "lib", None)
        bufs.append(make(schema, capacity=24, lanes=lanes, episodes=True, sampler=sb.Prioritized(), name=f"{name}{int(use_native)}"))
    fast, ref = bufs
    rng = np.random.default_rng(lanes)
    for _ in range(30):
        k = int(rng.integers(1, 6))
        one = rng.random() < 0.3
        rows: dict[str, Any] = {
            "obs": rng.random((k, 3, 5)),  # float64: cast to float32
            "img": rng.integers(0, 255, (k, 2, 32, 32)).astype(np.uint8)[:, :, ::-1],  # not contiguous
            "action": rng.integers(-5, 5, k).astype(np.int32),
            "reward": rng.random(k).astype(np.float32),
            "flag": rng.random((k, 2)) < 0.5,
        }
        if one:
            rows = {n: v[0] for n, v in rows.items()}
            k = 1
        lane: Any = int(rng.integers(0, lanes)) if rng.random() < 0.5 or one else rng.integers(0, lanes, k)
        prio = rng.random(k) + 0.1
        episode = int(rng.integers(0, 9)) if rng.random() < 0.5 else rng.integers(0, 9, k)
        if one:
            prio, episode = prio[0], int(rng.integers(0, 9))
        got = fast.push(rows, lane=lane, episode=episode, priority=prio)
        want = ref.push(rows, lane=lane, episode=episode, priority=prio)
        assert np.array_equal(got, want)
    a, b = block_bytes(fast), block_bytes(ref)
    assert a.keys() == b.keys()
    for key in a:
        if key not in ("_tree_sum",):
            assert a[key] == b[key], key
    assert np.allclose(fast.block.arrays["_tree_sum"], ref.block.arrays["_tree_sum"], rtol=1e-12)
    assert (fast.ring.stamp % 2 == 0).all()


@needs_lib
@pytest.mark.parametrize("lanes", [1, 4])
def test_one_call_push_equals_python(make: Make, name: str, monkeypatch: pytest.MonkeyPatch, lanes: int) -> None:
    """Uniform pushes take one C call (``_native.push``): one lane or a lane per row, episodes,
    wrapping lanes, float64 into float32 and Python numbers cast as ``Schema.validate`` casts; the
    same bytes, ids and counts as the Python path; a frozen buffer still refuses."""
    assert LIB is not None
    schema = sb.Schema(obs=((3, 5), "float32"), img=((2, 32, 32), "uint8"), action=((), "int64"), flag=((2,), "bool"),
                       reward=((), "float32"), gain=((), "float64"), done=((), "bool"), small=((), "int16"), old=((1,), "float32"))
    fast = make(schema, capacity=24, lanes=lanes, episodes=True, name=name + "n")
    with monkeypatch.context() as m:
        m.setattr(native, "lib", None)
        ref = make(schema, capacity=24, lanes=lanes, episodes=True, name=name + "p")
    calls: list[bool] = []
    python_push = push.push

    def counted(*a: Any, **k: Any) -> Any:  # the Python steps: a push the one call did not take
        if a[0] is fast:
            calls[-1] = False
        return python_push(*a, **k)

    monkeypatch.setattr(fast, "_fast_push", None)  # the Python method goes to push.push, counted
    monkeypatch.setattr(push, "push", counted)
    fast.ring.writer_id()  # this process registered (as its first push through the steps does)
    rng = np.random.default_rng(lanes)
    for i in range(60):
        k = int(rng.integers(1, 6))
        rows: dict[str, Any] = {"obs": rng.normal(size=(k, 3, 5)).astype(np.float32 if i % 2 else np.float64),
                                "img": rng.integers(0, 255, (k, 2, 32, 32)).astype(np.uint8),
                                "action": rng.integers(-5, 5, k), "flag": rng.random((k, 2)) < 0.5,
                                "reward": rng.normal(size=k) * 1e30, "gain": rng.normal(size=k).astype(np.float32),
                                "done": rng.random(k) < 0.5, "small": rng.integers(-300, 300, k).astype(np.int16),
                                "old": rng.normal(size=(k, 1)).astype(np.float32)}
        if i % 3 == 0:  # one row, fields as Python numbers and numpy scalars
            k = 1
            rows = {n: v[0] for n, v in rows.items()}
            rows.update(reward=float(rows["reward"]), gain=float(rows["gain"]), done=bool(rows["done"]),
                        small=int(rows["small"]), old=float(rows["old"][0]) if i % 2 else rows["old"][0])
            if i % 6 == 0:
                rows.update(reward=int(rng.integers(-9, 9)), gain=True, done=int(rng.integers(0, 2)))
        lane: Any = int(rng.integers(0, lanes)) if rng.random() < 0.5 else rng.integers(0, lanes, k)
        episode = int(rng.integers(0, 9)) if rng.random() < 0.5 else rng.integers(0, 9, k)
        calls.append(True)
        got = fast.push(rows, lane=lane, episode=episode)
        with monkeypatch.context() as m:
            m.setattr(native, "lib", None)
            want = ref.push(rows, lane=lane, episode=episode)
        assert np.array_equal(got, want)
    # each push in one call, wrapping lanes too
    assert calls == [True] * 60
    a, b = block_bytes(fast), block_bytes(ref)
    assert a.keys() == b.keys()
    for key in a:
        assert a[key] == b[key], key
    assert fast.stats["inserted"] == ref.stats["inserted"]
    fast.freeze()
    with pytest.raises(sb.ReadOnlyError):
        fast.push({n: v[:1] for n, v in rows.items()}, lane=0, episode=0)


@needs_lib
def test_one_call_push_leaves_what_python_must_decide_alone(make: Make, name: str) -> None:
    """Anything the one call does not take returns ``None`` with the buffer unchanged, and the
    Python steps then push it or raise their clear error: values it would have to cast otherwise,
    a lane out of range or too full, episodes missing or unwanted, a push that may interleave
    envs, a process it does not name, a busy lock, an odd slot, a frozen buffer."""
    assert LIB is not None
    buf = make(MUJOCO, capacity=12, lanes=2, episodes=True, name=name)
    plan = buf._copier.plan
    block, ring_ = buf.block, buf.ring
    stats, stamp = block.arrays["_stats"], block.stamp
    rows = {k: np.ascontiguousarray(v) for k, v in transition(0, 2).items()}
    e2 = np.array([4, 5], np.int64)
    ring_.writer_id()
    before = {n: a.copy() for n, a in block.arrays.items() if n != "_mutex"}
    for data, lane, episode in (
        ({**rows, "obs": rows["obs"].astype(np.int32)}, 0, 1),  # a cast validate decides
        ({**rows, "obs": rows["obs"].astype(np.float64) * 1e300}, 0, 1),  # float64 too large for float32: validate refuses
        ({**rows, "action": rows["action"][:, ::-1]}, 0, 1),  # not contiguous
        ({**rows, "done": rows["done"][:1]}, 0, 1),  # ragged
        ({k: v for k, v in rows.items() if k != "done"}, 0, 1),  # a missing field
        ({**rows, "extra": rows["done"]}, 0, 1),  # an unknown one
        ({**rows, "obs": rows["obs"].tolist()}, 0, 1),  # not an array
        ({**{k: v[0] for k, v in rows.items()}, "reward": 2 ** 70}, 0, 1),  # a number too large
        ({**{k: v[0] for k, v in rows.items()}, "done": 2}, 0, 1),  # 2 is not a flag
        ({**{k: v[0] for k, v in rows.items()}, "reward": -1e300}, 0, 1),  # would become -inf
        ({**{k: v[0] for k, v in rows.items()}, "action": 1.0}, 0, 1),  # a float into an int field
        (list(rows.values()), 0, 1),  # not a dict
        (rows, 2, 1), (rows, -1, 1), (rows, np.array([0, 2]), 1), (rows, np.array([0], np.int64), 1),
        (rows, np.array([0, 1], np.int32), 1), (rows, None, 1),  # two lanes and no lane=
        ({k: np.repeat(v, 4, axis=0) for k, v in rows.items()}, 0, 1),  # 8 rows for a lane of 6
        (rows, 0, None), (rows, 0, 1.5), (rows, 0, np.array([1, 2, 3])), (rows, 0, 2 ** 70),
        (rows, 0, np.arange(4)[::2]), (rows, 0, np.arange(2)[::-1]),  # strided episode ids: numpy copies them
        ({**{k: v[0] for k, v in rows.items()}, "reward": b"\x01\x02\x03\x04"}, 0, 1),  # bytes: validate refuses
    ):
        assert LIB.push(plan, data, lane, episode) is None
    solo = make(MUJOCO, capacity=8, episodes=True, name=name + "s")
    solo.ring.writer_id()
    assert LIB.push(solo._copier.plan, rows, None, e2) is None  # push.note_interleaving decides
    assert LIB.push(solo._copier.plan, rows, None, 3) is not None
    small = make(sb.Schema(u=((), "uint8")), capacity=4, name=name + "u")
    small.ring.writer_id()
    assert LIB.push(small._copier.plan, {"u": b"\x01"}, None, None) is None  # bytes: numpy makes it a string
    with pytest.raises(sb.FieldError):
        small.push(u=b"\x01")
    assert len(small) == 0
    me = ring_.me.copy()
    ring_.me[0] += 1  # another process's entry
    assert LIB.push(plan, rows, 0, 1) is None
    ring_.me[:] = me
    child = os.fork()  # a forked child holds its parent's entry until it registers its own
    if child == 0:
        code = 9
        try:
            code = 0 if LIB.push(plan, rows, 0, 1) is None else 1
        finally:
            os._exit(code)
    assert os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]) == 0
    stamp[1] = 3  # lane 0's slot 1 is being written
    assert LIB.push(plan, rows, 0, 1) is None
    stamp[1] = 0
    stats[int(Counter.FROZEN)] = 1
    assert LIB.push(plan, rows, 0, 1) is None
    stats[int(Counter.FROZEN)] = 0
    ring_.lock.acquire()  # busy: the Python steps wait for it
    try:
        assert LIB.push(plan, rows, 0, 1) is None
    finally:
        ring_.lock.release()
    for n, a in before.items():
        assert np.array_equal(block.arrays[n], a), n
    with pytest.raises(TypeError):
        LIB.push(plan, rows, 0)
    with pytest.raises(ValueError):  # not a plan
        LIB.push(stamp, rows, 0, 1)
    got = LIB.push(plan, rows, np.array([1, 0], np.int64), e2)
    assert got.tolist() == [1, 0] and stamp[[0, 6]].tolist() == [2, 2] and stats[int(Counter.INSERTED)] == 2
    assert block.episode is not None and block.episode[[6, 0]].tolist() == [4, 5]


@needs_lib
def test_a_push_plan_refuses_what_does_not_fit_the_ring(make: Make, name: str) -> None:
    assert LIB is not None
    buf = make(MUJOCO, capacity=12, lanes=2, name=name)
    c, r = buf._copier, buf.ring
    packed = buf.block.packed
    assert packed is not None
    widths = tuple(int(buf.block.fields[n].dtype.itemsize * np.prod(s)) for n, s in zip(c.names, c.shapes, strict=True))
    ring_ = dict(lock=r.lock.memory, cursors=r.cursors, stats=r.stats_array, stamp=r.stamp, owner=r.owner,
                 writers=r.writers, me=r.me)
    fields = dict(names=c.names, formats=c.formats, shapes=c.shapes, widths=widths, targets=c.columns, offsets=c.offsets)

    def plan(**kw: Any) -> Any:
        views = tuple(kw.get(k, v) for k, v in ring_.items())
        f = {k: kw.get(k, v) for k, v in fields.items()}
        return LIB.plan(views, kw.get("fields", tuple(zip(*f.values(), strict=True))), episode=kw.get("episode"), envs=kw.get("envs", 0))

    assert plan() is not None
    assert LIB.plan(ring=tuple(ring_.values()), fields=tuple(zip(*fields.values(), strict=True))) is not None
    for bad in (dict(lock=r.lock.memory[:32]), dict(cursors=r.cursors.reshape(-1)[:12]), dict(stats=r.stats_array[:11]),
                dict(writers=r.writers[:8]), dict(owner=r.owner[:5]), dict(owner=r.stamp), dict(me=np.zeros(3, np.int64)),
                dict(envs=3), dict(envs=-1), dict(episode=np.zeros(5, np.int64)),
                dict(widths=(10 ** 6,) * len(widths)), dict(offsets=(packed.shape[1],) * len(widths)),
                dict(shapes=((-1,),) * len(widths)), dict(formats=("f",) * len(widths)), dict(fields=()),
                dict(fields=((c.names[0],),)), dict(fields=[tuple(zip(*fields.values(), strict=True))]), dict(stamp=r.stamp[:5])):
        with pytest.raises((ValueError, TypeError)):
            plan(**bad)


@needs_lib
def test_put_reserve_and_check_refuse_bad_input(make: Make, name: str) -> None:
    assert LIB is not None
    buf = make(MUJOCO, capacity=10, name=name)
    packed, stamp, owner = buf.block.packed, buf.block.stamp, buf.ring.owner
    assert packed is not None
    before = (packed.copy(), stamp.copy(), owner.copy())
    src = np.zeros((2, 4), np.uint8)
    for where, offset in (([0, 10], 0), ([-1, 0], 0), ([0, 1], packed.shape[1] - 3), ([0, 1], -1), (9, 0), (-1, 0)):
        slots: Any = np.array(where, np.int64) if isinstance(where, list) else where
        with pytest.raises((IndexError, ValueError)):
            LIB.put(slots, 2, stamp, (packed,), (offset,), None, (src,), True)
    with pytest.raises(ValueError):  # 9 bytes are not 2 rows
        LIB.put(0, 2, stamp, (packed,), (0,), None, (np.zeros((3, 3), np.uint8),), True)
    with pytest.raises(ValueError):  # k slots expected
        LIB.put(np.array([0, 1, 2], np.int64), 2, stamp, (packed,), (0,), None, (src,), True)
    with pytest.raises(ValueError):
        LIB.put(0, 2, stamp, (packed,), (), None, (src,), True)
    with pytest.raises(ValueError):  # a format per source
        LIB.put(0, 2, stamp, (packed,), (0,), (), (src,), True)
    readonly = packed.copy()
    readonly.flags.writeable = False
    with pytest.raises(TypeError):
        LIB.put(0, 2, stamp, (readonly,), (0,), None, (src,), True)
    # a source of another format, or not contiguous: False, nothing copied (the caller casts)
    assert LIB.put(0, 2, stamp, (packed,), (0,), (b"f",), (src,), True) is False
    assert LIB.put(0, 2, stamp, (packed,), (0,), None, (np.zeros((2, 8), np.uint8)[:, ::2],), True) is False
    for args in ((-1, 2, 0, 0), (9, 2, 0, 0), (0, 2, -1, 0), (0, 2, 0, 70_000), (0, 2, 2 ** 62, 0)):
        with pytest.raises(ValueError):
            LIB.reserve(stamp, owner, *args, np.empty(2, np.int64))
    with pytest.raises(TypeError):
        LIB.reserve(stamp, owner.astype(np.int64), 0, 1, 0, 0, np.empty(1, np.int64))
    with pytest.raises(ValueError):  # a stamp kept for each slot
        LIB.reserve(stamp, owner, 0, 2, 0, 0, np.empty(1, np.int64))
    assert np.array_equal(packed, before[0]) and np.array_equal(stamp, before[1]) and np.array_equal(owner, before[2])
    cursors = buf.block.arrays["_lanes"]
    n, at = np.empty(2, np.int64), np.empty(2, np.int64)
    for lane, w in (([0, 1], 0), ([0, -1], 0), ([0, 0], -1)):  # one lane: lane 1 does not exist
        with pytest.raises(ValueError):
            LIB.reserve_lanes(cursors, stamp, owner, np.array(lane, np.int64), w, n, at, np.empty(2, np.int64))
    with pytest.raises(ValueError):
        LIB.reserve_lanes(cursors, stamp, owner, np.zeros(3, np.int64), 0, n, at, np.empty(3, np.int64))
    with pytest.raises(ValueError):
        LIB.reserve_lanes(cursors, stamp, owner, np.zeros(2, np.int64), 0, n, at, np.empty(3, np.int64))
    assert np.array_equal(stamp, before[1]) and cursors[0, 0] == 0
    assert LIB.lanes_worst(np.array([0, 1, 1, 0, 1], np.int64), 2) == 3
    assert LIB.lanes_worst(np.array([0, 2], np.int64), 2) == -1 and LIB.lanes_worst(np.array([-1], np.int64), 2) == -1
    with pytest.raises(ValueError):
        LIB.lanes_worst(np.zeros(2, np.int64), 0)
    stamp[3] = 7  # being written: reserve leaves everything alone
    old = np.full(3, -1, np.int64)
    assert LIB.reserve(stamp, owner, 2, 3, 50, 5, old) is False and owner[2:5].tolist() == [0, 0, 0]
    assert old.tolist() == [-1, -1, -1]
    stamp[5] = 42
    old = np.full(2, -1, np.int64)
    assert LIB.reserve(stamp, owner, 4, 2, 50, 5, old) is True
    assert stamp[4:6].tolist() == [101, 103] and owner[4:6].tolist() == [5, 5] and old.tolist() == [0, 42]
    stamp[:] = 0


@needs_lib
def test_fast_checks_take_exactly_what_validate_takes_unchanged(make: Make, name: str) -> None:
    """``Copier.fast_check`` accepts only rows that ``Schema.validate`` would pass through as they are
    (the fields' dtypes and shapes, contiguous); anything else goes to ``validate``."""
    buf = make(MUJOCO, capacity=10, name=name)
    copier = buf._copier
    rows = {k: np.ascontiguousarray(v) for k, v in transition(0, 3).items()}
    assert copier.fast_check(rows) == (3, rows)
    one = {k: v[0] for k, v in rows.items()}
    assert copier.fast_check(one) == (1, one)
    assert copier.fast_check({**rows, "done": rows["done"][:2]}) is None  # ragged
    assert copier.fast_check({**rows, "done": one["done"]}) is None  # one row and 3 rows
    assert copier.fast_check({**rows, "obs": rows["obs"].astype(np.float64)}) is None  # a cast
    assert copier.fast_check({**rows, "obs": np.asfortranarray(np.zeros((3, 17), np.float32))[:, ::-1]}) is None
    assert copier.fast_check({**rows, "obs": rows["obs"][:, :16]}) is None  # a wrong shape
    assert copier.fast_check({**rows, "obs": rows["obs"].tolist()}) is None  # not an array
    assert copier.fast_check({k: v for k, v in rows.items() if k != "done"}) is None  # a missing field
    assert copier.fast_check({**rows, "extra": rows["done"]}) is None
    assert copier.fast_check({k: v[:0] for k, v in rows.items()}) is None  # no rows: validate's case
    assert copier.fast_check({**one, "reward": float(one["reward"])}) is None  # a number: validate makes it an array
    old = make(sb.Schema(obs=((17,), "float32"), rew=((1,), "float32")), capacity=10, name=name + "c")._copier
    three = {"obs": np.zeros((3, 17), np.float32), "rew": np.zeros(3, np.float32)}
    assert old.fast_check(three) is None  # cpprb's (k,) for a (1,) field: validate reshapes it to (k, 1)
    assert old.fast_check({**three, "rew": np.zeros((3, 1), np.float32)}) is not None
    with pytest.raises(sb.FieldError):  # and validate still raises what it raised
        buf.push({**rows, "obs": rows["obs"][:, :16]})
    assert len(buf) == 0


@needs_lib
def test_a_native_copy_that_fails_gives_the_rows_back(make: Make, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    buf = make(MUJOCO, capacity=8, name=name, sampler=sb.Prioritized())
    buf.push(transition(0, 4))

    class Failing:
        check = staticmethod(LIB.check)  # type: ignore[union-attr]

        def put(self, *args: Any) -> None:
            raise KeyboardInterrupt

    copier = buf._copier
    monkeypatch.setattr(copier, "lib", Failing())
    with pytest.raises(KeyboardInterrupt):
        buf.push(transition(4, 2))
    monkeypatch.undo()
    assert set(seq_of(buf.sample(100))) == {0, 1, 2, 3}
    assert buf.priorities.tree.leaves[4:6].tolist() == [0.0, 0.0]  # type: ignore[union-attr]
    assert buf.ring.stamp[4:6].tolist() == [0, 0]


# -- the protocol on both paths ---------------------------------------------------------------
def test_round_trip_and_torn_rows_never_kept(path: str, make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=64, name=name, sampler=sb.Prioritized(), seed=1)
    for i in range(0, 96, 8):
        buf.push(transition(i, 8))
    res = buf.ring.reserve(3)  # rows 96-98 being written: never returned
    try:
        seq = seq_of(buf.sample(512))
        assert set(seq) <= set(range(32, 96))
        buf.update_priorities(np.arange(32, 96), np.where(np.arange(32, 96) == 40, 1e6, 1e-6))
        assert (seq_of(buf.sample(256)) == 40).mean() > 0.9
    finally:
        buf.ring.commit(res)


def writer(name: str, pure: bool, rows: int) -> None:
    if pure:
        native.lib = None
    buf = sb.ReplayBuffer.attach(name)
    try:
        for i in range(0, rows, 8):
            buf.push(transition(i, 8))
    finally:
        buf.close()


@pytest.mark.slow
def test_a_writer_process_and_a_sampler_never_tear_rows(path: str, make: Make, name: str, procs: list[Any]) -> None:
    import multiprocessing as mp

    buf = make(MUJOCO, capacity=256, name=name)
    buf.push(transition(0, 8))
    p = mp.get_context("spawn").Process(target=writer, args=(name, path == "python", 40_000))
    procs.append(p)
    p.start()
    batches = 0
    while p.is_alive() or batches < 5:
        seq_of(buf.sample(128))  # every value of every row checked against its sequence number
        batches += 1
    p.join(30)
    assert p.exitcode == 0 and buf.stats["inserted"] == 40_008
    assert batches >= 5


@needs_lib
def test_large_outputs_share_one_allocation_and_equal_python(make: Make, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    schema = sb.Schema(obs=((4, 32, 32), "uint8"), next_obs=((4, 32, 32), "uint8"), feat=((300,), "float64"),
                       reward=((), "float32"))
    buf = make(schema, capacity=64, name=name)
    rng = np.random.default_rng(5)
    buf.push({f.name: rng.integers(0, 250, (64, *f.shape)).astype(f.dtype) for f in schema})
    ids = rng.integers(0, 64, 600)  # 600 * 8 KiB: above the 1 MiB of one allocation
    a = gathered(buf.block, buf.ring, ids, True, monkeypatch)
    b = gathered(buf.block, buf.ring, ids, False, monkeypatch)
    same_rows(a, b)
    assert a.ok.all() and a.large["obs"].base is not None and a.large["obs"].base is a.large["next_obs"].base
    batch = buf.sample(600)
    assert np.array_equal(batch.obs, buf.block.large["obs"][batch.index])
    assert np.array_equal(batch.next_obs, buf.block.large["next_obs"][batch.index])
    assert np.array_equal(batch.feat, buf.block.large["feat"][batch.index])


def test_dead_writers_rows_are_never_read_and_are_reclaimed(path: str, make: Make, name: str) -> None:
    """A writer that reserves rows and dies: readers skip them, and a reservation that comes round
    takes them over (the C reservation leaves odd slots to ring.py's lapping rules)."""
    buf = make(MUJOCO, capacity=8, name=name, seed=3)
    buf.push(transition(0, 4))
    code = f"import os, shmbuffer as sb; sb.ReplayBuffer.attach({name!r}).ring.reserve(2); os._exit(0)"
    env = {**os.environ, "SHMBUFFER_PURE": "1" if path == "python" else "0"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
    assert buf.ring.stamp[:6].tolist() == [2, 4, 6, 8, 9, 11]
    assert set(seq_of(buf.sample(64))) <= {0, 1, 2, 3}
    buf.push(transition(6, 2))  # slots 6, 7
    buf.push(transition(8, 4))  # slots 0-3: wraps, nothing odd there
    assert buf.stats["reclaimed"] == 0
    buf.push(transition(12, 2))  # slots 4, 5: odd rows of a dead writer, reclaimed
    assert buf.stats["reclaimed"] == 2 and not (buf.ring.stamp & 1).any()
    assert sorted(seq_of(buf.get(slice(None))).tolist()) == [6, 7, 8, 9, 10, 11, 12, 13]


def test_lanes_clear_and_limits_on_both_paths(path: str, make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=12, lanes=3, name=name, seed=4)
    ids = buf.push(transition(0, 6), lane=np.array([0, 1, 2, 0, 1, 2]))
    assert ids.tolist() == [0, 1, 2, 3, 4, 5]
    assert buf.push(transition(6, 2), lane=1).tolist() == [7, 10]
    assert set(seq_of(buf.sample(200))) == set(range(8))
    buf.clear()
    assert len(buf) == 0
    with pytest.raises(sb.EmptyBufferError):
        buf.sample(4)
    buf.push(transition(20, 3), lane=np.array([2, 2, 0]))
    assert set(seq_of(buf.sample(100))) == {20, 21, 22}
    with pytest.raises(sb.CapacityError):  # more rows than a lane holds: refused before anything changes
        buf.push(transition(30, 5), lane=np.zeros(5, np.int64))
    with pytest.raises(sb.CapacityError, match="lane numbers"):
        buf.push(transition(30, 2), lane=np.array([0, 3]))
    assert len(buf) == 3 and buf.stats["inserted"] == 11


# -- prioritized replay: the draw, the weights, the update -----------------------------------------
def python_ring(rg: Any) -> Any:
    """The same ring, read by the numpy code (no C view of its stamps and cursors)."""
    clone = ring.Ring.__new__(ring.Ring)
    clone.__dict__.update(rg.__dict__)
    clone.native_view, clone._lib = None, None
    return clone


def messy_prioritized(make: Make, name: str, lanes: int, dyadic: bool) -> sb.ReplayBuffer:
    """A prioritized buffer whose lanes lapped and whose slots hold every case a draw must tell
    apart: committed rows, rows being written, empty slots with a leaf, leaves of 0."""
    rng = np.random.default_rng(lanes)
    buf = make(MUJOCO, capacity=600, lanes=lanes, name=name, seed=0, sampler=sb.Prioritized(alpha=0.6, beta=0.4))
    for j in range(5):  # 950 rows into 600 slots: every lane laps, lane 0 most (cursors differ)
        k = 200 if j < 4 else 150
        p = np.floor(rng.random(k) * 4096) / 64 if dyadic else rng.random(k) ** 2 * 10
        p[rng.random(k) < 0.1] = 0.0
        lane = (rng.integers(0, lanes, k) if j < 4 else np.zeros(k, np.int64)) if lanes > 1 else 0
        buf.push(transition(200 * j, k), lane=lane, priority=p)
    st = buf.ring.stamp
    odd = rng.choice(600, 30, replace=False)
    st[odd[:15]] += 1  # being written
    st[odd[15:]] = 0  # empty, yet their leaves stay
    # a clear() that died before it reset the tree (priorities.py's repair case): rows before the
    # new base keep their leaves; then a few rows pushed after it
    leaves = buf.priorities.tree.leaves.copy()  # type: ignore[union-attr]
    buf.clear()
    buf.priorities.tree.update(np.arange(600), leaves)  # type: ignore[union-attr]
    buf.push(transition(900, 60), lane=rng.integers(0, lanes, 60) if lanes > 1 else 0, priority=np.ones(60))
    return buf


@needs_lib
@pytest.mark.parametrize("lanes", [1, 3])
@pytest.mark.parametrize("dyadic", [True, False])
def test_prioritized_draw_native_equals_python(make: Make, name: str, lanes: int, dyadic: bool) -> None:
    """The same RNG state gives the same ids, leaves and INVALID marks, stratified or not; with
    dyadic priorities every sum is exact (the same walk to the bit), with random floats the inner
    sums may differ in the last bit (C adds in order, numpy by BLAS) and so may a draw on a boundary."""
    from shmbuffer.sampling.samplers import Draw, tree_draw

    buf = messy_prioritized(make, name, lanes, dyadic)
    tree, rg = buf.priorities.tree, buf.ring  # type: ignore[union-attr]
    assert rg.native_view is not None and tree.lib is not None
    ref_tree, ref_ring = python_tree(tree.capacity, tree.sums, tree.mins), python_ring(rg)
    same = total = invalid = 0
    for seed, k, stratified in [(1, 1, True), (2, 256, True), (3, 256, False), (4, 3000, True), (5, 7, False)]:
        a = tree_draw(rg, tree, np.random.default_rng(seed), k, stratified=stratified)
        b = tree_draw(ref_ring, ref_tree, np.random.default_rng(seed), k, stratified=stratified)
        assert type(a) is Draw and a.ids.dtype == np.int64 and a.leaves is not None and b.leaves is not None
        assert a.ids.shape == b.ids.shape == (k,)
        if dyadic:
            assert np.array_equal(a.ids, b.ids) and np.array_equal(a.leaves, b.leaves)
        same += int((a.ids == b.ids).sum())
        total += k
        # what the ids say is what the ring holds: invalid exactly where the Python rules say
        valid = a.ids != ring.INVALID
        assert np.array_equal(rg.current(a.ids[valid]), np.ones(int(valid.sum()), bool))
        invalid += int((~valid).sum())
    assert same >= total * 0.999
    assert 0 < invalid < total  # the messy ring exercised both
    # the generators were advanced alike: the next draws agree too
    ga, gb = np.random.default_rng(9), np.random.default_rng(9)
    tree_draw(rg, tree, ga, 5, stratified=True)
    tree_draw(ref_ring, ref_tree, gb, 5, stratified=True)
    assert ga.random() == gb.random()


@needs_lib
def test_prioritized_draw_of_an_empty_tree_draws_nothing(make: Make, name: str) -> None:
    from shmbuffer.sampling.samplers import tree_draw

    buf = make(MUJOCO, capacity=64, name=name, sampler=sb.Prioritized())
    g = np.random.default_rng(0)
    got = tree_draw(buf.ring, buf.priorities.tree, g, 16, stratified=True)  # type: ignore[union-attr]
    assert got.ids.size == 0 and got.leaves is not None and got.leaves.size == 0
    assert g.random() == np.random.default_rng(0).random()  # no number was used


@needs_lib
@pytest.mark.parametrize("low", [1.0, 1e-3, 1e-300, 0.0])
def test_prioritized_weights_native_equal_python(low: float) -> None:
    """Weights agree to 1 float32 ulp (the C library's pow against numpy's, which may be a
    vectorized one that differs in float64's last bit); a tree without positive leaves gives ones;
    ratios past float64's range give 0."""
    rng = np.random.default_rng(11)
    capacity = 70_001
    fast = SumTree(capacity)
    leaves = np.exp(rng.standard_normal(capacity) * 3) * (rng.random(capacity) < 0.7)
    if low > 0:
        leaves[5] = low
        leaves = np.where(leaves > 0, np.maximum(leaves, low), 0.0)
    else:
        leaves[:] = 0.0
    fast.update(np.arange(capacity), leaves)
    ref = python_tree(capacity, fast.sums, fast.mins)
    drawn = np.concatenate([fast.leaves[rng.integers(0, capacity, 4000)], [0.0, 1e280, low]])
    for beta, calls, steps in [(0.4, 0, None), (0.0, 10, None), (1.0, 3, None), (0.4, 50, 100), (0.7, 500, 100)]:
        s = sb.Prioritized(alpha=0.6, beta=beta, beta_steps=steps)
        got = s.weights(fast, drawn, calls)
        want = s.weights(ref, drawn, calls)
        assert got is not None and want is not None and got.dtype == want.dtype == np.float32
        np.testing.assert_array_max_ulp(got, want, maxulp=1)
        if low == 0.0:
            assert (got == 1).all()
        elif low == 1e-300 and beta > 0:
            assert got[-2] == 0.0  # 1e280 / 1e-300 overflows: weight 0, as numpy gives
    if low == 1.0:  # a min tree holding NaN (never made by the checked paths): ones, as numpy's min gives
        fast._mins[-1][3] = np.nan  # a node of the top level
        s = sb.Prioritized(alpha=0.6, beta=0.4)
        assert np.all(s.weights(fast, drawn, 0) == 1) and np.all(s.weights(ref, drawn, 0) == 1)


@needs_lib
def test_prioritized_weights_find_the_smallest_leaf_under_any_top_node() -> None:
    """The C weights take the min of the top level in several lanes at once and a scalar tail:
    the smallest leaf (or a NaN in the min tree) under any top node counts, as in numpy."""
    capacity = 70_001  # levels 70,016 / 4,384 / 274: the top node of slot s is s // 256
    s = sb.Prioritized(alpha=0.6, beta=0.4)
    drawn = np.array([1.0, 0.5, 0.25])
    for node in [*range(10), 264, 271, 272, 273]:
        fast = SumTree(capacity)
        fast.update(np.arange(capacity), 1.0)
        fast.update(np.array([node * 256 + 7]), 0.25)
        ref = python_tree(capacity, fast.sums, fast.mins)
        got = s.weights(fast, drawn, 0)
        assert got is not None and got[-1] == 1.0 and got[0] < 0.6
        np.testing.assert_array_max_ulp(got, s.weights(ref, drawn, 0), maxulp=1)  # type: ignore[arg-type]
        fast._mins[-1][node] = np.nan
        fast._mins[-1][0 if node else 1] = 0.25  # a missed NaN would give weights below 1
        assert np.all(s.weights(fast, drawn, 0) == 1) and np.all(s.weights(ref, drawn, 0) == 1)


@pytest.mark.parametrize("lanes", [1, 3])
def test_priority_updates_give_the_same_tree_on_both_paths(make: Make, name: str, monkeypatch: pytest.MonkeyPatch,
                                                           lanes: int) -> None:
    """The same pushes and updates (stale, cleared and repeated ids among them: the last value of
    a repeated id wins) leave the same leaves, mins, largest priority and counts on the C path and
    on the Python path; inner sums agree to rounding (bit-equal for dyadic priorities)."""
    if LIB is None:
        pytest.skip(f"the C extension is not loaded: {native.REASON}")
    bufs = []
    for which in ("native", "python"):
        with monkeypatch.context() as m:
            if which == "python":
                m.setattr(native, "lib", None)
            bufs.append(make(MUJOCO, capacity=300, lanes=lanes, name=f"{name}{which[0]}", seed=2,
                             sampler=sb.Prioritized(alpha=0.6, beta=0.4)))
    fast, ref = bufs
    assert fast.ring.native_view is not None and ref.ring.native_view is None
    fused: list[Any] = []  # what each one-call update (_native.update_priorities) returned
    real = LIB.update_priorities
    monkeypatch.setattr(LIB, "update_priorities", lambda *a: fused.append(real(*a)) or fused[-1])
    rng = np.random.default_rng(lanes)
    for step in range(12):
        k = int(rng.integers(1, 120))
        lane = rng.integers(0, lanes, k) if lanes > 1 else 0
        p = rng.random(k) * 5 if step % 2 else np.floor(rng.random(k) * 512) / 8
        for b in bufs:
            if step == 6:
                b.clear()  # every id before is stale from now on
            b.push(transition(k * step, k), lane=lane, priority=p)
        held = fast.ring.held_ids()
        # rows held (some twice), and ids of rows overwritten or cleared since (stale: skipped)
        ids = np.concatenate([rng.choice(held, 200), held[:20], np.arange(10, dtype=np.int64)])
        q = rng.random(ids.size) * 3 if step % 3 else np.floor(rng.random(ids.size) * 512) / 8
        assert fast.update_priorities(ids, q) == ref.update_priorities(ids, q)
        ft, rt = fast.priorities.tree, ref.priorities.tree  # type: ignore[union-attr]
        assert np.array_equal(ft.leaves, rt.leaves) and np.array_equal(ft.mins, rt.mins)
        np.testing.assert_allclose(ft.sums, rt.sums, rtol=1e-12, atol=0)
        assert fast.priorities.max_priority == ref.priorities.max_priority  # type: ignore[union-attr]
        assert np.array_equal(fast.ring.stamp, ref.ring.stamp)
    assert len(fused) == 12 and None not in fused  # the C path made every update above
    for bad in ([np.nan], [-1.0], [np.inf]):
        for b in bufs:
            with pytest.raises(sb.FieldError, match="finite values"):
                b.update_priorities(b.ring.held_ids()[:1], np.array(bad))
    for b in bufs:
        with pytest.raises(sb.UnknownIdError, match="never named a row"):
            b.update_priorities(np.array([-1, 0], np.int64), np.ones(2))
        with pytest.raises(sb.UnknownIdError, match="never named a row"):
            b.update_priorities(np.array([10**12], np.int64), np.ones(1))


def test_a_stale_priority_update_changes_nothing_on_both_paths(path: str, make: Make, name: str) -> None:
    """Ids of rows overwritten or cleared since are skipped, their priorities count nowhere (not
    in the largest priority either); in a batch mixing them with current ids, a repeated id's
    last value wins."""
    buf = make(MUJOCO, capacity=8, name=name, sampler=sb.Prioritized(alpha=1.0, eps=0.0))
    old = buf.push(transition(0, 8), priority=np.ones(8))
    new = buf.push(transition(8, 4), priority=np.full(4, 2.0))  # laps old[:4]
    tree = buf.priorities.tree  # type: ignore[union-attr]
    before = (tree.sums.copy(), tree.mins.copy())
    assert buf.update_priorities(old[:4], np.full(4, 50.0)) == 0
    assert np.array_equal(tree.sums, before[0]) and np.array_equal(tree.mins, before[1])
    assert buf.priorities.max_priority == 2.0  # type: ignore[union-attr]
    ids = np.array([old[0], old[5], new[1], old[5], old[2]], np.int64)
    assert buf.update_priorities(ids, np.array([70.0, 3.0, 4.0, 5.0, 60.0])) == 3
    assert buf.priority(old[4:]).tolist() == [1.0, 5.0, 1.0, 1.0]
    assert buf.priority(new).tolist() == [2.0, 4.0, 2.0, 2.0]
    assert buf.priorities.max_priority == 5.0 and tree.total == 18.0  # type: ignore[union-attr]
    buf.clear()  # the rows keep their committed stamps, but no longer count
    assert buf.update_priorities(new, np.full(4, 9.0)) == 0 and tree.total == 0


def test_a_priority_update_leaves_used_up_rows_out_on_both_paths(path: str, make: Make, name: str) -> None:
    """Under max_use a row drawn max_use times keeps a leaf of 0 whatever priority it is given."""
    buf = make(MUJOCO, capacity=8, name=name, seed=1, sampler=sb.Prioritized(alpha=1.0, eps=0.0), max_use=1)
    ids = buf.push(transition(0, 4), priority=np.ones(4))
    used = np.sort(buf.sample(2, replace=False).index)
    assert buf.update_priorities(ids, np.array([2.0, 3.0, 4.0, 5.0])) == 4
    want = np.array([2.0, 3.0, 4.0, 5.0])
    want[np.searchsorted(ids, used)] = 0.0
    assert buf.priority(ids).tolist() == want.tolist()
    assert buf.priorities.max_priority == 5.0  # type: ignore[union-attr]


def test_priorities_at_the_leaf_bound_on_both_paths(path: str, make: Make, name: str) -> None:
    """With alpha 2 the largest priority is 1e140 (leaf 1e280): just below it is taken, just above
    refused with nothing changed, however the C path skips the bound check for smaller ones."""
    buf = make(MUJOCO, capacity=8, name=name, sampler=sb.Prioritized(alpha=2.0, eps=0.0))
    ids = buf.push(transition(0, 4), priority=[1.0, 2.0, 3.0, 4.0])
    assert buf.update_priorities(ids[:2], np.array([1e140 * (1 - 1e-12), 5.0])) == 2
    assert buf.priorities.max_priority == 1e140 * (1 - 1e-12)  # type: ignore[union-attr]
    before = buf.priorities.tree.sums.copy()  # type: ignore[union-attr]
    with pytest.raises(sb.FieldError, match="exceed 1e"):
        buf.update_priorities(ids[2:], np.array([1.0, 1e140 * (1 + 1e-12)]))
    with pytest.raises(sb.FieldError, match="exceed 1e"):
        buf.push(transition(4, 1), priority=np.array([1e141]))
    assert np.array_equal(buf.priorities.tree.sums, before)  # type: ignore[union-attr]
    assert buf.priority(ids).tolist()[1:] == [25.0, 9.0, 16.0]


@needs_lib
@pytest.mark.parametrize("lanes", [1, 3])
def test_current_and_known_ids_equal_python(make: Make, name: str, lanes: int) -> None:
    buf = make(MUJOCO, capacity=60, lanes=lanes, name=name)
    rg = buf.ring
    rng = np.random.default_rng(4)
    for j in range(5):
        buf.push(transition(30 * j, 30), lane=rng.integers(0, lanes, 30) if lanes > 1 else 0)
        if j == 3:
            buf.clear()
    rg.stamp[rng.choice(60, 6, replace=False)] += 1  # some rows being written
    ref = python_ring(rg)
    ids = np.concatenate([rng.integers(-5, 200, 500), [ring.INVALID, 2**62, -(2**63), 2**63 - 1]]).astype(np.int64)
    assert np.array_equal(rg.current(ids), ref.current(ids))
    held = rg.held_ids()
    assert held.size and rg.current(held).any() and not rg.current(held).all()
    assert np.array_equal(rg.check_ids(held, "x"), ref.check_ids(held, "x"))
    cursors = rg._lanes[:, 0]
    first_unborn = [int(cursors[lane]) * lanes + lane for lane in range(lanes)]  # the next id of each lane
    assert np.array_equal(rg.check_ids(np.array(first_unborn) - lanes, "x"), np.array(first_unborn) - lanes)
    for bad in ([-1], first_unborn[-1:], first_unborn[:1], [2**63 - 1], [-(2**63)]):
        with pytest.raises(sb.UnknownIdError) as a:
            rg.check_ids(np.array(bad, np.int64), "x")
        with pytest.raises(sb.UnknownIdError) as b:
            ref.check_ids(np.array(bad, np.int64), "x")
        assert str(a.value) == str(b.value)


@needs_lib
def test_prioritized_kernels_refuse_bad_input(make: Make, name: str) -> None:
    assert LIB is not None
    buf = make(MUJOCO, capacity=64, lanes=2, name=name, sampler=sb.Prioritized())
    buf.push(transition(0, 8), lane=0)
    tree, rg = buf.priorities.tree, buf.ring  # type: ignore[union-attr]
    stamp, cur = rg.native_view  # type: ignore[misc]
    plan, cap = tree.plan, tree.capacity
    u, out_i, out_f = np.zeros(4), np.empty(4, np.int64), np.empty(4)

    def draw(**kw: Any) -> Any:
        a = dict(sums=tree.sums, plan=plan, cap=cap, total=1.0, u=u, strat=True, stamp=stamp, cur=cur,
                 slots=out_i.copy(), leaves=out_f.copy(), ids=out_i.copy())
        a.update(kw)
        return LIB.tree_draw(*a.values())

    draw()  # fine as given
    cases: list[tuple[dict[str, Any], type[Exception]]] = [
        (dict(ids=np.empty(3, np.int64)), ValueError), (dict(leaves=np.empty(4, np.float32)), TypeError),
        (dict(stamp=stamp[:-1]), ValueError), (dict(cur=cur[:, :3].copy()), ValueError),
        (dict(cur=np.zeros((3, 8), np.int64)), ValueError), (dict(sums=tree.sums[:-1]), ValueError),
        (dict(cap=65), ValueError), (dict(u=np.zeros(4, np.float32)), TypeError),
        (dict(slots=np.empty(8, np.int64)[::2]), TypeError),
    ]
    for kw, exc in cases:
        with pytest.raises(exc):
            draw(**kw)
    leaves = np.ones(4)
    with pytest.raises(TypeError):
        LIB.weights(tree.mins, plan, cap, leaves, 0.4, np.empty(4))  # float64 out
    with pytest.raises(ValueError):
        LIB.weights(tree.mins, plan, cap, leaves, 0.4, np.empty(3, np.float32))
    with pytest.raises(ValueError, match="plan"):
        LIB.weights(tree.mins[:-1], plan, cap, leaves, 0.4, np.empty(4, np.float32))
    lock, prio = rg.lock.memory, buf.priorities._prio  # type: ignore[union-attr]

    def update(**kw: Any) -> Any:
        a = dict(lock=lock, ids=np.array([0, 2], np.int64), p=np.ones(2), leaves=np.ones(2), stamp=stamp, cur=cur,
                 sums=tree.sums, mins=tree.mins, plan=plan, cap=cap, prio=prio)
        a.update(kw)
        return LIB.update_priorities(*a.values())

    assert update() == 2  # fine as given: ids 0 and 2 are lane 0's rows 0 and 1, both current
    assert update(ids=np.array([0, 1], np.int64)) is None  # lane 1 has no row yet: the Python path raises
    assert update(ids=np.array([-2, 0], np.int64)) is None
    bad_updates: list[tuple[dict[str, Any], type[Exception]]] = [
        (dict(lock=lock[:32]), ValueError), (dict(p=np.ones(3)), ValueError), (dict(leaves=np.ones(1)), ValueError),
        (dict(stamp=stamp[:-2]), ValueError), (dict(cur=np.zeros((3, 8), np.int64)), ValueError),
        (dict(mins=tree.mins[:-1]), ValueError), (dict(sums=tree.sums[:-1]), ValueError), (dict(cap=65), ValueError),
        (dict(prio=prio[:0]), ValueError), (dict(ids=np.array([0, 2], np.int32)), TypeError),
        (dict(leaves=np.ones(2, np.float32)), TypeError), (dict(prio=prio.copy()[::2]), TypeError),
    ]
    ro = tree.sums.copy()
    ro.flags.writeable = False
    bad_updates.append((dict(sums=ro), TypeError))
    for kw, exc in bad_updates:
        with pytest.raises(exc):
            update(**kw)
    assert LIB.scan(np.array([1.0, 3.0])) == 3.0 and LIB.scan(np.empty(0)) == 0.0
    for bad in ([1.0, np.nan], [-0.5], [np.inf]):
        assert LIB.scan(np.array(bad)) == -1.0
    with pytest.raises(TypeError):
        LIB.scan(np.ones(2, np.float32))
    ids = np.array([0, 2], np.int64)
    with pytest.raises(ValueError):
        LIB.known(ids, np.zeros(12, np.int64))
    with pytest.raises(TypeError):
        LIB.known(ids.astype(np.int32), cur)
    with pytest.raises(ValueError):
        LIB.current(ids, stamp, cur, np.empty(3, np.bool_))
    with pytest.raises(ValueError):
        LIB.current(ids, stamp[:63], cur, np.empty(2, np.bool_))  # 2 lanes do not divide 63 slots
    ro = np.empty(2, np.bool_)
    ro.flags.writeable = False
    with pytest.raises(TypeError):
        LIB.current(ids, stamp, cur, ro)


@needs_lib
def test_push_itself_runs_in_c_for_its_usual_calls_and_the_method_for_the_rest(make: Make, name: str) -> None:
    """A uniform buffer's ``push`` (and ``add``) is a ``_native.BoundPush``: ``push(**fields)`` and
    ``push(dict)``, with ``lane=`` and ``episode=`` or without, push in C with no dict made; every
    other call gives what the Python method gives, errors included, and leaves the buffer as it was."""

    buf = make(MUJOCO, capacity=16, lanes=2, episodes=True, name=name)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(native, "lib", None)
        ref = make(MUJOCO, capacity=16, lanes=2, episodes=True, name=name + "r")
    assert type(buf.push) is LIB.BoundPush and type(buf.add) is LIB.BoundPush and buf.push.__self__ is buf
    assert isinstance(ref.push, types.MethodType)  # the Python method, bound as usual
    assert isinstance(make(MUJOCO, capacity=8, sampler=sb.Prioritized(), name=name + "p").push, types.MethodType)
    assert sb.ReplayBuffer.push.__doc__ == buf.push.__doc__ and sb.ReplayBuffer.push.__name__ == "push"
    rows = transition(0, 2)
    one = {k: v[0] for k, v in transition(2, 1).items()}
    for args, kwargs in (((), {**rows, "lane": 0, "episode": 1}), ((rows,), {"lane": 1, "episode": np.array([3, 4])}),
                         ((one,), {"lane": 0, "episode": 5}), ((), {**one, "episode": 6, "lane": np.array([1])})):
        assert np.array_equal(buf.push(*args, **kwargs), ref.push(*args, **kwargs))
    for args, kwargs, error in (
        ((), {**rows, "episode": 1}, "lane: this buffer has 2 lanes"),
        ((), {**rows, "lane": 0}, "episode: this buffer keeps episodes"),
        ((), {**rows, "lane": 0, "episode": 1, "priority": 1.0}, "priority: this buffer samples uniformly"),
        ((), {**rows, "obz": rows["obs"], "lane": 0, "episode": 1}, "unknown field 'obz'"),
        ((), {**{k: v for k, v in rows.items() if k != "obs"}, "lane": 0, "episode": 1}, "missing field 'obs'"),
        ((), {**rows, "done": rows["done"][:1], "lane": 0, "episode": 1}, "ragged batch"),
        ((), {**rows, "lane": 5, "episode": 1}, "lane"),
        ((rows,), {"lane": 0, "episode": 1, "obs": rows["obs"]}, "takes a mapping or keyword fields"),
    ):
        for b in (buf, ref):
            with pytest.raises((sb.FieldError, sb.CapacityError, TypeError), match=error):
                b.push(*args, **kwargs)
    assert block_bytes(buf) == block_bytes(ref)
    import pickle

    again = pickle.loads(pickle.dumps(buf.push))  # a bound method's pickle: the buffer's push
    assert np.array_equal(again(rows, lane=0, episode=7), ref.push(rows, lane=0, episode=7))
    other = sb.ReplayBuffer.attach(buf.handle)
    assert np.array_equal(other.push(rows, lane=1, episode=8), ref.push(rows, lane=1, episode=8))
    other.close()
    kept = sb.ReplayBuffer.attach(buf.handle).push  # as a bound method, it keeps its buffer object
    assert not kept.__self__.closed
    assert np.array_equal(kept(rows, lane=0, episode=9), ref.push(rows, lane=0, episode=9))
    with pytest.raises(sb.FieldError, match="priority: this buffer samples uniformly"):  # the method, for the rest
        kept(rows, lane=0, episode=9, priority=1.0)
    kept.__self__.close()
    assert block_bytes(buf) == block_bytes(ref)
    held = buf.push
    buf.close()  # a push callable still held does not keep the mapping
    with pytest.raises(sb.ClosedError):
        held(**rows, lane=0, episode=1)
    with pytest.raises(sb.ClosedError):
        buf.push(**rows, lane=0, episode=1)


LAYOUT_H = Path(native.__file__).with_name("layout.h")


def layout_h_defines() -> dict[str, int]:
    """Every ``#define NAME value`` of ``native/layout.h`` (its include guard aside), evaluated."""
    found: dict[str, int] = {}
    for line in LAYOUT_H.read_text().splitlines():
        m = re.match(r"#define\s+(\w+)\s+(.+?)\s*(/\*.*)?$", line)
        if m and not m.group(1).endswith("_H"):
            text = m.group(2).replace("(int64_t)", "")
            assert re.fullmatch(r"[-+*<>() 0-9]+", text), f"layout.h: {m.group(1)} is not a plain integer: {text}"
            found[m.group(1)] = int(eval(text))  # digits, operators and parentheses only (checked above)
    return found


def test_layout_h_states_the_python_layout() -> None:
    """Every constant the C files take from ``native/layout.h`` is the Python definition's number:
    a change on one side alone fails here."""
    from shmbuffer import frames
    from shmbuffer.protocol import layout
    from shmbuffer.shm import lock

    specs = {c.name: c for c in layout.columns(sb.Schema(x=((), "float32")), layout.Options(capacity=12, lanes=3))}
    python = {
        "LANE_WORDS": layout.LANE_WORDS, "LANE_CURSOR": layout.Lane.CURSOR, "LANE_BASE": layout.Lane.BASE,
        "STATS_WORDS": specs["_stats"].shape[0], "COUNTER_UPDATES": Counter.UPDATES, "COUNTER_INSERTED": Counter.INSERTED, "COUNTER_FROZEN": Counter.FROZEN, "COUNTER_REMOVED": Counter.REMOVED,
        "WRITERS": layout.WRITERS, "LOCK_SIZE": lock.SIZE, "LOCK_REPAIR": lock.REPAIR,
        "KIND_END": frames.END, "KIND_START": frames.START, "KIND_ZERO": frames.ZERO, "KIND_LEAD": frames.LEAD,
        "FANOUT": sumtree.FANOUT, "INVALID_ID": ring.INVALID,
    }
    assert specs["_writer_pid"].shape == (layout.WRITERS,) and specs["_mutex"].shape == (lock.SIZE,)
    assert {k: int(v) for k, v in python.items()} == layout_h_defines()
    if LIB is not None:  # the module's attributes come from the same header (a stale build fails here)
        assert {k: getattr(LIB, k) for k in python} == layout_h_defines()


ARITHMETIC_C = """
#include <stdio.h>
#include "layout.h"
static const int64_t V[] = {%(values)s};
#define NV (sizeof(V) / sizeof(V[0]))
#define OUT(x) printf("%%lld\\n", (long long)(x))
int main(void) {
    const int64_t lanes_[] = {1, 3, 4}, lcs[] = {5, 7};
    for (int a = 0; a < 3; a++)
        for (int b = 0; b < 2; b++)
            for (size_t i = 0; i < NV; i++) {
                int64_t lanes = lanes_[a], lc = lcs[b], v = V[i];
                OUT(slot_of(lanes - 1, v, lc)); OUT(row_id(v, lanes - 1, lanes)); OUT(lane_of_id(v, lanes));
                OUT(number_of_id(v, lanes)); OUT(slot_of_id(v, lanes, lc)); OUT(committed_stamp_of_id(v, lanes));
                OUT(first_row(v, V[(i + 1) %% NV], lc));
            }
    for (size_t i = 0; i < NV; i++) {
        int64_t v = V[i], w = V[(i + 3) %% NV];
        OUT(writing_stamp(v)); OUT(committed_stamp(v)); OUT(commit_stamp(writing_stamp(v))); OUT(number_of_stamp(v));
        OUT(is_committed(v)); OUT(next_row(v, w)); OUT(intact(v, w, v)); OUT(intact(v, v, v)); OUT(intact(w, v, v));
    }
    return 0;
}
"""


def test_layout_h_does_the_row_arithmetic_of_rows_py(tmp_path: Path) -> None:
    """The row arithmetic of ``native/layout.h`` (slots, ids, stamps, bounds) gives what
    ``protocol/rows.py`` gives, on ids and stamps of any value (wrapping as numpy's int64)."""
    from shmbuffer.protocol import rows

    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the layout.h check")
    values = [0, 1, 2, 3, 5, 6, 7, 11, 12, 13, 35, 1_000_003, -1, -2, -3, -7, -36, 2**62 - 1, 2**62, -(2**62),
              2**63 - 1, -(2**63), -(2**63) + 1]
    source = tmp_path / "arithmetic.c"
    source.write_text(ARITHMETIC_C % {"values": ", ".join(f"INT64_C({v})" if v > -(2**63) else "INT64_MIN" for v in values)})
    program = tmp_path / "arithmetic"
    subprocess.run([cc, "-std=c11", "-O2", "-Wall", "-Werror", "-I", str(LAYOUT_H.parent), str(source), "-o", str(program)],
                   check=True, capture_output=True)
    got = [int(x) for x in subprocess.run([str(program)], check=True, capture_output=True, text=True).stdout.split()]
    v = np.array(values, np.int64)
    nxt = np.roll(v, -1)
    expected: list[np.ndarray] = []
    for lanes in (1, 3, 4):
        for lc in (5, 7):
            table = np.zeros((len(v), 8), np.int64)
            table[:, int(Lane.CURSOR)], table[:, int(Lane.BASE)] = v, nxt
            per = [rows.slot(lanes - 1, v, lc), rows.row_id(v, lanes - 1, lanes), rows.lane_of(v, lanes),
                   rows.number_of(v, lanes), rows.slot_of_id(v, lanes, lc), rows.committed_of_id(v, lanes),
                   rows.bounds(table, lc)[0]]
            expected.append(np.stack([np.broadcast_to(np.asarray(x, np.int64), v.shape) for x in per], axis=1).reshape(-1))
    w = np.roll(v, -3)
    per = [rows.writing(v), rows.committed(v), rows.committed(v), rows.number_of_stamp(v), rows.is_committed(v),
           np.maximum(v, w),  # ring.py's reservation: a lane's next row, max(cursor, base)
           rows.intact(v, w, v), rows.intact(v, v, v), rows.intact(w, v, v)]
    expected.append(np.stack([np.asarray(x, np.int64) for x in per], axis=1).reshape(-1))
    assert got == np.concatenate(expected).tolist()


def test_every_c_file_is_built_and_shipped() -> None:
    """setup.py builds every C file of ``shmbuffer/native`` and MANIFEST.in puts them and the
    headers in the sdist (a file added on one side only would break a build from the sdist)."""
    root = LAYOUT_H.parents[2]
    setup = (root / "setup.py").read_text()
    listed = set(re.findall(r'"(\w+\.c)"', setup))
    assert listed == {p.name for p in LAYOUT_H.parent.glob("*.c")}
    assert {"layout.h", "native.h"} <= set(re.findall(r'"(\w+\.h)"', setup))
    assert "include shmbuffer/native/*.c shmbuffer/native/*.h" in (root / "MANIFEST.in").read_text().splitlines()


def test_the_lanes_column_has_lane_words_per_lane() -> None:
    from shmbuffer.protocol.layout import LANE_WORDS, Options, columns

    specs = {c.name: c for c in columns(sb.Schema(x=((), "float32")), Options(capacity=12, lanes=3))}
    assert specs["_lanes"].shape == (3, LANE_WORDS)
