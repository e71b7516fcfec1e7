"""A snapshot's pieces into a sink at the places ``format.Layout`` gives them: the save's file, or
``MemorySink`` (one array of bytes) for ``export``. The snapshot itself, which rows as of which
moment and how they are read while writers go on, is ``protocol/snapshot.py``'s (its docstring
is the rule); ``copy_rows`` asks it for pieces, lane by lane, and lays them out.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from ..protocol.snapshot import CHUNK_BYTES, Buffer, Piece, Run, Snapshot, columns
from .format import Layout, Tensor

__all__ = ["CHUNK_BYTES", "Buffer", "MemorySink", "Sink", "Snapshot", "columns", "copy_rows"]


class Sink(Protocol):
    """Where ``copy_rows`` puts the rows: bytes at offsets of the data section."""

    def start(self, plan: Layout) -> None:
        """Make room for the rows of ``plan``."""

    def write(self, offset: int, a: np.ndarray) -> None:
        """The bytes of ``a`` at ``offset``."""

    def move(self, src: int, dst: int, nbytes: int) -> None:
        """Move ``nbytes`` from ``src`` down to ``dst``."""

    def finish(self, final: Layout) -> None:
        """The rows are all there, laid out as ``final``."""


class MemorySink:
    """The rows go to one array of bytes, ``data``; the tensors are views of it (``export``)."""

    data = np.empty(0, np.uint8)

    def start(self, plan: Layout) -> None:
        """Allocate the bytes of ``plan``."""
        self.data = np.empty(plan.data_bytes, np.uint8)

    def write(self, offset: int, a: np.ndarray) -> None:
        """The bytes of ``a`` at ``offset``."""
        a = np.ascontiguousarray(a)
        self.data[offset:offset + a.nbytes] = a.reshape(-1).view(np.uint8)

    def move(self, src: int, dst: int, nbytes: int) -> None:
        """Move ``nbytes`` from ``src`` down to ``dst``, a chunk at a time."""
        for done in range(0, nbytes, CHUNK_BYTES):
            k = min(CHUNK_BYTES, nbytes - done)
            self.data[dst + done:dst + done + k] = self.data[src + done:src + done + k]

    def finish(self, final: Layout) -> None:
        """Nothing to do: the rows are in ``data``."""


def _layout(tensors: list[Tensor], runs: list[Run]) -> Layout:
    return Layout(tensors, [(r.keep, r.end) for r in runs])


def copy_rows(snap: Snapshot, tensors: list[Tensor], sink: Sink, done: Any = None) -> tuple[Layout, bool]:
    """Copy every run of ``snap`` into ``sink`` (the module docstring); return the final layout and
    whether the tensors had to be moved over rows dropped after the layout was planned. ``done``:
    called with the bytes of each piece once written (a progress bar's ``add``)."""
    runs = snap.runs
    row_bytes = sum(t.row_bytes for t in tensors)
    step = snap.piece_rows(row_bytes)
    held: list[Piece] = []
    for run in runs:  # the first piece of every lane fixes the layout before anything is written
        while run.at < run.end:
            piece = snap.copy(run, step)
            if piece is not None:
                held.append(piece)
                break
    plan = _layout(tensors, runs)
    sink.start(plan)

    def write(piece: Piece) -> None:
        for t in tensors:
            sink.write(plan.at(t, piece.lane, piece.start), piece.arrays[t.name])
        if done is not None:
            done(piece.rows * row_bytes)

    while held:  # popped, so that each piece is freed once written: memory stays at about one piece
        write(held.pop())
    while any(r.at < r.end for r in runs):
        for run in runs:
            if run.at < run.end:
                got = snap.copy(run, step)
                if got is not None:
                    write(got)
                    got = None
    final = _layout(tensors, runs)
    moved = final.keep != plan.keep
    if moved:  # writers overwrote rows after the layout was planned: close the gaps, front to back
        for t in tensors:
            for lane, count in enumerate(final.counts):
                src, dst = plan.at(t, lane, final.keep[lane]), final.at(t, lane, final.keep[lane])
                if src != dst:
                    sink.move(src, dst, count * t.row_bytes)
    sink.finish(final)
    return final, moved
