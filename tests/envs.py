"""Tiny envs with the Gymnasium API whose every value can be checked (used by collector tests)."""

from __future__ import annotations

from typing import Any

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
