"""Save / load (the file format, golden files, damaged files), saving while writers run, and the
plain numpy export / import."""

from __future__ import annotations

import base64
import json
import multiprocessing as mp
import os
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file

import shmbuffer as sb
from shmbuffer import persistence
from shmbuffer.protocol.layout import Options
from shmbuffer.shm import segment

from .conftest import MUJOCO, SMALL, copy_through, discard, seq_of, small_row, transition
from .golden import make_golden

Make = Callable[..., sb.ReplayBuffer]
GOLDEN = Path(__file__).resolve().parent / "golden" / "v1"
GOLDEN_V2 = GOLDEN.parent / "v2"
GOLDEN_V3 = GOLDEN.parent / "v3"
ROW = MUJOCO.row_bytes + 1
"""Bytes a MUJOCO row takes in a save: its fields and ``_present``."""


@pytest.fixture
def loaded() -> Iterator[list[sb.ReplayBuffer]]:
    """Buffers made by ``load``: closed and unlinked after the test."""
    made: list[sb.ReplayBuffer] = []
    yield made
    discard(made)


def push_lane(buf: sb.ReplayBuffer, lane: int, k: int, **kw: Any) -> np.ndarray:
    """Push ``k`` rows into ``lane`` whose values derive from their ids (``n * lanes + lane``);
    only correct while no one else pushes into that lane."""
    n0 = int(buf.ring.bounds()[1][lane])
    ids = (n0 + np.arange(k)) * buf.lanes + lane
    got = buf.push(transition(ids), lane=lane, **kw)
    assert np.array_equal(got, ids)
    return ids


def check_file(path: Path) -> dict[str, Any]:
    """Read a save with the safetensors package; check that every lane's rows are its consecutive
    row numbers [first, stop), each row intact and the row with that id, or a hole (``_present``
    0), zeros in every tensor. Returns meta.json."""
    meta = json.loads((path / "meta.json").read_text())
    tensors = load_file(str(path / "rows.safetensors"))
    lanes = len(meta["lanes"])
    ids = np.concatenate([np.arange(ln["first"], ln["stop"]) * lanes + i for i, ln in enumerate(meta["lanes"])])
    assert meta["rows"] == ids.size
    present = tensors["_present"]
    assert present.dtype == np.bool_ and present.shape == (ids.size,)
    assert np.array_equal(seq_of({k: v[present] for k, v in tensors.items()}), ids[present])
    assert all(not v[~present].any() for v in tensors.values())
    assert {t["name"] for t in meta["tensors"]} == set(tensors)
    for t in meta["tensors"]:
        assert list(tensors[t["name"]].shape) == t["shape"]
    return meta


# -- round trips ---------------------------------------------------------------------------------------
def test_uniform_round_trip(make: Make, loaded: list, name: str, tmp_path: Path) -> None:
    buf = make(MUJOCO, capacity=100, name=name)
    buf.push(transition(0, 80))
    buf.push(transition(80, 50))  # wraps: rows 30..129 stay
    buf.sample(7)
    out = sb.save(buf, tmp_path / "ckpt")
    assert out["rows"] == 100 and out["dropped"] == 0 and not out["moved"]
    meta = check_file(tmp_path / "ckpt")
    assert meta["format"] == "shmbuffer" and meta["format_version"] == 1
    assert meta["lanes"] == [{"first": 30, "stop": 130, "base": 0}]
    assert meta["stats"] == buf.stats and meta["sampler_state"] is None
    assert sb.Schema.from_json(meta["schema"]) == MUJOCO and meta["options"] == buf.options.to_json()
    tensors = load_file(str(tmp_path / "ckpt" / "rows.safetensors"))
    assert set(tensors) == {*MUJOCO.names, "_present"} and tensors["_present"].all()

    new = sb.load(tmp_path / "ckpt", seed=3)
    loaded.append(new)
    assert new.owner and new.name != buf.name and len(new) == 100 and new.full
    assert new.stats["inserted"] == 130 and new.stats["sampled"] == 7
    rows = new.get(slice(None))
    assert np.array_equal(rows.index, np.arange(30, 130)) and np.array_equal(seq_of(rows), rows.index)
    # the same seed draws the same ids from the original and from the copy
    again = sb.ReplayBuffer.attach(buf.handle, seed=3)
    try:
        for _ in range(3):
            a, b = again.sample(64), new.sample(64)
            assert np.array_equal(a.index, b.index)
            assert np.array_equal(seq_of(b), b.index)
    finally:
        again.close()
    # row ids go on where they stopped
    assert new.push(transition(130, 2)).tolist() == [130, 131]
    assert seq_of(new.get(-1)) == 131


def test_prioritized_round_trip(make: Make, loaded: list, name: str, tmp_path: Path) -> None:
    """Two lanes, episodes, max_use: rows, ids, episodes, leaves, uses and the largest priority
    come back, and the same seed then draws the same rows, round after round."""
    opts: dict[str, Any] = {"sampler": sb.Prioritized(alpha=0.7, beta=0.5), "max_use": 4, "lanes": 2, "episodes": True}
    buf = make(MUJOCO, capacity=64, name=name, seed=0, **opts)
    rng = np.random.default_rng(1)
    for i in range(6):
        lane = i % 2
        push_lane(buf, lane, 10, episode=i, priority=rng.random(10) * 5)
    batch = buf.sample(16)
    buf.update_priorities(batch, rng.random(16) * 20)
    for _ in range(5):
        buf.sample(16)
    sb.save(buf, tmp_path / "p")
    meta = check_file(tmp_path / "p")
    assert meta["sampler_state"] == {"max_priority": buf.priorities.max_priority}
    tensors = load_file(str(tmp_path / "p" / "rows.safetensors"))
    ring, prios = buf.ring, buf.priorities
    ids = buf.export()["index"]  # every row saved, used-up ones too (get's positions skip those)
    slots = ring.slots(ids)
    assert np.array_equal(tensors["_leaf"], prios.tree.leaves[slots])
    assert np.array_equal(tensors["_uses"], prios.uses[slots]) and tensors["_uses"].max() > 0
    assert np.array_equal(tensors["_episode"], buf.block.episode[slots])

    new = sb.load(tmp_path / "p", seed=9)
    loaded.append(new)
    assert new.options == buf.options and new.stats == buf.stats
    assert np.array_equal(sb.export(new)["index"], ids)
    assert np.array_equal(new.get(slice(None)).index, buf.get(slice(None)).index) and len(new) == len(buf)
    assert np.array_equal(new.priorities.tree.leaves[new.ring.slots(ids)], tensors["_leaf"])
    assert new.priorities.tree.total == prios.tree.total and new.priorities.max_priority == prios.max_priority
    assert np.array_equal(sb.export(new)["episode"], tensors["_episode"])
    again = sb.ReplayBuffer.attach(buf.handle, seed=9)
    try:
        for _ in range(6):  # uses run out along the way, identically in both
            a, b = again.sample(8), new.sample(8)
            assert np.array_equal(a.index, b.index) and np.array_equal(a.weight, b.weight)
            assert np.array_equal(seq_of(b), b.index)
        assert np.array_equal(new.priorities.uses, prios.uses)
    finally:
        again.close()


def test_capacity_may_change_while_the_rows_fit(make: Make, loaded: list, name: str, tmp_path: Path) -> None:
    buf = make(MUJOCO, capacity=20, lanes=2, name=name, seed=0)
    for lane in (0, 1, 0):
        push_lane(buf, lane, 8)  # lane 0 wraps: rows 6..15 stay
    sb.save(buf, tmp_path / "c")
    ids = buf.get(slice(None)).index
    big = sb.load(tmp_path / "c", capacity=100)
    loaded.append(big)
    assert big.capacity == 100 and big.lane_capacity == 50
    assert np.array_equal(big.get(slice(None)).index, ids) and len(big) == len(buf) == 18
    assert np.array_equal(seq_of(big.get(slice(None))), ids)
    assert push_lane(big, 1, 3).tolist() == [17, 19, 21]  # ids go on in each lane
    small = sb.load(tmp_path / "c", capacity=20)
    loaded.append(small)
    assert np.array_equal(small.get(slice(None)).index, ids)
    with pytest.raises(sb.CapacityError, match=r"lanes of 5 rows, but a lane .* holds 10 rows: expected capacity >= 20"):
        sb.load(tmp_path / "c", name=name + "x", capacity=10)
    with pytest.raises(sb.CapacityError, match="positive multiple of the 2 lanes"):
        sb.load(tmp_path / "c", name=name + "x", capacity=21)
    assert not os.path.exists(segment.path_of(name + "x"))


def test_every_dtype_and_a_large_field(make: Make, loaded: list, name: str, tmp_path: Path) -> None:
    schema = sb.Schema(
        frame=((2, 24, 24), "uint8"), f16=((3,), "float16"), c64=((2,), "complex64"), c128=((), "complex128"),
        i8=((), "int8"), u64=((), "uint64"), i16=((2,), "int16"), flag=((), "bool"),
    )
    rng = np.random.default_rng(0)
    k = 37
    data = {
        "frame": rng.integers(0, 255, (k, 2, 24, 24), dtype=np.uint8),
        "f16": rng.normal(size=(k, 3)).astype(np.float16),
        "c64": (rng.normal(size=(k, 2)) + 1j * rng.normal(size=(k, 2))).astype(np.complex64),
        "c128": rng.normal(size=k) + 1j * rng.normal(size=k),
        "i8": rng.integers(-128, 127, k, dtype=np.int8),
        "u64": rng.integers(0, 2**63, k, dtype=np.uint64) * 2 + 1,
        "i16": rng.integers(-3000, 3000, (k, 2), dtype=np.int16),
        "flag": rng.random(k) < 0.5,
    }
    buf = make(schema, capacity=40, name=name)
    buf.push(data)
    sb.save(buf, tmp_path / "d")
    tensors = load_file(str(tmp_path / "d" / "rows.safetensors"))
    assert tensors["c64"].dtype == np.float32 and tensors["c64"].shape == (k, 2, 2)
    assert np.array_equal(tensors["c64"].view(np.complex64)[..., 0], data["c64"])
    assert np.array_equal(tensors["c128"].view(np.complex128)[..., 0], data["c128"])
    for n in ("frame", "f16", "i8", "u64", "i16", "flag"):
        assert tensors[n].dtype == data[n].dtype and np.array_equal(tensors[n], data[n]), n
    new = sb.load(tmp_path / "d")
    loaded.append(new)
    rows = new.get(slice(None))
    for n, a in data.items():
        assert rows[n].dtype == a.dtype and np.array_equal(rows[n], a), n
    # export sees the same, and from_arrays makes a buffer of it
    exported = sb.export(new)
    assert np.array_equal(exported["index"], np.arange(k))
    copy = sb.from_arrays(schema, exported)
    loaded.append(copy)
    assert copy.capacity == k and all(np.array_equal(copy.get(slice(None))[n], a) for n, a in data.items())


def test_empty_and_cleared_buffers(make: Make, loaded: list, name: str, tmp_path: Path) -> None:
    buf = make(MUJOCO, capacity=16, lanes=2, name=name)
    sb.save(buf, tmp_path / "empty")
    assert check_file(tmp_path / "empty")["rows"] == 0
    new = sb.load(tmp_path / "empty")
    loaded.append(new)
    assert len(new) == 0 and push_lane(new, 1, 2).tolist() == [1, 3]

    push_lane(buf, 0, 5)
    push_lane(buf, 1, 2)
    buf.clear()  # base moves to the lane boundary: ids go on from 16
    push_lane(buf, 1, 3)
    sb.save(buf, tmp_path / "cleared")
    meta = check_file(tmp_path / "cleared")
    assert meta["lanes"] == [{"first": 8, "stop": 8, "base": 8}, {"first": 8, "stop": 11, "base": 8}]
    new = sb.load(tmp_path / "cleared")
    loaded.append(new)
    assert new.get(slice(None)).index.tolist() == [17, 19, 21]
    assert np.array_equal(new.ring.base(np.arange(2)), [8, 8])
    assert push_lane(new, 0, 1).tolist() == [16]


def test_save_replaces_an_earlier_save_and_reports_progress(
    make: Make, name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    buf = make(MUJOCO, capacity=100, name=name)
    buf.push(transition(0, 10))
    sb.save(buf, tmp_path / "s")
    buf.push(transition(10, 90))
    with pytest.raises(FileExistsError, match=r"already holds a save \(meta.json and rows.safetensors\); pass overwrite=True"):
        sb.save(buf, tmp_path / "s")
    assert check_file(tmp_path / "s")["rows"] == 10  # the earlier save is untouched
    assert sorted(os.listdir(tmp_path / "s")) == ["meta.json", "rows.safetensors"]
    monkeypatch.setattr(sb.protocol.snapshot, "CHUNK_BYTES", ROW * 10)
    calls: list[tuple[int, int]] = []
    sb.save(buf, tmp_path / "s", progress=lambda done, total: calls.append((done, total)), overwrite=True)
    assert check_file(tmp_path / "s")["rows"] == 100
    assert sorted(os.listdir(tmp_path / "s")) == ["meta.json", "rows.safetensors"]
    assert len(calls) == 10 and calls[-1] == (100 * ROW, 100 * ROW)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)
    sb.save(buf, tmp_path / "s", progress=True, overwrite=True)
    assert "saving" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="is not a directory"):
        sb.save(buf, tmp_path / "file")


# -- saving while writers run ------------------------------------------------------------------------------
def lapping(monkeypatch: pytest.MonkeyPatch, buf: sb.ReplayBuffer, at_call: int, lane: int, rows: int) -> None:
    """Before the save's ``at_call``-th piece (0-based), a writer pushes ``rows`` rows into ``lane``."""
    real = persistence.snapshot.Snapshot.copy
    calls = [0]

    def copy(self: Any, run: Any, k: int) -> Any:
        if calls[0] == at_call:
            for i in range(0, rows, 10):
                push_lane(buf, lane, min(10, rows - i))
        calls[0] += 1
        return real(self, run, k)

    monkeypatch.setattr(persistence.snapshot.Snapshot, "copy", copy)


@pytest.mark.parametrize(
    ("at_call", "lane", "rows", "moved"),
    [
        (1, 1, 5, False),  # lane 1's oldest rows go before its first piece: the layout allows for it
        (2, 0, 15, True),  # lane 0's second piece is reached by the writer: the tensors move down
        (1, 1, 120, False),  # lane 1 is lapped whole before it is read: none of its rows is saved
    ],
)
def test_rows_overwritten_during_the_save_are_dropped_from_the_oldest_end(
    at_call: int, lane: int, rows: int, moved: bool, make: Make, loaded: list, name: str, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    buf = make(MUJOCO, capacity=200, lanes=2, name=name)
    for ln in (0, 1):
        for _ in range(13):
            push_lane(buf, ln, 10)  # full, wrapped: rows 30..129 of each lane
    monkeypatch.setattr(sb.protocol.snapshot, "CHUNK_BYTES", ROW * 10 * 2)  # pieces of 10 rows a lane
    lapping(monkeypatch, buf, at_call, lane, rows)
    out = sb.save(buf, tmp_path / "w")
    assert out["moved"] == moved
    meta = check_file(tmp_path / "w")
    other = 1 - lane
    assert meta["lanes"][other] == {"first": 30, "stop": 130, "base": 0}
    expect_first = min(30 + rows, 130)
    assert meta["lanes"][lane] == {"first": expect_first, "stop": 130 if rows < 100 else expect_first, "base": 0}
    assert out["dropped"] == min(rows, 100)
    new = sb.load(tmp_path / "w")
    loaded.append(new)
    got = new.get(slice(None))
    assert np.array_equal(seq_of(got), got.index) and len(new) == meta["rows"]


@pytest.mark.parametrize("commits", [True, False])
def test_a_row_being_written_at_the_start(commits: bool, make: Make, name: str, tmp_path: Path) -> None:
    """Waited for when it commits within ``wait``; else the lane's run stops before it."""
    buf = make(MUJOCO, capacity=100, name=name)
    push_lane(buf, 0, 10)
    go = threading.Event()
    writer = threading.Thread(target=push_lane, args=(buf, 0, 3))
    copy_through(buf, lambda field: go.wait(10) if threading.current_thread() is writer else None)
    writer.start()
    try:
        while len(buf) < 13:  # reserved: rows 10..12 are being written
            time.sleep(0.001)
        push_lane(buf, 0, 4)  # committed after them: rows 13..16
        timer = threading.Timer(0.2, go.set)
        if commits:
            timer.start()
        out = sb.save(buf, tmp_path / "b", wait=5.0 if commits else 0.2)
    finally:
        go.set()
        writer.join()
    meta = check_file(tmp_path / "b")
    assert meta["lanes"][0]["stop"] == (17 if commits else 10)
    assert out["dropped"] == (0 if commits else 7)


def _writer(handle: sb.BufferHandle, stop: Any, started: Any) -> None:
    buf = sb.ReplayBuffer.attach(handle)
    lanes = buf.lanes
    n = [int(x) for x in buf.ring.bounds()[1]]
    i = 0
    while not stop.is_set():
        lane = i % lanes
        k = 1 + i % 37
        ids = (n[lane] + np.arange(k)) * lanes + lane
        buf.push(transition(ids), lane=lane)
        n[lane] += k
        i += 1
        if i == 50:
            started.set()
        time.sleep(0.0001)  # about 100k rows/s: laps a save of small pieces, not every save
    buf.close()


@pytest.mark.slow
def test_save_while_a_writer_laps_the_ring(make: Make, loaded: list, name: str, tmp_path: Path, procs: list,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer process pushes self-verifying rows (about 100k a second) into a small ring while
    saves run with small pieces: every saved row intact and the row of its id, each lane one run
    of consecutive row numbers, none pushed after the save began."""
    buf = make(MUJOCO, capacity=4000, lanes=2, name=name)
    for lane in (0, 1):
        for _ in range(3):
            push_lane(buf, lane, 1000)
    ctx = mp.get_context("spawn")
    stop, started = ctx.Event(), ctx.Event()
    p = ctx.Process(target=_writer, args=(buf.handle, stop, started))
    p.start()
    procs.append(p)
    assert started.wait(60)
    kept: list[int] = []
    try:
        for i, rows in enumerate([20, 200, 2000] * 2):  # small pieces: the writer laps the save; large: less
            monkeypatch.setattr(sb.protocol.snapshot, "CHUNK_BYTES", ROW * rows)
            before = buf.ring.bounds()[1].copy()
            out = sb.save(buf, tmp_path / f"s{i}")
            after = buf.ring.bounds()[1]
            meta = check_file(tmp_path / f"s{i}")
            for lane, ln in enumerate(meta["lanes"]):
                assert before[lane] - buf.lane_capacity <= ln["first"] <= ln["stop"] <= after[lane]
            kept.append(out["rows"])
            new = sb.load(tmp_path / f"s{i}")
            loaded.append(new)
            got = new.get(slice(None))
            assert np.array_equal(seq_of(got), got.index)
    finally:
        stop.set()
        p.join(30)
    assert p.exitcode == 0
    assert max(kept) >= buf.capacity // 2, kept  # not only empty saves


# -- holes: empty rows inside a lane's run ---------------------------------------------------------------
def interrupted_push(buf: sb.ReplayBuffer, lane: int, k: int) -> np.ndarray:
    """A push of ``k`` rows given back empty after its reservation (``Ring.abandon``: what a push
    stopped midway over rows it cannot put back leaves): they read as empty. Returns their ids."""
    ring, prios = buf.ring, buf.priorities
    res = ring.reserve(k, lane, also=None if prios is None else (lambda slots: prios.set_rows(slots, None, fresh=True)))
    ring.abandon(res, None if prios is None else (lambda slots: prios.tree.update(slots, 0.0)))
    return res.ids


def _dies_mid_push(handle: sb.BufferHandle, lane: int, k: int) -> None:
    """A writer killed while it copies its rows: they stay odd, owned by a dead process."""
    buf = sb.ReplayBuffer.attach(handle)
    copy_through(buf, lambda field: os._exit(0))
    buf.push(transition(np.zeros(k, np.int64)), lane=lane, episode=99 if buf.options.episodes else None)


def dead_push(buf: sb.ReplayBuffer, procs: list, lane: int, k: int) -> np.ndarray:
    n0 = int(buf.ring.bounds()[1][lane])
    p = mp.get_context("spawn").Process(target=_dies_mid_push, args=(buf.handle, lane, k))
    procs.append(p)
    p.start()
    p.join(60)
    assert p.exitcode == 0
    ids = (n0 + np.arange(k)) * buf.lanes + lane
    assert (buf.ring.stamp[buf.ring.slots(ids)] & 1).all()  # being written, by nobody alive
    return ids


def test_a_dead_writers_row_is_a_hole_not_the_end(make: Make, loaded: list, name: str, tmp_path: Path, procs: list) -> None:
    """r21: rows pushed after a dead writer's row are saved; that row is a hole. The save reaps it
    (nobody has yet) instead of waiting for it."""
    buf = make(MUJOCO, capacity=1000, name=name)
    push_lane(buf, 0, 10)
    hole = dead_push(buf, procs, 0, 1)
    push_lane(buf, 0, 500)
    t0 = time.monotonic()
    out = sb.save(buf, tmp_path / "d", wait=30.0)
    assert time.monotonic() - t0 < 10  # not waited for
    assert (out["rows"], out["holes"], out["dropped"]) == (510, 1, 0)
    meta = check_file(tmp_path / "d")
    assert meta["lanes"] == [{"first": 0, "stop": 511, "base": 0}] and meta["rows"] == 511
    assert load_file(str(tmp_path / "d" / "rows.safetensors"))["_present"].tolist() == [True] * 10 + [False] + [True] * 500
    new = sb.load(tmp_path / "d")
    loaded.append(new)
    ids = np.delete(np.arange(511), hole)
    assert len(new) == len(buf) == 510 and new.ring.stamp[new.ring.slots(hole)].tolist() == [0]
    assert np.array_equal(seq_of(new.take(ids)), ids)
    for source in (buf, new):
        out = sb.export(source)
        assert np.array_equal(out["index"], ids) and np.array_equal(seq_of(out), ids)
        assert sum(len(p["reward"]) for p in persistence.pieces(source)) == 510


def test_holes_survive_the_round_trip(make: Make, loaded: list, name: str, tmp_path: Path, procs: list) -> None:
    """Dead writers' rows and interrupted pushes, at a lane's start, middle and end, with
    priorities, uses and episodes: the loaded buffer has the same rows at the same row numbers,
    its holes empty (stamp 0, leaf 0), and saves to the same file content."""
    opts: dict[str, Any] = {"sampler": sb.Prioritized(alpha=1.0, eps=0.0), "max_use": 5, "lanes": 2, "episodes": True}
    buf = make(MUJOCO, capacity=64, name=name, seed=0, **opts)
    holes = [interrupted_push(buf, 1, 2)]  # lane 1's first rows
    for i in range(3):
        push_lane(buf, 0, 6, episode=i, priority=np.arange(6) + 1.0)
        holes.append(dead_push(buf, procs, 0, 1) if i != 1 else interrupted_push(buf, 0, 3))
        push_lane(buf, 1, 5, episode=10 + i, priority=2.0)
    holes.append(interrupted_push(buf, 1, 1))  # lane 1's last row
    gone = np.sort(np.concatenate(holes))
    buf.sample(20)  # uses
    ring, prios = buf.ring, buf.priorities
    assert prios is not None
    first, stop = ring.bounds()
    every = np.concatenate([np.arange(a, b) * 2 + lane for lane, (a, b) in enumerate(zip(first, stop, strict=True))])
    kept = every[~np.isin(every, gone)]
    out = sb.save(buf, tmp_path / "h")
    assert (out["rows"], out["holes"], out["dropped"]) == (kept.size, gone.size, 0)
    check_file(tmp_path / "h")
    tensors = load_file(str(tmp_path / "h" / "rows.safetensors"))
    assert np.array_equal(tensors["_present"], ~np.isin(every, gone))
    assert not ring.stamp[ring.slots(gone)].any()  # the dead writers' rows were reaped

    new = sb.load(tmp_path / "h", seed=1)
    loaded.append(new)
    assert len(new) == len(buf) and np.array_equal(new.ring.bounds()[1], stop)
    assert np.array_equal(new.ring.bounds()[0], first)
    assert not new.ring.stamp[new.ring.slots(gone)].any() and not new.priorities.tree.leaves[new.ring.slots(gone)].any()
    slots = ring.slots(kept)
    assert np.array_equal(new.ring.stamp[slots], ring.stamp[slots])
    assert np.array_equal(new.priorities.tree.leaves[slots], prios.tree.leaves[slots])
    assert np.array_equal(new.priorities.uses[slots], prios.uses[slots])
    assert new.priorities.tree.total == prios.tree.total
    rows = new.take(kept)
    assert np.array_equal(seq_of(rows), kept)
    exported = sb.export(new)
    assert np.array_equal(exported["index"], kept) and np.array_equal(exported["episode"], buf.block.episode[slots])
    assert np.array_equal(seq_of(exported), kept)
    for _ in range(5):
        assert not np.isin(new.sample(8).index, gone).any()
    sb.save(new, tmp_path / "again")
    again = load_file(str(tmp_path / "again" / "rows.safetensors"))
    assert all(np.array_equal(again[k], tensors[k]) for k in tensors if k not in ("_leaf", "_uses"))


def test_a_hole_overwritten_during_the_save_goes_with_the_rows_before_it(
    make: Make, loaded: list, name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    buf = make(MUJOCO, capacity=100, name=name)
    push_lane(buf, 0, 55)
    interrupted_push(buf, 0, 1)  # row 55
    for _ in range(7):
        push_lane(buf, 0, 10)  # full, wrapped: rows 26..125, row 55 a hole
    monkeypatch.setattr(sb.protocol.snapshot, "CHUNK_BYTES", ROW * 10)  # pieces of 10 rows
    lapping(monkeypatch, buf, 1, 0, 34)  # after the first piece: rows 26..59 overwritten
    out = sb.save(buf, tmp_path / "o")
    meta = check_file(tmp_path / "o")
    assert meta["lanes"] == [{"first": 60, "stop": 126, "base": 0}]
    assert (out["rows"], out["holes"], out["dropped"], out["moved"]) == (66, 0, 34, True)
    new = sb.load(tmp_path / "o")
    loaded.append(new)
    got = new.get(slice(None))
    assert np.array_equal(seq_of(got), got.index) and got.index.tolist() == list(range(60, 126))


# -- golden files of every format version ---------------------------------------------------------------
def test_golden_uniform(loaded: list) -> None:
    new = sb.load(GOLDEN / "uniform", seed=0)
    loaded.append(new)
    rows = new.get(slice(None))
    assert rows.index.tolist() == list(range(3, 11)) and np.array_equal(seq_of(rows), rows.index)
    assert new.capacity == 8 and new.lanes == 1 and new.options.sampler == sb.Uniform() and new.priorities is None
    assert new.stats == {"inserted": 11, "sampled": 5, "reclaimed": 0, "lock_recoveries": 0}
    assert set(load_file(str(GOLDEN / "uniform" / "rows.safetensors"))) == {*MUJOCO.names, "_present"}


def test_golden_prioritized(loaded: list) -> None:
    """The content tests/golden/make_golden.py describes."""
    new = sb.load(GOLDEN / "prioritized", seed=0)
    loaded.append(new)
    assert new.options == Options(8, 2, sb.Prioritized(alpha=0.5, beta=0.4), 3, True)
    ids = np.array([4, 6, 8, 10, 1, 3, 5])
    rows = new.get(slice(None))  # get's positions leave id 4 out: it is used up (the file has no counters)
    assert np.array_equal(rows.index, ids[1:]) and np.array_equal(seq_of(rows), ids[1:]) and len(new) == 6
    assert sb.export(new)["episode"].tolist() == [0, 1, 1, 1, 7, 7, 7]
    slots = new.ring.slots(ids)
    prio = np.array([5.0, 7.0, 0.25, 11.0, 0.5, 0.5, 9.0])
    leaves = (prio + 1e-6) ** 0.5
    leaves[0] = 0.0  # id 4 was drawn max_use times
    assert np.array_equal(new.priorities.tree.leaves[slots], leaves)
    assert new.priorities.uses[slots].tolist() == [3, 0, 0, 0, 0, 1, 0]
    assert new.priorities.max_priority == 11.0
    assert new.stats["inserted"] == 9
    for _ in range(4):  # 17 draws are left in all
        batch = new.sample(4)
        assert 4 not in batch.index and np.array_equal(seq_of(batch), batch.index)


def test_golden_holes(loaded: list) -> None:
    """Empty rows inside a lane's run come back empty at their row numbers (make_golden.py)."""
    new = sb.load(GOLDEN / "holes", seed=0)
    loaded.append(new)
    # len counts the rows there (the holes are left out, as get's positions and export leave them)
    assert len(new) == 5 and new.ring.bounds()[0].tolist() == [0, 0] and new.ring.bounds()[1].tolist() == [4, 4]
    present, holes = np.array([0, 6, 1, 3, 5]), np.array([2, 4, 7])
    assert np.array_equal(new.get(slice(0, len(new))).index, present)
    out = sb.export(new)
    assert np.array_equal(out["index"], present) and np.array_equal(seq_of(out), present)
    assert out["episode"].tolist() == [0, 0, 1, 1, 1]
    slots = new.ring.slots(holes)
    assert not new.ring.stamp[slots].any() and not new.priorities.tree.leaves[slots].any()
    assert np.array_equal(new.priorities.tree.leaves[new.ring.slots(present)], present + 1.0)
    assert new.priorities.max_priority == 7.0
    with pytest.raises(sb.EmptyBufferError):
        new.take([2])  # a hole, by its id
    assert set(new.sample(200).index) == set(present)
    tensors = load_file(str(GOLDEN / "holes" / "rows.safetensors"))
    assert tensors["_present"].tolist() == [True, False, False, True, True, True, True, False]


def test_golden_v2_frames(loaded: list) -> None:
    """Format version 2 (``next_of``/``stack``): the content tests/golden/make_golden.py describes,
    written by commit 969d4a4."""
    new = sb.load(GOLDEN_V2 / "frames", seed=0)
    loaded.append(new)
    assert new.options.rows.once and new.capacity == 16 and len(new) == 5
    rows = new.get(slice(None))
    assert rows["action"].tolist() == [0, 1, 2, 5, 6]
    assert rows["done"].tolist() == [False, False, True, False, False]
    assert rows["truncated"].tolist() == [False, False, False, False, True]
    frames = [[0, 0], [0, 1], [1, 2], [5, 5], [5, 6]]  # the frame numbers t of each obs's 2 frames
    nexts = [[0, 1], [1, 2], [2, 3], [5, 6], [6, 7]]
    for i in range(5):
        assert np.array_equal(rows["obs"][i], np.concatenate([make_golden.frame(t) for t in frames[i]]))
        assert np.array_equal(rows["next_obs"][i], np.concatenate([make_golden.frame(t) for t in nexts[i]]))
    tensors = load_file(str(GOLDEN_V2 / "frames" / "rows.safetensors"))
    assert set(tensors) == {"obs", "action", "done", "truncated", "_kind", "_present"}
    assert tensors["obs"].shape == (7, 1, 2, 3)  # the stored rows: each transition's newest frame, end rows


def test_golden_v3_pushed(loaded: list) -> None:
    """Format version 3 (the saving process's last rows): the content tests/golden/make_golden.py
    describes. The loading process holds the waiting step and continues the episode with its next
    step, as the saving process would have."""
    new = sb.load(GOLDEN_V3 / "pushed", seed=0)
    loaded.append(new)
    assert new.capacity == 6 and len(new) == 4  # row 1's stack reaches the lapped row 0: no transition
    assert new.get(slice(None))["action"].tolist() == [2, 3, 4, 5]
    waiting = new.pending()
    assert waiting["action"].tolist() == [6] and waiting["index"].tolist() == [6]
    assert np.array_equal(waiting["obs"][0], np.concatenate([make_golden.frame(5), make_golden.frame(6)]))
    assert np.array_equal(waiting["next_obs"][0], np.concatenate([make_golden.frame(6), make_golden.frame(7)]))
    new.push(**make_golden.frames_episode(list(range(9)), "truncated")[7])  # the step after it, ending the episode
    rows = new.get(slice(None))
    assert rows["action"].tolist() == [4, 5, 6, 7] and rows["truncated"].tolist() == [False] * 3 + [True]
    for i, t in enumerate(range(4, 8)):
        assert np.array_equal(rows["obs"][i], np.concatenate([make_golden.frame(t - 1), make_golden.frame(t)]))
        assert np.array_equal(rows["next_obs"][i], np.concatenate([make_golden.frame(t), make_golden.frame(t + 1)]))


def test_every_format_version_has_a_reader_and_a_golden_file_that_loads(loaded: list) -> None:
    assert tuple(persistence.READERS) == persistence.VERSIONS == (
        persistence.FORMAT_VERSION_1, persistence.FORMAT_VERSION_2, persistence.FORMAT_VERSION_3)
    assert persistence.VERSION == max(persistence.VERSIONS)
    for version in persistence.VERSIONS:
        saves = sorted((GOLDEN.parent / f"v{version}").iterdir())
        assert saves, f"no golden file of format version {version}"
        for folder in saves:
            assert json.loads((folder / "meta.json").read_text())["format_version"] == version
            new = sb.load(folder)
            loaded.append(new)
            assert len(new) > 0


@pytest.mark.parametrize(("version", "kind"), [("v1", "uniform"), ("v1", "prioritized"), ("v2", "frames"),
                                               ("v3", "pushed")])
def test_a_save_is_byte_for_byte_the_golden_file(version: str, kind: str, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The recipe of a golden file, saved today with the golden's save_id, gives the same
    rows.safetensors byte for byte, and the same meta.json but for the buffer's name, the release
    and the counters (which the v1 files predate)."""
    golden = GOLDEN.parent / version / kind
    meta = json.loads((golden / "meta.json").read_text())
    monkeypatch.setattr(persistence.saving.secrets, "token_hex", lambda k: meta["save_id"])
    monkeypatch.setattr(make_golden, "OUT", tmp_path / "v1")
    monkeypatch.setattr(make_golden, "OUT2", tmp_path / "v2")
    monkeypatch.setattr(make_golden, "OUT3", tmp_path / "v3")
    getattr(make_golden, kind)()
    assert (tmp_path / version / kind / "rows.safetensors").read_bytes() == (golden / "rows.safetensors").read_bytes()
    again = json.loads((tmp_path / version / kind / "meta.json").read_text())
    if kind == "frames":  # inserted counted stored rows at 969d4a4 (7), transitions since (5): not the format's doing
        assert (meta["stats"].pop("inserted"), again["stats"].pop("inserted")) == (7, 5)
    differ = {key for key in set(meta) | set(again) if meta.get(key) != again.get(key)}
    assert differ <= {"name", "shmbuffer_version", "counters"}, {k: (meta.get(k), again.get(k)) for k in differ}


def test_golden_files_are_what_the_script_makes() -> None:
    for version, kinds in ((1, ("uniform", "prioritized", "holes")), (2, ("frames",)), (3, ("pushed",))):
        for kind in kinds:
            folder = GOLDEN.parent / f"v{version}" / kind
            meta = json.loads((folder / "meta.json").read_text())
            assert meta["format_version"] == version
            with open(folder / "rows.safetensors", "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                assert (8 + n) % 64 == 0
                head = json.loads(f.read(n))["__metadata__"]
                assert head["save_id"] == meta["save_id"] and head["format_version"] == str(version)


# -- damaged, truncated and mismatched files ------------------------------------------------------------
@pytest.fixture
def saved(make: Make, name: str, tmp_path: Path) -> Path:
    buf = make(MUJOCO, capacity=16, name=name, sampler=sb.Prioritized())
    buf.push(transition(0, 10))
    sb.save(buf, tmp_path / "ok")
    return tmp_path / "ok"


def rewrite_header(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Change the JSON header of rows.safetensors in place, keeping its length."""
    file = path / "rows.safetensors"
    raw = bytearray(file.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    head = json.loads(raw[8:8 + n])
    edit(head)
    new = json.dumps(head, separators=(",", ":")).encode()
    assert len(new) <= n
    raw[8:8 + n] = new + b" " * (n - len(new))
    file.write_bytes(bytes(raw))


def edit_meta(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    meta = json.loads((path / "meta.json").read_text())
    edit(meta)
    (path / "meta.json").write_text(json.dumps(meta))


def _offsets(head: dict[str, Any]) -> None:
    head["obs"]["data_offsets"] = [head["obs"]["data_offsets"][0] + 10**6, head["obs"]["data_offsets"][1] + 10**6]


def _dtype(head: dict[str, Any]) -> None:
    head["reward"]["dtype"] = "I32"


DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    "meta not JSON": (lambda p: (p / "meta.json").write_text("{oops"), r"meta.json: not valid JSON"),
    "meta not ours": (lambda p: edit_meta(p, lambda m: m.update(format="npz")),
                      r"meta.json: format 'npz', expected 'shmbuffer'"),
    "unknown version": (lambda p: edit_meta(p, lambda m: m.update(format_version=7)),
                        r"format version 7; this shmbuffer reads versions 1"),
    "meta rows disagree": (lambda p: edit_meta(p, lambda m: m.update(rows=11)), r"rows is 11, the lanes hold 10"),
    "meta lanes disagree": (lambda p: edit_meta(p, lambda m: m.update(rows=11) or m["lanes"][0].update(stop=11)),
                            r"tensors .* expected .* for its schema and options"),
    "meta entry missing": (lambda p: edit_meta(p, lambda m: m.pop("schema")), r"meta.json: missing or malformed entry"),
    "header not JSON": (lambda p: rewrite_header(p, lambda h: None) or _poke(p, 8, b"["), r"header is not valid JSON"),
    "header not ours": (lambda p: rewrite_header(p, lambda h: h["__metadata__"].update(format="other")),
                        r"__metadata__ format 'other', expected 'shmbuffer'"),
    "offsets out of range": (lambda p: rewrite_header(p, _offsets), r"starts at data offset \d+, expected \d+ .* out of range"),
    "dtype disagrees": (lambda p: rewrite_header(p, _dtype), r"rows.safetensors holds tensors .*; .*meta.json says"),
    "truncated data": (lambda p: _truncate(p, -7), r"rows.safetensors is truncated: its header says the data runs to byte \d+, the file has \d+ bytes"),
    "truncated header": (lambda p: _truncate(p, 20), r"rows.safetensors is truncated: its header length says \d+ bytes follow"),
    "tiny": (lambda p: _truncate(p, 3), r"3 bytes, expected at least 8"),
    "trailing bytes": (lambda p: _append(p, b"xyz"), r"3 bytes follow the last tensor, expected none"),
    "other save": (lambda p: rewrite_header(p, lambda h: h["__metadata__"].update(save_id="0" * 16)),
                   r"come from different saves"),
    "bad priorities": (lambda p: _poke(p, _tensor_at(p, "_leaf"), struct.pack("<d", -1.0)),
                       r"'_leaf' holds negative or non-finite priorities"),
    # files that raised other exceptions, hung, or loaded a buffer that could not be read
    "first 2**62": (lambda p: edit_meta(p, lambda m: m["lanes"][0].update(first=2**62, stop=2**62 + 10, base=2**62)),
                    r"lanes\[0\]\.base is 4611686018427387904, expected an int in \[0, 2305843009213693952\]"),
    "negative first": (lambda p: edit_meta(p, lambda m: m["lanes"][0].update(first=-1, stop=9, base=-1)),
                       r"lanes\[0\]\.base is -1, expected an int in \[0, "),
    "base after first": (lambda p: edit_meta(p, lambda m: m["lanes"][0].update(base=1)),
                         r"lane 0 has base 1 and rows \[0, 10\); expected base <= first"),
    "max_priority NaN": (lambda p: edit_meta(p, lambda m: m["sampler_state"].update(max_priority=float("nan"))),
                         r"sampler_state\.max_priority is nan, expected a finite number >= 0"),
    "max_priority -1": (lambda p: edit_meta(p, lambda m: m["sampler_state"].update(max_priority=-1)),
                        r"sampler_state\.max_priority is -1, expected a finite number >= 0"),
    "max_priority string": (lambda p: edit_meta(p, lambda m: m["sampler_state"].update(max_priority="1")),
                            r"sampler_state\.max_priority is '1', expected a finite number"),
    "no sampler_state": (lambda p: edit_meta(p, lambda m: m.update(sampler_state=None)),
                         r"sampler_state is None, expected the largest priority \(the buffer has a tree\)"),
    "leaf too large": (lambda p: _poke(p, _tensor_at(p, "_leaf"), struct.pack("<d", 1e300)),
                       r"'_leaf' holds .* leaves above 1e\+280"),
    # a leaf below the bound whose priority overflows (alpha 0.6): export() warned
    "leaf of no finite priority": (lambda p: _poke(p, _tensor_at(p, "_leaf"), struct.pack("<d", 1e250)),
                                   r"'_leaf' holds .* of no finite priority"),
    "limiter timeout NaN": (lambda p: edit_meta(p, lambda m: m["options"].update(limiter={
                                "samples_per_insert": 1.0, "min_size": 1, "error": None, "block_writers": False,
                                "timeout": float("nan")})),
                            r"options\.limiter\.timeout is nan, expected a finite number >= 0"),
    "alpha a huge int": (lambda p: edit_meta(p, lambda m: m["options"]["sampler"].update(alpha=10**400)),
                         r"options\.sampler: Prioritized: alpha must be a finite number >= 0, got 1000.*\.\.\."),
    "version true": (lambda p: edit_meta(p, lambda m: m.update(format_version=True)), r"format version True; this"),
    "stats overflow": (lambda p: edit_meta(p, lambda m: m["stats"].update(sampled=2**64)),
                       r"stats\.sampled is 18446744073709551616, expected an int in \[0, 9223372036854775807\]"),
    "capacity absurd": (lambda p: edit_meta(p, lambda m: m["options"].update(capacity=2**62)),
                        r"options\.capacity is 4611686018427387904, expected an int in \[1, 281474976710656\]"),
    "field absurd": (lambda p: edit_meta(p, lambda m: m["schema"][0].update(shape=[1, 2**50])),
                     r"schema\[0\]\.shape is a JSON array of 2, expected a list of ints in \[1, 2\*\*48\)"),
    "field huge": (lambda p: edit_meta(p, lambda m: m["schema"][0].update(shape=[2**30, 2**30])),
                   r"16 rows of \d+ bytes \(options.capacity, schema\) need more than 256\.0 TiB"),
    "dtype nonsense": (lambda p: edit_meta(p, lambda m: m["schema"][0].update(dtype="nonsense")),
                       r"schema\[0\]\.dtype is 'nonsense', expected a numpy dtype"),
    "lanes not a list": (lambda p: edit_meta(p, lambda m: m.update(lanes={"first": 0})),
                         r"malformed entry: lanes is a JSON object, expected an array"),
    "tensor entry malformed": (lambda p: edit_meta(p, lambda m: m["tensors"][0].pop("numpy")),
                               r"tensors\[0\] is a JSON object, expected an object with the keys"),
    "meta nested 10000 deep": (lambda p: (p / "meta.json").write_text('{"format": "shmbuffer", "x": ' + "[" * 10000 + "]" * 10000 + "}"),
                               r"meta.json: not valid JSON \(RecursionError"),
    "header nested 10000 deep": (lambda p: (p / "rows.safetensors").write_bytes(_header_only(b'{"a": ' + b"[" * 10000 + b"]" * 10000 + b"}")),
                                 r"rows.safetensors: its header is not valid JSON \(RecursionError"),
    "header metadata not strings": (lambda p: rewrite_header(p, lambda h: h["__metadata__"].update(format_version=1)),
                                    r"__metadata__ holds values that are not strings"),
    "header shape of bools": (lambda p: rewrite_header(p, lambda h: h["reward"].update(shape=[True])),
                              r"tensor 'reward' has a malformed header entry"),
    "header offsets a string": (lambda p: rewrite_header(p, lambda h: h["reward"].update(data_offsets="ab")),
                                r"tensor 'reward' has a malformed header entry"),
    "rows a FIFO": (lambda p: (p / "rows.safetensors").unlink() or os.mkfifo(p / "rows.safetensors"),
                    r"rows.safetensors is a FIFO; expected the regular file shmbuffer.save wrote"),
    "meta a FIFO": (lambda p: (p / "meta.json").unlink() or os.mkfifo(p / "meta.json"), r"meta.json is a FIFO"),
    "rows a directory": (lambda p: (p / "rows.safetensors").unlink() or (p / "rows.safetensors").mkdir(),
                         r"rows.safetensors is a directory"),
    "rows a link": (lambda p: _link(p, "rows.safetensors"), r"rows.safetensors is a symbolic link; expected the regular file"),
    "meta a link": (lambda p: _link(p, "meta.json"), r"meta.json is a symbolic link; expected the regular file"),
}


def _header_only(head: bytes) -> bytes:
    return struct.pack("<Q", len(head)) + head


def _link(path: Path, file: str) -> None:
    """Move ``file`` aside and put a symbolic link to it in its place."""
    (path / file).rename(path / f"{file}.real")
    (path / file).symlink_to(path / f"{file}.real")


def _poke(path: Path, at: int, data: bytes) -> None:
    with open(path / "rows.safetensors", "r+b") as f:
        f.seek(at)
        f.write(data)


def _truncate(path: Path, size: int) -> None:
    file = path / "rows.safetensors"
    os.truncate(file, size if size > 0 else file.stat().st_size + size)


def _append(path: Path, data: bytes) -> None:
    with open(path / "rows.safetensors", "ab") as f:
        f.write(data)


def _tensor_at(path: Path, tensor: str) -> int:
    with open(path / "rows.safetensors", "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return 8 + n + int(json.loads(f.read(n))[tensor]["data_offsets"][0])


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_damaged_files_are_refused_and_leave_nothing(case: str, saved: Path, name: str) -> None:
    damage, message = DAMAGE[case]
    damage(saved)
    before = set(segment.list_names())
    with pytest.raises(sb.LayoutError, match=message):
        sb.load(saved, name=name + "-loaded")
    assert not os.path.exists(segment.path_of(name + "-loaded"))
    assert not {n for n in set(segment.list_names()) - before if n.startswith(f"{os.getpid()}-")}


def test_missing_files(saved: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"expected a directory written by shmbuffer\.save"):
        sb.load(tmp_path / "nothing")
    (saved / "rows.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"rows.safetensors does not exist \(.*meta.json does\)"):
        sb.load(saved)


# -- plain numpy --------------------------------------------------------------------------------------
def test_export_and_from_arrays(make: Make, loaded: list, name: str) -> None:
    buf = make(MUJOCO, capacity=20, lanes=2, episodes=True, name=name)
    for lane, episode in ((0, 1), (1, 2), (0, 3)):
        push_lane(buf, lane, 7, episode=episode)
    out = sb.export(buf)
    rows = buf.get(slice(None))
    assert sorted(out) == sorted([*MUJOCO.names, "index", "episode"])
    assert np.array_equal(out["index"], rows.index) and np.array_equal(seq_of(out), rows.index)
    assert out["episode"].tolist() == [1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2]

    copy = sb.from_arrays(MUJOCO, out, episodes=True, seed=0)
    loaded.append(copy)
    assert copy.capacity == 17 and np.array_equal(seq_of(copy.get(slice(None))), rows.index)
    assert np.array_equal(sb.export(copy)["episode"], out["episode"])
    # a cpprb env_dict, priorities and lanes per row, and fewer slots than rows: the newest stay
    env = {"obs": {"shape": 17}, "action": {"shape": 6}, "reward": {"shape": ()}, "next_obs": {"shape": 17},
           "done": {"shape": (), "dtype": "bool"}}
    fields = transition(0, 17)  # row i has the value i
    lanes = np.arange(17) % 2
    small = sb.from_arrays(env, {**fields, "lane": lanes, "priority": np.arange(17.0)}, capacity=8, lanes=2,
                           sampler=sb.Prioritized())
    loaded.append(small)
    assert len(small) == 8 and small.priorities.max_priority == 16.0
    assert seq_of(small.get(slice(None))).tolist() == [10, 12, 14, 16, 9, 11, 13, 15]
    assert np.array_equal(copy.get(slice(None)).obs, out["obs"])


def test_from_arrays_refuses_bad_input_and_leaves_nothing(name: str) -> None:
    data = transition(0, 5)
    del data["done"]
    with pytest.raises(sb.FieldError, match="missing field 'done'"):
        sb.from_arrays(MUJOCO, data, name=name)
    with pytest.raises(sb.FieldError, match="episode: this buffer keeps episodes"):
        sb.from_arrays(MUJOCO, transition(0, 5), name=name, episodes=True)
    assert not os.path.exists(segment.path_of(name))


def test_from_arrays_spreads_rows_over_env_lanes(loaded: list, name: str) -> None:
    """With envs=N and no lane= (nor ids to keep), rows are whole env steps, env-major, as a push
    without lane= takes them: row i goes to lane i % N (they all went to lane 0 before)."""
    fields = transition(0, 12)  # row i has the value i
    buf = sb.from_arrays(MUJOCO, fields, envs=3, name=name)
    loaded.append(buf)
    assert buf.lanes == 3 and buf.capacity == 12 and len(buf) == 12
    assert seq_of(buf.get(slice(None))).tolist() == [0, 3, 6, 9, 1, 4, 7, 10, 2, 5, 8, 11]  # lane by lane
    assert (buf.get(slice(None)).index % 3).tolist() == [0] * 4 + [1] * 4 + [2] * 4
    small = sb.from_arrays(MUJOCO, fields, envs=3, capacity=6)  # 2 steps of each env: the newest stay
    loaded.append(small)
    assert seq_of(small.get(slice(None))).tolist() == [6, 9, 7, 10, 8, 11]
    with pytest.raises(sb.FieldError, match=r"envs=3 .*needs a multiple of 3 rows, got 10; pass lane="):
        sb.from_arrays(MUJOCO, transition(0, 10), envs=3, name=name + "x")
    assert not os.path.exists(segment.path_of(name + "x"))


def test_an_export_of_a_next_of_buffer_carries_the_use_counts(make: Make, loaded: list, name: str) -> None:
    """With ``next_of`` and ``max_use``, an export has ``uses`` as any other buffer's: a copy made
    from it draws no row the original had used up."""
    sch = sb.Schema(obs=((2,), "float32"), next_obs=((2,), "float32"), done=((), "bool"))
    obs = np.stack([np.zeros(8), np.arange(8)], axis=1).astype(np.float32)
    buf = make(sch, 32, next_of={"next_obs": "obs"}, max_use=2, name=name)
    buf.push(obs=obs, next_obs=obs + np.float32([0, 1]), done=np.zeros(8, bool), flush=True)
    buf.sample(8, replace=False)
    buf.sample(5, replace=False)  # 5 rows used up, 3 drawn once
    out = buf.export()
    assert out["uses"].tolist() == buf.uses(out["index"]).tolist() and out["uses"].sum() == 13
    copy = sb.ReplayBuffer.from_arrays(sch, out, next_of={"next_obs": "obs"}, max_use=2, name=name + "c")
    loaded.append(copy)
    assert len(copy) == len(buf) == 3
    assert copy.export()["uses"].tolist() == out["uses"].tolist()


def test_import_rows_of_an_export_keeps_each_row_in_its_lane(make: Make, name: str) -> None:
    """An export lists lane after lane; ``import_rows`` puts each row back into its lane (its id's),
    not spread over the lanes as a push without ``lane=``, which would put one env's steps into
    several lanes (windows such as n-step returns would then mix envs)."""
    src = make(MUJOCO, 24, envs=2, name=name)
    src.push(transition(0, 12))                                            # row i into lane i % 2
    into = make(MUJOCO, 24, envs=2, name=name + "i")
    persistence.import_rows(into, src.export())
    assert seq_of(into.get(slice(None))).tolist() == seq_of(src.get(slice(None))).tolist()
    assert (into.get(slice(None)).index % 2).tolist() == (src.get(slice(None)).index % 2).tolist()


def test_export_drops_rows_overwritten_meanwhile(make: Make, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    buf = make(MUJOCO, capacity=200, lanes=2, name=name)
    for ln in (0, 1):
        for _ in range(13):
            push_lane(buf, ln, 10)
    monkeypatch.setattr(sb.protocol.snapshot, "CHUNK_BYTES", ROW * 10 * 2)
    lapping(monkeypatch, buf, 2, 0, 15)
    out = sb.export(buf)
    ids = np.concatenate([np.arange(45, 130) * 2, np.arange(30, 130) * 2 + 1])
    assert np.array_equal(out["index"], ids) and np.array_equal(seq_of(out), ids)
    assert all(a.flags.c_contiguous and a.flags.aligned for a in out.values())


def test_the_buffer_methods(make: Any, name: str, tmp_path: Path) -> None:
    """``save``/``load``/``export``/``from_arrays`` as Velora, cpprb and DI-engine users call them."""
    buf = make(MUJOCO, capacity=20, name=name, seed=0)
    buf.push(transition(0, 12))
    buf.save(tmp_path / "b")
    back = sb.ReplayBuffer.load(tmp_path / "b", name=name + "l", seed=0)
    try:
        assert np.array_equal(back.get(slice(None)).index, buf.get(slice(None)).index)
        assert seq_of(back.get(slice(None))).tolist() == list(range(12))
        assert np.array_equal(buf.export()["obs"], sb.export(back)["obs"])
    finally:
        back.close()
        back.unlink()
    rows = buf.export()
    again = sb.ReplayBuffer.from_arrays(MUJOCO, {k: rows[k] for k in MUJOCO.names}, 30, name=name + "a")
    try:
        assert seq_of(again.get(slice(None))).tolist() == list(range(12)) and again.capacity == 30
    finally:
        again.close()
        again.unlink()


# -- malformed saves, fuzzed ------------------------------------------------------------------
POOL: list[Any] = [None, True, False, -1, 0, 1, 2, 3, 7, 16, 2**31, 2**62, 2**63, 2**64, -(2**63), 0.5, -0.0, 1e308,
                   float("nan"), float("inf"), "", "x", "<f4", "F32", "prioritized", [], {}, [1], [[]], [-1], {"a": 1}]
"""Values a corrupted JSON entry may take."""


def _paths(value: Any, at: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """The path of every value inside a JSON value (not the value itself)."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, inner in items:
        yield (*at, key)
        yield from _paths(inner, (*at, key))


def _mutate(value: Any, rng: np.random.Generator) -> tuple[Any, ...]:
    """Change a JSON value in one random place: replace an entry, remove it, or add one."""
    paths = list(_paths(value))
    path = paths[rng.integers(len(paths))]
    parent = value
    for key in path[:-1]:
        parent = parent[key]
    what = rng.integers(4)
    if what == 0:
        del parent[path[-1]]
    elif what == 1 and isinstance(parent, dict):
        parent["extra"] = POOL[rng.integers(len(POOL))]
    else:
        parent[path[-1]] = POOL[rng.integers(len(POOL))]
    return path


def _check_loaded(new: sb.ReplayBuffer) -> None:
    """A buffer loaded from a corrupted save must still be right: every row the one of its id,
    the tree finite, sampling working."""
    out = sb.export(new)
    assert np.array_equal(seq_of(out), out["index"])
    prios = new.priorities
    if prios is not None:
        assert np.isfinite(prios.tree.total) and np.isfinite(prios.max_priority) and prios.max_priority >= 0
        if prios.tree.total > 0:
            batch = new.sample(4)
            assert np.array_equal(seq_of(batch), batch.index) and np.isfinite(batch.weight).all()


def test_fuzzed_saves_load_correctly_or_raise_layout_error(make: Make, name: str, tmp_path: Path) -> None:
    """Hundreds of random corruptions of meta.json's values and of the safetensors header (its
    bytes and its values): each loads a correct buffer or raises LayoutError, never another
    exception, and leaves nothing in /dev/shm (the ``no_leaks`` fixture)."""
    buf = make(MUJOCO, capacity=16, lanes=2, name=name, seed=0, sampler=sb.Prioritized(alpha=0.5), max_use=3,
               episodes=True)
    push_lane(buf, 0, 6, episode=1, priority=np.arange(1.0, 7.0))
    push_lane(buf, 1, 3, episode=2)
    buf.sample(5)
    sb.save(buf, tmp_path / "good")
    meta = json.loads((tmp_path / "good" / "meta.json").read_text())
    raw = (tmp_path / "good" / "rows.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    head, data = json.loads(raw[8:8 + n]), raw[8 + n:]
    folder = tmp_path / "bad"
    folder.mkdir()
    rng = np.random.default_rng(10)
    seen: dict[str, int] = {"loaded": 0, "refused": 0, "too large": 0}

    def attempt(meta_text: str, rows: bytes, case: str) -> None:
        (folder / "meta.json").write_text(meta_text)
        (folder / "rows.safetensors").write_bytes(rows)
        try:
            new = sb.load(folder, name=f"{name}-{sum(seen.values())}", seed=0)
        except sb.LayoutError:
            seen["refused"] += 1
            return
        except sb.OutOfSharedMemory:  # a capacity that may be real but does not fit here
            assert case == "('options', 'capacity')", case
            seen["too large"] += 1
            return
        try:
            _check_loaded(new)
        finally:
            discard([new])
        seen["loaded"] += 1

    good_meta = json.dumps(meta)
    for _ in range(400):
        m = json.loads(good_meta)
        path = _mutate(m, rng)
        attempt(json.dumps(m), raw, str(path))
    for _ in range(300):  # bytes of the header, its length included
        bad = bytearray(raw)
        for at in rng.integers(0, 8 + n, size=rng.integers(1, 4)):
            bad[at] = rng.integers(256)
        attempt(good_meta, bytes(bad), "header bytes")
    for _ in range(300):  # values of the header (with its new length)
        h = json.loads(json.dumps(head))
        _mutate(h, rng)
        encoded = json.dumps(h).encode()
        attempt(good_meta, struct.pack("<Q", len(encoded)) + encoded + data, "header values")
    assert seen["loaded"] > 10 and seen["refused"] > 500, seen


# -- files and other users ------------------------------------------------------------------
@pytest.mark.parametrize("umask", [0o000, 0o022, 0o277])
def test_saves_are_private_whatever_the_umask(umask: int, make: Make, loaded: list, name: str, tmp_path: Path) -> None:
    buf = make(MUJOCO, capacity=8, name=name)
    buf.push(transition(0, 8))
    (tmp_path / "mine").mkdir()
    os.chmod(tmp_path / "mine", 0o755)
    old = os.umask(umask)
    try:
        sb.save(buf, tmp_path / "s")
        sb.save(buf, tmp_path / "mine")  # an existing directory of ours keeps its mode
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "s").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(tmp_path / "mine").st_mode) == 0o755
    for folder in (tmp_path / "s", tmp_path / "mine"):
        assert sorted(os.listdir(folder)) == ["meta.json", "rows.safetensors"]
        for file in ("meta.json", "rows.safetensors"):
            assert stat.S_IMODE(os.stat(folder / file).st_mode) == 0o600, (folder, file)
    new = sb.load(tmp_path / "s")
    loaded.append(new)
    assert seq_of(new.get(slice(None))).tolist() == list(range(8))


def test_save_never_writes_through_links(make: Make, name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    buf = make(MUJOCO, capacity=8, name=name)
    buf.push(transition(0, 8))
    victim = tmp_path / "victim"
    victim.write_text("precious")
    folder = tmp_path / "s"
    folder.mkdir()
    for planted in (f".rows.safetensors.{os.getpid()}.tmp", f".meta.json.{os.getpid()}.tmp"):  # names once predictable
        (folder / planted).symlink_to(victim)
    sb.save(buf, folder)
    assert victim.read_text() == "precious"
    # a temporary file's name that someone guessed is refused, never opened
    monkeypatch.setattr(persistence.saving.secrets, "token_hex", lambda k: "0" * (2 * k))
    (folder / f".rows.safetensors.{'0' * 16}.tmp").symlink_to(victim)
    with pytest.raises(FileExistsError):
        sb.save(buf, folder, overwrite=True)
    monkeypatch.undo()
    assert victim.read_text() == "precious"
    # links where the files go are replaced, not written through
    for file in ("meta.json", "rows.safetensors"):
        (folder / file).unlink()
        (folder / file).symlink_to(victim)
    with pytest.raises(FileExistsError, match="already holds a save"):
        sb.save(buf, folder)
    sb.save(buf, folder, overwrite=True)
    assert victim.read_text() == "precious"
    assert not (folder / "meta.json").is_symlink() and check_file(folder)["rows"] == 8
    # the directory itself may not be a link: another user could point it elsewhere
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (tmp_path / "elsewhere").mkdir()
    with pytest.raises(FileExistsError, match=r"link is a symbolic link; expected a directory of yours"):
        sb.save(buf, tmp_path / "link")
    assert os.listdir(tmp_path / "elsewhere") == []


def test_save_refuses_a_directory_of_another_user(make: Make, name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    buf = make(MUJOCO, capacity=8, name=name)
    buf.push(transition(0, 8))
    (tmp_path / "theirs").mkdir()
    me = os.geteuid()
    monkeypatch.setattr(os, "geteuid", lambda: me + 1)
    with pytest.raises(PermissionError, match=rf"theirs belongs to user {me}, not to you \(user {me + 1}\)"):
        sb.save(buf, tmp_path / "theirs")
    monkeypatch.undo()
    assert os.listdir(tmp_path / "theirs") == []
    with pytest.raises(sb.ClosedError):  # a failed save leaves no directory it made
        closed = sb.ReplayBuffer.attach(buf.handle)
        closed.close()
        sb.save(closed, tmp_path / "new")
    assert not (tmp_path / "new").exists()


def test_save_refuses_an_empty_path_and_a_wait_that_is_not_seconds(
    make: Make, name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``save("")`` would write into the current folder (``Path("")`` is ``.``); a NaN ``wait``
    would wait for good for a row being written. Both are refused, and nothing is written."""
    buf = make(MUJOCO, capacity=8, name=name)
    buf.push(transition(0, 8))
    monkeypatch.chdir(tmp_path)
    for path in ("", b"", None):
        with pytest.raises(ValueError, match=r"save: path: expected a folder's path .* got"):
            sb.save(buf, path)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"save: wait: expected seconds"):
        buf.save(tmp_path / "s", wait=float("nan"))
    assert os.listdir(tmp_path) == [] and len(buf) == 8 and buf.stats["inserted"] == 8


def test_a_save_while_other_rows_are_updated_all_the_time_keeps_every_row(
    make: Make, name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # another process updating some row without pause moves Counter.UPDATES across every copy of
    # a piece; the save must still copy the piece (holding the lock, so no update can begin),
    # not give up after its tries and drop every row up to the piece's end
    from shmbuffer.protocol.layout import Counter
    from shmbuffer.shm.lock import RobustLock

    buf = make(sb.Schema(x=((), "int64")), 64, sampler=sb.Prioritized(), name=name)
    buf.push(x=np.arange(64))
    held: list[int] = []
    acquire, release = RobustLock.acquire, RobustLock.release

    def locked(self: RobustLock, timeout: float | None = None) -> None:
        acquire(self, timeout)
        held.append(1)

    def unlocked(self: RobustLock) -> None:
        held.pop()
        release(self)

    monkeypatch.setattr(RobustLock, "acquire", locked)
    monkeypatch.setattr(RobustLock, "release", unlocked)
    real = buf.block.counters

    class Moving:
        def __getitem__(self, i: int) -> Any:
            if i == Counter.UPDATES and not held:  # an update begins whenever the lock is free
                real[i] += 1
            return real[i]

        def __setitem__(self, i: int, value: Any) -> None:
            real[i] = value

    monkeypatch.setattr(buf.block, "counters", Moving())
    t = time.monotonic()
    out = sb.export(buf)
    assert out["x"].tolist() == list(range(64)) and time.monotonic() - t < 0.5
    buf.save(tmp_path / "s")
    monkeypatch.undo()
    assert load_file(str(tmp_path / "s" / "rows.safetensors"))["x"].tolist() == list(range(64))


# -- the snapshot reads through the reader's gather --------------------------------------------------------
def _updater(handle: sb.BufferHandle, rounds: int) -> None:
    buf = sb.ReplayBuffer.attach(handle)
    try:
        wide = np.ones((8, 300), np.float32)
        for v in range(1, rounds + 1):
            buf.update(np.arange(8), obs=wide * v, reward=float(v))
    finally:
        buf.close()


def test_a_save_while_another_process_updates_every_row_keeps_every_row_whole(
    make: Make, loaded: list, name: str, tmp_path: Path, procs: list[Any], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Updates never end while the saves run: each save still keeps all 8 rows (a piece an update
    spans is gathered again, at last under the lock), each row of one update, both fields."""
    import multiprocessing as mp

    from shmbuffer.protocol import snapshot

    gathered: list[bool] = []
    real = snapshot.gather

    def spy(*args: Any, **kwargs: Any) -> Any:
        gathered.append(kwargs.get("stored", False))
        return real(*args, **kwargs)

    monkeypatch.setattr(snapshot, "gather", spy)
    schema = sb.Schema(obs=((300,), "float32"), reward=((), "float32"))
    buf = make(schema, 8, name=name)
    buf.push(obs=np.zeros((8, 300)), reward=np.zeros(8))
    p = mp.get_context("fork").Process(target=_updater, args=(buf.handle, 2000))
    procs.append(p)
    p.start()
    saves = 0
    while p.is_alive() or not saves:
        out = sb.save(buf, tmp_path / "u", overwrite=True)
        assert out["rows"] == 8 and out["dropped"] == 0
        got = load_file(str(tmp_path / "u" / "rows.safetensors"))
        assert (got["obs"] == got["reward"][:, None]).all()
        saves += 1
    p.join(30)
    assert p.exitcode == 0
    assert gathered and all(gathered)  # every read of the rows was the reader's gather of the stored rows
    sb.save(buf, tmp_path / "u", overwrite=True)  # the updates have ended: the last one is saved
    new = sb.load(tmp_path / "u")
    loaded.append(new)
    assert np.array_equal(new.get(slice(None)).reward, buf.get(slice(None)).reward)


@pytest.mark.parametrize("case", ["undefined bits", "zeroed", "no end row", "all holes", "one hole"])
def test_a_tampered_frames_save_is_refused(case: str, tmp_path: Path, name: str) -> None:
    """Every column the readers trust is checked on load: ``_kind`` (defined values, end rows where
    episodes end, episodes starting after them) and ``_present`` (a hole's bytes are zeros)."""
    import shutil

    path = tmp_path / "frames"
    shutil.copytree(GOLDEN_V2 / "frames", path)
    tensors = load_file(str(path / "rows.safetensors"))
    kinds = tensors["_kind"]
    at = _tensor_at(path, "_kind")
    if case == "undefined bits":
        _poke(path, at + 1, b"\xff")
        message = "'_kind' holds 255"
    elif case == "zeroed":
        _poke(path, at, bytes(kinds.size))
        message = "last step is not followed by its end row"
    elif case == "no end row":
        end = int(np.flatnonzero(kinds == 1)[0])
        _poke(path, at + end, b"\x00")
        message = "last step is not followed by its end row"
    else:
        present = _tensor_at(path, "_present")
        _poke(path, present, bytes(kinds.size) if case == "all holes" else b"\x00")
        message = "marks row 0 of lane 0 a hole"
    with pytest.raises(sb.LayoutError, match=message):
        sb.load(path, name=name)
    assert not os.path.exists(segment.path_of(name))


def _pushed_values(meta: dict[str, Any], name: str, value: str) -> None:
    meta["pushed"][0]["values"][name] = value


@pytest.mark.parametrize(("edit", "message"), [
    (lambda m: m.pop("pushed"), r"pushed is None, expected an array in a version-3 save only"),
    (lambda m: m.update(format_version=2), r"pushed is .*expected an array in a version-3 save only"),
    (lambda m: m["pushed"].append(m["pushed"][0]), r"pushed\[1\]\.lane is 0, expected each lane once"),
    (lambda m: m["pushed"][0].update(lane=1), r"pushed\[0\]\.lane is 1, expected an int in \[0, 0\]"),
    (lambda m: m["pushed"][0].update(row=5), r"pushed\[0\]\.row is 5, expected lane 0's newest row, 6"),
    (lambda m: m["pushed"][0].update(episode="x"), r"pushed\[0\]\.episode is 'x', expected an int"),
    (lambda m: m["pushed"][0]["values"].pop("obs"), r"pushed\[0\]\.values is .*keys \['next_obs', 'obs'\]"),
    (lambda m: _pushed_values(m, "obs", "not base64!"), r"pushed\[0\]\.values\.obs is .*expected base64"),
    (lambda m: _pushed_values(m, "obs", "AAAA"), r"values\.obs is 'AAAA', expected base64 of 12 bytes"),
    (lambda m: _pushed_values(m, "obs", base64.b64encode(bytes(12)).decode()), r"row 6 of lane 0 .*newest of its stacks"),
    (lambda m: m["lanes"][0].update(stop=6) or m.update(rows=5), r"pushed\[0\]\.row is 6, expected lane 0's newest row, 5"),
])
def test_a_damaged_pushed_entry_is_refused(edit: Callable[[dict[str, Any]], None], message: str, tmp_path: Path,
                                           name: str) -> None:
    """A version-3 save's ``pushed`` (the saving process's last rows, which the loading process's
    next push continues) is checked like every other entry: its place in the file's version, its
    lanes and rows, its values' encoding and sizes, and the stored row it continues."""
    import shutil

    path = tmp_path / "pushed"
    shutil.copytree(GOLDEN_V3 / "pushed", path)
    edit_meta(path, edit)
    with pytest.raises(sb.LayoutError, match=message):
        sb.load(path, name=name)
    assert not os.path.exists(segment.path_of(name))


def test_import_rows_in_pieces_changes_nothing_on_error_and_fills_env_lanes(make: Make, name: str) -> None:
    # import_rows pushes a lane's capacity at a time: a bad value in a later piece must be refused
    # before the first piece goes in, and a buffer with envs= takes whole env steps per piece
    x = sb.Schema(x=((), "int64"))
    buf = make(x, 4, sampler=sb.Prioritized(), max_use=3, name=name)
    with pytest.raises(sb.FieldError, match="nothing was changed"):
        persistence.import_rows(buf, {"x": np.arange(6), "priority": [1.0] * 5 + [-1.0]})
    with pytest.raises(sb.CapacityError, match="uses"):
        persistence.import_rows(buf, {"x": np.arange(6), "uses": [0] * 5 + [-1]})
    assert len(buf) == 0 and buf.stats["inserted"] == 0
    envs = make(x, 6, envs=2, name=name + "e")
    assert persistence.import_rows(envs, {"x": np.arange(4)}).tolist() == [0, 1, 2, 3]
    assert envs.get(slice(None)).x.tolist() == [0, 2, 1, 3]                # lane 0, then lane 1


def test_export_and_import_carry_priorities_uses_and_ids(make: Make, name: str) -> None:
    s = sb.Prioritized(alpha=0.5, eps=0.0)
    buf = make(SMALL, 6, sampler=s, max_use=3, name=name, seed=0)
    buf.push(obs=np.zeros((9, 3))[:6], reward=np.arange(6.0), priority=np.arange(1.0, 7.0))
    buf.push(obs=np.zeros((3, 3)), reward=np.arange(6.0, 9.0), priority=[7.0, 8.0, 9.0])   # ids 3..8 held
    buf.delete([5])
    buf.sample(4, replace=False)
    out = sb.export(buf)
    assert out["index"].tolist() == [3, 4, 6, 7, 8]
    assert np.allclose(out["priority"], [4, 5, 7, 8, 9])
    uses = out["uses"].copy()
    assert uses.sum() == 4
    copy = sb.ReplayBuffer.from_arrays(SMALL, out, sampler=s, max_use=3, name=name + "c")
    try:
        again = sb.export(copy)
        assert again["index"].tolist() == [3, 4, 6, 7, 8]                # the same ids
        assert np.allclose(again["priority"], out["priority"]) and again["uses"].tolist() == uses.tolist()
        assert copy.take([6]).reward.tolist() == [6.0] and len(copy) == 5
        with pytest.raises(sb.EmptyBufferError):
            copy.take([5])                                              # the deleted row stays a hole
    finally:
        copy.close()
        copy.unlink()
    target = make(SMALL, 20, sampler=s, max_use=3, name=name + "t")
    target.push(small_row(100))
    new = persistence.import_rows(target, out)                          # into an existing buffer
    assert new.tolist() == [1, 2, 3, 4, 5]
    assert np.allclose(sb.export(target)["priority"][1:], out["priority"])
    assert target.uses(new).tolist() == uses.tolist()


def test_a_save_of_a_step_ended_after_its_push_loads(make: Make, loaded: list, name: str, tmp_path: Path) -> None:
    """A lane's waiting step ended by ``update`` (SB3's ``dones[pos - 1] = True`` before a second
    ``learn()``), then followed by the next episode's first step, has no next observation: it is
    not a transition, and a save of it loads (the load refused it as an altered ``_kind``)."""
    schema = sb.Schema(obs=((2,), "float32"), next_obs=((2,), "float32"), reward=((), "float32"), done=((), "bool"))

    def steps(ts: range) -> dict[str, np.ndarray]:
        t = np.array(list(ts))
        return {"obs": np.stack([t, t], 1).astype(np.float32), "next_obs": np.stack([t + 1, t + 1], 1).astype(np.float32),
                "reward": t.astype(np.float32), "done": np.zeros(t.size, bool)}

    buf = make(schema, 16, next_of="obs", episodes=True, name=name)
    ids = buf.push(steps(range(3)), episode=0)
    buf.update(ids[-1], done=True)
    buf.push(steps(range(10, 13)), episode=1)
    assert len(buf) == 4
    sb.save(buf, tmp_path / "s")
    new = sb.load(tmp_path / "s", name=name + "l")
    loaded.append(new)
    # the lane's waiting step goes along, still waiting for its next observation (a save keeps it)
    assert len(new) == 4 and new.export()["reward"].tolist() == [0.0, 1.0, 10.0, 11.0]
    assert new.export()["done"].tolist() == [False] * 4
    assert new.pending()["reward"].tolist() == [12.0]


@pytest.mark.parametrize("frames", [None, "obs"])
def test_an_export_of_an_empty_buffer_has_every_key(frames: str | None, make: Make, loaded: list, name: str) -> None:
    """An empty buffer's export has the keys a full one's has (``episode``, ``priority``,
    ``uses``), so code that reads them, and ``from_arrays``, need no special case (an empty
    ``next_of`` buffer's export had no ``episode``: an SB3 buffer pickled after ``reset()`` failed
    to load)."""
    schema = sb.Schema(obs=((2,), "float32"), next_obs=((2,), "float32"), done=((), "bool"))
    opts: dict[str, Any] = dict(next_of=frames, episodes=True, sampler=sb.Prioritized(0.6, 0.4), max_use=3)
    buf = make(schema, 16, name=name, **opts)
    t = np.arange(4, dtype=np.float32)
    buf.push(obs=np.stack([t, t], 1), next_obs=np.stack([t + 1, t + 1], 1), done=t == 3, episode=0)
    keys = set(buf.export())
    buf.clear()
    empty = buf.export()
    assert set(empty) == keys and all(a.shape[0] == 0 for a in empty.values())
    assert empty["episode"].dtype == np.int64 and empty["uses"].dtype == np.int64
    new = sb.ReplayBuffer.from_arrays(schema, empty, capacity=16, name=name + "a", **opts)
    loaded.append(new)
    assert len(new) == 0


@pytest.mark.parametrize("how", ["used up", "deleted"])
def test_a_save_whose_counters_say_no_row_was_removed_still_counts_right(how: str, make: Make, loaded: list,
                                                                         name: str, tmp_path: Path) -> None:
    """Whether rows were removed (deleted or used up, ``Counter.REMOVED``: ``len`` then leaves them
    out) comes from the rows a load reads, not from ``counters`` (which saves written before it
    existed lack, and a hand can edit): ``len`` counted the holes and used-up rows, and
    ``get(slice(0, len))`` raised."""
    buf = make(sb.Schema(x=((), "int64")), 8, max_use=1, name=name)
    ids = buf.push(x=np.arange(6))
    if how == "used up":
        buf.sample(3, replace=False)
    else:
        buf.delete(ids[[1, 2]])
    sb.save(buf, tmp_path / "s")
    edit_meta(tmp_path / "s", lambda m: m["counters"].update(removed=0))
    new = sb.load(tmp_path / "s", name=name + "l")
    loaded.append(new)
    assert len(new) == len(buf) == 3 + (how == "deleted")
    assert np.array_equal(new.get(slice(0, len(new))).x, buf.get(slice(0, len(buf))).x)


@pytest.mark.parametrize("sampler", ["uniform", "prioritized"])
def test_a_save_whose_leaves_disagree_with_the_uses_is_refused(sampler: str, make: Make, name: str,
                                                               tmp_path: Path) -> None:
    """Under ``max_use`` a row's leaf says whether it can be drawn and its use count whether it
    is used up: a save where a row not used up has a leaf of 0 (a row ``len`` counts and no draw
    reaches) is refused, naming the row, as other altered columns are."""
    prioritized = sampler == "prioritized"
    buf = make(sb.Schema(x=((), "int64")), 8, max_use=2, name=name,
               sampler=sb.Prioritized(0.6, 0.4) if prioritized else sb.Uniform())
    buf.push(x=np.arange(6))
    sb.save(buf, tmp_path / "s")
    _poke(tmp_path / "s", _tensor_at(tmp_path / "s", "_leaf") + 8 * 3, bytes(8))  # row 3's leaf: 0.0
    with pytest.raises(sb.LayoutError, match=r"'_leaf'.*row 3"):
        sb.load(tmp_path / "s", name=name + "l")
    assert not os.path.exists(segment.path_of(name + "l"))


@pytest.mark.parametrize("how", ["abandoned", "dead writer"])
def test_a_hole_left_by_a_push_is_not_counted(how: str, make: Make, name: str, procs: list) -> None:
    """A push given back empty (``Ring.abandon``) or a dead writer's row, once reaped, leaves a
    hole: ``len`` and ``get``'s positions leave it out as ``export`` and ``sample`` do (``len``
    counted it, and ``get(slice(0, len(buf)))`` raised "a row was lost")."""
    buf = make(MUJOCO, capacity=16, name=name)
    push_lane(buf, 0, 3)
    hole = interrupted_push(buf, 0, 2) if how == "abandoned" else dead_push(buf, procs, 0, 2)
    push_lane(buf, 0, 3)
    buf.reap()
    kept = buf.export()["index"]
    assert kept.size == 6 and not np.isin(hole, kept).any()
    assert len(buf) == 6 and np.array_equal(buf.get(slice(0, len(buf))).index, kept)
    assert [int(buf.get(i).index) for i in range(-1, -7, -1)] == kept[::-1].tolist()
