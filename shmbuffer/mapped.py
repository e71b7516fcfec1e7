"""A buffer's block mapped in this process: creating or attaching it, its handle, its parts, and
its lifecycle. ``ReplayBuffer`` (``buffer.py``) is a ``MappedBlock`` with the buffer's operations.

Lifecycle: the constructing process creates the block and owns it; ``attach`` maps an existing
block and never removes it (unless its creator ``give_up`` and the attacher ``take_over``). ``close()`` unmaps this process's view (``BufferError`` while arrays
from ``view()``/``column()`` live; close again once they are gone); ``unlink()`` removes the name,
by itself when the creator exits or drops the buffer. Both are idempotent. A ``with`` block closes
(and, in the creator, unlinks); views still alive keep the mapping until they go.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any, TypeVar

import numpy as np

from .errors import SchemaError, closed
from .protocol import layout
from .protocol.layout import Block, Options
from .protocol.priorities import Priorities
from .protocol.ring import Ring, check_platform
from .sampling.samplers import Sampler
from .schema import Schema, as_schema
from .shm.segment import Segment

__all__ = ["BufferHandle", "MappedBlock"]

_M = TypeVar("_M", bound="MappedBlock")


@dataclass(frozen=True)
class BufferHandle:
    """What another process needs to attach: the buffer's name. Small, plain and picklable."""

    name: str


class MappedBlock:
    """A buffer's block mapped in this process (see the module docstring): the segment, and the
    ring, columns and priority tree laid on it. A subclass adds what its operations need by
    extending ``_setup`` and ``_close``."""

    _ring: Ring | None = None  # class defaults: close() works after a half-finished construction
    _segment: Segment | None = None

    @classmethod
    def attach(
        cls: type[_M], handle: BufferHandle | str, *, schema: Schema | Mapping[str, Any] | None = None,
        seed: int | np.random.Generator | None = None, sampler: type[Sampler] | ModuleType | None = None,
    ) -> _M:
        """Map an existing buffer by handle or name, as the class this is called on
        (``ReplayBuffer.attach`` gives a ``ReplayBuffer``). With ``schema``, refuse another layout.
        ``sampler``: the class of the buffer's sampler (refused when the buffer's is another kind), or
        the module that defines it, for a buffer made with a sampler of the user's; without it
        such a buffer needs its class imported here (``UnknownSampler`` names it).
        ``sampler=Unimported`` reads the rows of a buffer whose sampler class is not imported
        (a stand-in that cannot draw: the command line's ``inspect``, ``top``, ``save``)."""
        check_platform()
        name = handle.name if isinstance(handle, BufferHandle) else handle
        segment = Segment.attach(name)
        try:
            found, opts = layout.read(name, segment.meta, segment.header.fingerprint, sampler)
            if schema is not None and as_schema(schema) != found:
                raise SchemaError(f"buffer {name!r} has schema {found}, expected {as_schema(schema)}")
            self = cls.__new__(cls)
            self._setup(segment, found, opts, seed, initialise=False)
        except BaseException:
            segment.close(defer=True)  # the traceback may hold views of a half-made setup's parts
            raise
        return self

    def _create(self, name: str | None, schema: Schema, opts: Options, seed: Any) -> None:
        check_platform()
        segment = layout.create(name, schema, opts)
        try:
            self._setup(segment, schema, opts, seed, initialise=True)
        except BaseException:
            segment.close(defer=True)  # the traceback may hold views of a half-made setup's parts
            segment.unlink()
            raise

    def _setup(self, segment: Segment, schema: Schema, opts: Options, seed: Any, *, initialise: bool) -> None:
        # seed is for a subclass's own parts (ReplayBuffer's sampling)
        self._segment = segment
        self.schema = schema
        self.options = opts
        self.name = segment.name
        self._block = Block(schema, opts, segment.arrays)
        self._ring = Ring(segment.arrays, initialise=initialise)
        self._prios = Priorities(segment.arrays, opts.sampler, opts.max_use, initialise=initialise) if opts.tree else None
        if self._prios is not None:
            self._ring.repairs.append(self._prios.repair)

    @property
    def handle(self) -> BufferHandle:
        """A small picklable handle naming this buffer: ``ReplayBuffer.attach(handle)`` in another process."""
        return BufferHandle(self.name)

    @property
    def sampler(self) -> Sampler:
        """The buffer's sampler (``options.sampler``): the one every process attached shares."""
        return self.options.sampler

    @property
    def ring(self) -> Ring:
        """The ring (``ring.py``). With ``block`` and ``priorities``, the reader's interface
        (``protocol.reader.Source``) for the modules built on the protocol; user code needs none."""
        if self._ring is None:
            raise closed(self.name)
        return self._ring

    @property
    def block(self) -> Block:
        """Named views of the block's columns (``layout.py``): the reader's interface (``ring``)."""
        if self._ring is None:
            raise closed(self.name)
        return self._block

    @property
    def priorities(self) -> Priorities | None:
        """The priority tree and use counts, or ``None`` without a tree: the reader's interface (``ring``)."""
        if self._ring is None:
            raise closed(self.name)
        return self._prios

    @property
    def owner(self) -> bool:
        """Whether this object created the buffer (and so removes it from ``/dev/shm`` on ``unlink``)."""
        return self._segment is not None and self._segment.owner

    @property
    def closed(self) -> bool:
        """Whether ``close()`` has been called on this object."""
        return self._ring is None

    def close(self) -> None:
        """Unmap this process's view (the lifecycle: ``shmbuffer.mapped``'s docstring). Idempotent.
        In a ``finally`` or ``except`` block it lets go as ``with`` does (the mapping goes with the
        last view): the exception being handled holds, in its traceback, the internals of the call
        that raised."""
        self._close(defer=sys.exc_info()[0] is not None)

    def _close(self, *, defer: bool) -> None:
        if self._segment is None:
            return
        if self._ring is not None:
            self._ring.lock.let_go()  # a robust mutex this process holds must stay mapped (lock.py)
        self._ring = self._prios = None
        self._block = None  # type: ignore[assignment]
        self._segment.close(defer=defer)

    def give_up(self) -> None:
        """Stop owning the buffer this object created: it stays in ``/dev/shm`` when this process
        exits, until the process that calls ``take_over`` removes it (or ``shmbuffer gc``)."""
        if self._segment is not None:
            self._segment.give_up()

    def take_over(self) -> None:
        """Own the buffer mapped here, which its creator gave up: this process removes it (``owner``)."""
        if self._segment is not None:
            self._segment.take_over()

    def unlink(self) -> None:
        """Remove the buffer's name from ``/dev/shm``; open views stay valid. Idempotent."""
        if self._segment is not None:
            self._segment.unlink()

    def __enter__(self: _M) -> _M:
        return self

    def __exit__(self, *exc: object) -> None:
        owner = self.owner
        self._close(defer=True)  # views still held keep the mapping alive until they go
        if owner:
            self.unlink()
