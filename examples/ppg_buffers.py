"""PPG-style buffers: a policy buffer used for a few epochs per rollout, and a value buffer that
keeps the last rollouts for the auxiliary phase, filled together from the same data.

    python examples/ppg_buffers.py [--iterations 40] [--seed 0]

Phasic Policy Gradient (Cobbe et al. 2020) trains the policy on each fresh rollout for a few
epochs (here: ``epoch()`` gives every row once per epoch; ``max_use=epochs`` makes sure no row is
ever used more than that), and every ``aux_every`` iterations distils value information from all
the rollouts of those iterations (here: the value buffer, ``clear``-ed after each auxiliary phase).
``Buffers`` creates both from one configuration and ``push`` writes each rollout into both.
The networks are deliberately tiny: this example shows the data flow, not PPG's tricks.

Each iteration prints its losses and the mean return of the CartPole episodes that ended in its
rollout. The policy loss is PPO's clipped surrogate on advantages normalised per minibatch, so it
stays near zero (within a few hundredths of it) whether the policy improves or not; the value loss
is the squared error of the returns to go, in return units squared (tens to hundreds here, as the
returns grow). What a run at the defaults shows: a mean return near random play (about 22) in iteration 1 that
grows over the 40 iterations, and the verdict on the last line, ``LEARNING: mean episode return A
in iteration 1, B in iteration 40 (target 75); every rollout row used 3 times in the policy phase,
no more``. The last iteration's mean is over the few episodes that ended in it, so it jumps from
one iteration and one run to the next (two runs of the default seed ended at 179.4 and 444.0),
which is why only the verdict is quoted here. It exits with status 1
(``NOT LEARNING``) when that mean stays below ``--target``.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field, fields

import gymnasium as gym
import numpy as np
import torch

import shmbuffer as sb


@dataclass
class Args:
    """The example's settings; each is a flag (``--aux-every 2``)."""

    envs: int = field(default=4, metadata={"help": "CartPole envs of the vector env"})
    rollout: int = field(default=128, metadata={"help": "steps of every env per rollout"})
    epochs: int = field(default=3, metadata={"help": "passes over each rollout in the policy phase (max_use)"})
    minibatch: int = field(default=128, metadata={"help": "rows per minibatch"})
    aux_every: int = field(default=4, metadata={"help": "iterations between auxiliary phases"})
    iterations: int = field(default=40, metadata={"help": "rollouts, each followed by its policy phase"})
    lr: float = field(default=1e-3, metadata={"help": "Adam's learning rate"})
    gamma: float = field(default=0.99, metadata={"help": "discount"})
    target: float = field(default=75.0, metadata={"help": "mean return in the last iteration that counts as learning (random play: about 22)"})
    seed: int = field(default=0, metadata={"help": "seeds torch and the envs"})


def main(args: Args) -> list[float]:
    """Run; return the mean return of the episodes that ended in each iteration's rollout."""
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    envs = gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1") for _ in range(args.envs)])
    schema = sb.Schema(obs=((4,), "float32"), action=((), "int64"), logp=((), "float32"), ret=((), "float32"))
    rows = args.rollout * args.envs
    policy = torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.Tanh(), torch.nn.Linear(64, 2))
    value = torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    opt = torch.optim.Adam([*policy.parameters(), *value.parameters()], lr=args.lr)
    with sb.Buffers(policy=dict(schema=schema, capacity=rows, max_use=args.epochs, seed=args.seed),
                    value=dict(schema=schema, capacity=rows * args.aux_every, seed=args.seed)) as group:
        obs, _ = envs.reset(seed=args.seed)
        running, means = np.zeros(args.envs), []
        for it in range(1, args.iterations + 1):
            # -- a rollout, with discounted returns to go, into both buffers at once ----------------
            trace, ended = [], []
            for _ in range(args.rollout):
                with torch.no_grad():
                    dist = torch.distributions.Categorical(logits=policy(torch.from_numpy(obs)))
                    action = dist.sample()
                next_obs, reward, terminated, truncated, _ = envs.step(action.numpy())
                trace.append((obs, action.numpy(), dist.log_prob(action).numpy(), reward, terminated | truncated))
                running += reward
                ended += running[terminated | truncated].tolist()  # whole episodes: their return
                running[terminated | truncated] = 0
                obs = next_obs
            ret = np.zeros(args.envs, np.float32)
            returns = []
            for _, _, _, reward, done in reversed(trace):
                ret = reward + args.gamma * ret * ~done
                returns.append(ret)
            returns.reverse()
            group["policy"].clear()
            group.push(obs=np.concatenate([t[0] for t in trace]), action=np.concatenate([t[1] for t in trace]),
                       logp=np.concatenate([t[2] for t in trace]), ret=np.concatenate(returns))

            # -- policy phase: `epochs` passes over the rollout, each row once per pass --------------
            for _ in range(args.epochs):
                for batch in group["policy"].epoch(args.minibatch):
                    b = batch.to("cpu")
                    adv = b.ret - value(b.obs).squeeze(-1).detach()
                    adv = (adv - adv.mean()) / (adv.std() + 1e-8)  # normalised: the loss's scale stays put
                    ratio = torch.exp(torch.distributions.Categorical(logits=policy(b.obs)).log_prob(b.action) - b.logp)
                    loss = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean()
                    value_loss = (value(b.obs).squeeze(-1) - b.ret).pow(2).mean()
                    opt.zero_grad()
                    (loss + 0.5 * value_loss).backward()
                    opt.step()
            assert list(group["policy"].epoch(args.minibatch)) == []  # every row used `epochs` times

            # -- auxiliary phase: all rollouts since the last one, then start over ------------------
            if it % args.aux_every == 0:
                for _ in range(len(group["value"]) // args.minibatch):
                    b = group["value"].sample(args.minibatch).to("cpu")
                    aux = (value(b.obs).squeeze(-1) - b.ret).pow(2).mean()
                    opt.zero_grad()
                    aux.backward()
                    opt.step()
                print(f"iteration {it}: auxiliary phase on {len(group['value'])} rows, value loss {aux.item():.3f}")
                group["value"].clear()
            means.append(float(np.mean(ended)) if ended else float("nan"))
            print(f"iteration {it}: {rows} rows, policy loss {loss.item():+.4f}, value loss {value_loss.item():.1f}, "
                  f"mean return of the {len(ended)} episodes that ended {means[-1]:.1f}")
    envs.close()
    verdict = "LEARNING" if means[-1] >= args.target else "NOT LEARNING"
    print(f"{verdict}: mean episode return {means[0]:.1f} in iteration 1, {means[-1]:.1f} in iteration {len(means)} "
          f"(target {args.target:g}); every rollout row used {args.epochs} times in the policy phase, no more")
    return means


def parse(argv: list[str] | None = None) -> Args:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=Formatter)
    for f in fields(Args):
        p.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default, help=f.metadata["help"])
    return Args(**vars(p.parse_args(argv)))


class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Each flag's default in its help; the docstring as written."""


if __name__ == "__main__":
    args = parse()
    sys.exit(0 if main(args)[-1] >= args.target else 1)
