"""Env worker processes that step environments with a policy and write straight into a buffer.

::

    with Collector(lambda: gym.make("CartPole-v1"), buf, workers=2, envs_per_worker=4) as col:
        col.warm(1_000)                      # Velora's warm: wait until 1,000 rows are in
        ...train...; col.publish(model)      # workers pick up new weights without pausing anyone
        col.check()                          # re-raise a worker's exception here

Each worker is a ``multiprocess`` process (dill pickles lambdas and closures, so env factories can
be either; forkserver by default, spawn where forkserver is missing). It builds
``envs_per_worker`` environments with the Gymnasium API and steps them together, asking the
policy for all their actions at once. Every step it pushes one row per env into the buffer, into
the env's lane (env ``g`` of ``workers * envs_per_worker`` goes to lane ``g % lanes``), with the
env's current episode id (``g << 32 | episode number``) when the buffer keeps episodes.

Transitions follow Gymnasium's rules: ``done`` is ``terminated`` (the value of ``next_obs`` must not
be bootstrapped); a ``truncated`` episode (a time limit) keeps its final observation as
``next_obs``, is not done, and simply ends: the env is reset and its next row starts a new episode.
A schema with a ``truncated`` field gets that flag too.

Shared state (``multiprocess`` raw arrays, handed to the workers when they start):

* weights: the policy's parameters as one float32 vector under a seqlock: the learner makes the
  version odd, copies, makes it even (``publish``); a worker copies them when the version is even
  and new, then checks the version again and keeps the copy only if it did not change;
* per-worker counters (env steps, episodes, return of recent episodes) readable by the learner;
* a stop flag. Errors travel on a queue.

NOTE (shutdown): ``stop()`` sets the stop flag, joins every worker for ``timeout`` seconds, then
kills the ones left. A worker checks the flag every step and, every half second, that the learner
is alive (by pid and start time, since under forkserver its parent is the fork server), and exits
on its own if not. A worker that raises sends its traceback to the learner, where the next
``check()`` (also run by ``warm``, ``stats`` and a ``Loader`` given the collector) stops every
worker and raises ``WorkerError`` with it. A worker that dies without a word (SIGKILL, a crash)
is found by ``check()`` from its exit code.
"""

from __future__ import annotations

import os
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

import multiprocess
import numpy as np

from . import arguments
from .buffer import BufferHandle, ReplayBuffer
from .errors import ShmBufferError, WaitTimeout
from .progress import Progress
from .shm.segment import process_alive, start_time

RECENT = 100
"""Returns of recent episodes kept per worker."""

# counters columns
STEPS, EPISODES, RETURNS_SEEN, ALIVE = 0, 1, 2, 3


class WorkerError(ShmBufferError, RuntimeError):
    """A collector worker raised or died; the message carries its traceback or exit code."""


Policy = Callable[..., np.ndarray]
"""``policy(model, obs, step) -> actions``: ``obs`` has one row per env of the worker, ``step`` is
the worker's env-step count; ``model`` is the worker's copy of the published model (or None).
A policy that takes ``worker`` and/or ``envs`` keywords (or ``**kwargs``) also gets the worker's
number and its envs' global indices (``worker * envs_per_worker + i``), e.g. for Ape-X's
per-actor epsilons: ``eps = 0.4 ** (1 + 7 * envs / (total - 1))``."""

FIELDS = ("obs", "action", "reward", "next_obs", "done", "truncated")
"""The fields ``default_transition`` gives."""


def _extra_keywords(policy: Callable[..., Any]) -> set[str]:
    """Which of ``worker`` and ``envs`` the policy takes as keywords."""
    import inspect

    try:
        params = inspect.signature(policy).parameters.values()
    except (TypeError, ValueError):
        return set()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return {"worker", "envs"}
    return {p.name for p in params if p.name in ("worker", "envs") and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}


def random_policy(space: Any) -> Policy:
    """A policy that samples each action uniformly from ``space`` (ignores the model)."""
    def act(model: Any, obs: np.ndarray, step: int) -> np.ndarray:
        return np.stack([space.sample() for _ in range(obs.shape[0])])

    return act


def default_transition(
    obs: np.ndarray, action: np.ndarray, reward: np.ndarray, next_obs: np.ndarray,
    terminated: np.ndarray, truncated: np.ndarray,
) -> dict[str, np.ndarray]:
    """The row a collector pushes for one step: ``obs``, ``action``, ``reward``, ``next_obs``, ``done``
    (terminated), ``truncated``."""
    return {"obs": obs, "action": action, "reward": reward, "next_obs": next_obs, "done": terminated,
            "truncated": truncated}


def flatten(model: Any) -> np.ndarray:
    """A torch model's state as one flat float32 array (what ``publish`` writes to shared memory)."""
    import torch

    with torch.no_grad():
        return torch.cat([p.detach().reshape(-1).float().cpu() for p in model.state_dict().values()]).numpy()


def unflatten(model: Any, flat: np.ndarray) -> None:
    """Load a flat array written by ``flatten`` into ``model``'s state, in place."""
    import torch

    state = model.state_dict()
    at = 0
    with torch.no_grad():
        for value in state.values():
            n = value.numel()
            value.copy_(torch.from_numpy(flat[at:at + n]).reshape(value.shape).to(value.dtype))
            at += n


class Collector:
    """Worker processes filling ``buffer`` from envs made by ``env_fn`` (see the module docstring).

    :param env_fn: makes one Gymnasium env (a lambda is fine: workers use ``multiprocess``).
    :param buffer: the buffer the workers attach to and push into, one lane per env when it has
        ``workers * envs_per_worker`` lanes. A buffer that keeps episodes needs at least one lane
        per env; a plain ``lanes=N`` buffer with more lanes than envs is refused (lanes would stay
        empty), one made with ``envs=N`` is not (other writers may fill the other lanes). A
        ``shmbuffer.ray.WriterTarget`` works too: each worker opens it (the shard on its node
        through shared memory, else a remote writer through Ray).
    :param workers: worker processes.
    :param envs_per_worker: envs each worker steps as a vector.
    :param policy: ``policy(model, obs, step) -> actions`` (default: random actions).
    :param model: a torch module whose copy each worker keeps; ``publish`` refreshes the copies.
    :param transition: ``transition(obs, action, reward, next_obs, terminated, truncated)`` maps a
        step to the buffer's fields (default: those names, with ``done`` = terminated; fields the
        schema lacks are dropped).
    :param seed: seeds the envs' resets and each worker's sampling (different for every worker and env).
    :param start_method: ``multiprocess``'s start method (default: forkserver where there is one).
    """

    def __init__(
        self,
        env_fn: Callable[[], Any],
        buffer: ReplayBuffer,
        *,
        workers: int = 2,
        envs_per_worker: int = 1,
        policy: Policy | None = None,
        model: Any = None,
        transition: Callable[..., dict[str, np.ndarray]] = default_transition,
        seed: int = 0,
        start_method: str | None = None,
    ) -> None:
        if workers <= 0 or envs_per_worker <= 0:
            raise ValueError(f"workers and envs_per_worker must be positive, got {workers} and {envs_per_worker}")
        total = workers * envs_per_worker
        if buffer.lanes > total and buffer.options.envs is None:
            # a buffer made with envs=N says its lanes have other writers too (an SB3 learner's
            # envs, other collectors): only a plain lanes=N buffer is surely left partly empty
            raise ValueError(
                f"Collector: the buffer has {buffer.lanes} lanes but {total} envs push into it: "
                f"{buffer.lanes - total} lanes would stay empty (capacity lost); make it with envs={total}"
            )
        if buffer.options.ordered and buffer.lanes < total:
            raise ValueError(
                f"Collector: {total} envs into {buffer.lanes} lane(s) of a buffer that keeps episodes or reads next "
                "observations and older frames from the lane (next_of/stack): several envs' steps would interleave "
                f"in a lane; make the buffer with envs={total} (one lane per env)"
            )
        if transition is default_transition:
            missing = [n for n in buffer.schema.names if n not in FIELDS]
            if missing:
                raise ValueError(
                    f"Collector: the buffer's field(s) {', '.join(map(repr, missing))} are not among the "
                    f"default transition's ({', '.join(FIELDS)}); map a step to your fields with "
                    "transition=lambda obs, action, reward, next_obs, terminated, truncated: {...} "
                    "(cpprb's names: {'obs': obs, 'act': action, 'rew': reward, 'next_obs': next_obs, "
                    "'done': terminated})"
                )
        methods = multiprocess.get_all_start_methods()
        method = start_method or ("forkserver" if "forkserver" in methods else "spawn")
        self._ctx = multiprocess.get_context(method)
        self.buffer = buffer
        self.workers = workers
        self.envs_per_worker = envs_per_worker
        self._model = model
        weights = flatten(model) if model is not None else np.zeros(0, np.float32)
        self._weights = self._ctx.RawArray("f", max(weights.size, 1))
        self._version = self._ctx.RawArray("q", 8)
        self._counters = self._ctx.RawArray("d", workers * 8)
        self._returns = self._ctx.RawArray("d", workers * RECENT)
        self._stop = self._ctx.RawArray("q", 8)
        self._errors = self._ctx.Queue()
        self._stopped = False
        if model is not None:
            self.publish(model)
        learner = (os.getpid(), start_time())
        self._procs = []
        for w in range(workers):
            args = (w, env_fn, buffer.handle, envs_per_worker, policy, model, transition, seed, learner,
                    self._weights, self._version, self._counters, self._returns, self._stop, self._errors)
            p = self._ctx.Process(target=_worker, args=args, daemon=True, name=f"shmbuffer-collector-{w}")
            p.start()
            self._procs.append(p)

    # -- the learner's side ---------------------------------------------------------------------
    def publish(self, model: Any) -> int:
        """Copy ``model``'s parameters to the workers (they load them at their next step);
        returns the new version."""
        flat = flatten(model)
        weights = np.frombuffer(self._weights, np.float32)
        if flat.size != weights.size:
            raise ValueError(f"publish: the model has {flat.size} parameters, the collector was built for {weights.size}")
        version = np.frombuffer(self._version, np.int64)
        version[0] += 1  # odd: being written
        weights[:] = flat
        version[0] += 1  # even: a consistent copy
        return int(version[0]) // 2

    def check(self) -> None:
        """Raise ``WorkerError`` (after stopping every worker) if a worker raised or died."""
        try:
            worker, text = self._errors.get_nowait()
        except queue.Empty:
            pass
        else:
            self.stop()
            raise WorkerError(f"collector worker {worker} raised:\n{text}")
        if self._stopped:
            return
        for w, p in enumerate(self._procs):
            if p.exitcode is not None and not np.frombuffer(self._stop, np.int64)[0]:
                try:  # its last words may still be on their way
                    worker, text = self._errors.get(timeout=0.5)
                    self.stop()
                    raise WorkerError(f"collector worker {worker} raised:\n{text}")
                except queue.Empty:
                    self.stop()
                    raise WorkerError(f"collector worker {w} (pid {p.pid}) died with exit code {p.exitcode}") from None

    def stats(self, window: int = RECENT) -> dict[str, Any]:
        """Env steps, finished episodes and the mean return of each worker's last ``window``
        episodes (at most 100; fewer follow learning more closely), in all and per worker."""
        self.check()
        if not 1 <= window <= RECENT:
            raise ValueError(f"stats: window must be in [1, {RECENT}], got {window!r}")
        c = np.frombuffer(self._counters, np.float64).reshape(self.workers, 8)
        r = np.frombuffer(self._returns, np.float64).reshape(self.workers, RECENT)
        recent = []
        for w in range(self.workers):
            seen = int(c[w, RETURNS_SEEN])
            recent.append(r[w, np.arange(seen - min(seen, window), seen) % RECENT])
        every = np.concatenate(recent)
        return {
            "env_steps": int(c[:, STEPS].sum()),
            "episodes": int(c[:, EPISODES].sum()),
            "recent_return": float(every.mean()) if every.size else float("nan"),
            "workers": [
                {"env_steps": int(c[w, STEPS]), "episodes": int(c[w, EPISODES]),
                 "recent_return": float(recent[w].mean()) if recent[w].size else float("nan")}
                for w in range(self.workers)
            ],
        }

    def warm(self, rows: int, *, timeout: float = 300.0) -> None:
        """Block until the buffer has received ``rows`` rows (Velora's ``warm``)."""
        timeout = arguments.timeout(timeout, "Collector.warm: timeout")
        deadline = time.monotonic() + timeout
        with Progress(f"warm({rows})", rows) as line:  # a line on a terminal, once it takes a while
            while (got := self.buffer.stats["inserted"]) < rows:
                line.update(got)
                self.check()
                if time.monotonic() > deadline:
                    raise WaitTimeout(f"warm({rows}): only {got} rows after {timeout:.0f} s")
                time.sleep(0.01)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop and join every worker (killing those that do not exit in ``timeout``). Idempotent."""
        timeout = arguments.timeout(timeout, "Collector.stop: timeout")
        if self._stopped:
            return
        self._stopped = True
        np.frombuffer(self._stop, np.int64)[0] = 1
        deadline = time.monotonic() + timeout
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(5)

    close = stop

    def __enter__(self) -> Collector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __del__(self) -> None:
        if not getattr(self, "_stopped", True):
            self.stop(timeout=1.0)


# -- the worker's side ------------------------------------------------------------------------


def _worker(
    w: int, env_fn: Callable[[], Any], handle: BufferHandle, n_envs: int, policy: Policy | None, model: Any,
    transition: Callable[..., dict[str, np.ndarray]], seed: int, learner: tuple[int, float],
    weights: Any, version: Any, counters: Any, returns: Any, stop: Any, errors: Any,
) -> None:
    try:
        import torch

        torch.set_num_threads(1)  # both cores are busy: torch's own threads only slow the gather
        _run(w, env_fn, handle, n_envs, policy, model, transition, seed, learner, weights, version, counters,
             returns, stop)
    except BaseException:
        errors.put((w, traceback.format_exc()))
        errors.close()
        errors.join_thread()
        raise SystemExit(1) from None


def _run(
    w: int, env_fn: Callable[[], Any], handle: BufferHandle, n_envs: int, policy: Policy | None, model: Any,
    transition: Callable[..., dict[str, np.ndarray]], seed: int, learner: tuple[int, float],
    weights: Any, version: Any, counters: Any, returns: Any, stop: Any,
) -> None:
    # a writer target (shmbuffer.ray.WriterTarget) opens itself: the shard on this node, or a remote writer
    opener = getattr(handle, "open", None)
    buf = opener(seed=seed + w) if opener is not None else ReplayBuffer.attach(handle, seed=seed + w)
    flags = np.frombuffer(stop, np.int64)
    count = np.frombuffer(counters, np.float64).reshape(-1, 8)[w]
    recent = np.frombuffer(returns, np.float64).reshape(-1, RECENT)[w]
    shared = np.frombuffer(weights, np.float32)
    ver = np.frombuffer(version, np.int64)
    envs = [env_fn() for _ in range(n_envs)]
    act = policy if policy is not None else random_policy(envs[0].action_space)
    first_env = w * n_envs
    wants = _extra_keywords(act)
    extra = {k: v for k, v in (("worker", w), ("envs", first_env + np.arange(n_envs))) if k in wants}
    lanes = (first_env + np.arange(n_envs)) % buf.lanes
    episode_no = np.zeros(n_envs, np.int64)
    keeps_episodes = buf.options.episodes
    names = set(buf.schema.names)
    obs = np.stack([e.reset(seed=seed * 100_003 + first_env + i)[0] for i, e in enumerate(envs)])
    ret = np.zeros(n_envs)
    seen_version = 0
    local = np.empty_like(shared)
    step = 0
    next_check = time.monotonic() + 0.5
    while not flags[0]:
        v = int(ver[0])
        if model is not None and v % 2 == 0 and v != seen_version:
            local[:] = shared
            if int(ver[0]) == v:  # nobody wrote meanwhile: a consistent copy
                unflatten(model, local)
                seen_version = v
        actions = np.asarray(act(model, obs, step, **extra))
        results = [e.step(a) for e, a in zip(envs, actions, strict=True)]
        next_obs = np.stack([r[0] for r in results])
        reward = np.array([r[1] for r in results], np.float64)
        terminated = np.array([r[2] for r in results], bool)
        truncated = np.array([r[3] for r in results], bool)
        rows = transition(obs, actions, reward, next_obs, terminated, truncated)
        rows = {k: v for k, v in rows.items() if k in names}
        episode = (first_env + np.arange(n_envs)) << 32 | episode_no if keeps_episodes else None
        pushed = False
        while not pushed and not flags[0]:  # a rate limiter may hold writers back: keep seeing the flag
            try:
                buf.push(rows, lane=lanes, episode=episode, timeout=0.2)
                pushed = True
            except WaitTimeout:
                if not process_alive(*learner):
                    flags[0] = 1
        if not pushed:
            break
        ret += reward
        step += n_envs
        count[STEPS] = step
        ended = terminated | truncated
        obs = next_obs
        for i in np.flatnonzero(ended):
            recent[int(count[RETURNS_SEEN]) % RECENT] = ret[i]
            count[RETURNS_SEEN] += 1
            count[EPISODES] += 1
            ret[i] = 0
            episode_no[i] += 1
            obs[i] = envs[i].reset()[0]
        if time.monotonic() > next_check:
            next_check = time.monotonic() + 0.5
            if not process_alive(*learner):
                break  # the learner is gone: nobody will read what we push
    buf.close()
