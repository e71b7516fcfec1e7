"""``protocol/by_position.py`` and ``protocol/census.py``: what the facades and ``top`` ask of a buffer
by slot and by place in a lane, checked against rows whose content names their id."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

import shmbuffer as sb
from shmbuffer.protocol import by_position, census

from .conftest import SMALL

Make = Callable[..., sb.ReplayBuffer]


def push_named(buf: sb.ReplayBuffer, lane: int, k: int) -> np.ndarray:
    """``k`` rows into ``lane``, each row's reward its own id once pushed (written by ``update``)."""
    out = []
    for part in np.array_split(np.arange(k), -(-k // buf.lane_capacity)):  # a push fits its lane
        ids = buf.push({"obs": np.zeros((part.size, 3), np.float32), "reward": np.zeros(part.size, np.float32)}, lane=lane)
        buf.update(ids, reward=ids.astype(np.float32))
        out.append(ids)
    return np.concatenate(out)


@pytest.mark.parametrize("lanes", [1, 3])
def test_slots_ids_and_places_agree_with_the_rows(make: Make, name: str, lanes: int) -> None:
    buf = make(SMALL, 12 * lanes, name=name, lanes=lanes)
    for lane in range(lanes):
        push_named(buf, lane, 5 + 4 * lane)  # lane 2 laps: 13 rows in 12 slots
    ids = by_position.live(buf)
    slots = by_position.slots_of(buf, ids)
    assert np.array_equal(buf.column("reward")[slots], ids)  # each id's slot holds its row
    assert np.array_equal(by_position.ids_at(buf, slots), ids)
    position, lane = by_position.in_lane(buf, ids)
    number = ids // lanes
    assert np.array_equal(lane, ids % lanes) and np.array_equal(position, number % buf.lane_capacity)
    assert np.array_equal(by_position.lane_slots(buf, lane, number), slots)
    assert np.array_equal(by_position.row_ids(buf, number, lane), ids)
    stop, written = by_position.lanes(buf)
    assert written.tolist() == [5 + 4 * ln for ln in range(lanes)] and np.array_equal(stop, written)
    last, since = by_position.newest(buf, np.arange(lanes))
    assert np.array_equal(last, stop - 1) and since.all()
    free = by_position.free(buf)
    assert set(free.tolist()) == set(range(buf.capacity)) - set(slots.tolist())


def test_the_newest_rows_at_a_place_and_a_clear(make: Make, name: str) -> None:
    buf = make(SMALL, 16, name=name, lanes=2)
    push_named(buf, 0, 11)  # lane 0 (8 slots): rows 0..10, slots 0..2 lapped once
    push_named(buf, 1, 3)
    place = np.array([1, 5, 1, 5])
    lane = np.array([0, 0, 1, 1])
    rows, last = by_position.newest_at(buf, place, lane)
    assert rows.tolist() == [9, 5, 1, -3] and last.tolist() == [10, 10, 2, 2]
    ids = by_position.row_ids(buf, rows, lane)
    assert by_position.cleared(buf, ids).tolist() == [False, False, False, True]  # lane 1 never reached place 5
    buf.clear()
    assert by_position.cleared(buf, ids).all()
    assert not by_position.newest(buf, np.arange(2))[1].any()
    assert by_position.free(buf).size == buf.capacity and by_position.live(buf).size == 0
    push_named(buf, 0, 2)
    stop, written = by_position.lanes(buf)
    assert written.tolist() == [2, 0] and stop[0] > 2  # rows since the clear; the cursor goes on


def test_a_one_lane_buffer_by_slot(make: Make, name: str) -> None:
    buf = make(SMALL, 8, name=name)
    push_named(buf, 0, 5)
    assert by_position.next_slot(buf) == 5 and by_position.cursor(buf) == 5
    assert by_position.held(buf, np.arange(8)).tolist() == [True] * 5 + [False] * 3
    push_named(buf, 0, 5)  # laps: rows 2..9 held, slots 2..7 then 0, 1
    assert by_position.next_slot(buf) == 2 and by_position.cursor(buf) == 10 and by_position.held(buf, np.arange(8)).all()
    buf.clear()
    assert by_position.next_slot(buf) == 0 and not by_position.held(buf, np.arange(8)).any()
    assert by_position.cursor(buf) >= 10  # the cursor never goes back: a push by anyone moves it on


def test_write_free_writes_only_where_no_row_is(make: Make, name: str) -> None:
    buf = make(SMALL, 8, name=name)
    ids = push_named(buf, 0, 4)
    buf.delete(ids[1:2])
    by_position.write_free(buf, np.arange(8), "reward", np.full(8, -1.0, np.float32))
    assert buf.column("reward").tolist() == [0, -1, 2, 3, -1, -1, -1, -1]
    with pytest.raises(sb.UnknownIdError, match="update_priorities"):
        by_position.known(buf, [0, 99], "update_priorities")


def test_a_census_counts_rows_per_writer(make: Make, name: str) -> None:
    buf = make(SMALL, 16, name=name, lanes=2)
    before = census.take(buf)
    push_named(buf, 0, 5)
    push_named(buf, 1, 3)
    c = census.take(buf)
    assert c.rows == 8 and c.inserted == 8 and not c.removed and c.writing.size == 0
    me = int(np.flatnonzero(c.writer_pid)[0])
    assert c.held[me] == 8 and c.held.sum() == 8
    assert c.cursors.tolist() == [5, 3]
    assert census.pushed(buf, before.cursors, c.cursors)[me] == pytest.approx(8)
    buf.delete(np.array([0]))
    c = census.take(buf)
    assert c.removed and c.held[me] == 7 and c.device_lag_rows is None
