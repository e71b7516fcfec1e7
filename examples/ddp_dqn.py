"""DQN on CartPole trained by several DDP ranks from one shared buffer, collectors writing it.

    torchrun --nproc-per-node 2 examples/ddp_dqn.py [--updates 3000] [--target 150]
    python examples/ddp_dqn.py                       # one rank: the same run's data, alone

Rank 0 creates the buffer and starts a ``Collector``: env worker processes that step CartPole with
the latest published Q-network (epsilon-greedy) and push every transition into the buffer. Every
rank (rank 0 too) attaches to it as its rank::

    rb = sb.ReplayBuffer.attach(name, rank=rank, world_size=world_size, seed=args.seed)
    batch = rb.sample(args.batch_size)        # this rank's rows of one global batch

and trains its ``DistributedDataParallel`` replica: the loss of its rows, gradients averaged over
the ranks by DDP, so each update learns from one global batch of ``batch_size * world_size`` rows,
the batch one rank attached with ``world_size=1`` draws at that step (``--prioritized``: one
stratified prioritized draw, each rank updating the priorities of its rows in the one tree).
Backend gloo on CPU, nccl when there are GPUs (one per rank).

At the end rank 0 plays ``--eval-episodes`` greedy episodes and the run checks that their mean
return reaches ``--target`` (a random policy scores about 22) and that every rank holds the same
model. What a run at the defaults shows: rank 0's last line is the verdict, ``OK: 2 ranks (gloo)
trained one model from one buffer: 3,000 updates of a global batch of 128 (64 a rank, uniform), N
rows pushed by E collector envs, in S s; models equal on every rank: True; greedy return G (target
150, random about 22)`` (the counts, the time and the return depend on the machine and its load,
so none is quoted here); ``FAILED`` and exit status 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field, fields
from typing import Any

import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import shmbuffer as sb
from shmbuffer.collector import Collector


@dataclass
class Args:
    """The example's settings; each is a flag (``--updates 500``)."""

    updates: int = field(default=3_000, metadata={"help": "gradient steps, every rank in lockstep"})
    batch_size: int = field(default=64, metadata={"help": "rows each rank samples a step (the global batch: x ranks)"})
    workers: int = field(default=2, metadata={"help": "collector worker processes"})
    envs_per_worker: int = field(default=4, metadata={"help": "CartPole envs each collector worker steps"})
    buffer_size: int = field(default=50_000, metadata={"help": "rows the buffer holds"})
    learning_starts: int = field(default=2_000, metadata={"help": "rows in the buffer before the first update"})
    learning_rate: float = field(default=5e-4, metadata={"help": "Adam's learning rate (of the averaged gradient)"})
    gamma: float = field(default=0.99, metadata={"help": "discount"})
    target_network_frequency: int = field(default=250, metadata={"help": "updates between target network copies"})
    publish_frequency: int = field(default=50, metadata={"help": "updates between weights sent to the collectors"})
    prioritized: bool = field(default=False, metadata={"help": "prioritized replay, shared by every rank"})
    eval_episodes: int = field(default=10, metadata={"help": "greedy episodes rank 0 plays at the end"})
    target: float = field(default=150.0, metadata={"help": "the mean greedy return the run must reach"})
    seed: int = field(default=1, metadata={"help": "seeds the model, the buffer's draws and the envs"})


class QNetwork(nn.Module):
    def __init__(self, obs_dim: int = 4, actions: int = 2) -> None:
        super().__init__()
        self.network = nn.Sequential(nn.Linear(obs_dim, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(),
                                     nn.Linear(84, actions))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.network(x)


def make_env() -> gym.Env:
    return gym.make("CartPole-v1")


def epsilon_greedy(model: Any, obs: np.ndarray, step: int) -> np.ndarray:
    """The collectors' policy: epsilon from 1 to 0.05 over a worker's first 10,000 steps."""
    epsilon = max(0.05, 1.0 - step / 10_000)
    with torch.no_grad():
        greedy = model(torch.as_tensor(obs, dtype=torch.float32)).argmax(dim=1).numpy()
    explore = np.random.random(obs.shape[0]) < epsilon
    return np.where(explore, np.random.randint(0, 2, obs.shape[0]), greedy)


def evaluate(q: nn.Module, episodes: int) -> float:
    env = make_env()
    returns = []
    for episode in range(episodes):
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
    if "RANK" not in os.environ:  # plain `python examples/ddp_dqn.py`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29517")
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ['LOCAL_RANK'])}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(1)  # the collectors and the other ranks have the other cores
    torch.manual_seed(args.seed)  # every rank starts from the same model (DDP broadcasts rank 0's anyway)
    start = time.monotonic()

    # -- rank 0: the buffer and the collectors that fill it -------------------------------------
    col: Collector | None = None
    owner: sb.ReplayBuffer | None = None
    envs = args.workers * args.envs_per_worker
    if rank == 0:
        schema = sb.Schema(obs=((4,), "float32"), action=((), "int64"), reward=((), "float32"),
                           next_obs=((4,), "float32"), done=((), "bool"))
        sampler = sb.Prioritized(beta_steps=args.updates) if args.prioritized else sb.Uniform()
        owner = sb.ReplayBuffer(schema, args.buffer_size, envs=envs, sampler=sampler)
        col = Collector(make_env, owner, workers=args.workers, envs_per_worker=args.envs_per_worker,
                        policy=epsilon_greedy, model=QNetwork(), seed=args.seed)
        col.warm(args.learning_starts)
    name = [owner.name if owner is not None else ""]
    dist.broadcast_object_list(name, src=0)  # every rank learns the buffer's name

    # -- every rank: its attach, its replica -----------------------------------------------------
    rb = sb.ReplayBuffer.attach(name[0], rank=rank, world_size=world, seed=args.seed)
    q = DDP(QNetwork().to(device), device_ids=[device.index] if cuda else None)
    target = QNetwork().to(device)
    target.load_state_dict(q.module.state_dict())
    optimizer = torch.optim.Adam(q.parameters(), lr=args.learning_rate)
    try:
        for update in range(1, args.updates + 1):
            data = rb.sample(args.batch_size).to(device)  # this rank's part of the global batch
            with torch.no_grad():
                td_target = data.reward + args.gamma * target(data.next_obs).max(dim=1).values * (~data.done)
            q_sa = q(data.obs).gather(1, data.action[:, None]).squeeze(1)
            if args.prioritized:
                loss = (data.weight * F.smooth_l1_loss(q_sa, td_target, reduction="none")).mean()
                rb.update_priorities(data, (q_sa - td_target).abs().detach())  # into the one tree
            else:
                loss = F.smooth_l1_loss(q_sa, td_target)
            optimizer.zero_grad()
            loss.backward()  # DDP averages the gradients over the ranks: the global batch's
            optimizer.step()
            if update % args.target_network_frequency == 0:
                target.load_state_dict(q.module.state_dict())
            if col is not None and update % args.publish_frequency == 0:
                col.publish(q.module)  # the collectors act with the newest weights
                col.check()
        # -- the verdict ---------------------------------------------------------------------------
        flat = torch.cat([p.detach().reshape(-1) for p in q.module.parameters()]).cpu()
        every = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(every, flat)
        same = all(torch.equal(every[0], other) for other in every)
        rows = rb.stats["inserted"]
    finally:
        rb.close()
        dist.barrier()  # every rank's attach closed before rank 0 unlinks the buffer
        if col is not None:
            col.stop()
        if owner is not None:
            owner.close()
            owner.unlink()
    result = {"ok": 1.0, "rank": float(rank)}
    if rank == 0:
        greedy = evaluate(q.module.cpu(), args.eval_episodes)
        seconds = time.monotonic() - start
        ok = greedy >= args.target and same
        print(f"{'OK' if ok else 'FAILED'}: {world} rank{'s' if world > 1 else ''} ({'nccl' if cuda else 'gloo'}) "
              f"trained one model from one buffer: {args.updates:,d} updates of a global batch of "
              f"{args.batch_size * world} ({args.batch_size} a rank, {'prioritized' if args.prioritized else 'uniform'}), "
              f"{rows:,d} rows pushed by {envs} collector envs, in {seconds:.0f} s; models equal on every rank: "
              f"{same}; greedy return {greedy:.1f} (target {args.target:g}, random about 22)", flush=True)
        result = {"ok": float(ok), "greedy_return": greedy, "rows": float(rows), "seconds": seconds}
    dist.destroy_process_group()
    return result


def parse(argv: list[str] | None = None) -> Args:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=Formatter)
    for f in fields(Args):
        if f.type in (bool, "bool"):
            p.add_argument(f"--{f.name.replace('_', '-')}", action="store_true", help=f.metadata["help"])
        else:
            p.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default,
                           help=f.metadata["help"])
    return Args(**vars(p.parse_args(argv)))


class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Each flag's default in its help; the docstring as written."""


if __name__ == "__main__":
    sys.exit(0 if main(parse()).get("ok") else 1)
