"""Issue 15's traps: vector-env pushes that silently broke n-step returns, sequences and groups,
lanes left unused, shape-(1,) rewards, and errors that did not name the field or what to do."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import shmbuffer as sb

from .conftest import MUJOCO, transition

Make = Callable[..., sb.ReplayBuffer]
SMALL = sb.Schema(obs=((3,), "float32"), action=((), "int64"), reward=((), "float32"),
                  next_obs=((3,), "float32"), done=((), "bool"))


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


# -- n-step, sequences and groups never silently degrade -----------------------------------------


def test_vector_env_into_one_lane_refuses_windows(make: Make, name: str) -> None:
    """The measured trap: 4 envs pushed per step into the default single lane made every n-step
    transition 1 step long (512 of 512). Now every window sampler refuses, naming the fix."""
    buf = make(SMALL, capacity=400, episodes=True, name=name, seed=0)
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
    buf = make(SMALL, capacity=400, episodes=True, envs=4, name=name, seed=0)
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
    ids = buf.push({k: np.concatenate([step[k], step[k]]) for k in SMALL.names}, episode=np.arange(8) % 4 << 32)
    assert (ids % 4).tolist() == [0, 1, 2, 3, 0, 1, 2, 3]


def test_envs_push_must_be_whole_steps(make: Make, name: str) -> None:
    buf = make(SMALL, capacity=40, envs=4, name=name)
    rows = {k: v[:3] for k, v in vector_steps(4, 1)[0][0].items()}
    with pytest.raises(sb.FieldError, match=r"lane: .*envs=4.*got 3 rows"):
        buf.push(rows)
    assert len(buf) == 0
    buf.push(rows, lane=[0, 1, 2])  # naming the lanes is always possible
    assert len(buf) == 3
    with pytest.raises(ValueError, match="envs"):
        sb.ReplayBuffer(SMALL, 40, envs=4, lanes=2, name=name + "x")


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
    buf = make(SMALL, capacity=400, episodes=True, name=name, seed=0)
    for rows, episode in vector_steps(1, 20):
        buf.push(rows, episode=episode)
    rows = {k: np.concatenate([r[k] for r, _ in vector_steps(1, 5)]) for k in SMALL.names}
    buf.push(rows, episode=0)  # a chunk of one episode
    assert len(buf.sample(8, n_step=3)) == 8
    lanes = make(SMALL, capacity=400, lanes=2, episodes=True, name=name + "l", seed=0)
    for rows, episode in vector_steps(2, 20):
        lanes.push(rows, lane=[0, 1], episode=episode)
    assert (lanes.sample(64, n_step=3).steps == 3).sum() > 40


# -- shape-(1,) rewards and dones ----------------------------------------------------------------


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


# -- errors that name the field and what to do ---------------------------------------------------


def test_reset_tuple_names_the_field(make: Make, name: str) -> None:
    buf = make(SMALL, capacity=8, name=name)
    reset = (np.zeros(3, np.float32), {})
    with pytest.raises(sb.FieldError, match=r"field 'obs': .*\(obs, info\).*obs, info = env.reset\(\)"):
        buf.push(obs=reset, action=0, reward=0.0, next_obs=np.zeros(3), done=False)
    with pytest.raises(sb.FieldError, match=r"field 'obs': cannot be made an array"):
        buf.push(obs=[np.zeros(3), np.zeros(2)], action=0, reward=0.0, next_obs=np.zeros(3), done=False)
    assert len(buf) == 0


def test_tensor_that_requires_grad_names_the_field(make: Make, name: str) -> None:
    buf = make(SMALL, capacity=8, name=name)
    q = torch.zeros(3, requires_grad=True) * 2
    with pytest.raises(sb.FieldError, match=r"field 'next_obs': got a tensor that requires grad; push value.detach\(\)"):
        buf.push(obs=np.zeros(3), action=0, reward=0.0, next_obs=q, done=False)
    buf.push(obs=np.zeros(3), action=0, reward=0.0, next_obs=q.detach(), done=False)
    assert len(buf) == 1


def test_float_done_into_bool_is_refused(make: Make, name: str) -> None:
    buf = make(SMALL, capacity=8, name=name)
    with pytest.raises(sb.FieldError, match=r"field 'done': expected bool, got float64: a float flag is refused"):
        buf.push(obs=np.zeros(3), action=0, reward=0.0, next_obs=np.zeros(3), done=1.0)
    buf.push(obs=np.zeros(3), action=0, reward=0.0, next_obs=np.zeros(3), done=1)  # ints 0/1 are fine
    assert len(buf) == 1


def test_cpprb_argument_order_says_schema_first(name: str) -> None:
    with pytest.raises(sb.SchemaError, match=r"got int \(the schema comes first: ReplayBuffer\(schema, capacity\)\)"):
        sb.ReplayBuffer(32, {"obs": {"shape": 3}}, name=name)  # type: ignore[arg-type]


def test_update_priorities_with_ids_that_never_existed(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=16, sampler=sb.Prioritized(), name=name)
    buf.push(transition(0, 4))
    for ids in ([-1], [12345]):
        with pytest.raises(sb.UnknownIdError, match="never named a row"):
            buf.update_priorities(ids, [1.0])


# -- Batch ---------------------------------------------------------------------------------------


def test_batch_slicing_fields_and_dict(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=16, sampler=sb.Prioritized(), name=name, seed=0)
    buf.push(transition(0, 10))
    batch = buf.sample(6)
    head = batch[:2]
    assert len(head) == 2 and isinstance(head, sb.Batch)
    assert np.array_equal(head.obs, batch.obs[:2]) and np.array_equal(head.index, batch.index[:2])
    assert np.array_equal(head.weight, batch.weight[:2])
    picked = batch[np.array([5, 0])]
    assert np.array_equal(picked.reward, batch.reward[[5, 0]])
    masked = batch[batch.reward > 4]
    assert np.array_equal(masked.index, batch.index[batch.reward > 4])
    one = batch[3]
    assert one.obs.shape == (17,) and one.index == batch.index[3]
    t = batch.to("cpu")[torch.tensor([1, 2])]
    assert torch.equal(t.obs, torch.from_numpy(batch.obs[[1, 2]]))
    with pytest.raises(IndexError, match="6 rows"):
        batch[7]
    d = dict(batch)
    assert set(d) == {*MUJOCO.names, "index", "weight"}
    assert batch.keys() == [*MUJOCO.names, "index", "weight"]
    # a learner-side field
    batch["advantage"] = np.arange(6.0)
    batch.ret = np.ones(6)
    assert np.array_equal(batch.advantage, np.arange(6.0)) and np.array_equal(batch["ret"], np.ones(6))
    assert np.array_equal(batch[:3].advantage, np.arange(3.0))
    assert torch.equal(batch.to("cpu").advantage, torch.arange(6.0, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"one value per row \(6, ...\)"):
        batch["bad"] = np.arange(5)
    batch["reward"] = np.zeros(6, np.float32)  # replacing a field
    assert not batch.to("cpu").reward.any()


def test_batch_to_tensordict(make: Make, name: str) -> None:
    pytest.importorskip("tensordict")
    buf = make(MUJOCO, capacity=16, name=name, seed=0)
    buf.push(transition(0, 10))
    batch = buf.sample(5)
    td = batch.to_tensordict()
    assert td.batch_size == torch.Size([5])
    assert torch.equal(td["obs"], torch.from_numpy(batch.obs)) and torch.equal(td["index"], torch.from_numpy(batch.index))
    assert set(td.keys()) == {*MUJOCO.names, "index"}


# -- the collector -------------------------------------------------------------------------------

COLLECTED = sb.Schema(obs=((3,), "float32"), action=((), "int64"), reward=((), "float32"),
                      next_obs=((3,), "float32"), done=((), "bool"))


def test_collector_refuses_lanes_that_break_windows_or_stay_empty(make: Make, name: str) -> None:
    from shmbuffer.collector import Collector

    from .envs import CountingEnv

    shared = make(COLLECTED, capacity=60, episodes=True, name=name)
    with pytest.raises(ValueError, match=r"4 envs into 1 lane\(s\).*interleave.*envs=4"):
        Collector(CountingEnv, shared, workers=2, envs_per_worker=2)
    wide = make(COLLECTED, capacity=60, lanes=6, name=name + "w")
    with pytest.raises(ValueError, match=r"6 lanes but 4 envs.*2 lanes would stay empty.*envs=4"):
        Collector(CountingEnv, wide, workers=2, envs_per_worker=2)


def test_collector_with_cpprb_names_hints_at_transition(make: Make, name: str) -> None:
    from shmbuffer.collector import Collector

    from .envs import CountingEnv

    cpprb = make(sb.Schema({"obs": {"shape": 3}, "act": {"dtype": np.int64}, "rew": {}, "next_obs": {"shape": 3},
                            "done": {}}), capacity=10, name=name)
    with pytest.raises(ValueError, match=r"field\(s\) 'act', 'rew' are not among the default transition's.*transition=lambda"):
        Collector(CountingEnv, cpprb, workers=1)


def test_collector_policy_knows_its_worker_and_envs(make: Make, name: str) -> None:
    """Ape-X's per-actor epsilons need each worker's and env's index: a policy taking ``worker``
    and ``envs`` gets them (here it writes them into the actions, read back from the rows)."""
    from shmbuffer.collector import Collector

    from .envs import CountingEnv

    def policy(model: Any, obs: np.ndarray, step: int, *, worker: int, envs: np.ndarray) -> np.ndarray:
        assert envs.tolist() == [2 * worker, 2 * worker + 1]
        return (envs % 2).astype(np.int64)  # CountingEnv takes 0/1 actions

    def transition(obs: Any, action: Any, reward: Any, next_obs: Any, terminated: Any, truncated: Any) -> dict[str, Any]:
        return {"obs": obs, "action": action, "reward": reward, "next_obs": next_obs, "done": terminated}

    buf = make(COLLECTED, capacity=4 * 50, envs=4, name=name)
    with Collector(CountingEnv, buf, workers=2, envs_per_worker=2, policy=policy, transition=transition) as col:
        deadline = time.monotonic() + 60
        while min(stop - start for start, stop in zip(*buf.ring.bounds(), strict=True)) < 5:
            col.check()  # every worker has pushed (a loaded machine starts them slowly)
            assert time.monotonic() < deadline
            time.sleep(0.01)
        col.warm(200)
        col.stop()
        last = col.stats(window=1)
        with pytest.raises(ValueError, match=r"window must be in \[1, 100\]"):
            col.stats(window=0)
    # CountingEnv's episodes last n = 3..8 steps with rewards 1..n: the last one's return alone
    triangular = {n * (n + 1) / 2 for n in range(3, 9)}
    assert all(w["recent_return"] in triangular for w in last["workers"])
    rows = buf.get(slice(None))
    seen = sorted(set(zip((rows.index % 4).tolist(), rows.action.tolist(), strict=True)))
    assert {lane: action for lane, action in seen} == {0: 0, 1: 1, 2: 0, 3: 1}  # env g in lane g


# -- the command line ------------------------------------------------------------------------------


def _cli(*args: str, stdout: Any = None) -> Any:
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    return subprocess.run([sys.executable, "-m", "shmbuffer.cli", *args], stdout=stdout if stdout is not None else subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, cwd=root, timeout=120)


def test_cli_output_into_a_closed_pipe_is_quiet(make: Make, name: str) -> None:
    """`shmbuffer inspect NAME --json | head` ended in a BrokenPipeError traceback. The reader end
    is closed before the command writes, so every write fails (no race with the pipe's buffer)."""
    import os

    buf = make(MUJOCO, capacity=16, name=name)
    buf.push(transition(0, 4))
    for args in (("inspect", name, "--json"), ("inspect", name), ("ls", "--json")):
        r, w = os.pipe()
        os.close(r)
        try:
            out = _cli(*args, stdout=w)
        finally:
            os.close(w)
        assert out.returncode == 0 and out.stderr == "", (args, out.stderr)


def test_cli_inspect_by_path_and_save_refuses_to_overwrite(make: Make, name: str, tmp_path: Any) -> None:
    import json

    from shmbuffer.shm import segment

    buf = make(MUJOCO, capacity=16, name=name)
    buf.push(transition(0, 4))
    info = json.loads(_cli("inspect", segment.path_of(name), "--json").stdout)
    assert info["rows"] == 4
    assert _cli("save", name, str(tmp_path / "s")).returncode == 0
    again = _cli("save", name, str(tmp_path / "s"))
    assert again.returncode == 1 and "--force" in again.stderr and "Traceback" not in again.stderr
    assert _cli("save", name, str(tmp_path / "s"), "--force").returncode == 0
