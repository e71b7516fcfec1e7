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
