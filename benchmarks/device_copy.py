"""The device-resident copy (``shmbuffer.DeviceReplay``) against sampling on the host, in one run.

    python -m benchmarks.device_copy                    # the CPU-side parts (refresh, draws), 1M rows
    python -m benchmarks.device_copy --device cuda      # the GPU table of benchmarks/README.md
    python -m benchmarks.device_copy --quick            # tiny sizes: the smoke test

Cases (each prints one line and goes into the JSON ``--out``):

* ``refresh``: a full buffer of MuJoCo rows (165 bytes) copied whole into the device copy (rows/s),
  then the rows of one new push of 65,536 rows (rows/s); beside them ``memcpy``, the same bytes by
  ``np.copyto`` (the floor of a host copy); and the refresh after an ``update()`` of 64 rows (ms,
  the median of 5).
* ``sample``: 256 rows a batch, batches/s: ``DeviceReplay.sample`` against ``buf.sample(256).to(device)``
  and a numpy ring (``np.take`` of 256 rows of in-process arrays, then ``.to(device)``).
* ``prioritized``: sample 256 + ``update_priorities`` at full capacity, batches/s, the device copy
  against ``buf.sample`` + ``.to(device)`` + ``buf.update_priorities``.
* ``keep_up``: 2 writer processes push 64-row chunks at ``--ingest`` rows/s in all (default 500k)
  into a full buffer for ``--seconds`` while the learner samples 256 rows, alternating between the
  device copy (its default bound and background refresher) and ``buf.sample(256).to(device)``:
  batches/s of each and their ratio, each call's latency (median, 99th percentile), the lag seen
  before each resident sample (rows, ms), the refresher's rows/s while it copies (the refresh's
  own clock, ``DeviceRows.state``: rows taken in over the seconds spent inside refreshes) against
  ``np.copyto`` of the same bytes in cache (``memcpy``: the average refresh's rows, copied again and
  again) and from memory (``memcpy_memory``: the buffer's bytes, once), the share of those seconds
  spent waiting while a sample held the copy's lock, the same rows over the CPU time the refreshing thread spent (what the load
  does not change) against ``np.copyto``, the refresher's rows/s (wall, and per CPU-second) against
  ``fresh_copy`` (``np.copyto`` of the rows the writers just wrote, as they come in: the floor for
  rows another core wrote moments before, which a hot ``np.copyto`` of the same bytes is not),
  whether a refresh was one C call, and the machine's 1-minute load.
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
        dev = sb.DeviceReplay(buf, device, refresher=False)  # only the timed syncs refresh
        dev.forget_rows()  # the next sync copies every row again
        t0 = time.perf_counter()
        dev.sync()
        full = capacity / (time.perf_counter() - t0)
        k = min(65536, capacity)
        buf.push(rows(k, capacity))
        t0 = time.perf_counter()
        dev.sync()
        new = k / (time.perf_counter() - t0)
        ids = buf.get(slice(0, 64)).index
        edit = []
        for _ in range(5):  # 64 rows updated in place (TorchRL's storage overwriting): the rows copied again
            buf.update(ids, reward=np.float32(0.0))
            t0 = time.perf_counter()
            dev.sync()
            edit.append(time.perf_counter() - t0)
        src = np.ones(capacity * 165, np.uint8)
        dst = np.empty_like(src)
        np.copyto(dst, src)  # the pages touched once: the floor is the copy, not the page faults
        t0 = time.perf_counter()
        np.copyto(dst, src)
        memcpy = capacity / (time.perf_counter() - t0)
        dev.close()
        return {"case": "refresh", "full_rows_s": full, "new_rows_s": new, "memcpy_rows_s": memcpy,
                "full_vs_memcpy": full / memcpy, "edit64_ms": float(np.median(edit)) * 1e3}
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

        out: dict[str, Any] = {"case": "prioritized" if prioritized else "sample", "resident_batches_s": rate(resident, seconds),
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


def _learner(sample: Callable[[], Any], seconds: float, lag: Callable[[], tuple[int, float]] | None) -> dict[str, float]:
    """Sample for ``seconds``: batches/s, each call's latency (ms), the lag seen before each call."""
    rows_behind, ms_behind, calls_ms = [], [], []
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        if lag is not None:
            behind, since = lag()
            rows_behind.append(behind)
            ms_behind.append(since * 1e3)
        t1 = time.perf_counter()
        sample()
        calls_ms.append((time.perf_counter() - t1) * 1e3)
    out = {"batches_s": len(calls_ms) / (time.perf_counter() - t0),
           "sample_ms_p50": float(np.percentile(calls_ms, 50)), "sample_ms_p99": float(np.percentile(calls_ms, 99))}
    if lag is not None:
        out.update(lag_rows_p50=float(np.percentile(rows_behind, 50)), lag_rows_p99=float(np.percentile(rows_behind, 99)),
                   lag_ms_p50=float(np.percentile(ms_behind, 50)), lag_ms_p99=float(np.percentile(ms_behind, 99)))
    return out


def fresh_copy(buf: sb.ReplayBuffer, seconds: float, pace: float = 0.0025) -> float:
    """Rows/s of ``np.copyto`` of the rows the writers just wrote: every ``pace`` seconds (about
    as often as the refresher refreshes) each lane's rows since the last look, as runs of slots,
    from the columns a refresh copies; only the copies timed. The floor of copying fresh rows
    (written by another core moments before) in this process, beside the hot ``np.copyto``."""
    from shmbuffer.protocol.layout import Lane

    block, ring = buf.block, buf.ring
    cols = ([block.packed] if block.packed is not None else []) + list(block.large.values())
    most = 65536
    scratch = [np.ones_like(c[:most]) for c in cols]  # touched: no page faults in the timed copies
    lc, cursors = ring.lane_capacity, ring.cursors[:, int(Lane.CURSOR)]
    seen, rows, spent, t0 = cursors.copy(), 0, 0.0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        time.sleep(pace)
        now = cursors.copy()
        for lane in range(ring.lanes):
            n = max(int(seen[lane]), int(now[lane]) - lc)
            while n < now[lane]:
                k = min(int(now[lane]) - n, lc - n % lc, most)
                s0 = lane * lc + n % lc
                t = time.perf_counter()
                for c, out in zip(cols, scratch, strict=True):
                    np.copyto(out[:k], c[s0:s0 + k])
                spent += time.perf_counter() - t
                rows, n = rows + k, n + k
        seen = now
    return rows / spent if spent else 0.0


def case_keep_up(capacity: int, device: str, tag: str, seconds: float, ingest: float) -> dict[str, Any]:
    """2 writer processes at ``ingest`` rows/s in all into a full buffer; the learner samples 256
    from the device copy (default bound, background refresher) and from the host
    (``buf.sample(256).to(device)``), alternating, same run; the refresher's rows/s while it
    copies against ``np.copyto`` of the same bytes."""
    buf = sb.ReplayBuffer(SCHEMA, capacity, name=f"bench-dev-k-{tag}", lanes=2)
    ctx = mp.get_context("fork")
    stop = ctx.Event()
    procs = [ctx.Process(target=_writer, args=(buf.handle, lane, stop, ingest / 2)) for lane in range(2)]
    done = sync_device(device)
    try:
        step = min(65536, capacity // 2)
        for at in range(0, capacity, step):
            buf.push(rows(min(step, capacity - at), at), lane=(at // step) % 2)
        dev = sb.DeviceReplay(buf, device)
        spent: list[float] = [0.0, 0.0, 0.0]  # seconds in refreshes, rows taken in, refreshes
        state = getattr(dev, "state", None)  # the refresh's own counts (a tree without them: timed here)
        if state is None:
            real = dev._refresh

            def refresh(*args: Any) -> int:
                t = time.perf_counter()
                got = real(*args)
                spent[0] += time.perf_counter() - t
                spent[1] += got
                spent[2] += 1
                return got

            dev._refresh = refresh  # type: ignore[method-assign,assignment]
        for p in procs:
            p.start()
        time.sleep(0.5)
        if state is not None:
            from shmbuffer.device.rows import CPU, DONE, SPENT, TAKEN, WAITED

            before = state[[SPENT, TAKEN, DONE, WAITED, CPU]].copy()
        inserted0, t0 = buf.stats["inserted"], time.perf_counter()
        runs: dict[str, list[dict[str, float]]] = {"resident": [], "host": []}
        for _ in range(2):
            runs["resident"].append(_learner(lambda: (dev.sample(256), done()), seconds / 4, dev.lag))
            runs["host"].append(_learner(lambda: (buf.sample(256).to(device), done()), seconds / 4, None))
        ingest = (buf.stats["inserted"] - inserted0) / (time.perf_counter() - t0)
        waited = cpu = 0.0
        if state is not None:
            got = state[[SPENT, TAKEN, DONE, WAITED, CPU]] - before
            spent, waited, cpu = [got[0] / 1e9, float(got[1]), float(got[2])], got[3] / 1e9, got[4] / 1e9
        one_call = bool(getattr(dev, "one_call", False))
        dev.close()
        fresh = fresh_copy(buf, seconds / 4)  # the writers still push; no copy refreshes now
    finally:
        stop.set()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
        buf.close()
        buf.unlink()
    each = int(max(1.0, spent[1] // max(1.0, spent[2]))) * 165
    src, dst = np.ones(each, np.uint8), np.empty(each, np.uint8)
    memcpy = rate(lambda: np.copyto(dst, src), 0.3) * each / 165
    whole, into = np.ones(capacity * 165, np.uint8), np.ones(capacity * 165, np.uint8)  # touched: no page faults
    t = time.perf_counter()
    np.copyto(into, whole)
    memcpy_memory = capacity / (time.perf_counter() - t)  # the buffer's bytes, from memory: no cache holds them
    del whole, into
    res = {k: float(np.mean([r[k] for r in runs["resident"]])) for k in runs["resident"][0]}
    host = {k: float(np.mean([r[k] for r in runs["host"]])) for k in runs["host"][0]}
    refresh_rows_s = spent[1] / spent[0] if spent[0] else 0.0
    return {"case": "keep_up", "ingest_rows_s": ingest, "resident_batches_s": res["batches_s"],
            "host_batches_s": host["batches_s"], "resident_vs_host": res["batches_s"] / host["batches_s"],
            "resident_ms_p99": res["sample_ms_p99"], "host_ms_p99": host["sample_ms_p99"],
            "resident_ms_p50": res["sample_ms_p50"], "host_ms_p50": host["sample_ms_p50"],
            "lag_rows_p50": res["lag_rows_p50"], "lag_rows_p99": res["lag_rows_p99"],
            "lag_ms_p50": res["lag_ms_p50"], "lag_ms_p99": res["lag_ms_p99"],
            "refresh_rows_s": refresh_rows_s, "refresh_rows_each": spent[1] / max(1, spent[2]),
            "refresh_vs_memcpy": refresh_rows_s / memcpy, "refresh_waited_share": waited / spent[0] if spent[0] else 0.0,
            "refresh_cpu_vs_memcpy": spent[1] / cpu / memcpy if cpu else 0.0,
            "fresh_copy_rows_s": fresh, "refresh_vs_fresh_copy": refresh_rows_s / fresh if fresh else 0.0,
            "refresh_cpu_vs_fresh_copy": spent[1] / cpu / fresh if cpu and fresh else 0.0,
            "refresh_vs_memcpy_memory": refresh_rows_s / memcpy_memory,
            "refresh_one_call": one_call, "load_1min": os.getloadavg()[0]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.device_copy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--capacity", type=int, default=1_000_000)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--ingest", type=float, default=5e5, help="rows/s the 2 writers of keep_up push in all")
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
