"""The hindsight case: a sample of 256 with ``future`` relabelling (HER, 4 goals per real one).

* ``her.sample256``: Fetch-like rows (``observation`` float32[10], ``achieved_goal`` and
  ``desired_goal`` float32[3], ``action`` float32[4]; episodes of 50 steps) at capacity 1,000,000
  (``--quick``: 20,000), one env. Subjects: ``buf.sample(256, hindsight=Hindsight(...))`` on a
  shmbuffer (numpy), ``shmbuffer.sb3.HerReplayBuffer.sample(256)`` (torch tensors, as SB3's),
  SB3's ``HerReplayBuffer.sample(256)`` and cpprb's ``HindsightReplayBuffer.sample(256)``
  (``prioritized=False``). Every subject's ``compute_reward`` is the same vectorised function
  (a goal counts as reached within 0.05, as Fetch's). SB3 and both of ours relabel at sample time;
  cpprb relabels when an episode ends (``on_episode_end`` stores each step 1 + 4 times with its
  goals and rewards fixed then), so its sample is a plain sample of those rows. The shmbuffer and
  SB3 buffers are filled with the same rows by writing their arrays (SB3's ``ep_start`` /
  ``ep_length`` set as its ``add`` would); cpprb through ``add`` and ``on_episode_end``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .cases import BATCH, Case, Config, Metric, Op, Subject, case_result, measure
from .peers import need

OBS, GOAL, ACT, EPISODE = 10, 3, 4, 50
NAMES = ("observation", "achieved_goal", "desired_goal")


def compute_reward(achieved: np.ndarray, desired: np.ndarray, info: Any) -> np.ndarray:
    return -(np.linalg.norm(achieved - desired, axis=-1) > 0.05).astype(np.float32)


class RewardEnv:
    """What SB3's HerReplayBuffer asks of its env: ``env_method("compute_reward", ...)``."""

    def env_method(self, name: str, achieved: np.ndarray, desired: np.ndarray, info: Any,
                   indices: Any = None) -> list[np.ndarray]:
        return [compute_reward(achieved, desired, info)]


def rows(capacity: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    out = {}
    for name, width in (("observation", OBS), ("achieved_goal", GOAL), ("desired_goal", GOAL)):
        out[name] = rng.standard_normal((capacity, width)).astype(np.float32)
        out["next_" + name] = rng.standard_normal((capacity, width)).astype(np.float32)
    out["action"] = rng.uniform(-1, 1, (capacity, ACT)).astype(np.float32)
    out["reward"] = rng.standard_normal(capacity).astype(np.float32)
    out["done"] = np.arange(capacity) % EPISODE == EPISODE - 1
    return out


def spaces_() -> tuple[Any, Any]:
    from gymnasium import spaces

    box = {n: spaces.Box(-np.inf, np.inf, (OBS if n == "observation" else GOAL,), np.float32) for n in NAMES}
    return spaces.Dict(box), spaces.Box(-1, 1, (ACT,), np.float32)


def ours_subject(capacity: int, data: Callable[[], dict[str, np.ndarray]]) -> Subject:
    def setup() -> tuple[dict[str, Op], Callable[[], None]]:
        import shmbuffer as sb

        f = ((OBS,), "float32")
        g = ((GOAL,), "float32")
        schema = sb.Schema(obs=f, next_obs=f, achieved_goal=g, next_achieved_goal=g, desired_goal=g,
                           next_desired_goal=g, action=((ACT,), "float32"), reward=((), "float32"), done=((), "bool"))
        buf = sb.ReplayBuffer(schema, capacity, episodes=True, seed=0)
        try:
            d = data()
            push = {"obs": d["observation"], "next_obs": d["next_observation"], "action": d["action"],
                    "reward": d["reward"], "done": d["done"]}
            for n in ("achieved_goal", "desired_goal"):
                push[n], push["next_" + n] = d[n], d["next_" + n]
            buf.push(push, episode=np.arange(capacity) // EPISODE)
            spec = sb.Hindsight(compute_reward, strategy="future", n_sampled_goal=4)
            check = buf.sample(BATCH, hindsight=spec)
            r = check.relabelled
            goal_rows = check.goal[r]
            assert (goal_rows // EPISODE == check.index[r] // EPISODE).all() and (goal_rows >= check.index[r]).all()
            assert np.array_equal(check.desired_goal[r], d["next_achieved_goal"][goal_rows])
        except BaseException:
            buf.close()
            buf.unlink()
            raise

        def close() -> None:
            buf.close()
            buf.unlink()

        return {"sample": lambda: buf.sample(BATCH, hindsight=spec)}, close

    return Subject("shmbuffer", "ours", setup, capacity * 100, "buf.sample(256, hindsight=Hindsight(future, 4))")


def _fill_sb3(rb: Any, d: dict[str, np.ndarray], capacity: int, ours: bool) -> None:
    if ours:
        buf = rb.buffer
        push = {f"obs_{n}": d[n] for n in NAMES} | {f"next_obs_{n}": d["next_" + n] for n in NAMES}
        push |= {"action": d["action"], "reward": d["reward"], "done": d["done"].astype(np.float32),
                 "timeouts": np.zeros(capacity, np.float32)}
        buf.push(push, lane=0, episode=np.arange(capacity) // EPISODE)
    else:
        for n in NAMES:
            rb.observations[n][:, 0] = d[n]
            rb.next_observations[n][:, 0] = d["next_" + n]
        rb.actions[:, 0] = d["action"]
        rb.rewards[:, 0] = d["reward"]
        rb.dones[:, 0] = d["done"]
        rb.full = True
    idx = np.arange(capacity)
    rb.ep_start[:, 0] = idx // EPISODE * EPISODE
    rb.ep_length[:, 0] = EPISODE


def sb3_subject(capacity: int, data: Callable[[], dict[str, np.ndarray]], ours: bool) -> Subject:
    def setup() -> tuple[dict[str, Op], Callable[[], None]]:
        if ours:
            from shmbuffer.sb3 import HerReplayBuffer
        else:
            from stable_baselines3 import HerReplayBuffer  # type: ignore[assignment]
        obs_space, act_space = spaces_()
        rb = HerReplayBuffer(capacity, obs_space, act_space, RewardEnv(), device="cpu", n_sampled_goal=4,
                             goal_selection_strategy="future")
        _fill_sb3(rb, data(), capacity, ours)
        rb.sample(BATCH)
        return {"sample": lambda: rb.sample(BATCH)}, (rb.close if ours else (lambda: None))

    def check() -> None:
        need("stable_baselines3")

    name = "shmbuffer.sb3" if ours else "sb3"
    note = "shmbuffer.sb3.HerReplayBuffer.sample(256) (torch)" if ours else "HerReplayBuffer.sample(256) (torch)"
    return Subject(name, "ours" if ours else "peer", setup, capacity * 200, note, check)


def cpprb_subject(capacity: int, data: Callable[[], dict[str, np.ndarray]]) -> Subject:
    def setup() -> tuple[dict[str, Op], Callable[[], None]]:
        cpprb = need("cpprb")
        d = data()
        env_dict = {"obs": {"shape": OBS + GOAL}, "act": {"shape": ACT}, "next_obs": {"shape": OBS + GOAL}}

        def reward(next_obs: np.ndarray, act: np.ndarray, goal: np.ndarray) -> np.ndarray:
            return compute_reward(next_obs[:, OBS:], goal, None)

        her = cpprb.HindsightReplayBuffer(capacity, env_dict, EPISODE, reward, goal_func=lambda s: s[:, OBS:],
                                          goal_shape=(GOAL,), prioritized=False)
        obs = np.concatenate([d["observation"], d["achieved_goal"]], axis=1)
        nxt = np.concatenate([d["next_observation"], d["next_achieved_goal"]], axis=1)
        for e in range(capacity // (EPISODE * 5)):  # each step is stored 1 + 4 times
            at = slice(e * EPISODE, (e + 1) * EPISODE)
            her.add(obs=obs[at], act=d["action"][at], next_obs=nxt[at])
            her.on_episode_end(d["desired_goal"][at.start])
        her.sample(BATCH)
        return {"sample": lambda: her.sample(BATCH)}, lambda: None

    def check() -> None:
        need("cpprb")

    return Subject("cpprb", "peer", setup, capacity * 150,
                   "HindsightReplayBuffer(prioritized=False).sample(256): goals fixed at on_episode_end", check)


def her_case(cfg: Config) -> dict[str, Any]:
    capacity = 20_000 if cfg.quick else 1_000_000
    cache: list[dict[str, np.ndarray]] = []

    def data() -> dict[str, np.ndarray]:
        if not cache:
            cache.append(rows(capacity))
        return cache[0]

    metrics = {"sample": Metric(f"sample {BATCH}, future relabelling (4 goals a real one)", "batches/s", 1, 0)}
    subjects = [ours_subject(capacity, data), sb3_subject(capacity, data, True), sb3_subject(capacity, data, False),
                cpprb_subject(capacity, data)]
    res = measure(subjects, metrics, cfg)
    cache.clear()
    return case_result(f"Fetch-like goal rows, episodes of {EPISODE} steps, capacity {capacity:,}: sample {BATCH} "
                       "with future relabelling", None, cfg, metrics, {s.name: res[s.name] for s in subjects},
                       capacity=capacity, episode=EPISODE)


def register(cases: dict[str, Case]) -> None:
    cases["her.sample256"] = Case("her.sample256", "sample 256 with future hindsight relabelling", "sample", her_case)
