"""Quick start: two worker processes push transitions into a shared buffer while the learner samples.

    python examples/quickstart.py [--capacity 100000] [--seconds 3]

What a run at the defaults shows: each worker pushes for ``--seconds`` while the learner samples
batches of 256, and the last line is the verdict, ``OK: 2 workers pushed N rows (R rows/s) in S s;
the learner sampled B batches of 256 meanwhile; the buffer holds 100,000 rows`` (the counts and
rates depend on the machine and its load, so none is quoted here). It exits with status 1
(``FAILED``) if no batch could be sampled.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from dataclasses import dataclass, field, fields

import numpy as np
import torch  # noqa: F401  (imported before the workers start: the first import takes a second)

import shmbuffer as sb


@dataclass
class Args:
    """The example's settings; each is a flag (``--batch-size 64``)."""

    capacity: int = field(default=100_000, metadata={"help": "rows the buffer holds; the oldest are overwritten"})
    seconds: float = field(default=3.0, metadata={"help": "how long the workers push"})
    workers: int = field(default=2, metadata={"help": "worker processes pushing rows"})
    batch_size: int = field(default=256, metadata={"help": "rows per sampled batch"})


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
def main(args: Args) -> int:
    """Run; return the number of batches sampled."""
    with sb.ReplayBuffer(SCHEMA, capacity=args.capacity, seed=0) as buf:
        ctx = mp.get_context("spawn")
        workers = [ctx.Process(target=worker, args=(buf.handle, i, args.seconds)) for i in range(args.workers)]
        for w in workers:
            w.start()
        batches, start = 0, time.monotonic()
        try:
            while len(buf) < args.batch_size and any(w.is_alive() for w in workers):
                time.sleep(0.01)
            start = time.monotonic()
            while any(w.is_alive() for w in workers):
                batch = buf.sample(args.batch_size)       # numpy: batch.obs, batch["reward"], batch.index
                tensors = batch.to("cpu")                 # torch tensors ("cuda" on a GPU machine)
                assert tensors.obs.shape == (args.batch_size, 4)
                batches += 1
        finally:
            for w in workers:
                w.join()
        seconds = time.monotonic() - start
        pushed = buf.stats["inserted"]
        print(f"{'OK' if batches else 'FAILED'}: {args.workers} workers pushed {pushed:,d} rows "
              f"({pushed / max(seconds, 1e-9):,.0f} rows/s) in {seconds:.1f} s; the learner sampled {batches:,d} "
              f"batches of {args.batch_size} meanwhile; the buffer holds {len(buf):,d} rows")
    return batches


def parse(argv: list[str] | None = None) -> Args:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=Formatter)
    for f in fields(Args):
        p.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default, help=f.metadata["help"])
    return Args(**vars(p.parse_args(argv)))


class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Each flag's default in its help; the docstring as written."""


if __name__ == "__main__":
    sys.exit(0 if main(parse()) else 1)
