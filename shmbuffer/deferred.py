"""A shared buffer named now and made by the first write, in whichever process it happens.

A facade whose schema comes from the first data written (TorchRL's ``ShmStorage``) may travel to
other processes before anything is written: TorchRL's collectors hand an empty storage to their
workers, whose data has keys the main process never sees (a step counter the workers add). So the
block cannot be made before the storage travels. A ``DeferredBuffer`` fixes its name instead, and
keeps beside it a small record block (``<name>.init``, one row) that says what the rows are:

- The first process to write makes the block, under that name: the exclusive create (``O_EXCL``)
  decides the race, so exactly one writer makes it. It then writes the facade's description of
  the rows (JSON: their kind, their classes ...) into the record.
- Every other process, on its first write or read, finds the description in the record and
  attaches the block; a writer that lost the race waits for it (``WAIT`` seconds at most).
- The block belongs to the process that made this object (``home``), as a buffer belongs to its
  creator: a writer elsewhere that made it gives it up (``MappedBlock.give_up``) before it writes
  the record, and ``home`` takes it over when it first attaches (at ``close`` at the latest). If
  ``home`` dies before that, ``shmbuffer gc`` removes the block (its creator is gone).

Until something is shared nothing of this is made: ``record`` is made by ``share`` (the facade
calls it when it is pickled while empty); an object never shared makes its block itself, as
before.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import numpy as np

from .buffer import ReplayBuffer
from .schema import Schema

__all__ = ["RECORD_BYTES", "WAIT", "DeferredBuffer"]

RECORD_BYTES = 4096
"""Room for the description of the rows (JSON) in the record."""
WAIT = 60.0
"""Seconds a writer that lost the race to make the block waits for its maker to describe it."""
_RECORD = Schema(text=((RECORD_BYTES,), "uint8"), length=((), "int64"))


class DeferredBuffer:
    """A buffer named ``name``, made by the first ``make`` in any process (module docstring).

    :param name: the block's name in ``/dev/shm``.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.home = os.getpid()
        self.record: ReplayBuffer | None = None

    def share(self) -> None:
        """Make the record (in ``home``, once): from now on the block may be made elsewhere."""
        if self.record is None and os.getpid() == self.home:
            self.record = ReplayBuffer(_RECORD, 1, name=f"{self.name}.init")

    def description(self) -> dict[str, Any] | None:
        """What the maker wrote about the rows, or ``None`` while no block is made (or shared)."""
        if self.record is None or not len(self.record):
            return None
        row = self.record.export()
        return dict(json.loads(row["text"][0][: int(row["length"][0])].tobytes()))

    def find(self) -> tuple[ReplayBuffer, dict[str, Any]] | None:
        """The block, attached, and its description, once a process made it; ``home`` takes it over."""
        described = self.description()
        if described is None:
            return None
        buf = ReplayBuffer.attach(self.name)
        if os.getpid() == self.home:
            buf.take_over()
        return buf, described

    def make(self, schema: Schema, capacity: int, description: dict[str, Any]) -> tuple[ReplayBuffer, dict[str, Any]]:
        """The block: made here for ``schema`` and described by ``description`` if no process has
        made it, else attached, with its maker's description (compare it with yours)."""
        if self.record is None:  # never shared: nothing to coordinate
            return ReplayBuffer(schema, capacity, name=self.name), description
        text = json.dumps(description).encode()
        if len(text) > RECORD_BYTES:
            raise ValueError(f"DeferredBuffer: the description of the rows takes {len(text)} bytes, at most "
                             f"{RECORD_BYTES} fit: shorten the class names it holds")
        deadline = time.monotonic() + WAIT
        while True:
            found = self.find()
            if found is not None:
                return found
            try:
                buf = ReplayBuffer(schema, capacity, name=self.name)
            except FileExistsError:  # another process is making it: wait for its description
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"DeferredBuffer: buffer {self.name!r} exists but its maker has not described it in {WAIT:.0f} s "
                        "(it died making it, or a stale buffer has that name: `shmbuffer gc`)") from None
                time.sleep(0.005)
                continue
            if os.getpid() != self.home:
                buf.give_up()  # first: once described, home may take it over
            row = np.zeros(RECORD_BYTES, np.uint8)
            row[: len(text)] = np.frombuffer(text, np.uint8)
            self.record.push(text=row[None], length=np.array([len(text)]))
            return buf, description

    def close(self) -> None:
        """Close the record (``home`` removes it); the block is the caller's to close."""
        if self.record is not None:
            owner = self.record.owner
            try:
                self.record.close()
            finally:
                if owner:
                    self.record.unlink()
