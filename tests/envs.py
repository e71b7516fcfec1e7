"""Tiny envs with the Gymnasium API whose every value can be checked (used by collector tests)."""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces


class CountingEnv:
    """obs = [env seed, episode, t]; an episode terminates at t == length (random 3..12 from the
    seed) or is truncated at t == limit; reward = t."""

    def __init__(self, limit: int = 8, fail_at: int | None = None) -> None:
        self.observation_space = spaces.Box(-np.inf, np.inf, (3,), np.float32)
        self.action_space = spaces.Discrete(2)
        self.limit, self.fail_at = limit, fail_at
        self.seed, self.episode, self.t, self.length, self.steps = 0, -1, 0, 0, 0
        self.rng = np.random.default_rng(0)

    def _obs(self) -> np.ndarray:
        return np.array([self.seed, self.episode, self.t], np.float32)

    def reset(self, *, seed: int | None = None, options: Any = None) -> tuple[np.ndarray, dict]:
        if seed is not None:
            self.seed, self.rng = seed, np.random.default_rng(seed)
        self.episode += 1
        self.t = 0
        self.length = int(self.rng.integers(3, 13))
        return self._obs(), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        self.steps += 1
        if self.fail_at is not None and self.steps >= self.fail_at:
            raise RuntimeError(f"CountingEnv failed on purpose at step {self.steps}")
        self.t += 1
        terminated = self.t == self.length
        truncated = not terminated and self.t == self.limit
        return self._obs(), float(self.t), terminated, truncated, {}


LIMIT = 9
"""Steps after which an episode is truncated (lengths are 3..12: some end each way)."""


class EpisodeEnv(gym.Env):  # type: ignore[type-arg]
    """obs = ``[env, episode, t, length]`` (``size`` copies of that code for a large observation);
    terminates at ``t == length`` (3..12, from the seed), truncated at ``t == LIMIT``; reward ``t``."""

    def __init__(self, size: int = 0, fail_at: int | None = None) -> None:
        shape = (size,) if size else (4,)
        self.observation_space = spaces.Box(-1, 2**30, shape, np.int32 if size else np.float32)
        self.action_space = spaces.Discrete(2)
        self.size, self.fail_at = size, fail_at
        self.env, self.episode, self.t, self.length, self.steps = 0, -1, 0, 0, 0
        self.rng = np.random.default_rng(0)

    def _obs(self) -> np.ndarray:
        if self.size:
            return np.full(self.size, code(self.env, self.episode, self.t), np.int32)
        return np.array([self.env, self.episode, self.t, self.length], np.float32)

    def reset(self, *, seed: int | None = None, options: Any = None) -> tuple[np.ndarray, dict]:
        if seed is not None:
            self.env, self.rng = seed, np.random.default_rng(seed)
        self.episode += 1
        self.t = 0
        self.length = int(self.rng.integers(3, 13))
        return self._obs(), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        self.steps += 1
        if self.fail_at is not None and self.steps >= self.fail_at:
            raise RuntimeError(f"EpisodeEnv failed on purpose at step {self.steps}")
        self.t += 1
        terminated = self.t == self.length
        return self._obs(), float(self.t), terminated, not terminated and self.t == LIMIT, {}


def code(env: int, episode: int, t: int) -> int:
    """A large observation's every value: env, episode and step in one int32."""
    return env * 10_000_000 + episode * 100 + t
