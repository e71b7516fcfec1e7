"""Agent + expert data mixed by ratio (SQIL style) on CartPole.

    python examples/expert_mix.py [--updates 3000]

Soft Q Imitation Learning (Reddy et al. 2019) keeps the expert's demonstrations in one buffer
with reward 1 and the agent's own experience in another with reward 0, and trains a soft Q-learner
on batches drawn half from each. Here a scripted controller (push the cart the way the pole
falls) provides the demonstrations: they go into a buffer that is then frozen (read-only); two
collector processes fill the agent's buffer; ``Mix`` draws each batch 50/50 and ``batch.source``
says which rows are the expert's. The greedy policy is evaluated at the end.

What a run at the defaults shows: the batches are half the expert's, and the last line is the
verdict, ``IMITATED: greedy return G over 5 episodes after 3000 updates (target 200; random play:
about 22, the scripted expert: 500)`` when the greedy policy reaches ``--target``, ``NOT IMITATED``
otherwise (exit status 1).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field, fields
from typing import Any

import gymnasium as gym
import numpy as np
import torch

import shmbuffer as sb
from shmbuffer.collector import Collector
from shmbuffer.loader import Loader


@dataclass
class Args:
    """The example's settings; each is a flag (``--expert-share 0.25``)."""

    demos: int = field(default=20, metadata={"help": "scripted expert episodes in the frozen expert buffer"})
    updates: int = field(default=3_000, metadata={"help": "learner updates"})
    batch_size: int = field(default=128, metadata={"help": "rows per batch, from both buffers"})
    expert_share: float = field(default=0.5, metadata={"help": "share of each batch drawn from the expert's buffer"})
    lr: float = field(default=1e-3, metadata={"help": "Adam's learning rate"})
    gamma: float = field(default=0.99, metadata={"help": "discount"})
    alpha: float = field(default=0.1, metadata={"help": "soft Q-learning temperature"})
    seconds: float = field(default=300.0, metadata={"help": "wall-clock limit of the updates"})
    target: float = field(default=200.0, metadata={"help": "greedy return (mean of 5 episodes) that counts as imitated"})
    seed: int = field(default=0, metadata={"help": "seeds torch, the collectors and the buffers' sampling"})


def scripted(obs: np.ndarray) -> int:
    return int(obs[2] + 0.5 * obs[3] > 0)  # push towards the side the pole is falling to


def make_env() -> Any:
    return gym.make("CartPole-v1")


def greedy_return(q: torch.nn.Module, episodes: int, seed: int) -> float:
    env, total = make_env(), 0.0
    for i in range(episodes):
        obs, _ = env.reset(seed=seed + i)
        done = False
        while not done:
            with torch.no_grad():
                obs, r, term, trunc, _ = env.step(int(q(torch.from_numpy(obs)[None]).argmax()))
            total += float(r)
            done = term or trunc
    return total / episodes


def main(args: Args) -> float:
    """Run; return the greedy policy's mean return over 5 episodes."""
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    schema = sb.Schema(obs=((4,), "float32"), action=((), "int64"), reward=((), "float32"),
                       next_obs=((4,), "float32"), done=((), "bool"))
    # -- the expert's demonstrations, into a buffer that is then read-only -------------------------
    env = make_env()
    demo: dict[str, list[Any]] = {k: [] for k in schema.names}
    for i in range(args.demos):
        obs, _ = env.reset(seed=1_000 + i)
        done = False
        while not done:
            action = scripted(obs)
            next_obs, _, term, trunc, _ = env.step(action)
            for k, v in zip(schema.names, (obs, action, 1.0, next_obs, term), strict=True):
                demo[k].append(v)  # SQIL: the expert's reward is 1
            obs, done = next_obs, term or trunc
    rows = {k: np.asarray(v) for k, v in demo.items()}
    with sb.ReplayBuffer(schema, len(rows["obs"]), seed=args.seed) as expert, \
            sb.ReplayBuffer(schema, 50_000, seed=args.seed + 1) as agent:
        expert.push(rows)
        expert.freeze()
        print(f"expert: {len(expert)} rows from {args.demos} scripted episodes, frozen")

        # -- the agent's own data: two collector processes, random actions, reward 0 ---------------
        def sqil(obs: Any, action: Any, reward: Any, next_obs: Any, terminated: Any, truncated: Any) -> dict[str, Any]:
            return {"obs": obs, "action": action, "reward": np.zeros_like(reward), "next_obs": next_obs, "done": terminated}

        q = torch.nn.Sequential(torch.nn.Linear(4, 128), torch.nn.ReLU(), torch.nn.Linear(128, 2))
        target = torch.nn.Sequential(torch.nn.Linear(4, 128), torch.nn.ReLU(), torch.nn.Linear(128, 2))
        target.load_state_dict(q.state_dict())
        opt = torch.optim.Adam(q.parameters(), lr=args.lr)
        with Collector(make_env, agent, workers=2, transition=sqil, seed=args.seed) as collector:
            collector.warm(2_000)
            mix = sb.Mix([(agent, 1 - args.expert_share), (expert, args.expert_share)])
            start = time.monotonic()
            with Loader(mix, args.batch_size, collector=collector, batches=args.updates) as loader:
                for step, b in enumerate(loader, 1):
                    with torch.no_grad():  # soft Q-learning target: alpha * logsumexp(Q / alpha)
                        v_next = args.alpha * torch.logsumexp(target(b.next_obs) / args.alpha, dim=1)
                        goal = b.reward + args.gamma * (~b.done).float() * v_next
                    taken = q(b.obs).gather(1, b.action[:, None]).squeeze(1)
                    loss = torch.nn.functional.smooth_l1_loss(taken, goal)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    if step % 100 == 0:
                        target.load_state_dict(q.state_dict())
                    if step % 500 == 0:
                        share = (b.source == 1).float().mean().item()
                        print(f"update {step:5d}  loss {loss.item():.4f}  expert rows in batch {share:.0%}  "
                              f"agent rows {len(agent):,d}")
                    if time.monotonic() - start > args.seconds:
                        break
    greedy = greedy_return(q, 5, seed=7)
    print(f"{'IMITATED' if greedy >= args.target else 'NOT IMITATED'}: greedy return {greedy:.1f} over 5 episodes "
          f"after {step} updates (target {args.target:g}; random play: about 22, the scripted expert: 500)")
    return greedy


def parse(argv: list[str] | None = None) -> Args:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=Formatter)
    for f in fields(Args):
        p.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default, help=f.metadata["help"])
    return Args(**vars(p.parse_args(argv)))


class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Each flag's default in its help; the docstring as written."""


if __name__ == "__main__":
    args = parse()
    sys.exit(0 if main(args) >= args.target else 1)
