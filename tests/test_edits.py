"""update and delete (protocol/edits.py): what every reader sees after them."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import pytest

import shmbuffer as sb

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
    with pytest.raises(sb.EmptyBufferError, match="out of range"):
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
