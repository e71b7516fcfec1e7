"""Adapters: shmbuffer, each peer library and the plain baselines behind one small interface.

Single-process stores (``STORES``) are built as ``cls(spec, capacity, k)`` where ``k`` is the rows
per push the caller will use (Stable-Baselines3 needs it as ``n_envs``), and offer:

* ``pusher(rows, single)``: a zero-argument callable that pushes ``rows`` (converted to the
  library's own input format up front, as an env loop would hand it over); ``single`` pushes one
  row without a leading dimension.
* ``sample(n)`` (numpy, where the library has such a result) and ``sample_torch(n)``.
* ``raw(out)``: a result's fields as the library returns them, for the sanity checks.

Multi-process subjects (``MP``) are built in the learner process as ``cls(spec, capacity, ctx, name)``;
``open_writer(shared, spec)`` runs in each writer process on what ``shared()`` returned.

Every adapter uses its library the way the library's docs show; ``NOTES`` says how, for the report.
"""

from __future__ import annotations

import importlib
import os
import queue
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from .data import Fields, Spec


class Unavailable(Exception):
    """A subject that cannot run here. ``status``: "not installed", "n/a" or "wrong data"."""

    def __init__(self, status: str, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


def need(module: str) -> Any:
    if module.startswith("torchrl"):
        os.environ.setdefault("RL_LOGGING_LEVEL", "WARNING")  # torchrl logs every storage it builds
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise Unavailable("not installed", f"{module} is not installed ({e})") from None


def version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as v

    try:
        return v(dist)
    except PackageNotFoundError:
        return None


def env_dict(spec: Spec) -> dict[str, dict[str, Any]]:
    """cpprb's ``env_dict``: a scalar field is shape 1 (cpprb has no shape ``()``)."""
    return {n: {"shape": s or 1, "dtype": np.dtype(d).type} for n, (s, d) in spec.fields.items()}


def _torch_fields(out: dict[str, np.ndarray]) -> dict[str, Any]:
    import torch

    return {k: torch.from_numpy(v) for k, v in out.items()}


# -- single-process stores --------------------------------------------------------------------------
class Store:
    name = ""
    kind = "peer"  # ours | peer | baseline
    module: str | None = None
    numpy_sample = True
    fill_chunk: int | None = None  # rows per push when filling; None: as many as fit in 16 MB

    def __init__(self, spec: Spec, capacity: int, k: int) -> None:
        self.spec = spec
        self.capacity = capacity
        self.k = k

    @classmethod
    def available(cls) -> None:
        if cls.module:
            need(cls.module)

    def pusher(self, rows: Fields, single: bool) -> Callable[[], Any]:
        raise NotImplementedError

    def sample(self, n: int) -> Any:
        raise Unavailable("n/a", f"{self.name} returns torch tensors only (see the torch numbers)")

    def sample_torch(self, n: int) -> Any:
        return _torch_fields(self.sample(n))

    def raw(self, out: Any) -> dict[str, Any]:
        """A sample's fields as the library returns them (numpy arrays or tensors)."""
        return {n: out[n] for n in self.spec.fields}

    def close(self) -> None:
        pass


def _one(rows: Fields, single: bool) -> Fields:
    return {k: v[0] for k, v in rows.items()} if single else rows


class Ours(Store):
    name = "shmbuffer"
    kind = "ours"
    module = "shmbuffer"
    prefix = f"bench-{os.getpid()}-"

    def __init__(self, spec: Spec, capacity: int, k: int) -> None:
        super().__init__(spec, capacity, k)
        import shmbuffer as sb

        self.buf: Any = sb.ReplayBuffer(spec.schema, capacity, name=buffer_name(self.prefix))

    def pusher(self, rows: Fields, single: bool) -> Callable[[], Any]:
        return partial(self.buf.push, **_one(rows, single))

    def sample(self, n: int) -> Any:
        return self.buf.sample(n)

    def sample_torch(self, n: int) -> Any:
        return self.buf.sample(n).to("cpu")

    def close(self) -> None:
        close_ours(self.buf)


def buffer_name(prefix: str) -> str:
    return prefix + os.urandom(4).hex()


def close_ours(buf: Any) -> None:
    try:
        buf.close()
    except BufferError:  # arrays of it are still alive somewhere (an exception's frames): unlink anyway
        pass
    buf.unlink()


class NumpyRing(Store):
    """The plain baseline: one numpy array per field, a cursor, ``np.take`` to gather."""

    name = "numpy ring"
    kind = "baseline"

    def __init__(self, spec: Spec, capacity: int, k: int) -> None:
        super().__init__(spec, capacity, k)
        self.cols = {n: np.zeros((capacity, *spec.shape(n)), spec.dtype(n)) for n in spec.fields}
        self.pos = 0
        self.size = 0
        self.rng = np.random.default_rng(0)

    def pusher(self, rows: Fields, single: bool) -> Callable[[], Any]:
        return partial(self.push, _one(rows, single), single)

    def push(self, rows: Fields, single: bool) -> None:
        k = 1 if single else len(next(iter(rows.values())))
        pos, cap, cols = self.pos, self.capacity, self.cols
        if single:
            for name, v in rows.items():
                cols[name][pos] = v
        elif pos + k <= cap:
            for name, v in rows.items():
                cols[name][pos:pos + k] = v
        else:
            cut = cap - pos
            for name, v in rows.items():
                cols[name][pos:] = v[:cut]
                cols[name][:k - cut] = v[cut:]
        self.pos = (pos + k) % cap
        self.size = min(self.size + k, cap)

    def sample(self, n: int) -> Any:
        idx = self.rng.integers(0, self.size, n)
        return {name: col.take(idx, axis=0) for name, col in self.cols.items()}


class Cpprb(Store):
    name = "cpprb.ReplayBuffer"
    module = "cpprb"

    def __init__(self, spec: Spec, capacity: int, k: int) -> None:
        super().__init__(spec, capacity, k)
        self.rb = need("cpprb").ReplayBuffer(capacity, env_dict(spec))

    def pusher(self, rows: Fields, single: bool) -> Callable[[], Any]:
        return partial(self.rb.add, **_one(rows, single))

    def sample(self, n: int) -> Any:
        return self.rb.sample(n)


class TorchRL(Store):
    """``torchrl.data.ReplayBuffer(storage=...)``, fed TensorDicts: ``extend`` for k rows, ``add`` for one."""

    module = "torchrl"
    numpy_sample = False
    storage = "LazyTensorStorage"

    def __init__(self, spec: Spec, capacity: int, k: int) -> None:
        super().__init__(spec, capacity, k)
        data = need("torchrl.data")
        self.rb = data.ReplayBuffer(storage=getattr(data, self.storage)(capacity))

    def pusher(self, rows: Fields, single: bool) -> Callable[[], Any]:
        td = tensordict(_one(rows, single), single)
        return partial(self.rb.add, td) if single else partial(self.rb.extend, td)

    def sample_torch(self, n: int) -> Any:
        return self.rb.sample(n)


def tensordict(rows: Fields, single: bool) -> Any:
    import torch
    from tensordict import TensorDict

    n = [] if single else [len(next(iter(rows.values())))]
    return TensorDict({k: torch.from_numpy(np.asarray(v)) for k, v in rows.items()}, batch_size=n)


class TorchRLTensor(TorchRL):
    name = "torchrl LazyTensorStorage"
    storage = "LazyTensorStorage"


class TorchRLMemmap(TorchRL):
    name = "torchrl LazyMemmapStorage"
    storage = "LazyMemmapStorage"


class SB3(Store):
    """``stable_baselines3.common.buffers.ReplayBuffer`` with ``n_envs = k``: one ``add`` per env step
    of k envs, which is how SB3's own off-policy loop calls it (a push of 64 is one ``add`` with
    ``n_envs=64``; a push of 1 is ``n_envs=1``). Its capacity is ``capacity // k`` steps of k rows."""

    name = "sb3.ReplayBuffer"
    module = "stable_baselines3"
    numpy_sample = False

    def __init__(self, spec: Spec, capacity: int, k: int) -> None:
        super().__init__(spec, capacity, k)
        need("stable_baselines3")
        from gymnasium import spaces
        from stable_baselines3.common.buffers import ReplayBuffer

        obs = spaces.Box(0, 255, spec.shape("obs"), np.uint8) if spec.name == "atari" else spaces.Box(
            -np.inf, np.inf, spec.shape("obs"), np.float32)
        act = spaces.Discrete(18) if spec.name == "atari" else spaces.Box(-1, 1, spec.shape("action"), np.float32)
        self.rb = ReplayBuffer(capacity, obs, act, device="cpu", n_envs=k)
        self.infos: list[dict[str, Any]] = [{} for _ in range(k)]
        self.fill_chunk = k

    def pusher(self, rows: Fields, single: bool) -> Callable[[], Any]:
        r = rows  # always (n_envs, ...) arrays: SB3 has no single-row form
        return partial(self.rb.add, r["obs"], r["next_obs"], r["action"], r["reward"], r["done"], self.infos)

    def sample_torch(self, n: int) -> Any:
        return self.rb.sample(n)

    def raw(self, out: Any) -> dict[str, Any]:
        return {
            "obs": out.observations, "action": out.actions, "reward": out.rewards,
            "next_obs": out.next_observations, "done": out.dones,
        }


STORES: list[type[Store]] = [Ours, Cpprb, TorchRLTensor, TorchRLMemmap, SB3, NumpyRing]

NOTES = {
    "shmbuffer": "`ReplayBuffer(schema, capacity)`; `push(**fields)`; `sample(256)`, `.to('cpu')` for torch",
    "cpprb.ReplayBuffer": "`ReplayBuffer(capacity, env_dict)`; `add(**fields)`; `sample(256)` (dict of numpy); torch via `torch.from_numpy` per field",
    "torchrl LazyTensorStorage": "`ReplayBuffer(storage=LazyTensorStorage(capacity))`; `extend(TensorDict)` for k rows, `add(TensorDict)` for one; `sample(256)` (a TensorDict)",
    "torchrl LazyMemmapStorage": "as above with `LazyMemmapStorage(capacity)` (anonymous memory map: no scratch_dir)",
    "sb3.ReplayBuffer": "`ReplayBuffer(capacity, obs_space, action_space, n_envs=k)`; one `add(obs, next_obs, action, reward, done, infos)` per push of k rows (SB3's own loop); `sample(256)` (torch tensors)",
    "numpy ring": "one numpy array per field, a cursor, slice assignment to push, `rng.integers` + `np.take` to sample",
    "cpprb.MPReplayBuffer": "`MPReplayBuffer(capacity, env_dict, ctx=spawn)` passed to the writer processes; writers `add(**fields)`, the learner `sample(256)`",
    "torchrl shared LazyMemmapStorage": "`ReplayBuffer(storage=LazyMemmapStorage(capacity), shared=True)`, initialised by the learner, then passed to the writer processes (TorchRL's 'sharing replay buffers across processes'); writers `extend`, the learner `sample(256)`",
    "mp.Queue + numpy ring": "writers `put()` each 8-row batch (a copy: `put` pickles later, in a feeder thread) on a `multiprocessing.Queue(maxsize=64)`; the learner drains it into a numpy ring between samples",
}


MP_NOTES = {
    "shmbuffer": "`ReplayBuffer(schema, capacity)` created by the learner, which fills it and samples `sample(256)`; "
                 "each writer process `ReplayBuffer.attach(buf.handle)` and `push(**fields)` of 8 rows",
}
"""Notes for the multi-process subjects where the single-process note does not say how they are used."""


def sanity(cls: type[Store], spec: Spec, _done: dict[tuple[str, str], Unavailable | None] = {}) -> None:  # noqa: B006
    """Check that ``cls`` stores and returns the right rows (once per process): push 12 single rows
    into 8 slots and 6 batches of 8 into 32, sample, and compare every value with what was pushed
    and with the rows that must have been overwritten."""
    key = (cls.name, spec.name)
    if key not in _done:
        _done[key] = None
        try:
            for k, cap, pushes in ((1, 8, 12), (8, 32, 6)):
                store = cls(spec, cap, k)
                try:
                    seq = np.arange(pushes * k)
                    for j in range(pushes):
                        store.pusher(spec.make(0, seq[j * k:(j + 1) * k]), k == 1)()
                    outs = [("numpy", store.sample(64))] if cls.numpy_sample else []
                    outs.append(("torch", store.sample_torch(64)))
                    for how, out in outs:
                        raw = store.raw(out)
                        _check_sample(spec, spec.canonical(raw), seq[-cap:], how)
                        if how == "torch" and not all(hasattr(v, "detach") for v in raw.values()):
                            raise Unavailable("wrong data", f"sample as torch did not return tensors: {type(out)}")
                finally:
                    store.close()
        except Unavailable as e:
            _done[key] = e
        except Exception as e:
            _done[key] = Unavailable("error", f"sanity check raised {type(e).__name__}: {e}")
    if _done[key] is not None:
        raise _done[key]  # type: ignore[misc]


def _check_sample(spec: Spec, f: Fields, newest: np.ndarray, how: str) -> None:
    ok, _, seq = spec.check(f, full=True)
    if not ok.all():
        raise Unavailable("wrong data", f"{(~ok).sum()} of {ok.size} rows sampled ({how}) differ from the rows pushed")
    stale = ~np.isin(seq, newest)
    if stale.any():
        raise Unavailable("wrong data", f"sampled ({how}) {stale.sum()} rows that should have been overwritten")


# -- multi-process subjects ---------------------------------------------------------------------------
class MPWriter:
    """A writer process's side: ``push(batch)`` and ``close()``."""

    def __init__(self, push: Callable[[Fields], Any], close: Callable[[], Any] = lambda: None) -> None:
        self.push = push
        self.close = close


class MPSubject:
    name = ""
    kind = "peer"
    module: str | None = None
    ingest_in_learner = False  # rows count as ingested when the learner has them (the queue)

    def __init__(self, spec: Spec, capacity: int, ctx: Any, name: str) -> None:
        self.spec = spec
        self.capacity = capacity

    @classmethod
    def available(cls) -> None:
        if cls.module:
            need(cls.module)

    def shared(self) -> Any:
        raise NotImplementedError

    @staticmethod
    def open_writer(shared: Any, spec: Spec) -> MPWriter:
        raise NotImplementedError

    def push(self, rows: Fields) -> None:  # the learner's prefill
        raise NotImplementedError

    def poll(self) -> int:
        return 0

    def finish(self, writers: int, alive: Callable[[], bool]) -> None:
        pass

    def sample(self, n: int) -> Any:
        raise NotImplementedError

    def fields(self, out: Any) -> Fields:
        return self.spec.canonical({n: out[n] for n in self.spec.fields})

    def dump(self) -> Fields:
        """Every row held now, after the writers are done (for the lost-rows count)."""
        raise NotImplementedError

    def stats(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


class MPOurs(MPSubject):
    name = "shmbuffer"
    kind = "ours"

    def __init__(self, spec: Spec, capacity: int, ctx: Any, name: str) -> None:
        super().__init__(spec, capacity, ctx, name)
        import shmbuffer as sb

        self.buf: Any = sb.ReplayBuffer(spec.schema, capacity, name=name)

    def shared(self) -> Any:
        return self.buf.handle

    @staticmethod
    def open_writer(shared: Any, spec: Spec) -> MPWriter:
        import shmbuffer as sb

        buf: Any = sb.ReplayBuffer.attach(shared)
        return MPWriter(lambda b: buf.push(**b), buf.close)

    def push(self, rows: Fields) -> None:
        self.buf.push(**rows)

    def sample(self, n: int) -> Any:
        return self.buf.sample(n)

    def dump(self) -> Fields:
        return {n: self.buf.column(n) for n in self.spec.fields}

    def stats(self) -> dict[str, Any]:
        return {"len": len(self.buf), **self.buf.stats}

    def close(self) -> None:
        close_ours(self.buf)


class MPCpprb(MPSubject):
    name = "cpprb.MPReplayBuffer"
    module = "cpprb"

    def __init__(self, spec: Spec, capacity: int, ctx: Any, name: str) -> None:
        super().__init__(spec, capacity, ctx, name)
        self.rb = need("cpprb").MPReplayBuffer(capacity, env_dict(spec), ctx=ctx)

    def shared(self) -> Any:
        return self.rb

    @staticmethod
    def open_writer(shared: Any, spec: Spec) -> MPWriter:
        return MPWriter(lambda b: shared.add(**b))

    def push(self, rows: Fields) -> None:
        self.rb.add(**rows)

    def sample(self, n: int) -> Any:
        return self.rb.sample(n)

    def dump(self) -> Fields:
        return self.spec.canonical(self.rb.get_all_transitions())

    def stats(self) -> dict[str, Any]:
        return {"len": int(self.rb.get_stored_size())}


class MPTorchRL(MPSubject):
    name = "torchrl shared LazyMemmapStorage"
    module = "torchrl"

    def __init__(self, spec: Spec, capacity: int, ctx: Any, name: str) -> None:
        super().__init__(spec, capacity, ctx, name)
        data = need("torchrl.data")
        self.rb = data.ReplayBuffer(storage=data.LazyMemmapStorage(capacity), shared=True)

    def shared(self) -> Any:
        return self.rb

    @staticmethod
    def open_writer(shared: Any, spec: Spec) -> MPWriter:
        cache: dict[int, Any] = {}  # the Stamper's batches are reused: one TensorDict view each

        def push(b: Fields) -> None:
            td = cache.get(id(b))
            if td is None:
                td = cache[id(b)] = tensordict(b, False)
            shared.extend(td)

        return MPWriter(push)

    def push(self, rows: Fields) -> None:
        self.rb.extend(tensordict(rows, False))

    def sample(self, n: int) -> Any:
        return self.rb.sample(n)

    def dump(self) -> Fields:
        return self.spec.canonical({n: self.rb[:][n] for n in self.spec.fields})

    def stats(self) -> dict[str, Any]:
        return {"len": len(self.rb)}


class MPQueue(MPSubject):
    """The plain multi-process baseline: writers send batches through a ``multiprocessing.Queue``; the
    learner keeps a numpy ring and drains the queue between samples."""

    name = "mp.Queue + numpy ring"
    kind = "baseline"
    ingest_in_learner = True
    DRAIN = 64  # batches at most per drain, so the learner keeps sampling

    def __init__(self, spec: Spec, capacity: int, ctx: Any, name: str) -> None:
        super().__init__(spec, capacity, ctx, name)
        self.q = ctx.Queue(maxsize=64)
        self.ring = NumpyRing(spec, capacity, 8)
        self.sentinels = 0

    def shared(self) -> Any:
        return self.q

    @staticmethod
    def open_writer(shared: Any, spec: Spec) -> MPWriter:
        return MPWriter(lambda b: shared.put({k: v.copy() for k, v in b.items()}), lambda: shared.put(None))

    def push(self, rows: Fields) -> None:
        self.ring.push(rows, False)

    def _take(self, item: Fields | None) -> int:
        if item is None:
            self.sentinels += 1
            return 0
        self.ring.push(item, False)
        return len(item["obs"])

    def poll(self) -> int:
        rows = 0
        for _ in range(self.DRAIN):
            try:
                item = self.q.get_nowait()
            except queue.Empty:
                break
            rows += self._take(item)
        return rows

    def finish(self, writers: int, alive: Callable[[], bool]) -> None:
        while self.sentinels < writers:
            try:
                self._take(self.q.get(timeout=1.0))
            except queue.Empty:
                if not alive():
                    raise RuntimeError("a writer died before sending all its rows") from None

    def sample(self, n: int) -> Any:
        return self.ring.sample(n)

    def dump(self) -> Fields:
        return self.ring.cols

    def stats(self) -> dict[str, Any]:
        return {"len": self.ring.size}


MP: list[type[MPSubject]] = [MPOurs, MPCpprb, MPTorchRL, MPQueue]
MP_BY_NAME = {c.name: c for c in MP}


# -- prioritized stores (mujoco.prioritized) ----------------------------------------------------------
ALPHA, BETA = 0.6, 0.4


class PStore:
    """A prioritized buffer: ``push(rows, priorities)`` (returns the rows' indices), ``sample(n)``,
    ``index(out)`` (what the library's update takes), ``update(index, priorities)`` with priorities
    from ``prepare`` (the library's own format, converted up front), ``raw(out)`` / ``indices(out)`` /
    ``weights(out)`` for the sanity checks."""

    name = ""
    kind = "peer"
    module: str | None = None
    note = ""

    def __init__(self, spec: Spec, capacity: int) -> None:
        self.spec = spec
        self.capacity = capacity

    @classmethod
    def available(cls) -> None:
        if cls.module:
            need(cls.module)

    def push(self, rows: Fields, priorities: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def prepare(self, priorities: np.ndarray) -> Any:
        return priorities

    def sample(self, n: int) -> Any:
        raise NotImplementedError

    def index(self, out: Any) -> Any:
        raise NotImplementedError

    def update(self, index: Any, priorities: Any) -> Any:
        raise NotImplementedError

    def raw(self, out: Any) -> dict[str, Any]:
        return {n: out[n] for n in self.spec.fields}

    def indices(self, out: Any) -> np.ndarray:
        return np.asarray(self.index(out)).reshape(-1)

    def weights(self, out: Any) -> np.ndarray:
        raise NotImplementedError

    def close(self) -> None:
        pass


class POurs(PStore):
    name = "shmbuffer"
    kind = "ours"
    module = "shmbuffer"
    note = ("`ReplayBuffer(schema, capacity, sampler=Prioritized(alpha=0.6, beta=0.4))`; `push(**fields, priority=p)`; "
            "`batch = sample(256)` (`batch.weight`, `batch.index`); `update_priorities(batch, p)`")

    def __init__(self, spec: Spec, capacity: int) -> None:
        super().__init__(spec, capacity)
        import shmbuffer as sb

        self.buf: Any = sb.ReplayBuffer(spec.schema, capacity, sampler=sb.Prioritized(alpha=ALPHA, beta=BETA),
                                        name=buffer_name(Ours.prefix))

    def push(self, rows: Fields, priorities: np.ndarray) -> np.ndarray:
        return np.asarray(self.buf.push(**rows, priority=priorities))

    def sample(self, n: int) -> Any:
        return self.buf.sample(n)

    def index(self, out: Any) -> Any:
        return out  # update_priorities takes the batch itself

    def update(self, index: Any, priorities: Any) -> Any:
        return self.buf.update_priorities(index, priorities)

    def indices(self, out: Any) -> np.ndarray:
        return np.asarray(out.index)

    def weights(self, out: Any) -> np.ndarray:
        return np.asarray(out.weight)

    def close(self) -> None:
        close_ours(self.buf)


class PCpprb(PStore):
    name = "cpprb.PrioritizedReplayBuffer"
    module = "cpprb"
    cls_name = "PrioritizedReplayBuffer"
    note = ("`PrioritizedReplayBuffer(capacity, env_dict, alpha=0.6)` (its default eps 1e-4); "
            "`add(**fields, priorities=p)`; `sample(256, beta=0.4)` (dict with `weights`, `indexes`); "
            "`update_priorities(indexes, p)`")

    def __init__(self, spec: Spec, capacity: int) -> None:
        super().__init__(spec, capacity)
        self.rb = getattr(need("cpprb"), self.cls_name)(capacity, env_dict(spec), alpha=ALPHA)

    def push(self, rows: Fields, priorities: np.ndarray) -> np.ndarray:
        first = self.rb.add(**rows, priorities=priorities)
        return (int(first) + np.arange(len(priorities))) % self.capacity

    def sample(self, n: int) -> Any:
        return self.rb.sample(n, BETA)

    def index(self, out: Any) -> Any:
        return out["indexes"]

    def update(self, index: Any, priorities: Any) -> Any:
        return self.rb.update_priorities(index, priorities)

    def weights(self, out: Any) -> np.ndarray:
        return np.asarray(out["weights"])


class PCpprbMP(PCpprb):
    name = "cpprb.MPPrioritizedReplayBuffer"
    cls_name = "MPPrioritizedReplayBuffer"
    note = ("`MPPrioritizedReplayBuffer(capacity, env_dict, alpha=0.6)` (cpprb's shared-memory PER, used here "
            "from one process), otherwise as `PrioritizedReplayBuffer`")


class PTorchRL(PStore):
    name = "torchrl PrioritizedSampler"
    module = "torchrl"
    note = ("`ReplayBuffer(storage=LazyTensorStorage(capacity), sampler=PrioritizedSampler(capacity, alpha=0.6, "
            "beta=0.4))`; `extend(TensorDict)` then `update_priority(indices, p)`; "
            "`sample(256, return_info=True)` (`info['index']`, `info['priority_weight']`); "
            "`update_priority(info['index'], p)` with p a tensor")

    @classmethod
    def available(cls) -> None:
        need("torchrl.data")
        try:
            from torchrl.data import PrioritizedSampler

            PrioritizedSampler(8, ALPHA, BETA)
        except RuntimeError as e:
            try:
                importlib.import_module("torchrl._torchrl")
                why = str(e)
            except ImportError as ie:
                msg = str(ie)
                at = msg.find("undefined symbol")
                why = f"ImportError: {msg[at:at + 60] if at >= 0 else msg[:100]}..."
            raise Unavailable(
                "unusable",
                f"torchrl {version('torchrl')}'s compiled extension (torchrl._torchrl, the segment trees "
                f"PrioritizedSampler needs) does not load with torch {version('torch')}: {why}",
            ) from None

    def __init__(self, spec: Spec, capacity: int) -> None:
        super().__init__(spec, capacity)
        data = need("torchrl.data")
        self.rb = data.ReplayBuffer(storage=data.LazyTensorStorage(capacity),
                                    sampler=data.PrioritizedSampler(capacity, ALPHA, BETA))

    def push(self, rows: Fields, priorities: np.ndarray) -> np.ndarray:
        idx = self.rb.extend(tensordict(rows, False))
        self.rb.update_priority(idx, self.prepare(priorities))
        return np.asarray(idx).reshape(-1)

    def prepare(self, priorities: np.ndarray) -> Any:
        import torch

        return torch.from_numpy(np.asarray(priorities, np.float32))

    def sample(self, n: int) -> Any:
        return self.rb.sample(n, return_info=True)

    def index(self, out: Any) -> Any:
        return out[1]["index"]

    def update(self, index: Any, priorities: Any) -> Any:
        return self.rb.update_priority(index, priorities)

    def raw(self, out: Any) -> dict[str, Any]:
        return {n: out[0][n] for n in self.spec.fields}

    def weights(self, out: Any) -> np.ndarray:
        return np.asarray(out[1]["priority_weight"])


PSTORES: list[type[PStore]] = [POurs, PCpprb, PCpprbMP, PTorchRL]


# -- sequence stores (mujoco.sequence) ------------------------------------------------------------------
class SeqStore:
    """Windows of consecutive steps from ``Lanes`` data: ``sample(n, length)`` in the library's own
    form; ``windows(out, n, length)`` gives ``(fields (n, length, ...) canonical, mask (n, length))``
    for the sanity checks. ``strict``: every window must be whole (no mask) and inside one episode."""

    name = ""
    kind = "peer"
    module: str | None = None
    note = ""
    strict = True
    episodes_checked = True

    def __init__(self, data: Any) -> None:
        self.data = data
        self.spec: Spec = data.spec

    @classmethod
    def available(cls) -> None:
        if cls.module:
            need(cls.module)

    def sample(self, n: int, length: int) -> Any:
        raise NotImplementedError

    def windows(self, out: Any, n: int, length: int) -> tuple[Fields, np.ndarray]:
        raise NotImplementedError

    def close(self) -> None:
        pass


def _flat_canonical(spec: Spec, raw: dict[str, Any], n: int, length: int) -> Fields:
    """``(n, length, ...)`` fields of any library form, canonical (numpy, the schema's dtypes)."""
    flat = {}
    for name in spec.fields:
        v = raw[name]
        v = v.detach().cpu().numpy() if hasattr(v, "detach") else np.asarray(v)
        flat[name] = v.reshape(n * length, *spec.shape(name))
    return {k: v.reshape(n, length, *v.shape[1:]) for k, v in spec.canonical(flat).items()}


class SeqOurs(SeqStore):
    name = "shmbuffer"
    kind = "ours"
    module = "shmbuffer"
    strict = False
    note = ("`ReplayBuffer(schema, capacity, lanes=8, episodes=True)`, each env's rows pushed with "
            "`push(**fields, lane=env, episode=id)`; `sample_sequences(256, 16)`: fields (256, 16, ...) "
            "and `mask` (a window stops at its episode's end)")

    def __init__(self, data: Any) -> None:
        super().__init__(data)
        import shmbuffer as sb

        lanes, steps = data.lanes, data.steps
        self.buf: Any = sb.ReplayBuffer(self.spec.schema, lanes * steps, lanes=lanes, episodes=True,
                                        name=buffer_name(Ours.prefix))
        try:
            chunk = 8192
            for a in range(0, steps, chunk):
                for lane in range(lanes):
                    self.buf.push(**{k: v[lane, a:a + chunk] for k, v in data.cols.items()}, lane=lane,
                                  episode=data.episode[lane, a:a + chunk])
        except BaseException:
            close_ours(self.buf)
            raise

    def sample(self, n: int, length: int) -> Any:
        return self.buf.sample_sequences(n, length)

    def windows(self, out: Any, n: int, length: int) -> tuple[Fields, np.ndarray]:
        return _flat_canonical(self.spec, out.fields, n, length), np.asarray(out.mask, bool)

    def close(self) -> None:
        close_ours(self.buf)


class SeqTorchRL(SeqStore):
    """``SliceSampler(slice_len, traj_key="episode")`` over a ``LazyTensorStorage`` that holds the same
    rows and their episode ids. ``ndim=1``: each env's steps one after another (the layout most
    favourable to it: its trajectories are contiguous); ``ndim=2``: a ``[envs, time]`` storage, as a
    collector with 8 envs writes it."""

    module = "torchrl"
    ndim = 1
    cache = False

    def __init__(self, data: Any) -> None:
        super().__init__(data)
        import torch
        from tensordict import TensorDict

        d = need("torchrl.data")
        lanes, steps = data.lanes, data.steps
        self.rb = d.ReplayBuffer(storage=d.LazyTensorStorage(lanes * steps, ndim=self.ndim),
                                 sampler=d.SliceSampler(slice_len=16, traj_key="episode", cache_values=self.cache))
        td = TensorDict({**{k: torch.from_numpy(v) for k, v in data.cols.items()},
                         "episode": torch.from_numpy(data.episode)}, batch_size=[lanes, steps])
        chunk = 8192
        if self.ndim == 1:
            flat = td.reshape(-1)  # env 0's steps, then env 1's ...
            for a in range(0, lanes * steps, chunk * lanes):
                self.rb.extend(flat[a:a + chunk * lanes])
        else:
            for a in range(0, steps, chunk):
                self.rb.extend(td[:, a:a + chunk])

    def sample(self, n: int, length: int) -> Any:
        return self.rb.sample(n * length).reshape(n, length)

    def windows(self, out: Any, n: int, length: int) -> tuple[Fields, np.ndarray]:
        fields = _flat_canonical(self.spec, {k: out[k] for k in self.spec.fields}, n, length)
        return fields, np.ones((n, length), bool)


class SeqTorchRL1(SeqTorchRL):
    name = "torchrl SliceSampler"
    note = ("`ReplayBuffer(storage=LazyTensorStorage(capacity), sampler=SliceSampler(slice_len=16, "
            "traj_key='episode'))`, each env's steps stored one after another (contiguous trajectories); "
            "`sample(256 * 16)` reshaped to (256, 16)")


class SeqTorchRL2(SeqTorchRL):
    name = "torchrl SliceSampler, [envs, time] storage"
    ndim = 2
    note = ("as above over `LazyTensorStorage(capacity, ndim=2)`, extended with `[8 envs, time]` "
            "TensorDicts, as a collector with 8 envs writes them")


class SeqTorchRLCached(SeqTorchRL):
    name = "torchrl SliceSampler, cache_values=True"
    cache = True
    note = ("as `torchrl SliceSampler` with `cache_values=True`: the trajectory boundaries are found once and "
            "kept until the storage changes (nothing is written while it is timed here; in a replay loop that "
            "extends between samples they are found again each time)")


class SeqNumpy(SeqStore):
    """The plain baseline: random env and start, one fancy-index gather of ``start + arange(length)``
    per field; no episode checks (its windows may cross an episode's end)."""

    name = "numpy windows"
    kind = "baseline"
    episodes_checked = False
    note = ("one numpy array per field, `(envs * steps, ...)`; `rng.integers` for the env and the start, then "
            "`col.take(start[:, None] + arange(16), axis=0)` per field; no episode checks")

    def __init__(self, data: Any) -> None:
        super().__init__(data)
        self.cols = {k: v.reshape(data.lanes * data.steps, *v.shape[2:]).copy() for k, v in data.cols.items()}
        self.rng = np.random.default_rng(0)

    def sample(self, n: int, length: int) -> Any:
        data = self.data
        lane = self.rng.integers(0, data.lanes, n)
        start = lane * data.steps + self.rng.integers(0, data.steps - length + 1, n)
        idx = start[:, None] + np.arange(length)
        return {k: col.take(idx, axis=0) for k, col in self.cols.items()}

    def windows(self, out: Any, n: int, length: int) -> tuple[Fields, np.ndarray]:
        return _flat_canonical(self.spec, out, n, length), np.ones((n, length), bool)


SEQSTORES: list[type[SeqStore]] = [SeqOurs, SeqTorchRL1, SeqTorchRL2, SeqTorchRLCached, SeqNumpy]

NO_EQUIVALENT = {
    "mujoco.prioritized": {
        "sb3.ReplayBuffer": "Stable-Baselines3 has no prioritized replay buffer",
    },
    "mujoco.sequence": {
        "cpprb.ReplayBuffer": "cpprb has no sequence sampler (no windows of consecutive steps)",
        "sb3.ReplayBuffer": "Stable-Baselines3's ReplayBuffer has no sequence sampler",
    },
    "mujoco.loader": {
        "cpprb.ReplayBuffer": "cpprb has no prefetching loader",
        "sb3.ReplayBuffer": "Stable-Baselines3's ReplayBuffer has no prefetching loader",
    },
}
"""Peers that lack a case's feature: reported as "no equivalent", never measured as something else."""
