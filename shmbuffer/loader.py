"""The learner's side: batches on a device, sampled ahead in a background thread.

::

    loader = Loader(buf, batch_size=256, device="cuda", prefetch=2)
    for batch in loader:                      # torch tensors on the device
        loss = ...(batch.obs, batch.reward, batch.weight)
        loader.update_priorities(batch, td_error.abs())

A background thread samples ``prefetch`` batches ahead of the learner. With CUDA each batch is
gathered straight into *pinned* staging memory (``np.take(..., out=)`` into a pinned tensor's
memory, allocated once and reused: ``pin_memory()`` per batch would cost a copy and can stall),
copied to the device with ``non_blocking=True`` on a side stream, and handed over with an event:
the consumer's stream waits for the event before it touches the batch, and the device tensors are
marked as used by the consumer's stream (``record_stream``) so the caching allocator does not
hand their memory out early. A staging slot is reused only after its copy has completed. Device
tensors are fresh for each batch, so a batch stays valid as long as it is referenced.

Without CUDA the same API yields CPU tensors (zero-copy views of the sampled arrays), sampled in
the learner's own thread by default: under the GIL a background thread cannot overlap the
learner's Python work (``benchmarks/README.md``, the loader case, measures it against sampling
in the loop). Sampling a small batch is Python run with the GIL held (the gather gives the GIL up
only for large copies), so the thread hides only what falls into the learner's GIL-free kernels:
it takes the GIL at the learner's first release after a batch is taken, and the learner, back
from a short kernel, waits for the rest of that sample. ``background=True`` asks for the thread
anyway (e.g. when the training step mostly runs long GIL-free torch kernels, or the batches are
large).

The thread hands its batches over through ``_Handoff``: a deque and two wake tokens, so that the
learner takes a ready batch without waiting for a lock the thread may hold, and ``close()`` wakes a
learner waiting for a batch at once. On the CPU this measured within noise of a ``queue.Queue``:
the cost of the thread is the GIL, not the hand-off.

NOTE (shutdown): ``close()`` (or leaving the ``with`` block, or the end of iteration) stops the
thread: it sets a flag, empties the hand-off and wakes both sides (the thread waiting for room, a
learner waiting for a batch), and joins the thread. A rate limiter can hold a sample for its whole timeout, so on the default path
(``buffer.sample``) the thread samples in slices of ``SLICE`` seconds (``sample(...,
timeout=SLICE)``, again after each ``WaitTimeout``) and looks at the flag between them: ``close()``
returns within about a slice, and once it has returned no sample is admitted. The slices add up to the
``timeout`` given in ``sample_kwargs``, or to the limiter's own, before the ``WaitTimeout`` reaches
the learner. A custom ``sample=`` (or a ``Mix``) is called as it is, and ``close()`` waits up to
``JOIN`` seconds for it to return. An exception in the thread is re-raised in the learner at the
next batch. Once the loader has ended (every batch given, ``close()``, or an error re-raised),
``next()`` raises ``StopIteration`` again, or the same error.

``framework="jax"`` yields JAX arrays instead (``Batch.to_jax``): on the CPU they share the
sampled large fields' memory (each batch is gathered into fresh 64-byte aligned memory,
``aligned_outs``, so a batch stays valid as long as it is referenced); with ``device=`` a ``jax.Device`` each array is copied there once. The
torch-only paths (pinned staging, the device copy) are not used.

Every batch must have the keys and shapes of the first one (fields, extras such as ``weight``):
the pinned staging memory is made for them, and a batch that differs raises ``FieldError``
naming what differs.
"""

from __future__ import annotations

import inspect
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import numpy as np

from . import arguments, hints
from .batch import Batch, empty, jax_module, torch_views
from .device import DeviceReplay
from .errors import CapacityError, FieldError, LayoutError, WaitTimeout
from .protocol.draw_gather import sample_for_another
from .protocol.layout import Block
from .sampling.samplers import check_batch_size

SLICE = 0.1
"""Seconds a default-path sample may wait for a rate limiter before the thread looks at ``close()``."""
JOIN = 10.0
"""Seconds ``close()`` waits for a custom sampler to return."""
POLL = 0.1
"""Seconds a side waits for the other's token before it looks at ``close()`` and the thread again."""
_DONE = object()  # the thread gave every batch it was asked for
_CLOSED = object()  # close() ended the loader


def _host_arrays(batch: Batch) -> dict[str, np.ndarray]:
    """What travels to the device: the packed block, each field outside it, each extra."""
    record = batch.record if batch.block is not None else None
    out: dict[str, Any] = {"_block": batch.block} if record is not None else {}
    out.update({k: v for k, v in batch.fields.items() if record is None or k not in record.offsets})
    out.update({f"extra:{k}": v for k, v in batch.extras.items()})
    return {k: np.asarray(v) for k, v in out.items()}


def aligned_outs(buffer: Any, n: int) -> dict[str, np.ndarray] | None:
    """New arrays for ``buffer.sample(n, out=...)`` (the packed record, each large field), each
    64-byte aligned (``batch.ALIGN``), so that ``batch.to_jax()`` shares the large fields' memory;
    ``None`` for a buffer whose gathered fields do not have the schema's shapes (stored-once
    frames)."""
    block = buffer.block
    if block.stored is not block.schema:
        return None
    record = block.record
    out = {"_block": empty((n, record.itemsize), np.uint8)} if record is not None else {}
    for f in buffer.schema:
        if record is None or f.name not in record.offsets:
            out[f.name] = empty((n, *f.shape), f.dtype)
    return out


def _what(key: str) -> str:
    if key == "_block":
        return "the packed record"
    return f"extra {key[6:]!r}" if key.startswith("extra:") else f"field {key!r}"


def _wake(token: threading.Lock) -> None:
    """Give ``token`` (a lock used as a binary semaphore) to whoever waits on it; never blocks."""
    try:
        token.release()
    except RuntimeError:  # already given, not yet taken
        pass


def _check_sample_keywords(buffer: Any, sample: Any, kwargs: dict[str, Any]) -> None:
    """Refuse keywords ``buffer.sample`` does not take now, not at the first batch (a mistyped
    ``Loader`` keyword lands here), and keywords that a ``sample=`` function would never see."""
    if not kwargs:
        return
    if sample is not None:
        raise TypeError(f"Loader: the keywords {sorted(kwargs)} go to buffer.sample, which sample= replaces; "
                        "pass them in your sample function instead")
    try:
        params = inspect.signature(buffer.sample).parameters
    except (AttributeError, TypeError, ValueError):  # no sample, or one Python cannot look into: it checks them itself
        params = {}  # type: ignore[assignment]
    named = {k for k, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)} - {"n", "out"}
    unknown = {k: v for k, v in kwargs.items() if k not in named}
    if named and unknown:  # a sample(n, **kwargs) (a Mix's) passes them on: its sources check them
        raise hints.keyword_error("Loader", unknown)
    if kwargs.get("timeout") is not None:
        arguments.timeout(kwargs["timeout"], "Loader: timeout")


class _Handoff:
    """The bounded FIFO between the thread and the learner (``size`` items at most).

    Neither side ever waits for a lock the other side may hold: the items go through a ``deque``
    (``append``/``popleft`` are atomic under the GIL), and each side wakes the other by giving it a
    token (a lock released by the one and acquired by the other), only ever waited on when there is
    nothing to take or no room (a ``queue.Queue`` guards its items with one mutex, and a learner
    that finds it held waits for it, giving up the GIL). A stale token only makes a waiter look again.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.items: deque[Any] = deque()
        self._item = threading.Lock()  # given by put: there may be an item to take
        self._space = threading.Lock()  # given by get and clear: there may be room
        self._item.acquire()
        self._space.acquire()

    def put(self, item: Any, stop: threading.Event) -> bool:
        """Append ``item`` once there is room; ``False`` (not appended) once ``stop`` is set."""
        while len(self.items) >= self.size:
            if stop.is_set():
                return False
            self._space.acquire(timeout=POLL)
        if stop.is_set():
            return False
        self.items.append(item)
        _wake(self._item)
        return True

    def get(self, timeout: float) -> tuple[bool, Any]:
        """``(True, item)``, the oldest item, or ``(False, None)`` if none came within about ``timeout``."""
        if not self.items:
            self._item.acquire(timeout=timeout)
        try:
            item = self.items.popleft()
        except IndexError:
            return False, None
        _wake(self._space)
        return True, item

    def clear(self) -> None:
        """Drop every item and wake both sides (``close()``)."""
        self.items.clear()
        _wake(self._space)
        _wake(self._item)


class _Staging:
    """Pinned host memory for one batch: the packed block, each large field, the extras."""

    def __init__(self, arrays: dict[str, np.ndarray], torch: Any) -> None:
        self.pinned: dict[str, Any] = {}
        for key, a in arrays.items():
            self.pinned[key] = torch.empty(a.shape, dtype=torch.from_numpy(a[:0]).dtype, pin_memory=True)
        self.host = {key: t.numpy() for key, t in self.pinned.items()}
        self.gathered = {key: a for key, a in self.host.items() if not key.startswith("extra:")}
        """What a sample gathers into (``sample(out=)``): the block and the large fields."""
        self.event: Any = None


class Loader:
    """Iterate device batches from ``buffer`` (see the module docstring).

    :param buffer: a ``ReplayBuffer`` (gathered straight into pinned staging memory), or anything
        with ``sample`` such as a ``Mix`` (sampled, then copied into staging).
    :param batch_size: rows per batch.
    :param device: where batches go (default: the CPU, zero-copy).
    :param prefetch: batches sampled ahead by the background thread.
    :param sample: ``sample(buffer) -> Batch`` draws one batch (default: ``buffer.sample(batch_size,
        **sample_kwargs)``), e.g. ``lambda b: b.sample_sequences(32, 16)``.
    :param collector: a ``Collector`` checked for worker errors at every batch.
    :param batches: end the iteration after that many batches (default: never).
    :param background: sample in a thread (default: with CUDA only; see the module docstring).
    :param resident: sample from a copy of the buffer kept on ``device`` (``device.DeviceReplay``):
        ``True`` requires it (``CapacityError`` with the bytes needed and free when the device
        cannot hold it; ``LayoutError`` for a buffer it does not serve); ``None`` (the default)
        takes it on CUDA where it fits and serves the buffer, else the pinned path; ``False``
        never. ``loader.path`` says which path runs (``"resident"``, ``"pinned"`` or
        ``"host"``), ``loader.why`` why not resident.
    :param framework: ``"torch"`` (tensors) or ``"jax"`` (JAX arrays; ``device`` is then a
        ``jax.Device`` or ``None`` for the CPU).
    :param sample_kwargs: passed to ``buffer.sample`` (``n_step``, ``gamma``, ...).
    """

    def __init__(
        self,
        buffer: Any,
        batch_size: int = 256,
        *,
        device: Any = None,
        prefetch: int = 2,
        sample: Callable[[Any], Batch] | None = None,
        collector: Any = None,
        batches: int | None = None,
        background: bool | None = None,
        resident: bool | None = None,
        framework: str = "torch",
        **sample_kwargs: Any,
    ) -> None:
        import torch

        if prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, got {prefetch}")
        batch_size = check_batch_size(batch_size, "Loader: batch_size")
        _check_sample_keywords(buffer, sample, sample_kwargs)
        if framework not in ("torch", "jax"):
            raise ValueError(f"Loader(framework={framework!r}): expected 'torch' or 'jax'")
        self._jax = framework == "jax"
        self._jax_device = device if self._jax else None
        if self._jax:
            if resident:
                raise ValueError("Loader(framework='jax', resident=True): the device copy serves torch tensors; "
                                 "leave resident out for JAX")
            jax_module()  # a missing jax is said at construction rather than at the first batch
            device, resident = None, False
        self._torch = torch
        self.buffer = buffer
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.cuda = self.device.type == "cuda"
        if self.cuda and not torch.cuda.is_available():
            raise RuntimeError(f"device {self.device} was asked for, but torch.cuda.is_available() is False")
        self._custom = sample is not None or not isinstance(getattr(buffer, "block", None), Block)  # e.g. a Mix
        self._batch_size = batch_size
        self._kwargs = sample_kwargs
        self._sample = sample or (lambda b: b.sample(batch_size, **sample_kwargs))
        self._collector = collector
        self._limit = batches
        self._prefetch = prefetch
        self._queue = _Handoff(prefetch)
        self._stop = threading.Event()
        self._ended: object = None  # _DONE, _CLOSED or the error re-raised, once the loader has ended
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._staging: list[_Staging] = []
        self._layout: dict[str, tuple[tuple[int, ...], np.dtype[Any]]] | None = None
        self._made = 0
        self._resident = self._make_resident(resident)
        self.path = "resident" if self._resident is not None else "pinned" if self.cuda else "host"
        """Which path runs: ``"resident"`` (a device copy), ``"pinned"`` (CUDA through pinned
        staging) or ``"host"`` (CPU tensors of the sampled arrays)."""
        self._background = (self.cuda and self._resident is None) if background is None else bool(background)
        self._thread = threading.Thread(target=self._produce, name="shmbuffer-loader", daemon=True)
        if self._background:
            self._thread.start()

    def _make_resident(self, resident: bool | None) -> DeviceReplay | None:
        self.why = ""
        """Why the loader does not sample from a device copy (empty when it does)."""
        if resident is False:
            self.why = "resident=False"
            return None
        if resident is None and not self.cuda:
            self.why = "not a CUDA device (resident=True asks for a copy on the CPU)"
            return None
        if self._custom or self._kwargs:
            if resident:
                raise LayoutError("Loader(resident=True): the device copy samples plain batches; it takes no "
                                  f"sample= nor sample keywords (got {sorted(self._kwargs) or 'sample='}): resident=False")
            self.why = "a custom sample= or sample keywords"
            return None
        try:
            return DeviceReplay(self.buffer, self.device)
        except (CapacityError, LayoutError) as exc:
            if resident:
                raise
            self.why = str(exc)
            return None

    # -- the background thread ----------------------------------------------------------------
    def _produce(self) -> None:
        made = 0
        sample_for_another()  # this thread's gathers leave the GIL to the learner
        try:
            while not self._stop.is_set() and (self._limit is None or made < self._limit):
                item = self._to_device(made) if self.cuda and self._resident is None else self._to_cpu()
                if item is None or not self._queue.put(item, self._stop):  # close() came
                    return
                made += 1
        except BaseException as exc:  # handed to the learner at its next batch
            self._queue.put(exc, self._stop)
            return
        self._queue.put(_DONE, self._stop)

    def _draw(self, out: dict[str, np.ndarray] | None = None) -> Batch | None:
        """One batch; ``None`` when ``close()`` came while a rate limiter held it (see the NOTE)."""
        if self._custom:
            return self._sample(self.buffer)
        kwargs = dict(self._kwargs)
        if out is not None:
            kwargs["out"] = out
        limiter = self.buffer.options.limiter
        sample = self.buffer.sample if self._resident is None else self._resident.sample
        if limiter is None:
            return sample(self._batch_size, **kwargs)
        given = kwargs.pop("timeout", None)
        total = limiter.timeout if given is None else float(given)  # checked by _check_sample_keywords
        deadline = time.monotonic() + total
        while True:
            left = max(deadline - time.monotonic(), 0.0)
            try:
                return sample(self._batch_size, timeout=min(SLICE, left), **kwargs)
            except WaitTimeout as exc:
                if self._stop.is_set():
                    return None
                if left <= SLICE:
                    raise WaitTimeout(f"Loader: no batch of {self._batch_size} rows after {total:g} s; the last try: {exc}") from None

    def _to_cpu(self) -> Batch | None:
        if self._resident is not None:
            return self._draw()
        if not self._jax:
            batch = self._draw()
            return None if batch is None else batch.to("cpu")
        # fresh aligned memory for each batch: XLA shares it (to_jax), and no later batch reuses it
        batch = self._draw(out=None if self._custom else aligned_outs(self.buffer, self._batch_size))
        return None if batch is None else batch.to_jax(self._jax_device)

    def _check_layout(self, arrays: dict[str, np.ndarray], made: int) -> None:
        """Every batch has the first one's keys, shapes and dtypes: the staging memory's."""
        layout = {key: (a.shape, a.dtype) for key, a in arrays.items()}
        first = self._layout
        if first is None:
            self._layout = layout
            return
        if layout == first:
            return
        diff = [f"lacks {_what(k)}" for k in first if k not in layout]
        diff += [f"has {_what(k)}, which the first batch had not" for k in layout if k not in first]
        diff += [
            f"{_what(k)}: expected shape {first[k][0]} {first[k][1]}, got {layout[k][0]} {layout[k][1]}"
            for k in layout if k in first and layout[k] != first[k]
        ]
        raise FieldError(
            f"Loader: batch {made} does not match the first batch ({'; '.join(diff)}): the pinned "
            "staging memory is made for the first batch, so every batch must have the same fields, "
            "extras and shapes"
        )

    def _to_device(self, made: int) -> tuple[Batch, Any] | None:
        torch = self._torch
        slots = self._prefetch + 2  # in the queue, with the learner, being filled
        stage = self._staging[made % slots] if len(self._staging) == slots else None
        if stage is not None and stage.event is not None:
            stage.event.synchronize()  # its previous copy to the device has finished
        if stage is not None and not self._custom:  # gather straight into pinned memory
            batch = self._draw(out=stage.gathered)
            copy_rows = False
        else:
            batch = self._draw()
            copy_rows = True
        if batch is None:
            return None
        arrays = _host_arrays(batch)
        self._check_layout(arrays, made)
        if stage is None:
            stage = _Staging(arrays, torch)
            self._staging.append(stage)
        for key, a in stage.host.items():
            if copy_rows or key.startswith("extra:"):  # else the gather already wrote it there
                np.copyto(a, arrays[key])
        assert self._stream is not None
        with torch.cuda.stream(self._stream):
            moved = {k: t.to(self.device, non_blocking=True) for k, t in stage.pinned.items()}
            stage.event = torch.cuda.Event()
            stage.event.record(self._stream)
        fields: dict[str, Any] = {}
        if "_block" in moved and batch.record is not None:
            fields = torch_views(moved["_block"], batch.record)
            if batch.lead is not None:  # (n, T) windows: the block's rows are flattened
                fields = {k: v.view(*batch.lead, *v.shape[1:]) for k, v in fields.items()}
        out = {name: fields[name] if name in fields else moved[name] for name in batch.fields}
        extras = {k[6:]: v for k, v in moved.items() if k.startswith("extra:")}
        return Batch(out, extras, block=moved.get("_block"), record=batch.record, lead=batch.lead), stage.event

    # -- the learner's side -------------------------------------------------------------------
    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        if self._ended is not None:
            self._end()
        if self._collector is not None:
            self._collector.check()
        if not self._background:
            return self._next_here()
        while True:
            got, item = self._queue.get(timeout=POLL)
            if got:
                break
            if self._thread.is_alive() and not self._stop.is_set():
                continue
            got, item = self._queue.get(timeout=0.0)  # it may have put its last item just before it ended
            if not got:
                item = _CLOSED
            break
        if item is _DONE or item is _CLOSED or isinstance(item, BaseException):
            self._ended = item
            self.close()
            self._end()
        if not self.cuda or self._resident is not None:
            return item
        return self._receive(*item)

    def _next_here(self) -> Batch:
        """A batch sampled in the caller's thread (no background thread)."""
        if self._limit is not None and self._made >= self._limit:
            self._ended = _DONE
            self._end()
        try:
            if self._resident is not None:
                batch = self._resident.sample(self._batch_size)
            elif self.cuda:
                item = self._to_device(self._made)
                assert item is not None
                batch = self._receive(*item)
            else:
                got = self._to_cpu()
                assert got is not None
                batch = got
        except BaseException as exc:
            self._ended = exc
            raise
        self._made += 1
        return batch

    def _end(self) -> NoReturn:
        """Raise what ended the loader: its error, or ``StopIteration``."""
        if isinstance(self._ended, BaseException):
            raise self._ended
        raise StopIteration

    def _receive(self, batch: Batch, event: Any) -> Batch:
        """Hand a device batch to the consumer's stream (see the module docstring)."""
        stream = self._torch.cuda.current_stream(self.device)
        stream.wait_event(event)
        for t in [*batch.fields.values(), *batch.extras.values()]:
            t.record_stream(stream)
        return batch

    def update_priorities(self, batch: Batch, priorities: Any) -> int:
        """Priority feedback for a batch this loader gave (``ReplayBuffer.update_priorities``)."""
        return self.buffer.update_priorities(batch, priorities)

    def close(self) -> None:
        """Stop the background thread (see the module docstring). Idempotent."""
        self._stop.set()
        self._drain()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(JOIN)
        self._drain()  # a put that was under way when the flag was set
        if self._resident is not None and not self._thread.is_alive():
            self._resident.close()  # its views of the shared columns: the buffer can close
        if self._ended is None:
            self._ended = _CLOSED

    def _drain(self) -> None:
        self._queue.clear()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
