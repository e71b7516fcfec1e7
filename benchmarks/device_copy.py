"""The device-resident copy (``shmbuffer.DeviceReplay``) against sampling on the host, in one run.

    python -m benchmarks.device_copy                    # the CPU-side parts (refresh, draws), 1M rows
    python -m benchmarks.device_copy --device cuda      # the GPU table of benchmarks/README.md
    python -m benchmarks.device_copy --quick            # tiny sizes: the smoke test

Cases (each prints one line and goes into the JSON ``--out``):

* ``refresh``: a full buffer of MuJoCo rows (165 bytes) copied whole into the device copy (rows/s),
  then the rows of one new push of 65,536 rows (rows/s); beside them ``memcpy``, the same bytes by
  ``np.copyto`` (the floor of a host copy).
* ``sample``: 256 rows a batch, batches/s: ``DeviceReplay.sample`` against ``buf.sample(256).to(device)``
  and a numpy ring (``np.take`` of 256 rows of in-process arrays, then ``.to(device)``).
* ``prioritized``: sample 256 + ``update_priorities`` at full capacity, batches/s, the device copy
  against ``buf.sample`` + ``.to(device)`` + ``buf.update_priorities``.
* ``keep_up``: 2 writer processes push 64-row chunks at ``--ingest`` rows/s in all (default 1M) for
  ``--seconds`` while the learner samples from a device copy with ``max_lag_rows=0``: the ingest (rows/s), the learner's
  batches/s, and the lag (rows behind and milliseconds since the last sync) seen before each sample
  (median and 99th percentile).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import shmbuffer as sb

from .machine import info

SCHEMA = sb.Schema(obs=((17,), "float32"), action=((6,), "float32"), reward=((), "float32"),
                   next_obs=((17,), "float32"), done=((), "bool"))


def rows(k: int, start: int = 0) -> dict[str, np.ndarray]:
    seq = np.arange(start, start + k, dtype=np.float32)
    return {"obs": np.repeat(seq[:, None], 17, 1), "action": np.repeat(-seq[:, None], 6, 1), "reward": seq,
            "next_obs": np.repeat(seq[:, None] + 1, 17, 1), "done": np.zeros(k, bool)}


def rate(fn: Callable[[], Any], seconds: float) -> float:
    """Calls of ``fn`` per second over about ``seconds`` (after warm-up calls: torch's first
    indexing calls set up their kernels)."""
    for _ in range(20):
        fn()
    n, t0 = 0, time.perf_counter()
    while (t := time.perf_counter() - t0) < seconds:
        fn()
        n += 1
    return n / t


def sync_device(device: Any) -> Callable[[], None]:
    import torch

    return (lambda: torch.cuda.synchronize(device)) if torch.device(device).type == "cuda" else (lambda: None)


def fill(buf: sb.ReplayBuffer, capacity: int) -> None:
    for at in range(0, capacity, 65536):
        buf.push(rows(min(65536, capacity - at), at))


def case_refresh(capacity: int, device: str, tag: str) -> dict[str, Any]:
    buf = sb.ReplayBuffer(SCHEMA, capacity, name=f"bench-dev-r-{tag}")
    try:
        fill(buf, capacity)
        dev = sb.DeviceReplay(buf, device)
        buf.update([0], reward=np.float32(0.0))  # an update: the next sync copies every row again
        t0 = time.perf_counter()
        dev.sync()
        full = capacity / (time.perf_counter() - t0)
        k = min(65536, capacity)
        buf.push(rows(k, capacity))
        t0 = time.perf_counter()
        dev.sync()
        new = k / (time.perf_counter() - t0)
        src = np.ones(capacity * 165, np.uint8)
        dst = np.empty_like(src)
        np.copyto(dst, src)  # the pages touched once: the floor is the copy, not the page faults
        t0 = time.perf_counter()
        np.copyto(dst, src)
        memcpy = capacity / (time.perf_counter() - t0)
        dev.close()
        return {"case": "refresh", "full_rows_s": full, "new_rows_s": new, "memcpy_rows_s": memcpy,
                "full_vs_memcpy": full / memcpy}
    finally:
        buf.close()
        buf.unlink()


def case_sample(capacity: int, device: str, tag: str, seconds: float, prioritized: bool) -> dict[str, Any]:
    import torch

    sampler = sb.Prioritized(alpha=0.6) if prioritized else sb.Uniform()
    buf = sb.ReplayBuffer(SCHEMA, capacity, name=f"bench-dev-s-{tag}", sampler=sampler)
    done = sync_device(device)
    try:
        fill(buf, capacity)
        dev = sb.DeviceReplay(buf, device)
        prio = np.ones(256)

        def resident() -> None:
            b = dev.sample(256)
            if prioritized:
                dev.update_priorities(b.index, torch.ones(256, device=dev.device))
            done()

        def host() -> None:
            b = buf.sample(256).to(device)
            if prioritized:
                buf.update_priorities(b.index.cpu().numpy(), prio)
            done()

        out = {"case": "prioritized" if prioritized else "sample", "resident_batches_s": rate(resident, seconds),
               "host_batches_s": rate(host, seconds)}
        if not prioritized:
            ring = {k: np.ascontiguousarray(v) for k, v in rows(capacity).items()}
            gen = np.random.default_rng(0)

            def numpy_ring() -> None:
                idx = gen.integers(0, capacity, 256)
                {k: torch.from_numpy(np.take(v, idx, axis=0)).to(device) for k, v in ring.items()}
                done()

            out["numpy_ring_batches_s"] = rate(numpy_ring, seconds)
        out["resident_vs_host"] = out["resident_batches_s"] / out["host_batches_s"]
        dev.close()
        return out
    finally:
        buf.close()
        buf.unlink()


def _writer(handle: sb.BufferHandle, lane: int, stop: Any, per_s: float) -> None:
    """Push 64-row chunks at ``per_s`` rows a second (as fast as it can when that is more)."""
    buf = sb.ReplayBuffer.attach(handle)
    chunk = rows(64)
    t0, pushed = time.perf_counter(), 0
    while not stop.is_set():
        buf.push(chunk, lane=lane)
        pushed += 64
        ahead = pushed / per_s - (time.perf_counter() - t0)
        if ahead > 0:
            time.sleep(ahead)


def case_keep_up(capacity: int, device: str, tag: str, seconds: float, ingest: float) -> dict[str, Any]:
    buf = sb.ReplayBuffer(SCHEMA, capacity, name=f"bench-dev-k-{tag}", lanes=2)
    ctx = mp.get_context("fork")
    stop = ctx.Event()
    procs = [ctx.Process(target=_writer, args=(buf.handle, lane, stop, ingest / 2)) for lane in range(2)]
    done = sync_device(device)
    try:
        buf.push(rows(64), lane=0)
        dev = sb.DeviceReplay(buf, device, max_lag_rows=0)
        for p in procs:
            p.start()
        lags_rows, lags_ms, calls_ms, batches, empty = [], [], [], 0, 0
        inserted0, t0 = buf.stats["inserted"], time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            behind, since = dev.lag()
            lags_rows.append(behind)
            lags_ms.append(since * 1e3)
            t1 = time.perf_counter()
            try:
                dev.sample(256)
            except sb.EmptyBufferError:  # the writers lapped the whole ring during the sync
                empty += 1
                continue
            done()
            calls_ms.append((time.perf_counter() - t1) * 1e3)  # its sync included: how stale a draw can be
            batches += 1
        elapsed = time.perf_counter() - t0
        ingest = (buf.stats["inserted"] - inserted0) / elapsed
        dev.close()
    finally:
        stop.set()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
        buf.close()
        buf.unlink()
    return {"case": "keep_up", "ingest_rows_s": ingest, "learner_batches_s": batches / elapsed, "empty_syncs": empty,
            "lag_rows_p50": float(np.percentile(lags_rows, 50)), "lag_rows_p99": float(np.percentile(lags_rows, 99)),
            "lag_ms_p50": float(np.percentile(lags_ms, 50)), "lag_ms_p99": float(np.percentile(lags_ms, 99)),
            "sample_ms_p50": float(np.percentile(calls_ms, 50)), "sample_ms_p99": float(np.percentile(calls_ms, 99))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.device_copy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--capacity", type=int, default=1_000_000)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--ingest", type=float, default=1e6, help="rows/s the 2 writers of keep_up push in all")
    parser.add_argument("--quick", action="store_true", help="capacity 20,000 and 0.3 s a case")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    capacity, seconds = (20_000, 0.3) if args.quick else (args.capacity, args.seconds)
    tag = f"{os.getpid()}"
    results = {"machine": info(), "device": args.device, "capacity": capacity, "cases": [
        case_refresh(capacity, args.device, tag),
        case_sample(capacity, args.device, tag, seconds, prioritized=False),
        case_sample(capacity, args.device, tag, seconds, prioritized=True),
        case_keep_up(capacity, args.device, tag, seconds, args.ingest),
    ]}
    for case in results["cases"]:
        print("  ".join(f"{k}={v:,.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in case.items()), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
