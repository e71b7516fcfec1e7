"""Lanes and envs: a vector env's steps pushed one lane per env keep each env's steps
consecutive, so n-step returns, sequences and groups never silently degrade (ring.py, layout.py)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

import shmbuffer as sb

from .conftest import MUJOCO, STEP, transition

Make = Callable[..., sb.ReplayBuffer]




def vector_steps(envs: int, steps: int, episode_len: int = 1000) -> list[tuple[dict[str, np.ndarray], np.ndarray]]:
    """``steps`` steps of ``envs`` envs, env-major per step (a vector env's step), with each env's
    own episode id; obs of env e at step t is ``e * 1000 + t``."""
    out = []
    for t in range(steps):
        e = np.arange(envs)
        obs = (e * 1000 + t).astype(np.float32)[:, None].repeat(3, 1)
        rows = {"obs": obs, "action": e, "reward": np.ones(envs, np.float32), "next_obs": obs + 1,
                "done": np.zeros(envs, bool)}
        out.append((rows, (e << 32) | (t // episode_len)))
    return out


def test_vector_env_into_one_lane_refuses_windows(make: Make, name: str) -> None:
    """The measured trap: 4 envs pushed per step into the default single lane made every n-step
    transition 1 step long (512 of 512). Now every window sampler refuses, naming the fix."""
    buf = make(STEP, capacity=400, episodes=True, name=name, seed=0)
    for rows, episode in vector_steps(4, 50):
        buf.push(rows, episode=episode)
    for call in (lambda: buf.sample(64, n_step=3), lambda: buf.sample_sequences(8, 4),
                 lambda: buf.sample_groups(4, 3), lambda: buf.sample_episodes(1)):
        with pytest.raises(sb.FieldError, match=r"interleaved in one lane.*envs=N.*lane="):
            call()
    assert len(buf.sample(64)) == 64  # one-step sampling is still fine
    other = sb.ReplayBuffer.attach(name)  # every process sees it: the flag is shared
    try:
        with pytest.raises(sb.FieldError, match="interleaved") as caught:
            other.sample(4, n_step=2)
        del caught  # its frames hold the attached block's arrays
    finally:
        other.close()


def test_envs_option_makes_vector_pushes_one_lane_per_env(make: Make, name: str) -> None:
    buf = make(STEP, capacity=400, episodes=True, envs=4, name=name, seed=0)
    assert buf.lanes == 4 and buf.options.envs == 4
    for rows, episode in vector_steps(4, 50):
        buf.push(rows, episode=episode)
    batch = buf.sample(512, n_step=3, gamma=0.5)
    assert (batch.steps == 3).sum() > 400  # all but the newest two steps of each env
    full = batch.steps == 3
    assert np.allclose(batch.reward[full], 1 + 0.5 + 0.25)
    assert np.array_equal(batch.next_obs[full], batch.obs[full] + 3)  # the same env, 3 steps on
    seqs = buf.sample_sequences(16, 5)
    first = seqs.obs[:, :1, 0]
    whole = seqs.mask.all(axis=1)
    assert whole.any()
    assert np.array_equal(seqs.obs[whole, :, 0], first[whole] + np.arange(5))  # one env's steps
    groups = buf.sample_groups(4, 3)
    assert np.array_equal(np.diff(groups.obs[:, :, 0], axis=1), np.ones((4, 2)))
    # two steps at once: rows are env-major per step, row i to lane i % envs
    step = vector_steps(4, 1)[0][0]
    ids = buf.push({k: np.concatenate([step[k], step[k]]) for k in STEP.names}, episode=np.arange(8) % 4 << 32)
    assert (ids % 4).tolist() == [0, 1, 2, 3, 0, 1, 2, 3]


def test_envs_push_must_be_whole_steps(make: Make, name: str) -> None:
    buf = make(STEP, capacity=40, envs=4, name=name)
    rows = {k: v[:3] for k, v in vector_steps(4, 1)[0][0].items()}
    with pytest.raises(sb.FieldError, match=r"lane: .*envs=4.*got 3 rows"):
        buf.push(rows)
    assert len(buf) == 0
    buf.push(rows, lane=[0, 1, 2])  # naming the lanes is always possible
    assert len(buf) == 3
    with pytest.raises(ValueError, match="envs"):
        sb.ReplayBuffer(STEP, 40, envs=4, lanes=2, name=name + "x")


def test_lanes_without_lane_is_an_error_not_a_quiet_loss(make: Make, name: str) -> None:
    """40 slots in 4 lanes filled only lane 0: full after 10 rows, silently."""
    buf = make(MUJOCO, capacity=40, lanes=4, name=name)
    with pytest.raises(sb.FieldError, match=r"lane: this buffer has 4 lanes.*1/4 of the capacity.*lane=.*envs=N"):
        buf.push(transition(0, 8))
    with pytest.raises(sb.FieldError, match="lane="):
        buf.push(transition(0))
    assert len(buf) == 0
    buf.push(transition(0, 8), lane=np.arange(8) % 4)
    assert len(buf) == 8


def test_single_env_and_named_lanes_keep_windows(make: Make, name: str) -> None:
    """What must not be refused: one env's chunk of steps in one push (one episode), single-row
    pushes, and rows pushed with lane= (the caller says they are one env's steps)."""
    buf = make(STEP, capacity=400, episodes=True, name=name, seed=0)
    for rows, episode in vector_steps(1, 20):
        buf.push(rows, episode=episode)
    rows = {k: np.concatenate([r[k] for r, _ in vector_steps(1, 5)]) for k in STEP.names}
    buf.push(rows, episode=0)  # a chunk of one episode
    assert len(buf.sample(8, n_step=3)) == 8
    lanes = make(STEP, capacity=400, lanes=2, episodes=True, name=name + "l", seed=0)
    for rows, episode in vector_steps(2, 20):
        lanes.push(rows, lane=[0, 1], episode=episode)
    assert (lanes.sample(64, n_step=3).steps == 3).sum() > 40


def test_n_step_with_shape_one_reward_and_done(make: Make, name: str) -> None:
    """cpprb's default ``rew`` shape and SB3's layout: (1,) works wherever a scalar does."""
    schema = sb.Schema({"obs": {"shape": 3}, "act": {"shape": 1, "dtype": np.int64}, "rew": {},
                        "next_obs": {"shape": 3}, "done": {}})
    assert schema["rew"].shape == (1,) and schema["done"].shape == (1,)
    buf = make(schema, capacity=64, episodes=True, name=name, seed=0)
    for t in range(20):
        buf.push(obs=np.full(3, t), act=[0], rew=[1.0], next_obs=np.full(3, t + 1), done=[t == 9], episode=t // 10)
    batch = buf.sample(128, n_step=3, gamma=0.5)
    assert batch.rew.shape == (128, 1) and batch.done.shape == (128, 1)
    t = batch.obs[:, 0].astype(int)
    expected_steps = np.where(t < 10, np.minimum(3, 10 - t), np.minimum(3, 20 - t))
    assert np.array_equal(batch.steps, expected_steps)
    assert np.allclose(batch.rew[:, 0], [sum(0.5**i for i in range(s)) for s in expected_steps])
    assert np.array_equal(batch.next_obs[:, 0], t + expected_steps)
    assert np.array_equal(batch.done[:, 0], t + expected_steps == 10)
