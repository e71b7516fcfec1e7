"""Stable-Baselines3 replay buffers whose rows live in a shmbuffer (``pip install -e ".[sb3]"`` from a clone).

::

    from stable_baselines3 import DQN
    from shmbuffer.sb3 import ReplayBuffer

    model = DQN("MlpPolicy", env, replay_buffer_class=ReplayBuffer)
    shared = model.replay_buffer.buffer            # a shmbuffer.ReplayBuffer: attach it anywhere
    # other processes may push into `shared` (lane=env, or whole vector steps) while learn() runs
    model.learn(10_000)
    model.save_replay_buffer("rb.pkl")             # the rows, not a name: loads in a fresh process

``ReplayBuffer``, ``DictReplayBuffer`` and ``NStepReplayBuffer`` (``replay_buffer_kwargs={"n_steps":
3, "gamma": 0.99}``) are SB3's classes (``isinstance`` checks in SB3 pass) with SB3's behaviour: ``add`` takes one step of ``n_envs`` envs, ``sample`` draws positions and
env indices with ``np.random`` exactly as SB3 does, ``handle_timeout_termination`` masks dones
of time-limit ends, a ``VecNormalize`` passed as ``env`` normalizes observations and rewards. So,
given the same adds and the same ``np.random`` state, they return the same transitions as SB3's and
leave ``np.random`` in the same state. Making a buffer and adding to it draw nothing from it.

The rows are a shmbuffer made with ``envs=n_envs`` (one lane per env): SB3's position ``p`` of env
``e`` is the newest row of lane ``e`` in its slot ``p``; ``pos`` (the least filled lane's next slot)
and ``full`` are read from the shared ring, so rows pushed by other processes count. ``full`` can be
set as in SB3; ``pos`` only to its own value (the lanes' cursors are shared). Samples are stamped
copies: a row that a writer elsewhere is writing or overwriting is never returned torn (the rows at
the drawn positions are read again, for up to ``WAIT`` seconds).

SB3's arrays (``observations``, ``next_observations``, ``actions``, ``rewards``, ``dones``,
``timeouts``; ``(buffer_size, n_envs, *shape)`` in SB3's dtypes) are read-only views of the shared
columns. Item assignment on them (SB3's ``dones[pos] = True``) rewrites each touched row with
``buffer.update``: a reader anywhere sees the row as it was or as it is after, never half of it (its
stamp is odd while it changes and the update count moves, ``protocol/edits.py``). A row overwritten meanwhile
keeps what its writer pushed; a position holding no row takes the values, as SB3's array would.

``optimize_memory_usage=True`` (``ReplayBuffer`` only, as in SB3) stores each observation once:
the shared buffer is made with ``next_of="obs"`` (``frames.py``), so ``next_obs`` of a step is read
from ``obs`` of the env's next step, and an episode's last step keeps its real final observation (a
row of its own). Unlike SB3's flag this keeps timeouts exact: SB3 returns the next episode's first
observation as the final one (``handle_timeout_termination`` cannot be combined with it there).
``replay_buffer_kwargs={"stack": "obs"}`` also stores one frame of a stacked observation a row
(``VecFrameStack``: ``{"obs": (4, -1)}`` for channels last). Sampling then draws uniformly over the
whole transitions held (``buffer.sample``), not by SB3's positions; it still makes the draws of
``np.random`` SB3's sample makes (the same calls and bounds, from SB3's own count of adds), so the
global generator moves on as in a run on SB3's buffer, and the first of them seed the shared buffer's
generator. ``size()`` counts whole transitions per env. The arrays are then copies whose
rows include end rows, and position ``pos - 1 - j`` of env ``e`` is lane ``e``'s ``j``-th newest row
(end rows make the cursors differ), so SB3's truncation before a second ``learn()``
(``dones[pos - 1] = True``) ends every env's episode in its lane: the buffer keeps episode ids, and
the env's next add starts a new one (the cut step is never sampled).

Pickling (``save_replay_buffer``, ``deepcopy``) stores the rows with their ids and the settings;
unpickling makes a new shared buffer holding them at the same positions (the same arrays, ``pos``
and ``full``; with ``optimize_memory_usage`` the rows only, oldest first), owned by the loading
process. Where these differ from SB3 and why: ``docs/migration/sb3.md``.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
from gymnasium import spaces
from stable_baselines3.common import buffers as sb3_buffers
from stable_baselines3.common.type_aliases import DictReplayBufferSamples, ReplayBufferSamples

from ..errors import EmptyBufferError, FieldError
from .shared import WAIT, Shared, waiting

__all__ = ["WAIT", "DictReplayBuffer", "ReplayBuffer", "waiting"]


def _key(name: str) -> str:
    """A dict observation's key as part of a field name."""
    return re.sub(r"\W", "_", str(name)) or "key"

class ReplayBuffer(Shared, sb3_buffers.ReplayBuffer):
    """SB3's ``ReplayBuffer`` over a shmbuffer (see the module docstring).

    :param name: the shared buffer's name in ``/dev/shm`` (default: a fresh one); pass it with
        ``replay_buffer_kwargs={"name": ...}``.
    """

    def __init__(
        self, buffer_size: int, observation_space: spaces.Space, action_space: spaces.Space,
        device: Any = "auto", n_envs: int = 1, optimize_memory_usage: bool = False,
        handle_timeout_termination: bool = True, *, name: str | None = None, stack: Any = None,
    ) -> None:
        if isinstance(observation_space, spaces.Dict):
            raise ValueError("a Dict observation space needs shmbuffer.sb3.DictReplayBuffer")
        self._init_shared(buffer_size, observation_space, action_space, device, n_envs, optimize_memory_usage,
                          handle_timeout_termination, name, stack)

    def _obs_fields(self) -> dict[str, tuple[Any, ...]]:
        shape, dtype = tuple(self.obs_shape), self.observation_space.dtype
        return {"obs": (shape, dtype), "next_obs": (shape, dtype)}

    @property
    def observations(self) -> np.ndarray:
        """SB3's array, ``(buffer_size, n_envs, *obs_shape)``: a read-only view of the shared
        column; a write through it (``observations[pos] = x``, or assigning the whole array) goes
        through ``buffer.update``."""
        if self._settings["stack"] is not None:
            raise FieldError("observations: with stack= the buffer stores one frame of each stacked observation a "
                             "row, so there is no array of whole observations; read rows with sample() or buffer.get()")
        return self._column("obs")

    @observations.setter
    def observations(self, value: np.ndarray) -> None:
        self.observations[...] = value

    @property
    def next_observations(self) -> Any:  # SB3's attribute is None with optimize_memory_usage too
        """SB3's array; ``None`` with ``optimize_memory_usage`` (as SB3's: read from ``observations``)."""
        return None if self.optimize_memory_usage else self._column("next_obs")

    @next_observations.setter
    def next_observations(self, value: np.ndarray) -> None:
        if self.optimize_memory_usage:
            raise FieldError("next_observations: with optimize_memory_usage=True next observations are read from "
                             "the next step's observation and cannot be written")
        self._set_column("next_obs", value)

    def add(self, obs: np.ndarray, next_obs: np.ndarray, action: np.ndarray, reward: np.ndarray,
            done: np.ndarray, infos: list[dict[str, Any]]) -> None:
        """SB3's ``add``: one step of the ``n_envs`` envs, one row into each env's lane."""
        shape = (self.n_envs, *self.obs_shape)
        self._push({"obs": np.asarray(obs).reshape(shape), "next_obs": np.asarray(next_obs).reshape(shape)},
                   action, reward, done, infos)

    def sample(self, batch_size: int, env: Any = None) -> ReplayBufferSamples:
        """SB3's ``sample``: positions and envs drawn with ``np.random`` as SB3 draws them, the rows
        read as one stamped copy (never torn); ``env`` a ``VecNormalize`` normalizes them."""
        if self.optimize_memory_usage:  # uniform over whole transitions (the module docstring)
            if batch_size == 0:  # SB3 returns an empty batch (and draws nothing)
                return self._samples({f.name: np.empty((0, *f.shape), f.dtype) for f in self.buffer.schema}, env)
            self._draw_as_sb3(batch_size)
            return self._samples(self.buffer.sample(batch_size), env)  # EmptyBufferError when none
        upper_bound = self._upper_bound()
        if upper_bound == 0:
            raise EmptyBufferError("sample: the replay buffer is empty")
        batch_inds = np.random.randint(0, upper_bound, size=batch_size)
        return self._get_samples(batch_inds, env=env)

    def _samples(self, batch: Any, env: Any) -> ReplayBufferSamples:
        actions, dones, rewards = self._tail(batch, env)
        data = (self._normalize_obs(batch["obs"], env), actions, self._normalize_obs(batch["next_obs"], env), dones, rewards)
        return ReplayBufferSamples(*tuple(map(self._own_tensor, data)))

    def _get_samples(self, batch_inds: np.ndarray, env: Any = None) -> ReplayBufferSamples:
        if self.optimize_memory_usage:
            raise ValueError("_get_samples: with optimize_memory_usage=True transitions are drawn by sample(), "
                             "not by SB3's positions (rows there also hold episodes' final observations)")
        env_indices = np.random.randint(0, high=self.n_envs, size=(len(batch_inds),))
        return self._samples(self._take(batch_inds, env_indices), env)


class DictReplayBuffer(Shared, sb3_buffers.DictReplayBuffer):
    """SB3's ``DictReplayBuffer`` over a shmbuffer: each key ``k`` of the observation space is
    the fields ``obs_k`` and ``next_obs_k``."""

    def __init__(
        self, buffer_size: int, observation_space: spaces.Dict, action_space: spaces.Space,
        device: Any = "auto", n_envs: int = 1, optimize_memory_usage: bool = False,
        handle_timeout_termination: bool = True, *, name: str | None = None,
    ) -> None:
        if not isinstance(observation_space, spaces.Dict):
            raise ValueError(f"DictReplayBuffer needs a Dict observation space, got {observation_space}")
        if optimize_memory_usage:  # as SB3's DictReplayBuffer
            raise ValueError("DictReplayBuffer does not support optimize_memory_usage=True (neither does SB3's)")
        self._init_shared(buffer_size, observation_space, action_space, device, n_envs, optimize_memory_usage,
                          handle_timeout_termination, name)

    def _obs_fields(self) -> dict[str, tuple[Any, ...]]:
        out = {}
        for key, space in self.observation_space.spaces.items():
            spec = (tuple(self.obs_shape[key]), space.dtype)
            out[f"obs_{_key(key)}"] = spec
            out[f"next_obs_{_key(key)}"] = spec
        return out

    @property  # type: ignore[override]
    def observations(self) -> dict[str, np.ndarray]:
        """SB3's dict of arrays, one per key of the observation space, as ``ReplayBuffer.observations``."""
        return {k: self._column(f"obs_{_key(k)}") for k in self.observation_space.spaces}

    @observations.setter
    def observations(self, value: dict[str, np.ndarray]) -> None:
        for k, v in value.items():
            self._set_column(f"obs_{_key(k)}", v)

    @property  # type: ignore[override]
    def next_observations(self) -> dict[str, np.ndarray]:
        """SB3's dict of arrays of next observations, as ``observations``."""
        return {k: self._column(f"next_obs_{_key(k)}") for k in self.observation_space.spaces}

    @next_observations.setter
    def next_observations(self, value: dict[str, np.ndarray]) -> None:
        for k, v in value.items():
            self._set_column(f"next_obs_{_key(k)}", v)

    def add(self, obs: dict[str, np.ndarray], next_obs: dict[str, np.ndarray], action: np.ndarray,  # type: ignore[override]
            reward: np.ndarray, done: np.ndarray, infos: list[dict[str, Any]]) -> None:
        """SB3's ``add`` with dict observations: one step of the ``n_envs`` envs."""
        fields = {}
        for key in self.observation_space.spaces:
            shape = (self.n_envs, *self.obs_shape[key])
            fields[f"obs_{_key(key)}"] = np.asarray(obs[key]).reshape(shape)
            fields[f"next_obs_{_key(key)}"] = np.asarray(next_obs[key]).reshape(shape)
        self._push(fields, action, reward, done, infos)

    def sample(self, batch_size: int, env: Any = None) -> DictReplayBufferSamples:  # type: ignore[override]
        """SB3's ``sample`` with dict observations, as ``ReplayBuffer.sample``."""
        upper_bound = self._upper_bound()
        if upper_bound == 0:
            raise EmptyBufferError("sample: the replay buffer is empty")
        batch_inds = np.random.randint(0, upper_bound, size=batch_size)
        return self._get_samples(batch_inds, env=env)

    def _get_samples(self, batch_inds: np.ndarray, env: Any = None) -> DictReplayBufferSamples:  # type: ignore[override]
        env_indices = np.random.randint(0, high=self.n_envs, size=(len(batch_inds),))
        batch = self._take(batch_inds, env_indices)
        keys = list(self.observation_space.spaces)
        obs = self._normalize_obs({k: batch[f"obs_{_key(k)}"] for k in keys}, env)
        next_obs = self._normalize_obs({k: batch[f"next_obs_{_key(k)}"] for k in keys}, env)
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
