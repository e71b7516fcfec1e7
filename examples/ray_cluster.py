"""The demo's DQN past one machine: collectors on 2 Ray nodes, one buffer shard each, one learner
sampling across the shards.

    python examples/ray_cluster.py                      # a local cluster of 2 nodes (raylets)
    python examples/ray_cluster.py --address auto       # an existing cluster: a shard on every node
    python examples/ray_cluster.py --tiny               # a smoke test (CI)

On every node a collector host (a Ray actor pinned to the node, no CPU reserved) runs a
``Collector`` whose worker processes push into that node's shard through shared memory. The
learner (this process) samples prioritized batches from all shards as from one buffer
(``ShardedBuffer``), trains a double DQN with the importance weights, sends the TD errors home to
each row's shard and publishes its weights to every host.

Every ``--eval-every`` updates the greedy policy plays 5 episodes; the run ends SOLVED when they
and 20 more average 475 (CartPole's bar), or after ``--max-seconds``. DQN's greedy return swings
and can fall late in a run, so a run stopped by the clock keeps the weights that evaluated best
while training (the last weights evaluated the same way compete), as SB3's ``EvalCallback`` keeps
its best model; the last line judges them on 20 fresh episodes and says which weights it judged.
It exits with status 0 when that mean reaches ``--target`` (100; random play scores about 22), 1
otherwise (always 0 with ``--tiny`` or ``--max-updates``, which only check that it runs). Two
raylets, two collectors and the learner share a 2-core machine's cores, so the learner makes few
updates there; how many depends on the machine and its load.

What a run at the defaults shows: the shards, a progress line every few seconds (env steps, rows in
each shard, updates, the collectors' recent return, the last evaluation), then the verdict,
``LEARNED: mean evaluation return of the best evaluated weights, at U updates: M +- S over 20
episodes (target 100; solved at 475), T s`` (or ``of the last weights``; ``SOLVED`` when it reached 475
early, ``NOT LEARNED`` below the target, exit status 1).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

import shmbuffer as sb
from shmbuffer.demo import EpsilonGreedy, evaluate, make_env, q_network
from shmbuffer.ray import ShardedBuffer


@dataclass
class Args:
    """The example's settings; each is a flag (``--batch-size 64``)."""

    address: str = field(default="", metadata={"help": "a Ray cluster to join ('auto'); empty: start 2 local nodes"})
    nodes: int = field(default=2, metadata={"help": "nodes of the local cluster (one shard and one collector each)"})
    seed: int = field(default=1, metadata={"help": "seeds torch, the envs and the sampling"})
    envs_per_node: int = field(default=4, metadata={"help": "CartPole envs each node's collector steps"})
    capacity: int = field(default=50_000, metadata={"help": "rows each shard holds"})
    batch_size: int = field(default=128, metadata={"help": "rows per learner batch"})
    prefetch: int = field(default=2, metadata={"help": "batches requested ahead from each remote shard"})
    lr: float = field(default=1e-3, metadata={"help": "Adam's learning rate"})
    gamma: float = field(default=0.99, metadata={"help": "discount"})
    tau: float = field(default=0.01, metadata={"help": "Polyak rate of the target network, per update"})
    learning_starts: int = field(default=2_000, metadata={"help": "rows in all shards before the first update"})
    samples_per_insert: float = field(default=8.0, metadata={"help": "rate limiter over every shard: rows sampled per row inserted"})
    publish_every: int = field(default=50, metadata={"help": "updates between publishing the weights"})
    eval_every: int = field(default=1_000, metadata={"help": "updates between greedy evaluations"})
    target: float = field(default=100.0, metadata={"help": "mean return of the last 20 greedy episodes that counts as learned"})
    solved: float = field(default=475.0, metadata={"help": "mean evaluation return that ends the run early (CartPole's bar)"})
    max_seconds: float = field(default=120.0, metadata={"help": "wall-clock limit of the learner"})
    max_updates: int = field(default=0, metadata={"help": "stop after this many updates (0: no limit)"})
    tiny: bool = field(default=False, metadata={"help": "tiny sizes: a smoke test"})


@ray.remote(num_cpus=0)
class CollectorHost:
    """A ``Collector`` on this node pushing into this node's shard; weights come by ``publish``."""

    def __init__(self, target: Any, envs: int, model: Any, args: Args, node: int) -> None:
        from shmbuffer.collector import Collector

        torch.set_num_threads(1)
        self.model = model
        policy = EpsilonGreedy(1.0, 0.02, 15_000, 2, args.seed + node)
        self.collector = Collector(make_env, target.handle, workers=1, envs_per_worker=envs, policy=policy,
                                   model=copy.deepcopy(model), seed=args.seed * 100 + node)

    def publish(self, state: dict[str, Any]) -> dict[str, Any]:
        self.model.load_state_dict(state)
        self.collector.publish(self.model)
        return self.collector.stats()

    def stop(self) -> None:
        self.collector.stop()


def start_cluster(args: Args) -> Any:
    if args.address:
        ray.init(address=args.address, include_dashboard=False, log_to_driver=False)
        return None
    from ray.cluster_utils import Cluster

    store = 80 * 2**20
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": store,
                                                            "include_dashboard": False})
    for _ in range(args.nodes - 1):
        cluster.add_node(num_cpus=1, object_store_memory=store)
    cluster.wait_for_nodes(timeout=120)
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    return cluster


def main(args: Args) -> dict[str, Any]:
    if args.tiny:
        args.capacity, args.batch_size, args.learning_starts = 2_000, 32, 200
        args.envs_per_node, args.max_updates, args.eval_every, args.max_seconds = 2, 100, 10**9, 120.0
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    cluster = start_cluster(args)
    q = q_network(4, 2, 128)
    target = copy.deepcopy(q)
    opt = torch.optim.Adam(q.parameters(), lr=args.lr)
    schema = sb.Schema(obs=((4,), "float32"), action=((), "int64"), reward=((), "float32"),
                       next_obs=((4,), "float32"), done=((), "bool"))
    limiter = sb.RateLimiter(samples_per_insert=args.samples_per_insert, min_size=args.learning_starts,
                             error=args.samples_per_insert * args.learning_starts, timeout=120.0)
    report: dict[str, Any] = {"solved": False, "updates": 0}
    hosts: list[Any] = []
    start = time.monotonic()
    try:
        with ShardedBuffer(schema, args.capacity, sampler=sb.Prioritized(alpha=0.6, beta=0.4, beta_steps=20_000),
                           prefetch=args.prefetch, limiter=limiter, seed=args.seed) as buf:
            print(f"{len(buf.shards)} shards: " + ", ".join(f"{s.name} on node {s.node[:8]}" for s in buf.shards),
                  flush=True)
            # -- a collector on every node, pushing into its node's shard ------------------------
            writer = buf.writer()
            hosts = [CollectorHost.options(scheduling_strategy=NodeAffinitySchedulingStrategy(s.node, soft=False))
                     .remote(writer, args.envs_per_node, copy.deepcopy(q), args, s.index) for s in buf.shards]
            # -- the learner ---------------------------------------------------------------------
            updates, evals, last = 0, [], 0.0
            best: tuple[float, int, dict[str, Any]] | None = None  # (evaluation, updates, weights)
            while True:
                batch = buf.sample(args.batch_size)  # waits for learning_starts rows in all shards
                t = batch.to("cpu")
                q_taken = q(t.obs).gather(1, t.action[:, None]).squeeze(1)
                with torch.no_grad():
                    best_next = q(t.next_obs).argmax(dim=1, keepdim=True)
                    goal = t.reward + args.gamma * (~t.done).float() * target(t.next_obs).gather(1, best_next).squeeze(1)
                td = goal - q_taken
                weight = torch.from_numpy(batch.weight)
                loss = (weight * torch.nn.functional.smooth_l1_loss(q_taken, goal, reduction="none")).mean()
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(q.parameters(), 10.0)
                opt.step()
                buf.update_priorities(batch, td.detach().abs())  # each row's priority goes to its shard
                with torch.no_grad():
                    for p, tp in zip(q.parameters(), target.parameters(), strict=True):
                        tp.lerp_(p, args.tau)
                updates += 1
                if updates % args.publish_every == 0:
                    stats = ray.get([h.publish.remote(q.state_dict()) for h in hosts])
                    elapsed = time.monotonic() - start
                    if elapsed - last >= 2.0:
                        last = elapsed
                        recent = np.nanmean([s["recent_return"] for s in stats])
                        print(f"{elapsed:6.1f}s  env steps {sum(s['env_steps'] for s in stats):>8,d}  "
                              f"shards {[r['rows'] for r in buf.ls()]}  updates {updates:>6,d}  "
                              f"return {recent:6.1f}  eval {f'{evals[-1]:6.1f}' if evals else '     -'}", flush=True)
                if updates % args.eval_every == 0:
                    evals.append(float(evaluate(q, 5, seed=10_000 + updates).mean()))
                    if best is None or evals[-1] >= best[0]:
                        # DQN's greedy return swings and can collapse late in a run: keep the best
                        # evaluated weights, as SB3's EvalCallback keeps its best model
                        best = (evals[-1], updates, copy.deepcopy(q.state_dict()))
                    if evals[-1] >= args.solved:
                        full = evaluate(q, 20, seed=50_000 + updates)
                        if full.mean() >= args.solved:
                            report.update(solved=True, eval_returns=full)
                            break
                if time.monotonic() - start > args.max_seconds or (args.max_updates and updates >= args.max_updates):
                    break
            report.update(updates=updates, seconds=time.monotonic() - start, stats=buf.stats,
                          shards_seen=sorted(set(batch.shard.tolist())))
            if "eval_returns" not in report:  # stopped by the clock or --max-updates
                # the policy to judge is chosen on the evaluations made while training (the last
                # weights evaluated like the others), then judged on 20 episodes none of them saw
                last_eval = float(evaluate(q, 5, seed=10_000 + updates).mean())
                report["policy"] = f"the last weights, at {updates:,d} updates"
                if best is not None and best[0] > last_eval:
                    q.load_state_dict(best[2])
                    report["policy"] = f"the best evaluated weights, at {best[1]:,d} updates"
                report["eval_returns"] = evaluate(q, 5 if args.tiny else 20, seed=90_000)
            ray.get([h.stop.remote() for h in hosts])
    finally:
        # a host's Collector holds multiprocessing semaphores (/dev/shm/sem.mp-*), unlinked when
        # its process exits; an actor left to ray.shutdown is killed, its resource tracker with it
        ends = [h.__ray_terminate__.remote() for h in hosts]
        if ends:
            ray.wait(ends, num_returns=len(ends), timeout=60)
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
    s, returns = report["stats"], report["eval_returns"]
    print(f"{report['updates']} updates in {report['seconds']:.0f} s; {s['inserted']:,d} rows inserted into "
          f"{len(s['shards'])} shards {[v['rows'] for v in s['shards'].values()]}; last batch from shards "
          f"{report['shards_seen']}")
    report["learned"] = bool(returns.mean() >= args.target)
    verdict = "SOLVED" if report["solved"] else "LEARNED" if report["learned"] else "NOT LEARNED"
    policy = f" of {report['policy']}:" if "policy" in report else ""
    print(f"{verdict}: mean evaluation return{policy} {returns.mean():.1f} +- {returns.std():.1f} over "
          f"{returns.size} episodes (target {args.target:g}; solved at {args.solved:g}), {report['seconds']:.0f} s")
    return report


def parse(argv: list[str] | None = None) -> Args:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=Formatter)
    for f in fields(Args):
        if f.type == "bool":
            p.add_argument(f"--{f.name.replace('_', '-')}", action="store_true", help=f.metadata["help"])
        else:
            p.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default, help=f.metadata["help"])
    return Args(**vars(p.parse_args(argv)))


class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Each flag's default in its help; the docstring as written."""


if __name__ == "__main__":
    args = parse()
    result = main(args)
    sys.exit(0 if result["solved"] or result["learned"] or args.tiny or args.max_updates else 1)
