"""Windows of consecutive steps: sequences, n-step returns, groups and whole episodes."""

from __future__ import annotations

import functools
import importlib.util
import multiprocessing as mp
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import shmbuffer as sb
from shmbuffer.sequences import n_step_return, window_mask

from .conftest import MUJOCO, SMALL, small_row, transition
from .conftest import seq_of as checked_seq_of

Make = Callable[..., sb.ReplayBuffer]


def seq_of(batch: Any) -> np.ndarray:
    return checked_seq_of(batch, done=False)  # Lane sets done itself


STRIDE = 1_000_000
"""Lane ``l``'s rows are sequence numbers ``l * STRIDE + t``: apart while ``t < STRIDE``."""
REPLAYED = 60_000
"""Steps of each writer's stream the learner replays to know every row's episode (a writer stops
there): over 1,800 laps of the tests' rings of 32 rows a lane."""


class Lane:
    """One env's stream of rows: sequence numbers ``base + t``, episodes of random lengths that
    end by termination (done) or truncation (a new episode id without done)."""

    def __init__(self, lane: int, seed: int) -> None:
        self.lane, self.rng = lane, np.random.default_rng(seed)
        self.t, self.episode, self.left = 0, lane * 1_000_000, int(self.rng.integers(1, 12))
        self.rows: list[tuple[int, int, bool]] = []  # (seq, episode, done) of every row pushed

    def step(self) -> tuple[dict[str, np.ndarray], int]:
        seq = self.lane * STRIDE + self.t
        self.left -= 1
        ended = self.left == 0
        done = ended and bool(self.rng.random() < 0.5)  # else truncated: no done, a new episode
        row = transition(seq)
        row["done"] = np.asarray(done)
        self.rows.append((seq, self.episode, done))
        episode = self.episode
        self.t += 1
        if ended:
            self.episode += 1
            self.left = int(self.rng.integers(1, 12))
        return row, episode

    def fill(self, buf: sb.ReplayBuffer, steps: int) -> None:
        for _ in range(steps):
            row, episode = self.step()
            buf.push(row, lane=self.lane, episode=episode)


@functools.cache
def replayed() -> tuple[Lane, Lane]:
    """The two writers' streams (lanes 0 and 1, seeded as ``_lane_writer`` seeds them), replayed
    once a process: every test that runs those writers reads the same rows."""
    lanes = (Lane(0, 0), Lane(1, 1))
    for lane in lanes:
        for _ in range(REPLAYED):
            lane.step()
    return lanes


def episode_of(lanes: tuple[Lane, ...] | list[Lane]) -> dict[int, int]:
    return {seq: ep for lane in lanes for seq, ep, _ in lane.rows}


def check_windows(batch: Any, episodes: dict[int, int], burn_in: int) -> None:
    """Every window: valid steps consecutive, one episode, contiguous around the anchor, zeros
    elsewhere."""
    mask = batch.mask
    assert mask[:, burn_in].all()
    for row in range(mask.shape[0]):
        m = mask[row]
        where = np.flatnonzero(m)
        assert np.array_equal(where, np.arange(where[0], where[-1] + 1))  # one run
        seq = seq_of({k: batch[k][row][m] for k in MUJOCO.names})
        assert np.array_equal(np.diff(seq), np.ones(seq.size - 1))  # strictly increasing by 1
        assert len({episodes[int(s)] for s in seq}) == 1
        assert not batch.obs[row][~m].any() and (batch.index[row][~m] == -1).all()


def test_sequences_stay_inside_episodes(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=4 * 64, lanes=4, episodes=True, name=name, seed=0)
    lanes = [Lane(i, i) for i in range(4)]
    for _ in range(30):
        for lane in lanes:
            lane.fill(buf, 3)  # lanes wrap: 90 steps into 64 slots each
    episodes = episode_of(lanes)
    for burn_in in (0, 3):
        batch = buf.sample_sequences(64, 8, burn_in=burn_in)
        assert batch.obs.shape == (64, 8 + burn_in, 17) and batch.mask.shape == (64, 8 + burn_in)
        check_windows(batch, episodes, burn_in)
    assert batch.mask.sum() < batch.mask.size  # some windows were cut at an episode's end


def test_time_major_is_the_transpose(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=128, lanes=2, episodes=True, name=name)
    lanes = [Lane(0, 0), Lane(1, 1)]
    for lane in lanes:
        lane.fill(buf, 40)
    a = sb.ReplayBuffer.attach(buf.handle, seed=5)
    b = sb.ReplayBuffer.attach(buf.handle, seed=5)
    try:
        bm = a.sample_sequences(16, 5, burn_in=2)
        tm = b.sample_sequences(16, 5, burn_in=2, time_major=True)
    finally:
        a.close()
        b.close()
    assert tm.obs.shape == (7, 16, 17) and tm.obs.strides[0] > tm.obs.strides[1]  # time outermost in memory
    for key in (*MUJOCO.names, "mask", "index"):
        assert np.array_equal(tm[key], np.swapaxes(bm[key], 0, 1))
    on_meta = tm.to("meta")  # the device path's views (shapes only) without a GPU
    assert on_meta.obs.shape == (7, 16, 17) and on_meta.reward.shape == (7, 16)


def _lane_writer(handle: sb.BufferHandle, lane: int, seconds: float) -> None:
    buf = sb.ReplayBuffer.attach(handle)
    source = Lane(lane, lane)
    end = time.monotonic() + seconds
    while time.monotonic() < end and source.t + 4 <= REPLAYED:  # the learner knows only the replayed steps
        source.fill(buf, 4)
    buf.close()


@pytest.mark.slow
def test_sequences_while_writers_push(make: Make, name: str, procs: list) -> None:
    """Flashbax's check under load: writers push increasing values into their lanes while the
    learner samples windows; every window is strictly increasing, one episode, never torn."""
    episodes = episode_of(replayed())  # the writers' deterministic streams, to know each episode
    buf = make(MUJOCO, capacity=2 * 64, lanes=2, episodes=True, name=name)
    ctx = mp.get_context("spawn")
    for lane in (0, 1):
        p = ctx.Process(target=_lane_writer, args=(buf.handle, lane, 2.5))
        p.start()
        procs.append(p)
    while len(buf) < 32:
        time.sleep(0.01)
    windows = 0
    while any(p.is_alive() for p in procs):
        batch = buf.sample_sequences(16, 6, burn_in=2)
        check_windows(batch, episodes, 2)
        windows += 16
    for p in procs:
        p.join(10)
        assert p.exitcode == 0
    assert windows > 500


# -- n-step -------------------------------------------------------------------------------------


def test_n_step_return_on_plain_arrays() -> None:
    reward = np.array([[1.0, 2, 4, 8], [1, 2, 4, 8], [1, 2, 4, 8]])
    done = np.array([[0, 0, 0, 0], [0, 1, 0, 0], [0, 0, 0, 0]], bool)
    mask = np.array([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 1]], bool)
    mask = window_mask(mask, 0)
    ret, steps, last_done = n_step_return(reward, done, mask, 0.5)
    assert ret.tolist() == [1 + 1 + 1 + 1, 1 + 1, 1 + 1]
    assert steps.tolist() == [4, 2, 2] and last_done.tolist() == [False, True, False]


def reference_n_step(rows: list[tuple[int, int, bool]], held: set[int], seq: int, n: int, gamma: float) -> tuple[float, int, bool, int]:
    """The n-step return of the row ``seq`` from the list of pushed rows, by hand."""
    at = next(i for i, r in enumerate(rows) if r[0] == seq)
    ret, k, done, last = 0.0, 0, False, seq
    for j in range(n):
        if at + j >= len(rows):
            break
        s, ep, d = rows[at + j]
        if s not in held or ep != rows[at][1]:
            break
        ret += gamma**j * float(s)  # the reward of a row is its sequence number
        k, done, last = k + 1, d, s
        if d:
            break
    return ret, k, done, last


@pytest.mark.parametrize("sampler", [sb.Uniform(), sb.Prioritized()])
def test_n_step_matches_a_reference(sampler: Any, make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=2 * 32, lanes=2, episodes=True, sampler=sampler, name=name, seed=2)
    lanes = [Lane(0, 10), Lane(1, 11)]
    for _ in range(25):
        for lane in lanes:
            lane.fill(buf, 2)  # 50 steps a lane, 32 kept: rows wrap
    held = set(seq_of(buf.get(slice(None))).tolist())
    batch = buf.sample(200, n_step=3, gamma=0.5)
    for i in range(200):
        seq = int(batch.obs[i, 0])  # obs still says which row this is
        lane = lanes[seq // STRIDE]
        ret, k, done, last = reference_n_step(lane.rows, held, seq, 3, 0.5)
        assert batch.steps[i] == k
        assert batch.reward[i] == pytest.approx(ret)
        assert bool(batch.done[i]) == done
        assert np.array_equal(batch.next_obs[i], transition(last)["next_obs"])
    assert (batch.steps > 1).any() and (batch.steps < 3).any() and batch.done.any()


def test_n_step_with_large_next_obs(make: Make, name: str) -> None:
    schema = sb.Schema(obs=((600,), "float32"), reward=((), "float32"), next_obs=((600,), "float32"), done=((), "bool"))
    buf = make(schema, capacity=20, episodes=True, name=name)
    for t in range(20):
        buf.push(obs=np.full(600, t), reward=1.0, next_obs=np.full(600, t + 1), done=t == 9, episode=t // 10)
    batch = buf.sample(100, n_step=4, gamma=1.0)
    for i in range(100):
        t = int(batch.obs[i, 0])
        k = min(4, 10 - t % 10)
        assert batch.steps[i] == k and batch.reward[i] == k
        assert batch.next_obs[i, 0] == t + k and bool(batch.done[i]) == (t + k == 10)


def test_n_step_errors(make: Make, name: str) -> None:
    plain = make(MUJOCO, capacity=8, name=name)
    plain.push(transition(0, 4))
    with pytest.raises(sb.FieldError, match="needs episode ids: create the buffer with episodes=True"):
        plain.sample(2, n_step=3)
    odd = sb.Schema(o=((2,), "float32"), r=((), "float32"))
    buf = make(odd, capacity=8, episodes=True, name=name + "x")
    buf.push(o=np.zeros(2), r=1.0, episode=0)
    with pytest.raises(sb.FieldError, match="need a reward field"):
        buf.sample(1, n_step=2)
    with pytest.raises(ValueError, match="gamma must be in"):
        plain.sample(1, n_step=2, gamma=2.0)
    with pytest.raises(ValueError, match="n_step must be an int >= 1"):
        plain.sample(1, n_step=0)


# -- groups and episodes --------------------------------------------------------------------------


def test_groups(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=3 * 50, lanes=3, episodes=True, name=name, seed=1)
    lanes = [Lane(i, 20 + i) for i in range(3)]
    for lane in lanes:
        lane.fill(buf, 45)
    episodes = episode_of(lanes)
    ordered = buf.sample_groups(20, 4)
    assert ordered.obs.shape == (20, 4, 17) and "mask" not in ordered
    for g in range(20):
        seq = seq_of({k: ordered[k][g] for k in MUJOCO.names})
        assert np.array_equal(np.diff(seq), [1, 1, 1]) and len({episodes[int(s)] for s in seq}) == 1
    shuffled = buf.sample_groups(20, 4, ordered=False)
    for g in range(20):
        seq = seq_of({k: shuffled[k][g] for k in MUJOCO.names})
        assert len(set(seq)) == 4 and len({episodes[int(s)] for s in seq}) == 1
    with pytest.raises(sb.EmptyBufferError, match="has 40 rows"):
        buf.sample_groups(1, 40, ordered=False)
    with pytest.raises(sb.EmptyBufferError, match="no episode has 40 rows in a row"):
        buf.sample_groups(1, 40)


def test_shuffled_groups_of_large_fields_only(make: Make, name: str) -> None:
    """Every field large (no packed record, so no block): the groups re-drawn in later rounds go
    into the first round's batch instead of replacing it."""
    schema = sb.Schema(obs=((300,), "float32"))
    assert schema.record.itemsize == 0
    buf = make(schema, capacity=256, episodes=True, name=name, seed=1)
    at = 0
    for episode, length in enumerate([2, 10] * 10):  # anchors on a 2-row episode must be re-drawn
        obs = np.zeros((length, 300), np.float32)
        obs[:, 0], obs[:, 1:] = episode, (at + np.arange(length))[:, None]
        buf.push(obs=obs, episode=episode)
        at += length
    for _ in range(10):
        batch = buf.sample_groups(8, 4, ordered=False)
        assert batch.obs.shape == (8, 4, 300) and batch.index.shape == (8, 4)
        assert np.array_equal(batch.obs[:, :, 1], batch.index) and (batch.obs[:, :, 2:] == batch.obs[:, :, 1:2]).all()
        assert (batch.obs[:, :, 0] == batch.obs[:, :1, 0]).all() and (batch.obs[:, :, 0] % 2 == 1).all()
        assert all(len(set(g)) == 4 for g in batch.index.tolist())


def test_whole_episodes(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=2 * 40, lanes=2, episodes=True, name=name, seed=4)
    lanes = [Lane(0, 30), Lane(1, 31)]
    for lane in lanes:
        lane.fill(buf, 60)  # wraps: the oldest episodes are cut, the newest is still running
    held = set(seq_of(buf.get(slice(None))).tolist())
    complete: dict[int, list[int]] = {}
    for lane in lanes:
        rows = lane.rows
        for seq, ep, _ in rows:
            complete.setdefault(ep, []).append(seq)
        last_ep = rows[-1][1]
        complete.pop(last_ep)  # still running: no later episode has started in its lane
    complete = {ep: seqs for ep, seqs in complete.items() if set(seqs) <= held}
    got = buf.sample_episodes(30, replace=True)  # with repeats: more than there are
    assert len(got) == 30
    for episode in got:
        seq = seq_of(episode).tolist()
        assert seq in complete.values()
    assert len({tuple(seq_of(e)) for e in got}) > 3


def test_episode_ids_are_checked(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=8, episodes=True, name=name)
    with pytest.raises(sb.FieldError, match=r"push\(..., episode=id\) is required"):
        buf.push(transition(0))
    with pytest.raises(sb.FieldError, match=r"episode: expected an int or 3 ints, got float64"):
        buf.push(transition(0, 3), episode=np.zeros(3))
    with pytest.raises(sb.FieldError, match="expected an int or 3 ints"):
        buf.push(transition(0, 3), episode=[1, 2])
    plain = make(MUJOCO, capacity=8, name=name + "p")
    with pytest.raises(sb.FieldError, match="does not keep episodes"):
        plain.push(transition(0), episode=3)
    with pytest.raises(sb.FieldError, match="needs episode ids"):
        plain.sample_sequences(1, 2)
    buf.push(transition(0, 3), episode=[7, 7, 8])
    with pytest.raises(sb.CapacityError, match="longer than a lane"):
        buf.sample_sequences(1, 8, burn_in=1)
    with pytest.raises(ValueError, match="length must be an int >= 1"):
        buf.sample_sequences(1, 0)


def test_sequence_batch_to_torch(make: Make, name: str) -> None:
    import torch  # here, not at the top: the writer processes this module spawns need no torch

    buf = make(MUJOCO, capacity=32, episodes=True, name=name)
    Lane(0, 0).fill(buf, 32)
    t = buf.sample_sequences(4, 3).to("cpu")
    assert t.obs.shape == (4, 3, 17) and t.mask.dtype == torch.bool


# -- n-step under concurrency (the anchor's episode is the one read with the anchor) --------------


def test_n_step_anchor_overwritten_before_the_window_is_read(make: Make, name: str, monkeypatch: Any) -> None:
    """The anchor row's slot is overwritten between the batch's stamped gather and the n-step
    window's gather, by a row of the episode that follows the anchor's: the window must still be
    judged by the anchor's own episode (read with it), never by the new row's."""
    from shmbuffer import sequences

    buf = make(MUJOCO, capacity=8, episodes=True, sampler=sb.Prioritized(alpha=1.0, eps=0.0), name=name)
    for t in range(8):  # row 0 ends episode 0 by truncation (no done); rows 1.. are episode 1
        row = transition(t)
        row["done"] = np.asarray(False)
        buf.push(row, episode=0 if t == 0 else 1, priority=1.0 if t == 0 else 0.0)
    original = sequences.window_ids
    calls = []

    def overwrite_then_read(*args: Any) -> Any:
        if not calls:
            row = transition(8)
            row["done"] = np.asarray(False)
            buf.push(row, episode=1, priority=0.0)  # lands in row 0's slot
        calls.append(1)
        return original(*args)

    monkeypatch.setattr(sequences, "window_ids", overwrite_then_read)
    batch = buf.sample(4, n_step=3, gamma=0.5)
    assert calls, "the window was not gathered"
    assert batch.obs[:, 0].tolist() == [0.0] * 4  # the anchor's copy, intact
    assert batch.steps.tolist() == [1] * 4, "the window crossed into the next episode"
    assert batch.reward.tolist() == [0.0] * 4
    assert np.array_equal(batch.next_obs, np.stack([transition(0)["next_obs"]] * 4))
    assert batch.episode.tolist() == [0] * 4


def _check_n_step(batch: Any, rows: dict[int, tuple[int, bool]], n: int, gamma: float) -> int:
    """Every transition against the rows it was built from; returns how many used > 1 step."""
    longer = 0
    for i in range(len(batch)):
        seq = int(batch.obs[i, 0])
        ep, _ = rows[seq]
        k = int(batch.steps[i])
        assert 1 <= k <= n
        ret, done = 0.0, False
        for j in range(k):
            e, d = rows[seq + j]
            assert e == ep, f"row {seq}: step {j} is from episode {e}, the row's is {ep}"
            assert not done, f"row {seq}: step {j} follows a done"
            ret += gamma**j * float(seq + j)
            done = d
        assert batch.reward[i] == pytest.approx(ret, rel=1e-6), f"row {seq}: return {batch.reward[i]}, expected {ret}"
        assert bool(batch.done[i]) == done
        assert np.array_equal(batch.next_obs[i], transition(seq + k - 1)["next_obs"])
        assert int(batch.episode[i]) == ep
        longer += k > 1
    return longer


@pytest.mark.slow
@pytest.mark.parametrize("sampler", [sb.Uniform(), sb.Prioritized()])
def test_n_step_while_writers_push(sampler: Any, make: Make, name: str, procs: list) -> None:
    """Two writer processes, one env a lane, episodes ending by termination or by truncation (a
    new episode id without done), a small ring that laps all the time: every sampled n-step
    transition equals the one computed from the rows it was built from."""
    rows = {seq: (ep, d) for lane in replayed() for seq, ep, d in lane.rows}
    buf = make(MUJOCO, capacity=2 * 16, lanes=2, episodes=True, sampler=sampler, name=name)
    ctx = mp.get_context("spawn")
    for lane in (0, 1):
        p = ctx.Process(target=_lane_writer, args=(buf.handle, lane, 3.0))
        p.start()
        procs.append(p)
    while len(buf) < 16:
        time.sleep(0.01)
    sampled = longer = 0
    while any(p.is_alive() for p in procs):
        batch = buf.sample(64, n_step=3, gamma=0.5)
        longer += _check_n_step(batch, rows, 3, 0.5)
        sampled += 64
    for p in procs:
        p.join(10)
        assert p.exitcode == 0
    assert sampled > 2000 and longer > sampled // 10


def test_distinct_episodes_and_short_groups(make: Make, name: str) -> None:
    # DI-engine's example: push("a", {"episode": 1}), push("b", {"episode": 2}), push("c", {"episode": 2})
    buf = make(SMALL, 10, episodes=True, name=name, seed=0)
    for value, episode in ((0, 1), (1, 2), (2, 2)):
        buf.push(small_row(value), episode=episode)
    for _ in range(50):
        groups = buf.sample_groups(2, 2, replace=False, short=True)
        assert sorted(groups.reward[:, 0].tolist()) == [0, 1]        # one group of each episode
        short = int(np.flatnonzero(groups.reward[:, 0] == 0)[0])
        assert groups.mask[short].tolist() == [True, False]            # episode 1 kept, truncated
        assert groups.mask[1 - short].tolist() == [True, True]
        assert groups.index[short].tolist() == [0, -1]
    with pytest.raises(sb.EmptyBufferError, match="holds 2 episodes, fewer than the 3"):
        buf.sample_groups(3, 2, replace=False, short=True)
    # whole episodes: the one still being written (episode 2) is not complete
    assert [e.reward.tolist() for e in buf.sample_episodes(1, replace=False)] == [[0.0]]
    with pytest.raises(sb.EmptyBufferError, match="holds 1 complete episodes"):
        buf.sample_episodes(2, replace=False)


def test_episodes_are_distinct_in_a_call(make: Make, name: str) -> None:
    buf = make(SMALL, 100, episodes=True, name=name, seed=3)
    for episode, length in enumerate([3, 5, 2, 7, 4, 6]):
        buf.push(obs=np.full((length, 3), episode), reward=np.full(length, episode), episode=episode)
    for _ in range(50):
        got = buf.sample_episodes(5, replace=False)                   # the 6th is still open
        assert sorted(int(e.reward[0]) for e in got) == [0, 1, 2, 3, 4]
        groups = buf.sample_groups(6, 3, ordered=False, replace=False, short=True)
        assert sorted(groups.reward[:, 0].tolist()) == [0, 1, 2, 3, 4, 5]
        ordered = buf.sample_groups(4, 4, replace=False)              # only episodes of 4 rows or more
        assert sorted(ordered.reward[:, 0].tolist()) == [1, 3, 4, 5] and "mask" not in ordered


@pytest.mark.parametrize("wide", ["r", "d"])
def test_n_step_refuses_a_reward_or_done_of_several_values_before_drawing(wide: str, make: Make, name: str) -> None:
    """A reward or done field of several values a row is small (packed) but not a scalar per row:
    refused by name before anything is drawn, on the host and by the device copy, the buffer as it was
    (not a numpy or torch reshape error after the draw)."""
    sch = sb.Schema(o=((2,), "float32"), next_obs=((2,), "float32"), r=((2,) if wide == "r" else (), "float32"),
                    d=((2,) if wide == "d" else (), "bool"))
    buf = make(sch, capacity=16, episodes=True, max_use=1, name=name)
    buf.push({"o": np.zeros((8, 2)), "next_obs": np.zeros((8, 2)), "r": np.zeros((8, 2) if wide == "r" else 8),
              "d": np.zeros((8, 2) if wide == "d" else 8, bool)}, episode=np.zeros(8, int))
    samples = [buf.sample]
    if importlib.util.find_spec("torch") is not None:
        from shmbuffer.device import DeviceReplay
        dev = DeviceReplay(buf, "cpu", max_lag_rows=0, refresher=False, seed=0)
        samples.append(dev.sample)
    for sample in samples:
        before = dict(buf.stats)
        with pytest.raises(sb.FieldError, match=rf"n_step=2: field '{wide}' must be a scalar per row .*\(2,\)"):
            sample(4, n_step=2, fields={"reward": "r", "done": "d"})
        assert dict(buf.stats) == before and len(buf) == 8
    assert buf.sample(8).index.size == 8  # no row was used up by the refused samples
