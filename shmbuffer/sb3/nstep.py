"""Stable-Baselines3's ``NStepReplayBuffer`` on a shmbuffer: ``buffers.ReplayBuffer`` whose samples
are n-step transitions read from the lane under the stamp check (the windows of ``buffers.py``'s
docstring)."""

from __future__ import annotations

from typing import Any

import numpy as np
from gymnasium import spaces
from stable_baselines3.common import buffers as sb3_buffers
from stable_baselines3.common.type_aliases import ReplayBufferSamples

from ..protocol import by_position
from .buffers import ReplayBuffer, waiting


class NStepReplayBuffer(ReplayBuffer, sb3_buffers.NStepReplayBuffer):
    """SB3's ``NStepReplayBuffer`` over a shmbuffer: ``sample`` returns n-step transitions
    (``rewards`` the discounted return over up to ``n_steps`` steps of one env, ``next_observations``
    and ``dones`` those of the last step used, ``discounts`` ``gamma ** steps used``), computed as
    SB3 computes them, so for the same adds and ``np.random`` state they are SB3's.

    A window stops at its first ``done`` or time-limit end (inclusive), and at its lane's newest
    row (SB3's ``pos - 1``): past it lie the lane's oldest rows. The window's rows are one stamped
    copy, read again while a writer elsewhere is writing one of them.

    :param n_steps: steps accumulated per transition (SB3's, default 3).
    :param gamma: the discount (SB3's, default 0.99).
    :param name: as for ``ReplayBuffer``.
    """

    def __init__(
        self, buffer_size: int, observation_space: spaces.Space, action_space: spaces.Space,
        device: Any = "auto", n_envs: int = 1, optimize_memory_usage: bool = False,
        handle_timeout_termination: bool = True, *, n_steps: int = 3, gamma: float = 0.99, name: str | None = None,
    ) -> None:
        if isinstance(n_steps, bool) or not isinstance(n_steps, (int, np.integer)) or n_steps < 1:
            raise ValueError(f"n_steps: expected a positive int, got {n_steps!r}")
        if not isinstance(gamma, (int, float, np.floating)) or not 0.0 <= float(gamma) <= 1.0:
            raise ValueError(f"gamma: expected a float in [0, 1], got {gamma!r}")
        steps = max(buffer_size // max(int(n_envs), 1), 1) if isinstance(n_envs, int) else 1
        if n_steps > steps:
            raise ValueError(
                f"n_steps: {n_steps} is more than the {steps} steps each env's rows hold (buffer_size "
                f"{buffer_size} // n_envs {n_envs}); use a larger buffer_size or fewer n_steps"
            )
        if optimize_memory_usage:
            raise ValueError("NStepReplayBuffer: optimize_memory_usage=True is not supported (its windows are read "
                             "by SB3's positions); use shmbuffer.sb3.ReplayBuffer with it, or leave it False")
        super().__init__(buffer_size, observation_space, action_space, device, n_envs, optimize_memory_usage,
                         handle_timeout_termination, name=name)
        self.n_steps = int(n_steps)
        self.gamma = float(gamma)

    def _get_samples(self, batch_inds: np.ndarray, env: Any = None) -> ReplayBufferSamples:
        env_indices = np.random.randint(0, self.n_envs, size=batch_inds.shape)
        b, n = len(batch_inds), self.n_steps
        lane = np.asarray(env_indices, np.int64)

        def read() -> tuple[Any, np.ndarray, np.ndarray]:  # as _take: one stamped copy of every window's rows
            row, last = by_position.newest_at(self.buffer, batch_inds, lane)  # last: each lane's newest row, SB3's pos - 1
            rows = np.minimum(row[:, None] + np.arange(n), last[:, None])  # past the newest: masked below
            return self.buffer.take(by_position.row_ids(self.buffer, rows, lane[:, None]).reshape(-1)), rows, last

        batch, rows, last = waiting(read, "rows of the drawn windows")
        # from here on SB3's NStepReplayBuffer._get_samples, step for step (float32 included)
        dones_seq = batch.done.reshape(b, n)
        truncated_seq = batch.timeouts.reshape(b, n).copy()
        newest = rows == last[:, None]
        truncated_seq[newest] = np.logical_or(truncated_seq[newest], np.logical_not(dones_seq[newest]))
        rewards_seq = self._normalize_reward(batch.reward.reshape(b, n), env)
        done_or_truncated = np.logical_or(dones_seq, truncated_seq)
        done_idx = done_or_truncated.argmax(axis=1)
        done_idx = np.where(done_or_truncated.any(axis=1), done_idx, n - 1)
        mask = np.arange(n).reshape(1, -1) <= done_idx[:, None]
        target_q_discounts = self.gamma ** mask.sum(axis=1, keepdims=True).astype(np.float32)
        discounts = self.gamma ** np.arange(n, dtype=np.float32).reshape(1, -1)
        n_step_returns = (rewards_seq * discounts * mask).sum(axis=1, keepdims=True)
        at = np.arange(b)
        next_obs = self._normalize_obs(batch.next_obs.reshape(b, n, *self.obs_shape)[at, done_idx], env)
        next_dones = dones_seq[at, done_idx][:, None].astype(np.float32)
        next_timeouts = truncated_seq[at, done_idx][:, None].astype(np.float32)
        final_dones = next_dones * (1.0 - next_timeouts)
        obs = self._normalize_obs(batch.obs.reshape(b, n, *self.obs_shape)[:, 0], env)
        actions = batch.action.reshape(b, n, -1)[:, 0]
        return ReplayBufferSamples(
            observations=self._own_tensor(obs),  # type: ignore[arg-type]
            actions=self._own_tensor(actions),
            next_observations=self._own_tensor(next_obs),  # type: ignore[arg-type]
            dones=self._own_tensor(final_dones),
            rewards=self._own_tensor(n_step_returns),
            discounts=self._own_tensor(target_q_discounts),
        )

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "n_step": (self.n_steps, self.gamma)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.n_steps, self.gamma = state["n_step"]
