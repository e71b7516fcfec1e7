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

Without CUDA the same API yields CPU tensors (zero-copy views of the sampled arrays), still
sampled ahead so that sampling overlaps training.

NOTE (shutdown): ``close()`` (or leaving the ``with`` block, or the end of iteration) stops the
thread: it sets a flag, drains the queue so the thread is never blocked on a full one, and joins
it. An exception in the thread is re-raised in the learner at the next batch.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from .batch import Batch, torch_views
from .buffer import ReplayBuffer

_DONE = object()


class _Staging:
    """Pinned host memory for one batch: the packed block, each large field, the extras."""

    def __init__(self, like: Batch, torch: Any) -> None:
        self.pinned: dict[str, Any] = {}
        arrays = {**({"_block": like._block} if like._block is not None else {}),
                  **{k: v for k, v in like.fields.items() if like._block is None or k not in like._record.offsets},  # type: ignore[union-attr]
                  **{f"extra:{k}": v for k, v in like.extras.items()}}
        for key, a in arrays.items():
            a = np.asarray(a)
            self.pinned[key] = torch.empty(a.shape, dtype=torch.from_numpy(a[:0]).dtype, pin_memory=True)
        self.host = {key: t.numpy() for key, t in self.pinned.items()}
        self.event: Any = None


class Loader:
    """Iterate device batches from ``buffer`` (see the module docstring); a ``Mix`` works too.

    ``sample(buffer) -> Batch`` draws one batch (default: ``buffer.sample(batch_size,
    **sample_kwargs)``). ``collector``, when given, is checked for worker errors at every batch.
    ``batches`` ends the iteration after that many (default: never).
    """

    def __init__(
        self,
        buffer: ReplayBuffer | Any,
        batch_size: int = 256,
        *,
        device: Any = None,
        prefetch: int = 2,
        sample: Callable[[ReplayBuffer], Batch] | None = None,
        collector: Any = None,
        batches: int | None = None,
        **sample_kwargs: Any,
    ) -> None:
        import torch

        if prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, got {prefetch}")
        self._torch = torch
        self.buffer = buffer
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.cuda = self.device.type == "cuda"
        if self.cuda and not torch.cuda.is_available():
            raise RuntimeError(f"device {self.device} was asked for, but torch.cuda.is_available() is False")
        self._custom = sample is not None or not isinstance(buffer, ReplayBuffer)  # e.g. a Mix
        self._batch_size = batch_size
        self._kwargs = sample_kwargs
        self._sample = sample or (lambda b: b.sample(batch_size, **sample_kwargs))
        self._collector = collector
        self._limit = batches
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=prefetch)
        self._stop = threading.Event()
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._staging: list[_Staging] = []
        self._thread = threading.Thread(target=self._produce, name="shmbuffer-loader", daemon=True)
        self._thread.start()

    # -- the background thread ----------------------------------------------------------------
    def _produce(self) -> None:
        made = 0
        try:
            while not self._stop.is_set() and (self._limit is None or made < self._limit):
                item = self._to_device(made) if self.cuda else self._sample(self.buffer).to("cpu")
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                made += 1
        except BaseException as exc:  # handed to the learner at its next batch
            self._put_final(exc)
            return
        self._put_final(_DONE)

    def _put_final(self, item: Any) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def _to_device(self, made: int) -> tuple[Batch, Any]:
        torch = self._torch
        slots = self._queue.maxsize + 2  # in the queue, with the learner, being filled
        stage = self._staging[made % slots] if len(self._staging) == slots else None
        if stage is not None and stage.event is not None:
            stage.event.synchronize()  # its previous copy to the device has finished
        if stage is not None and not self._custom:  # gather straight into pinned memory
            batch = self.buffer.sample(self._batch_size, out=stage.host, **self._kwargs)
            copy_rows = False
        else:
            batch = self._sample(self.buffer)
            if stage is None:
                stage = _Staging(batch, torch)
                self._staging.append(stage)
            copy_rows = True
        for key, a in stage.host.items():
            if key.startswith("extra:"):
                np.copyto(a, batch.extras[key[6:]])
            elif copy_rows:  # a custom sampler (or the first batch): one copy into pinned memory
                np.copyto(a, batch._block if key == "_block" else batch.fields[key])
        assert self._stream is not None
        with torch.cuda.stream(self._stream):
            moved = {k: t.to(self.device, non_blocking=True) for k, t in stage.pinned.items()}
            stage.event = torch.cuda.Event()
            stage.event.record(self._stream)
        fields: dict[str, Any] = {}
        if "_block" in moved and batch._record is not None:
            fields = torch_views(moved["_block"], batch._record)
            if batch._lead is not None:  # (n, T) windows: the block's rows are flattened
                fields = {k: v.view(*batch._lead, *v.shape[1:]) for k, v in fields.items()}
        out = {name: fields[name] if name in fields else moved[name] for name in batch.fields}
        extras = {k[6:]: v for k, v in moved.items() if k.startswith("extra:")}
        return Batch(out, extras, block=moved.get("_block"), record=batch._record, lead=batch._lead), stage.event

    # -- the learner's side -------------------------------------------------------------------
    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        if self._collector is not None:
            self._collector.check()
        item = self._queue.get()
        if item is _DONE:
            self.close()
            raise StopIteration
        if isinstance(item, BaseException):
            self.close()
            raise item
        if not self.cuda:
            return item
        batch, event = item
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
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(10)

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
