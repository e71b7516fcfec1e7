"""Cases for the sampling features beyond uniform rows: prioritized replay, windows of consecutive
steps, and the prefetching loader (all MuJoCo-like rows, capacity 1,000,000; ``--quick``: 20,000).

* ``mujoco.prioritized``: one op is a prioritized sample of 256 rows plus a priority update of those
  256 rows (the PER learner's step, without the learning), in iterations/s. Every subject is filled
  with the same rows and the same random priorities first, and each update gives the next of 64
  pre-drawn arrays of random priorities (converted to the library's format up front).
* ``mujoco.sequence``: 256 windows of 16 consecutive steps from 8 envs' rows with episode ids
  (``data.Lanes``: episodes of 1,000 steps), in batches/s.
* ``mujoco.loader``: training iterations/s, each one a batch of 256 plus a small fixed training step
  (a 17-256-256-6 MLP, forward, MSE loss against the action, backward, Adam step), with batches from
  shmbuffer's ``loader(prefetch=2)`` (on the CPU it samples in the caller's thread by default), from
  ``loader(prefetch=2, background=True)`` (a thread samples ahead), from ``sample(256).to("cpu")`` in
  the loop, and from TorchRL's ``ReplayBuffer(prefetch=2)`` and without prefetch. The floor is the
  training step alone on a fixed batch: the rate an ideal loader (free batches) would give. The added
  ``train_small`` measure does the same with a 17-64-64-6 MLP (shmbuffer's subjects and the floor only),
  where sampling is a larger share of an iteration.

Torch runs with 1 thread in the sequence and loader cases (set for the case, restored after; see
``torch_threads``): on this shared 2-core VM its default 2 threads made TorchRL's slice sampling 4-20x
slower whenever other work held the other core, and the loader's sampling thread needs a core to
overlap with the training step.

Before a subject is timed it must return the right rows: prioritized stores are checked on a small
buffer (the rows and the indices they come back with, weights in (0, 1], and a skewed update must
skew the draws), the sequence stores on the data they hold (every step of a window is the next step
of the same env and episode, and shmbuffer's windows stop exactly at an episode's end), the
loaders on a batch.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from . import peers
from .data import MUJOCO, Lanes, Spec
from .harness import BATCH, PROFILES, Case, Config, Metric, Op, Pool, Subject, case_result, fill, measure, take_floor
from .peers import Unavailable

LANES = 8
LENGTH = 16
FILL = 8192  # rows per push when filling


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Torch with ``n`` threads inside the block (when torch is installed), as it was after. On this
    2-core VM shared with other work, torch's default 2 threads make its CPU ops 4-20x slower
    whenever the other core is busy (a thread waits for the other at every parallel op)."""
    try:
        import torch
    except ImportError:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def no_equivalent(case: str) -> list[Subject]:
    """Peers that lack the case's feature: listed, never measured."""

    def subject(name: str, why: str) -> Subject:
        def check() -> None:
            raise Unavailable("no equivalent", why)

        return Subject(name, "peer", lambda: ({}, lambda: None), 0, "", check)

    return [subject(n, why) for n, why in peers.NO_EQUIVALENT.get(case, {}).items()]


# -- prioritized ---------------------------------------------------------------------------------------
def fill_priorities(j: int, k: int) -> np.ndarray:
    """The random priorities of fill chunk ``j`` (the same for every subject)."""
    return np.abs(np.random.default_rng(1000 + j).standard_normal(k)) + 0.01


def update_priorities(k: int = BATCH, count: int = 64) -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [np.abs(rng.standard_normal(k)) + 0.01 for _ in range(count)]


def fill_prioritized(store: peers.PStore, spec: Spec, capacity: int) -> None:
    chunk = min(FILL, capacity)
    rows = spec.make(0, np.arange(chunk))
    for j in range(-(-capacity // chunk)):
        store.push(rows, fill_priorities(j, chunk))


def prioritized_op(store: peers.PStore) -> Op:
    """Sample 256, update their priorities with the next pre-drawn array."""
    nxt = itertools.cycle([store.prepare(p) for p in update_priorities()]).__next__
    sample, index, update = store.sample, store.index, store.update

    def op() -> Any:
        out = sample(BATCH)
        update(index(out), nxt())
        return out

    return op


def check_prioritized(cls: type[peers.PStore], spec: Spec,
                      _done: dict[str, Unavailable | None] = {}) -> None:  # noqa: B006
    """On 64 rows (seq 0..63): sampled rows are right and come with their own indices, weights are
    in (0, 1], and after giving rows 3 and 7 priority 100 and the rest 0.001, most draws are theirs."""
    if cls.name not in _done:
        _done[cls.name] = None
        try:
            store = cls(spec, 64)
            try:
                ids = store.push(spec.make(0, np.arange(64)), fill_priorities(0, 64))
                out = store.sample(BATCH)
                f = spec.canonical(store.raw(out))
                ok, _, seq = spec.check(f, full=True)
                if not ok.all():
                    raise Unavailable("wrong data", f"{(~ok).sum()} of {ok.size} sampled rows differ from the rows pushed")
                got = store.indices(out)
                if not np.array_equal(np.asarray(ids)[seq], got):
                    raise Unavailable("wrong data", "sampled rows do not come with their own indices")
                w = store.weights(out)
                if w.shape[0] != BATCH or not ((w > 0) & (w <= 1 + 1e-6)).all():
                    raise Unavailable("wrong data", f"importance weights not in (0, 1]: {w[:4]} ...")
                p = np.full(64, 1e-3)
                p[[3, 7]] = 100.0
                store.update(np.asarray(ids), store.prepare(p))
                hot = 0
                for _ in range(4):
                    _, _, seq = spec.check(spec.canonical(store.raw(store.sample(BATCH))))
                    hot += int(np.isin(seq, (3, 7)).sum())
                if hot < 0.9 * 4 * BATCH:
                    raise Unavailable("wrong data", f"after the update only {hot} of {4 * BATCH} draws were the 2 "
                                                    "high-priority rows (expected >= 90%)")
            finally:
                store.close()
        except Unavailable as e:
            _done[cls.name] = e
        except Exception as e:
            _done[cls.name] = Unavailable("error", f"sanity check raised {type(e).__name__}: {e}")
    if _done[cls.name] is not None:
        raise _done[cls.name]  # type: ignore[misc]


def prioritized_subject(cls: type[peers.PStore], spec: Spec, capacity: int) -> Subject:
    def check() -> None:
        cls.available()
        check_prioritized(cls, spec)

    def setup() -> tuple[dict[str, Op], Callable[[], None]]:
        store = cls(spec, capacity)
        try:
            fill_prioritized(store, spec, capacity)
            op = prioritized_op(store)
            for _ in range(4):  # priorities updated at least once before timing
                op()
            return {"per": op}, store.close
        except BaseException:
            store.close()
            raise

    return Subject(cls.name, cls.kind, setup, 2 * capacity * spec.row_bytes, cls.note, check)


def prioritized_case(cfg: Config) -> dict[str, Any]:
    spec = MUJOCO
    cap = cfg.capacity(spec)
    metrics = {"per": Metric(f"prioritized sample {BATCH} + update {BATCH}", "iterations/s", 1, BATCH * spec.row_bytes)}
    pool = Pool(spec, cap)
    # the floor: the gather part alone (np.take of 256 random rows of the same bytes; no draw, no update)
    subjects = [prioritized_subject(c, spec, cap) for c in peers.PSTORES] + [take_floor(pool, True, ("per",))]
    subjects += no_equivalent("mujoco.prioritized")
    try:
        res = measure(subjects, metrics, cfg)
    finally:
        pool.free()
    res = {s.name: res[s.name] for s in subjects}
    return case_result(f"{spec.title}: prioritized sample {BATCH} + update of their {BATCH} priorities "
                       f"(alpha {peers.ALPHA}, beta {peers.BETA}) at capacity {cap:,}", spec, cfg, metrics, res)


def prioritized_profile_op(spec: Spec, capacity: int) -> tuple[Op, Callable[[], None]]:
    store = peers.POurs(spec, capacity)
    try:
        fill_prioritized(store, spec, capacity)
        return prioritized_op(store), store.close
    except BaseException:
        store.close()
        raise


# -- sequences -----------------------------------------------------------------------------------------
def check_windows(store: peers.SeqStore, data: Lanes) -> float:
    """Sample 256 windows from a filled store and check them (see the module docstring); returns the
    fraction of window steps that exist (1 for whole windows)."""
    n, length = BATCH, LENGTH
    fields, mask = store.windows(store.sample(n, length), n, length)
    if mask.shape != (n, length):
        raise Unavailable("wrong data", f"expected {n} windows of {length}, got a mask of shape {mask.shape}")
    flat = {k: v.reshape(n * length, *v.shape[2:]) for k, v in fields.items()}
    ok, w, seq = data.spec.check(flat, full=True)
    ok, w, seq = ok.reshape(n, length), w.reshape(n, length), seq.reshape(n, length)
    if not ok[mask].all():
        raise Unavailable("wrong data", f"{(~ok[mask]).sum()} window steps differ from the rows pushed")
    if not mask[:, 0].all():
        raise Unavailable("wrong data", "a window's first step is missing")
    inner = mask[:, 1:] & mask[:, :-1]
    if not ((w[:, 1:] == w[:, :1]) | ~mask[:, 1:]).all() or not (np.diff(seq, axis=1) == 1)[inner].all():
        raise Unavailable("wrong data", "a window's steps are not consecutive steps of one env")
    end = data.episode_end(seq[:, 0])
    if store.episodes_checked:
        if store.strict:
            if not mask.all() or (seq[:, -1] >= end).any():
                raise Unavailable("wrong data", "a window is short or crosses an episode's end")
        else:  # a window holds exactly the steps up to its episode's end, at most `length`
            want = np.minimum(length, end - seq[:, 0])
            got = mask.sum(axis=1)
            if not (np.logical_and.accumulate(mask, axis=1) == mask).all() or not np.array_equal(got, want):
                raise Unavailable("wrong data", "a window does not stop exactly at its episode's end")
    return float(mask.mean())


def sequence_subject(cls: type[peers.SeqStore], data: Callable[[], Lanes], capacity: int, spec: Spec,
                     filled: dict[str, float]) -> Subject:
    def setup() -> tuple[dict[str, Op], Callable[[], None]]:
        store = cls(data())
        try:
            filled[cls.name] = check_windows(store, store.data)
            sample = store.sample
            return {"windows": lambda: sample(BATCH, LENGTH)}, store.close
        except BaseException:
            store.close()
            raise

    return Subject(cls.name, cls.kind, setup, 2 * capacity * spec.row_bytes, cls.note, cls.available)


def sequence_case(cfg: Config) -> dict[str, Any]:
    spec = MUJOCO
    cap = cfg.capacity(spec)
    cap -= cap % LANES
    cache: list[Lanes] = []

    def data() -> Lanes:
        if not cache:
            cache.append(Lanes.make(spec, cap, LANES))
        return cache[0]

    metrics = {"windows": Metric(f"{BATCH} windows of {LENGTH} steps", "batches/s", 1, BATCH * LENGTH * spec.row_bytes)}
    filled: dict[str, float] = {}
    subjects = [sequence_subject(c, data, cap, spec, filled) for c in peers.SEQSTORES]
    subjects += no_equivalent("mujoco.sequence")
    with torch_threads(1):
        res = measure(subjects, metrics, cfg)
    res = {s.name: res[s.name] for s in subjects}
    cache.clear()
    for name, frac in filled.items():
        if res.get(name, {}).get("status") == "ok":
            res[name]["steps_present"] = round(frac, 4)
    return case_result(f"{spec.title}: {BATCH} windows of {LENGTH} consecutive steps, {LANES} envs (one lane "
                       f"each), episodes of 1,000 steps, capacity {cap:,}", spec, cfg, metrics, res,
                       lanes=LANES, length=LENGTH, torch_threads=1)


# -- the loader -----------------------------------------------------------------------------------------
SMALL = 64
"""The hidden width of the added ``train_small`` variant: a 17-64-64-6 MLP, whose step is about a third
of the 17-256-256-6 one's, so that sampling is a larger share of each iteration."""


class Trainer:
    """The fixed fake training step: a 17-``hidden``-``hidden``-6 MLP (256 unless told), MSE of its
    output against the action, backward, Adam step."""

    def __init__(self, hidden: int = 256) -> None:
        import torch

        torch.manual_seed(0)
        nn = torch.nn
        self.net = nn.Sequential(nn.Linear(17, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, 6))
        self.opt = torch.optim.Adam(self.net.parameters(), lr=1e-4)
        self.loss = nn.functional.mse_loss

    def step(self, obs: Any, action: Any) -> None:
        self.opt.zero_grad(set_to_none=True)
        self.loss(self.net(obs), action).backward()
        self.opt.step()


def _check_batch(spec: Spec, raw: dict[str, Any], who: str) -> None:
    ok, _, _ = spec.check(spec.canonical(raw), full=True)
    if not ok.all() or ok.size != BATCH:
        raise Unavailable("wrong data", f"{who}: {(~ok).sum()} of {ok.size} rows differ from the rows pushed")


def _train_ops(nxt: Callable[[], Any]) -> dict[str, Op]:
    """The two measures on batches from ``nxt``: with the 17-256-256-6 MLP and with the small one."""

    def op(trainer: Trainer) -> Op:
        def one() -> Any:
            b = nxt()
            trainer.step(b.obs, b.action)
            return b

        return one

    return {"train": op(Trainer()), "train_small": op(Trainer(SMALL))}


def loader_subjects(spec: Spec, capacity: int) -> list[Subject]:
    def ours(how: str) -> Callable[[], tuple[dict[str, Op], Callable[[], None]]]:
        """``how``: "loader" (the default: on the CPU, sampled in the caller's thread), "thread"
        (``background=True``) or "loop" (``sample().to("cpu")`` in the loop, no loader)."""

        def setup() -> tuple[dict[str, Op], Callable[[], None]]:
            store = peers.Ours(spec, capacity, 64)
            loader: Any = None
            try:
                fill(store, spec, capacity)
                if how == "loop":
                    buf = store.buf

                    def nxt() -> Any:
                        return buf.sample(BATCH).to("cpu")
                else:
                    background = True if how == "thread" else None
                    loader = store.buf.loader(BATCH, device="cpu", prefetch=2, background=background)
                    nxt = iter(loader).__next__
                first = nxt()
                _check_batch(spec, first.fields, "shmbuffer")

                def close() -> None:
                    if loader is not None:
                        loader.close()
                    store.close()

                return _train_ops(nxt), close
            except BaseException:
                if loader is not None:
                    loader.close()
                store.close()
                raise

        return setup

    def torchrl(prefetch: int | None) -> Callable[[], tuple[dict[str, Op], Callable[[], None]]]:
        def setup() -> tuple[dict[str, Op], Callable[[], None]]:
            d = peers.need("torchrl.data")
            rb = d.ReplayBuffer(storage=d.LazyTensorStorage(capacity), batch_size=BATCH, prefetch=prefetch)
            try:
                chunk = min(FILL, capacity)
                td = peers.tensordict(spec.make(0, np.arange(chunk)), False)
                for _ in range(-(-capacity // chunk)):
                    rb.extend(td)
                trainer = Trainer()
                _check_batch(spec, {k: v for k, v in rb.sample().items()}, "torchrl")

                def op() -> Any:
                    batch = rb.sample()
                    trainer.step(batch["obs"], batch["action"])
                    return batch

                return {"train": op}, rb.shutdown
            except BaseException:
                rb.shutdown()
                raise

        return setup

    def step_only() -> tuple[dict[str, Op], Callable[[], None]]:
        import torch

        trainer, small = Trainer(), Trainer(SMALL)
        rows = spec.make(0, np.arange(BATCH))
        obs, action = torch.from_numpy(rows["obs"]), torch.from_numpy(rows["action"])
        return {"train": lambda: trainer.step(obs, action), "train_small": lambda: small.step(obs, action)}, lambda: None

    def needs(*modules: str) -> Callable[[], None]:
        def check() -> None:
            for m in modules:
                peers.need(m)

        return check

    nbytes = capacity * spec.row_bytes
    return [
        Subject("shmbuffer", "ours", ours("loader"), nbytes,
                "`buf.loader(256, device='cpu', prefetch=2)`: on the CPU the loader samples in the caller's thread "
                "by default; each iteration takes the next batch (CPU tensors) and runs the training step",
                needs("torch", "shmbuffer")),
        Subject("shmbuffer loader(background=True)", "ours", ours("thread"), nbytes,
                "`buf.loader(256, device='cpu', prefetch=2, background=True)`: a thread samples ahead; each "
                "iteration takes the next batch and runs the training step", needs("torch", "shmbuffer")),
        Subject("shmbuffer sample().to('cpu'), no prefetch", "baseline", ours("loop"), nbytes,
                "`buf.sample(256).to('cpu')` in the loop, then the training step", needs("torch", "shmbuffer")),
        Subject("torchrl ReplayBuffer(prefetch=2)", "peer", torchrl(2), nbytes,
                "`ReplayBuffer(storage=LazyTensorStorage(capacity), batch_size=256, prefetch=2)` (a thread pool "
                "samples ahead); `sample()` then the training step", needs("torch", "torchrl.data")),
        Subject("torchrl ReplayBuffer, no prefetch", "peer", torchrl(None), nbytes,
                "as above without `prefetch`", needs("torch", "torchrl.data")),
        Subject("floor: training step alone", "floor", step_only, 0,
                "the training step on one fixed batch, no sampling: what a free loader would give", needs("torch")),
        *no_equivalent("mujoco.loader"),
    ]


def loader_case(cfg: Config) -> dict[str, Any]:
    spec = MUJOCO
    cap = cfg.capacity(spec)
    try:
        import torch  # noqa: F401
    except ImportError:
        return {"status": "skipped", "reason": "torch is not installed"}
    metrics = {"train": Metric(f"batch of {BATCH} + training step (17-256-256-6 MLP, Adam)", "iterations/s", 1,
                               BATCH * spec.row_bytes),
               "train_small": Metric(f"batch of {BATCH} + small training step (17-{SMALL}-{SMALL}-6 MLP, Adam; added "
                                     "variant: sampling a larger share)", "iterations/s", 1, BATCH * spec.row_bytes)}
    subjects = loader_subjects(spec, cap)
    with torch_threads(1):
        res = measure(subjects, metrics, cfg)
    res = {s.name: res[s.name] for s in subjects}
    return case_result(f"{spec.title}: training iterations/s, each a batch of {BATCH} and a fixed training step "
                       f"(torch with 1 thread), capacity {cap:,}", spec, cfg, metrics, res, torch_threads=1)


# -- registration --------------------------------------------------------------------------------------
def register(cases: dict[str, Case]) -> None:
    PROFILES["prioritized"] = prioritized_profile_op  # harness.profile can profile it: <schema>.prioritized
    cases["mujoco.prioritized"] = Case("mujoco.prioritized", "prioritized sample 256 + update 256 at capacity 1,000,000",
                                       "prioritized", prioritized_case)
    cases["mujoco.sequence"] = Case("mujoco.sequence", "256 windows of 16 consecutive steps, 8 envs", "sequence",
                                    sequence_case)
    cases["mujoco.loader"] = Case("mujoco.loader", "loader(prefetch=2) vs sample() with a training step", "loader",
                                  loader_case)
