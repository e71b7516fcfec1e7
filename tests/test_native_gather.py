"""The C gather and frame stacks (``native/gather.c``) against the Python reference: the same bytes
and intact masks gathered, the same stacks; the kernels refuse bad input instead of crashing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import shmbuffer as sb
from shmbuffer import native
from shmbuffer.protocol import ring
from shmbuffer.protocol.gather import gather

from .conftest import LIB, MUJOCO, needs_lib, transition

Make = Callable[..., sb.ReplayBuffer]


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
