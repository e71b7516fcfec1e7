"""Hindsight relabelling (``shmbuffer.hindsight``, ``sample(n, hindsight=...)``) and SB3's
``HerReplayBuffer`` over a shmbuffer (``shmbuffer.sb3.HerReplayBuffer``).

Rows are self-verifying: row ``k`` of lane ``l`` (each lane written in order from its start)
holds ``obs = k`` everywhere, ``next_achieved_goal = (k, episode)``, and the episodes of a lane
follow a fixed plan (``episodes_of``), so every relabelled goal names the row it came from and
its episode, and a test checks it against the transition it was given to."""

from __future__ import annotations

import multiprocessing as mp
import pickle
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import shmbuffer as sb
from shmbuffer.hindsight import Hindsight

Make = Callable[..., sb.ReplayBuffer]

GOAL = sb.Schema(
    obs=((8,), "float32"), action=((), "int64"), reward=((), "float32"), done=((), "bool"),
    achieved_goal=((2,), "float32"), next_achieved_goal=((2,), "float32"),
    desired_goal=((2,), "float32"), next_desired_goal=((2,), "float32"),
)
REWARD = -7.0
"""The reward every row is pushed with: a relabelled reward differs."""


def compute_reward(achieved: np.ndarray, desired: np.ndarray, info: Any) -> np.ndarray:
    assert len(info) == achieved.shape[0]
    return np.where((achieved == desired).all(axis=-1), 0.0, -1.0).astype(np.float32)


class Plan:
    """The episodes of one lane: lengths 2..7 in a fixed pattern, ids ``j * lanes + lane``."""

    def __init__(self, lane: int, lanes: int, rows: int) -> None:
        self.episode = np.empty(rows, np.int64)
        self.first = np.empty(rows, np.int64)
        self.last = np.empty(rows, np.int64)
        k = j = 0
        while k < rows:
            length = 2 + (j * 7 + lane * 3) % 6
            stop = k + length
            self.episode[k:stop] = j * lanes + lane
            self.first[k:stop] = k
            self.last[k:stop] = stop - 1
            k, j = stop, j + 1
        self.episode, self.first, self.last = self.episode[:rows], self.first[:rows], self.last[:rows]

    def rows(self, a: int, b: int) -> dict[str, np.ndarray]:
        k = np.arange(a, b)
        ep = self.episode[a:b].astype(np.float32)
        nxt = np.stack([k.astype(np.float32), ep], axis=1)
        return {"obs": np.repeat(k.astype(np.float32)[:, None], 8, axis=1), "action": k,
                "reward": np.full(b - a, REWARD, np.float32), "done": k == self.last[a:b],
                "achieved_goal": nxt - [1, 0], "next_achieved_goal": nxt,
                "desired_goal": np.full((b - a, 2), -1, np.float32), "next_desired_goal": np.full((b - a, 2), -1, np.float32)}


def fill(buf: sb.ReplayBuffer, plan: Plan, lane: int, a: int, b: int) -> None:
    buf.push(plan.rows(a, b), lane=lane, episode=plan.episode[a:b])


def check(batch: Any, lanes: int, strategy: str, plans: list[Plan] | None = None) -> int:
    """Every property a hindsight batch must have; returns how many rows were relabelled."""
    index = batch.index
    k = index // lanes
    lane = index % lanes
    assert np.array_equal(batch.obs, np.repeat(k.astype(np.float32)[:, None], 8, axis=1))  # whole rows
    assert np.array_equal(batch.next_achieved_goal[:, 0], k) and np.array_equal(batch.next_achieved_goal[:, 1], batch.episode)
    r = batch.relabelled
    assert np.array_equal(batch.goal == -1, ~r)
    # rows not relabelled are as pushed
    assert (batch.desired_goal[~r] == -1).all() and (batch.next_desired_goal[~r] == -1).all()
    assert (batch.reward[~r] == REWARD).all()
    # relabelled: the goal row is of the same lane and episode, and its achieved goal is the goal
    g = batch.goal[r]
    assert np.array_equal(g % lanes, lane[r])
    gk = g // lanes
    assert np.array_equal(batch.desired_goal[r], np.stack([gk.astype(np.float32), batch.episode[r]], axis=1))
    assert np.array_equal(batch.next_desired_goal[r], batch.desired_goal[r])
    assert np.array_equal(batch.reward[r], compute_reward(batch.next_achieved_goal[r], batch.desired_goal[r], [0] * r.sum()))
    if strategy == "future":
        assert (gk >= k[r]).all()
    if plans is not None:
        last = np.array([plans[ln].last[kk] for ln, kk in zip(lane, k, strict=True)])
        first = np.array([plans[ln].first[kk] for ln, kk in zip(lane, k, strict=True)])
        assert (gk <= last[r]).all() and (gk >= first[r]).all()
        if strategy == "final":
            assert np.array_equal(gk, last[r])
    return int(r.sum())


@pytest.mark.parametrize("strategy", ["future", "final", "episode"])
def test_goals_come_from_the_episode(strategy: str, make: Make, name: str) -> None:
    lanes, rows = 3, 60
    buf = make(GOAL, 3 * 80, lanes=lanes, episodes=True, name=name, seed=1)
    plans = [Plan(ln, lanes, rows) for ln in range(lanes)]
    for ln in range(lanes):
        fill(buf, plans[ln], ln, 0, rows)
    spec = Hindsight(compute_reward, strategy=strategy, n_sampled_goal=4)
    seen = set()
    for _ in range(20):
        batch = buf.sample(128, hindsight=spec)
        assert check(batch, lanes, strategy, plans) == int(0.8 * 128)
        seen.update(batch.index.tolist())
    # the episode each lane is still writing (its last row not done) is never drawn
    for ln in range(lanes):
        running = plans[ln].episode == plans[ln].episode[rows - 1]
        if not plans[ln].rows(rows - 1, rows)["done"][0]:
            assert not seen & set((np.flatnonzero(running) * lanes + ln).tolist())
    assert len(seen) > 100


def test_future_is_uniform_over_the_rest_of_the_episode(make: Make, name: str) -> None:
    buf = make(GOAL, 64, episodes=True, name=name, seed=2)
    plan = Plan(0, 1, 7)  # episodes of rows 0-1, 2-4 and 5-6 (still running: 4 rows long)
    fill(buf, plan, 0, 0, 7)
    batch = buf.sample(4000, hindsight=Hindsight(compute_reward, ratio=1.0))
    assert set(batch.index.tolist()) == {0, 1, 2, 3, 4}
    at = batch.index == 2  # the first row of the 3-row episode: goals from rows 2, 3 and 4
    counts = np.bincount(batch.goal[at], minlength=7)
    assert (counts[2:5] > at.sum() / 3 * 0.8).all() and counts[2:5].sum() == at.sum()


def test_ratio(make: Make, name: str) -> None:
    buf = make(GOAL, 64, episodes=True, name=name)
    plan = Plan(0, 1, 30)
    fill(buf, plan, 0, 0, 30)
    assert buf.sample(50, hindsight=Hindsight(compute_reward, ratio=0.0)).relabelled.sum() == 0
    assert buf.sample(50, hindsight=Hindsight(compute_reward, n_sampled_goal=1)).relabelled.sum() == 25
    assert buf.sample(50, hindsight=Hindsight(compute_reward, ratio=1.0)).relabelled.sum() == 50
    assert Hindsight(compute_reward).her_ratio == pytest.approx(0.8)  # SB3's default n_sampled_goal=4


def test_an_episode_completes_when_the_next_one_starts(make: Make, name: str) -> None:
    """Without a done flag, an episode is complete once another follows it in the lane."""
    schema = sb.Schema(**{f.name: (f.shape, f.dtype) for f in GOAL if f.name != "done"})
    buf = make(schema, 64, episodes=True, name=name)
    plan = Plan(0, 1, 12)
    rows = plan.rows(0, 12)
    del rows["done"]
    last_ep = plan.episode[11]
    buf.push(rows, episode=plan.episode)
    batch = buf.sample(300, hindsight=Hindsight(compute_reward, done=()))
    assert not (batch.episode == last_ep).any() and len(set(batch.episode.tolist())) > 1


def test_refusals_leave_the_buffer_as_it_was(make: Make, name: str) -> None:
    plain = make(GOAL, 32, name=name)
    plain.push(Plan(0, 1, 4).rows(0, 4))
    with pytest.raises(sb.FieldError, match="episodes=True"):
        plain.sample(8, hindsight=Hindsight(compute_reward))
    buf = make(GOAL, 32, episodes=True, name=name + "b")
    with pytest.raises(sb.EmptyBufferError, match="empty"):
        buf.sample(8, hindsight=Hindsight(compute_reward))
    plan = Plan(0, 1, 12)
    fill(buf, plan, 0, 0, 1)  # an episode still running: nothing to draw
    with pytest.raises(sb.EmptyBufferError, match="complete"):
        buf.sample(8, hindsight=Hindsight(compute_reward))
    fill(buf, plan, 0, 1, 12)
    before = (len(buf), buf.stats["sampled"])
    with pytest.raises(sb.FieldError, match=r"'goal_achieved'.*not in the schema"):
        buf.sample(8, hindsight=Hindsight(compute_reward, achieved="goal_achieved"))
    with pytest.raises(sb.FieldError, match="desired field 'obs' has shape"):
        buf.sample(8, hindsight=Hindsight(compute_reward, desired="obs"))
    with pytest.raises(sb.FieldError, match="reward field 'obs'"):
        buf.sample(8, hindsight=Hindsight(compute_reward, reward="obs"))
    with pytest.raises(ValueError, match="n_step=1"):
        buf.sample(8, n_step=3, hindsight=Hindsight(compute_reward))
    with pytest.raises(ValueError, match="replace=True"):
        buf.sample(8, replace=False, hindsight=Hindsight(compute_reward))
    with pytest.raises(TypeError, match=r"shmbuffer\.Hindsight"):
        buf.sample(8, hindsight={"strategy": "future"})  # type: ignore[arg-type]
    with pytest.raises(sb.FieldError, match="compute_reward returned"):
        buf.sample(8, hindsight=Hindsight(lambda a, d, i: np.zeros(3), ratio=1.0))
    assert (len(buf), buf.stats["sampled"]) == before
    with pytest.raises(ValueError, match="strategy must be one of future, final, episode, got 'last'"):
        Hindsight(compute_reward, strategy="last")
    with pytest.raises(ValueError, match="not both"):
        Hindsight(compute_reward, n_sampled_goal=4, ratio=0.5)
    with pytest.raises(ValueError, match="ratio must be a number in"):
        Hindsight(compute_reward, ratio=1.5)
    with pytest.raises(TypeError, match="compute_reward must be callable"):
        Hindsight("reward")  # type: ignore[arg-type]


def test_info_and_one_call_a_batch(make: Make, name: str) -> None:
    buf = make(GOAL, 64, episodes=True, name=name)
    fill(buf, Plan(0, 1, 30), 0, 0, 30)
    calls: list[Any] = []

    def counted(a: np.ndarray, d: np.ndarray, info: Any) -> np.ndarray:
        calls.append(info)
        return compute_reward(a, d, [0] * a.shape[0])

    given: list[np.ndarray] = []

    def info(batch: Any, positions: np.ndarray) -> list[tuple[str, int]]:
        given.append(positions)
        return [("info", int(i)) for i in positions]

    batch = buf.sample(40, hindsight=Hindsight(counted, info=info))
    assert check(batch, 1, "future") == 32 and len(calls) == 1 and len(given) == 1
    assert sorted(given[0].tolist()) == np.flatnonzero(batch.relabelled).tolist()
    assert calls[0] == [("info", int(i)) for i in given[0]]


def test_prioritized_weights_are_the_rows(make: Make, name: str) -> None:
    buf = make(GOAL, 64, episodes=True, name=name, sampler=sb.Prioritized(alpha=1.0, beta=1.0, eps=0.0))
    fill(buf, Plan(0, 1, 40), 0, 0, 40)
    ids = buf.get(slice(0, 40)).index
    buf.update_priorities(ids, 1.0 + (ids % 4))
    batch = buf.sample(256, hindsight=Hindsight(compute_reward))
    check(batch, 1, "future")
    p = 1.0 + (batch.index % 4)
    assert np.allclose(batch.weight, (p / 1.0) ** -1.0, rtol=1e-5)  # min leaf 1: the row's weight, relabelled or not
    assert buf.update_priorities(batch, np.ones(256)) == 256


def test_image_goals_stored_once(make: Make, name: str) -> None:
    """``next_of`` keeps each goal image once; relabelled goals are the goal rows' next images."""
    img = (3, 24, 24)
    schema = sb.Schema(obs=((4,), "float32"), achieved=(img, "uint8"), next_achieved=(img, "uint8"),
                       desired=(img, "uint8"), reward=((), "float32"), done=((), "bool"))
    buf = make(schema, 2 * 64, lanes=2, episodes=True, next_of={"next_achieved": "achieved"}, name=name)
    lengths = [3, 5, 2, 4]
    value, lasts = {}, set()
    for lane in range(2):
        r = 0  # the lane's row number: an episode's final observation takes a row of its own (frames.py)
        for j, n in enumerate(lengths):
            ep = j * 2 + lane
            for t in range(n):
                v = (lane * 100 + r) % 250
                value[(lane, r)] = v
                buf.push(obs=np.full(4, r, np.float32), achieved=np.full(img, v, np.uint8),
                         next_achieved=np.full(img, (v + 1) % 250 if t < n - 1 else 251, np.uint8),
                         desired=np.zeros(img, np.uint8), reward=-1.0, done=t == n - 1, lane=lane, episode=ep)
                r += 1
            lasts.add((lane, r - 1))
            r += 1
    spec = Hindsight(lambda a, d, i: (a == d).all(axis=(1, 2, 3)).astype(np.float32) - 1, achieved="next_achieved",
                     desired="desired", ratio=1.0)
    batch = buf.sample(200, hindsight=spec)
    assert batch.relabelled.all()
    goal_rows = batch.goal // 2
    goal_lane = batch.goal % 2
    for i in range(200):
        lane, gk = int(goal_lane[i]), int(goal_rows[i])
        expect = 251 if (lane, gk) in lasts else value[(lane, gk)] + 1  # the last: the final image
        assert (batch.desired[i] == expect).all()
        assert gk >= batch.obs[i, 0]
    assert np.array_equal(batch.reward, spec.compute_reward(batch.next_achieved, batch.desired, None))


def test_loader_and_save_load(make: Make, name: str, tmp_path: Any) -> None:
    buf = make(GOAL, 2 * 40, lanes=2, episodes=True, name=name, seed=3)
    plans = [Plan(ln, 2, 40) for ln in range(2)]
    for ln in range(2):
        fill(buf, plans[ln], ln, 0, 40)
    spec = Hindsight(compute_reward, strategy="final")
    with buf.loader(64, hindsight=spec) as loader:
        for _, batch in zip(range(3), loader, strict=False):
            host = {k: np.asarray(v) for k, v in batch.fields.items()}
            r = np.asarray(batch.relabelled)
            assert r.sum() == int(0.8 * 64)
            assert (host["reward"][r] != REWARD).all() and (host["reward"][~r] == REWARD).all()
    buf.save(tmp_path / "her")
    loaded = sb.ReplayBuffer.load(tmp_path / "her", name=name + "l")
    try:
        check(loaded.sample(128, hindsight=spec), 2, "final", plans)
    finally:
        loaded.close()
        loaded.unlink()


# -- writers that lap the ring ----------------------------------------------------------------------

def _writer(handle: sb.BufferHandle, lane: int, lanes: int, rows: int) -> None:
    buf = sb.ReplayBuffer.attach(handle)
    plan = Plan(lane, lanes, rows)
    k = 0
    while k < rows:
        n = min(3, rows - k)
        fill(buf, plan, lane, k, k + n)
        k += n
    buf.close()


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["future", "episode"])
def test_goals_while_writers_lap_the_ring(strategy: str, make: Make, name: str, procs: list) -> None:
    """Two writer processes, one a lane, lap a ring of 24 rows a lane all the time: every goal is
    of its transition's lane and episode, from a row of it (after it for ``future``), never torn."""
    lanes, rows = 2, 60_000
    buf = make(GOAL, lanes * 24, lanes=lanes, episodes=True, name=name, sampler=sb.Prioritized())
    plans = [Plan(ln, lanes, rows) for ln in range(lanes)]
    ctx = mp.get_context("spawn")
    for ln in range(lanes):
        p = ctx.Process(target=_writer, args=(buf.handle, ln, lanes, rows))
        p.start()
        procs.append(p)
    spec = Hindsight(compute_reward, strategy=strategy, ratio=0.9)
    deadline = time.monotonic() + 60
    while len(buf) < lanes * 24 and time.monotonic() < deadline:
        time.sleep(0.01)
    relabelled = 0
    while any(p.is_alive() for p in procs):
        try:
            batch = buf.sample(64, hindsight=spec)
        except sb.WaitTimeout:  # a descheduled writer can hold rows odd for a while on 2 cores
            continue
        relabelled += check(batch, lanes, strategy, plans)
    for p in procs:
        p.join(10)
        assert p.exitcode == 0
    assert relabelled > 1000


# -- shmbuffer.sb3.HerReplayBuffer ------------------------------------------------------------------

sb3 = pytest.importorskip("stable_baselines3")


def _bit_env(n_envs: int = 2) -> Any:
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.envs import BitFlippingEnv

    return make_vec_env(lambda: BitFlippingEnv(n_bits=4, continuous=True), n_envs)


def _her(venv: Any, name: str, **kwargs: Any) -> Any:
    from shmbuffer.sb3 import HerReplayBuffer

    return HerReplayBuffer(1000, venv.observation_space, venv.action_space, venv, n_envs=venv.num_envs,
                           name=name, **kwargs)


def _steps(rb: Any, venv: Any, n: int) -> None:
    obs = venv.reset()
    for _ in range(n):
        actions = np.random.rand(venv.num_envs, 4)
        nxt, rewards, dones, infos = venv.step(actions)
        stored = {k: v.copy() for k, v in nxt.items()}
        for i in np.flatnonzero(dones):  # as SB3's _store_transition: the real final observation
            for k in stored:
                stored[k][i] = infos[i]["terminal_observation"][k]
        rb.add(obs, stored, actions, rewards, dones, infos)
        obs = nxt


def test_sb3_her_rewards_are_the_envs(name: str) -> None:
    from stable_baselines3.her.her_replay_buffer import HerReplayBuffer as Theirs

    venv = _bit_env()
    rb = _her(venv, name, n_sampled_goal=4, goal_selection_strategy="final", copy_info_dict=True)
    try:
        assert isinstance(rb, Theirs)
        np.random.seed(0)
        _steps(rb, venv, 40)
        s = rb.sample(200)
        achieved = s.next_observations["achieved_goal"].numpy()
        desired = s.observations["desired_goal"].numpy()
        assert np.array_equal(desired, s.next_observations["desired_goal"].numpy())
        expect = venv.env_method("compute_reward", achieved, desired, [{}] * 200, indices=[0])[0]
        assert np.allclose(s.rewards.numpy().reshape(-1), expect)
        assert (rb.ep_length[:20] > 0).any() and rb.her_ratio == pytest.approx(0.8)
        clone = pickle.loads(pickle.dumps(rb))
        try:
            assert clone.env is None
            with pytest.raises(ValueError, match="set_env"):
                clone.sample(8)
            clone.set_env(venv)
            assert clone.sample(8).rewards.shape == (8, 1)
            assert np.array_equal(clone.observations["observation"], rb.observations["observation"])
        finally:
            clone.close()
    finally:
        rb.close()


def test_sb3_her_before_an_episode_ends(name: str) -> None:
    venv = _bit_env(1)
    rb = _her(venv, name)
    try:
        obs = venv.reset()
        action = np.zeros((1, 4), np.float32)
        nxt, r, _, infos = venv.step(action)
        rb.add(obs, nxt, action, r, np.array([False]), infos)
        with pytest.raises(RuntimeError, match="end of the first episode"):
            rb.sample(4)
        with pytest.warns(UserWarning, match="will be truncated"):
            rb.truncate_last_trajectory()  # SB3's: the running episode counts as ended
        assert rb.sample(4).rewards.shape == (4, 1)
    finally:
        rb.close()


def test_sb3_her_pickled_mid_episode_goes_on_with_the_episode(name: str) -> None:
    """A copy pickled while each env's episode runs continues those episodes with its next adds,
    as the original does: the steps before the pickle end with them and are drawn (hindsight
    draws complete episodes only), instead of waiting for an end that never comes."""
    venv = _bit_env(2)
    rb = _her(venv, name)
    clone = None
    try:
        obs = venv.reset()
        action = np.zeros((2, 4), np.float32)
        for _ in range(4):  # the dones are the test's: no info says the episode was cut
            nxt, r, _, _ = venv.step(action)
            rb.add(obs, nxt, action, r, np.array([False, False]), [{}, {}])
            obs = nxt
        clone = pickle.loads(pickle.dumps(rb))
        clone.set_env(venv)
        nxt, r, _, _ = venv.step(action)
        for buf in (rb, clone):
            buf.add(obs, nxt, action, r, np.array([True, True]), [{}, {}])
        want, got = rb.buffer.export(), clone.buffer.export()
        assert got["episode"].tolist() == want["episode"].tolist()
        assert len(set(want["episode"].tolist())) == 2                     # one episode per env, whole
        assert set(clone.buffer.sample(400, hindsight=clone.hindsight).index.tolist()) == set(got["index"].tolist())
    finally:
        rb.close()
        if clone is not None:
            clone.close()


def _sb3_writer(handle: sb.BufferHandle, lanes: int) -> None:
    """Another process writing whole episodes into env 1's lane of an SB3 HerReplayBuffer."""
    buf = sb.ReplayBuffer.attach(handle)
    for j in range(5):
        n = 3
        goal = np.full((n, 4), j % 2, np.int8)
        row = {f.name: np.zeros((n, *f.shape), f.dtype) for f in buf.schema}
        row["next_obs_achieved_goal"] = np.repeat(np.arange(n, dtype=np.int8)[:, None], 4, axis=1)
        row["obs_desired_goal"] = row["next_obs_desired_goal"] = goal
        row["done"][-1] = 1
        buf.push(row, lane=1, episode=np.full(n, 1_000 + j * lanes + 1))
    buf.close()


def test_sb3_her_relabels_rows_of_other_processes(name: str, procs: list) -> None:
    venv = _bit_env(2)
    rb = _her(venv, name, n_sampled_goal=4)
    try:
        p = mp.get_context("spawn").Process(target=_sb3_writer, args=(rb.buffer.handle, 2))
        p.start()
        procs.append(p)
        p.join(60)
        assert p.exitcode == 0
        batch = rb.buffer.sample(400, hindsight=rb.hindsight)
        theirs = batch.episode >= 1_000
        r = batch.relabelled & theirs
        assert r.any()
        rows = (batch.goal[r] // 2)
        assert np.array_equal(batch.obs_desired_goal[r][:, 0], rows - rows // 3 * 3)  # the goal row's step
        assert ((batch.goal[r] // 2) >= batch.index[r] // 2).all()
    finally:
        rb.close()


def test_sb3_her_leaves_np_random_alone_until_it_samples(name: str) -> None:
    """Making the buffer and adding to it draw nothing from np.random (SB3's HerReplayBuffer draws
    only when it samples: a draw before would shift a seeded run's exploration); the shared
    buffer's generator is seeded from np.random at the first sample, so seeded runs repeat."""
    venv = _bit_env(2)
    rng = np.random.default_rng(0)
    steps = []
    obs = venv.reset()
    for _ in range(30):
        actions = rng.random((venv.num_envs, 4)).astype(np.float32)
        nxt, rewards, dones, infos = venv.step(actions)
        stored = {k: v.copy() for k, v in nxt.items()}
        for i in np.flatnonzero(dones):
            for k in stored:
                stored[k][i] = infos[i]["terminal_observation"][k]
        steps.append((obs, stored, actions, rewards, dones, infos))
        obs = nxt
    np.random.seed(4)
    before = np.random.get_state()
    made = []
    try:
        for i in range(2):
            made.append(_her(venv, f"{name}{i}"))
            for step in steps:
                made[-1].add(*step)
        after = np.random.get_state()
        assert np.array_equal(after[1], before[1]) and after[2] == before[2]
        got = []
        for rb in made:
            np.random.seed(7)
            got.append([rb.sample(64) for _ in range(3)])
        for a, b in zip(*got, strict=True):
            for k in a.observations:
                assert np.array_equal(a.observations[k].numpy(), b.observations[k].numpy())
            assert np.array_equal(a.rewards.numpy(), b.rewards.numpy())
    finally:
        for rb in made:
            rb.close()
