"""Several buffers at once: named buffers created together, and mixes sampled by ratio.

PPG keeps a policy buffer and a value buffer filled from the same data; R2D3, DQfD and SQIL train
on the agent's own data mixed with expert demonstrations. ::

    group = Buffers(policy=dict(schema=s, capacity=50_000, max_use=1),
                    value=dict(schema=s, capacity=200_000))
    group.push(obs=o, ...)                         # into every buffer (or to=["value"])
    mix = Mix([(agent, 0.75), (expert, 0.25)])     # DI-engine's form
    batch = mix.sample(256)                        # batch.source says where each row came from
    mix.update_priorities(batch, td.abs())         # each row's priority goes to its own buffer

Shares: each source is asked for exactly its share of every batch. Shares are whole rows: the
exact share ``n * weight`` plus what earlier calls rounded away, rounded down, with the rows left
over going to the sources with the largest remainders (largest-remainder apportionment with error
carried over). So one batch may differ from the exact share by less than a row per source, and
over many calls the rows each source gave differ from its exact share by less than one row in
total: no source is favoured by the rounding.

A source that holds fewer rows than its share (drawn from fewer rows, a share would only repeat
them) either makes the sample wait (``on_short="wait"``,
up to ``timeout`` seconds, then ``WaitTimeout``) or raises ``EmptyBufferError`` at once
(``on_short="raise"``): a batch is never silently short.

The rows of a mixed batch keep their source's order (source 0's rows first). Fields are those the
sources share (same name, shape and dtype). When any source is prioritized every batch has
``weight``, even one to which no prioritized source gave a row: a prioritized source's rows carry
their importance weights, the others' weight 1. So every batch of a mix has the same keys (a
``Loader`` stages them once).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from . import arguments
from .batch import Batch
from .buffer import BufferHandle, ReplayBuffer
from .errors import EmptyBufferError, SchemaError, WaitTimeout
from .protocol import by_position
from .protocol.priorities import check_priorities


class Buffers(Mapping[str, ReplayBuffer]):
    """Named buffers created together: each keyword is ``ReplayBuffer``'s arguments (a dict with
    ``schema`` and ``capacity`` at least). Read like a dict; closed and unlinked together."""

    def __init__(self, specs: Mapping[str, Mapping[str, Any]] | None = None, /, **more: Mapping[str, Any]) -> None:
        every = {**(specs or {}), **more}
        if not every:
            raise ValueError("Buffers: give at least one buffer, e.g. Buffers(agent=dict(schema=s, capacity=10_000))")
        self._buffers: dict[str, ReplayBuffer] = {}
        try:
            for key, spec in every.items():
                if not isinstance(spec, Mapping) or "schema" not in spec or "capacity" not in spec:
                    raise ValueError(f"Buffers: {key!r} needs a dict with schema and capacity, got {spec!r}")
                self._buffers[key] = ReplayBuffer(**spec)
        except BaseException:
            self.close()
            raise

    @classmethod
    def attach(cls, handles: Mapping[str, BufferHandle | str]) -> Buffers:
        """The same group in another process, from ``group.handles``."""
        self = cls.__new__(cls)
        self._buffers = {}
        try:
            for key, handle in handles.items():
                self._buffers[key] = ReplayBuffer.attach(handle)
        except BaseException:
            self.close()
            raise
        return self

    @property
    def handles(self) -> dict[str, BufferHandle]:
        """Each buffer's picklable ``BufferHandle`` by key (``Buffers.attach`` takes them in another process)."""
        return {key: buf.handle for key, buf in self._buffers.items()}

    def __getitem__(self, key: str) -> ReplayBuffer:
        try:
            return self._buffers[key]
        except KeyError:
            raise KeyError(f"no buffer {key!r}; the group has {', '.join(self._buffers)}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._buffers)

    def __len__(self) -> int:
        return len(self._buffers)

    def push(self, data: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None, /, *,
             to: Sequence[str] | None = None,
             **options: Any) -> dict[str, np.ndarray]:
        """Push the same rows into each buffer of ``to`` (default: all), with ``push``'s options
        (``lane``, ``episode``, ``priority``) for each. Every target runs ``push``'s checks before
        any is written (schema, capacity, frozen, episode ids, priorities), so a push refused by
        one changes none; a rate limiter that blocks writers may still hold a later target back.
        Returns the ids per buffer. Rows are copied once into each buffer's shared memory.
        ``data`` may be a list of row mappings (a collector's transitions, nerveX's PPG pipeline)."""
        targets = list(self._buffers) if to is None else list(to)
        keys = ("lane", "episode", "priority", "timeout")
        rows: Any = ({k: v for k, v in options.items() if k not in keys} if data is None
                     else dict(data) if isinstance(data, Mapping) else data)  # a list of rows as is
        kw = {k: v for k, v in options.items() if k in keys}
        check = {k: v for k, v in kw.items() if k != "timeout"}
        for key in targets:
            self[key].check(rows, **check)
        return {key: self[key].push(rows, **kw) for key in targets}

    def mix(self, weights: Mapping[str, float], **kwargs: Any) -> Mix:
        """A ``Mix`` of these buffers by key and weight (``{"agent": 0.75, "expert": 0.25}``); ``kwargs`` go to
        ``Mix``."""
        return Mix([(self[key], w) for key, w in weights.items()], **kwargs)

    def close(self) -> None:
        """Close every buffer in this process (a buffer still exporting views is left open)."""
        for buf in self._buffers.values():
            try:
                buf.close()
            except BufferError:
                pass

    def unlink(self) -> None:
        """Remove every buffer's block from ``/dev/shm`` (the creator's call, after ``close``)."""
        for buf in self._buffers.values():
            buf.unlink()

    def __enter__(self) -> Buffers:
        return self

    def __exit__(self, *exc: object) -> None:
        for buf in self._buffers.values():
            buf.__exit__(*exc)


def apportion(n: int, weights: np.ndarray, carry: np.ndarray) -> np.ndarray:
    """Whole shares of ``n`` by ``weights`` (summing to 1); ``carry`` (updated in place) holds
    what earlier calls rounded away. See the module docstring."""
    exact = n * weights + carry
    counts = np.floor(exact).astype(np.int64)
    left = n - int(counts.sum())
    if left > 0:
        counts[np.argsort(-(exact - counts), kind="stable")[:left]] += 1
    elif left < 0:
        counts[np.argsort(exact - counts, kind="stable")[:-left]] -= 1
    counts = np.maximum(counts, 0)
    carry[:] = exact - counts
    return counts


class Mix:
    """Sample several buffers as one batch by ratio: ``Mix([(agent, 0.75), (expert, 0.25)])``."""

    def __init__(self, sources: Sequence[tuple[ReplayBuffer, float]], *, on_short: str = "wait",
                 timeout: float = 60.0) -> None:
        if not sources:
            raise ValueError("Mix: give at least one (buffer, weight) pair")
        for i, pair in enumerate(sources):
            if not (isinstance(pair, tuple | list) and len(pair) == 2 and isinstance(pair[0], ReplayBuffer)):
                got = type(pair[0]).__name__ if isinstance(pair, tuple | list) and len(pair) == 2 else repr(pair)
                raise TypeError(f"Mix: source {i}: expected a (ReplayBuffer, weight) pair, got {got}; "
                                "pass Mix([(agent, 0.75), (expert, 0.25)])")
        timeout = arguments.timeout(timeout, "Mix: timeout")
        if on_short not in ("wait", "raise"):
            raise ValueError(f"Mix: on_short must be 'wait' or 'raise', got {on_short!r}")
        weights = np.array([float(w) for _, w in sources])
        if not np.all(np.isfinite(weights)) or (weights < 0).any() or weights.sum() <= 0:
            raise ValueError(f"Mix: weights must be finite, >= 0 and not all 0, got {weights.tolist()}")
        self.buffers = [buf for buf, _ in sources]
        self.weights = weights / weights.sum()
        self.on_short, self.timeout = on_short, timeout
        self._carry = np.zeros(len(self.buffers))
        first = self.buffers[0].schema
        shared = [f for f in first if all(f.name in b.schema and b.schema[f.name] == f for b in self.buffers[1:])]
        if not shared:
            raise SchemaError("Mix: the buffers share no field (same name, shape and dtype)")
        self.fields = tuple(f.name for f in shared)
        self._packed = all(b.schema == first for b in self.buffers)
        self._weighted = any(b.options.sampler.weighted for b in self.buffers)

    def shares(self, n: int) -> np.ndarray:
        """How many rows each source gives to the next batch of ``n`` (advances the carry)."""
        return apportion(n, self.weights, self._carry)

    def sample(self, n: int, **kwargs: Any) -> Batch:
        """``n`` rows, each source's share from it (``ReplayBuffer.sample``'s options apply to
        every source); ``batch.source`` holds each row's source number."""
        carry = self._carry.copy()
        counts = self.shares(n)
        try:
            self._wait_for(counts)
            parts = [(i, b.sample(int(c), **kwargs)) for i, (b, c) in enumerate(zip(self.buffers, counts, strict=True)) if c]
        except BaseException:
            self._carry[:] = carry  # a batch that was not drawn takes nothing from the shares
            raise
        return self._join(parts)

    def _wait_for(self, counts: np.ndarray) -> None:
        deadline = time.monotonic() + self.timeout
        while True:
            short = [(i, b, int(c)) for i, (b, c) in enumerate(zip(self.buffers, counts, strict=True)) if c and len(b) < c]
            if not short:
                return
            i, buf, c = short[0]
            what = f"Mix: source {i} ({buf.name!r}) holds {len(buf)} rows, its share of this batch is {c}"
            if self.on_short == "raise":
                raise EmptyBufferError(what)
            if time.monotonic() > deadline:
                raise WaitTimeout(f"{what} after waiting {self.timeout:g} s")
            time.sleep(0.005)

    def _join(self, parts: list[tuple[int, Batch]]) -> Batch:
        fields = {name: np.concatenate([p.fields[name] for _, p in parts]) for name in self.fields}
        source = np.concatenate([np.full(len(p), i, np.int8) for i, p in parts])
        extras: dict[str, Any] = {"index": np.concatenate([p.index for _, p in parts]), "source": source}
        if self._weighted:  # even when no prioritized source gave a row to this batch
            extras["weight"] = np.concatenate(
                [p.extras.get("weight", np.ones(len(p), np.float32)) for _, p in parts])
        for key in ("steps", "mask"):
            if all(key in p.extras for _, p in parts):
                extras[key] = np.concatenate([p.extras[key] for _, p in parts])
        if self._packed and all(p.block is not None for _, p in parts):
            block = np.concatenate([p.block for _, p in parts])
            record = parts[0][1].record
            assert record is not None
            views = record.views(block)  # the fields as views of one block: one copy to a device
            fields = {name: views[name] if name in views else fields[name] for name in self.fields}
            return Batch(fields, extras, block=block, record=record)
        return Batch(fields, extras)

    def update_priorities(self, batch: Batch, priorities: Any) -> int:
        """Send each row's priority to its own source; sources that sample uniformly are skipped.
        Returns how many rows were updated. Every priority is checked before any source is
        updated: NaN, infinite or negative ones raise ``FieldError`` and change nothing."""
        source = batch.source
        index = batch.index
        if hasattr(source, "detach"):
            source, index = source.detach().cpu().numpy(), index.detach().cpu().numpy()
        source, index = np.asarray(source).reshape(-1), np.asarray(index).reshape(-1)
        priorities = check_priorities(priorities, source.size, "update_priorities: priority")
        work = []
        for i, buf in enumerate(self.buffers):  # every source checked before any is updated
            rows = source == i
            prios = buf.priorities
            if rows.any() and prios is not None and prios.prioritized:
                what = f"update_priorities: source {i} ({buf.name!r})"
                ids = by_position.known(buf, index[rows], what)
                work.append((buf, ids, prios.check(priorities[rows], ids.size, what)))
        return sum(buf.update_priorities(ids, p) for buf, ids, p in work)

    def __len__(self) -> int:
        return sum(len(b) for b in self.buffers)
