"""PPG-style buffers: a policy buffer used for a few epochs per rollout, and a value buffer that
keeps the last rollouts for the auxiliary phase, filled together from the same data.

    python examples/ppg_buffers.py [--iterations 8]

Phasic Policy Gradient (Cobbe et al. 2020) trains the policy on each fresh rollout for a few
epochs (here: ``epoch()`` gives every row once per epoch; ``max_use=epochs`` makes sure no row is
ever used more than that), and every ``aux_every`` iterations distils value information from all
the rollouts of those iterations (here: the value buffer, ``clear``-ed after each auxiliary phase).
``Buffers`` creates both from one configuration and ``push`` writes each rollout into both.
The networks are deliberately tiny: this example shows the data flow, not PPG's tricks.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import torch

import shmbuffer as sb


@dataclass
class Args:
    envs: int = 4
    rollout: int = 128
    epochs: int = 3
    minibatch: int = 128
    aux_every: int = 4
    iterations: int = 8
    lr: float = 3e-4
    gamma: float = 0.99
    seed: int = 0


def main(args: Args) -> None:
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
        for it in range(1, args.iterations + 1):
            # -- a rollout, with discounted returns to go, into both buffers at once ----------------
            trace = []
            for _ in range(args.rollout):
                with torch.no_grad():
                    dist = torch.distributions.Categorical(logits=policy(torch.from_numpy(obs)))
                    action = dist.sample()
                next_obs, reward, terminated, truncated, _ = envs.step(action.numpy())
                trace.append((obs, action.numpy(), dist.log_prob(action).numpy(), reward, terminated | truncated))
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
                    ratio = torch.exp(torch.distributions.Categorical(logits=policy(b.obs)).log_prob(b.action) - b.logp)
                    loss = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean() + (value(b.obs).squeeze(-1) - b.ret).pow(2).mean()
                    opt.zero_grad()
                    loss.backward()
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
            mean_return = float(np.mean([r[0] for r in returns]))
            print(f"iteration {it}: {rows} rows, policy loss {loss.item():+.3f}, return to go at step 0 {mean_return:.1f}")
    envs.close()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for field, default in vars(Args()).items():
        p.add_argument(f"--{field.replace('_', '-')}", type=type(default), default=default)
    main(Args(**vars(p.parse_args())))
