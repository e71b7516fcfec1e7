"""Collectors: env workers writing transitions into the buffer, weights, errors and shutdown."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import torch

import shmbuffer as sb
from shmbuffer.collector import Collector, WorkerError

from .envs import CountingEnv

Make = Callable[..., sb.ReplayBuffer]
ROOT = Path(__file__).resolve().parent.parent
SCHEMA = sb.Schema(obs=((3,), "float32"), action=((), "int64"), reward=((), "float32"),
                   next_obs=((3,), "float32"), done=((), "bool"), truncated=((), "bool"))


def test_rows_are_the_envs_transitions(make: Make, name: str) -> None:
    buf = make(SCHEMA, capacity=4 * 500, lanes=4, episodes=True, name=name)
    with Collector(CountingEnv, buf, workers=2, envs_per_worker=2, seed=1) as col:
        col.warm(400)
        deadline = time.monotonic() + 60
        while min(stop - start for start, stop in zip(*buf.ring.bounds(), strict=True)) < 50:
            col.check()  # both workers have started (a loaded machine starts them slowly)
            assert time.monotonic() < deadline
            time.sleep(0.01)
        col.stop()
        stats = col.stats()
    assert stats["env_steps"] == buf.stats["inserted"] >= 400
    assert stats["episodes"] > 10 and stats["recent_return"] > 0
    seeds = set()
    everything = buf.get(slice(None))
    for lane in range(4):
        mine = everything.index % 4 == lane
        obs, nxt = everything.obs[mine], everything.next_obs[mine]
        done, trunc, reward = everything.done[mine], everything.truncated[mine], everything.reward[mine]
        assert len(set(obs[:, 0])) == 1  # one env per lane
        seeds.add(float(obs[0, 0]))
        assert np.array_equal(nxt[:, 2], obs[:, 2] + 1) and np.array_equal(reward, nxt[:, 2])
        assert np.array_equal(nxt[:, 1], obs[:, 1])  # next_obs is the episode's own last obs
        ended = done | trunc
        assert not (done & trunc).any()
        # within an episode, the next row starts where this one ended; after its end, a reset
        same = ~ended[:-1]
        assert np.array_equal(obs[1:][same], nxt[:-1][same])
        assert (obs[1:][~same][:, 2] == 0).all() and (obs[1:][~same][:, 1] == obs[:-1][~same][:, 1] + 1).all()
        assert trunc.any() and done.any()
        assert (nxt[trunc][:, 2] == 8).all()  # truncated at the limit, final observation kept
    assert len(seeds) == 4


def test_episode_ids_follow_the_episodes(make: Make, name: str) -> None:
    buf = make(SCHEMA, capacity=2 * 300, lanes=2, episodes=True, name=name)
    with Collector(CountingEnv, buf, workers=1, envs_per_worker=2) as col:
        col.warm(200)
    batch = buf.sample_sequences(50, 6)
    for row in range(50):
        m = batch.mask[row]
        assert len(set(batch.obs[row][m][:, 1])) == 1  # one episode per window
        assert np.array_equal(np.diff(batch.obs[row][m][:, 2]), np.ones(m.sum() - 1))


class Threshold(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bias = torch.nn.Parameter(torch.zeros(1))


def act_by_bias(model: Any, obs: np.ndarray, step: int) -> np.ndarray:
    return np.full(obs.shape[0], int(model.bias.item() > 0))


def test_published_weights_reach_the_workers(make: Make, name: str) -> None:
    buf = make(SCHEMA, capacity=5000, name=name)
    model = Threshold()
    with Collector(CountingEnv, buf, workers=2, policy=act_by_bias, model=model) as col:
        col.warm(50)
        assert set(buf.sample(200).action) == {0}
        with torch.no_grad():
            model.bias.fill_(1.0)
        assert col.publish(model) == 2
        start = buf.stats["inserted"]
        col.warm(start + 500)
        late = buf.get(slice(-200, None))
    assert set(late.action) == {1}
    with pytest.raises(ValueError, match="parameters"):
        col.publish(torch.nn.Linear(2, 2))


def failing_env() -> CountingEnv:
    return CountingEnv(fail_at=30)


def test_a_worker_exception_reaches_the_learner(make: Make, name: str) -> None:
    buf = make(SCHEMA, capacity=1000, name=name)
    col = Collector(failing_env, buf, workers=2)
    try:
        with pytest.raises(WorkerError, match=r"(?s)collector worker \d raised:.*RuntimeError: CountingEnv failed on purpose at step 30"):
            col.warm(10_000, timeout=60)
        assert all(not p.is_alive() for p in col._procs)  # every worker was stopped
    finally:
        col.stop()


def test_a_killed_worker_is_reported(make: Make, name: str) -> None:
    buf = make(SCHEMA, capacity=1000, name=name)
    with Collector(CountingEnv, buf, workers=2) as col:
        col.warm(20)
        os.kill(col._procs[1].pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        with pytest.raises(WorkerError, match=r"worker 1 \(pid \d+\) died with exit code -9"):
            while time.monotonic() < deadline:
                col.check()
                time.sleep(0.05)


def test_workers_exit_when_the_learner_dies(tmp_path: Path) -> None:
    script = textwrap.dedent("""
        import sys, time, shmbuffer as sb
        from shmbuffer.collector import Collector
        from tests.envs import CountingEnv
        from tests.test_collector import SCHEMA
        buf = sb.ReplayBuffer(SCHEMA, 1000)
        col = Collector(CountingEnv, buf, workers=2)
        col.warm(10)
        print(" ".join(str(p.pid) for p in col._procs), flush=True)
        time.sleep(120)
    """)
    learner = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        assert learner.stdout is not None
        line = learner.stdout.readline()
        pids = [int(p) for p in line.split()]
        assert len(pids) == 2, learner.stderr.read() if learner.stderr else line
        learner.kill()
        learner.wait(10)
        deadline = time.monotonic() + 20
        while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
            assert time.monotonic() < deadline, "workers outlived their learner"
            time.sleep(0.1)
    finally:
        learner.kill()
        learner.wait()
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for stream in (learner.stdout, learner.stderr):
            if stream is not None:
                stream.close()


def test_stop_leaves_no_process(make: Make, name: str) -> None:
    buf = make(SCHEMA, capacity=1000, name=name)
    col = Collector(CountingEnv, buf, workers=2, start_method="spawn")
    col.warm(10)
    procs = list(col._procs)
    col.stop()
    col.stop()
    assert all(p.exitcode is not None for p in procs)
    assert all(not psutil.pid_exists(p.pid) or psutil.Process(p.pid).status() == psutil.STATUS_ZOMBIE for p in procs)


def test_bad_arguments(make: Make, name: str) -> None:
    buf = make(SCHEMA, capacity=10, name=name)
    with pytest.raises(ValueError, match="must be positive"):
        Collector(CountingEnv, buf, workers=0)


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
