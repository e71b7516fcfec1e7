"""update and delete (protocol/edits.py): what every reader sees after them."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shmbuffer as sb

from .conftest import SMALL, small_row

Make = Callable[..., sb.ReplayBuffer]
SCHEMA = sb.Schema(x=((), "int64"), y=((2,), "float32"))


def _rows(k: int, at: int = 0) -> dict[str, np.ndarray]:
    x = np.arange(at, at + k)
    return {"x": x, "y": np.stack([x, -x], axis=1).astype(np.float32)}


@pytest.mark.parametrize("lanes", [1, 2])
@pytest.mark.parametrize("max_use", [None, 5])
def test_after_delete_every_reader_agrees_on_positions(lanes: int, max_use: int | None, make: Make, name: str) -> None:
    """len, get (ints, negative ints, slices, arrays), view and export name the same rows, oldest
    first, once rows were deleted."""
    buf = make(SCHEMA, 8 * lanes, lanes=lanes, max_use=max_use, name=name)
    for ln in range(lanes):
        buf.push(_rows(8, 100 * ln), lane=ln)
    doomed = np.array([i for i in buf.get(slice(0, len(buf))).index.tolist() if i % 3 == 0])
    assert buf.delete(doomed) == doomed.size
    left = buf.export()
    assert len(buf) == left["index"].size == 8 * lanes - doomed.size
    every = buf.get(slice(0, len(buf)))
    assert np.array_equal(every.index, left["index"]) and np.array_equal(every.x, left["x"])
    assert not np.isin(every.index, doomed).any()
    for i in range(len(buf)):
        assert int(buf.get(i).x) == int(left["x"][i]) == int(buf.get(i - len(buf)).x)
    assert np.array_equal(buf.get(np.array([0, -1])).x, left["x"][[0, -1]])
    with pytest.raises(IndexError, match="out of range"):  # sb.PositionError: an EmptyBufferError too
        buf.get(len(buf))
    mine = left["index"][left["index"] % lanes == 0]
    runs = np.split(mine, np.flatnonzero(np.diff(mine // lanes) != 1) + 1)
    assert len(runs) > 1
    first = runs[0]
    assert np.array_equal(buf.view(0, first.size).index, first)  # a run of rows that are all there
    with pytest.raises(ValueError, match="deleted or used up"):
        buf.view(0, first.size + 1)
    at = first.size
    assert np.array_equal(buf.view(at, at + runs[1].size).index, runs[1])


@pytest.mark.parametrize("sampler", ["uniform", "prioritized"])
@pytest.mark.parametrize("max_use", [None, 5])
def test_a_buffer_emptied_by_delete_says_so_at_once(sampler: str, max_use: int | None, make: Make, name: str) -> None:
    s = sb.Prioritized(0.6, 0.4) if sampler == "prioritized" else sb.Uniform()
    buf = make(SCHEMA, 8, sampler=s, max_use=max_use, name=name)
    buf.push(_rows(8))
    buf.delete(buf.get(slice(0, 8)).index)
    assert len(buf) == 0
    began = time.monotonic()
    for replace in (True, False):
        with pytest.raises(sb.EmptyBufferError, match="every row was deleted") as e:
            buf.sample(4, replace=replace)
        assert "max_use" not in str(e.value)
    assert time.monotonic() - began < 0.5  # said at once, not after re-drawing for a second
    with pytest.raises(sb.EmptyBufferError):
        buf.get(0)


def test_used_up_and_deleted_rows_are_told_apart(make: Make, name: str) -> None:
    buf = make(SCHEMA, 8, max_use=1, name=name)
    buf.push(_rows(8))
    buf.delete(buf.get(slice(0, 3)).index)
    assert len(buf.sample(5, replace=False)) == 5  # every row left, once
    assert len(buf) == 0
    with pytest.raises(sb.EmptyBufferError, match=r"5 have been drawn max_use=1 times, 3 were deleted"):
        buf.sample(1)


def test_a_batch_larger_than_the_uses_left_says_so(make: Make, name: str) -> None:
    """Two fresh rows under ``max_use=2`` serve 4 draws: a sample of 5 says that, not that the rows
    "have been drawn max_use=2 times" (they were, by the refused batch itself, and given back)."""
    buf = make(SCHEMA, 8, max_use=2, name=name)
    buf.push(_rows(2))
    with pytest.raises(sb.EmptyBufferError, match=r"has 4 draws left \(max_use=2, 2 rows\), fewer than the batch's 5") as e:
        buf.sample(5)
    assert "have been drawn" not in str(e.value)
    assert buf.uses(buf.get(slice(None)).index).tolist() == [0, 0] and len(buf.sample(4)) == 4


def test_update_rows_by_id(make: Make, name: str) -> None:
    buf = make(SMALL, 4, sampler=sb.Prioritized(alpha=1.0, eps=0.0), name=name)
    ids = buf.push(obs=np.zeros((3, 3)), reward=np.zeros(3))
    assert buf.update(ids[1:], reward=[5.0, 6.0]) == 2
    got = buf.get(slice(None))
    assert got.reward.tolist() == [0, 5, 6] and (got.obs == 0).all()      # the fields not given stay
    assert buf.update([0], {"obs": np.ones(3), "priority": 7.0}) == 1
    assert buf.get(0).obs.tolist() == [1, 1, 1] and buf.priority([0]).tolist() == [7.0]
    buf.push(obs=np.zeros((3, 3)), reward=np.zeros(3))                    # ids 0..1 overwritten
    assert buf.update([0, 1, 2], reward=9.0) == 1                          # stale ids are skipped
    assert buf.get(slice(None)).reward.tolist() == [9, 0, 0, 0]
    with pytest.raises(sb.FieldError, match="no field 'bogus'"):
        buf.update([2], bogus=1)
    with pytest.raises(sb.UnknownIdError):
        buf.update([99], reward=1.0)
    with pytest.raises(sb.FieldError, match="field 'obs'"):
        buf.update([2], obs=np.zeros(4))
    buf.freeze()
    with pytest.raises(sb.ReadOnlyError):
        buf.update([2], reward=1.0)


class _Spy(dict[str, Any]):
    """The block's field views, calling ``during`` before each column of an update is copied."""

    def __init__(self, fields: dict[str, np.ndarray], during: Callable[[], None]) -> None:
        super().__init__(fields)
        self.during = during

    def __getitem__(self, key: str) -> Any:
        col = super().__getitem__(key)
        spy = self

        class Column:
            def __setitem__(self, where: Any, value: Any) -> None:
                spy.during()
                col[where] = value

        return Column()


def test_a_reader_never_sees_a_row_half_updated(make: Make, name: str) -> None:
    buf = make(SMALL, 8, name=name, seed=0)
    buf.push(obs=np.zeros((8, 3)), reward=np.zeros(8))
    block = buf.block
    real = block.fields
    seen: list[int] = []

    def during() -> None:
        # mid-update: the row being updated is odd, so samples re-draw it and take refuses it
        block.fields = real
        for _ in range(20):
            batch = buf.sample(8)
            seen.extend(batch.index.tolist())
            assert (batch.obs == batch.reward[:, None]).all()
        with pytest.raises(sb.EmptyBufferError):
            buf.take([3])
        block.fields = spy

    spy = _Spy(real, during)
    block.fields = spy
    try:
        assert buf.update([3], obs=np.full(3, 7.0), reward=7.0) == 1
    finally:
        block.fields = real
    assert seen and 3 not in seen and len(set(seen)) == 7
    assert buf.take([3]).reward.tolist() == [7.0]                     # committed again afterwards


@pytest.mark.parametrize("pure", [False, True])
def test_an_update_of_other_rows_loses_no_row_of_take_or_epoch(
    make: Make, name: str, pure: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # an update anywhere moves Counter.UPDATES, which discards the whole gather it spans; take
    # and epoch cannot re-draw, so they must gather the untouched rows again, not drop them
    from shmbuffer import native
    from shmbuffer.protocol.ring import Ring

    if pure:
        monkeypatch.setattr(native, "lib", None)
    buf = make(SMALL, 64, name=name)
    buf.push(obs=np.zeros((64, 3)), reward=np.arange(64.0))
    cleared = Ring.cleared
    pending: list[int] = []

    def spy(self: Ring, ids: np.ndarray, lowest: int | None = None) -> np.ndarray:
        if pending:  # called by gather after its copies: another process updates row 63 now
            pending.pop()
            buf.update([63], reward=1000.0)
        return cleared(self, ids, lowest)

    monkeypatch.setattr(Ring, "cleared", spy)
    pending.append(1)
    got = np.concatenate([b.reward for b in buf.epoch(16, shuffle=False)])
    assert not pending and got[:63].tolist() == list(range(63))
    pending.append(1)
    assert buf.take([0, 1]).reward.tolist() == [0.0, 1.0] and not pending


@pytest.mark.parametrize("pure", [False, True])
def test_updates_beginning_during_every_large_gather_do_not_starve_reads(
    make: Make, name: str, pure: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a process updating some row without pause begins an update during nearly every gather of
    # many large rows (a sample of 2048 Atari frames failed every time with WaitTimeout); the
    # gather reads such rows again in small pieces, each under its own count
    from shmbuffer import native
    from shmbuffer.protocol import gather
    from shmbuffer.protocol.layout import Counter
    from shmbuffer.protocol.ring import Ring

    if pure:
        monkeypatch.setattr(native, "lib", None)
    buf = make(sb.Schema(obs=((16384,), "float32"), x=((), "int64")), 32, name=name, seed=0)
    buf.push(obs=np.zeros((32, 16384), np.float32), x=np.arange(32))
    assert gather._PIECE_BYTES // buf.schema.row_bytes < 16
    cleared = Ring.cleared

    def spy(self: Ring, ids: np.ndarray, lowest: int | None = None) -> np.ndarray:
        if ids.size > gather._PIECE_BYTES // buf.schema.row_bytes:  # after a large gather's copies
            buf.block.counters[Counter.UPDATES] += 1                  # an update began meanwhile
        return cleared(self, ids, lowest)

    monkeypatch.setattr(Ring, "cleared", spy)
    batch = buf.sample(16)
    assert (batch.x == batch.index).all()
    assert buf.get(slice(None)).x.tolist() == list(range(32))
    assert buf.take(np.arange(16)).x.tolist() == list(range(16))
    assert [len(b) for b in buf.epoch(32, shuffle=False)] == [32]


def test_distinct_rows_beyond_those_left_after_deletes(make: Make, name: str) -> None:
    # len(buf) leaves deleted rows out; sample(replace=False) must say so, not spin for a second
    # and raise WaitTimeout as if rows were being written
    buf = make(sb.Schema(x=((), "int64")), 10, name=name, seed=0)
    buf.push(x=np.arange(10))
    assert buf.delete([0, 1, 2, 3, 4]) == 5 and len(buf) == 5
    with pytest.raises(sb.EmptyBufferError, match="only 5 rows"):
        buf.sample(8, replace=False)
    assert sorted(buf.sample(5, replace=False).x.tolist()) == [5, 6, 7, 8, 9]


def test_delete_rows(make: Make, name: str, tmp_path: Path) -> None:
    buf = make(SMALL, 10, sampler=sb.Prioritized(), name=name, seed=1)
    buf.push(obs=np.arange(6.0)[:, None] * np.ones(3), reward=np.arange(6.0))
    assert len(buf) == 6
    assert buf.delete([1, 4, 4]) == 2 and buf.delete([1]) == 0
    assert len(buf) == 4 and buf.size == 4
    assert buf.priority([1, 4]).tolist() == [0.0, 0.0]
    for _ in range(50):
        assert not {1, 4} & set(buf.sample(8).index.tolist())
    with pytest.raises(sb.EmptyBufferError):
        buf.take([1])
    assert sb.export(buf)["index"].tolist() == [0, 2, 3, 5]
    buf.save(tmp_path / "s")
    with sb.load(tmp_path / "s", name=name + "l") as back:
        assert len(back) == 4 and sb.export(back)["index"].tolist() == [0, 2, 3, 5]
    buf.push(obs=np.zeros((8, 3)), reward=np.zeros(8))       # rows 4..13: row 4 is still deleted
    assert len(buf) == 9
    buf.push(small_row(0))                                         # the ring comes round: 10 rows held again
    assert len(buf) == 10


def test_used_up_rows_do_not_count(make: Make, name: str) -> None:
    buf = make(SMALL, 10, max_use=1, name=name, seed=0)
    buf.push(obs=np.zeros((6, 3)), reward=np.zeros(6))
    batch = buf.sample(4, replace=False)
    assert len(buf) == 2 and len(batch) == 4
    buf.sample(2, replace=False)
    assert len(buf) == 0


def test_updates_from_another_process_are_never_seen_torn(make: Make, name: str, procs: list[Any]) -> None:
    """A process rewrites every row over and over (a large field, then a small one); the learner
    samples meanwhile: every row it gets has both fields of one update."""
    import multiprocessing as mp

    schema = sb.Schema(obs=((300,), "float32"), reward=((), "float32"))
    buf = make(schema, 8, name=name, seed=0)
    buf.push(obs=np.zeros((8, 300)), reward=np.zeros(8))
    p = mp.get_context("fork").Process(target=_updater, args=(buf.handle, 3000))
    procs.append(p)
    p.start()
    samples = 0
    while p.is_alive() or not samples:
        batch = buf.sample(8)
        assert (batch.obs == batch.reward[:, None]).all()
        samples += 1
    p.join(30)
    assert p.exitcode == 0
    assert (buf.get(slice(None)).reward == 3000).all()


def _updater(handle: sb.BufferHandle, rounds: int) -> None:
    buf = sb.ReplayBuffer.attach(handle)
    try:
        wide = np.ones((8, 300), np.float32)
        for v in range(1, rounds + 1):
            assert buf.update(np.arange(8), obs=wide * v, reward=float(v)) == 8
    finally:
        buf.close()


def _steps(ts: range, done_at: int | None = None) -> dict[str, np.ndarray]:
    t = np.array(list(ts))
    return {"obs": np.stack([t, t], 1).astype(np.float32), "next_obs": np.stack([t + 1, t + 1], 1).astype(np.float32),
            "reward": t.astype(np.float32), "done": t == done_at}


NEXT_OF = sb.Schema(obs=((2,), "float32"), next_obs=((2,), "float32"), reward=((), "float32"), done=((), "bool"))


def test_update_cannot_end_an_episode_that_goes_on_with_next_of(make: Make, name: str) -> None:
    """With ``next_of`` an episode's last step is followed by an end row holding its final
    observation; a step whose next row goes on with its episode cannot become a last step in
    place. ``update`` refuses it, naming the field, and changes nothing; the lane's newest step
    (its next observation not stored yet) may be ended, as SB3 truncates a trajectory."""
    buf = make(NEXT_OF, 16, next_of="obs", episodes=True, name=name)
    ids = buf.push(_steps(range(4)), episode=0)
    before = buf.export()
    with pytest.raises(sb.FieldError, match=r"'done'.*goes on"):
        buf.update(ids[1], done=True, reward=5.0)
    after = buf.export()
    assert all(np.array_equal(before[k], after[k]) for k in before)
    assert buf.update(ids[1], done=False, reward=5.0) == 1  # no end: any row
    assert buf.update(ids[-1], done=True) == 1  # the newest: its next row is not pushed yet
    buf.push(_steps(range(10, 12)), episode=1)  # the next episode starts after it
    assert buf.get(slice(None)).reward.tolist() == [0.0, 5.0, 2.0, 10.0]


def test_take_of_a_deleted_row_says_it_was_removed(make: Make, name: str) -> None:
    """``take`` of a deleted row (or one a dead or failed push left empty) says the row was lost or
    deleted, not "overwritten, cleared or being written"; a row overwritten says that."""
    buf = make(SCHEMA, 4, name=name)
    ids = buf.push(_rows(4))
    buf.delete(ids[1])
    with pytest.raises(sb.EmptyBufferError, match="was deleted") as e:
        buf.take(ids[1:2])
    assert "overwritten" not in str(e.value)
    buf.push(_rows(1, 4))  # overwrites id 0
    with pytest.raises(sb.EmptyBufferError, match=r"overwritten.*ids \[1\]: a row was lost"):
        buf.take(ids[:2])
