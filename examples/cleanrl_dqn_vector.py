"""DQN on CartPole, CleanRL style, with 8 envs whose worker processes write the replay buffer.

    python examples/cleanrl_dqn_vector.py [--total-timesteps 100000] [--target 150]

The loop is CleanRL's ``dqn.py`` with one change: the envs are ``shmbuffer.vector.AsyncVectorEnv``,
Gymnasium's ``AsyncVectorEnv`` whose workers push every transition into a shared ``ReplayBuffer``
themselves (one lane per env), so the loop has no ``rb.add``: it steps the envs, samples batches
and trains. Gymnasium's next-step autoreset is handled where the rows are written: the step that
resets an env is not a transition, and an episode's last row keeps its final observation.

At the end the greedy policy plays ``--eval-episodes`` episodes, and the run checks that their mean
return reaches ``--target`` (a random policy scores about 22; 500 is the most). What a run at the
defaults shows: 100,000 env steps and 12,000 updates, then the verdict on the last line, ``OK``
when the greedy return reaches ``--target``; the return itself varies from run to run and seed to
seed (runs of the default seed have ended anywhere from about 165 to 245), so only the verdict is
quoted here. It exits with status 1 (``FAILED``) below the target.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass, field, fields

import gymnasium as gym
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import shmbuffer as sb
from shmbuffer.vector import AsyncVectorEnv


@dataclass
class Args:
    """The example's settings; each is a flag (``--total-timesteps 2000``)."""

    env_id: str = field(default="CartPole-v1", metadata={"help": "a Gymnasium env with a Box observation and Discrete actions"})
    num_envs: int = field(default=8, metadata={"help": "envs, each in a worker process writing its own rows"})
    total_timesteps: int = field(default=100_000, metadata={"help": "env steps in all (every env together)"})
    learning_rate: float = field(default=5e-4, metadata={"help": "Adam's learning rate"})
    buffer_size: int = field(default=50_000, metadata={"help": "rows the buffer holds"})
    gamma: float = field(default=0.99, metadata={"help": "discount"})
    target_network_frequency: int = field(default=500, metadata={"help": "gradient steps between target network copies"})
    batch_size: int = field(default=128, metadata={"help": "rows a gradient step samples"})
    start_e: float = field(default=1.0, metadata={"help": "exploration's first epsilon"})
    end_e: float = field(default=0.05, metadata={"help": "exploration's last epsilon"})
    exploration_fraction: float = field(default=0.2, metadata={"help": "the part of the run epsilon falls over"})
    learning_starts: int = field(default=4_000, metadata={"help": "env steps before the first gradient step"})
    train_frequency: int = field(default=1, metadata={"help": "vector steps (num_envs env steps) per gradient step"})
    eval_episodes: int = field(default=10, metadata={"help": "greedy episodes played at the end"})
    target: float = field(default=150.0, metadata={"help": "the mean greedy return the run must reach"})
    seed: int = field(default=1, metadata={"help": "seeds torch, numpy and the envs"})


def make_env(env_id: str) -> gym.Env:
    return gym.make(env_id)


class QNetwork(nn.Module):
    def __init__(self, obs_dim: int, actions: int) -> None:
        super().__init__()
        self.network = nn.Sequential(nn.Linear(obs_dim, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(),
                                     nn.Linear(84, actions))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.network(x)


def linear_schedule(start_e: float, end_e: float, duration: float, t: int) -> float:
    return max(end_e, start_e + (end_e - start_e) * t / duration)


def evaluate(args: Args, q: QNetwork) -> float:
    env = make_env(args.env_id)
    returns = []
    for episode in range(args.eval_episodes):
        obs, _ = env.reset(seed=10_000 + episode)
        done, ret = False, 0.0
        while not done:
            with torch.no_grad():
                action = int(q(torch.as_tensor(obs, dtype=torch.float32)[None]).argmax())
            obs, reward, terminated, truncated, _ = env.step(action)
            ret += float(reward)
            done = terminated or truncated
        returns.append(ret)
    env.close()
    return float(np.mean(returns))


def main(args: Args) -> dict[str, float]:
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # the env workers have the other cores
    start = time.monotonic()

    # -- the buffer and the envs that fill it ----------------------------------------------------
    probe = make_env(args.env_id)
    obs_shape, n_actions = probe.observation_space.shape, int(probe.action_space.n)  # type: ignore[attr-defined]
    probe.close()
    schema = sb.Schema(obs=(obs_shape, "float32"), action=((), "int64"), reward=((), "float32"),
                       next_obs=(obs_shape, "float32"), done=((), "bool"))
    rb = sb.ReplayBuffer(schema, args.buffer_size, envs=args.num_envs, seed=args.seed)
    envs = AsyncVectorEnv([lambda: make_env(args.env_id)] * args.num_envs, rb)

    q_network = QNetwork(int(np.prod(obs_shape)), n_actions)
    optimizer = torch.optim.Adam(q_network.parameters(), lr=args.learning_rate)
    target_network = QNetwork(int(np.prod(obs_shape)), n_actions)
    target_network.load_state_dict(q_network.state_dict())

    # -- the loop: Gymnasium's, with no rb.add -----------------------------------------------------
    episode_returns: list[float] = []
    running = np.zeros(args.num_envs)
    updates = 0
    try:
        obs, _ = envs.reset(seed=args.seed)
        for step in range(0, args.total_timesteps, args.num_envs):
            epsilon = linear_schedule(args.start_e, args.end_e, args.exploration_fraction * args.total_timesteps, step)
            if random.random() < epsilon:
                actions = envs.action_space.sample()
            else:
                with torch.no_grad():
                    actions = q_network(torch.as_tensor(obs)).argmax(dim=1).numpy()
            obs, rewards, terminations, truncations, _ = envs.step(actions)  # the workers pushed the rows
            running += rewards
            for i in np.flatnonzero(terminations | truncations):
                episode_returns.append(float(running[i]))
                running[i] = 0.0

            # -- training --------------------------------------------------------------------------
            if step >= args.learning_starts and (step // args.num_envs) % args.train_frequency == 0:
                data = rb.sample(args.batch_size).to("cpu")
                with torch.no_grad():
                    target_max = target_network(data.next_obs).max(dim=1).values
                    td_target = data.reward + args.gamma * target_max * (~data.done)
                old_val = q_network(data.obs).gather(1, data.action[:, None]).squeeze(1)
                loss = F.smooth_l1_loss(old_val, td_target)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                updates += 1
                if updates % args.target_network_frequency == 0:
                    target_network.load_state_dict(q_network.state_dict())
        rows = rb.stats["inserted"]
    finally:
        envs.close()
        rb.close()

    greedy = evaluate(args, q_network)
    seconds = time.monotonic() - start
    recent = float(np.mean(episode_returns[-20:])) if episode_returns else float("nan")
    ok = greedy >= args.target
    print(f"{'OK' if ok else 'FAILED'}: {args.total_timesteps:,d} env steps by {args.num_envs} writing workers, "
          f"{rows:,d} rows pushed, {updates:,d} updates in {seconds:.0f} s; return of the last episodes "
          f"{recent:.1f}, greedy return {greedy:.1f} (target {args.target:g}, random about 22)")
    return {"ok": float(ok), "greedy_return": greedy, "rows": rows, "seconds": seconds}


def parse(argv: list[str] | None = None) -> Args:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=Formatter)
    for f in fields(Args):
        p.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default, help=f.metadata["help"])
    return Args(**vars(p.parse_args(argv)))


class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Each flag's default in its help; the docstring as written."""


if __name__ == "__main__":
    sys.exit(0 if main(parse())["ok"] else 1)
