"""Several learners on one buffer (``ReplayBuffer.attach(..., rank=, world_size=, seed=)``): total
batches per second of 2 rank processes against 1, both in one run, alternating.

``ranks.mujoco``: a MuJoCo-like buffer of 200,000 rows (``--quick``: 20,000 rows, runs of 0.5 s),
full, no writers.
Each run starts its rank processes (``fork``), lets them attach and warm up, then starts them
together for ``cfg.mp_seconds``; each samples 256 rows in a loop (``per``: a prioritized buffer,
sample 256 and ``update_priorities`` of the batch), and the run's number is the batches of all its
ranks per second. Metrics: ``uniform`` and ``per`` quiet, ``uniform_busy`` and ``per_busy`` with
two busy processes (a Python loop each) running beside the ranks. Subjects, every metric measured
in every round in a rotating order:

* ``shmbuffer``: 2 ranks (``world_size=2``: each draws its half of one global batch of 512);
* ``shmbuffer, 1 rank``: 1 rank (``world_size=1``), the baseline of the targets;
* ``plain attaches, 2 processes`` and ``plain attach, 1 process``: attaches without a rank (each
  process draws its own batches, as before ranks existed), for comparison.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from typing import Any

import numpy as np

from . import peers
from .data import MUJOCO
from .harness import BATCH, Case, Config, Metric, case_result, summary
from .multiproc import kill_tree, limit_threads, sweep

ROWS, QUICK_ROWS = 200_000, 20_000
SUBJECTS = {  # name: (processes, ranked)
    "shmbuffer": (2, True),
    "shmbuffer, 1 rank": (1, True),
    "plain attaches, 2 processes": (2, False),
    "plain attach, 1 process": (1, False),
}
METRICS = {"uniform": (False, False), "per": (True, False), "uniform_busy": (False, True), "per_busy": (True, True)}


def _rank(name: str, rank: int, w: int, ranked: bool, per: bool, ready: Any, go: Any, seconds: float, out: Any) -> None:
    import shmbuffer as sb

    limit_threads()
    buf = (sb.ReplayBuffer.attach(name, rank=rank, world_size=w, seed=7) if ranked
           else sb.ReplayBuffer.attach(name, seed=1000 + rank))
    try:
        prios = np.random.default_rng(rank).random(BATCH) + 0.01
        for _ in range(50):  # warm: the one call made, pages touched
            b = buf.sample(BATCH)
            if per:
                buf.update_priorities(b, prios)
        ready.put(rank)
        go.wait(30)
        n, end = 0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            b = buf.sample(BATCH)
            if per:
                buf.update_priorities(b, prios)
            n += 1
        del b  # its arrays are views of the block: gone before close
        out.put(n)
    finally:
        buf.close()


def _busy(stop: Any) -> None:
    while not stop.is_set():
        sum(range(10_000))


def run_once(names: dict[bool, str], subject: str, metric: str, seconds: float) -> float:
    """One run: the subject's processes on the metric's buffer; total batches per second."""
    procs, ranked = SUBJECTS[subject]
    per, busy = METRICS[metric]
    ctx = mp.get_context("fork")
    ready, out, go, stop = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Event()
    started: list[Any] = []
    try:
        if busy:
            for _ in range(2):
                started.append(ctx.Process(target=_busy, args=(stop,), daemon=True))
                started[-1].start()
        for r in range(procs):
            started.append(ctx.Process(target=_rank, args=(names[per], r, procs, ranked, per, ready, go, seconds, out),
                                       daemon=True))
            started[-1].start()
        for _ in range(procs):
            ready.get(timeout=60)
        go.set()
        total = sum(out.get(timeout=seconds + 60) for _ in range(procs))
        return total / seconds
    finally:
        stop.set()
        for p in started:
            p.join(5)
            if p.is_alive() and p.pid is not None:
                kill_tree(p.pid)
                p.join(5)


def ranks_case(cfg: Config) -> dict[str, Any]:
    import shmbuffer as sb

    rows = QUICK_ROWS if cfg.quick else ROWS
    seconds = min(cfg.mp_seconds, 0.5) if cfg.quick else cfg.mp_seconds  # quick: 16 runs, a smoke test
    names: dict[bool, str] = {}
    made = []
    try:
        for per in (False, True):
            buf = sb.ReplayBuffer(MUJOCO.schema, rows, name=peers.buffer_name(peers.Ours.prefix),
                                  sampler=sb.Prioritized() if per else sb.Uniform())
            made.append(buf)
            chunk = 10_000
            data = MUJOCO.make(0, np.arange(chunk))
            for _ in range(rows // chunk):
                buf.push(**data)
            if per:
                buf.update_priorities(np.arange(rows), np.random.default_rng(0).random(rows) + 0.01)
            names[per] = buf.name
        order = [(s, m) for m in METRICS for s in SUBJECTS]
        runs: dict[str, dict[str, list[float]]] = {s: {m: [] for m in METRICS} for s in SUBJECTS}
        for r in range(cfg.repeat):
            k = r % len(order)
            for subject, metric in order[k:] + order[:k]:  # rotating: machine noise hits all alike
                v = run_once(names, subject, metric, seconds)
                runs[subject][metric].append(v)
                print(f"      {subject}, {metric}: {v:,.0f} batches/s", flush=True)
    finally:
        for buf in made:
            buf.close()
            buf.unlink()
        sweep(peers.Ours.prefix)
    subjects = {
        s: {"status": "ok", "kind": "ours" if s == "shmbuffer" else "baseline" if s == "shmbuffer, 1 rank" else "variant",
            "note": f"{SUBJECTS[s][0]} process{'es' if SUBJECTS[s][0] > 1 else ''}, "
                    + (f"ranked attaches (world_size={SUBJECTS[s][0]})" if SUBJECTS[s][1] else "plain attaches"),
            "metrics": {m: {**summary(v), "gb_per_s": statistics_gb(v)} for m, v in runs[s].items()}}
        for s in SUBJECTS
    }
    ratios = {m: runs["shmbuffer"][m] and [a / b for a, b in zip(runs["shmbuffer"][m], runs["shmbuffer, 1 rank"][m],
                                                                     strict=True)] for m in METRICS}
    label = {"uniform": "uniform sample 256, quiet", "per": "prioritized sample 256 + update, quiet",
             "uniform_busy": "uniform sample 256, 2 busy processes beside",
             "per_busy": "prioritized sample 256 + update, 2 busy processes beside"}
    metrics = {m: Metric(f"total over the ranks: {label[m]}", "batches/s", 1, BATCH * MUJOCO.row_bytes) for m in METRICS}
    return case_result(f"{MUJOCO.title}: {rows:,} rows, no writers; 2 rank processes against 1, {seconds:g} s a run",
                       MUJOCO, cfg, metrics, subjects, seconds=seconds, rows=rows, cores=os.cpu_count(),
                       ratios_2_over_1={m: summary(v) for m, v in ratios.items() if v})


def statistics_gb(values: list[float]) -> float:
    return float(np.median(values)) * BATCH * MUJOCO.row_bytes / 1e9


def register(cases: dict[str, Case]) -> None:
    cases["ranks.mujoco"] = Case("ranks.mujoco", "2 ranks / 1 rank on one buffer: uniform, prioritized, quiet and busy",
                                 "multiproc", ranks_case, rounds=3)
