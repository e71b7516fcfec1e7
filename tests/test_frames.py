"""Observations stored once (``frames.py``): next observations and frame stacks read from the lane.

The reference is a buffer storing full ``obs`` and ``next_obs``: given the same pushes, every
transition the compressed buffer returns is bit-identical to the reference's, over random episode
lengths, terminations and truncations, several lanes, wrap-around, both paddings and stack axes;
and under writer processes that are killed mid-run, every sampled transition is exactly the one
its writer pushed."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import shmbuffer as sb
from shmbuffer import frames, persistence
from shmbuffer.errors import FieldError, SchemaError
from shmbuffer.protocol.layout import Counter

Make = Callable[..., sb.ReplayBuffer]


def schema(frame: tuple[int, ...], k: int, axis: int) -> sb.Schema:
    shape = list(frame)
    shape[axis] *= k
    return sb.Schema(obs=(tuple(shape), "uint8"), action=((), "int64"), reward=((), "float32"),
                     next_obs=(tuple(shape), "uint8"), done=((), "bool"), truncated=((), "bool"),
                     tag=((3,), "int64"))


def frame_of(lane: int, ep: int, t: int, frame: tuple[int, ...]) -> np.ndarray:
    """A frame that names its lane, episode and step in every byte pattern."""
    base = (lane * 101 + ep * 37 + t * 11) % 251
    return ((np.arange(int(np.prod(frame))) + base) % 256).astype(np.uint8).reshape(frame)


def episode(lane: int, ep: int, length: int, end: str, frame: tuple[int, ...], k: int, axis: int,
            pad: str) -> list[dict[str, Any]]:
    """One env's transitions as Gymnasium's FrameStackObservation (``pad="reset"``) or SB3's
    VecFrameStack (``pad="zero"``) hands them over; the last one ends by ``end``."""
    frames = [frame_of(lane, ep, t, frame) for t in range(length + 1)]
    first = frames[0] if pad == "reset" else np.zeros_like(frames[0])
    history = [first] * (k - 1) + [frames[0]]
    out = []
    for t in range(length):
        obs = np.concatenate(history[-k:], axis=axis)
        history.append(frames[t + 1])
        nxt = np.concatenate(history[-k:], axis=axis)
        last = t == length - 1
        out.append(dict(obs=obs, action=t, reward=float(t + 1), next_obs=nxt,
                        done=last and end == "terminated", truncated=last and end == "truncated",
                        tag=np.array([lane, ep, t])))
    return out


def stepper(rng: np.random.Generator, lanes: int, frame: tuple[int, ...], k: int, axis: int, pad: str):
    """Per lane, an endless stream of transitions of random episodes."""
    def lane_stream(lane: int):
        ep = 0
        while True:
            length = int(rng.integers(1, 9))
            end = str(rng.choice(["terminated", "truncated"]))
            yield from episode(lane, ep, length, end, frame, k, axis, pad)
            ep += 1
    return [lane_stream(lane) for lane in range(lanes)]


def same(a: sb.Batch, b: sb.Batch, names: tuple[str, ...]) -> bool:
    return all(np.array_equal(a[n], b[n]) and a[n].dtype == b[n].dtype for n in names)


CASES = [  # frame, k, axis, pad, next_of, stack, lanes
    ((1, 12, 12), 4, 0, "reset", "obs", "obs", 1),
    ((1, 40, 40), 4, 0, "zero", "obs", "obs", 3),      # a frame with a column of its own
    ((12, 12, 1), 4, 2, "zero", "obs", {"obs": (4, -1)}, 2),  # SB3's channels-last stacks
    ((2, 10, 10), 3, 0, "reset", "obs", {"obs": 3}, 2),  # frames of 2 channels
    ((1, 40, 40), 4, 0, "reset", None, "obs", 2),       # stacks only: next_obs stored whole
    ((1, 40, 40), 2, 0, "reset", "obs", None, 2),       # next only: obs stored whole
]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("seed", [0, 1])
def test_rebuilt_transitions_are_bit_identical(case: int, seed: int, make: Make, name: str) -> None:
    frame, k, axis, pad, next_of, stack, lanes = CASES[case]
    sch = schema(frame, k, axis)
    rng = np.random.default_rng(seed)
    full = make(sch, 240 * lanes, lanes=lanes, name=name + "f")
    comp = make(sch, 40 * lanes, lanes=lanes, next_of=next_of, stack=stack, name=name + "c", seed=seed)
    streams = stepper(rng, lanes, frame, k, axis, pad)
    to_full: dict[int, int] = {}
    waiting: dict[int, bool] = {}  # per lane: its newest transition waits for the next row
    for _ in range(60):  # wraps the compressed buffer's lanes several times
        lane = int(rng.integers(lanes))
        chunk = [next(streams[lane]) for _ in range(int(rng.integers(1, 5)))]
        rows = {n: np.stack([np.asarray(r[n]) for r in chunk]) for n in sch.names}
        a = full.push(rows, lane=lane)
        b = comp.push(rows, lane=lane)
        assert b.shape == a.shape
        to_full.update(zip(b.tolist(), a.tolist(), strict=True))
        waiting[lane] = next_of is not None and not (chunk[-1]["done"] or chunk[-1]["truncated"])
        # every transition still readable is the reference's; the recent ones are readable
        readable = 0
        held = [i for i in to_full if comp.ring.current(np.array([i]))[0]]
        for i in held:
            try:
                got = comp.take([i])
            except sb.EmptyBufferError:
                continue
            readable += 1
            assert same(got, full.take([to_full[i]]), sch.names), i
        assert readable >= len(held) - lanes * (k + 1)
    held = [i for i in to_full if comp.ring.current(np.array([i]))[0]]
    # len counts the transitions a reader can read: not a lane's waiting row, nor a row whose
    # stack reaches rows lapped
    assert len(comp) == readable <= len(held) - sum(waiting.values())
    batch = comp.sample(128)
    ref = full.take([to_full[i] for i in batch.index.tolist()])
    assert same(batch, ref, sch.names)


def test_prioritized_never_draws_an_end_row_and_updates(make: Make, name: str) -> None:
    sch = schema((1, 40, 40), 4, 0)
    full = make(sch, 400, name=name + "f")
    comp = make(sch, 400, next_of="obs", stack="obs", sampler=sb.Prioritized(), name=name + "c", seed=3)
    to_full = {}
    for ep in range(30):
        for row in episode(0, ep, 3, "terminated" if ep % 2 else "truncated", (1, 40, 40), 4, 0, "reset"):
            to_full[int(comp.push(**row)[0])] = int(full.push(**row)[0])
    for _ in range(20):
        batch = comp.sample(64)
        assert set(batch.index.tolist()) <= set(to_full)
        assert same(batch, full.take([to_full[i] for i in batch.index.tolist()]), sch.names)
        assert np.all(batch.weight > 0)
        comp.update_priorities(batch.index, np.full(64, 2.0))


def test_n_step_over_rebuilt_rows(make: Make, name: str) -> None:
    """n-step returns read the next observation after the last step used from the lane."""
    sch = schema((1, 40, 40), 4, 0)
    comp = make(sch, 200, lanes=2, episodes=True, next_of="obs", stack="obs", name=name, seed=1)
    rows: dict[int, dict[str, Any]] = {}
    order: dict[int, list[int]] = {0: [], 1: []}
    for ep in range(12):
        lane = ep % 2
        for row in episode(lane, ep, 5, "terminated" if ep % 3 else "truncated", (1, 40, 40), 4, 0, "reset"):
            i = int(comp.push(**row, lane=lane, episode=ep)[0])
            rows[i] = row
            order[lane].append(i)
    batch = comp.sample(128, n_step=3, gamma=0.5)
    for j, i in enumerate(batch.index.tolist()):
        lane = i % 2
        at = order[lane].index(i)
        ep = rows[i]["tag"][1]
        used = [rows[i]]
        for nxt in order[lane][at + 1:at + 3]:
            if used[-1]["done"] or used[-1]["truncated"] or rows[nxt]["tag"][1] != ep:
                break
            used.append(rows[nxt])
        assert batch.steps[j] == len(used)
        assert np.isclose(batch.reward[j], sum(0.5 ** s * r["reward"] for s, r in enumerate(used)))
        assert np.array_equal(batch.next_obs[j], used[-1]["next_obs"])
        assert np.array_equal(batch.obs[j], rows[i]["obs"])


def test_memory_is_one_frame_a_transition(make: Make, name: str) -> None:
    sch = sb.Schema(obs=((4, 84, 84), "uint8"), action=((), "int64"), reward=((), "float32"),
                    next_obs=((4, 84, 84), "uint8"), done=((), "bool"))
    full = make(sch, 1000, name=name + "f")
    comp = make(sch, 1000, next_of="obs", stack="obs", name=name + "c")
    size = {b: os.path.getsize(f"/dev/shm/shmbuffer-{b.name}") for b in (full, comp)}
    per = (size[comp] - 1000 * 8 - 1000 * 2) / 1000  # less the stamps and owners
    assert per <= 1.15 * (84 * 84 + 16)
    assert size[full] / size[comp] > 7


def test_bad_pushes_are_refused_and_leave_the_buffer_as_it_was(make: Make, name: str) -> None:
    sch = schema((1, 12, 12), 4, 0)
    buf = make(sch, 64, next_of="obs", stack="obs", name=name)
    rows = episode(0, 0, 4, "terminated", (1, 12, 12), 4, 0, "reset")
    buf.push(**rows[0])
    before = (len(buf), buf.stats["inserted"])
    with pytest.raises(FieldError, match=r"'obs'.*does not continue"):
        buf.push(**rows[2])  # a step skipped
    bad = dict(rows[0], obs=rows[0]["obs"].copy())
    bad["obs"][0] = 7
    with pytest.raises(FieldError, match="starts an episode"):
        sb.ReplayBuffer.attach(buf.handle).push(**bad)  # another process's first row: not padding
    assert (len(buf), buf.stats["inserted"]) == before
    buf.push(**rows[1])
    with pytest.raises(FieldError, match="stored once"):
        buf.update([0], obs=rows[0]["obs"])
    with pytest.raises(FieldError, match="view"):
        buf.view(0, 1)
    with pytest.raises(SchemaError, match="marks an episode's last step"):
        make(sb.Schema(obs=((2, 4), "uint8"), next_obs=((2, 4), "uint8")), 8, next_of="obs", name=name + "x")
    with pytest.raises(SchemaError, match="divide"):
        make(sch, 8, stack={"obs": 3}, name=name + "y")


def test_a_pending_row_is_not_drawn(make: Make, name: str) -> None:
    """The newest row of a lane has no next observation yet: it is never sampled."""
    sch = schema((1, 12, 12), 4, 0)
    buf = make(sch, 64, next_of="obs", stack="obs", name=name, seed=0)
    rows = episode(0, 0, 6, "terminated", (1, 12, 12), 4, 0, "reset")
    ids = [int(buf.push(**r)[0]) for r in rows[:3]]
    drawn = set(buf.sample(200).index.tolist())
    assert drawn == set(ids[:2])


# -- writers in other processes, killed mid-run ------------------------------------------------------
FRAME = (1, 40, 40)


def _writer(handle: sb.BufferHandle, lane: int, first_ep: int, seconds: float) -> None:
    buf = sb.ReplayBuffer.attach(handle)
    rng = np.random.default_rng(lane * 1000 + first_ep)
    ep, stop = first_ep, time.monotonic() + seconds
    while time.monotonic() < stop:
        rows = episode(lane, ep, int(rng.integers(1, 12)), str(rng.choice(["terminated", "truncated"])),
                       FRAME, 4, 0, "reset")
        for at in range(0, len(rows), 3):
            chunk = rows[at:at + 3]
            buf.push({n: np.stack([np.asarray(r[n]) for r in chunk]) for n in chunk[0]}, lane=lane)
        ep += 1
    buf.close()


def _expected(lane: int, ep: int, t: int, k: int = 4) -> tuple[np.ndarray, np.ndarray]:
    frames = [frame_of(lane, ep, max(u, 0), FRAME) for u in range(t - k + 1, t + 2)]
    return np.concatenate(frames[:k]), np.concatenate(frames[1:])


@pytest.mark.slow
def test_writers_killed_mid_run_and_clears_never_yield_mixed_transitions(make: Make, name: str, procs: list) -> None:
    buf = make(schema(FRAME, 4, 0), 2 * 48, lanes=2, next_of="obs", stack="obs",
               sampler=sb.Prioritized(), name=name, seed=5)
    ctx = mp.get_context("spawn")
    writers = {}
    for lane in (0, 1):
        p = ctx.Process(target=_writer, args=(buf.handle, lane, 0, 4.0))
        p.start()
        procs.append(p)
        writers[lane] = p
    deadline = time.monotonic() + 60
    while len(buf) < 40 and time.monotonic() < deadline:
        time.sleep(0.01)
    checked = kills = clears = 0
    start = time.monotonic()
    while any(p.is_alive() for p in procs) or time.monotonic() - start < 2:
        if clears < 2 and time.monotonic() - start > 1.0 + clears:
            buf.clear()  # writers mid-episode go on; stacks reaching before the clear are not read
            clears += 1
        if kills < 3 and time.monotonic() - start > 0.6 * (kills + 1):
            lane = kills % 2  # its writer dies (mid-push, often); a new one takes the lane
            writers[lane].kill()
            writers[lane].join(5)
            p = ctx.Process(target=_writer, args=(buf.handle, lane, 10_000 * (kills + 1), 2.0))
            p.start()
            procs.append(p)
            writers[lane] = p
            kills += 1
        try:
            batch = buf.sample(32)
        except (sb.WaitTimeout, sb.EmptyBufferError):
            continue
        for j in range(32):
            lane, ep, t = batch.tag[j].tolist()
            obs, nxt = _expected(lane, ep, t)
            assert np.array_equal(batch.obs[j], obs), (lane, ep, t)
            assert np.array_equal(batch.next_obs[j], nxt), (lane, ep, t)
            assert batch.action[j] == t and batch.reward[j] == t + 1
        checked += 32
    for p in writers.values():  # the writers alive at the end finished without an error
        p.join(30)
        assert p.exitcode == 0
    assert kills == 3 and clears == 2 and checked > 500


def test_it_composes_with_the_rest(make: Make, name: str, tmp_path: Any) -> None:
    """Loader (pinned staging), sequences with burn-in, whole episodes, mixing, epochs, export,
    save/load (format 2) and inspect all see the same transitions as the reference buffer."""
    import json
    import subprocess
    import sys

    sch = schema((1, 40, 40), 4, 0)
    full = make(sch, 400, lanes=2, episodes=True, name=name + "f")
    comp = make(sch, 400, lanes=2, episodes=True, next_of="obs", stack="obs", name=name + "c", seed=0)
    m = {}
    for ep in range(20):
        for row in episode(ep % 2, ep, 7, "terminated" if ep % 3 else "truncated", (1, 40, 40), 4, 0, "reset"):
            a = full.push(**row, lane=ep % 2, episode=ep)
            m[int(comp.push(**row, lane=ep % 2, episode=ep)[0])] = int(a[0])

    def ref(ids: Any) -> sb.Batch:
        return full.take([m[int(i)] for i in np.asarray(ids).reshape(-1)])

    loader = comp.loader(64, device="cpu", prefetch=2)
    try:
        got = next(iter(loader))
        want = ref(got.index.numpy() if hasattr(got.index, "numpy") else got.index)
        assert all(np.array_equal(np.asarray(got[n]), want[n]) for n in sch.names)
    finally:
        loader.close()
    seq = comp.sample_sequences(8, 5, burn_in=2)
    for j, t in zip(*np.nonzero(seq.mask), strict=True):
        r = ref([seq.index[j, t]])
        assert np.array_equal(seq.obs[j, t], r.obs[0]) and np.array_equal(seq.next_obs[j, t], r.next_obs[0])
    for replace in (False, True):
        for b in comp.sample_episodes(3, replace=replace):
            assert len(b) == 7 and same(b, ref(b.index), sch.names) and (b.done[-1] or b.truncated[-1])
    mixed = sb.Mix([(comp, 0.5), (full, 0.5)]).sample(32)
    assert mixed.obs.shape == (32, 4, 40, 40) and mixed.next_obs.shape == (32, 4, 40, 40)
    assert sum(len(b) for b in comp.epoch(50, shuffle=False)) == len(comp) == 140  # every episode ended
    exported = comp.export()
    assert same(exported, ref(exported["index"]), sch.names) and exported["index"].size == 140
    comp.save(tmp_path / "s")
    assert json.loads((tmp_path / "s" / "meta.json").read_text())["format_version"] == 2
    loaded = sb.ReplayBuffer.load(tmp_path / "s", name=name + "l")
    try:
        assert loaded.options.rows == comp.options.rows
        assert same(loaded.take(exported["index"]), ref(exported["index"]), sch.names)
        row = episode(0, 99, 1, "terminated", (1, 40, 40), 4, 0, "reset")[0]
        loaded.push(**row, lane=0, episode=99)  # goes on taking episodes
    finally:
        loaded.close()
        loaded.unlink()
    out = subprocess.run([sys.executable, "-m", "shmbuffer.cli", "inspect", comp.name, "--json"],
                         capture_output=True, text=True, check=True).stdout
    info = json.loads(out)
    assert info["bytes_per_row_without_frames"] / info["bytes_per_row"] > 4


def test_get_and_take_say_why_a_row_is_not_a_transition(make: Make, name: str) -> None:
    sch = schema((1, 12, 12), 4, 0)
    buf = make(sch, 64, next_of="obs", stack="obs", name=name)
    rows = episode(0, 0, 3, "terminated", (1, 12, 12), 4, 0, "reset")
    ids = [int(buf.push(**r)[0]) for r in rows[:2]]
    with pytest.raises(sb.EmptyBufferError, match="waits for the next row"):
        buf.take([ids[1]])  # the newest row: no next observation yet
    assert len(buf) == 1 and np.array_equal(buf.get(0).obs, rows[0]["obs"])
    assert np.array_equal(buf.get(-1).obs, rows[0]["obs"])  # get counts transitions, as len does
    with pytest.raises(sb.EmptyBufferError, match=r"get\(1\): index out of range for 1 row$"):
        buf.get(1)


@pytest.mark.slow
def test_a_collector_feeds_a_next_of_buffer(make: Make, name: str) -> None:
    """Collector processes (one lane per env) into ``next_of``: every sampled next observation is
    the env's (CountingEnv's obs name its env, episode and step), final ones included."""
    from shmbuffer.collector import Collector

    from .envs import CountingEnv

    sch = sb.Schema(obs=((3,), "float32"), action=((), "int64"), reward=((), "float32"),
                    next_obs=((3,), "float32"), done=((), "bool"), truncated=((), "bool"))
    with pytest.raises(ValueError, match="one lane per env"):
        Collector(CountingEnv, make(sch, 64, next_of="obs", name=name + "x"), workers=2)
    buf = make(sch, 4 * 5000, envs=4, next_of="obs", name=name, seed=2)  # no lapping: len is exact below
    with Collector(CountingEnv, buf, workers=2, envs_per_worker=2, seed=1) as col:
        col.warm(300)
        col.stop()
    batch = buf.sample(512)
    assert np.array_equal(batch.next_obs[:, :2], batch.obs[:, :2])  # same env, same episode
    assert np.array_equal(batch.next_obs[:, 2], batch.obs[:, 2] + 1)  # the next step
    assert np.array_equal(batch.reward, batch.next_obs[:, 2])
    assert (batch.done | batch.truncated).any()
    exported = buf.export()  # the transitions that can be read: each lane's newest waits for its next
    assert len(buf) == exported["index"].size
    # inserted counts transitions, not end rows; len leaves out each lane's newest row until its next comes
    assert 0 <= buf.stats["inserted"] - len(buf) <= 4


# -- regressions from the review of the first version ----------------------------------------------
def _push_all(buf: sb.ReplayBuffer, rows: list[dict[str, Any]], **kw: Any) -> list[int]:
    return [int(buf.push(**r, **kw)[0]) for r in rows]


def test_a_clear_mid_episode_keeps_the_writer_going(make: Make, name: str) -> None:
    """A writer that goes on with its episode after ``clear()`` starts its lane again: the older
    frames of its first stack go into lead rows, so every row it pushes is a whole transition,
    readable, sampled and counted alike (they were counted but their stacks reached into
    the cleared rows, and ``sample`` timed out)."""
    sch = schema((1, 4, 4), 4, 0)
    buf = make(sch, 16, next_of="obs", stack="obs", name=name)
    rows = episode(0, 0, 12, "terminated", (1, 4, 4), 4, 0, "reset")
    _push_all(buf, rows[:3])
    buf.clear()
    ids = _push_all(buf, rows[3:])
    for i, row in zip(ids, rows[3:], strict=True):
        got = buf.take([i])
        assert np.array_equal(got.obs[0], row["obs"]) and np.array_equal(got.next_obs[0], row["next_obs"])
    assert len(buf) == 9 and buf.export()["index"].size == 9
    got = buf.get(slice(0, len(buf)))
    assert np.array_equal(got.index, ids) and np.array_equal(got.obs, np.stack([r["obs"] for r in rows[3:]]))
    assert set(buf.sample(64, timeout=1.0).index.tolist()) <= set(ids)


def test_arrays_the_caller_reuses_are_checked_as_pushed(make: Make, name: str) -> None:
    sch = sb.Schema(obs=((3,), "float32"), next_obs=((3,), "float32"), done=((), "bool"))
    buf = make(sch, 16, next_of="obs", name=name)
    a = np.ones(3, np.float32)
    buf.push(obs=np.zeros(3, np.float32), next_obs=a, done=False)
    a[...] = 9  # the env reuses its array
    with pytest.raises(FieldError, match="does not continue"):
        buf.push(obs=a, next_obs=np.full(3, 2, np.float32), done=False)
    buf.push(obs=np.ones(3, np.float32), next_obs=np.full(3, 2, np.float32), done=True)
    assert np.array_equal(buf.take([0]).next_obs[0], np.ones(3))


def test_every_next_stack_must_continue_its_stack(make: Make, name: str) -> None:
    sch = schema((1, 4, 4), 4, 0)
    buf = make(sch, 16, next_of="obs", stack="obs", name=name)
    row = dict(episode(0, 0, 3, "terminated", (1, 4, 4), 4, 0, "reset")[0])
    row["next_obs"] = row["next_obs"].copy()
    row["next_obs"][0] += 1
    with pytest.raises(FieldError, match=r"'next_obs'.*older frames"):
        buf.push(**row)
    assert len(buf) == 0 and buf.stats["inserted"] == 0


def test_an_update_between_the_reads_of_a_transition_is_not_torn(make: Make, name: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from shmbuffer.protocol import gather

    sch = sb.Schema(obs=((2,), "float32"), next_obs=((2,), "float32"), goal=((600,), "float32"),
                    reward=((), "float32"), done=((), "bool"))
    buf = make(sch, 16, next_of="obs", name=name)
    for t in range(3):
        buf.push(obs=np.full(2, t, np.float32), next_obs=np.full(2, t + 1, np.float32), goal=np.zeros(600, np.float32),
                 reward=0.0, done=t == 2)
    real, calls = gather._gather, []

    def between(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 2:  # after the window's read, before the large fields'
            buf.update([1], goal=np.ones(600, np.float32), reward=1.0)
        return real(*args, **kwargs)

    monkeypatch.setattr(gather, "_gather", between)
    got = buf.take([1])
    assert (got.reward[0] == 1.0) == bool(got.goal[0].all()) and (got.reward[0] == 0.0) == (not got.goal[0].any())


def test_limiter_and_stats_count_transitions(make: Make, name: str) -> None:
    sch = sb.Schema(obs=((2,), "float32"), next_obs=((2,), "float32"), done=((), "bool"))
    buf = make(sch, 64, next_of="obs", name=name)
    for t in range(4):  # four 1-step episodes: four end rows
        buf.push(obs=np.full(2, 10 * t, np.float32), next_obs=np.full(2, 10 * t + 1, np.float32), done=True)
    assert buf.stats["inserted"] == len(buf) == 4
    with pytest.raises(FieldError, match="delete"):
        buf.delete([0])
    for _ in range(50):  # half the rows are end rows: drawn, refused, re-drawn, never served
        assert set(buf.sample(64).index.tolist()) <= {0, 2, 4, 6}


def test_nothing_to_sample_is_said_at_once(make: Make, name: str) -> None:
    sch = sb.Schema(obs=((2,), "float32"), next_obs=((2,), "float32"), done=((), "bool"))
    buf = make(sch, 64, envs=4, next_of="obs", name=name)
    buf.push(obs=np.zeros((4, 2), np.float32), next_obs=np.ones((4, 2), np.float32), done=np.zeros(4, bool))
    assert len(buf) == 0
    with pytest.raises(sb.EmptyBufferError, match="0 whole transitions"):
        buf.sample(2)
    buf.push(obs=np.ones((4, 2), np.float32), next_obs=np.ones((4, 2), np.float32), done=np.zeros(4, bool))
    assert len(buf) == 4
    with pytest.raises(sb.EmptyBufferError, match="holds 4 whole"):
        buf.sample(5, replace=False)
    assert sorted(buf.sample(4, replace=False).index.tolist()) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="lanes of 4 rows or more"):
        make(sch, 2, next_of="obs", name=name + "x")


def test_zero_padding_with_a_field_whose_first_frame_is_zeros(make: Make, name: str) -> None:
    sch = sb.Schema(a=((2, 3), "float32"), b=((2, 3), "float32"), done=((), "bool"))
    buf = make(sch, 16, stack={"a": 2, "b": 2}, name=name)
    a = np.zeros((2, 3), np.float32)
    a[1] = 5  # zero padding, first frame 5s
    buf.push(a=a, b=np.zeros((2, 3), np.float32), done=False)  # b's first frame is zeros: either padding
    got = buf.take([0])
    assert np.array_equal(got.a[0], a) and not got.b[0].any()


def test_groups_of_an_episode_cut_by_lapping(make: Make, name: str) -> None:
    sch = schema((1, 4, 4), 4, 0)
    full = make(sch, 64, episodes=True, name=name + "f")
    comp = make(sch, 24, episodes=True, next_of="obs", stack="obs", name=name + "c", seed=0)
    m = {}
    for row in episode(0, 0, 40, "truncated", (1, 4, 4), 4, 0, "reset"):  # one long episode wraps the lane
        m[int(comp.push(**row, episode=0)[0])] = int(full.push(**row, episode=0)[0])
    batch = comp.sample_groups(2, 6, short=True)
    for i in batch.index[batch.mask]:
        assert same(comp.take([i]), full.take([m[int(i)]]), sch.names)


@pytest.mark.parametrize("next_of", ["obs", None])
def test_rows_of_one_push_must_continue_each_other(next_of: str | None, make: Make, name: str) -> None:
    sch = schema((1, 4, 4), 4, 0)
    buf = make(sch, 32, lanes=2, next_of=next_of, stack="obs", name=name)
    rows = episode(0, 0, 6, "terminated", (1, 4, 4), 4, 0, "reset")
    other = episode(1, 0, 6, "terminated", (1, 4, 4), 4, 0, "reset")
    ok = [rows[0], other[0], rows[1], other[1]]  # two envs, env-major steps
    buf.push({n: np.stack([np.asarray(r[n]) for r in ok]) for n in sch.names}, lane=np.array([0, 1, 0, 1]))
    bad = [rows[2], other[2], rows[4], other[3]]  # lane 0 skips a step inside the push
    with pytest.raises(FieldError, match=r"row 2"):
        buf.push({n: np.stack([np.asarray(r[n]) for r in bad]) for n in sch.names}, lane=np.array([0, 1, 0, 1]))
    assert buf.stats["inserted"] == 4


def test_draws_are_uniform_over_transitions(make: Make, name: str) -> None:
    """Rows that are not transitions (episodes' end rows) drawn with the others are replaced by
    spare draws: every transition is still drawn equally often."""
    sch = sb.Schema(obs=((2,), "float32"), next_obs=((2,), "float32"), done=((), "bool"))
    buf = make(sch, 256, next_of="obs", name=name, seed=11)
    for t in range(200):  # episodes of 100 steps: one row in 101 is an end row (a few a sample)
        buf.push(obs=np.full(2, t, np.float32), next_obs=np.full(2, t + 1, np.float32), done=t % 100 == 99)
    counts = np.zeros(200)
    for _ in range(400):
        batch = buf.sample(256)
        assert np.array_equal(batch.next_obs, batch.obs + 1)
        assert np.array_equal(buf.take(batch.index).obs, batch.obs)  # ids and rows moved together
        counts += np.bincount(batch.obs[:, 0].astype(int), minlength=200)
    expected = 400 * 256 / 200
    assert np.abs(counts - expected).max() < 6 * np.sqrt(expected)  # about 5 standard deviations


# -- episodes resumed: lead rows ------------------------------------------------------------------------
@pytest.mark.parametrize("frame", [(1, 12, 12), (1, 40, 40)], ids=["packed", "column"])
@pytest.mark.parametrize("seed", range(3))
def test_an_export_of_a_lapped_buffer_loads_into_one_that_stores_frames_once(frame: tuple[int, ...], seed: int,
                                                                             make: Make, name: str) -> None:
    """The oldest episodes of a full buffer lost their first steps to lapping: their first
    readable stacks hold real older frames, not padding. Their export loads into a next_of/stack
    buffer (``from_arrays``, ``import_rows``): those frames go into lead rows, every transition reads
    back bit for bit, none is lost, and no lead row is drawn or counted."""
    k, lanes = 4, 2
    sch = schema(frame, k, 0)
    rng = np.random.default_rng(seed)
    src = make(sch, 16 * lanes, lanes=lanes, episodes=True, next_of="obs", stack="obs", name=name + "s")
    eps = 0
    # per lane 12 steps, then 6 more: 20 rows with the end rows, in lanes of 16, so the first
    # episode loses its first 4 rows to lapping and its steps from the 8th on stay readable
    for i, length in enumerate([12, 12, 6 + int(rng.integers(0, 2)), 6]):
        lane = i % lanes
        rows = episode(lane, eps, length, str(rng.choice(["terminated", "truncated"])), frame, k, 0,
                       str(rng.choice(["reset", "zero"])))
        src.push({n: np.stack([np.asarray(r[n]) for r in rows]) for n in sch.names}, lane=lane, episode=eps)
        eps += 1
    out = src.export()
    assert out["index"].size
    # each lane's first exported transition resumes a cut episode: a plain push refuses it
    lane_of = out["index"] % lanes
    firsts = [int(np.flatnonzero(lane_of == ln)[0]) for ln in range(lanes) if (lane_of == ln).any()]
    probe = make(sch, 20 * len(firsts), lanes=len(firsts), next_of="obs", stack="obs", name=name + "p")
    refused = 0
    for ln, i in enumerate(firsts):
        try:
            probe.push({n: out[n][i:i + 1] for n in sch.names}, lane=ln)
        except FieldError as e:
            assert "starts an episode" in str(e)
            refused += 1
    assert refused == lanes, "a lane's export begins with no cut episode: nothing there needs lead rows"
    for target in ("from_arrays", "import_rows"):
        if target == "from_arrays":
            new = sb.ReplayBuffer.from_arrays(sch, out, name=name + "f", next_of="obs", stack="obs", episodes=True)
        else:
            new = make(sch, 200, episodes=True, next_of="obs", stack="obs", name=name + "i")
            persistence.import_rows(new, out)  # DI-engine's import_data (compat.ding)
        try:
            back = new.export()
            assert len(new) == out["index"].size
            for n in sch.names:
                assert np.array_equal(back[n], out[n]), n
            drawn = new.sample(300)
            tags = {tuple(t) for t in out["tag"].tolist()}
            assert {tuple(t) for t in drawn.tag.tolist()} <= tags  # transitions only, never a lead row
            whole = {tuple(t): i for i, t in enumerate(out["tag"].tolist())}
            for j, t in enumerate(drawn.tag.tolist()):
                i = whole[tuple(t)]
                assert np.array_equal(drawn.obs[j], out["obs"][i]) and np.array_equal(drawn.next_obs[j], out["next_obs"][i])
            runs = new.sample_sequences(16, 3)  # windows of steps: never a lead row among them
            assert {tuple(t) for t in runs.tag[runs.mask].tolist()} <= tags
        finally:
            if target == "from_arrays":
                new.close()
                new.unlink()


def test_a_resumed_episode_never_lends_its_frames_to_the_row_before(make: Make, name: str) -> None:
    """``push(resume=True)`` of a row whose stack holds real older frames: they are read back as
    pushed, and a transition left open before it in the lane (its next row never came) is not
    completed with a lead row's frame: it is never drawn."""
    frame, k = (1, 12, 12), 4
    sch = schema(frame, k, 0)
    buf = make(sch, 64, episodes=True, next_of="obs", stack="obs", name=name, seed=0)
    open_ = episode(0, 0, 6, "terminated", frame, k, 0, "reset")[:3]  # three steps, then the env went away
    buf.push({n: np.stack([np.asarray(r[n]) for r in open_]) for n in sch.names}, episode=0)
    later = episode(0, 1, 9, "truncated", frame, k, 0, "zero")[5:]  # an episode resumed at its 6th step
    rows = {n: np.stack([np.asarray(r[n]) for r in later]) for n in sch.names}
    with pytest.raises(FieldError, match="starts an episode"):
        buf.push(rows, episode=1)
    ids = buf.push(rows, episode=1, resume=True)
    assert ids.size == len(later)
    got = buf.take(ids)
    assert np.array_equal(got.obs, rows["obs"]) and np.array_equal(got.next_obs, rows["next_obs"])
    drawn = {tuple(t) for t in buf.sample(400).tag.tolist()}
    assert drawn == {tuple(r["tag"]) for r in open_[:2] + later}  # not the open step, no lead row


def _push_fresh_episode(buf: sb.ReplayBuffer, frame: tuple[int, ...]) -> None:
    """In a forked child: a new episode's first steps into lane 0, where the parent left one open."""
    rows = episode(0, 7, 3, "terminated", frame, 4, 0, "reset")
    buf.push({n: np.stack([np.asarray(r[n]) for r in rows]) for n in buf.schema.names})
    os._exit(0)


def test_a_forked_child_starts_its_own_rows(make: Make, name: str, procs: list) -> None:
    """A forked child inherits the parent's pusher but not its rows: the parent's open episode
    in a lane is not the child's to continue, so the child's new episode there is a start (not
    refused as a step that fails to follow the parent's)."""
    frame = (1, 12, 12)
    sch = schema(frame, 4, 0)
    buf = make(sch, 64, next_of="obs", stack="obs", name=name)
    open_ = episode(0, 0, 6, "terminated", frame, 4, 0, "reset")[:2]
    buf.push({n: np.stack([np.asarray(r[n]) for r in open_]) for n in sch.names})
    p = mp.get_context("fork").Process(target=_push_fresh_episode, args=(buf, frame))
    p.start()
    procs.append(p)
    p.join(60)
    assert p.exitcode == 0
    assert {tuple(t) for t in buf.sample(200).tag.tolist()} == {(0, 0, 0), (0, 7, 0), (0, 7, 1), (0, 7, 2)}


def test_a_clear_between_the_checks_and_the_reservation_is_checked_again(make: Make, name: str) -> None:
    """A clear() that comes after the pusher decided a row continues its lane (no lead rows) but
    before the reservation: stored so, the row would reach into the cleared rows. The reservation is undone and the push checked again: it starts the lane anew."""
    from shmbuffer.protocol.ring import Ring

    sch = schema((1, 4, 4), 4, 0)
    buf = make(sch, 16, next_of="obs", stack="obs", name=name)
    rows = episode(0, 0, 12, "terminated", (1, 4, 4), 4, 0, "reset")
    _push_all(buf, rows[:3])
    real = Ring.reserve

    def reserve(self: Ring, *args: Any, **kwargs: Any) -> Any:
        Ring.reserve = real  # type: ignore[method-assign]
        buf.clear()  # another process's, right after the checks
        return real(self, *args, **kwargs)

    Ring.reserve = reserve  # type: ignore[method-assign]
    try:
        ids = _push_all(buf, rows[3:4])
    finally:
        Ring.reserve = real  # type: ignore[method-assign]
    assert Ring.reserve is real  # the clear came
    ids += _push_all(buf, rows[4:])
    assert len(buf) == 9 and np.array_equal(buf.get(slice(None)).index, ids)
    for i, row in zip(ids, rows[3:], strict=True):
        got = buf.take([i])
        assert np.array_equal(got.obs[0], row["obs"]) and np.array_equal(got.next_obs[0], row["next_obs"])


def test_a_push_clears_overtake_again_and_again_is_refused_with_nothing_stored(
    make: Make, name: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Checked again up to three times; then refused, each reservation undone."""
    from shmbuffer.protocol.frames_push import Pusher

    sch = schema((1, 4, 4), 4, 0)
    buf = make(sch, 16, next_of="obs", stack="obs", name=name)
    rows = episode(0, 0, 12, "terminated", (1, 4, 4), 4, 0, "reset")
    _push_all(buf, rows[:3])
    before = {k: v.copy() for k, v in buf.block.arrays.items() if k not in ("_mutex", "_owner", "_stats", "_edits")}
    calls: list[int] = []

    def overtaken(self: Pusher, *args: Any) -> tuple[str, bool]:
        calls.append(1)
        return "lane 0 was cleared (clear()) each time this push was being checked", True

    monkeypatch.setattr(Pusher, "confirm", overtaken)
    with pytest.raises(sb.FieldError, match=r"each time this push was being checked"):
        buf.push(**rows[3])
    assert len(calls) == 3 and len(buf) == 2
    assert all(np.array_equal(buf.block.arrays[k], v) for k, v in before.items())
    edits = int(buf.block.counters[Counter.EDITS])  # each put-back logged, before and after its stamps
    assert edits == 6 and buf.block.arrays["_edits"][:edits].tolist() == [3] * 6


def test_stacks_without_next_of_count_as_get_indexes(make: Make, name: str) -> None:
    """``stack`` alone: lead rows (a lane started again after clear(), or resume) are not
    transitions; ``len`` left them in while ``get`` left them out."""
    sch = schema((1, 4, 4), 4, 0)
    buf = make(sch, 16, stack="obs", name=name)
    rows = episode(0, 0, 12, "terminated", (1, 4, 4), 4, 0, "reset")
    _push_all(buf, rows[:3])
    buf.clear()
    ids = _push_all(buf, rows[3:5])
    assert len(buf) == 2 and np.array_equal(buf.get(slice(None)).index, ids)
    assert np.array_equal(buf.get(-1).obs, rows[4]["obs"]) and np.array_equal(buf.get(len(buf) - 1).obs, rows[4]["obs"])


@pytest.mark.parametrize("case", range(len(CASES)))
def test_an_import_of_an_export_is_the_same_buffer(case: int, make: Make, name: str) -> None:
    """``from_arrays`` and ``import_rows`` of an export hold every exported transition, in order and
    samplable, however many round trips: each lane's last one keeps the next observation it was
    exported with (an end row after it, ``push(flush=)``), instead of waiting for a next row."""
    frame, k, axis, pad, next_of, stack, lanes = CASES[case]
    sch = schema(frame, k, axis)
    rng = np.random.default_rng(case)
    src = make(sch, 60 * lanes, lanes=lanes, next_of=next_of, stack=stack, name=name + "s")
    streams = stepper(rng, lanes, frame, k, axis, pad)
    for _ in range(12):
        lane = int(rng.integers(lanes))
        chunk = [next(streams[lane]) for _ in range(int(rng.integers(1, 5)))]
        src.push({n: np.stack([np.asarray(r[n]) for r in chunk]) for n in sch.names}, lane=lane)
    out = src.export()
    assert out["index"].size == len(src)
    tags = sorted(tuple(t) for t in out["tag"].tolist())
    opts = dict(lanes=lanes, next_of=next_of, stack=stack)
    current = out
    for trip in range(3):
        new = sb.ReplayBuffer.from_arrays(sch, current, name=f"{name}r{trip}", **opts)
        try:
            assert len(new) == len(src), trip
            back = new.export()
            for n in sch.names:
                assert np.array_equal(back[n], out[n]), (trip, n)
            drawn = new.sample(64 * len(tags))
            assert sorted({tuple(t) for t in drawn.tag.tolist()}) == tags, trip  # every one samplable
            current = back
        finally:
            new.close()
            new.unlink()
    into = make(sch, 60 * lanes, name=name + "i", **opts)
    persistence.import_rows(into, {**out, "lane": out["index"] % lanes})
    assert len(into) == len(src)
    assert sorted({tuple(t) for t in into.sample(64 * len(tags)).tag.tolist()}) == tags
    again = into.export()
    for n in sch.names:
        assert np.array_equal(again[n], out[n]), n


@pytest.mark.parametrize("case", range(len(CASES)))
def test_pending_is_each_lanes_waiting_step_as_pushed(case: int, make: Make, name: str) -> None:
    """``pending()``: each lane's newest step that waits for its next observation, as this process
    pushed it; with ``export`` it is every pushed transition. None in another process, in a lane
    whose newest step ended its episode, nor without ``next_of``."""
    frame, k, axis, pad, next_of, stack, lanes = CASES[case]
    sch = schema(frame, k, axis)
    buf = make(sch, 60 * lanes, lanes=lanes, next_of=next_of, stack=stack, name=name)
    pushed: list[dict[str, Any]] = []
    for lane in range(lanes):
        rows = episode(lane, 0, 6, "terminated", frame, k, axis, pad)
        rows = rows if lane == 0 else rows[:3]  # lane 0's episode ended; the others wait
        pushed += rows
        _push_all(buf, rows, lane=lane)
    waiting = buf.pending()
    if next_of is None:
        assert waiting["index"].size == 0 and set(waiting) == set(buf.export())
        return
    assert sorted(waiting) == sorted(buf.export()) and (waiting["index"] % lanes).tolist() == list(range(1, lanes))
    both = {n: np.concatenate([buf.export()[n], waiting[n]]) for n in waiting}
    assert sorted(map(tuple, both["tag"].tolist())) == sorted(tuple(r["tag"].tolist()) for r in pushed)
    for r in pushed:
        at = np.flatnonzero((both["tag"] == r["tag"]).all(axis=1))[0]
        assert all(np.array_equal(both[n][at], r[n]) for n in sch.names)
    other = sb.ReplayBuffer.attach(buf.handle)
    try:
        assert other.pending()["index"].size == 0
    finally:
        other.close()


def test_flush_makes_a_lanes_last_row_a_transition_at_once(make: Make, name: str) -> None:
    """``push(flush=True)`` stores the next observation of each lane's last row now: counted and
    drawn with its own next_obs and done; the lane's next row starts an episode. A bad ``flush``
    changes nothing."""
    frame, k = (1, 12, 12), 4
    sch = schema(frame, k, 0)
    buf = make(sch, 80, lanes=2, next_of="obs", stack="obs", name=name)
    rows = episode(0, 0, 5, "truncated", frame, k, 0, "reset")[:3]  # an episode cut before its end
    pushed = {n: np.stack([np.asarray(r[n]) for r in rows]) for n in sch.names}
    with pytest.raises(FieldError, match="flush"):
        buf.push(pushed, lane=0, flush=np.ones(2, bool))
    assert len(buf) == 0 and int(buf.ring.cursors[0, 0]) == 0
    buf.push(pushed, lane=0)
    assert len(buf) == 2  # the newest waits for its next observation
    buf.push({n: np.stack([np.asarray(r[n]) for r in episode(1, 0, 5, "truncated", frame, k, 0, "zero")[:3]])
              for n in sch.names}, lane=1, flush=True)
    assert len(buf) == 5
    got = buf.sample(400)
    newest = got.tag[:, 0] == 1
    assert {tuple(t) for t in got.tag[newest].tolist()} == {(1, 0, 0), (1, 0, 1), (1, 0, 2)}
    last = np.flatnonzero((got.tag == [1, 0, 2]).all(axis=1))[0]
    want = episode(1, 0, 5, "truncated", frame, k, 0, "zero")[2]
    assert np.array_equal(got.next_obs[last], want["next_obs"]) and not got.done[last] and not got.truncated[last]
    with pytest.raises(FieldError, match="starts an episode"):  # the next row of lane 1 starts one
        buf.push(episode(1, 0, 5, "truncated", frame, k, 0, "zero")[3], lane=1)


def _tagged(rows: dict[str, np.ndarray], names: tuple[str, ...]) -> dict[tuple[int, ...], list[np.ndarray]]:
    return {tuple(t): [rows[n][i] for n in names] for i, t in enumerate(rows["tag"].tolist())}


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("rows_a_lane", [60, 10])
def test_a_save_keeps_each_lanes_waiting_step(case: int, rows_a_lane: int, make: Make, name: str,
                                              tmp_path: Any) -> None:
    """A save by the process that pushed keeps each lane's newest step, which waits for its next
    observation, with that observation: loaded, the buffer holds every transition the original
    holds, bit for bit, a full lane's oldest too, and the loading process holds those steps, still
    waiting (``pending``); the original is left as it was. A save by another process keeps those
    rows as they are: waiting, with nothing to complete them."""
    frame, k, axis, pad, next_of, stack, lanes = CASES[case]
    sch = schema(frame, k, axis)
    rng = np.random.default_rng(case)
    src = make(sch, rows_a_lane * lanes, lanes=lanes, next_of=next_of, stack=stack, name=name + "s")
    streams = stepper(rng, lanes, frame, k, axis, pad)
    for _ in range(12):
        lane = int(rng.integers(lanes))
        chunk = [next(streams[lane]) for _ in range(int(rng.integers(1, 5)))]
        src.push({n: np.stack([np.asarray(r[n]) for r in chunk]) for n in sch.names}, lane=lane)
    before, exported, waiting = len(src), src.export(), src.pending()
    src.save(tmp_path / "s")
    assert len(src) == before and all(np.array_equal(src.export()[n], exported[n]) for n in exported)
    loaded = sb.ReplayBuffer.load(tmp_path / "s", name=name + "l")
    try:
        got = _tagged(loaded.export(), sch.names)
        pushed = {**_tagged(exported, sch.names), **_tagged(waiting, sch.names)}
        for tag, values in got.items():  # every loaded transition is one pushed, bit for bit
            assert all(np.array_equal(a, b) for a, b in zip(values, pushed[tag], strict=True)), tag
        # every one the original holds, lapped or not, and the waiting steps still waiting
        assert set(got) == set(_tagged(exported, sch.names)) and len(loaded) == before
        still = _tagged(loaded.pending(), sch.names)
        assert set(still) == set(_tagged(waiting, sch.names))
        for tag, values in still.items():
            assert all(np.array_equal(a, b) for a, b in zip(values, pushed[tag], strict=True)), tag
        drawn = loaded.sample(64 * len(got))
        assert {tuple(t) for t in drawn.tag.tolist()} == set(got)
    finally:
        loaded.close()
        loaded.unlink()
    other = sb.ReplayBuffer.attach(src.handle)
    try:
        other.save(tmp_path / "o")
    finally:
        other.close()
    again = sb.ReplayBuffer.load(tmp_path / "o", name=name + "o")
    try:
        assert len(again) == before
    finally:
        again.close()
        again.unlink()


@pytest.mark.parametrize("case", range(len(CASES)))
def test_a_save_of_full_lanes_loads_every_transition_and_continues_them(case: int, make: Make, name: str,
                                                                        tmp_path: Any) -> None:
    """Every lane filled past full by this process, its newest step's episode going on (with
    ``next_of``, waiting for its next observation): a load holds every transition the original
    holds, bit for bit (stacks and next observations rebuilt from the same rows), and the same
    waiting steps (``pending``); the loading process's next step into each lane continues the lane
    exactly as the original's does, completing the waiting step."""
    frame, k, axis, pad, next_of, stack, lanes = CASES[case]
    sch = schema(frame, k, axis)
    rng = np.random.default_rng(case)
    src = make(sch, 10 * lanes, lanes=lanes, next_of=next_of, stack=stack, name=name + "s")
    streams = stepper(rng, lanes, frame, k, axis, pad)
    for lane in range(lanes):
        pushed = 0
        while True:
            step = next(streams[lane])
            src.push(step, lane=lane)
            pushed += 1
            first, stop = src.ring.bounds()
            if pushed > 20 and stop[lane] - first[lane] == src.lane_capacity and not (step["done"] or step["truncated"]):
                break
    before, waiting = src.export(), src.pending()
    assert waiting["index"].size == (lanes if next_of else 0)
    src.save(tmp_path / "s")
    loaded = sb.ReplayBuffer.load(tmp_path / "s", name=name + "l")
    try:
        for mine, theirs in ((loaded.export(), before), (loaded.pending(), waiting)):
            assert mine["index"].tolist() == theirs["index"].tolist()
            got, want = _tagged(mine, sch.names), _tagged(theirs, sch.names)
            assert set(got) == set(want)
            for tag, values in got.items():
                assert all(np.array_equal(a, b) for a, b in zip(values, want[tag], strict=True)), tag
        for lane in range(lanes):  # the next step, into both
            step = next(streams[lane])
            assert np.array_equal(src.push(step, lane=lane), loaded.push(step, lane=lane))
        after, got_after = _tagged(src.export(), sch.names), _tagged(loaded.export(), sch.names)
        assert set(got_after) == set(after) and len(loaded) == len(src)
        assert set(_tagged(waiting, sch.names)) <= set(got_after)  # the waiting steps are transitions now
        for tag, values in got_after.items():
            assert all(np.array_equal(a, b) for a, b in zip(values, after[tag], strict=True)), tag
    finally:
        loaded.close()
        loaded.unlink()


def test_continuity_compares_values_as_stored(make: Make, name: str) -> None:
    """A next observation pushed as float64 into a float32 field is stored as float32: the next
    row's observation continues it when equal as stored, whatever dtype each came in."""
    sch = sb.Schema(obs=((3,), "float32"), next_obs=((3,), "float32"), done=((), "bool"))
    buf = make(sch, 16, next_of="obs", name=name)
    buf.push(obs=np.full(3, 0.1), next_obs=np.full(3, 0.2), done=False)
    buf.push(obs=np.full(3, 0.2, np.float32), next_obs=np.full(3, 0.3), done=False)
    buf.push(obs=[np.full(3, 0.3), np.full(3, 0.4)], next_obs=[np.full(3, 0.4, np.float32), np.full(3, 0.5)],
             done=[False, True])
    assert len(buf) == 4
    assert np.array_equal(buf.take([0]).next_obs[0], np.full(3, 0.2, np.float32))
    with pytest.raises(FieldError, match="does not continue"):  # still refused when unequal as stored
        buf.push(obs=np.full(3, 0.6), next_obs=np.full(3, 0.7), done=False)
        buf.push(obs=np.full(3, 0.7000001), next_obs=np.full(3, 0.8), done=False)


def _positions_agree(buf: sb.ReplayBuffer) -> None:
    """``len``, ``get`` (every position, and a slice of all), ``export`` and ``sample`` count and
    return the same transitions."""
    got = buf.get(slice(0, len(buf)))
    assert [int(buf.get(i).index) for i in range(len(buf))] == got.index.tolist()
    assert np.array_equal(got.index, buf.export()["index"])
    assert set(buf.sample(400).index.tolist()) == set(got.index.tolist())


@pytest.mark.parametrize("next_of", ["obs", None])
def test_stacks_that_reach_rows_lapped_are_not_counted(next_of: str | None, make: Make, name: str) -> None:
    """Once the ring laps an episode's first rows, the oldest rows' stacks reach rows no longer
    held: they are not transitions, and ``len`` and ``get``'s positions leave them out as
    ``export`` and ``sample`` do (``len`` counted them, and ``get(0)`` raised)."""
    sch = schema((1, 4, 4), 4, 0)
    buf = make(sch, 16, next_of=next_of, stack="obs", name=name)
    rows = episode(0, 0, 30, "terminated", (1, 4, 4), 4, 0, "reset")
    _push_all(buf, rows[:25])
    assert len(buf) == 16 - 3 - (next_of is not None)  # three rows' stacks reach lapped rows; the newest waits
    _positions_agree(buf)


def test_a_step_followed_by_another_episodes_start_is_not_counted(make: Make, name: str) -> None:
    """With ``next_of`` a lane's step whose episode stopped without its end (the next push into the
    lane is another episode's first step; or its ``done`` set after its push, as SB3 truncates a
    trajectory) has no next observation: it is not a transition, and ``len`` and ``get``'s
    positions leave it out as ``export`` and ``sample`` do."""
    sch = schema((1, 4, 4), 1, 0)
    buf = make(sch, 32, next_of="obs", episodes=True, name=name)
    first = episode(0, 0, 5, "terminated", (1, 4, 4), 1, 0, "reset")
    second = episode(0, 1, 5, "terminated", (1, 4, 4), 1, 0, "reset")
    _push_all(buf, first[:3], episode=0)  # episode 0 stops after three steps: the third has no next
    _push_all(buf, second[:4], episode=1)
    assert len(buf) == 2 + 3
    _positions_agree(buf)


def test_distinct_draws_beyond_the_transitions_of_a_stack_buffer_are_refused_at_once(make: Make, name: str) -> None:
    """``stack`` alone: ``sample(n, replace=False)`` of more transitions than the buffer holds (rows
    whose stacks reach rows lapped are none) raises ``EmptyBufferError`` at once, as with
    ``next_of`` (it re-drew for a second and raised ``WaitTimeout``)."""
    sch = schema((1, 4, 4), 4, 0)
    buf = make(sch, 16, stack="obs", name=name)
    _push_all(buf, episode(0, 0, 30, "terminated", (1, 4, 4), 4, 0, "reset")[:25])
    assert len(buf) == 13
    t0 = time.monotonic()
    with pytest.raises(sb.EmptyBufferError, match="holds 13 whole transitions"):
        buf.sample(14, replace=False)
    assert time.monotonic() - t0 < 0.5
    assert buf.sample(13, replace=False).index.size == 13


def test_stacks_assembled_along_a_later_axis_are_contiguous_arrays() -> None:
    """Stacks along a later axis are new contiguous arrays, also where a frame is one wide along it
    (channels last: a reshape alone gives a strided view there); torch tensors (the device copy's)
    assemble to the same values."""
    s = frames.Stack("obs", 4, 2, 1)
    fr = np.arange(3 * 4 * 5 * 6, dtype=np.int64).reshape(3, 4, 5, 6, 1)
    got = frames.assemble(s, fr)
    assert got.shape == (3, 5, 6, 4) and got.flags.c_contiguous
    assert np.array_equal(got[:, :, :, 1], fr[:, 1, :, :, 0])
    torch = pytest.importorskip("torch")
    assert np.array_equal(frames.assemble(s, torch.from_numpy(fr)).numpy(), got)
