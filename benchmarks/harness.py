"""The harness every benchmark module uses: the registry of cases, the interleaved measuring loop,
the subjects shared by several cases, and profiling (for missed targets).

A case is a function ``run(cfg) -> dict`` registered under a dotted name (``mujoco.push64``); a
capability that does not exist yet is registered with ``pending`` (a reason) and no function, and
shows in the results as "not available yet". Adding a capability's rows means adding one function
with ``@case(...)`` (as ``cases.py`` does) or registering it (as ``multiproc.py`` and ``features.py``
do); ``measure`` does the rest. Every other module of ``benchmarks`` imports this one and this one
imports none of them but ``data`` and ``peers``, so no two benchmark modules import each other.

How ``measure`` times (every case, every subject alike):

* Each subject (shmbuffer, a peer, a baseline, a floor) is set up (built, sanity-checked, filled)
  and warmed up; the warm-up also sizes a block of calls lasting about ``cfg.block_s``.
* Then ``cfg.repeat`` rounds; in each, every subject runs one timed block of each variant, in an
  order that rotates from round to round, so machine noise hits all of them alike. The result is
  the median (with min and max) of the rounds.
* When the subjects of a case do not fit in memory together (Atari rows at capacity 50,000 are
  2.8 GB a subject), the peers are taken in waves that fit; shmbuffer, the baseline and the floors
  (which share one block) stay set up and take part in every round of every wave.
* A subject that is not installed, not applicable, fails its sanity check, raises or hangs
  (``cfg.timeout``) is reported with that status and the reason; the others go on.
"""

from __future__ import annotations

import cProfile
import gc
import io
import itertools
import pstats
import signal
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import peers
from .data import SPECS, Spec
from .peers import Unavailable

Op = Callable[[], Any]
BATCH = 256


# -- configuration ------------------------------------------------------------------------------------
@dataclass
class Config:
    quick: bool = False
    repeat: int = 5
    block_s: float = 0.25
    warmup_s: float = 0.15
    mp_seconds: float = 6.0
    timeout: float = 120.0
    memory_budget: int = 0  # bytes a case's subjects may hold at once; 0: 65% of the memory available

    def capacity(self, spec: Spec) -> int:
        return spec.quick_capacity if self.quick else spec.capacity

    def budget(self) -> int:
        if self.memory_budget:
            return self.memory_budget
        import psutil

        return int(psutil.virtual_memory().available * 0.65)


def quick_config(repeat: int | None = None) -> Config:
    return Config(quick=True, repeat=repeat or 1, block_s=0.02, warmup_s=0.01, mp_seconds=2.0, timeout=60.0)


# -- the registry ---------------------------------------------------------------------------------------
@dataclass
class Case:
    name: str
    title: str
    group: str
    run: Callable[[Config], dict[str, Any]] | None = None
    pending: str | None = None
    rounds: int | None = None
    """At most this many rounds unless ``--repeat`` asks for more: a case whose rounds last a minute
    (several processes, a training run) takes fewer, so the whole suite takes 25-35 minutes on the 2-core VM."""


CASES: dict[str, Case] = {}


def case(name: str, title: str, group: str) -> Callable[[Callable[[Config], dict[str, Any]]], Callable[[Config], dict[str, Any]]]:
    def register(fn: Callable[[Config], dict[str, Any]]) -> Callable[[Config], dict[str, Any]]:
        CASES[name] = Case(name, title, group, fn)
        return fn

    return register


def pending(name: str, title: str, group: str, reason: str) -> None:
    CASES[name] = Case(name, title, group, None, reason)


# -- measuring ------------------------------------------------------------------------------------------
class Timeout(Exception):
    pass


@contextmanager
def time_limit(seconds: float, what: str) -> Iterator[None]:
    """Raise ``Timeout`` in this (main) thread after ``seconds`` (for a call stuck in Python code)."""

    def alarm(signum: int, frame: Any) -> None:
        raise Timeout(f"{what}: no answer after {seconds:.0f} s (timed out)")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@dataclass
class Subject:
    """Something to time. ``setup`` returns ``({variant: op}, teardown)``; each op call does
    ``Metric.per_op`` units of work (rows or batches). ``check`` raises ``Unavailable`` cheaply,
    before anything is built. ``nbytes``: memory it holds while set up."""

    name: str
    kind: str  # ours | peer | baseline | floor
    setup: Callable[[], tuple[dict[str, Op], Callable[[], None]]]
    nbytes: int = 0
    note: str = ""
    check: Callable[[], None] = lambda: None


@dataclass
class Metric:
    label: str
    unit: str
    per_op: int  # units per call
    bytes_per_unit: int


def summary(values: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def _failure(e: BaseException) -> dict[str, Any]:
    if isinstance(e, Unavailable):
        return {"status": e.status, "reason": e.reason}
    if isinstance(e, Timeout):
        return {"status": "timeout", "reason": str(e)}
    return {"status": "error", "reason": f"{type(e).__name__}: {e}"}


def _block(op: Op, n: int) -> float:
    gc.collect()
    t0 = time.perf_counter()
    for _ in itertools.repeat(None, n):
        op()
    return time.perf_counter() - t0


def _warm(op: Op, seconds: float, block_s: float = 0.0) -> int:
    """Call ``op`` for ``seconds`` (3 calls at least); return the calls a block of ``block_s`` takes."""
    n, spent = 0, 0.0
    t0 = time.perf_counter()
    while spent < seconds or n < 3:
        op()
        n += 1
        spent = time.perf_counter() - t0
    return max(1, min(1_000_000, round(block_s * n / spent)))


def waves(peers_: list[Subject], room: int) -> list[list[Subject]]:
    """Peers in groups that fit in ``room`` bytes together (one at least per group)."""
    out: list[list[Subject]] = []
    for s in peers_:
        if out and sum(p.nbytes for p in out[-1]) + s.nbytes <= room:
            out[-1].append(s)
        else:
            out.append([s])
    return out or [[]]


def measure(subjects: list[Subject], metrics: dict[str, Metric], cfg: Config) -> dict[str, dict[str, Any]]:
    """Time every subject's variants, interleaved round-robin over ``cfg.repeat`` rounds.

    When everything does not fit in memory at once, the peers are measured in waves that fit:
    shmbuffer, the baseline and the floors stay set up throughout and take part in every round of
    every wave (so they have more rounds); each wave's peers are set up, timed and torn down.
    """
    out: dict[str, dict[str, Any]] = {}
    live: dict[str, tuple[dict[str, Op], Callable[[], None]]] = {}
    calls: dict[tuple[str, str], int] = {}
    runs: dict[tuple[str, str], list[float]] = {}
    ready: list[Subject] = []
    for s in subjects:
        try:
            s.check()
            ready.append(s)
        except Exception as e:
            out[s.name] = _failure(e)
    anchors = [s for s in ready if s.kind != "peer"]
    groups = waves([s for s in ready if s.kind == "peer"], cfg.budget() - sum(s.nbytes for s in anchors))

    def setup(s: Subject) -> None:
        try:
            with time_limit(cfg.timeout * 3, f"{s.name} setup"):
                live[s.name] = s.setup()
        except Exception as e:
            out[s.name] = _failure(e)

    def teardown(s: Subject) -> None:
        ops_down = live.pop(s.name, None)
        if ops_down is not None:
            try:
                ops_down[1]()
            except Exception as e:
                out.setdefault(s.name, {"status": "error", "reason": f"teardown: {type(e).__name__}: {e}"})

    def time_one(s: Subject, fresh: bool) -> None:
        try:
            for variant, op in live[s.name][0].items():
                with time_limit(cfg.timeout, f"{s.name} {variant}"):
                    if (s.name, variant) not in calls:
                        calls[s.name, variant] = _warm(op, cfg.warmup_s, cfg.block_s)
                    elif fresh:
                        _warm(op, cfg.warmup_s / 3)
                    n = calls[s.name, variant]
                    dt = _block(op, n)
                runs.setdefault((s.name, variant), []).append(n * metrics[variant].per_op / dt)
        except Exception as e:
            out[s.name] = _failure(e)
            teardown(s)

    try:
        for s in anchors:
            setup(s)
        for wave in groups:
            for s in wave:
                setup(s)
            group = [s for s in subjects if s in anchors or s in wave]
            fresh = {s.name for s in group}
            for r in range(cfg.repeat):
                for s in group[r % len(group):] + group[:r % len(group)]:
                    if s.name not in out and s.name in live:
                        time_one(s, s.name in fresh)
                        fresh.discard(s.name)
            for s in wave:
                teardown(s)
    finally:
        for s in subjects:
            teardown(s)
    for s in subjects:
        if s.name in out:
            out[s.name].update(kind=s.kind, note=s.note)
            continue
        res: dict[str, Any] = {"status": "ok", "kind": s.kind, "note": s.note, "metrics": {}, "calls_per_block": {}}
        for variant, m in metrics.items():
            values = runs.get((s.name, variant))
            if values is None:
                res["metrics"][variant] = {"status": "n/a", "reason": f"{s.name} has no {m.label}"}
                continue
            st = summary(values)
            st["gb_per_s"] = st["median"] * m.bytes_per_unit / 1e9
            res["metrics"][variant] = st
            res["calls_per_block"][variant] = calls[s.name, variant]
        out[s.name] = res
    if len(groups) > 1:
        for s in subjects:
            out[s.name]["wave"] = next((i for i, g in enumerate(groups) if s in g), "all")
    return out


def case_result(title: str, spec: Spec | None, cfg: Config, metrics: dict[str, Metric],
                subjects: dict[str, dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {
        "status": "ok",
        "title": title,
        "schema": spec.name if spec else None,
        "capacity": cfg.capacity(spec) if spec else None,
        "row_bytes": spec.row_bytes if spec else None,
        "metrics": {k: {"label": m.label, "unit": m.unit, "bytes_per_unit": m.bytes_per_unit} for k, m in metrics.items()},
        "subjects": subjects,
        **extra,
    }


# -- subjects -------------------------------------------------------------------------------------------
def fill(store: peers.Store, spec: Spec, capacity: int) -> None:
    """Push ``capacity`` rows (valid rows, repeated) so the store is full and every page touched."""
    chunk = store.fill_chunk or max(1, min(capacity, 8192, (16 << 20) // spec.row_bytes))
    push = store.pusher(spec.make(0, np.arange(chunk)), False)
    for _ in range(-(-capacity // chunk)):
        push()


def store_subject(cls: type[peers.Store], spec: Spec, capacity: int, k: int, variants: dict[str, str]) -> Subject:
    """``variants``: ``{"push": ...}`` or ``{"numpy": "sample", "torch": "sample_torch"}``."""

    def check() -> None:
        cls.available()
        peers.sanity(cls, spec)

    def setup() -> tuple[dict[str, Op], Callable[[], None]]:
        store = cls(spec, capacity, k)
        try:
            fill(store, spec, capacity)
            ops: dict[str, Op] = {}
            for variant, method in variants.items():
                if method == "push":
                    ops[variant] = _pushes(store, spec, k)
                elif method == "sample" and not cls.numpy_sample:
                    continue
                else:
                    ops[variant] = _bind(getattr(store, method), BATCH)
            return ops, store.close
        except BaseException:
            store.close()
            raise

    return Subject(cls.name, cls.kind, setup, capacity * spec.row_bytes, peers.NOTES.get(cls.name, ""), check)


def _pushes(store: peers.Store, spec: Spec, k: int) -> Op:
    """An op that pushes one of 4 prepared k-row batches (in turn) into ``store``."""
    nxt = itertools.cycle([store.pusher(spec.make(0, np.arange(j * k, (j + 1) * k)), k == 1) for j in range(4)]).__next__

    def op() -> Any:
        return nxt()()

    return op


def _bind(fn: Callable[[int], Any], n: int) -> Op:
    return lambda: fn(n)


class Pool:
    """One preallocated block of ``capacity`` rows, every page touched, that all the floors of a case
    share (as one packed array or as separate columns): touching fresh memory is slow on a VM, and
    the floors need not each have their own."""

    def __init__(self, spec: Spec, capacity: int) -> None:
        self.spec = spec
        self.capacity = capacity
        self.nbytes = capacity * spec.row_bytes + 64 * len(spec.fields)
        self._mem: np.ndarray | None = None

    def mem(self) -> np.ndarray:
        if self._mem is None:
            self._mem = np.empty(self.nbytes, np.uint8)
            self._mem.fill(1)
        return self._mem

    def packed(self) -> np.ndarray:
        return self.mem()[:self.capacity * self.spec.row_bytes].reshape(self.capacity, self.spec.row_bytes)

    def columns(self) -> dict[str, np.ndarray]:
        mem, at, cols = self.mem(), 0, {}
        for n in self.spec.fields:
            dt, shape = self.spec.dtype(n), self.spec.shape(n)
            size = self.capacity * int(np.prod(shape, dtype=np.int64)) * dt.itemsize
            cols[n] = mem[at:at + size].view(dt).reshape(self.capacity, *shape)
            at += -(-size // 64) * 64
        return cols

    def free(self) -> None:
        self._mem = None


def copyto_floor(pool: Pool, k: int, packed: bool) -> Subject:
    """``np.copyto`` of a k-row block into a preallocated array of the buffer's size, moving round it."""
    spec, capacity = pool.spec, pool.capacity

    def setup() -> tuple[dict[str, Op], Callable[[], None]]:
        limit = capacity - capacity % k
        pos = 0
        if packed:
            dest = pool.packed()
            src = np.ones((k, spec.row_bytes), np.uint8)

            def op() -> None:
                nonlocal pos
                np.copyto(dest[pos:pos + k], src)
                pos = (pos + k) % limit
        else:
            cols = pool.columns()
            srcs = [(cols[n], np.ones((k, *spec.shape(n)), spec.dtype(n))) for n in spec.fields]

            def op() -> None:
                nonlocal pos
                for col, src in srcs:
                    np.copyto(col[pos:pos + k], src)
                pos = (pos + k) % limit

        return {"push": op}, lambda: None

    how = "one packed array" if packed else "separate columns"
    return Subject(f"floor np.copyto ({how})", "floor", setup, pool.nbytes if packed else 0,
                   f"np.copyto of a {k}-row block into a preallocated {how}, moving round it")


def take_floor(pool: Pool, packed: bool, variants: tuple[str, ...]) -> Subject:
    """``np.take`` of 256 random rows (indices drawn up front) from a heap array of the same bytes.

    The index sets cycle through enough draws to touch every row about four times (at most 16,384
    sets), so the rows come from memory as a buffer's do: 64 sets, as before issue 24, touched
    2.75 MB of MuJoCo rows, which stay in the cache after the first round and made the floor 3-4x
    faster than any gather from a 1M-row buffer can be."""
    capacity = pool.capacity

    def setup() -> tuple[dict[str, Op], Callable[[], None]]:
        rng = np.random.default_rng(1)
        sets = int(min(16_384, max(64, 4 * capacity // BATCH)))
        idx = itertools.cycle(list(rng.integers(0, capacity, (sets, BATCH)))).__next__
        if packed:
            heap = pool.packed()

            def op() -> Any:
                return np.take(heap, idx(), axis=0)
        else:
            cols = list(pool.columns().values())

            def op() -> Any:
                i = idx()
                return [np.take(c, i, axis=0) for c in cols]

        return dict.fromkeys(variants, op), lambda: None

    how = "one packed array" if packed else "separate columns"
    return Subject(f"floor np.take ({how})", "floor", setup, pool.nbytes if packed else 0,
                   f"np.take of {BATCH} rows at random (pre-drawn) indices from a heap {how}")




# -- profiles (for missed targets) ----------------------------------------------------------------------
PROFILES: dict[str, Callable[[Spec, int], tuple[Op, Callable[[], None]]]] = {}
"""Ops ``profile`` can profile besides push and sample, by name (``<schema>.<name>``): each takes the
schema's spec and the capacity and gives ``(op, close)``; ``features.register`` adds ``prioritized``."""


def profile(what: str, cfg: Config, top: int = 14) -> list[str]:
    """cProfile of shmbuffer doing ``what`` (``push<k>``, ``sample256[torch]`` or one of
    ``PROFILES`` such as ``prioritized``, on ``<schema>``), in this process at the case's capacity;
    the ``top`` entries by own time."""
    schema, op_name = what.split(".", 1)
    spec = SPECS[schema]
    cap = cfg.capacity(spec)
    op: Op | None = None
    if op_name in PROFILES:  # prioritized sample + update, ...
        op, close = PROFILES[op_name](spec, cap)
    else:
        store = peers.Ours(spec, cap, 64)
        close = store.close
    try:
        if op is None:
            fill(store, spec, cap)
            if op_name.startswith("push"):
                op = _pushes(store, spec, int(op_name[4:]))
            else:
                op = _bind(store.sample_torch if op_name.endswith("torch") else store.sample, BATCH)
        n = _warm(op, 0.1, 0.5 if cfg.quick else 2.0)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(n):
            op()
        prof.disable()
    finally:
        close()
    s = io.StringIO()
    stats = pstats.Stats(prof, stream=s)
    stats.sort_stats("tottime").print_stats(top)
    lines = [ln.rstrip() for ln in s.getvalue().splitlines() if ln.strip()]
    start = next((i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls")), 0)
    return [f"{n} calls of {what} (capacity {cap})", *(_short(ln) for ln in lines[start:])]


def _short(line: str) -> str:
    """A profile line without the long site-packages and checkout prefixes."""
    for root in (Path(np.__file__).parents[1], Path(__file__).parents[1]):
        line = line.replace(f"{root}/", "")
    return line
