"""shmbuffer.sb3: SB3's replay buffers over a shmbuffer. The contract is SB3's own buffer: given the
same adds and the same np.random state, the same transitions; and SB3's DQN learns with it as
with its own buffer."""

from __future__ import annotations

import io
import os
import pickle
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

sb3 = pytest.importorskip("stable_baselines3")
gym = pytest.importorskip("gymnasium")

from gymnasium import spaces  # noqa: E402
from stable_baselines3.common import buffers  # noqa: E402

import shmbuffer as sb  # noqa: E402
from shmbuffer import sb3 as ours  # noqa: E402
from shmbuffer.shm import segment  # noqa: E402


@pytest.fixture
def opened() -> Iterator[list[Any]]:
    made: list[Any] = []
    yield made
    for rb in made:
        rb.close()


def adds(n_envs: int, steps: int, obs_space: spaces.Space, act_space: spaces.Space, seed: int) -> list[tuple[Any, ...]]:
    """SB3 ``add`` arguments: random observations and actions, dones, time-limit ends."""
    rng = np.random.default_rng(seed)
    obs_space.seed(seed)
    act_space.seed(seed + 1)
    out = []
    for t in range(steps):
        if isinstance(obs_space, spaces.Dict):
            obs = {k: np.stack([s.sample() for _ in range(n_envs)]) for k, s in obs_space.spaces.items()}
            nxt = {k: np.stack([s.sample() for _ in range(n_envs)]) for k, s in obs_space.spaces.items()}
        else:
            obs = np.stack([obs_space.sample() for _ in range(n_envs)])
            nxt = np.stack([obs_space.sample() for _ in range(n_envs)])
        action = np.stack([act_space.sample() for _ in range(n_envs)])
        reward = rng.normal(size=n_envs).astype(np.float32)
        done = (rng.random(n_envs) < 0.3) | (np.arange(n_envs) == t % 5)  # every env ends now and then
        infos = [{"TimeLimit.truncated": bool(d and (t + i) % 2 == 0)} for i, d in enumerate(done)]
        out.append((obs, nxt, action, reward, done, infos))
    return out


def same(a: Any, b: Any) -> None:
    for x, y in zip(a, b, strict=True):
        if x is None:
            assert y is None
        elif isinstance(x, dict):
            assert x.keys() == y.keys()
            for k in x:
                assert torch.equal(x[k], y[k]), k
        else:
            assert x.dtype == y.dtype and x.shape == y.shape
            assert torch.equal(x, y)


CASES = {
    "box-1env": (spaces.Box(-1, 1, (4,), np.float32), spaces.Discrete(3), 1, 10, 7),
    "box-3envs-wrap": (spaces.Box(-1, 1, (4,), np.float32), spaces.Box(-2, 2, (2,), np.float32), 3, 12, 11),
    "discrete-obs-4envs": (spaces.Discrete(5), spaces.Discrete(2), 4, 8, 13),
    "float64-actions": (spaces.Box(-1, 1, (3,), np.float64), spaces.Box(-1, 1, (2,), np.float64), 2, 8, 6),
    "box-2envs-not-full": (spaces.Box(0, 255, (2, 3), np.uint8), spaces.MultiDiscrete([3, 4]), 2, 40, 9),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("timeouts", [True, False])
def test_same_transitions_as_sb3(case: str, timeouts: bool, name: str, opened: list[Any]) -> None:
    obs_space, act_space, n_envs, size, steps = CASES[case]
    theirs = buffers.ReplayBuffer(size, obs_space, act_space, "cpu", n_envs=n_envs, handle_timeout_termination=timeouts)
    mine = ours.ReplayBuffer(size, obs_space, act_space, "cpu", n_envs=n_envs, handle_timeout_termination=timeouts, name=name)
    opened.append(mine)
    assert isinstance(mine, buffers.ReplayBuffer) and mine.buffer.lanes == n_envs
    for step in adds(n_envs, steps, obs_space, act_space, seed=len(case)):
        theirs.add(*step)
        mine.add(*step)
        assert (mine.pos, mine.full, mine.size()) == (theirs.pos, theirs.full, theirs.size())
    for draw in range(5):
        np.random.seed(draw)
        a = theirs.sample(32)
        np.random.seed(draw)
        b = mine.sample(32)
        same(a, b)
    if timeouts:  # the masking mattered: some sampled done was a time-limit end
        np.random.seed(0)
        assert (theirs.dones.sum() > 0) and (theirs.timeouts * theirs.dones).sum() > 0
    inds = np.arange(theirs.size())  # every position, for all envs
    np.random.seed(1)
    a = theirs._get_samples(inds)
    np.random.seed(1)
    b = mine._get_samples(inds)
    same(a, b)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("timeouts", [True, False])
def test_n_step_same_transitions_as_sb3(case: str, timeouts: bool, name: str, opened: list[Any]) -> None:
    """SB3's NStepReplayBuffer and ours, the same adds and np.random state: the same n-step
    returns, discounts, last next_obs and dones, for random draws and for every position
    (windows cut by dones, time-limit ends, the newest row, and the wrap of a full buffer)."""
    obs_space, act_space, n_envs, size, steps = CASES[case]
    n_steps = min(4, size // n_envs)  # SB3 reads a window longer than an env's rows round and round
    kw = {"n_envs": n_envs, "handle_timeout_termination": timeouts, "n_steps": n_steps, "gamma": 0.9}
    theirs = buffers.NStepReplayBuffer(size, obs_space, act_space, "cpu", **kw)
    mine = ours.NStepReplayBuffer(size, obs_space, act_space, "cpu", name=name, **kw)
    opened.append(mine)
    assert isinstance(mine, buffers.NStepReplayBuffer) and isinstance(mine, ours.ReplayBuffer)
    for step in adds(n_envs, steps, obs_space, act_space, seed=len(case)):
        theirs.add(*step)
        mine.add(*step)
    for draw in range(5):
        np.random.seed(draw)
        a = theirs.sample(32)
        np.random.seed(draw)
        same(a, mine.sample(32))
    np.random.seed(1)
    a = theirs._get_samples(np.arange(theirs.size()))
    np.random.seed(1)
    b = mine._get_samples(np.arange(theirs.size()))
    same(a, b)
    assert a.discounts is not None and len(set(a.discounts.flatten().tolist())) > 1  # some windows were cut
    # the copy keeps n_steps and gamma
    copy = pickle.loads(pickle.dumps(mine))
    opened.append(copy)
    assert (copy.n_steps, copy.gamma) == (n_steps, 0.9)


def test_n_step_refusals(name: str) -> None:
    box = spaces.Box(-1, 1, (4,), np.float32)
    with pytest.raises(ValueError, match=r"n_steps: 6 is more than the 5 steps each env's rows hold"):
        ours.NStepReplayBuffer(10, box, spaces.Discrete(2), n_envs=2, n_steps=6, name=name)
    with pytest.raises(ValueError, match=r"n_steps: expected a positive int, got 0"):
        ours.NStepReplayBuffer(10, box, spaces.Discrete(2), n_steps=0, name=name)
    with pytest.raises(ValueError, match=r"gamma: expected a float in \[0, 1\], got 1.5"):
        ours.NStepReplayBuffer(10, box, spaces.Discrete(2), gamma=1.5, name=name)
    assert name not in segment.list_names()


def test_dqn_n_step_trains_as_with_sb3s_buffer(name: str) -> None:
    """DQN with 3-step returns: SB3's NStepReplayBuffer and ours give the same training run (the
    same parameters after it), so SB3 uses our discounts as its own."""
    from stable_baselines3 import DQN

    torch.set_num_threads(1)
    params = []
    for cls, kwargs in ((buffers.NStepReplayBuffer, {}), (ours.NStepReplayBuffer, {"name": name})):
        model = DQN("MlpPolicy", "CartPole-v1", buffer_size=2_000, learning_starts=100, train_freq=1, seed=3,
                    device="cpu", policy_kwargs={"net_arch": [32]}, replay_buffer_class=cls,
                    replay_buffer_kwargs={"n_steps": 3, "gamma": 0.95, **kwargs})
        try:
            model.learn(600)
        finally:
            if kwargs:
                model.replay_buffer.close()
        params.append(model.policy.state_dict())
    assert params[0].keys() == params[1].keys()
    assert all(torch.equal(params[0][k], params[1][k]) for k in params[0])


def test_dict_buffer_same_transitions(name: str, opened: list[Any]) -> None:
    obs_space = spaces.Dict({"image": spaces.Box(0, 255, (3, 4), np.uint8), "vec": spaces.Box(-1, 1, (2,), np.float32)})
    act_space = spaces.Box(-1, 1, (2,), np.float32)
    theirs = buffers.DictReplayBuffer(10, obs_space, act_space, "cpu", n_envs=2)
    mine = ours.DictReplayBuffer(10, obs_space, act_space, "cpu", n_envs=2, name=name)
    opened.append(mine)
    assert isinstance(mine, buffers.DictReplayBuffer)
    for step in adds(2, 9, obs_space, act_space, seed=3):
        theirs.add(*step)
        mine.add(*step)
    for draw in range(3):
        np.random.seed(draw)
        a = theirs.sample(16)
        np.random.seed(draw)
        same(a, mine.sample(16))


def test_vec_normalize_is_applied(name: str, opened: list[Any]) -> None:
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.vec_env import VecNormalize

    venv = VecNormalize(make_vec_env("CartPole-v1", n_envs=2, seed=0))
    venv.reset()
    for _ in range(20):
        venv.step(np.array([0, 1]))
    obs_space, act_space = venv.observation_space, venv.action_space
    theirs = buffers.ReplayBuffer(16, obs_space, act_space, "cpu", n_envs=2)
    mine = ours.ReplayBuffer(16, obs_space, act_space, "cpu", n_envs=2, name=name)
    opened.append(mine)
    for step in adds(2, 8, obs_space, act_space, seed=5):
        theirs.add(*step)
        mine.add(*step)
    np.random.seed(4)
    a = theirs.sample(8, env=venv)
    np.random.seed(4)
    b = mine.sample(8, env=venv)
    same(a, b)
    np.random.seed(4)
    raw = mine.sample(8)
    assert not torch.equal(raw.observations, b.observations)  # normalization did something
    venv.close()


def test_refusals(name: str) -> None:
    box = spaces.Box(-1, 1, (4,), np.float32)
    with pytest.raises(ValueError, match="DictReplayBuffer"):
        ours.ReplayBuffer(10, spaces.Dict({"a": box}), spaces.Discrete(2), name=name)
    with pytest.raises(ValueError, match="optimize_memory_usage"):
        ours.DictReplayBuffer(10, spaces.Dict({"a": box}), spaces.Discrete(2), optimize_memory_usage=True, name=name)
    with pytest.raises(ValueError, match="optimize_memory_usage"):
        ours.NStepReplayBuffer(10, box, spaces.Discrete(2), optimize_memory_usage=True, name=name)
    with pytest.raises(ValueError, match="stack"):
        ours.ReplayBuffer(10, box, spaces.Discrete(2), stack="obs", name=name)


def test_optimize_memory_usage_stores_observations_once_and_keeps_final_ones(name: str, opened: list[Any]) -> None:
    """With optimize_memory_usage each sampled transition is one that was added, final observations
    included (SB3's own flag returns the next episode's first observation there), in a buffer of
    about half the bytes; pickling keeps them."""
    import os

    box = spaces.Box(-10, 10, (32,), np.float32)
    mine = ours.ReplayBuffer(64, box, spaces.Discrete(2), "cpu", n_envs=2, optimize_memory_usage=True, name=name)
    opened.append(mine)
    assert mine.optimize_memory_usage
    rng = np.random.default_rng(0)
    obs, added = rng.normal(size=(2, 32)).astype(np.float32), {}
    for t in range(20):  # each env's episodes end by termination or by a time limit
        nxt = rng.normal(size=(2, 32)).astype(np.float32)
        done = np.array([t % 5 == 4, t % 7 == 6])
        infos = [{"TimeLimit.truncated": bool(d and e == 1)} for e, d in enumerate(done)]
        mine.add(obs, nxt, np.array([t, t]), np.array([t, -t], np.float32), done, infos)
        for e in range(2):
            added[(e, t)] = (obs[e].copy(), nxt[e].copy(), float(done[e] and e == 0))
        obs = np.where(done[:, None], rng.normal(size=(2, 32)).astype(np.float32), nxt)
    assert mine.size() == 19  # per env: the newest step waits for its next observation (unless it ended)
    by_obs = {o.tobytes(): (n, d) for o, n, d in added.values()}
    for m in (mine, pickle.loads(pickle.dumps(mine))):
        if m is not mine:
            opened.append(m)
        got = m.sample(256)
        for o, n, d in zip(got.observations.numpy(), got.next_observations.numpy(), got.dones.numpy(), strict=True):
            want_next, want_done = by_obs[o.tobytes()]
            assert np.array_equal(n, want_next) and d[0] == want_done
    big = spaces.Box(0, 255, (84, 84), np.uint8)
    large = [ours.ReplayBuffer(2_000, big, spaces.Discrete(2), "cpu", optimize_memory_usage=flag, name=name + f"b{flag}")
             for flag in (False, True)]
    opened += large
    size = [os.path.getsize(f"/dev/shm/shmbuffer-{b.buffer.name}") for b in large]
    assert size[1] < 0.55 * size[0]  # one 84x84 frame a row instead of two


def test_dqn_learns_with_optimize_memory_usage(name: str) -> None:
    from stable_baselines3 import DQN

    model = DQN("MlpPolicy", "CartPole-v1", buffer_size=2_000, learning_starts=100, train_freq=1, seed=3,
                replay_buffer_class=ours.ReplayBuffer, optimize_memory_usage=True,
                replay_buffer_kwargs={"handle_timeout_termination": True, "name": name})
    try:
        model.learn(400)
        assert model.replay_buffer.size() > 300 and model.replay_buffer.optimize_memory_usage
    finally:
        model.replay_buffer.close()


def test_pickle_keeps_the_rows_not_the_name(name: str, opened: list[Any]) -> None:
    box = spaces.Box(-1, 1, (4,), np.float32)
    mine = ours.ReplayBuffer(12, box, spaces.Discrete(3), "cpu", n_envs=2, name=name)
    opened.append(mine)
    for step in adds(2, 9, box, spaces.Discrete(3), seed=2):  # 9 steps into 6 slots per env: wrapped
        mine.add(*step)
    data = pickle.dumps(mine)
    mine.close()  # the original is gone: the copy must not need it
    assert name not in segment.list_names()
    copy = pickle.loads(data)
    opened.append(copy)
    assert copy.buffer.name != name and copy.full and copy.size() == 6
    theirs = buffers.ReplayBuffer(12, box, spaces.Discrete(3), "cpu", n_envs=2)
    for step in adds(2, 9, box, spaces.Discrete(3), seed=2):
        theirs.add(*step)
    # the same rows at the same positions and envs: the copy's lanes start at SB3's position 0
    # where the original's wrapped, so compare the sets of rows held
    def held(rb: Any) -> set[tuple[float, ...]]:
        np.random.seed(0)
        s = rb._get_samples(np.repeat(np.arange(6), 40))
        return set(map(tuple, torch.cat([s.observations, s.actions, s.rewards, s.dones], 1).tolist()))

    assert held(copy) == held(theirs) and len(held(theirs)) == 12


def test_model_save_and_load_replay_buffer(name: str, opened: list[Any], tmp_path: Any) -> None:
    from stable_baselines3 import DQN

    model = DQN("MlpPolicy", "CartPole-v1", buffer_size=500, learning_starts=50, replay_buffer_class=ours.ReplayBuffer,
                replay_buffer_kwargs={"name": name}, seed=0, device="cpu")
    opened.append(model.replay_buffer)
    model.learn(120)
    assert model.replay_buffer.buffer.name == name and model.replay_buffer.size() == 120
    model.save_replay_buffer(tmp_path / "rb.pkl")
    rows = model.replay_buffer.buffer.export()
    other = DQN("MlpPolicy", "CartPole-v1", buffer_size=500, replay_buffer_class=ours.ReplayBuffer,
                replay_buffer_kwargs={"name": name + "o"}, seed=0, device="cpu")
    opened.append(other.replay_buffer)
    other.load_replay_buffer(tmp_path / "rb.pkl")
    opened.append(other.replay_buffer)
    assert isinstance(other.replay_buffer, ours.ReplayBuffer) and other.replay_buffer.buffer.name not in (name, name + "o")
    loaded = other.replay_buffer.buffer.export()
    for key in ("obs", "action", "reward", "next_obs", "done", "timeouts"):
        assert np.array_equal(loaded[key], rows[key]), key
    buf = io.BytesIO()
    pickle.dump(other.replay_buffer, buf)


def test_other_processes_push_while_learning(name: str, opened: list[Any], procs: list[Any]) -> None:
    """The reason for shared memory: a collector process pushes rows into the buffer DQN learns
    from, while learn() runs; its rows are sampled and none is torn."""
    from stable_baselines3 import DQN
    from stable_baselines3.common.env_util import make_vec_env

    model = DQN("MlpPolicy", make_vec_env("CartPole-v1", n_envs=2, seed=0), buffer_size=8000, learning_starts=100,
                train_freq=1, replay_buffer_class=ours.ReplayBuffer, replay_buffer_kwargs={"name": name}, seed=0,
                device="cpu")
    rb = model.replay_buffer
    opened.append(rb)
    col = sb.Collector(lambda: gym.make("CartPole-v1"), rb.buffer, workers=1,
                       transition=lambda obs, action, reward, next_obs, terminated, truncated: {
                           "obs": obs, "action": action[:, None], "reward": reward, "next_obs": next_obs,
                           "done": terminated.astype(np.float32), "timeouts": np.zeros(len(obs), np.float32)})
    try:
        col.warm(200)
        model.learn(300)  # 150 steps of 2 envs, one lane each; the collector's env pushes into lane 0
        col.check()
        np.random.seed(0)
        s = rb.sample(2000)  # while the collector still pushes
        # every row is whole: CartPole's next_obs follows obs by one physics step (x += 0.02 * x_dot)
        assert torch.allclose(s.next_observations[:, 0], s.observations[:, 0] + 0.02 * s.observations[:, 1], atol=1e-5)
    finally:
        col.stop()
    start, stop = rb.buffer.ring.bounds()
    assert stop[1] - start[1] == 150 and stop[0] - start[0] >= 150 + 200
    assert rb.size() == 150 and rb.buffer.stats["inserted"] == stop.sum()


def test_sample_waits_for_a_row_being_written(name: str, opened: list[Any]) -> None:
    """SB3's pos counts a row that a writer elsewhere has reserved and not yet committed (a
    writer descheduled there holds it for milliseconds): sample waits for the commit and returns
    that row, instead of giving up after a few tight retries."""
    box = spaces.Box(-1, 1, (4,), np.float32)
    mine = ours.ReplayBuffer(16, box, spaces.Discrete(2), "cpu", name=name)
    opened.append(mine)
    for step in adds(1, 5, box, spaces.Discrete(2), seed=0):
        mine.add(*step)
    ring = mine.buffer.ring
    res = ring.reserve(1)  # row 5, odd: a writer between reserving and committing it
    assert mine.pos == 6
    timer = threading.Timer(0.2, ring.commit, args=(res,))
    timer.start()
    try:
        t0 = time.monotonic()
        s = mine._get_samples(np.array([5, 0]))
        waited = time.monotonic() - t0
    finally:
        timer.join()
    assert waited >= 0.15  # returned only once the row was committed
    assert torch.equal(s.observations[0], torch.zeros(4))  # that row: never written, so zeros
    assert not torch.equal(s.observations[1], torch.zeros(4))


def _dqn_eval(replay_buffer_class: Any, kwargs: dict[str, Any], seed: int, steps: int = 8_000) -> float:
    from stable_baselines3 import DQN
    from stable_baselines3.common.evaluation import evaluate_policy

    model = DQN("MlpPolicy", "CartPole-v1", learning_rate=1e-3, buffer_size=10_000, learning_starts=500,
                batch_size=64, train_freq=4, target_update_interval=250, exploration_fraction=0.3,
                exploration_final_eps=0.05, policy_kwargs={"net_arch": [64, 64]}, seed=seed, device="cpu",
                replay_buffer_class=replay_buffer_class, replay_buffer_kwargs=kwargs)
    if steps:
        model.learn(steps)
    mean, _ = evaluate_policy(model, model.get_env(), n_eval_episodes=10, deterministic=True)
    if replay_buffer_class is not None:
        model.replay_buffer.close()
    return float(mean)


def test_dqn_learns_the_same_as_with_sb3s_buffer(name: str) -> None:
    """Same seeds, same hyperparameters, SB3's buffer and ours: since sampling consumes
    np.random identically and returns the same transitions, training is the same run, so the
    evaluation returns are equal (one process, one thread: torch's CPU kernels are deterministic);
    and it did learn: better than the same network untrained."""
    torch.set_num_threads(1)
    theirs = _dqn_eval(None, {}, seed=1)
    mine = _dqn_eval(ours.ReplayBuffer, {"name": name}, seed=1)
    untrained = _dqn_eval(None, {}, seed=1, steps=0)
    assert mine == theirs
    assert theirs > 2 * untrained


@pytest.mark.parametrize("algo", ["SAC", "TD3"])
def test_sac_and_td3_train_on_it(algo: str, name: str) -> None:
    """Continuous actions through SB3's own training loop; the rows are the env's transitions."""
    import stable_baselines3

    cls = getattr(stable_baselines3, algo)
    model = cls("MlpPolicy", "Pendulum-v1", buffer_size=1_000, learning_starts=50, batch_size=32, seed=0,
                device="cpu", policy_kwargs={"net_arch": [16]}, replay_buffer_class=ours.ReplayBuffer,
                replay_buffer_kwargs={"name": name})
    try:
        model.learn(120)
        assert model.replay_buffer.size() == 120 and model.logger.name_to_value["train/actor_loss"] != 0
        rows = model.replay_buffer.buffer.get(slice(None))
        assert rows.action.shape == (120, 1) and rows.obs.shape == (120, 3)
        # Pendulum's obs is (cos, sin, theta_dot): every row's obs and next_obs lie on the circle
        assert np.allclose(rows.obs[:, 0] ** 2 + rows.obs[:, 1] ** 2, 1, atol=1e-5)
        assert np.allclose(rows.next_obs[:, 0] ** 2 + rows.next_obs[:, 1] ** 2, 1, atol=1e-5)
        assert (rows.obs[1:] == rows.next_obs[:-1])[~rows.done[:-1].astype(bool) & ~rows.timeouts[:-1].astype(bool)].all()
    finally:
        model.replay_buffer.close()


def test_optimize_memory_usage_says_when_nothing_can_be_sampled(name: str, opened: list[Any]) -> None:
    box = spaces.Box(-1, 1, (3,), np.float32)
    mine = ours.ReplayBuffer(32, box, spaces.Discrete(2), "cpu", optimize_memory_usage=True, name=name)
    opened.append(mine)
    with pytest.raises(sb.EmptyBufferError, match="0 whole transitions"):
        mine.sample(4)
    mine.add(np.zeros((1, 3), np.float32), np.ones((1, 3), np.float32), np.array([0]), np.array([1.0]),
             np.array([False]), [{}])
    with pytest.raises(sb.EmptyBufferError, match="0 whole transitions"):  # its next observation is not in yet
        mine.sample(4)
    mine.add(np.ones((1, 3), np.float32), np.full((1, 3), 2, np.float32), np.array([1]), np.array([1.0]),
             np.array([True]), [{}])
    assert mine.size() == 2 and mine.sample(4).observations.shape == (4, 3)


# -- SB3's public arrays, pos and full (SB3's own tests read and write them) ----------------------

ARRAYS = ("observations", "next_observations", "actions", "rewards", "dones", "timeouts")


@pytest.mark.parametrize("case", sorted(CASES))
def test_arrays_are_sb3s(case: str, name: str, opened: list[Any]) -> None:
    """After the same adds, every SB3 array has SB3's shape, dtype and values (several envs, a
    wrapped buffer, float64 actions stored as float32, Discrete observations), and pos and full
    are SB3's after each add."""
    obs_space, act_space, n_envs, size, steps = CASES[case]
    theirs = buffers.ReplayBuffer(size, obs_space, act_space, "cpu", n_envs=n_envs)
    mine = ours.ReplayBuffer(size, obs_space, act_space, "cpu", n_envs=n_envs, name=name)
    opened.append(mine)
    for step in adds(n_envs, steps, obs_space, act_space, seed=len(case)):
        theirs.add(*step)
        mine.add(*step)
        assert (mine.pos, mine.full) == (theirs.pos, theirs.full)
    for attr in ARRAYS:
        a, b = getattr(theirs, attr), getattr(mine, attr)
        assert (b.shape, b.dtype) == (a.shape, a.dtype), attr
        assert np.array_equal(a, b), attr


def test_arrays_are_live_views_of_the_shared_columns(name: str, opened: list[Any]) -> None:
    """A row pushed through another handle (another process's collector) is in the array already
    taken: lane e's slot p is position p of env e."""
    box = spaces.Box(-1, 1, (3,), np.float32)
    mine = ours.ReplayBuffer(8, box, spaces.Discrete(2), "cpu", n_envs=2, name=name)
    opened.append(mine)
    rewards, obs = mine.rewards, mine.observations
    with sb.ReplayBuffer.attach(mine.buffer.handle) as other:
        other.push({"obs": np.full((2, 3), 7, np.float32), "next_obs": np.zeros((2, 3), np.float32),
                    "action": np.array([[0], [1]]), "reward": np.array([1.5, 2.5], np.float32),
                    "done": np.zeros(2, np.float32), "timeouts": np.zeros(2, np.float32)})
    assert rewards.tolist()[0] == [1.5, 2.5] and (obs[0] == 7).all()
    assert mine.pos == 1 and not np.shares_memory(mine.rewards.copy(), rewards)
    assert np.shares_memory(rewards, mine.buffer.block.fields["reward"])


def test_dict_arrays_are_sb3s(name: str, opened: list[Any]) -> None:
    obs_space = spaces.Dict({"image": spaces.Box(0, 255, (3, 4), np.uint8), "vec": spaces.Box(-1, 1, (2,), np.float64)})
    act_space = spaces.Box(-1, 1, (2, 3), np.float64)
    theirs = buffers.DictReplayBuffer(6, obs_space, act_space, "cpu", n_envs=2)
    mine = ours.DictReplayBuffer(6, obs_space, act_space, "cpu", n_envs=2, name=name)
    opened.append(mine)
    for step in adds(2, 5, obs_space, act_space, seed=4):  # 5 steps into 3 positions: wrapped
        theirs.add(*step)
        mine.add(*step)
    for attr in ("observations", "next_observations"):
        a, b = getattr(theirs, attr), getattr(mine, attr)
        assert a.keys() == b.keys()
        for k in a:
            assert (b[k].shape, b[k].dtype) == (a[k].shape, a[k].dtype) and np.array_equal(a[k], b[k]), (attr, k)
    for attr in ("actions", "rewards", "dones", "timeouts"):
        a, b = getattr(theirs, attr), getattr(mine, attr)
        assert (b.shape, b.dtype) == (a.shape, a.dtype) and np.array_equal(a, b), attr
    mine.observations["vec"][0, 1] = [0.5, -0.5]  # a write into a dict observation goes to its field
    theirs.observations["vec"][0, 1] = [0.5, -0.5]
    np.random.seed(0)
    a = theirs._get_samples(np.array([0, 0, 0, 0]))
    np.random.seed(0)
    same(a, mine._get_samples(np.array([0, 0, 0, 0])))


@pytest.mark.parametrize("dict_obs", [False, True])
def test_full_set_by_hand_reads_the_arrays_as_they_are(dict_obs: bool, name: str, opened: list[Any]) -> None:
    """SB3's own dtype test: ``full = True`` on an empty buffer samples every position, which holds
    zeros of the field's dtype, as SB3's arrays do; reset() forgets it."""
    box = spaces.Box(0, 100, dtype=np.uint16)
    obs_space = spaces.Dict({"o": box}) if dict_obs else box
    cls, theirs_cls = (ours.DictReplayBuffer, buffers.DictReplayBuffer) if dict_obs else (ours.ReplayBuffer, buffers.ReplayBuffer)
    act = spaces.Box(-1, 1, (2,), np.float64)
    mine = cls(4, obs_space, act, "cpu", name=name)
    opened.append(mine)
    theirs = theirs_cls(4, obs_space, act, "cpu")
    with pytest.raises(sb.EmptyBufferError):
        mine.sample(3)
    mine.full = theirs.full = True
    assert mine.full and mine.size() == 4
    np.random.seed(2)
    a = theirs.sample(16)
    np.random.seed(2)
    same(a, mine.sample(16))
    mine.reset()
    assert not mine.full and mine.size() == 0


def test_full_false_by_hand_counts_up_to_pos_until_the_next_wrap(name: str, opened: list[Any]) -> None:
    box = spaces.Box(-1, 1, (2,), np.float32)
    theirs = buffers.ReplayBuffer(4, box, spaces.Discrete(2), "cpu")
    mine = ours.ReplayBuffer(4, box, spaces.Discrete(2), "cpu", name=name)
    opened.append(mine)
    steps = adds(1, 11, box, spaces.Discrete(2), seed=1)
    for step in steps[:5]:
        theirs.add(*step)
        mine.add(*step)
    mine.full = theirs.full = False
    for step in steps[5:]:
        assert (mine.pos, mine.full, mine.size()) == (theirs.pos, theirs.full, theirs.size())
        theirs.add(*step)
        mine.add(*step)
    assert (mine.pos, mine.full, mine.size()) == (theirs.pos, theirs.full, theirs.size())
    with pytest.raises(TypeError, match="full: expected a bool"):
        mine.full = "yes"  # type: ignore[assignment]


def test_pos_is_the_lanes_next_slot(name: str, opened: list[Any]) -> None:
    box = spaces.Box(-1, 1, (2,), np.float32)
    mine = ours.ReplayBuffer(6, box, spaces.Discrete(2), "cpu", n_envs=2, name=name)
    opened.append(mine)
    for step in adds(2, 4, box, spaces.Discrete(2), seed=1):
        mine.add(*step)
    assert mine.pos == 1 and mine.full
    mine.pos = 1  # SB3's own value: nothing moves
    with pytest.raises(ValueError, match=r"pos: .* cannot be moved to 2"):
        mine.pos = 2
    assert mine.pos == 1
    mine.reset()
    assert (mine.pos, mine.full, mine.size()) == (0, False, 0)
    mine.add(*adds(2, 1, box, spaces.Discrete(2), seed=2)[0])
    assert mine.pos == 1 and mine.observations[0].tolist() == mine.buffer.get(slice(None)).obs.tolist()


def test_writes_through_the_arrays_are_sb3s(name: str, opened: list[Any]) -> None:
    """SB3's writes (``dones[pos - 1, :] = True`` in its n-step test, a whole column, one element)
    land where SB3's do and are what the next samples read."""
    box = spaces.Box(-1, 1, (3,), np.float32)
    kw = {"n_envs": 2, "n_steps": 3, "gamma": 0.9}
    theirs = buffers.NStepReplayBuffer(12, box, spaces.Discrete(2), "cpu", **kw)
    mine = ours.NStepReplayBuffer(12, box, spaces.Discrete(2), "cpu", name=name, **kw)
    opened.append(mine)
    for step in adds(2, 8, box, spaces.Discrete(2), seed=5):  # wrapped: 8 steps into 6 positions
        theirs.add(*step)
        mine.add(*step)
    for rb in (theirs, mine):
        rb.dones[rb.pos - 1, :] = True
        rb.rewards[:, 1] = np.arange(6)
        rb.observations[2, 0, 1] = 9.0
        rb.timeouts[rb.pos] = 0
        rb.actions = np.ones((6, 2, 1), np.int64)  # SB3 replaces the array; ours writes its values
    for attr in ARRAYS:
        assert np.array_equal(getattr(theirs, attr), getattr(mine, attr)), attr
    np.random.seed(3)
    a = theirs._get_samples(np.arange(6))
    np.random.seed(3)
    same(a, mine._get_samples(np.arange(6)))


def test_a_write_is_an_update_under_the_commit_protocol(name: str, opened: list[Any]) -> None:
    """A write through an array rewrites each row it touches as ``buffer.update`` does: the row's
    stamp turns odd and even again and the update count moves, so a reader whose copy spans it
    reads the row again (never half a row); a row overwritten since keeps what its writer pushed."""
    from shmbuffer.protocol.layout import Counter

    box = spaces.Box(-1, 1, (64,), np.float32)
    mine = ours.ReplayBuffer(4, box, spaces.Discrete(2), "cpu", name=name)
    opened.append(mine)
    for step in adds(1, 3, box, spaces.Discrete(2), seed=6):
        mine.add(*step)
    counters = mine.buffer.block.counters
    before, stamps = int(counters[Counter.UPDATES]), mine.buffer.ring.stamp.copy()
    mine.observations[1] = 0.25
    assert int(counters[Counter.UPDATES]) == before + 1
    assert np.array_equal(mine.buffer.ring.stamp, stamps)  # committed again, as before
    assert (mine.buffer.get(1).obs == 0.25).all()


def test_writes_to_positions_without_a_row_stay_as_in_sb3(name: str, opened: list[Any]) -> None:
    box = spaces.Box(-1, 1, (2,), np.float32)
    mine = ours.ReplayBuffer(4, box, spaces.Discrete(2), "cpu", name=name)
    opened.append(mine)
    mine.rewards[2, 0] = 5.0  # no row there yet: stored as SB3 stores it
    assert mine.rewards[2, 0] == 5.0 and len(mine.buffer) == 0
    for step in adds(1, 3, box, spaces.Discrete(2), seed=0):
        mine.add(*step)
    assert mine.rewards[2, 0] == step[3][0]  # the row pushed there replaced it


def test_bad_writes_say_what_and_change_nothing(name: str, opened: list[Any]) -> None:
    box = spaces.Box(-1, 1, (2,), np.float32)
    mine = ours.ReplayBuffer(8, box, spaces.Discrete(2), "cpu", n_envs=2, name=name)
    opened.append(mine)
    for step in adds(2, 3, box, spaces.Discrete(2), seed=0):
        mine.add(*step)
    rows = mine.buffer.export()
    with pytest.raises(ValueError, match=r"done\[0\] = \.\.\.: expected values of shape \(2,\)"):
        mine.dones[0] = np.ones(3)
    with pytest.raises(IndexError, match=r"reward: index 9 does not fit SB3's array of shape \(4, 2\)"):
        mine.rewards[9] = 1.0
    with pytest.raises(ValueError, match="read-only"):
        mine.dones[0][0] = 1.0  # a slice is a read-only view: only the array itself writes
    with pytest.raises(ValueError, match="read-only"):
        mine.dones += 1
    after = mine.buffer.export()
    assert all(np.array_equal(rows[k], after[k]) for k in rows)


def test_pickle_keeps_positions_and_arrays(name: str, opened: list[Any]) -> None:
    """A copy (SB3's deepcopy, save_replay_buffer) has the same arrays, pos and full as the
    original, wrapped or not, and goes on as SB3's buffer would."""
    import copy as copying

    box = spaces.Box(-1, 1, (3,), np.float32)
    theirs = buffers.ReplayBuffer(10, box, spaces.Discrete(3), "cpu", n_envs=2)
    mine = ours.ReplayBuffer(10, box, spaces.Discrete(3), "cpu", n_envs=2, name=name)
    opened.append(mine)
    steps = adds(2, 12, box, spaces.Discrete(3), seed=2)
    for k, step in enumerate(steps[:7]):
        theirs.add(*step)
        mine.add(*step)
        if k in (2, 6):  # not wrapped, then wrapped
            twin = copying.deepcopy(mine)
            opened.append(twin)
            assert twin.buffer.name != mine.buffer.name
            assert (twin.pos, twin.full, twin.size()) == (theirs.pos, theirs.full, theirs.size())
            for attr in ARRAYS:
                assert np.array_equal(getattr(twin, attr), getattr(theirs, attr)), attr
    for step in steps[7:]:
        theirs.add(*step)
        twin.add(*step)
    np.random.seed(5)
    a = theirs.sample(20)
    np.random.seed(5)
    same(a, twin.sample(20))


def test_dqn_learns_twice_with_optimize_memory_usage(name: str) -> None:
    """The issue's case: SB3 truncates the last trajectory before a second learn() by writing
    ``replay_buffer.dones[pos - 1] = True``; that ends every env's episode in its lane, so the
    reset env's first step starts a new one (and no transition crosses the two runs)."""
    from stable_baselines3 import DQN

    model = DQN("MlpPolicy", "CartPole-v1", buffer_size=100, learning_starts=10, optimize_memory_usage=True,
                seed=0, device="cpu", replay_buffer_class=ours.ReplayBuffer,
                replay_buffer_kwargs={"handle_timeout_termination": False, "name": name})
    rb = model.replay_buffer
    try:
        model.learn(50)
        at = (rb.pos - 1) % rb.buffer_size
        newest = rb.observations[at, 0].copy()  # the newest step, not an episode's end
        assert rb.dones[at, 0] == 0 and rb.buffer.block.fields["_kind"][at] == 0
        with pytest.warns(UserWarning, match="last trajectory in the replay buffer will be truncated"):
            model.learn(50)
        assert rb.full and rb.size() > 50
        s = rb.sample(2000)
        # the cut step is never drawn: its next observation is not the next run's first one
        cut = (s.observations == torch.as_tensor(newest)).all(dim=1)
        assert not cut.any()
        obs, done = rb.buffer.block.fields["obs"], rb.buffer.block.fields["done"]
        assert done[np.flatnonzero((obs == newest).all(axis=1))].tolist() == [1.0]
        del obs, done
    finally:
        rb.close()


def test_optimize_memory_usage_dones_at_pos_is_every_envs_newest_row(name: str, opened: list[Any]) -> None:
    """With optimize_memory_usage lanes also hold end rows, so their cursors differ; SB3's
    ``dones[(pos - 1) % buffer_size] = True`` still marks each env's newest step, and each env's
    next add starts an episode instead of being refused as not continuing the lane."""
    box = spaces.Box(-10, 10, (3,), np.float32)
    mine = ours.ReplayBuffer(32, box, spaces.Discrete(2), "cpu", n_envs=2, optimize_memory_usage=True, name=name)
    opened.append(mine)
    rng = np.random.default_rng(0)
    obs = rng.normal(size=(2, 3)).astype(np.float32)
    for t in range(5):
        nxt = rng.normal(size=(2, 3)).astype(np.float32)
        done = np.array([t == 1, False])  # env 0 ends an episode: its lane gets an end row
        mine.add(obs, nxt, np.array([0, 1]), np.ones(2, np.float32), done, [{}, {}])
        obs = np.where(done[:, None], rng.normal(size=(2, 3)).astype(np.float32), nxt)
    assert mine.buffer.ring.bounds()[1].tolist() == [6, 5]
    at = (mine.pos - 1) % mine.buffer_size
    mine.dones[at] = True
    assert mine.dones[at].tolist() == [1.0, 1.0]
    done = mine.buffer.block.fields["done"]
    assert done[[5, 16 + 4]].tolist() == [1.0, 1.0] and done.sum() == 1 + 2  # each lane's newest row, and env 0's end
    fresh = rng.normal(size=(2, 3)).astype(np.float32)  # the envs were reset
    mine.add(fresh, fresh + 1, np.array([0, 1]), np.ones(2, np.float32), np.array([False, False]), [{}, {}])
    got = mine.sample(500)
    assert not (got.next_observations == torch.as_tensor(fresh)[:, None]).all(dim=2).any()  # nothing crosses


def test_extend_with_sb3s_arrays(name: str, opened: list[Any]) -> None:
    """SB3's save/load test refills a buffer with ``extend(old.observations, ..., infos)``: each
    add gets one env's rows and a time-limit flag that is an array of one."""
    box = spaces.Box(-1, 1, (3,), np.float32)
    src = buffers.ReplayBuffer(6, box, spaces.Discrete(2), "cpu")
    for step in adds(1, 6, box, spaces.Discrete(2), seed=8):
        src.add(*step)
    infos = [[{"TimeLimit.truncated": t}] for t in src.timeouts]
    theirs = buffers.ReplayBuffer(6, box, spaces.Discrete(2), "cpu")
    mine = ours.ReplayBuffer(6, box, spaces.Discrete(2), "cpu", name=name)
    opened.append(mine)
    for rb in (theirs, mine):
        rb.extend(src.observations, src.next_observations, src.actions, src.rewards, src.dones, infos)
    assert src.timeouts.any()
    for attr in ARRAYS:
        assert np.array_equal(getattr(theirs, attr), getattr(mine, attr)), attr


def test_sample_reads_the_positions_again_when_a_writer_laps_them(name: str, opened: list[Any]) -> None:
    """A writer elsewhere overwrites drawn positions between the draw and the read: the positions
    are looked up again (the newest row in each slot), not read forever under their old ids
    (which raised after WAIT seconds under a collector lapping the lanes)."""
    box = spaces.Box(-1, 1, (4,), np.float32)
    mine = ours.ReplayBuffer(8, box, spaces.Discrete(2), "cpu", name=name)
    opened.append(mine)
    steps = adds(1, 16, box, spaces.Discrete(2), seed=0)
    for step in steps[:8]:
        mine.add(*step)
    take = mine.buffer.take
    lapped: list[int] = []

    def lapping_take(ids: Any) -> Any:
        if not lapped:  # once: another writer comes round the whole lane first
            for step in steps[8:]:
                mine.add(*step)
            lapped.append(1)
        return take(ids)

    mine.buffer.take = lapping_take  # type: ignore[method-assign]
    t0 = time.monotonic()
    np.random.seed(1)
    got = mine.sample(32)
    assert time.monotonic() - t0 < ours.WAIT and lapped
    newest = np.stack([np.asarray(s[0]).reshape(4) for s in steps[8:]])
    assert all((newest == row).all(axis=1).any() for row in got.observations.numpy())


def test_optimize_memory_usage_round_trips_lose_nothing(name: str, opened: list[Any], tmp_path: Any) -> None:
    """Pickling, deepcopy and save_replay_buffer/load_replay_buffer of an optimize_memory_usage
    buffer keep every transition it could sample, however many times, and each env's newest step,
    still waiting for the env's next add, with the next observation it was added with: the copy
    goes on from it as the original does."""
    import copy as copying

    from stable_baselines3 import DQN

    box = spaces.Box(-10, 10, (3,), np.float32)
    mine = ours.ReplayBuffer(64, box, spaces.Discrete(2), "cpu", n_envs=2, optimize_memory_usage=True, name=name)
    opened.append(mine)
    obs = np.zeros((2, 3), np.float32)
    for t in range(13):
        nxt = np.stack([np.full(3, 100 * e + t + 1, np.float32) for e in range(2)])
        mine.add(obs, nxt, np.array([0, 1]), np.array([t, t], np.float32), np.array([False, t == 6]), [{}, {}])
        obs = nxt
    want = {(o.tobytes(), n.tobytes()) for o, n in zip(*(mine.buffer.export()[k] for k in ("obs", "next_obs")), strict=True)}
    assert len(want) == 24 and mine.size() == 12  # per env the newest step waits for its next observation

    def pairs(rb: Any) -> set[tuple[bytes, bytes]]:
        got = rb.sample(2000)
        return {(o.tobytes(), n.tobytes()) for o, n in zip(got.observations.numpy(), got.next_observations.numpy(),
                                                           strict=True)}

    model = DQN("MlpPolicy", "CartPole-v1", buffer_size=64, seed=0, device="cpu")
    rb = mine
    for trip in range(3):
        for how in ("pickle", "deepcopy", "save"):
            if how == "pickle":
                rb = pickle.loads(pickle.dumps(rb))
            elif how == "deepcopy":
                rb = copying.deepcopy(rb)
            else:
                model.replay_buffer = rb
                model.save_replay_buffer(tmp_path / "rb.pkl")
                model.load_replay_buffer(tmp_path / "rb.pkl")
                rb = model.replay_buffer
            opened.append(rb)
            assert rb.size() == 12, (trip, how)
            assert pairs(rb) == want, (trip, how)
    # each env's newest step went along with its next observation: the copy goes on from it as
    # the original does (the next add continues it), and both hold the same transitions
    nxt = np.full((2, 3), 7.5, np.float32)
    for buf in (mine, rb):
        buf.add(obs, nxt, np.array([0, 1]), np.zeros(2, np.float32), np.ones(2, bool), [{}, {}])
    assert rb.size() == mine.size() == 14 and pairs(rb) == pairs(mine) > want


@pytest.mark.parametrize("kind", ["plain", "optimize_memory_usage", "dict"])
def test_sample_of_zero_is_an_empty_batch_as_in_sb3(kind: str, name: str, opened: list[Any]) -> None:
    box = spaces.Box(-1, 1, (3,), np.float32)
    space = spaces.Dict({"a": box}) if kind == "dict" else box
    cls = ours.DictReplayBuffer if kind == "dict" else ours.ReplayBuffer
    mine = cls(16, space, spaces.Discrete(2), "cpu", optimize_memory_usage=kind == "optimize_memory_usage", name=name)
    opened.append(mine)
    obs = {"a": np.zeros((1, 3), np.float32)} if kind == "dict" else np.zeros((1, 3), np.float32)
    mine.add(obs, obs, np.array([0]), np.array([1.0]), np.array([True]), [{}])
    got = mine.sample(0)
    observations = got.observations["a"] if kind == "dict" else got.observations
    assert observations.shape == (0, 3) and got.actions.shape[0] == 0 and got.rewards.shape == (0, 1)


def test_an_optimize_memory_usage_buffer_pickles_after_reset(name: str, opened: list[Any]) -> None:
    """A copy of an emptied ``optimize_memory_usage`` buffer (``reset()``) is an empty buffer that
    goes on (its unpickling failed with ``KeyError: 'episode'``)."""
    import copy as copying

    box = spaces.Box(-10, 10, (3,), np.float32)
    mine = ours.ReplayBuffer(16, box, spaces.Discrete(2), "cpu", n_envs=2, optimize_memory_usage=True, name=name)
    opened.append(mine)
    obs = np.zeros((2, 3), np.float32)
    mine.add(obs, obs + 1, np.array([0, 1]), np.zeros(2, np.float32), np.array([False, True]), [{}, {}])
    mine.reset()
    twin = copying.deepcopy(mine)
    opened.append(twin)
    assert twin.size() == 0
    for t in range(3):
        twin.add(obs + t, obs + t + 1, np.array([0, 1]), np.zeros(2, np.float32), np.zeros(2, bool), [{}, {}])
    assert twin.size() == 2 and twin.sample(4).observations.shape == (4, 3)


def test_a_copy_after_reset_keeps_the_arrays_where_no_row_is(name: str, opened: list[Any]) -> None:
    """After ``reset()`` SB3's arrays keep their old values past ``pos`` (SB3 reads them when
    ``full`` is set by hand); a copy (pickle, deepcopy) has the same arrays and samples the same
    (they came back as zeros)."""
    import copy as copying

    box = spaces.Box(-1, 1, (3,), np.float32)
    theirs = buffers.ReplayBuffer(10, box, spaces.Discrete(3), "cpu", n_envs=2)
    mine = ours.ReplayBuffer(10, box, spaces.Discrete(3), "cpu", n_envs=2, name=name)
    opened.append(mine)
    steps = adds(2, 9, box, spaces.Discrete(3), seed=4)
    for k, step in enumerate(steps):
        theirs.add(*step)
        mine.add(*step)
        if k == 6:
            theirs.reset()
            mine.reset()
    theirs.full = mine.full = True
    twin = copying.deepcopy(pickle.loads(pickle.dumps(mine)))
    opened.append(twin)
    assert (twin.pos, twin.full) == (theirs.pos, theirs.full)
    for attr in ARRAYS:
        assert np.array_equal(getattr(twin, attr), getattr(theirs, attr)), attr
    np.random.seed(3)
    a = theirs.sample(40)
    np.random.seed(3)
    same(a, twin.sample(40))


@pytest.mark.parametrize("once", [False, True])
def test_a_copy_whose_rows_are_refused_leaves_no_shared_buffer(once: bool, name: str, opened: list[Any]) -> None:
    """Unpickling rows the new buffer refuses (a damaged or hand-made state) raises and removes the
    shared buffer it had made (it stayed in /dev/shm until the half-made object was collected)."""
    box = spaces.Box(-10, 10, (3,), np.float32)
    mine = ours.ReplayBuffer(16, box, spaces.Discrete(2), "cpu", n_envs=2, optimize_memory_usage=once, name=name)
    opened.append(mine)
    obs = np.zeros((2, 3), np.float32)
    for t in range(3):
        mine.add(obs + t, obs + t + 1, np.array([0, 1]), np.zeros(2, np.float32), np.zeros(2, bool), [{}, {}])
    state = mine.__getstate__()
    state["rows"]["obs"] = state["rows"]["obs"][:, :2]  # a field of another shape
    def made_here() -> set[str]:  # this process's unnamed buffers (segment.new_name): not another worker's
        return {n for n in segment.list_names() if n.startswith(f"{os.getpid()}-")}

    before = made_here()
    copy = object.__new__(ours.ReplayBuffer)
    with pytest.raises(sb.FieldError):
        copy.__setstate__(state)
    assert made_here() == before


# -- the global generator: touched only where SB3's own buffer draws from it ------------------------


def chained(n_envs: int, steps: int, width: int, seed: int, timeouts: bool = True) -> list[tuple[Any, ...]]:
    """SB3 ``add`` arguments of episodes: each env's next obs is its next step's obs until the
    episode ends (as optimize_memory_usage needs), every env ending now and then; drawn with a
    generator of their own (np.random left alone)."""
    rng = np.random.default_rng(seed)
    obs = rng.normal(size=(n_envs, width)).astype(np.float32)
    out = []
    for t in range(steps):
        nxt = rng.normal(size=(n_envs, width)).astype(np.float32)
        done = (rng.random(n_envs) < 0.2) | (np.arange(n_envs) == t % 7)
        infos = [{"TimeLimit.truncated": bool(timeouts and d and (t + i) % 2 == 0)} for i, d in enumerate(done)]
        out.append((obs, nxt, rng.integers(0, 3, n_envs), rng.normal(size=n_envs).astype(np.float32), done, infos))
        obs = np.where(done[:, None], rng.normal(size=(n_envs, width)).astype(np.float32), nxt)
    return out


def same_state(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    """Two ``np.random.get_state()`` the same: the same generator position."""
    return a[0] == b[0] and np.array_equal(a[1], b[1]) and a[2:] == b[2:]


@pytest.mark.parametrize("kind", ["plain", "optimize_memory_usage", "dict", "n_step"])
def test_making_and_adding_leave_np_random_alone(kind: str, name: str, opened: list[Any]) -> None:
    """SB3's buffers draw from np.random in sample() only: a draw when the buffer is made shifts
    every later one (an algorithm's exploration) from the run on SB3's buffer."""
    box, act = spaces.Box(-1, 1, (4,), np.float32), spaces.Discrete(3)
    space = spaces.Dict({"a": box}) if kind == "dict" else box
    np.random.seed(5)
    before = np.random.get_state()
    if kind == "dict":
        mine = ours.DictReplayBuffer(24, space, act, "cpu", n_envs=2, name=name)
    elif kind == "n_step":
        mine = ours.NStepReplayBuffer(24, space, act, "cpu", n_envs=2, name=name)
    else:
        mine = ours.ReplayBuffer(24, space, act, "cpu", n_envs=2, optimize_memory_usage=kind != "plain",
                                 handle_timeout_termination=True, name=name)
    opened.append(mine)
    assert same_state(np.random.get_state(), before)
    for obs, nxt, *rest in chained(2, 30, 4, seed=3):  # past a wrap, episodes ending
        mine.add({"a": obs} if kind == "dict" else obs, {"a": nxt} if kind == "dict" else nxt, *rest)
    assert same_state(np.random.get_state(), before)
    mine.reset()
    assert same_state(np.random.get_state(), before)


@pytest.mark.parametrize("once", [False, True])
@pytest.mark.parametrize("n_envs", [1, 3])
def test_sample_draws_from_np_random_what_sb3s_sample_draws(once: bool, n_envs: int, name: str,
                                                            opened: list[Any]) -> None:
    """After SB3's sample and ours from the same np.random state, np.random is in the same state:
    a seeded run on our buffer sees the same global stream as on SB3's (with optimize_memory_usage
    too, whose transitions are drawn by the shared buffer's generator: the positions SB3 would
    draw are drawn all the same, bounded by SB3's own pos and full, which episodes' end rows do
    not move), also in a pickled copy."""
    box, act = spaces.Box(-1, 1, (4,), np.float32), spaces.Discrete(3)
    size = 8 * n_envs
    theirs = buffers.ReplayBuffer(size, box, act, "cpu", n_envs=n_envs, optimize_memory_usage=once,
                                  handle_timeout_termination=not once)
    mine = ours.ReplayBuffer(size, box, act, "cpu", n_envs=n_envs, optimize_memory_usage=once,
                             handle_timeout_termination=not once, name=name)
    opened.append(mine)
    checked, differed = 0, False
    for t, step in enumerate(chained(n_envs, 20, 4, seed=n_envs, timeouts=not once)):  # past a wrap (8 steps an env)
        theirs.add(*step)
        mine.add(*step)
        differed |= (mine.pos, mine.full) != (theirs.pos, theirs.full)
        if t < 2:  # with optimize_memory_usage SB3 samples once pos > 0; ours once a whole transition is in
            continue
        for seed in (t, t + 100):
            for batch in (1, 5, 64):
                np.random.seed(seed)
                theirs.sample(batch)
                after_theirs = np.random.get_state()
                np.random.seed(seed)
                mine.sample(batch)
                assert same_state(np.random.get_state(), after_theirs), (t, seed, batch)
                checked += 1
    assert theirs.full and checked == 18 * 6
    # with optimize_memory_usage the end rows of episodes moved the shared lanes on further than
    # SB3's pos: bounds from our pos and full would have drawn otherwise
    assert differed == once
    copy = pickle.loads(pickle.dumps(mine))
    opened.append(copy)
    np.random.seed(9)
    theirs.sample(32)
    after_theirs = np.random.get_state()
    np.random.seed(9)
    copy.sample(32)
    assert same_state(np.random.get_state(), after_theirs)
