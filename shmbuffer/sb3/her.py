"""Stable-Baselines3's ``HerReplayBuffer`` over a shmbuffer: goals relabelled at sample time by
``shmbuffer.hindsight``, from the rows of every process that writes into the shared buffer.

::

    from stable_baselines3 import SAC
    from shmbuffer.sb3 import HerReplayBuffer

    model = SAC("MultiInputPolicy", env, replay_buffer_class=HerReplayBuffer,
                replay_buffer_kwargs={"n_sampled_goal": 4, "goal_selection_strategy": "future"})
    shared = model.replay_buffer.buffer     # lane e holds env e's steps, one episode id an episode

SB3's constructor, ``add``, ``sample``, ``set_env``, ``truncate_last_trajectory``, pickling without
the env and the attributes SB3's tests read (``ep_start``, ``ep_length``, ``_current_ep_start``,
``infos``, ``her_ratio``, ``n_sampled_goal``, ``goal_selection_strategy``, ``copy_info_dict``) are
SB3's. The rows are a ``DictReplayBuffer`` (``buffers.py``) made with ``episodes=True``: each add
names its env's episode, and an env's next add after a done (or a position set done by hand, as
``truncate_last_trajectory`` does) starts a new one.

``sample`` is ``buffer.sample(batch_size, hindsight=...)``: transitions of complete episodes drawn
uniformly over the shared rows (an episode is complete once its last row is marked done, as SB3
counts it), ``int(her_ratio * batch_size)`` of them relabelled with the strategy's goals from the
same env's episode, rewards from ``env.env_method("compute_reward", ...)`` on the first env, once a
batch. Where this differs from SB3 (``docs/migration/sb3.md``): the draws come from the buffer's
generator (seeded from one draw of ``np.random`` at the first sample: making the buffer leaves
``np.random`` alone), not ``np.random``; the relabelled
rows are spread over the batch, not its last ones; a transition of an episode whose first rows
were overwritten is still drawn (its goals come from its rows still held: SB3 drops the whole
episode); ``ep_start``, ``ep_length`` and ``infos`` record this process's adds only (rows pushed by
other processes are relabelled from the shared episode ids; with ``copy_info_dict`` their infos
are whatever this process stored at that position).
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
from gymnasium import spaces
from stable_baselines3.common.type_aliases import DictReplayBufferSamples
from stable_baselines3.her import her_replay_buffer as sb3_her
from stable_baselines3.her.goal_selection_strategy import KEY_TO_GOAL_STRATEGY, GoalSelectionStrategy

from ..batch import Batch
from ..errors import EmptyBufferError
from ..hindsight import Hindsight
from ..protocol import by_position
from ..sampling.limiter import RateLimiter
from .buffers import DictReplayBuffer, _key

__all__ = ["HerReplayBuffer"]

GOAL_KEYS = ("observation", "achieved_goal", "desired_goal")
STRATEGY_NAMES = {GoalSelectionStrategy.FUTURE: "future", GoalSelectionStrategy.FINAL: "final",
                  GoalSelectionStrategy.EPISODE: "episode"}


class HerReplayBuffer(DictReplayBuffer, sb3_her.HerReplayBuffer):
    """SB3's ``HerReplayBuffer`` over a shmbuffer (see the module docstring).

    :param name: the shared buffer's name in ``/dev/shm`` (default: a fresh one).
    :param limiter: a ``RateLimiter`` for the shared buffer (samples per insert, held for every
        process: collectors pushing into it wait while the learner's samples lag behind).
    """

    def __init__(
        self, buffer_size: int, observation_space: spaces.Dict, action_space: spaces.Space, env: Any,
        device: Any = "auto", n_envs: int = 1, optimize_memory_usage: bool = False,
        handle_timeout_termination: bool = True, n_sampled_goal: int = 4,
        goal_selection_strategy: GoalSelectionStrategy | str = "future", copy_info_dict: bool = False,
        *, name: str | None = None, limiter: RateLimiter | None = None,
    ) -> None:
        if not isinstance(observation_space, spaces.Dict) or not set(GOAL_KEYS) <= set(observation_space.spaces):
            raise ValueError(f"HerReplayBuffer needs a Dict observation space with the keys {', '.join(GOAL_KEYS)} "
                             f"(a GoalEnv's), got {observation_space}")
        if isinstance(goal_selection_strategy, str):
            key = goal_selection_strategy.lower()
            if key not in KEY_TO_GOAL_STRATEGY:
                raise ValueError(f"goal_selection_strategy: expected one of {', '.join(KEY_TO_GOAL_STRATEGY)}, got "
                                 f"{goal_selection_strategy!r}")
            goal_selection_strategy = KEY_TO_GOAL_STRATEGY[key]
        if not isinstance(goal_selection_strategy, GoalSelectionStrategy):
            raise ValueError(f"Invalid goal selection strategy, please use one of {list(GoalSelectionStrategy)}")
        if isinstance(n_sampled_goal, bool) or not isinstance(n_sampled_goal, (int, np.integer)) or n_sampled_goal < 0:
            raise ValueError(f"n_sampled_goal: expected an int >= 0, got {n_sampled_goal!r}")
        if optimize_memory_usage:  # as SB3's DictReplayBuffer
            raise ValueError("HerReplayBuffer does not support optimize_memory_usage=True (neither does SB3's)")
        self._init_shared(buffer_size, observation_space, action_space, device, n_envs, False,
                          handle_timeout_termination, name, episodes=True, limiter=limiter)
        self._her_init(env, n_sampled_goal, goal_selection_strategy, copy_info_dict)

    def _her_init(self, env: Any, n_sampled_goal: int, strategy: GoalSelectionStrategy, copy_info_dict: bool) -> None:
        self.env = env
        self.copy_info_dict = copy_info_dict
        self.goal_selection_strategy = strategy
        self.n_sampled_goal = int(n_sampled_goal)
        self.her_ratio = 1 - (1.0 / (self.n_sampled_goal + 1))
        self.infos = np.array([[{} for _ in range(self.n_envs)] for _ in range(self.buffer_size)])
        self.ep_start = np.zeros((self.buffer_size, self.n_envs), dtype=np.int64)
        self.ep_length = np.zeros((self.buffer_size, self.n_envs), dtype=np.int64)
        self._current_ep_start = np.zeros(self.n_envs, dtype=np.int64)
        self._keys = [(k, _key(k)) for k in self.observation_space.spaces]

    def add(  # type: ignore[override]
        self, obs: dict[str, np.ndarray], next_obs: dict[str, np.ndarray], action: np.ndarray,
        reward: np.ndarray, done: np.ndarray, infos: list[dict[str, Any]],
    ) -> None:
        """SB3's ``add``: one step of the ``n_envs`` envs, with SB3's episode bookkeeping."""
        pos = self.pos
        for env_idx in range(self.n_envs):  # an episode being overwritten leaves SB3's bookkeeping whole
            length = self.ep_length[pos, env_idx]
            if length > 0:
                end = self.ep_start[pos, env_idx] + length
                self.ep_length[np.arange(pos, end) % self.buffer_size, env_idx] = 0
        self.ep_start[pos] = self._current_ep_start.copy()
        if self.copy_info_dict:
            self.infos[pos] = infos
        DictReplayBuffer.add(self, obs, next_obs, action, reward, done, infos)
        for env_idx in range(self.n_envs):
            if done[env_idx]:
                self._compute_episode_length(env_idx)

    @property
    def hindsight(self) -> Hindsight:
        """The relabelling ``sample`` asks of the shared buffer (``buffer.sample(n, hindsight=...)``),
        from the buffer's settings now (``her_ratio``, ``goal_selection_strategy`` may be changed)."""
        return Hindsight(self._compute_reward, strategy=STRATEGY_NAMES[self.goal_selection_strategy],
                         ratio=float(self.her_ratio), achieved="next_obs_achieved_goal",
                         desired=("obs_desired_goal", "next_obs_desired_goal"), reward="reward",
                         done=("done", "timeouts"), info=self._infos_of if self.copy_info_dict else None)

    def _compute_reward(self, achieved: np.ndarray, desired: np.ndarray, infos: Any) -> np.ndarray:
        if self.env is None:
            raise ValueError("HerReplayBuffer.sample: no env to compute rewards with; pass env= or call set_env(env) "
                             "(after loading a pickled buffer)")
        rewards = self.env.env_method("compute_reward", achieved, desired, infos, indices=[0])
        return np.asarray(rewards[0]).astype(np.float32)

    def _infos_of(self, batch: Batch, positions: np.ndarray) -> Any:
        return copy.deepcopy(self.infos[by_position.in_lane(self.buffer, batch.index[positions])])

    def sample(self, batch_size: int, env: Any = None) -> DictReplayBufferSamples:  # type: ignore[override]
        """SB3's ``sample``: transitions of complete episodes, ``her_ratio`` of them relabelled."""
        self._seed()
        try:
            batch = self.buffer.sample(batch_size, hindsight=self.hindsight)
        except EmptyBufferError as e:
            raise RuntimeError(
                "Unable to sample before the end of the first episode. We recommend choosing a value "
                f"for learning_starts that is greater than the maximum number of timesteps in the environment. ({e})"
            ) from e
        keys = self._keys
        obs = self._normalize_obs({k: batch[f"obs_{key}"] for k, key in keys}, env)
        next_obs = self._normalize_obs({k: batch[f"next_obs_{key}"] for k, key in keys}, env)
        assert isinstance(obs, dict) and isinstance(next_obs, dict)
        actions, dones, rewards = self._tail(batch, env)
        torch = self._own_tensor
        return DictReplayBufferSamples(
            observations={k: torch(v) for k, v in obs.items()},
            actions=torch(actions),
            next_observations={k: torch(v) for k, v in next_obs.items()},
            dones=torch(dones),
            rewards=torch(rewards),
        )

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["her"] = {"n_sampled_goal": self.n_sampled_goal, "her_ratio": self.her_ratio,
                        "goal_selection_strategy": self.goal_selection_strategy, "copy_info_dict": self.copy_info_dict,
                        "infos": self.infos, "ep_start": self.ep_start, "ep_length": self.ep_length,
                        "current_ep_start": self._current_ep_start}
        return state  # without the env, as SB3's: set_env() after loading

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        her = state["her"]
        self._her_init(None, her["n_sampled_goal"], her["goal_selection_strategy"], her["copy_info_dict"])
        self.her_ratio = her["her_ratio"]
        self.infos, self.ep_start, self.ep_length = her["infos"], her["ep_start"], her["ep_length"]
        self._current_ep_start = her["current_ep_start"]
