"""Hindsight experience replay on bit flipping, fed by collector processes.

    python examples/her_bit_flipping.py [--n-bits 10] [--target 0.9]

Bit flipping (Andrychowicz et al. 2017; Stable-Baselines3's ``BitFlippingEnv``): flip one of
``n`` bits a step until the bits equal a random goal, within ``n`` steps; the reward is -1 until
then. Without relabelling a random policy almost never sees a reward above -1 once ``n`` is 10.
Two collector processes step the env with an epsilon-greedy copy of the Q-network and push each
step into their own lane of a shared buffer (``episodes=True``: the collectors name each env's
episodes). The learner (DQN, a target network, Huber loss) samples with
``hindsight=Hindsight(env.compute_reward, strategy="future", n_sampled_goal=4)``: 80% of each batch
gets a goal achieved later in the same episode, and its reward from ``compute_reward``. Every
``--eval-every`` updates the greedy policy plays ``--eval-episodes`` episodes; the run stops once
their success rate reaches ``--target`` (SB3's ``test_performance_her`` asks 0.9 of DQN with its
``HerReplayBuffer`` on 10 bits) or after ``--max-updates``.

What a run at the defaults shows: a line per evaluation (updates, env steps the collectors made,
success rate, loss, seconds since the first update), then the verdict, ``SOLVED: greedy success
rate ... over 50 episodes after U updates, S s (target 0.9; 2 collector processes made N env
steps)`` once an evaluation reaches ``--target``; the counts and seconds vary with the machine and
its load (the collectors run at their own pace). It exits with status 1 (``NOT SOLVED``) when the
target is not reached.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import torch
from stable_baselines3.common.envs import BitFlippingEnv

import shmbuffer as sb
from shmbuffer.collector import Collector


@dataclass
class Args:
    """The example's settings; each is a flag (``--n-bits 6``)."""

    n_bits: int = field(default=10, metadata={"help": "bits to flip (the episode's step limit too)"})
    capacity: int = field(default=100_000, metadata={"help": "rows the buffer holds"})
    batch_size: int = field(default=128, metadata={"help": "transitions per update"})
    n_sampled_goal: int = field(default=4, metadata={"help": "relabelled transitions per real one (SB3's)"})
    strategy: str = field(default="future", metadata={"help": "goal selection: future, final or episode"})
    lr: float = field(default=1e-3, metadata={"help": "Adam's learning rate"})
    gamma: float = field(default=0.98, metadata={"help": "discount"})
    target_every: int = field(default=100, metadata={"help": "updates between target network copies"})
    publish_every: int = field(default=50, metadata={"help": "updates between publishing weights to the collectors"})
    learning_starts: int = field(default=500, metadata={"help": "rows in the buffer before the first update"})
    eval_every: int = field(default=250, metadata={"help": "updates between greedy evaluations"})
    eval_episodes: int = field(default=50, metadata={"help": "episodes a greedy evaluation plays"})
    max_updates: int = field(default=20_000, metadata={"help": "updates before giving up"})
    target: float = field(default=0.9, metadata={"help": "greedy success rate that ends the run"})
    workers: int = field(default=2, metadata={"help": "collector processes"})
    seed: int = field(default=0, metadata={"help": "seeds the envs, the network and the sampling"})


# -- the env as flat arrays: observation, achieved goal, desired goal ----------------------------------
class FlatBits:
    """``BitFlippingEnv`` (discrete) with its dict observation as one float32 vector
    ``[observation, achieved_goal, desired_goal]`` (collectors stack plain arrays)."""

    def __init__(self, n_bits: int) -> None:
        self.env = BitFlippingEnv(n_bits=n_bits, continuous=False)
        self.action_space = self.env.action_space
        self.n = n_bits

    def _flat(self, obs: dict[str, np.ndarray]) -> np.ndarray:
        return np.concatenate([obs["observation"], obs["achieved_goal"], obs["desired_goal"]]).astype(np.float32)

    def reset(self, *, seed: int | None = None) -> tuple[np.ndarray, dict[str, Any]]:
        obs, info = self.env.reset(seed=seed)
        return self._flat(obs), info

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        obs, reward, terminated, truncated, info = self.env.step(int(action))
        return self._flat(obs), float(reward), bool(terminated), bool(truncated), info


class EnvFactory:
    """A picklable env factory for the collector processes."""

    def __init__(self, n_bits: int) -> None:
        self.n_bits = n_bits

    def __call__(self) -> FlatBits:
        return FlatBits(self.n_bits)


def schema(n: int) -> sb.Schema:
    vec = ((n,), "float32")
    return sb.Schema(obs=vec, next_obs=vec, achieved_goal=vec, next_achieved_goal=vec, desired_goal=vec,
                     next_desired_goal=vec, action=((), "int64"), reward=((), "float32"), done=((), "bool"),
                     truncated=((), "bool"))


class Transition:
    """A collector step as the buffer's fields: the flat vectors cut into their three parts."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __call__(self, obs: np.ndarray, action: np.ndarray, reward: np.ndarray, next_obs: np.ndarray,
                 terminated: np.ndarray, truncated: np.ndarray) -> dict[str, np.ndarray]:
        n = self.n
        return {"obs": obs[:, :n], "achieved_goal": obs[:, n:2 * n], "desired_goal": obs[:, 2 * n:],
                "next_obs": next_obs[:, :n], "next_achieved_goal": next_obs[:, n:2 * n],
                "next_desired_goal": next_obs[:, 2 * n:], "action": action.astype(np.int64),
                "reward": reward.astype(np.float32), "done": terminated, "truncated": truncated}


# -- the Q-network: (observation, desired goal) -> a value per bit ------------------------------------
def q_network(n: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(2 * n, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                               torch.nn.ReLU(), torch.nn.Linear(256, n))


class EpsilonGreedy:
    """The collectors' policy: random bits for the first steps, then greedy with 5% random flips."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __call__(self, model: torch.nn.Module, obs: np.ndarray, step: int) -> np.ndarray:
        n = self.n
        eps = max(0.05, 1.0 - step / 1_000)
        with torch.no_grad():
            greedy = model(torch.as_tensor(np.concatenate([obs[:, :n], obs[:, 2 * n:]], axis=1))).argmax(1).numpy()
        explore = np.random.random(obs.shape[0]) < eps
        return np.where(explore, np.random.randint(n, size=obs.shape[0]), greedy)


def evaluate(q: torch.nn.Module, n: int, episodes: int, seed: int) -> float:
    env = FlatBits(n)
    wins = 0
    for e in range(episodes):
        obs, _ = env.reset(seed=seed + e)
        for _ in range(n):
            with torch.no_grad():
                a = int(q(torch.as_tensor(np.concatenate([obs[:n], obs[2 * n:]]))[None]).argmax())
            obs, _, terminated, truncated, _ = env.step(a)
            if terminated:
                wins += 1
            if terminated or truncated:
                break
    return wins / episodes


# -- the learner -----------------------------------------------------------------------------------------
def main(args: Args) -> dict[str, Any]:
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    n = args.n_bits
    q, target = q_network(n), q_network(n)
    target.load_state_dict(q.state_dict())
    opt = torch.optim.Adam(q.parameters(), lr=args.lr)
    reward_env = BitFlippingEnv(n_bits=n, continuous=False)  # its compute_reward is vectorised
    spec = sb.Hindsight(reward_env.compute_reward, strategy=args.strategy, n_sampled_goal=args.n_sampled_goal,
                        achieved="next_achieved_goal", desired=("desired_goal", "next_desired_goal"))
    result: dict[str, Any] = {"success": 0.0, "updates": 0, "steps": 0, "seconds": 0.0}
    with sb.ReplayBuffer(schema(n), args.capacity, envs=args.workers, episodes=True, seed=args.seed) as buf, \
            Collector(EnvFactory(n), buf, workers=args.workers, policy=EpsilonGreedy(n), model=q,
                      transition=Transition(n), seed=args.seed) as collector:
        collector.warm(args.learning_starts)
        start = time.monotonic()
        for update in range(1, args.max_updates + 1):
            b = buf.sample(args.batch_size, hindsight=spec)
            obs = torch.as_tensor(np.concatenate([b.obs, b.desired_goal], axis=1))
            nxt = torch.as_tensor(np.concatenate([b.next_obs, b.next_desired_goal], axis=1))
            reward, done = torch.as_tensor(b.reward), torch.as_tensor(b.done.astype(np.float32))
            with torch.no_grad():
                goal = reward + args.gamma * (1 - done) * target(nxt).max(1).values
            value = q(obs).gather(1, torch.as_tensor(b.action)[:, None])[:, 0]
            loss = torch.nn.functional.smooth_l1_loss(value, goal)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if update % args.target_every == 0:
                target.load_state_dict(q.state_dict())
            if update % args.publish_every == 0:
                collector.publish(q)
            if update % args.eval_every == 0 or update == args.max_updates:
                success = evaluate(q, n, args.eval_episodes, 10_000 + update)
                steps = collector.stats()["env_steps"]
                seconds = time.monotonic() - start
                print(f"update {update:6d}  env steps {steps:8,d}  success {success:.2f}  loss {loss.item():.4f}  "
                      f"{seconds:6.1f} s", flush=True)
                result = {"success": success, "updates": update, "steps": steps, "seconds": seconds}
                if success >= args.target:
                    break
    solved = result["success"] >= args.target
    print(f"{'SOLVED' if solved else 'NOT SOLVED'}: greedy success rate {result['success']:.2f} over {args.eval_episodes} "
          f"episodes after {result['updates']} updates, {result['seconds']:.1f} s (target {args.target:g}; "
          f"{args.workers} collector processes made {result['steps']:,d} env steps)")
    result["solved"] = solved
    return result


def parse(argv: list[str] | None = None) -> Args:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=Formatter)
    for f in fields(Args):
        p.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default, help=f.metadata["help"])
    return Args(**vars(p.parse_args(argv)))


class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Each flag's default in its help; the docstring as written."""


if __name__ == "__main__":
    sys.exit(0 if main(parse())["solved"] else 1)
