"""EnvPool into a buffer: env steps per second of an EnvPool pool (synchronous ``step``, 8 envs,
random actions) whose every transition is stored, three ways in the same run::

    python -m benchmarks.envpool_envs                 # 3 interleaved rounds, 3 s a run
    python -m benchmarks.envpool_envs --quick         # 1 round, 1 s a run
    python -m benchmarks.envpool_envs --out results/envpool.json

- ``shmbuffer``: the pool wrapped in ``shmbuffer.vector.RecordTransitions``: each ``step`` pushes
  the step's transitions (one row per env that moved, into its lane) in one ``push``;
- ``cpprb``: the loop a cpprb user writes: ``step``, then ``ReplayBuffer.add(**fields)`` of the
  envs that moved (EnvPool's autoreset step is not a transition);
- ``sb3``: the same with Stable-Baselines3's ``ReplayBuffer(n_envs=8).add``, which takes every env
  each call: the autoreset step is stored (SB3's buffer has no way to leave an env out), as an SB3
  user of EnvPool gets it.

The asynchronous loop (``--loops async``; both by default): ``ASYNC_ENVS`` envs stepped
``ENVS`` at a time by EnvPool's ``send``/``recv`` (``batch_size=ENVS``), so that the threads step
one batch while the main thread stores the other. Every subject runs the same loop: ``recv``,
store the batch, ``send`` its envs their actions: ``shmbuffer`` by ``RecordTransitions.recv``/
``send`` (the push inside ``recv``); ``cpprb`` and ``sb3`` from each env's last observation and
action, keyed by ``info["env_id"]``, as a user writes it (cpprb leaves out the batch's first
observations and autoreset steps; SB3's ``n_envs=ENVS`` buffer stores the batch as it comes).

EnvPool runs ``THREADS`` threads in both loops. Envs: CartPole-v1 (obs 4 float32) and, where the
installed EnvPool runs it, Pong-v5 (obs (4, 84, 84) uint8). Rounds interleave the subjects;
medians and same-run ratios are reported, with ``envpool alone`` (the same loop, storing nothing)
as the bound: no store can make a loop faster than that. Say how loaded the machine was.
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

import numpy as np

import shmbuffer as sb

ENVS = 8
ASYNC_ENVS = 16
"""Envs of the asynchronous loop: two batches of ``ENVS``, one stepping while the other is stored."""
THREADS = 2
CAPACITY = 200_000
"""Rows a store holds, at most ``MEMORY`` bytes of observations (every peer allocates it up front)."""
MEMORY = 1 << 30


def capacity_of(env: Any) -> int:
    space = env.single_observation_space
    row = 2 * int(np.prod(space.shape)) * np.dtype(space.dtype).itemsize  # obs and next_obs
    return min(CAPACITY, MEMORY // row // ENVS * ENVS)


def pool(env_id: str, envs: int = ENVS) -> Any:
    """An EnvPool pool of ``envs`` envs stepped ``ENVS`` at a time by ``THREADS`` threads."""
    import envpool

    with warnings.catch_warnings():
        # EnvPool's CartPole bounds are float64, which Gymnasium's Box casts (spaces made when first read)
        warnings.filterwarnings("ignore", ".*precision lowered by casting", UserWarning)
        env = envpool.make(env_id, env_type="gymnasium", num_envs=envs, batch_size=ENVS, seed=0,
                           num_threads=THREADS)
        env.single_observation_space, env.single_action_space  # noqa: B018
        return _Clocked(env)


IN_ENVPOOL = [0.0, 0.0]
"""Seconds spent in EnvPool's ``step``, ``send`` and ``recv`` (``_Clocked``), for ``_timed``: wall-clock
and the main thread's CPU time."""


class _Clocked:
    """An EnvPool pool whose ``step``, ``send`` and ``recv`` add their time to ``IN_ENVPOOL``: the
    rest of the main thread's CPU time is the store's and the loop's own, which another process's
    load on the machine disturbs far less than the steps per second."""

    def __init__(self, env: Any) -> None:
        self.env = env

    def __getattr__(self, name: str) -> Any:
        return getattr(self.env, name)

    def _clocked(self, call: Any, *args: Any) -> Any:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return call(*args)
        finally:
            IN_ENVPOOL[0] += time.perf_counter() - t0
            IN_ENVPOOL[1] += time.thread_time() - c0

    def step(self, actions: Any) -> Any:
        return self._clocked(self.env.step, actions)

    def send(self, actions: Any, env_id: Any = None) -> Any:
        return self._clocked(self.env.send, actions, env_id)

    def recv(self) -> Any:
        return self._clocked(self.env.recv)


def schema_of(env: Any) -> sb.Schema:
    space = env.single_observation_space
    return sb.Schema(obs=(space.shape, space.dtype), action=((), "int64"), reward=((), "float32"),
                     next_obs=(space.shape, space.dtype), done=((), "bool"), truncated=((), "bool"))


def _timed(step: Any, seconds: float) -> tuple[float, float, float]:
    """Env steps per wall-clock second, per CPU-second of this process (its EnvPool threads
    included: on a machine loaded by other work, the cost that the wall clock hides), and the
    main thread's CPU microseconds an env step outside EnvPool's calls (the store and the loop)."""
    for _ in range(20):  # warm up
        step()
    steps, t0, c0, m0 = 0, time.perf_counter(), time.process_time(), time.thread_time()
    IN_ENVPOOL[:] = [0.0, 0.0]
    while (now := time.perf_counter()) - t0 < seconds:
        step()
        steps += ENVS
    main = time.thread_time() - m0 - IN_ENVPOOL[1]
    return steps / (now - t0), steps / (time.process_time() - c0), main / steps * 1e6


def run_ours(env_id: str, seconds: float) -> tuple[float, float, float]:
    from shmbuffer.vector import RecordTransitions

    env = pool(env_id)
    n = int(env.single_action_space.n)
    with sb.ReplayBuffer(schema_of(env), capacity_of(env), envs=ENVS) as buf:
        rec = RecordTransitions(env, buf)
        rng = np.random.default_rng(0)
        rec.reset()
        try:
            return _timed(lambda: rec.step(rng.integers(0, n, ENVS)), seconds)
        finally:
            rec.close()


def run_cpprb(env_id: str, seconds: float) -> tuple[float, float, float]:
    env = pool(env_id)
    n = int(env.single_action_space.n)
    rb = cpprb_buffer(env)
    rng = np.random.default_rng(0)
    state = {"obs": env.reset()[0], "resetting": np.zeros(ENVS, bool)}

    def step() -> None:
        actions = rng.integers(0, n, ENVS)
        obs, reward, terminated, truncated, _ = env.step(actions)
        moved = ~state["resetting"]  # EnvPool's autoreset step is not a transition
        rb.add(obs=state["obs"][moved], act=actions[moved], rew=reward[moved], next_obs=obs[moved],
               done=terminated[moved], truncated=truncated[moved])
        state["resetting"] = terminated | truncated
        state["obs"] = obs

    try:
        return _timed(step, seconds)
    finally:
        env.close()


def run_sb3(env_id: str, seconds: float) -> tuple[float, float, float]:
    from stable_baselines3.common.buffers import ReplayBuffer

    env = pool(env_id)
    n = int(env.single_action_space.n)
    rb = ReplayBuffer(capacity_of(env), env.single_observation_space, env.single_action_space, device="cpu", n_envs=ENVS,
                      optimize_memory_usage=False, handle_timeout_termination=True)
    rng = np.random.default_rng(0)
    state = {"obs": env.reset()[0]}
    infos = [{} for _ in range(ENVS)]

    def step() -> None:
        actions = rng.integers(0, n, ENVS)
        obs, reward, terminated, truncated, _ = env.step(actions)
        for i in range(ENVS):
            infos[i]["TimeLimit.truncated"] = bool(truncated[i] and not terminated[i])
        rb.add(state["obs"], obs, actions, reward, terminated | truncated, infos)
        state["obs"] = obs

    try:
        return _timed(step, seconds)
    finally:
        env.close()


def run_alone(env_id: str, seconds: float) -> tuple[float, float, float]:
    env = pool(env_id)
    n = int(env.single_action_space.n)
    rng = np.random.default_rng(0)
    env.reset()
    try:
        return _timed(lambda: env.step(rng.integers(0, n, ENVS)), seconds)
    finally:
        env.close()


def cpprb_buffer(env: Any) -> Any:
    import cpprb

    space = env.single_observation_space
    return cpprb.ReplayBuffer(capacity_of(env), {"obs": {"shape": space.shape, "dtype": space.dtype}, "act": {"shape": 1},
                                                 "rew": {}, "next_obs": {"shape": space.shape, "dtype": space.dtype},
                                                 "done": {}, "truncated": {}})


def async_loop(env_id: str, seconds: float, store: Any) -> tuple[float, float, float]:
    """The asynchronous loop: ``recv`` a batch, ``store(env, batch, actions sent before)``, ``send``
    the batch's envs their actions; ``env`` is ``store``'s to wrap (``RecordTransitions``)."""
    env = pool(env_id, ASYNC_ENVS)
    n = int(env.single_action_space.n)
    rng = np.random.default_rng(0)
    state = store(env, None, None)  # the store's setup; it returns what it steps with
    sent = np.zeros(ASYNC_ENVS, np.int64)
    state.async_reset()

    def step() -> None:
        batch = state.recv()
        ids = batch[4]["env_id"]
        actions = rng.integers(0, n, ids.shape[0])
        store(state, batch, sent)
        state.send(actions, ids)
        sent[ids] = actions

    try:
        return _timed(step, seconds)
    finally:
        env.close()


def async_ours(env_id: str, seconds: float) -> tuple[float, float, float]:
    from shmbuffer.vector import RecordTransitions

    buf: list[sb.ReplayBuffer] = []

    def store(env: Any, batch: Any, sent: Any) -> Any:
        if batch is None:  # the pool's envs into their lanes; RecordTransitions.recv pushes
            buf.append(sb.ReplayBuffer(schema_of(env), capacity_of(env) // ASYNC_ENVS * ASYNC_ENVS, envs=ASYNC_ENVS))
            return RecordTransitions(env, buf[0])
        return env

    try:
        return async_loop(env_id, seconds, store)
    finally:
        buf[0].close()


class _Keyed:
    """A peer's memory of each env in the asynchronous loop: its last observation, and whether
    its next batch is a first observation (after ``async_reset`` or an episode's end)."""

    def __init__(self, env: Any) -> None:
        space = env.single_observation_space
        self.env = env
        self.obs = np.zeros((ASYNC_ENVS, *space.shape), space.dtype)
        self.resetting = np.ones(ASYNC_ENVS, bool)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.env, name)


def async_cpprb(env_id: str, seconds: float) -> tuple[float, float, float]:
    rb: list[Any] = []

    def store(env: Any, batch: Any, sent: Any) -> Any:
        if batch is None:
            rb.append(cpprb_buffer(env))
            return _Keyed(env)
        obs, reward, terminated, truncated, info = batch
        ids = info["env_id"]
        moved = ~env.resetting[ids]  # a first observation is not a transition
        at = ids[moved]
        rb[0].add(obs=env.obs[at], act=sent[at], rew=reward[moved], next_obs=obs[moved], done=terminated[moved],
                  truncated=truncated[moved])
        env.resetting[ids] = moved & (terminated | truncated)
        env.obs[ids] = obs
        return env

    return async_loop(env_id, seconds, store)


def async_sb3(env_id: str, seconds: float) -> tuple[float, float, float]:
    from stable_baselines3.common.buffers import ReplayBuffer

    rb: list[Any] = []
    infos = [{} for _ in range(ENVS)]

    def store(env: Any, batch: Any, sent: Any) -> Any:
        if batch is None:
            rb.append(ReplayBuffer(capacity_of(env), env.single_observation_space, env.single_action_space,
                                   device="cpu", n_envs=ENVS, optimize_memory_usage=False,
                                   handle_timeout_termination=True))
            return _Keyed(env)
        obs, reward, terminated, truncated, info = batch
        ids = info["env_id"]
        for i in range(ENVS):
            infos[i]["TimeLimit.truncated"] = bool(truncated[i] and not terminated[i])
        rb[0].add(env.obs[ids], obs, sent[ids], reward, terminated | truncated, infos)
        env.obs[ids] = obs
        return env

    return async_loop(env_id, seconds, store)


def async_alone(env_id: str, seconds: float) -> tuple[float, float, float]:
    return async_loop(env_id, seconds, lambda env, batch, sent: env)


SUBJECTS = {"shmbuffer": run_ours, "cpprb": run_cpprb, "sb3": run_sb3, "envpool alone": run_alone}
ASYNC_SUBJECTS = {"shmbuffer": async_ours, "cpprb": async_cpprb, "sb3": async_sb3, "envpool alone": async_alone}
LOOPS = {"sync": SUBJECTS, "async": ASYNC_SUBJECTS}
STORES = ("shmbuffer", "cpprb", "sb3")


def runs(env_id: str) -> bool:
    """Whether the installed EnvPool makes and steps ``env_id``."""
    try:
        env = pool(env_id)
        env.reset()
        env.step(np.zeros(ENVS, np.int64))
        env.close()
        return True
    except Exception as exc:  # an env the wheel lacks, or one that fails to start
        print(f"{env_id}: not run ({type(exc).__name__}: {exc})", file=sys.stderr)
        return False


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.envpool_envs", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="1 round, 1 s a run")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--seconds", type=float, default=3.0, help="length of a run (default 3)")
    p.add_argument("--envs", default="CartPole-v1,Pong-v5", help="EnvPool env ids, comma-separated")
    p.add_argument("--loops", default="sync,async", help="sync, async or both (default), comma-separated")
    p.add_argument("--out", type=Path, help="write the results as JSON")
    args = p.parse_args(argv)
    rounds, seconds = (1, 1.0) if args.quick else (args.rounds, args.seconds)
    out: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                       "load": os.getloadavg()}, "threads": THREADS, "envs": {}}
    for env_id in args.envs.split(","):
        if not runs(env_id):
            continue
        for loop in args.loops.split(","):
            subjects = LOOPS[loop]
            got: dict[str, list[float]] = {name: [] for name in subjects}
            cpu: dict[str, list[float]] = {name: [] for name in subjects}
            outside: dict[str, list[float]] = {name: [] for name in subjects}
            for r in range(rounds):
                order = list(subjects)[r % len(subjects):] + list(subjects)[:r % len(subjects)]
                for name in order:
                    wall, per_cpu, us = subjects[name](env_id, seconds)
                    got[name].append(wall)
                    cpu[name].append(per_cpu)
                    outside[name].append(us)
            res: dict[str, Any] = {"steps_per_s": got, "steps_per_cpu_s": cpu, "us_outside_envpool": outside}
            out_med = {name: statistics.median(v) for name, v in outside.items()}
            res["store_us_outside_envpool"] = {name: out_med[name] - out_med["envpool alone"] for name in STORES}
            for kind, runs_ in (("wall", got), ("cpu", cpu)):
                med = {name: statistics.median(v) for name, v in runs_.items()}
                # what storing costs an env step: its time with the store less EnvPool's alone (same run)
                cost = {name: 1e6 / med[name] - 1e6 / med["envpool alone"] for name in STORES}
                res[kind] = {"median": med, "store_us_per_env_step": cost,
                             "ratio": {name: med["shmbuffer"] / med[name] for name in STORES[1:]},
                             "bound": {name: med["envpool alone"] / med[name] for name in STORES[1:]}}
                print(f"{env_id} {loop} ({'per wall-clock second' if kind == 'wall' else 'per CPU-second'}): "
                      + ", ".join(f"{name} {v:,.0f}" for name, v in med.items())
                      + "; shmbuffer / " + ", ".join(f"{k} {v:.2f}x" for k, v in res[kind]["ratio"].items())
                      + " (bound, alone / " + ", ".join(f"{k} {v:.2f}x" for k, v in res[kind]["bound"].items())
                      + "); storing costs " + ", ".join(f"{k} {v:.2f} us" for k, v in cost.items()) + " an env step")
            print(f"{env_id} {loop}: the main thread's CPU time an env step outside EnvPool's calls: "
                  + ", ".join(f"{name} {v:.2f} us" for name, v in out_med.items()) + "; the stores' part: "
                  + ", ".join(f"{k} {v:.2f} us" for k, v in res["store_us_outside_envpool"].items()))
            out["envs"].setdefault(env_id, {})[loop] = res
    print(f"load average {out['machine']['load'][0]:.1f}, EnvPool threads {THREADS}")
    if args.out:
        args.out.write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
