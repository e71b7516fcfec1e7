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

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .features import torch_threads
from .harness import BATCH, Case, Config, Metric, Op, Subject, case_result, measure, summary
from .peers import need

OBS, GOAL, ACT, EPISODE = 10, 3, 4, 50
WARM = 300
"""Samples each of our subjects takes before it is timed: a process remembers the complete episodes
it has met (``hindsight.Memo``), which a training run does after its first few hundred batches."""
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
            for _ in range(WARM):  # the memo of complete episodes, as a training run has it after a while
                buf.sample(BATCH, hindsight=spec)
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
        for _ in range(WARM if ours else 1):
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
    cases["her.sac"] = Case("her.sac", "SAC + HER on bit flipping: seconds to 0.9 success, 2 collectors vs SB3's loop",
                            "frameworks", sac_case, rounds=1)


# -- her.sac: a SAC training run's wall time to a success rate ------------------------------------------
SAC_BITS, SAC_QUICK_BITS = 6, 2
SAC_BUDGET = 150.0
"""Training seconds a run may take: both reach 0.9 in about 90-110 s on the 2-core VM; a run that has
not by then is reported with its success rate (a subject that missed, not a time to compare)."""
COLLECTORS = 2
TARGET = 0.9
EVAL_EPISODES = 50
SAMPLES_PER_STEP = 128.0
"""The learner's sampled rows an env step of the collectors (SB3's loop: 256, one batch of 256 a step):
each of the 2 collectors makes one step an update of the learner."""


class FlatBits:
    """SB3's ``BitFlippingEnv`` (continuous) with its dict observation as one float32 vector
    ``[observation, achieved_goal, desired_goal]``, for the collector processes."""

    def __init__(self, n: int) -> None:
        from stable_baselines3.common.envs import BitFlippingEnv

        self.env = BitFlippingEnv(n_bits=n, continuous=True)
        self.action_space = self.env.action_space

    @staticmethod
    def flat(obs: dict[str, np.ndarray]) -> np.ndarray:
        return np.concatenate([obs[k] for k in NAMES]).astype(np.float32)

    def reset(self, *, seed: int | None = None) -> tuple[np.ndarray, dict[str, Any]]:
        obs, info = self.env.reset(seed=seed)
        return self.flat(obs), info

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        obs, reward, terminated, truncated, info = self.env.step(action)
        return self.flat(obs), float(reward), bool(terminated), bool(truncated), info


class BitsFactory:
    def __init__(self, n: int) -> None:
        self.n = n

    def __call__(self) -> FlatBits:
        return FlatBits(self.n)


class SB3Rows:
    """A collector step as the fields of ``shmbuffer.sb3.HerReplayBuffer``'s shared buffer (SB3's
    ``done`` is terminated or truncated; ``timeouts`` a truncation, as ``handle_timeout_termination``)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __call__(self, obs: np.ndarray, action: np.ndarray, reward: np.ndarray, next_obs: np.ndarray,
                 terminated: np.ndarray, truncated: np.ndarray) -> dict[str, np.ndarray]:
        n = self.n
        out = {"action": action.astype(np.float32), "reward": reward.astype(np.float32),
               "done": (terminated | truncated).astype(np.float32), "timeouts": (truncated & ~terminated).astype(np.float32)}
        for i, k in enumerate(NAMES):
            out[f"obs_{k}"] = obs[:, i * n:(i + 1) * n].astype(np.int8)
            out[f"next_obs_{k}"] = next_obs[:, i * n:(i + 1) * n].astype(np.int8)
        return out


def plain_actor(n: int, hidden: tuple[int, ...]) -> Any:
    """SAC's actor for the collectors, as plain torch modules with the parameters of SB3's
    ``Actor`` in its order (``latent_pi``, ``mu``, ``log_std``): SB3's own module does not pickle
    into a worker (dill meets a ``typing_extensions`` sentinel). ``publish(model.actor)`` fills it."""
    import torch

    layers: list[Any] = []
    width = 3 * n
    for h in hidden:
        layers += [torch.nn.Linear(width, h), torch.nn.ReLU()]
        width = h
    return torch.nn.ModuleDict({"latent_pi": torch.nn.Sequential(*layers), "mu": torch.nn.Linear(width, n),
                                "log_std": torch.nn.Linear(width, n)})


class ActorPolicy:
    """The collectors' policy: SAC's stochastic action (tanh of a Gaussian sample) from the copy
    of the actor the learner publishes; the features are the dict observation's keys in the order
    SB3's ``CombinedExtractor`` concatenates them (``order``)."""

    def __init__(self, n: int, order: list[str]) -> None:
        self.n = n
        self.order = order

    def __call__(self, actor: Any, obs: np.ndarray, step: int) -> np.ndarray:
        import torch

        n = self.n
        parts = {k: obs[:, i * n:(i + 1) * n] for i, k in enumerate(NAMES)}
        x = torch.as_tensor(np.concatenate([parts[k] for k in self.order], axis=1))
        with torch.no_grad():
            latent = actor["latent_pi"](x)
            mean, log_std = actor["mu"](latent), actor["log_std"](latent).clamp(-20, 2)
            return torch.tanh(mean + torch.randn_like(mean) * log_std.exp()).numpy()


def _success(model: Any, n: int, episodes: int = EVAL_EPISODES) -> float:
    from stable_baselines3.common.envs import BitFlippingEnv

    env = BitFlippingEnv(n_bits=n, continuous=True)
    wins = 0
    for i in range(episodes):
        obs, _ = env.reset(seed=10_000 + i)
        for _ in range(n):
            action, _ = model.predict(obs, deterministic=True)
            obs, _, terminated, truncated, _ = env.step(action)
            wins += bool(terminated)
            if terminated or truncated:
                break
    return wins / episodes


def _sac(env: Any, buffer_class: Any, seed: int, **more: Any) -> Any:
    from stable_baselines3 import SAC

    return SAC("MultiInputPolicy", env, replay_buffer_class=buffer_class, learning_starts=100, buffer_size=100_000,
               replay_buffer_kwargs={"n_sampled_goal": 4, "goal_selection_strategy": "future", **more}, batch_size=256,
               policy_kwargs={"net_arch": [64, 64]}, seed=seed, train_freq=1, gradient_steps=1)


def sac_sb3(n: int, seed: int, budget: float) -> dict[str, Any]:
    """SB3's loop: ``model.learn`` in chunks of 500 steps, evaluated (untimed) after each."""
    from stable_baselines3 import HerReplayBuffer
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.envs import BitFlippingEnv

    model = _sac(make_vec_env(lambda: BitFlippingEnv(n_bits=n, continuous=True), 1), HerReplayBuffer, seed)
    spent, steps, success = 0.0, 0, 0.0
    while spent < budget and success < TARGET:
        t = time.perf_counter()
        model.learn(500, reset_num_timesteps=False)
        spent += time.perf_counter() - t
        steps += 500
        success = _success(model, n)
    return {"seconds": spent, "success": success, "env_steps": steps, "updates": int(model._n_updates)}


def sac_ours(n: int, seed: int, budget: float) -> dict[str, Any]:
    """The learner trains on ``shmbuffer.sb3.HerReplayBuffer`` (``model.train`` in chunks of 250
    updates, evaluated untimed after each) while 2 collector processes step the env with the
    published actor and push into its shared buffer (one lane each)."""
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.envs import BitFlippingEnv
    from stable_baselines3.common.logger import configure

    import shmbuffer as sb
    from shmbuffer.collector import Collector
    from shmbuffer.sb3 import HerReplayBuffer

    # the collectors wait while the learner's samples lag behind: SAMPLES_PER_STEP rows sampled an env step
    limiter = sb.RateLimiter(samples_per_insert=SAMPLES_PER_STEP, min_size=100, error=SAMPLES_PER_STEP * 200,
                             block_writers=True)
    model = _sac(make_vec_env(lambda: BitFlippingEnv(n_bits=n, continuous=True), COLLECTORS), HerReplayBuffer, seed,
                 limiter=limiter)
    model.set_logger(configure(None, [""]))
    buf = model.replay_buffer.buffer
    try:
        copy = plain_actor(n, (64, 64))
        ours = [p.shape for p in copy.parameters()]
        theirs = [p.shape for p in model.actor.parameters()]
        if ours != theirs:
            raise RuntimeError(f"the collectors' actor has parameters {ours}, SB3's actor {theirs}")
        order = list(model.observation_space.spaces)
        with Collector(BitsFactory(n), buf, workers=COLLECTORS, policy=ActorPolicy(n, order), model=copy,
                       transition=SB3Rows(n), seed=seed) as collector:
            collector.warm(100)
            spent, updates, success = 0.0, 0, 0.0
            while spent < budget and success < TARGET:
                t = time.perf_counter()
                for _ in range(10):
                    model.train(gradient_steps=25, batch_size=256)
                    collector.publish(model.actor)
                spent += time.perf_counter() - t
                updates += 250
                success = _success(model, n)
            steps = collector.stats()["env_steps"]
    finally:
        model.replay_buffer.close()
    return {"seconds": spent, "success": success, "env_steps": steps, "updates": updates}


def sac_case(cfg: Config) -> dict[str, Any]:
    n = SAC_QUICK_BITS if cfg.quick else SAC_BITS
    budget = 3.0 if cfg.quick else SAC_BUDGET  # --quick: a smoke run, success or not
    rounds = 1 if cfg.quick else max(1, min(cfg.repeat, 3))
    runs: dict[str, list[dict[str, Any]]] = {"shmbuffer": [], "sb3": []}
    subjects: dict[str, dict[str, Any]] = {}
    try:
        need("stable_baselines3")
    except Exception as e:
        return {"status": "skipped", "title": "SAC + HER on bit flipping", "reason": str(e)}
    with torch_threads(1):
        for r in range(rounds):
            for name, fn in (("shmbuffer", sac_ours), ("sb3", sac_sb3))[:: 1 if r % 2 == 0 else -1]:
                try:
                    runs[name].append(fn(n, r, budget))
                except Exception as e:
                    subjects[name] = {"status": "error", "reason": f"{type(e).__name__}: {e}"}
    for name, got in runs.items():
        if name in subjects or not got:
            continue
        reached = [g for g in got if g["success"] >= TARGET]
        subjects[name] = {"status": "ok", "kind": "ours" if name.startswith("shmbuffer") else "peer", "runs": got,
                          "metrics": {"seconds": summary([g["seconds"] for g in got])},
                          "note": ("shmbuffer.sb3.HerReplayBuffer + 2 collectors; " if name == "shmbuffer" else "")
                          + f"{len(reached)} of {len(got)} runs reached {TARGET} greedy success"}
    metrics = {"seconds": Metric(f"seconds of training to a greedy success rate of {TARGET}", "s", 1, 0)}
    return case_result(f"SAC + HER (future, 4) on {n}-bit flipping: training seconds to a greedy success rate of "
                       f"{TARGET} over {EVAL_EPISODES} episodes (evaluations not timed)", None, cfg, metrics, subjects,
                       bits=n, budget_s=budget)
