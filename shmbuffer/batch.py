"""Batches: rows taken from a buffer, with fields by attribute and by key.

``batch.obs`` and ``batch["obs"]`` are the same array; ``len(batch)`` is the number of rows (as
in TorchRL's TensorDict). Besides fields a batch carries *extras*: ``index`` (the rows' global ids,
see ``ring.py``) and, depending on the sampler, ``weight``, ``mask``, ``source`` ... — readable the
same two ways. ``batch.keys()`` are the fields then the extras, so ``dict(batch)`` holds both.

``batch[:2]``, ``batch[idx]`` and ``batch[mask]`` select rows of every field and extra (a new
batch); ``batch["adv"] = a`` or ``batch.adv = a`` adds a learner-side extra (one value per row).
``batch.to_tensordict()`` makes a TensorDict (with the ``tensordict`` package), ``batch.to_jax()``
JAX arrays (with the ``jax`` package, through DLPack).

When the batch was gathered from the packed record (``schema.py``), it keeps that block, and
``to(device)`` moves it with one copy, the small fields then being views of the device block.
"""

from __future__ import annotations

import ctypes
import math
import warnings
from collections.abc import Iterator
from functools import cache
from typing import Any

import numpy as np

from .errors import UnknownKey, UnknownName
from .hints import KEYS, key_hint
from .schema import Record


@cache
def torch_dtype(dtype: np.dtype[Any]) -> Any:
    """The torch dtype of a numpy dtype (cached)."""
    import torch

    return torch.from_numpy(np.empty(0, dtype)).dtype


def _tensor(a: Any) -> Any:
    import torch

    if type(a) is np.ndarray and a.flags.writeable:
        return torch.from_numpy(a)
    if isinstance(a, torch.Tensor):
        return a
    a = np.asarray(a)
    if a.flags.writeable:
        return torch.from_numpy(a)
    with warnings.catch_warnings():
        # torch has no read-only tensors: a zero-copy tensor of a read-only view is writable
        # memory that the docs ask users not to write (view() and column())
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


_set = object.__setattr__

ALIGN = 64
"""Bytes of alignment XLA needs to take a host array through DLPack without a copy (``to_jax``).
``buffer.sample`` allocates with numpy (16-byte aligned): aligning every sample would cost each
one microseconds; ``loader.aligned_outs`` makes aligned arrays to gather into."""


def empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """``np.empty(shape, dtype)`` whose memory starts at a multiple of ``ALIGN`` bytes (numpy's
    own allocations are 16-byte aligned)."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + ALIGN, np.uint8)
    # a quarter of raw.ctypes.data's time (numpy arrays export the buffer protocol; its stubs do not say so)
    at = -ctypes.addressof(ctypes.c_char.from_buffer(raw)) % ALIGN  # type: ignore[arg-type]
    return raw[at:at + nbytes].view(dtype).reshape(shape)


def jax_module() -> Any:
    """The ``jax`` module, or an ``ImportError`` that says which extra installs it."""
    try:
        import jax
    except ImportError:
        raise ImportError("shmbuffer's JAX batches (Batch.to_jax, Loader(framework='jax')) need the jax package: pip install jax, or from shmbuffer's clone "
                          "pip install -e '.[jax]'") from None
    return jax


class Batch:
    """Rows of a buffer: ``fields`` (the schema's, in order) and ``extras`` (index, weight ...)."""

    __slots__ = ("_block", "_lead", "_record", "extras", "fields")

    def __init__(
        self,
        fields: dict[str, Any],
        extras: dict[str, Any] | None = None,
        *,
        block: Any = None,
        record: Record | None = None,
        lead: tuple[int, ...] | None = None,
    ) -> None:
        # past __setattr__ (which adds learner-side fields): every batch is built here, on the hot path
        _set(self, "fields", fields)
        _set(self, "extras", extras if extras is not None else {})
        _set(self, "_block", block)
        _set(self, "_record", record)
        _set(self, "_lead", lead)  # the leading dims of the fields when the block's rows are (B, T) flattened

    @property
    def block(self) -> Any:
        """The packed small fields of these rows, ``(rows, itemsize)`` uint8 (``schema.Record``),
        when the batch was gathered from them; the small fields are views of it. (A batch may be
        made with the record as the structured array it was gathered into: its bytes are made
        here, when asked for, not on every sample.)"""
        b = self._block
        if b is not None and b.ndim == 1 and b.dtype.names is not None:
            b = b.view(np.uint8).reshape(b.shape[0], b.dtype.itemsize)
            _set(self, "_block", b)
        return b

    @property
    def record(self) -> Record | None:
        """Where each small field sits in ``block`` (``None`` without a block)."""
        return self._record

    @property
    def lead(self) -> tuple[int, ...] | None:
        """The leading dimensions of windows ``(n, T)`` whose rows ``block`` holds flattened."""
        return self._lead

    def __getattr__(self, name: str) -> Any:
        try:
            return self.fields[name]
        except KeyError:
            pass
        try:
            return self.extras[name]
        except KeyError:
            error = UnknownName if name in KEYS else AttributeError  # SB3's batch.observations ...
            raise error(self._missing(name), name=name, obj=self) from None

    def __setattr__(self, name: str, value: Any) -> None:
        if name in Batch.__slots__:
            object.__setattr__(self, name, value)
        else:
            self[name] = value

    def __setitem__(self, name: str, value: Any) -> None:
        """Replace a field or extra, or add an extra (advantages, returns ...): one value per row."""
        if not isinstance(name, str):
            raise TypeError(f"batch[...] = value: expected a name (str), got {type(name).__name__}")
        shape = getattr(value, "shape", None)
        if shape is None:
            value = np.asarray(value)
            shape = value.shape
        if not shape or shape[0] != len(self):
            raise ValueError(f"batch[{name!r}]: expected one value per row ({len(self)}, ...), got shape {tuple(shape)}")
        if name in self.fields:
            self.fields[name] = value
            self._block = None  # the field is no longer a view of the packed block
        else:
            self.extras[name] = value

    def __getitem__(self, name: Any) -> Any:
        if not isinstance(name, str):
            return self._rows(name)
        try:
            return self.fields[name] if name in self.fields else self.extras[name]
        except KeyError:
            raise UnknownKey(self._missing(name)) from None

    def _missing(self, name: str) -> str:
        """What a batch without ``name`` has, and our name for another library's key (``hints.py``)."""
        return (f"batch has no field {name!r}: fields {', '.join(self.fields)}; extras "
                f"{', '.join(self.extras) or 'none'}{key_hint(name)}")

    def __contains__(self, name: object) -> bool:
        return name in self.fields or name in self.extras

    def _rows(self, index: Any) -> Batch:
        """The rows ``index`` (an int, a slice, ints or a boolean mask) of every field and extra."""
        if hasattr(index, "detach"):
            index = index.detach().cpu().numpy()
        if isinstance(index, tuple):
            raise TypeError("batch[...]: select rows with one index (an int, a slice, ints or a mask)")
        if not isinstance(index, (int, np.integer, slice)):
            index = np.asarray(index)
            if index.dtype.kind not in "iub":
                raise TypeError(f"batch[...]: expected a name, an int, a slice, ints or a mask, got {index.dtype}")
        n = len(self)

        def pick(a: Any) -> Any:
            if isinstance(index, np.ndarray) and hasattr(a, "detach"):
                import torch

                return a[torch.as_tensor(index, device=a.device)]
            return a[index]

        try:
            fields = {k: pick(v) for k, v in self.fields.items()}
            extras = {k: pick(v) if getattr(v, "shape", ())[:1] == (n,) else v for k, v in self.extras.items()}
        except IndexError as exc:
            raise IndexError(f"batch[{index!r}]: {exc} (the batch has {n} rows)") from None
        return Batch(fields, extras)

    def keys(self) -> list[str]:
        """The fields (in schema order), then the extras (index, weight ...)."""
        return [*self.fields, *self.extras]

    def values(self) -> list[Any]:
        """The fields' arrays, then the extras' (``index``, ``weight`` ...), as ``dict.values`` would list them."""
        return [*self.fields.values(), *self.extras.values()]

    def items(self) -> list[tuple[str, Any]]:
        """``(name, array)`` of the fields, then of the extras."""
        return [*self.fields.items(), *self.extras.items()]

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        first = next(iter(self.fields.values()))
        return int(first.shape[0]) if first.ndim else 1

    @property
    def size(self) -> int:
        """The number of rows, the same as ``len(batch)``."""
        return len(self)

    def as_dict(self) -> dict[str, Any]:
        """Fields and extras in one plain dict (cpprb's ``sample`` returns this shape)."""
        return {**self.fields, **self.extras}

    def to_tensordict(self, device: Any = None) -> Any:
        """The fields and extras as a ``tensordict.TensorDict`` with batch size ``[len(batch)]``
        (TorchRL's batch type), on ``device`` (CPU by default, zero-copy there)."""
        try:
            from tensordict import TensorDict
        except ImportError:
            raise ImportError("to_tensordict() needs the tensordict package: pip install tensordict, or from "
                              "shmbuffer's clone pip install -e '.[torchrl]'") from None
        moved = self.to(device)
        return TensorDict({**moved.fields, **moved.extras}, batch_size=[len(self)], device=device)

    def to_jax(self, device: Any = None) -> Batch:
        """The same rows as JAX arrays, through DLPack: on the CPU (``device=None`` with JAX's
        default CPU backend) without a copy, to another JAX device (a ``jax.Device``) with one copy
        each.

        What is shared on the CPU: every field gathered as its own array (the large fields: images,
        frames) and every contiguous extra, when its memory is 64-byte aligned (``ALIGN``; XLA
        copies a host array at another alignment): ``Loader(framework="jax")`` gathers into such
        memory, and so does ``buf.sample(n, out=loader.aligned_outs(buf, n))``; a plain
        ``buf.sample(n)`` is numpy's 16-byte aligned memory, copied once and JAX
        keeps its dtype (64-bit ints and floats need ``jax.config.update("jax_enable_x64",
        True)``; without it JAX converts them to 32 bits, a copy). The small fields packed in one
        record (``batch.block``) are interleaved row by row and XLA takes only dense arrays: each
        is made dense on the host first, one copy of its few bytes per row.

        Lifetime: a shared JAX array reads the batch's memory, which stays allocated as long as
        the JAX array lives (DLPack keeps the numpy array alive); do not write the batch's arrays
        while JAX uses them. A batch gathered into memory that is reused (``sample(out=...)``,
        staging slots) is overwritten by the next batch: pass ``device`` or copy it first.
        """
        jax = jax_module()
        packed: Any = self.record.offsets if self._block is not None and self.record is not None else {}

        def put(a: Any, name: str) -> Any:
            if hasattr(a, "detach"):  # a torch tensor on the CPU: DLPack shares it too
                a = a.detach().cpu()
                if not a.is_contiguous():
                    a = a.contiguous()
            else:
                a = np.asarray(a)
                if name in packed or not (a.flags.c_contiguous and a.flags.writeable):
                    # DLPack exports only dense, writable arrays
                    dense = empty(a.shape, a.dtype)
                    np.copyto(dense, a)
                    a = dense
            got = jax.dlpack.from_dlpack(a)
            return got if device is None else jax.device_put(got, device)

        return Batch(
            {name: put(a, name) for name, a in self.fields.items()},
            {name: put(a, "") for name, a in self.extras.items()},
        )

    def to(self, device: Any = None, *, non_blocking: bool = False) -> Batch:
        """The same rows as torch tensors on ``device`` (CPU by default, zero-copy there).

        To another device the packed small fields travel as one block and become views of it.
        """
        import torch

        cpu = device is None or device == "cpu"  # the common case, without building a torch.device
        dev = torch.device("cpu") if cpu else torch.device(device)
        if cpu or dev.type == "cpu":  # zero-copy: the fields already share the gathered block
            def cpu(a: Any) -> Any:
                return torch.from_numpy(a) if type(a) is np.ndarray and a.flags.writeable else _tensor(a).cpu()

            return Batch(
                {name: cpu(a) for name, a in self.fields.items()},
                {name: cpu(a) for name, a in self.extras.items()},
            )

        def move(a: Any) -> Any:
            t = _tensor(a)
            return t if t.device == dev else t.to(dev, non_blocking=non_blocking)

        fields: dict[str, Any] = {}
        block = None
        if self._block is not None and self._record is not None:
            block = move(self.block)
            fields = torch_views(block, self._record)
            if self._lead is not None:
                fields = {k: v.view(*self._lead, *v.shape[1:]) for k, v in fields.items()}
        out = {name: fields[name] if name in fields else move(a) for name, a in self.fields.items()}
        extras = {name: move(a) for name, a in self.extras.items()}
        return Batch(out, extras, block=block, record=self._record, lead=self._lead)

    def numpy(self) -> Batch:
        """The same rows as numpy arrays (copied to the host if they are on a device)."""

        def host(a: Any) -> Any:
            return a.detach().cpu().numpy() if hasattr(a, "detach") else np.asarray(a)

        return Batch(
            {k: host(v) for k, v in self.fields.items()},
            {k: host(v) for k, v in self.extras.items()},
        )

    def __repr__(self) -> str:
        def show(a: Any) -> str:
            return f"{tuple(a.shape)} {getattr(a, 'dtype', '?')}"

        parts = [f"{k}: {show(v)}" for k, v in {**self.fields, **self.extras}.items()]
        return f"Batch({len(self)} rows; {', '.join(parts)})"


def torch_views(block: Any, record: Record) -> dict[str, Any]:
    """Views of each small field of a ``(n, itemsize)`` uint8 tensor, like ``Record.views``."""
    import torch

    n = block.shape[0]
    if block.device.type == "cpu" and block.is_contiguous():  # numpy's field views: half the time of as_strided
        rows = block.numpy().view(record.dtype).reshape(n)
        return {name: torch.from_numpy(rows[name]) for name in record.offsets}
    typed: dict[Any, Any] = {}
    out = {}
    for name, tdtype, shape, inner, at in _view_plan(record):
        if tdtype not in typed:
            typed[tdtype] = block.view(tdtype)  # (n, itemsize / size): the record's width divides
        flat = typed[tdtype]
        out[name] = torch.as_strided(flat, (n, *shape), (flat.stride(0), *inner), flat.storage_offset() + at)
    return out


_plans: dict[int, tuple[Record, list[tuple[str, Any, tuple[int, ...], list[int], int]]]] = {}


def _view_plan(record: Record) -> list[tuple[str, Any, tuple[int, ...], list[int], int]]:
    """Per small field: its name, torch dtype, shape, inner strides and offset in items (cached
    per record: a batch's views are made on the hot path)."""
    got = _plans.get(id(record))
    if got is not None and got[0] is record:
        return got[1]
    plan = []
    for name, offset in record.offsets.items():
        sub = record.dtype[name]
        base, shape = (sub.base, sub.shape) if sub.shape else (sub, ())
        inner = [int(np.prod(shape[i + 1:], dtype=np.int64)) for i in range(len(shape))]
        plan.append((name, torch_dtype(base), tuple(shape), inner, offset // base.itemsize))
    _plans[id(record)] = (record, plan)
    return plan
