"""The page-size part of the Atari sample's gap to its floor, measured apart from the buffer.

    python -m benchmarks.pages                  # 20 rounds, 50,000 Atari-sized rows a memory
    python -m benchmarks.pages --rounds 40 --capacity 20000

The same bytes (50,000 rows of 56,461 bytes, 2.8 GB) in three memories: anonymous memory with
transparent huge pages (``MADV_HUGEPAGE``: the heap the ``np.take`` floors read), anonymous memory
with 4 KiB pages (``MADV_NOHUGEPAGE``) and a ``/dev/shm`` mapping (4 KiB pages unless
``shmem_enabled`` allows huge ones). On each: ``np.take`` of 256 random rows of one packed array
(the floor's operation), and the C gather kernel (``_native.gather``, the stamp check included) of
the same rows from three columns of 16, 28,224 and 28,224 bytes (the buffer's layout). Times are
this thread's CPU time per call, the subjects interleaved round-robin; ``paired`` is the median
over rounds of (huge-page np.take / this) within the round. Needs 3 x 2.8 GB of memory, a third
of it in /dev/shm."""

from __future__ import annotations

import argparse
import itertools
import mmap
import os
import re
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from shmbuffer import native

from .data import ATARI

MADV_HUGEPAGE, MADV_NOHUGEPAGE = 14, 15


def memory(kind: str, nbytes: int) -> tuple[Any, np.ndarray]:
    """``nbytes`` of ``kind`` memory (``thp``, ``4k``, ``shm``), every page touched."""
    if kind == "shm":
        path = f"/dev/shm/shmbuffer-pages-{os.getpid()}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            m = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
            os.unlink(path)
    else:
        m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        m.madvise(MADV_HUGEPAGE if kind == "thp" else MADV_NOHUGEPAGE)
    a = np.frombuffer(m, np.uint8)
    a.fill(1)
    return m, a


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--capacity", type=int, default=ATARI.capacity)
    args = ap.parse_args()
    cap, batch, per = args.capacity, 256, 10
    widths = [16, 28_224, 28_224]  # the packed record (action, reward, done), obs, next_obs
    row = ATARI.row_bytes  # the packed floor's row: 56,461 bytes (the record's 16 hold 13 of them)
    lib = native.lib
    keep: list[Any] = []
    ops: dict[str, Callable[[], Any]] = {}
    rng = np.random.default_rng(1)
    nxt = itertools.cycle([rng.integers(0, cap, batch) for _ in range(64)]).__next__
    stamp = 2 * np.arange(cap, dtype=np.int64) + 2  # every row committed once
    ok = np.empty(batch, np.bool_)

    def arena() -> tuple[np.ndarray, ...]:  # as gather._gather_native allocates
        out = np.empty(sum(-(-batch * w // 64) * 64 for w in widths), np.uint8)
        views, at = [], 0
        for w in widths:
            views.append(out[at:at + batch * w].reshape(batch, w))
            at += -(-batch * w // 64) * 64
        return tuple(views)

    for kind in ("thp", "4k", "shm"):
        m, a = memory(kind, cap * sum(widths))  # seen as one packed array and as columns
        keep.append(m)
        ops[f"{kind:3s} np.take packed"] = (lambda p: lambda: np.take(p, nxt(), axis=0))(a[:cap * row].reshape(cap, row))
        if lib is not None:
            cols, at = [], 0
            for w in widths:
                cols.append(a[at:at + cap * w].reshape(cap, w))
                at += cap * w
            ops[f"{kind:3s} gather (C)"] = (lambda c: lambda: lib.gather(nxt(), 1, stamp, c, arena(), ok))(tuple(cols))
    smaps = open("/proc/self/smaps").read()
    print("AnonHugePages", sum(int(x) for x in re.findall(r"AnonHugePages:\s+(\d+)", smaps)) >> 10, "MiB,",
          "ShmemPmdMapped", sum(int(x) for x in re.findall(r"ShmemPmdMapped:\s+(\d+)", smaps)) >> 10, "MiB;",
          "C extension:", "loaded" if lib is not None else f"not loaded ({native.REASON})")
    for f in ops.values():
        f()
    res: dict[str, list[float]] = {k: [] for k in ops}
    names = list(ops)
    for _ in range(args.rounds):
        names = names[1:] + names[:1]
        for k in names:
            t = time.thread_time()
            for _ in range(per):
                ops[k]()
            res[k].append((time.thread_time() - t) / per * 1e6)
    ref = np.array(res["thp np.take packed"])
    print(f"{'':20s} {'min':>6s} {'median':>6s} us  paired (thp np.take / this)")
    for k, v in res.items():
        print(f"{k:20s} {min(v):6.0f} {statistics.median(v):6.0f}     {statistics.median(ref / np.array(v)):.2f}")


if __name__ == "__main__":
    main()
