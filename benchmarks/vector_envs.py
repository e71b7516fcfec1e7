"""Vector envs into a buffer: env steps per second from 8 envs into a replay buffer, and TorchRL's
collectors into a shared storage::

    python -m benchmarks.vector_envs                  # 3 interleaved rounds, 4 s a run
    python -m benchmarks.vector_envs --quick          # 1 round, 1 s a run
    python -m benchmarks.vector_envs --out results/vector.json

Env paths (8 envs, random actions drawn in the main process, every transition stored):

- ``writing workers``: ``shmbuffer.vector.AsyncVectorEnv``, whose worker processes push their own
  rows into the shared buffer (one lane per env);
- ``gymnasium + push``: Gymnasium's ``AsyncVectorEnv`` (shared observation memory) wrapped in
  ``RecordTransitions``, which pushes the 8 rows of each step from the main process;
- ``sb3 + add``: Stable-Baselines3's ``SubprocVecEnv`` and ``ReplayBuffer.add`` of each step.

Two envs: CartPole-v1 (obs 4 float32) and ``Pixels``, a synthetic env with a (3, 64, 64) uint8
observation (12 KiB) whose step costs little, so the transport dominates.

TorchRL: ``MultiSyncCollector`` (2 workers, CartPole, ``replay_buffer=``) into a ``ReplayBuffer``
on ``ShmStorage`` or on ``LazyTensorStorage`` (shared by the collector): frames per second and rows
lost (frames collected minus rows held; the storage is larger than the run).

Rounds interleave the subjects; medians and same-run ratios are reported, of env steps per
wall-clock second and per CPU-second (user + system time of the main process and every worker
during the timed steps: on a machine loaded by other work, the cost that the wall clock hides).
Say how loaded the machine was.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import psutil
from gymnasium import spaces

import shmbuffer as sb

ENVS = 8
BATCH = 16
"""Frames a TorchRL worker collects between writes: small, so the workers' writes meet often."""


class Pixels(gym.Env):  # type: ignore[type-arg]
    """A (3, 64, 64) uint8 observation, episodes of 200 steps, two actions: a cheap step, a large row."""

    def __init__(self) -> None:
        self.observation_space = spaces.Box(0, 255, (3, 64, 64), np.uint8)
        self.action_space = spaces.Discrete(2)
        self.t = 0
        self.frame = np.zeros((3, 64, 64), np.uint8)

    def reset(self, *, seed: int | None = None, options: Any = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self.t = 0
        self.frame[:] = 0
        return self.frame.copy(), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        self.t += 1
        self.frame[:, self.t % 64] = self.t % 256
        return self.frame.copy(), 1.0, False, self.t >= 200, {}


def make(env_id: str) -> Any:
    return gym.make("CartPole-v1") if env_id == "CartPole-v1" else Pixels()


def schema_of(env_id: str) -> sb.Schema:
    env = make(env_id)
    shape, dtype = env.observation_space.shape, env.observation_space.dtype
    return sb.Schema(obs=(shape, dtype), action=((), "int64"), reward=((), "float32"), next_obs=(shape, dtype),
                     done=((), "bool"))


def factories(env_id: str) -> list[Any]:
    return [lambda: make(env_id)] * ENVS


def run_ours(env_id: str, seconds: float) -> tuple[float, float]:
    from shmbuffer.vector import AsyncVectorEnv

    with sb.ReplayBuffer(schema_of(env_id), 200_000, envs=ENVS) as buf:
        envs = AsyncVectorEnv(factories(env_id), buf)
        try:
            return _steps_per_second(envs, seconds)
        finally:
            envs.close()


def run_gymnasium(env_id: str, seconds: float) -> tuple[float, float]:
    from shmbuffer.vector import RecordTransitions

    with sb.ReplayBuffer(schema_of(env_id), 200_000, envs=ENVS) as buf:
        envs = RecordTransitions(gym.vector.AsyncVectorEnv(factories(env_id)), buf)
        try:
            return _steps_per_second(envs, seconds)
        finally:
            envs.close()


def cpu_seconds() -> float:
    """CPU time (user + system) of this process and its live children: what a run costs, which a
    loaded machine changes less than the wall clock."""
    me = psutil.Process()
    total = 0.0
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def _steps_per_second(envs: Any, seconds: float) -> tuple[float, float]:
    rng = np.random.default_rng(0)
    envs.reset(seed=0)
    for _ in range(20):  # warm up: workers started, first pushes made
        envs.step(rng.integers(0, 2, ENVS))
    steps, t0, c0 = 0, time.perf_counter(), cpu_seconds()
    while (now := time.perf_counter()) - t0 < seconds:
        envs.step(rng.integers(0, 2, ENVS))
        steps += ENVS
    return steps / (now - t0), steps / (cpu_seconds() - c0)


def run_sb3(env_id: str, seconds: float) -> tuple[float, float]:
    from stable_baselines3.common.buffers import ReplayBuffer
    from stable_baselines3.common.vec_env import SubprocVecEnv

    envs = SubprocVecEnv(factories(env_id))
    try:
        rb = ReplayBuffer(200_000, envs.observation_space, envs.action_space, device="cpu", n_envs=ENVS,
                          handle_timeout_termination=True)
        rng = np.random.default_rng(0)
        obs = envs.reset()
        steps, t0, c0 = 0, 0.0, 0.0
        for i in range(10**9):
            if i == 20:
                steps, t0, c0 = 0, time.perf_counter(), cpu_seconds()
            actions = rng.integers(0, 2, ENVS)
            next_obs, rewards, dones, infos = envs.step(actions)
            real_next = next_obs.copy()  # SB3's loop: the final observation of an ended env from info
            for j in np.flatnonzero(dones):
                real_next[j] = infos[j]["terminal_observation"]
            rb.add(obs, real_next, actions, rewards, dones, infos)
            obs = next_obs
            steps += ENVS
            if t0 and (now := time.perf_counter()) - t0 >= seconds:
                return steps / (now - t0), steps / (cpu_seconds() - c0)
        raise AssertionError("unreachable")
    finally:
        envs.close()


def run_torchrl(storage_kind: str, frames: int) -> dict[str, float]:
    warnings.filterwarnings("ignore", "Creating .* WeightUpdaterBase is deprecated", DeprecationWarning)
    from torchrl.collectors import MultiSyncCollector
    from torchrl.data import LazyTensorStorage, ReplayBuffer
    from torchrl.envs import GymEnv

    from shmbuffer.torchrl import ShmStorage

    frames = -(-frames // BATCH) * BATCH  # whole batches: the collector collects no more than asked
    storage = ShmStorage(2 * frames) if storage_kind == "ShmStorage" else LazyTensorStorage(2 * frames)
    rb = ReplayBuffer(storage=storage)
    collector = MultiSyncCollector([lambda: GymEnv("CartPole-v1")] * 2, policy=None, frames_per_batch=BATCH,
                                   total_frames=frames, replay_buffer=rb)
    t0 = time.perf_counter()
    try:
        for _ in collector:
            pass
        seconds = time.perf_counter() - t0
    finally:
        collector.shutdown()
    held, collected = len(rb), frames
    if isinstance(storage, ShmStorage):
        storage.close()
    return {"frames_per_s": collected / seconds, "frames": float(collected), "held": float(held),
            "lost": float(max(0, collected - held))}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.vector_envs", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="1 round, 1 s a run, a short TorchRL run")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--seconds", type=float, default=4.0, help="length of an env run (default 4)")
    p.add_argument("--frames", type=int, default=8_192, help="frames of a TorchRL run (default 8,192)")
    p.add_argument("--no-torchrl", action="store_true", help="skip the TorchRL collectors")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    args = p.parse_args(argv)
    rounds, seconds, frames = (1, 1.0, 1_024) if args.quick else (args.rounds, args.seconds, args.frames)
    subjects = {"writing workers": run_ours, "gymnasium + push": run_gymnasium, "sb3 + add": run_sb3}
    rates: dict[str, dict[str, list[float]]] = {e: {s: [] for s in subjects} for e in ("CartPole-v1", "Pixels")}
    per_cpu: dict[str, dict[str, list[float]]] = {e: {s: [] for s in subjects} for e in rates}
    for r in range(rounds):
        for env_id, by in rates.items():
            order = list(subjects) if r % 2 == 0 else list(reversed(subjects))
            for name in order:
                wall, cpu = subjects[name](env_id, seconds)
                by[name].append(wall)
                per_cpu[env_id][name].append(cpu)
                print(f"round {r + 1} {env_id:12s} {name:18s} {wall:10,.0f} env steps/s, {cpu:10,.0f} per CPU-second",
                      flush=True)
    results: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                           "platform": platform.platform(), "load": os.getloadavg()},
                               "envs": ENVS, "rounds": rounds, "seconds": seconds, "env_steps_per_s": {},
                               "env_steps_per_cpu_s": {}}
    print(f"\n{'env':12s} {'path':18s} {'median steps/s':>15s} {'ratio ours/it':>14s} {'per CPU-s':>10s} {'ratio':>6s}")
    for env_id, by in rates.items():
        med = {n: statistics.median(v) for n, v in by.items()}
        cpu = {n: statistics.median(v) for n, v in per_cpu[env_id].items()}
        results["env_steps_per_s"][env_id] = {"median": med, "all": by}
        results["env_steps_per_cpu_s"][env_id] = {"median": cpu, "all": per_cpu[env_id]}
        for name, m in med.items():
            print(f"{env_id:12s} {name:18s} {m:15,.0f} {med['writing workers'] / m:14.2f} {cpu[name]:10,.0f} "
                  f"{cpu['writing workers'] / cpu[name]:6.2f}")
    if not args.no_torchrl:
        torchrl: dict[str, list[dict[str, float]]] = {"ShmStorage": [], "LazyTensorStorage": []}
        for r in range(rounds):
            for kind in (list(torchrl) if r % 2 == 0 else list(reversed(torchrl))):
                torchrl[kind].append(run_torchrl(kind, frames))
                last = torchrl[kind][-1]
                print(f"round {r + 1} MultiSyncCollector + {kind:18s} {last['frames_per_s']:8,.0f} frames/s, "
                      f"{last['lost']:.0f} of {last['frames']:.0f} rows lost", flush=True)
        results["torchrl"] = torchrl
        for kind, runs in torchrl.items():
            print(f"MultiSyncCollector + {kind:18s} median {statistics.median(x['frames_per_s'] for x in runs):8,.0f} "
                  f"frames/s, rows lost {[int(x['lost']) for x in runs]}")
    results["machine"]["load_after"] = os.getloadavg()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
    sys.exit(0)
