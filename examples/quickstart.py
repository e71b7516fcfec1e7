"""Quick start: two worker processes push transitions into a shared buffer while the learner samples.

    python examples/quickstart.py [--capacity 100000] [--seconds 3]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time
from dataclasses import dataclass

import numpy as np
import torch  # noqa: F401  (imported before the workers start: the first import takes a second)

import shmbuffer as sb


@dataclass
class Args:
    capacity: int = 100_000
    seconds: float = 3.0
    workers: int = 2
    batch_size: int = 256


SCHEMA = sb.Schema(
    obs=((4,), "float32"), action=((), "int64"), reward=((), "float32"),
    next_obs=((4,), "float32"), done=((), "bool"),
)


# -- the env worker: attach by handle, push rows ---------------------------------------------------
def worker(handle: sb.BufferHandle, seed: int, seconds: float) -> None:
    buf = sb.ReplayBuffer.attach(handle)
    rng = np.random.default_rng(seed)
    obs = rng.normal(size=4).astype(np.float32)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        next_obs = (obs + rng.normal(scale=0.1, size=4)).astype(np.float32)
        done = bool(rng.random() < 0.02)
        buf.push(obs=obs, action=int(rng.integers(2)), reward=1.0, next_obs=next_obs, done=done)
        obs = rng.normal(size=4).astype(np.float32) if done else next_obs
    buf.close()


# -- the learner: create the buffer, start workers, sample batches --------------------------------
def main(args: Args) -> None:
    with sb.ReplayBuffer(SCHEMA, capacity=args.capacity, seed=0) as buf:
        ctx = mp.get_context("spawn")
        workers = [ctx.Process(target=worker, args=(buf.handle, i, args.seconds)) for i in range(args.workers)]
        for w in workers:
            w.start()
        try:
            while len(buf) < args.batch_size:
                time.sleep(0.01)
            batches = 0
            while any(w.is_alive() for w in workers):
                batch = buf.sample(args.batch_size)       # numpy: batch.obs, batch["reward"], batch.index
                tensors = batch.to("cpu")                 # torch tensors ("cuda" on a GPU machine)
                batches += 1
        finally:
            for w in workers:
                w.join()
        print(f"{len(buf)} rows in the buffer ({buf.stats['inserted']} pushed), {batches} batches sampled")
        print(f"last batch: {tensors}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for field, default in vars(Args()).items():
        p.add_argument(f"--{field.replace('_', '-')}", type=type(default), default=default)
    main(Args(**vars(p.parse_args())))
