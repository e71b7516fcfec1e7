"""Reading a Minari dataset: ``shmbuffer.minari.from_minari`` (a buffer filled from the dataset)
against Minari's own ``iterate_episodes`` over the same dataset, same run::

    python -m benchmarks.minari_load                  # 1M steps in episodes of 200, 3 rounds
    python -m benchmarks.minari_load --quick          # 100k steps, 1 round

The dataset (made once, under a temporary ``MINARI_DATASETS_PATH``, with Minari's
``create_dataset_from_buffers``): CartPole-shaped steps (obs 4 float32, Discrete(2) actions),
HDF5, Minari's default format. Minari's side iterates every episode and touches its arrays;
ours builds the buffer (one lane, episodes kept) holding every step. Steps per second, medians of
interleaved rounds, and the ratio. Say how loaded the machine was.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np


def make_dataset(steps: int, length: int) -> str:
    import gymnasium as gym
    import minari
    from minari.data_collector import EpisodeBuffer

    rng = np.random.default_rng(0)
    episodes = []
    for i in range(steps // length):
        obs = rng.normal(size=(length + 1, 4)).astype(np.float32)
        episodes.append(EpisodeBuffer(id=i, observations=obs, actions=rng.integers(0, 2, length),
                                      rewards=np.ones(length), terminations=np.arange(length) == length - 1,
                                      truncations=np.zeros(length, bool)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Minari's nags about metadata
        minari.create_dataset_from_buffers("bench/cartpole-v0", episodes, observation_space=gym.spaces.Box(
            -np.inf, np.inf, (4,), np.float32), action_space=gym.spaces.Discrete(2), algorithm_name="random")
    return "bench/cartpole-v0"


def minari_iterate(dataset_id: str) -> float:
    import minari

    t0 = time.perf_counter()
    ds = minari.load_dataset(dataset_id)
    steps = 0
    for ep in ds.iterate_episodes():
        steps += len(ep.rewards)
    return steps / (time.perf_counter() - t0)


def ours(dataset_id: str) -> float:
    from shmbuffer.minari import from_minari

    t0 = time.perf_counter()
    buf = from_minari(dataset_id)
    steps = len(buf)
    seconds = time.perf_counter() - t0
    buf.close()
    buf.unlink()
    return steps / seconds


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.minari_load", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="100k steps, 1 round")
    p.add_argument("--steps", type=int, default=1_000_000, help="steps in the dataset (default 1M)")
    p.add_argument("--length", type=int, default=200, help="steps an episode (default 200)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--out", type=Path, help="write the results as JSON")
    args = p.parse_args(argv)
    steps, rounds = (100_000, 1) if args.quick else (args.steps, args.rounds)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["MINARI_DATASETS_PATH"] = tmp
        t0 = time.perf_counter()
        dataset_id = make_dataset(steps, args.length)
        made = time.perf_counter() - t0
        got: dict[str, list[float]] = {"shmbuffer.from_minari": [], "minari.iterate_episodes": []}
        for r in range(rounds):
            pair = [("shmbuffer.from_minari", ours), ("minari.iterate_episodes", minari_iterate)]
            for name, fn in pair if r % 2 == 0 else pair[::-1]:
                got[name].append(fn(dataset_id))
    med = {k: statistics.median(v) for k, v in got.items()}
    ratio = med["shmbuffer.from_minari"] / med["minari.iterate_episodes"]
    out = {"steps": steps, "episode_length": args.length, "made_in_s": made, "steps_per_s": got, "median": med,
           "ratio": ratio, "load": os.getloadavg()}
    print(f"{steps:,d} steps ({args.length} an episode): " + ", ".join(f"{k} {v:,.0f} steps/s" for k, v in med.items())
          + f"; ratio {ratio:.2f}x; load average {out['load'][0]:.1f}")
    if args.out:
        args.out.write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
