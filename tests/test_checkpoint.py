"""Checkpoints (``buf.checkpoint``) and ``ReplayBuffer.resume``: exact for every kind of buffer,
incremental, crash-safe (a checkpointing process killed at random points), compacted, refused when
tampered with, and consistent while writers and a learner run."""

from __future__ import annotations

import contextlib
import errno
import importlib
import json
import mmap
import multiprocessing as mp
import os
import select
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shmbuffer as sb
from shmbuffer.persistence.manifest import MANIFEST, read_manifest
from shmbuffer.protocol.layout import EDIT_LOG, Counter
from shmbuffer.protocol.rows import slot
from shmbuffer.protocol.snapshot import columns
from shmbuffer.sample_paths import generator_state
from shmbuffer.shm import segment

Make = Callable[..., sb.ReplayBuffer]
KINDS = ["uniform", "lanes", "episodes", "prioritized", "max_use", "limiter", "frames"]
FRAME = (6, 6)


@pytest.fixture
def resumed() -> Any:
    """Buffers a test resumed, closed and unlinked at teardown."""
    made: list[sb.ReplayBuffer] = []
    yield made
    for buf in made:
        with contextlib.suppress(BufferError):
            buf.close()
        buf.unlink()


def options(kind: str) -> tuple[sb.Schema, int, dict[str, Any]]:
    """The schema, capacity and options of a buffer of ``kind``."""
    if kind == "frames":
        schema = sb.Schema(obs=((4, *FRAME), "uint8"), next_obs=((4, *FRAME), "uint8"), reward=((), "float32"),
                           done=((), "bool"))
        return schema, 96, dict(next_of="obs", stack={"obs": 4}, lanes=2, episodes=True,
                                sampler=sb.Prioritized(0.6, 0.4))
    schema = sb.Schema(x=((3,), "float32"), y=((), "int64"))
    opts: dict[str, Any] = {
        "uniform": {}, "lanes": dict(lanes=3), "episodes": dict(episodes=True),
        "prioritized": dict(sampler=sb.Prioritized(0.6, 0.4), lanes=2), "max_use": dict(max_use=2),
        "limiter": dict(limiter=sb.RateLimiter(samples_per_insert=2.0, min_size=8, error=40.0, timeout=5.0)),
    }[kind]
    return schema, 48, opts


class Env:
    """A lane's steps of stacked frames (frame ``t`` is all ``t % 251``), episodes of 7 steps."""

    def __init__(self, lane: int, t: int = 0) -> None:
        self.lane, self.t = lane, t

    def steps(self, k: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
        out: dict[str, list[Any]] = {"obs": [], "next_obs": [], "reward": [], "done": []}
        eps = []
        for _ in range(k):
            t = self.t
            start = t - t % 7

            def stack(u: int, start: int = start) -> np.ndarray:
                return np.stack([np.full(FRAME, max(start, v) % 251, np.uint8) for v in range(u - 3, u + 1)])

            out["obs"].append(stack(t))
            out["next_obs"].append(stack(t + 1))
            out["reward"].append(np.float32(t))
            out["done"].append(t % 7 == 6)
            eps.append(self.lane * 10_000 + t // 7)
            self.t += 1
        return {n: np.stack(v) for n, v in out.items()}, np.array(eps, np.int64)


def drive(buf: sb.ReplayBuffer, kind: str, step: int, envs: dict[int, Env] | None = None) -> None:
    """Step ``step`` of a run: pushes, updates, deletes, priorities and samples, the same every time."""
    rng = np.random.default_rng(step)
    if kind == "frames":
        assert envs is not None
        for lane in range(buf.lanes):
            env = envs.setdefault(lane, Env(lane))
            data, eps = env.steps(int(rng.integers(1, 6)))
            buf.push(data, lane=lane, episode=eps)
    else:
        k = int(rng.integers(1, 9))
        data = {"x": rng.random((k, 3), np.float32), "y": rng.integers(0, 100, k)}
        extra: dict[str, Any] = {}
        if buf.lanes > 1:
            extra["lane"] = rng.integers(0, buf.lanes, k)
        if buf.options.episodes:
            extra["episode"] = np.full(k, step // 3)
        buf.push(data, **extra)
        if len(buf) > 4 and step % 2:
            ids = buf.export()["index"]
            pick = rng.choice(ids, 2, replace=False)
            buf.update(pick, y=np.array([-step, -step]))
            if step % 3 == 0:
                buf.delete(pick[:1])
    if len(buf) >= 8:
        batch = buf.sample(4)
        if buf.priorities is not None and buf.priorities.prioritized:
            buf.update_priorities(batch.index, rng.random(4) * 3)


def state(buf: sb.ReplayBuffer) -> dict[str, Any]:
    """Everything a resumed buffer must have as the original had it."""
    ring = buf.ring
    first, stop = ring.bounds()
    lc = ring.lane_capacity
    slots = np.concatenate([slot(lane, np.arange(first[lane], stop[lane]), lc) for lane in range(ring.lanes)])
    arrays = columns(buf)
    out: dict[str, Any] = {"stamps": arrays["_stamp"][slots].copy()}
    slots = slots[out["stamps"] != 0]  # a hole's bytes are never read (a save writes zeros)
    out |= {"first": first.tolist(), "stop": stop.tolist(), "len": len(buf),
                           "base": ring.base(np.arange(ring.lanes)).tolist(), "stats": ring.stats}
    for name in [*buf.block.fields, "_episode", "_uses"]:
        if name in arrays:
            out[name] = arrays[name][slots].copy()
    prios = buf.priorities
    if prios is not None:
        out["leaves"] = prios.tree.leaves[slots].copy()
        out["max_priority"] = prios.max_priority
    c = buf.block.counters
    out["counters"] = [int(c[i]) for i in (Counter.SAMPLE_CALLS, Counter.REMOVED, Counter.INTERLEAVED)]
    out["rng"] = buf.rng.bit_generator.state
    pusher = buf._pusher
    if pusher is not None:
        out["pending"] = {lane: (last.row, last.final, last.episode, {n: v.tolist() for n, v in last.values.items()})
                          for lane, last in pusher.last.items() if last.row == stop[lane] - 1}
    out["export"] = buf.export()
    return out


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if key == "export":
            assert a[key].keys() == b[key].keys()
            for n in a[key]:
                assert np.array_equal(a[key][n], b[key][n]), n
        elif isinstance(a[key], np.ndarray):
            assert np.array_equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


def continue_run(buf: sb.ReplayBuffer, kind: str, steps: int = 4) -> list[tuple[np.ndarray, dict[str, np.ndarray]]]:
    """What a learner draws: ``steps`` batches, with priority updates."""
    out = []
    for step in range(steps):
        batch = buf.sample(6)
        out.append((batch.index.copy(), {n: np.array(batch[n]) for n in buf.schema.names}))
        if buf.priorities is not None and buf.priorities.prioritized:
            buf.update_priorities(batch.index, np.random.default_rng(1000 + step).random(6) * 2)
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_a_resumed_buffer_is_the_checkpointed_one_and_draws_what_it_drew(kind: str, make: Make, resumed: list,
                                                                         name: str, tmp_path: Path) -> None:
    """Every kind of buffer: after checkpoints between pushes, updates, deletes, priority updates
    and samples (the ring lapped), a resumed buffer has the same rows, ids, lanes, episodes,
    stamps, leaves, uses, counters, pending steps and generator, and draws the same batches with
    the same priority updates as the original after the checkpoint."""
    schema, capacity, opts = options(kind)
    buf = make(schema, capacity, name=name, seed=7, **opts)
    envs: dict[int, Env] = {}
    summaries = []
    for step in range(40):
        drive(buf, kind, step, envs)
        if step % 5 == 4:
            summaries.append(buf.checkpoint(tmp_path / "c"))
    assert summaries[0]["full"] and not any(s["full"] for s in summaries[1:])
    assert any(s["edited"] for s in summaries) or kind in ("frames",)
    before = state(buf)
    new = sb.ReplayBuffer.resume(tmp_path / "c", name=name + "r")
    resumed.append(new)
    assert_same(before, state(new))
    drawn, again = continue_run(buf, kind), continue_run(new, kind)
    for (i1, d1), (i2, d2) in zip(drawn, again, strict=True):
        assert np.array_equal(i1, i2)
        for n in d1:
            assert np.array_equal(d1[n], d2[n])
    if kind == "frames":  # the pending steps go on: the next pushes continue the episodes
        for b in (buf, new):
            e = {lane: Env(lane, env.t) for lane, env in envs.items()}
            for lane in range(b.lanes):
                data, eps = e[lane].steps(3)
                b.push(data, lane=lane, episode=eps)
        assert_same(state(buf), state(new))


def test_checkpoints_write_only_what_changed(make: Make, name: str, tmp_path: Path) -> None:
    """A later checkpoint writes the new rows and the edited ones, not every row."""
    buf = make(sb.Schema(x=((64,), "float32")), 1000, name=name)
    buf.push(x=np.ones((800, 64), np.float32))
    first = buf.checkpoint(tmp_path / "c")
    buf.push(x=np.ones((10, 64), np.float32))
    buf.update(np.array([3, 5]), x=np.zeros((2, 64), np.float32))
    later = buf.checkpoint(tmp_path / "c")
    assert (first["new"], first["full"]) == (800, True)
    assert (later["new"], later["edited"], later["full"], later["rows"]) == (10, 2, False, 810)
    assert later["bytes"] < first["bytes"] / 20


def test_rows_edited_while_a_checkpoint_runs_are_read_again(make: Make, resumed: list, name: str, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows updated or deleted after the checkpoint copied them (a new row, an older one) are read
    again once the log of edits is read: the checkpoint holds them as they are then."""
    module = importlib.import_module("shmbuffer.persistence.checkpoint")  # the package's name is the function
    buf = make(sb.Schema(x=((), "int64")), 64, name=name, max_use=3)
    ids = buf.push(x=np.arange(20))
    buf.checkpoint(tmp_path / "c")
    new = buf.push(x=np.arange(20, 30))
    real = module._locked

    def edit_first(*args: Any) -> Any:
        buf.update(new[[2]], x=np.array([-1]))
        buf.update(ids[[5]], x=np.array([-2]))
        buf.delete(ids[[7]])
        return real(*args)

    monkeypatch.setattr(module, "_locked", edit_first)
    got = buf.checkpoint(tmp_path / "c")
    assert (got["new"], got["edited"], got["full"]) == (10, 3, False)
    back = sb.ReplayBuffer.resume(tmp_path / "c", name=name + "r")
    resumed.append(back)
    assert_same(state(buf), state(back))
    assert back.export()["x"].tolist() == [*range(5), -2, 6, *range(8, 22), -1, *range(23, 30)]


def _spy_copy_rows(module: Any, monkeypatch: pytest.MonkeyPatch, allow: bool) -> list[int]:
    """Count the checkpoints that read their new rows as a save does (``copy_rows``); raise in
    one unless ``allow``."""
    calls: list[int] = []
    real = module.copy_rows

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if not allow:
            raise AssertionError("the new rows were copied out of shared memory before being written")
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "copy_rows", spy)
    return calls


@pytest.mark.parametrize("kind", KINDS)
def test_new_rows_are_written_straight_from_the_shared_columns(kind: str, make: Make, resumed: list, name: str,
                                                               tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With no writer, delete or clear racing it, a checkpoint writes its new rows from the shared
    columns into the chunk (no gather into a copy first), and the resumed buffer is the same."""
    module = importlib.import_module("shmbuffer.persistence.checkpoint")
    schema, capacity, opts = options(kind)
    buf = make(schema, capacity, name=name, seed=3, **opts)
    envs: dict[int, Env] = {}
    for step in range(12):
        drive(buf, kind, step, envs)
    first, stop = buf.ring.bounds()
    lc = buf.ring.lane_capacity
    holes = sum(int((columns(buf)["_stamp"][slot(lane, np.arange(first[lane], stop[lane]), lc)] == 0).sum())
                for lane in range(buf.lanes))  # deleted rows: a checkpoint of them reads as a save does
    calls = _spy_copy_rows(module, monkeypatch, allow=True)
    buf.checkpoint(tmp_path / "c")
    for step in range(12, 16):
        if kind == "frames":
            drive(buf, kind, step, envs)
        else:
            extra: dict[str, Any] = {"lane": np.arange(5) % buf.lanes} if buf.lanes > 1 else {}
            if buf.options.episodes:
                extra["episode"] = np.full(5, 99)
            buf.push(x=np.ones((5, 3), np.float32), y=np.arange(5), **extra)
    buf.checkpoint(tmp_path / "c")
    assert len(calls) == (1 if holes else 0)
    back = sb.ReplayBuffer.resume(tmp_path / "c", name=name + "r")
    resumed.append(back)
    assert_same(state(buf), state(back))


@pytest.mark.parametrize("race", ["delete", "update", "lap"])
def test_a_row_that_changes_while_written_from_the_columns_is_not_taken_from_there(
        race: str, make: Make, resumed: list, name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A new row deleted, updated or overwritten (writers lapping the ring) after the first column
    of the chunk was written from shared memory: the stamps after the writes (delete, lap) send
    the rows through the save's reader, the log of edits (an update keeps the stamp) reads the
    row again; the checkpoint holds no torn or lost row."""
    module = importlib.import_module("shmbuffer.persistence.checkpoint")
    buf = make(sb.Schema(x=((), "int64"), y=((2,), "float32")), 64, name=name)
    buf.push(x=np.arange(54), y=np.zeros((54, 2), np.float32))
    buf.checkpoint(tmp_path / "c")
    new = buf.push(x=np.arange(54, 64), y=np.ones((10, 2), np.float32))
    before = buf.export()
    calls = _spy_copy_rows(module, monkeypatch, allow=True)
    real = module._Chunk.write
    writes: list[int] = []

    def racing(chunk: Any, offset: int, a: np.ndarray) -> None:
        writes.append(1)
        if len(writes) == 2:  # the first column is in the file, the second not yet
            if race == "delete":
                buf.delete(new[[3]])
            elif race == "update":
                buf.update(new[[3]], x=np.array([-3]), y=np.full((1, 2), -3, np.float32))
            else:
                buf.push(x=np.arange(100, 160), y=np.zeros((60, 2), np.float32))  # 54 old rows and 6 new ones go
        real(chunk, offset, a)

    monkeypatch.setattr(module._Chunk, "write", racing)
    buf.checkpoint(tmp_path / "c")
    back = sb.ReplayBuffer.resume(tmp_path / "c", name=name + "r")
    resumed.append(back)
    got = back.export()
    if race == "lap":
        assert len(calls) == 1
        assert got["index"].tolist() == before["index"][-4:].tolist()
        assert got["x"].tolist() == before["x"][-4:].tolist() and np.array_equal(got["y"], before["y"][-4:])
        return
    assert_same(state(buf), state(back))
    assert len(calls) == (1 if race == "delete" else 0)
    if race == "update":
        assert got["x"][57] == -3 and got["y"][57].tolist() == [-3, -3]


def test_an_overrun_log_of_edits_writes_every_row(make: Make, resumed: list, name: str, tmp_path: Path) -> None:
    """More rows edited between two checkpoints than the log of edits holds: the checkpoint cannot
    tell which, so it writes every row, and none is missed."""
    buf = make(sb.Schema(x=((), "int64")), 4 * EDIT_LOG, name=name)
    ids = buf.push(x=np.arange(3 * EDIT_LOG))
    buf.checkpoint(tmp_path / "c")
    for i in range(0, ids.size, 64):  # every row, in updates of 64
        buf.update(ids[i:i + 64], x=-np.arange(i, min(i + 64, ids.size)))
    got = buf.checkpoint(tmp_path / "c")
    assert got["full"] and got["new"] == ids.size
    new = sb.ReplayBuffer.resume(tmp_path / "c", name=name + "r")
    resumed.append(new)
    assert np.array_equal(new.export()["x"], -np.arange(ids.size))


def _open_in(folder: Path) -> list[str]:
    """The files under ``folder`` this process holds open (Linux: ``/proc/self/fd``)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(str(folder) + os.sep):
                out.append(target)
    return out


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="lists open files through /proc")
def test_a_log_of_edits_that_overruns_while_a_checkpoint_runs_leaves_no_file_open(
        make: Make, resumed: list, name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """More rows edited while a checkpoint runs than the log of edits holds: the checkpoint starts
    again with every row, and the chunk it had begun is closed and removed, not left open."""
    module = importlib.import_module("shmbuffer.persistence.checkpoint")
    buf = make(sb.Schema(x=((), "int64")), 4 * EDIT_LOG, name=name)
    ids = buf.push(x=np.arange(3 * EDIT_LOG))
    buf.checkpoint(tmp_path / "c")
    buf.push(x=np.arange(10))
    real = module._locked
    tries: list[int] = []

    def overrun(*args: Any) -> Any:
        if not tries:
            for i in range(0, ids.size, 64):
                buf.update(ids[i:i + 64], x=-np.arange(i, min(i + 64, ids.size)))
        tries.append(1)
        return real(*args)

    monkeypatch.setattr(module, "_locked", overrun)
    got = buf.checkpoint(tmp_path / "c")
    assert got["full"] and len(tries) == 2
    assert _open_in(tmp_path / "c") == []
    assert not [f for f in os.listdir(tmp_path / "c") if f.endswith(".tmp")]
    back = sb.ReplayBuffer.resume(tmp_path / "c", name=name + "r")
    resumed.append(back)
    assert_same(state(buf), state(back))


@pytest.mark.parametrize("which", [0, 1])
def test_a_checkpoint_whose_rename_fails_leaves_no_temporary_file(
        which: int, make: Make, resumed: list, name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The chunk's rename (0) or the manifest's (1) fails: the error comes out, no temporary file is
    left (nor open), and the folder resumes as the previous checkpoint left it."""
    buf = make(sb.Schema(x=((64,), "float32"), y=((), "int64")), 64, name=name)
    buf.push(x=np.ones((20, 64), np.float32), y=np.arange(20))
    buf.checkpoint(tmp_path / "c")
    before = state(buf)
    buf.push(x=np.full((8, 64), 2, np.float32), y=np.arange(8))
    real, calls = os.replace, []

    def replace(src: str, dst: str, **kwargs: Any) -> None:
        calls.append(src)
        if len(calls) == which + 1:
            raise OSError(errno.EIO, "rename failed", src)
        real(src, dst, **kwargs)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="rename failed"):
        buf.checkpoint(tmp_path / "c")
    monkeypatch.setattr(os, "replace", real)
    assert _open_in(tmp_path / "c") == []
    assert not [f for f in os.listdir(tmp_path / "c") if f.endswith(".tmp")]
    back = sb.ReplayBuffer.resume(tmp_path / "c", name=name + "r")
    resumed.append(back)
    assert_same(before, state(back))


class _Disk:
    """What a checkpoint asks of the disk, in order: ``("start", file, offset, nbytes)`` for each
    ``sync_file_range`` (``fail``: each returns -1, as on a file system without it), ``("fsync",
    file)`` and ``("rename", src, dst)``; files by the names they were created under, the folder as
    ``"folder"``."""

    def __init__(self, module: Any, monkeypatch: pytest.MonkeyPatch, call: str) -> None:
        self.events: list[tuple[Any, ...]] = []
        self.names: dict[int, str] = {}
        real_create, real_fsync, real_replace = module.create_file, os.fsync, os.replace

        def create(file: str, dfd: int) -> int:
            fd = real_create(file, dfd)
            self.names[fd] = file
            return fd

        def start(fd: int, offset: int, nbytes: int, flags: int) -> int:
            self.events.append(("start", self.names[fd], offset, nbytes, flags))
            return -1 if call == "failing" else 0

        def fsync(fd: int) -> None:
            self.events.append(("fsync", "folder" if os.path.isdir(f"/proc/self/fd/{fd}") else self.names.get(fd)))
            real_fsync(fd)

        def replace(src: str, dst: str, **kwargs: Any) -> None:
            self.events.append(("rename", src, dst))
            real_replace(src, dst, **kwargs)

        monkeypatch.setattr(module, "create_file", create)
        monkeypatch.setattr(module, "_sync_file_range", lambda: None if call == "none" else start)
        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "replace", replace)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="tells the folder from files through /proc")
@pytest.mark.parametrize("sync", [True, False])
def test_a_synced_checkpoint_starts_its_pages_to_the_disk_as_it_writes_them(
        sync: bool, make: Make, resumed: list, name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``sync``, each write of the chunk starts its whole pages to the disk at once
    (``sync_file_range``), and the rest of the chunk and the manifest once they are complete, so
    that the fsyncs wait only for what is left; the chunk and the manifest are fsync-ed before
    either is renamed into place, the folder after each rename (the chunk's name is on the disk
    before the manifest that names it). Without ``sync``, neither."""
    module = importlib.import_module("shmbuffer.persistence.checkpoint")
    buf = make(sb.Schema(x=((4096,), "float32"), y=((), "int64")), 256, name=name)
    buf.push(x=np.ones((100, 4096), np.float32), y=np.arange(100))
    buf.checkpoint(tmp_path / "c")
    buf.push(x=np.full((64, 4096), 2, np.float32), y=np.arange(64))  # 1 MB of x
    disk = _Disk(module, monkeypatch, "working")
    got = buf.checkpoint(tmp_path / "c", sync=sync)
    back = sb.ReplayBuffer.resume(tmp_path / "c", name=name + "r")
    resumed.append(back)
    assert_same(state(buf), state(back))
    if not sync:
        assert [e[0] for e in disk.events] == ["rename", "rename"]
        return
    chunk, man = (next(n for n in disk.names.values() if n.startswith(p)) for p in (".chunk-", f".{MANIFEST}"))
    at = {e: i for i, e in enumerate(disk.events)}
    page = mmap.PAGESIZE
    writes = [e for e in disk.events if e[:2] == ("start", chunk) and e[3]]
    assert writes and all(e[2] % page == 0 and e[3] % page == 0 and e[4] == 2 for e in writes)
    assert sum(e[3] for e in writes) >= 64 * 4096 * 4 - 2 * page  # every whole page of x as it is written
    assert at[("start", chunk, 0, 0, 2)] > max(at[e] for e in writes)  # the rest once complete
    assert at[("start", man, 0, 0, 2)] < at[("fsync", chunk)] < at[("fsync", man)]
    assert [e for e in disk.events if e[0] != "start"] == [
        ("fsync", chunk), ("fsync", man), ("rename", chunk, f"chunk-{got['sequence']:08d}.safetensors"),
        ("fsync", "folder"), ("rename", man, MANIFEST), ("fsync", "folder")]


@pytest.mark.parametrize("call", ["none", "failing"])
def test_where_pages_cannot_be_started_early_the_fsyncs_write_them(
        call: str, make: Make, resumed: list, name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No ``sync_file_range`` (not Linux), or one that fails (a file system without it): a synced
    checkpoint is written and fsync-ed all the same, and resumes to the buffer."""
    module = importlib.import_module("shmbuffer.persistence.checkpoint")
    buf = make(sb.Schema(x=((4096,), "float32"), y=((), "int64")), 256, name=name)
    buf.push(x=np.ones((100, 4096), np.float32), y=np.arange(100))
    buf.checkpoint(tmp_path / "c")
    buf.push(x=np.full((64, 4096), 2, np.float32), y=np.arange(64))
    disk = _Disk(module, monkeypatch, call)
    buf.checkpoint(tmp_path / "c")
    assert ("start" in [e[0] for e in disk.events]) == (call == "failing")
    assert [e[0] for e in disk.events if e[0] != "start"] == ["fsync", "fsync", "rename", "fsync", "rename", "fsync"]
    back = sb.ReplayBuffer.resume(tmp_path / "c", name=name + "r")
    resumed.append(back)
    assert_same(state(buf), state(back))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux's")
def test_sync_file_range_is_found_on_linux(tmp_path: Path) -> None:
    """On Linux the checkpoint finds libc's ``sync_file_range``, and it takes a file's pages."""
    module = importlib.import_module("shmbuffer.persistence.checkpoint")
    call = module._sync_file_range()
    assert call is not None
    fd = os.open(tmp_path / "f", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        os.write(fd, b"x" * 3 * mmap.PAGESIZE)
        assert call(fd, 0, 2 * mmap.PAGESIZE, 2) == 0
        assert call(fd, 0, 0, 2) == 0
    finally:
        os.close(fd)


def test_a_buffer_resumed_under_its_name_goes_on_incrementally(make: Make, resumed: list, name: str,
                                                               tmp_path: Path) -> None:
    """Resumed under the checkpointed buffer's name, the next checkpoint adds to the folder; under
    another name it writes every row (it cannot know the rows are the same)."""
    buf = make(sb.Schema(x=((), "int64")), 64, name=name)
    buf.push(x=np.arange(40))
    buf.checkpoint(tmp_path / "c")
    buf.close()
    buf.unlink()
    new = sb.ReplayBuffer.resume(tmp_path / "c", name=name)
    resumed.append(new)
    new.push(x=np.arange(40, 45))
    assert not new.checkpoint(tmp_path / "c")["full"]
    other = sb.ReplayBuffer.resume(tmp_path / "c", name=name + "o")
    resumed.append(other)
    assert other.checkpoint(tmp_path / "c")["full"]
    assert other.export()["x"].tolist() == list(range(45))


def test_compaction_keeps_the_folder_within_about_twice_the_buffer(make: Make, resumed: list, name: str,
                                                                   tmp_path: Path) -> None:
    """A ring lapped many times over many checkpoints: chunks less than half used are compacted,
    those unused removed, and the folder stays within about twice the buffer's rows."""
    buf = make(sb.Schema(x=((32,), "float32")), 256, lanes=2, name=name)
    row = 32 * 4
    for i in range(60):
        buf.push(x=np.full((24, 32), i, np.float32), lane=i % 2)
        got = buf.checkpoint(tmp_path / "c")
        chunks = [p for p in os.listdir(tmp_path / "c") if p.startswith("chunk-")]
        assert len(chunks) == len(read_manifest(tmp_path / "c").chunks)  # type: ignore[union-attr]
        assert got["folder_bytes"] <= 2 * 256 * (row + 1) + 8 * 4096, i
    assert got["kept"] >= 0
    new = sb.ReplayBuffer.resume(tmp_path / "c", name=name + "r")
    resumed.append(new)
    assert_same(state(buf), state(new))


def test_a_checkpoint_of_another_buffer_to_the_same_folder_is_refused(make: Make, name: str, tmp_path: Path) -> None:
    buf = make(sb.Schema(x=((), "int64")), 16, name=name)
    buf.push(x=np.arange(4))
    buf.checkpoint(tmp_path / "c")
    other = make(sb.Schema(x=((2,), "int64")), 16, name=name + "b")
    with pytest.raises(sb.FieldError, match="another schema or options"):
        other.checkpoint(tmp_path / "c")
    assert read_manifest(tmp_path / "c").buffer == name  # type: ignore[union-attr]


def _manifest_edit(folder: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    meta = json.loads((folder / MANIFEST).read_text())
    edit(meta)
    (folder / MANIFEST).write_text(json.dumps(meta))


@pytest.mark.parametrize("damage", ["manifest truncated", "manifest not json", "segment out of range", "chunk truncated",
                                    "chunk missing", "chunk header altered", "present altered", "leaf altered",
                                    "chunk of another checkpoint", "generator", "ranks", "device generator"])
def test_a_damaged_checkpoint_is_refused(damage: str, make: Make, name: str, tmp_path: Path) -> None:
    """Truncated or altered manifests and chunks raise ``LayoutError`` naming the file, before any
    shared memory is made."""
    buf = make(sb.Schema(x=((), "int64")), 16, name=name, sampler=sb.Prioritized(0.6, 0.4))
    buf.push(x=np.arange(6))
    buf.checkpoint(tmp_path / "c")
    buf.push(x=np.arange(2))
    buf.checkpoint(tmp_path / "c")
    folder = tmp_path / "c"
    man = read_manifest(folder)
    assert man is not None
    newest = folder / man.chunks[-1]["file"]
    oldest = folder / man.chunks[0]["file"]
    raw = bytearray(oldest.read_bytes())
    head = 8 + int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:head])
    match = None
    if damage == "manifest truncated":
        text = (folder / MANIFEST).read_bytes()
        (folder / MANIFEST).write_bytes(text[:len(text) // 2])
        match = "not valid JSON"
    elif damage == "manifest not json":
        (folder / MANIFEST).write_text("[1, 2]")
    elif damage == "segment out of range":
        _manifest_edit(folder, lambda m: m["checkpoint"]["segments"][0][0].__setitem__(4, 100))
    elif damage == "chunk truncated":
        oldest.write_bytes(bytes(raw[:-3]))
        match = "truncated"
    elif damage == "chunk missing":
        oldest.unlink()
    elif damage == "chunk header altered":
        raw[head - 20:head - 10] = b"x" * 10
        oldest.write_bytes(bytes(raw))
    elif damage == "present altered":
        at = head + header["new/_present"]["data_offsets"][0]
        raw[at] = 7
        oldest.write_bytes(bytes(raw))
        match = "_present"
    elif damage == "leaf altered":
        new_raw = bytearray(newest.read_bytes())
        h = 8 + int.from_bytes(new_raw[:8], "little")
        at = h + json.loads(new_raw[8:h])["_leaf"]["data_offsets"][0]
        new_raw[at:at + 8] = np.float64(-1.0).tobytes()
        newest.write_bytes(bytes(new_raw))
        match = "_leaf"
    elif damage == "chunk of another checkpoint":
        _manifest_edit(folder, lambda m: m["checkpoint"]["chunks"][0].__setitem__("id", "0" * 16))
        match = "not the one"
    elif damage == "ranks":
        _manifest_edit(folder, lambda m: m["checkpoint"].__setitem__("ranks", {"world_size": 0, "seed": 1, "step": 2,
                                                                               "epochs": 0}))
        match = r"checkpoint.ranks.world_size is 0, expected an int in \[1, "
    elif damage == "device generator":
        _manifest_edit(folder, lambda m: m["checkpoint"].__setitem__("device_generator", [1, 2]))
        match = "checkpoint.device_generator is 'list', expected an object"
    else:
        _manifest_edit(folder, lambda m: m["checkpoint"].__setitem__("generator", {"bit_generator": "Nope"}))
        match = "generator"
    error = FileNotFoundError if damage == "chunk missing" else sb.LayoutError
    with pytest.raises(error, match=match):
        sb.ReplayBuffer.resume(folder, name=name + "r")
    assert not os.path.exists(segment.path_of(name + "r"))


def test_resume_of_a_folder_without_a_checkpoint_says_so(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="checkpoint"):
        sb.ReplayBuffer.resume(tmp_path)


# -- writers and a learner running -------------------------------------------------------------------
def _writer(handle: Any, stop: Any) -> None:
    buf = sb.ReplayBuffer.attach(handle)
    i = 0
    while not stop.is_set():
        k = 16
        buf.push(x=np.arange(i, i + k, dtype=np.int64), y=np.zeros(k, np.int64))
        i += k
    buf.close()


def _learner(handle: Any, stop: Any) -> None:
    buf = sb.ReplayBuffer.attach(handle)
    rng = np.random.default_rng(0)
    while not stop.is_set():
        if len(buf) < 32:
            continue
        batch = buf.sample(16)
        buf.update_priorities(batch.index, rng.random(16) + 0.1)
        buf.update(batch.index[:2], y=batch.x[:2] + 1_000_000)
    buf.close()


def test_checkpoints_while_a_writer_and_a_learner_run(make: Make, resumed: list, procs: list, name: str,
                                                      tmp_path: Path) -> None:
    """A writer pushes and a learner samples, updates priorities and rows while checkpoints are
    taken: each checkpoint resumes to rows that are whole (each row's ``x`` its id, its ``y`` 0 or
    its ``x`` plus the learner's mark), consecutive in their lane, with valid leaves."""
    buf = make(sb.Schema(x=((), "int64"), y=((), "int64")), 4096, name=name, sampler=sb.Prioritized(0.6, 0.4))
    ctx = mp.get_context("fork")
    stop = ctx.Event()
    for target in (_writer, _learner):
        p = ctx.Process(target=target, args=(buf.handle, stop))
        p.start()
        procs.append(p)
    try:
        deadline = time.monotonic() + 10
        while buf.ring.inserted < 2000 and time.monotonic() < deadline:
            time.sleep(0.01)
        sums = [buf.checkpoint(tmp_path / "c", sync=False) for _ in range(8)]
    finally:
        stop.set()
        for p in procs:
            p.join(10)
    assert not any(s["full"] for s in sums[1:])
    new = sb.ReplayBuffer.resume(tmp_path / "c", name=name + "r")
    resumed.append(new)
    out = new.export()
    assert out["index"].size > 0
    assert np.array_equal(out["x"], out["index"])
    assert np.isin(out["y"], [0]).sum() + (out["y"] == out["x"] + 1_000_000).sum() == out["y"].size
    assert (np.diff(out["index"]) == 1).all()


# -- killed while it checkpoints -----------------------------------------------------------------------
def _child(folder: Path, name: str, kind: str, seed: int, out: int) -> None:
    """Resume (or start) the run under ``name`` and go on: a step, a checkpoint, forever; tell
    ``out`` when it has resumed (``r``) and how long each checkpoint took."""
    schema, capacity, opts = options(kind)
    man = read_manifest(folder, missing_ok=True)
    if man is None:
        buf = sb.ReplayBuffer(schema, capacity, name=name, seed=seed, **opts)
        step = 0
    else:
        buf = sb.ReplayBuffer.resume(folder, name=name)
        step = man.sequence
    os.write(out, b"r")
    while True:
        step += 1
        drive(buf, kind, step)
        t0 = time.perf_counter()
        buf.checkpoint(folder)
        os.write(out, f"c{time.perf_counter() - t0:.4f}".encode())


def test_a_checkpoint_killed_at_any_point_leaves_the_last_complete_one(make: Make, resumed: list, name: str,
                                                                        tmp_path: Path) -> None:
    """A process that steps and checkpoints in a loop, SIGKILLed at random points 50 times (from
    its start to about two checkpoints in), each time resumed by the next one under the same name:
    each time the folder resumes to exactly the state after its last complete checkpoint (a
    reference run replays the same steps), never a half one, and no stray file outlives the next
    checkpoint."""
    kind = "prioritized"
    schema, capacity, opts = options(kind)
    folder = tmp_path / "c"
    folder.mkdir()
    ref = make(schema, capacity, name=name + "ref", seed=3, **opts)
    at = 0
    rng = np.random.default_rng(0)
    interrupted = 0
    took = 0.1
    for kill in range(50):
        before = set(os.listdir(folder))
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            try:
                os.close(r)
                _child(folder, name, kind, 3, w)
            finally:
                os._exit(0)
        os.close(w)
        try:
            ready, _, _ = select.select([r], [], [], 30)
            assert ready and os.read(r, 1) == b"r"
            time.sleep(float(rng.uniform(0.0, 2.5 * took)))
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            said = b""
            while chunk := os.read(r, 4096):
                said += chunk
        finally:
            os.close(r)
        times = [float(x) for x in said.decode().split("c")[1:] if x]
        took = 0.5 * took + 0.5 * float(np.mean(times)) if times else took * 1.3  # none done: a longer window
        with contextlib.suppress(FileNotFoundError):
            os.unlink(segment.path_of(name))  # the killed child's buffer: the next one takes its name
        interrupted += any(p.endswith(".tmp") for p in set(os.listdir(folder)) - before)
        man = read_manifest(folder, missing_ok=True)
        if man is None:
            continue
        while at < man.sequence:
            at += 1
            drive(ref, kind, at)
            generator_state(ref._paths, ref.rng)  # as a checkpoint does
        new = sb.ReplayBuffer.resume(folder, name=f"{name}k{kill}")
        try:
            assert_same(state(ref), state(new))
        finally:
            new.close()
            new.unlink()
    assert at >= 10, f"the children made progress ({at} checkpoints)"
    assert interrupted >= 5, f"kills landed while a checkpoint was being written ({interrupted} of 50)"
    last = sb.ReplayBuffer.resume(folder, name=name)
    resumed.append(last)
    last.checkpoint(folder)
    listed = {c["file"] for c in read_manifest(folder).chunks}  # type: ignore[union-attr]
    assert set(os.listdir(folder)) == listed | {MANIFEST, ".lock"}


def _rank_batches(ranks: list[sb.ReplayBuffer], steps: int) -> list[np.ndarray]:
    """``steps`` sample calls of each rank in lockstep (one global batch a step), with priority
    updates where prioritized: the ids each rank drew, step by step."""
    out = []
    for step in range(steps):
        for r in ranks:
            batch = r.sample(4)
            out.append(batch.index.copy())
            if r.priorities is not None and r.priorities.prioritized:
                r.update_priorities(batch.index, np.random.default_rng(step).random(4) * 3 + 0.1)
    return out


@pytest.mark.parametrize("sampler", ["uniform", "prioritized"])
def test_resumed_ranks_draw_what_the_ranks_drew(sampler: str, make: Make, resumed: list, name: str,
                                                tmp_path: Path) -> None:
    """A rank's checkpoint records its step and epochs (the ranks' draws are keyed on them); ranks
    attached to the resumed buffer that put their sampling state back (``resume_sampling``) draw
    the batches the ranks drew after the checkpoint."""
    opts = {"sampler": sb.Prioritized(0.6, 0.4)} if sampler == "prioritized" else {}
    buf = make(sb.Schema(x=((), "int64")), 64, name=name, lanes=2, **opts)
    buf.push(x=np.arange(40), lane=np.arange(40) % 2)
    ranks = [sb.ReplayBuffer.attach(name, rank=r, world_size=2, seed=5) for r in range(2)]
    try:
        _rank_batches(ranks, 3)
        for r in ranks:  # a whole epoch: the next one's permutation is keyed on the count
            list(r.epoch(8))
        ranks[0].checkpoint(tmp_path / "c")
        man = read_manifest(tmp_path / "c")
        assert man is not None and man.ranks == {"world_size": 2, "seed": 5, "step": 3, "epochs": 1}
        drawn = _rank_batches(ranks, 3)
        epochs_drawn = [[b.index.tolist() for b in r.epoch(8)] for r in ranks]
    finally:
        for r in ranks:
            r.close()
    new = sb.ReplayBuffer.resume(tmp_path / "c", name=name + "r")
    resumed.append(new)
    again = [sb.ReplayBuffer.attach(name + "r", rank=r, world_size=2, seed=5) for r in range(2)]
    try:
        for r in again:
            r.resume_sampling(tmp_path / "c")
            assert (r.ranked.step, r.ranked.epochs) == (3, 1)  # type: ignore[union-attr]
        got = _rank_batches(again, 3)
        epochs = [[b.index.tolist() for b in r.epoch(8)] for r in again]
    finally:
        for r in again:
            r.close()
    for a, b in zip(drawn, got, strict=True):
        assert np.array_equal(a, b)
    assert epochs == epochs_drawn


def test_resume_sampling_of_a_rank_of_another_run_is_refused(make: Make, resumed: list, name: str,
                                                             tmp_path: Path) -> None:
    """A rank attached with another world size or seed than the checkpointed ranks', or a
    checkpoint no rank wrote: ``FieldError`` naming both, and the rank's step and generator stay."""
    buf = make(sb.Schema(x=((), "int64")), 64, name=name)
    buf.push(x=np.arange(20))
    rank = sb.ReplayBuffer.attach(name, rank=0, world_size=2, seed=5)
    try:
        rank.ranked.step = 7  # type: ignore[union-attr]
        rank.checkpoint(tmp_path / "ranked")
        buf.checkpoint(tmp_path / "plain")
    finally:
        rank.close()
    for world_size, seed, folder in ((3, 5, "ranked"), (2, 6, "ranked"), (2, 5, "plain")):
        other = sb.ReplayBuffer.attach(name, rank=0, world_size=world_size, seed=seed)
        try:
            before = other.rng.bit_generator.state
            with pytest.raises(sb.FieldError, match=f"this process is rank 0 with {{'world_size': {world_size}, 'seed': "
                                                    f"{seed}}}.*attach with the world_size and seed"):
                other.resume_sampling(tmp_path / folder)
            assert other.ranked.step == 0 and other.rng.bit_generator.state == before  # type: ignore[union-attr]
        finally:
            other.close()


@pytest.mark.parametrize("kind", ["uniform", "frames"])
def test_a_device_copy_resumed_draws_what_it_drew(kind: str, make: Make, resumed: list, name: str,
                                                  tmp_path: Path) -> None:
    """``checkpoint(path, device=copy)`` records the device copy's generator; a copy of the resumed
    buffer given it back (``resume_sampling(path, device=...)``) draws what the copy drew after
    the checkpoint (the C uniform draw's generator, and torch's where the draw is torch's)."""
    pytest.importorskip("torch")
    from shmbuffer.device import DeviceReplay

    if kind == "frames":
        schema, capacity, opts = options("frames")
        opts.pop("sampler")
    else:
        schema, capacity, opts = sb.Schema(x=((3,), "float32"), y=((), "int64")), 64, {"lanes": 2}
    buf = make(schema, capacity, name=name, seed=1, **opts)
    envs: dict[int, Env] = {}
    for step in range(10):
        if kind == "frames":
            drive(buf, kind, step, envs)
        else:
            buf.push(x=np.full((4, 3), step, np.float32), y=np.arange(4), lane=step % 2)

    def draws(dev: Any) -> list[np.ndarray]:
        return [np.asarray(dev.sample(5).index) for _ in range(4)]

    with DeviceReplay(buf, "cpu", seed=3, refresher=False, max_lag_s=None) as dev:
        draws(dev)
        buf.checkpoint(tmp_path / "c", device=dev)
        drawn = draws(dev)
    new = sb.ReplayBuffer.resume(tmp_path / "c", name=name + "r")
    resumed.append(new)
    with DeviceReplay(new, "cpu", seed=99, refresher=False, max_lag_s=None) as again:
        fresh = draws(again)
        new.resume_sampling(tmp_path / "c", device=again)
        got = draws(again)
    assert any(not np.array_equal(a, b) for a, b in zip(drawn, fresh, strict=True))  # another seed draws otherwise
    for a, b in zip(drawn, got, strict=True):
        assert np.array_equal(a, b)


def test_a_device_copy_of_another_buffer_or_state_is_refused(make: Make, resumed: list, name: str,
                                                             tmp_path: Path) -> None:
    """``device=`` must be a device copy of this buffer, and the checkpoint must hold a copy's
    generator; a malformed state is refused by the copy, which keeps its own."""
    pytest.importorskip("torch")
    from shmbuffer.device import DeviceReplay

    buf = make(sb.Schema(x=((), "int64")), 16, name=name)
    other = make(sb.Schema(x=((), "int64")), 16, name=name + "o")
    buf.push(x=np.arange(8))
    other.push(x=np.arange(8))
    with DeviceReplay(other, "cpu", seed=1, refresher=False) as theirs, \
            DeviceReplay(buf, "cpu", seed=1, refresher=False) as mine:
        with pytest.raises(sb.FieldError, match=f"device must be a DeviceReplay of buffer '{name}', got DeviceReplay of "
                                                f"buffer '{name}o'"):
            buf.checkpoint(tmp_path / "c", device=theirs)
        assert not (tmp_path / "c").exists()
        buf.checkpoint(tmp_path / "c")
        state = mine.generator_state
        with pytest.raises(sb.FieldError, match="holds no device copy's generator"):
            buf.resume_sampling(tmp_path / "c", device=mine)
        with pytest.raises(ValueError, match=r"DeviceReplay\.generator_state: expected what generator_state returns"):
            mine.generator_state = {"torch": "00", "xoshiro": [1, 2, 3, 4]}
        assert mine.generator_state == state
