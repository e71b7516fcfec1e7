"""Gymnasium vector envs whose steps go straight into a buffer, in the loop users already write.

::

    buf = sb.ReplayBuffer(schema, 100_000, envs=8)            # one lane per env
    envs = RecordTransitions(gym.make_vec("CartPole-v1", 8), buf)
    obs, _ = envs.reset(seed=0)
    while ...:
        obs, reward, terminated, truncated, info = envs.step(policy(obs))   # rows pushed

    envs = AsyncVectorEnv([make] * 8, buf)   # the same, but each worker process pushes its own rows

The rules a row follows, whoever writes it (those of ``collector.py``):

* one row per real transition of a sub-env, into that env's lane (env ``i`` goes to lane ``i``, or
  ``i % lanes`` when the buffer has fewer lanes and keeps neither episodes nor frames), with the
  env's episode id ``i << 32 | episode number`` when the buffer keeps episodes;
* ``done`` (and ``terminated``) is ``terminated``; a truncated episode keeps its final observation
  as ``next_obs`` and is not done; a schema with ``truncated`` gets the flag;
* the fields a step fills are ``obs``, ``action``, ``reward``, ``next_obs``, ``done``,
  ``terminated`` and ``truncated``: a schema may hold any of them, and no others.

Autoreset (how a vector env starts a sub-env's next episode) decides which step is a transition:

* ``AutoresetMode.NEXT_STEP`` (Gymnasium 1.x's default): the step after a terminated or truncated
  one resets the env and ignores its action; it is not a transition, and no row is written for it;
* ``AutoresetMode.SAME_STEP``: the step that ends an episode returns the reset observation, and
  the final one is in ``info["final_obs"]``: that is the row's ``next_obs``. Gymnasium 0.29 did the
  same with ``info["final_observation"]``, which is read too;
* ``AutoresetMode.DISABLED``: the user resets ended envs with ``reset(options={"reset_mask": m})``;
  every step is a transition.

The mode is read from ``envs.metadata["autoreset_mode"]``; an env without it follows the installed
Gymnasium's default (next-step from 1.0, same-step before), or the ``autoreset_mode`` given.

A push that fails (a rate limiter's ``WaitTimeout``, say) loses exactly that step's rows, and its
error says so; the recorder follows the envs all the same (their observations, resets and episode
numbers), so the rows of the steps after it are right. The error carries what the envs returned as
``.result`` (``obs, reward, terminated, truncated, info``), so that a loop can go on from it. In ``AsyncVectorEnv`` such an error ends
the worker, as any error does in Gymnasium's workers, and the main process is told which env's
step was not pushed.

EnvPool (``envpool.make(..., env_type="gymnasium")``) is such a vector env, next-step: its
synchronous ``step`` is recorded as above. Its asynchronous API is recorded too:
``async_reset()``, then ``send(actions, env_id)`` and ``recv()``, whose batch holds whichever envs
are ready, named by ``info["env_id"]``: each env's row goes into its own lane, from that env's
last observation and the action last sent to it, and the batch that brings an env's first
observation (after ``async_reset``, or EnvPool's autoreset step after an episode ended) writes no
row for it.

``AsyncVectorEnv`` needs none of this: its workers (Gymnasium's own, through the ``worker=`` hook)
wrap each sub-env in a recorder that sees the env's own ``reset`` and ``step`` calls, where every
step is a transition whatever the mode. A worker killed mid-push leaves no torn row: the buffer's
commit stamps (``protocol/ring.py``) never let a reader see a row being written.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import gymnasium
import numpy as np

from .buffer import BufferHandle, ReplayBuffer
from .errors import SchemaError, ShmBufferError

FIELDS = ("obs", "action", "reward", "next_obs", "done", "terminated", "truncated")
"""The fields a step fills."""

NEXT_STEP, SAME_STEP, DISABLED = "NextStep", "SameStep", "Disabled"
"""The values of Gymnasium's ``AutoresetMode`` (strings, so that 0.29, which has no enum, reads them too)."""


def check_fits(schema: Any, observation_space: Any, action_space: Any, who: str) -> None:
    """Refuse a schema that does not fit the env, naming the field, what the env gives and what
    the schema holds."""
    unknown = [n for n in schema.names if n not in FIELDS]
    if unknown:
        raise SchemaError(
            f"{who}: field {unknown[0]!r}: expected the fields a step fills ({', '.join(FIELDS)}), got a schema "
            f"with {', '.join(map(repr, unknown))}; rename it, or push your own rows with buf.push"
        )
    for name, space in (("obs", observation_space), ("next_obs", observation_space), ("action", action_space)):
        if name not in schema.names:
            continue
        shape, dtype = getattr(space, "shape", None), getattr(space, "dtype", None)
        if shape is None or dtype is None:
            raise SchemaError(
                f"{who}: field {name!r}: expected an array space (Box, Discrete, MultiDiscrete, ...), got "
                f"{space}; flatten it first (gymnasium.wrappers.vector.FlattenObservation)"
            )
        field = schema[name]
        fits = field.shape == tuple(shape) or (tuple(shape) == () and field.shape == (1,))
        if not fits or not np.can_cast(dtype, field.dtype, "same_kind"):
            raise SchemaError(
                f"{who}: field {name!r}: expected {tuple(shape)} {np.dtype(dtype)} (the env's {space}), got "
                f"{field.describe()} in the schema; make the field ({tuple(shape)}, {np.dtype(dtype).name!r})"
            )


def lanes_of(buf: ReplayBuffer, num_envs: int, who: str) -> np.ndarray:
    """Each sub-env's lane; refuses a buffer that would interleave envs where order matters."""
    if buf.lanes >= num_envs:
        return np.arange(num_envs)
    if buf.options.ordered:
        raise ValueError(
            f"{who}: {num_envs} envs into {buf.lanes} lane(s) of a buffer that keeps episodes or frames: "
            f"envs' steps would interleave in a lane; make the buffer with envs={num_envs} (one lane per env)"
        )
    return np.arange(num_envs) % buf.lanes


def _default_mode() -> str:
    major = int(gymnasium.__version__.split(".")[0])
    return NEXT_STEP if major >= 1 else SAME_STEP


def _mode_of(env: Any, given: Any) -> str:
    mode = given if given is not None else (getattr(env, "metadata", None) or {}).get("autoreset_mode")
    if mode is None:
        return _default_mode()
    value = getattr(mode, "value", mode)
    if value not in (NEXT_STEP, SAME_STEP, DISABLED):
        raise ValueError(f"autoreset_mode: expected one of {NEXT_STEP}, {SAME_STEP}, {DISABLED}, got {mode!r}")
    return str(value)


def _row(names: set[str], obs: Any, action: Any, reward: Any, next_obs: Any, terminated: Any,
         truncated: Any) -> dict[str, Any]:
    """The fields of ``names`` for a batch of transitions."""
    row = {"obs": obs, "action": action, "reward": reward, "next_obs": next_obs, "done": terminated,
           "terminated": terminated, "truncated": truncated}
    return {k: v for k, v in row.items() if k in names}


def _raise_saying(exc: BaseException, what: str, result: Any = None) -> NoReturn:
    """Raise ``exc`` saying ``what`` first: as a new one of its type, chained to it (shmbuffer's
    errors take one message), whose text crosses a worker's pipe; any other with ``what`` as a note.
    ``result``, what the envs' step returned, goes with it as ``.result``: the loop can go on."""
    if isinstance(exc, ShmBufferError) and len(exc.args) == 1 and isinstance(exc.args[0], str):
        said = type(exc)(f"{what}: {exc.args[0]}")
        said.result = result  # type: ignore[attr-defined]
        raise said from exc
    if hasattr(exc, "add_note"):  # Python 3.11+
        exc.add_note(what)
    if result is not None and isinstance(exc, Exception):
        exc.result = result  # type: ignore[attr-defined]
    raise exc


# 0.29 calls it VectorEnvWrapper
_VectorWrapper: Any = getattr(gymnasium.vector, "VectorWrapper", None) or getattr(gymnasium.vector, "VectorEnvWrapper")  # noqa: B009

FINAL_KEYS = ("final_obs", "final_observation")
"""Where a same-step vector env puts the final observations: Gymnasium 1.x, 0.29."""


class RecordTransitions(_VectorWrapper):
    """A vector env whose every ``step`` pushes its transitions into ``buf`` (see the module
    docstring for the rules of a row and the autoreset modes).

    Works on ``SyncVectorEnv``, ``AsyncVectorEnv`` and any env with the vector step API
    (``num_envs``, ``single_observation_space``, ``single_action_space``, ``reset``, ``step``).

    :param envs: the vector env.
    :param buf: the buffer; one lane per env (``envs=N``) keeps each env's steps in order.
    :param autoreset_mode: how ``envs`` resets ended sub-envs, when ``envs.metadata`` does not say.
    """

    def __init__(self, envs: Any, buf: ReplayBuffer, *, autoreset_mode: Any = None) -> None:
        if isinstance(envs, gymnasium.vector.VectorEnv):
            super().__init__(envs)
        else:  # the vector step API without the class (EnvPool-style): the wrapper's properties read self.env
            self.env = envs
            self._observation_space = self._action_space = None
            self._single_observation_space = self._single_action_space = None
            self._metadata = None
        self.buffer = buf
        self.autoreset_mode = _mode_of(envs, autoreset_mode)
        # an env that does not state its mode but puts final observations in info is same-step (0.29's)
        self._guessed = autoreset_mode is None and "autoreset_mode" not in (getattr(envs, "metadata", None) or {})
        n = envs.num_envs
        check_fits(buf.schema, envs.single_observation_space, envs.single_action_space, "RecordTransitions")
        lanes = lanes_of(buf, n, "RecordTransitions")
        self._names = set(buf.schema.names)
        self._episodes = buf.options.episodes  # both fixed at creation: read once, not each step
        self._lane_of = lanes if buf.lanes > 1 else None  # one lane: a push names none
        self._obs: np.ndarray | None = None
        self._resetting = np.zeros(n, bool)  # next-step mode: these envs' next step is their reset
        self._episode = np.full(n, -1, np.int64)
        self._ids = np.arange(n, dtype=np.int64) << 32
        self._sent: np.ndarray | None = None  # EnvPool's send: each env's action waiting for its recv

    def reset(self, *, seed: int | list[int] | None = None, options: dict[str, Any] | None = None) -> Any:
        """Reset the envs (those of ``options["reset_mask"]`` when given); each starts an episode."""
        mask = options.get("reset_mask") if isinstance(options, dict) else None  # before: the env pops it
        obs, info = self.env.reset(seed=seed, options=options)
        obs = np.array(obs)  # a copy: an async env's shared observations change at the next step
        if mask is None or self._obs is None:
            self._obs = obs
            self._episode += 1
            self._resetting[:] = False
        else:
            mask = np.asarray(mask, bool)
            self._obs[mask] = obs[mask]
            self._episode[mask] += 1
            self._resetting[mask] = False
        return obs, info

    def step(self, actions: Any) -> Any:
        """Step the envs and push one row per env that made a transition."""
        obs, reward, terminated, truncated, info = self.env.step(actions)
        before = self._obs
        if before is None:
            raise RuntimeError("RecordTransitions: step before reset; call reset() first")
        obs = np.array(obs)
        terminated = np.asarray(terminated, bool)
        truncated = np.asarray(truncated, bool)
        ended = terminated | truncated
        if self._guessed and ended.any() and any(k in info for k in FINAL_KEYS):
            self.autoreset_mode, self._guessed = SAME_STEP, False
        moved = ~self._resetting if self.autoreset_mode == NEXT_STEP else np.ones(self.num_envs, bool)
        try:
            if moved.any():
                self._push(before, obs, actions, reward, terminated, truncated, info, moved, ended)
        except BaseException as exc:
            _raise_saying(exc, f"RecordTransitions: this step's {int(moved.sum())} rows (envs "
                               f"{np.flatnonzero(moved).tolist()}) were not pushed and are lost; the recorder "
                               "follows the envs, so the steps after it are recorded as usual (the step's "
                               "result is the error's .result)", (obs, reward, terminated, truncated, info))
        finally:  # the envs stepped, pushed or not: so does the recorder
            if self.autoreset_mode == NEXT_STEP:
                self._episode += self._resetting  # one a reset env: one ufunc, no boolean-mask indexing
                self._resetting = moved & ended
            elif self.autoreset_mode == SAME_STEP:
                self._episode[ended] += 1
            self._obs = obs
        return obs, reward, terminated, truncated, info

    def _push(self, before: np.ndarray, obs: np.ndarray, actions: Any, reward: Any, terminated: np.ndarray,
              truncated: np.ndarray, info: dict[str, Any], moved: np.ndarray, ended: np.ndarray) -> None:
        """Push the transitions of the ``moved`` envs, from ``before`` to ``obs``."""
        next_obs = obs
        if self.autoreset_mode == SAME_STEP and ended.any():
            next_obs = obs.copy()
            next_obs[ended] = self._final(info, ended)
        at: Any = slice(None) if moved.all() else moved  # most steps: views, not boolean-mask copies
        rows = _row(self._names, before[at], np.asarray(actions)[at], np.asarray(reward)[at],
                    next_obs[at], terminated[at], truncated[at])
        episode = (self._ids | self._episode)[at] if self._episodes else None
        self.buffer.push(rows, lane=None if self._lane_of is None else self._lane_of[at], episode=episode)

    # -- EnvPool's asynchronous API ------------------------------------------------------------
    def async_reset(self) -> None:
        """Reset every env without waiting (EnvPool's ``async_reset``): each env's next batch from
        ``recv`` holds its first observation, not a transition."""
        self.env.async_reset()
        space = self.env.single_observation_space
        self._obs = np.zeros((self.num_envs, *space.shape), space.dtype)
        self._resetting[:] = True

    def send(self, actions: Any, env_id: Any = None) -> None:
        """Send ``actions`` to the envs ``env_id`` (default: all), as EnvPool's ``send``; the
        actions are kept for the transitions ``recv`` completes."""
        ids = np.arange(self.num_envs) if env_id is None else np.asarray(env_id, np.int64)
        actions = np.asarray(actions)
        if actions.shape[:1] != ids.shape:
            raise ValueError(f"RecordTransitions.send: expected one action per env id ({ids.size}), got actions of "
                             f"shape {actions.shape}")
        if self._sent is None:
            self._sent = np.zeros((self.num_envs, *actions.shape[1:]), actions.dtype)
        self.env.send(actions, env_id)
        self._sent[ids] = actions

    def recv(self) -> Any:
        """The next batch of ready envs (EnvPool's ``recv``): a row for each env in it whose step
        was a transition (not its first observation after a reset, not the autoreset step after
        its episode ended), into the env's lane ``info["env_id"]``."""
        if self._sent is None and not self._resetting.all():
            raise RuntimeError("RecordTransitions.recv: call async_reset() (or reset()) and send() first")
        obs, reward, terminated, truncated, info = self.env.recv()
        ids = np.asarray(info["env_id"], np.int64)
        obs = np.asarray(obs)  # a new array each recv; its rows are copied into self._obs below
        terminated = np.asarray(terminated, bool)
        truncated = np.asarray(truncated, bool)
        moved = ~self._resetting[ids]
        assert self._obs is not None
        try:
            if moved.any():
                assert self._sent is not None
                now: Any = slice(None) if moved.all() else moved  # most batches: views, not boolean-mask copies
                at = ids[now]
                rows = _row(self._names, self._obs[at], self._sent[at], np.asarray(reward)[now], obs[now],
                            terminated[now], truncated[now])
                episode = (self._ids | self._episode)[at] if self._episodes else None
                self.buffer.push(rows, lane=None if self._lane_of is None else self._lane_of[at], episode=episode)
        except BaseException as exc:
            _raise_saying(exc, f"RecordTransitions.recv: this batch's {int(moved.sum())} rows (envs "
                               f"{ids[moved].tolist()}) were not pushed and are lost; the recorder follows the envs, "
                               "so the batches after it are recorded as usual (the batch is the error's .result: "
                               "send its envs their actions)", (obs, reward, terminated, truncated, info))
        finally:  # the envs stepped, pushed or not: so does the recorder
            self._episode[ids[~moved]] += 1  # a first observation: an episode starts
            self._resetting[ids] = moved & (terminated | truncated)
            self._obs[ids] = obs
        return obs, reward, terminated, truncated, info

    def __enter__(self) -> RecordTransitions:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _final(self, info: dict[str, Any], ended: np.ndarray) -> np.ndarray:
        """The final observations of the ``ended`` envs from a same-step ``info`` (1.x or 0.29 keys)."""
        for key in FINAL_KEYS:
            if key in info:
                return np.stack([np.asarray(info[key][i]) for i in np.flatnonzero(ended)])
        raise ValueError(
            "RecordTransitions: an env ended in same-step autoreset mode but info has neither 'final_obs' "
            f"(Gymnasium 1.x) nor 'final_observation' (0.29), got keys {sorted(info)}; pass the env's "
            "autoreset_mode if it is not same-step"
        )


class _Recorded:
    """One sub-env inside a worker process, pushing each of its steps into the buffer: it sees the
    env's own ``reset`` and ``step`` calls, so every step is a transition whatever the autoreset mode."""

    def __init__(self, env_fn: Callable[[], Any], handle: BufferHandle, index: int, lane: int) -> None:
        self.env = env_fn()
        self.buffer = ReplayBuffer.attach(handle)
        self._names = set(self.buffer.schema.names)
        self._lane = lane if self.buffer.lanes > 1 else None
        self._id = index << 32
        self._episode = -1
        self._obs: Any = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.env, name)

    def get_wrapper_attr(self, name: str) -> Any:
        """The env's attribute (``AsyncVectorEnv.call`` and ``get_attr`` ask for it)."""
        inner = getattr(self.env, "get_wrapper_attr", None)
        return inner(name) if inner is not None else getattr(self.env, name)

    def set_wrapper_attr(self, name: str, value: Any) -> None:
        """Set the env's attribute (``AsyncVectorEnv.set_attr``)."""
        inner = getattr(self.env, "set_wrapper_attr", None)
        if inner is not None:
            inner(name, value)
        else:
            setattr(self.env, name, value)

    def reset(self, **kwargs: Any) -> Any:
        """Reset the env: a new episode starts."""
        obs, info = self.env.reset(**kwargs)
        self._obs = np.array(obs)
        self._episode += 1
        return obs, info

    def step(self, action: Any) -> Any:
        """Step the env and push the transition."""
        obs, reward, terminated, truncated, info = self.env.step(action)
        rows = _row(self._names, self._obs[None], np.asarray(action)[None], np.asarray([reward]), np.asarray(obs)[None],
                    np.asarray([terminated], bool), np.asarray([truncated], bool))
        episode = self._id | self._episode if self.buffer.options.episodes else None
        try:
            self.buffer.push(rows, lane=self._lane, episode=episode)
        except Exception as exc:  # Gymnasium ends the worker and re-raises the error's message in the main process
            _raise_saying(exc, f"AsyncVectorEnv: env {self._id >> 32}'s step was not pushed, and its worker ends "
                               "(Gymnasium ends a worker at any error); close() the envs and make them again")
        self._obs = np.array(obs)
        return obs, reward, terminated, truncated, info

    def close(self) -> None:
        """Close the env and this process's mapping of the buffer (let go of, when the traceback of
        the error that ends the worker still holds views of it: the process ends anyway)."""
        try:
            self.env.close()
        finally:
            self.buffer.__exit__(None, None, None)  # an attached buffer: closed, never unlinked


def _worker(handle: BufferHandle, lanes: tuple[int, ...], index: int, env_fn: Callable[[], Any], *rest: Any) -> None:
    """Gymnasium's own worker, stepping a sub-env that pushes its rows itself."""
    from gymnasium.vector.async_vector_env import _async_worker

    _async_worker(index, functools.partial(_Recorded, env_fn, handle, index, lanes[index]), *rest)


class AsyncVectorEnv(gymnasium.vector.AsyncVectorEnv):
    """Gymnasium's ``AsyncVectorEnv`` whose worker processes push each transition into ``buf``
    themselves (attached by handle, each sub-env into its lane), so no transition is sent to the
    main process to be pushed from there. The main loop is Gymnasium's: it still gets the
    observations, rewards and infos for its policy. A sub-env's error reaches the main process as
    Gymnasium's do; ``close()`` ends the workers, each closing its mapping of the buffer (the
    buffer itself stays the caller's).

    :param env_fns: one function per sub-env, making it.
    :param buf: the buffer; one lane per env (``envs=len(env_fns)``) keeps each env's steps in order.
    :param gymnasium_kwargs: ``AsyncVectorEnv``'s own (``shared_memory``, ``context``,
        ``autoreset_mode``, ...), all but ``worker``.
    """

    def __init__(self, env_fns: Sequence[Callable[[], Any]], buf: ReplayBuffer, **gymnasium_kwargs: Any) -> None:
        if "worker" in gymnasium_kwargs:
            raise ValueError("AsyncVectorEnv: worker= is taken (its workers write the rows); use "
                             "gymnasium.vector.AsyncVectorEnv with RecordTransitions for a worker of your own")
        self.buffer = buf
        lanes = lanes_of(buf, len(env_fns), "AsyncVectorEnv")  # before any process starts
        super().__init__(env_fns, worker=functools.partial(_worker, buf.handle, tuple(int(x) for x in lanes)),
                         **gymnasium_kwargs)
        try:
            check_fits(buf.schema, self.single_observation_space, self.single_action_space, "AsyncVectorEnv")
        except BaseException:
            self.close(terminate=True)
            raise
