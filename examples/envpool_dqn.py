"""DQN on CartPole, CleanRL style, with EnvPool's asynchronous envs stepping into the buffer.

    python examples/envpool_dqn.py [--total-timesteps 100000] [--target 150]

The envs are EnvPool's (``envpool.make(..., env_type="gymnasium")``), driven asynchronously:
``recv()`` returns the ``batch_size`` envs that are ready, the policy acts on them, ``send()``
sends their actions, and EnvPool's threads step them while the learner trains. The envs are
wrapped in ``shmbuffer.vector.RecordTransitions``: every ``recv`` pushes one row per ready env
into that env's lane (``info["env_id"]``), so the loop has no ``rb.add``; the step that resets an
ended env is not a transition.

At the end the greedy policy plays ``--eval-episodes`` episodes, and the run checks that their
mean return reaches ``--target`` (a random policy scores about 22; 500 is the most). What a run at the
defaults shows (the 2-core reference machine, shared with other agents' work, load about 15):
``OK: 100,000 env steps by 8 EnvPool envs (4 a batch), 98,665 rows pushed, 12,000 updates in 119
s; return of the last episodes 216.9, greedy return 223.6``. It exits with status 1 below the
target.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
import warnings
from dataclasses import dataclass, field, fields
from typing import Any

import envpool
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import shmbuffer as sb
from shmbuffer.vector import RecordTransitions


@dataclass
class Args:
    """The example's settings; each is a flag (``--total-timesteps 2000``)."""

    env_id: str = field(default="CartPole-v1", metadata={"help": "an EnvPool env with a Box observation and Discrete actions"})
    num_envs: int = field(default=8, metadata={"help": "envs in the pool"})
    batch_size_envs: int = field(default=4, metadata={"help": "envs recv() returns at a time (async when < num_envs)"})
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
    train_frequency: int = field(default=2, metadata={"help": "recv batches per gradient step"})
    eval_episodes: int = field(default=10, metadata={"help": "greedy episodes played at the end"})
    target: float = field(default=150.0, metadata={"help": "the mean greedy return the run must reach"})
    seed: int = field(default=1, metadata={"help": "seeds torch, numpy and the envs"})


def make_pool(args: Args, num_envs: int, batch_size: int, seed: int) -> Any:
    with warnings.catch_warnings():
        # EnvPool's CartPole bounds are float64, which Gymnasium's Box casts to float32 with a
        # warning (the spaces are made when first read)
        warnings.filterwarnings("ignore", ".*precision lowered by casting", UserWarning)
        env = envpool.make(args.env_id, env_type="gymnasium", num_envs=num_envs, batch_size=batch_size,
                           seed=seed, num_threads=2)
        env.single_observation_space, env.single_action_space  # noqa: B018
        return env


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
    env: Any = make_pool(args, 1, 1, 10_000)
    returns = []
    for _ in range(args.eval_episodes):
        obs, _ = env.reset()
        done, ret = False, 0.0
        while not done:
            with torch.no_grad():
                action = q(torch.as_tensor(obs)).argmax(dim=1).numpy()
            obs, reward, terminated, truncated, _ = env.step(action)
            ret += float(reward[0])
            done = bool(terminated[0] or truncated[0])
        returns.append(ret)
    env.close()
    return float(np.mean(returns))


def main(args: Args) -> dict[str, float]:
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # EnvPool's threads have the other core
    start = time.monotonic()

    # -- the buffer and the envs that fill it ----------------------------------------------------
    pool: Any = make_pool(args, args.num_envs, args.batch_size_envs, args.seed)
    obs_shape, n_actions = pool.single_observation_space.shape, int(pool.single_action_space.n)
    schema = sb.Schema(obs=(obs_shape, "float32"), action=((), "int64"), reward=((), "float32"),
                       next_obs=(obs_shape, "float32"), done=((), "bool"))
    rb = sb.ReplayBuffer(schema, args.buffer_size, envs=args.num_envs, seed=args.seed)
    envs = RecordTransitions(pool, rb)

    q_network = QNetwork(int(np.prod(obs_shape)), n_actions)
    optimizer = torch.optim.Adam(q_network.parameters(), lr=args.learning_rate)
    target_network = QNetwork(int(np.prod(obs_shape)), n_actions)
    target_network.load_state_dict(q_network.state_dict())

    # -- the loop: EnvPool's recv/send, with no rb.add --------------------------------------------
    episode_returns: list[float] = []
    running = np.zeros(args.num_envs)
    updates = batches = 0
    try:
        envs.async_reset()
        for step in range(0, args.total_timesteps, args.batch_size_envs):
            obs, rewards, terminations, truncations, info = envs.recv()  # the ready envs' rows pushed
            env_id = info["env_id"]
            running[env_id] += rewards
            for i in env_id[terminations | truncations]:
                episode_returns.append(float(running[i]))
                running[i] = 0.0
            epsilon = linear_schedule(args.start_e, args.end_e, args.exploration_fraction * args.total_timesteps, step)
            if random.random() < epsilon:
                actions = np.random.randint(0, n_actions, len(env_id))
            else:
                with torch.no_grad():
                    actions = q_network(torch.as_tensor(obs)).argmax(dim=1).numpy()
            envs.send(actions, env_id)  # EnvPool steps them while the learner trains
            batches += 1

            # -- training --------------------------------------------------------------------------
            if step >= args.learning_starts and batches % args.train_frequency == 0:
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
    print(f"{'OK' if ok else 'FAILED'}: {args.total_timesteps:,d} env steps by {args.num_envs} EnvPool envs "
          f"({args.batch_size_envs} a batch), {rows:,d} rows pushed, {updates:,d} updates in {seconds:.0f} s; "
          f"return of the last episodes {recent:.1f}, greedy return {greedy:.1f} (target {args.target:g}, random about 22)")
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
