"""``draw`` with replacement as one C call (``native/sample.c``), where the buffer's sampler and
columns allow it (``DrawGather.serves``); ``sample_for_another`` for threads that sample for another.

The reader's Python steps (``reader.draw``) stay the reference: this returns ``None`` wherever
they must decide or explain, and hands rows still not intact after its rounds to ``reader.fetch``.
"""

from __future__ import annotations

import threading
from typing import Any, cast

import numpy as np

from .. import frames, native
from ..batch import Batch
from ..sampling.samplers import Prioritized
from .gather import Out, Rows, large_outs
from .layout import EXTRA, Block
from .reader import Source, Uses, fetch, redrawer

MAX_COLUMNS = 64
"""Columns (the packed record, each large field, the episode ids) the C gather copies in one call
(``native.h``'s ``MAX_COLS``); a buffer with more samples through ``draw`` (numpy past them)."""


_NO_ROW: dict[str, np.ndarray] = {}
"""The per-row outs of a buffer that gathers no per-row column (never written to)."""


class _Thread(threading.local):
    nogil = False


_THREAD = _Thread()


def sample_for_another(on: bool = True) -> None:
    """Whether this thread samples for another thread (the loader's does): its one-call samples
    then release the GIL for the whole gather, however small, so the thread it serves runs its
    Python meanwhile. Otherwise only big gathers release it: a release while another thread
    runs Python costs the sampling thread the wait to get the GIL back."""
    _THREAD.nogil = on


class DrawGather:
    """``draw`` with replacement as one C call (``_native.sample``, ``native/sample.c``): the draw
    (uniform, or prioritized from the tree, stratified), the stamped gather of every column (with
    ``next_of``/``stack``: of each transition's window of rows, ``frames.py``'s rules in C), a few
    rounds of re-draws of rows not intact, and the importance weights, the GIL released around big
    copies; then the batch of the packed record's views. The draw's random numbers come from a
    xoshiro256** generator in C seeded from the buffer's ``rng`` (made again when ``rng`` is
    replaced): another stream than numpy's, the same distribution (``tests/test_draw_gather.py``).
    What the call does not serve it says: an empty buffer, an update during the gather
    (``_unless_updated``) and a closed plan go to ``draw`` (which raises or reads again), and rows
    still not intact after its rounds to ``fetch``.

    Served (``DrawGather.serves``): every buffer of at most ``MAX_COLUMNS`` columns (and a frames
    window of at most 64 rows), ``max_use`` included (each row returned counts its use in C, under
    the lock tried once); ``replace=False`` and hindsight take ``draw``."""

    def __init__(self, lib: Any, src: Source) -> None:
        block, ring, prios = src.block, src.ring, src.priorities
        self.lib = lib
        self.sample = lib.sample
        self.rng = src.rng
        cols = [] if block.packed is None else [block.packed]
        large = {name: col for name, col in block.large.items() if name != frames.KIND}
        cols += large.values()
        self.row = {name: col.dtype for name, col in block.row.items()}
        cols += block.row.values()
        spec = block.rows
        self.stacks: dict[str, frames.Stack] = {}
        """the outs that hold stacks' frames ``(n, k, *frame)``, for ``frames.assemble``"""
        self.large, parts = self._frames(block, large)  # PLAIN: the large columns as they are
        kinds = block.kinds  # the C reads a row's window only where rows have kinds
        frames_plan = None if kinds is None else (kinds, spec.depth, spec.ahead, tuple(parts))
        tree = None if prios is None else (prios.tree.sums, prios.tree.mins, prios.tree.plan)
        counting = prios is not None and prios.uses is not None
        claim = (ring.lock.memory, prios.uses, prios.max_use) if counting else None  # type: ignore[union-attr]
        seed = src.rng.integers(0, 1 << 64, size=4, dtype=np.uint64)
        view = ring.native_view
        assert view is not None, "serves() checked it"
        self.plan = lib.read_plan(view[0], view[1], block.counters, tuple(cols), seed, tree, claim, frames_plan)
        self.record = block.record if block.packed is not None else None
        self.names = block.schema.names
        self.tree = tree is not None
        self.counting = counting

    def _frames(self, block: Block, large: dict[str, np.ndarray]) -> tuple[list[Out], list[tuple[int, ...]]]:
        """The outs after the record's (in order) and the C parts that fill them, the record's and
        the episode's included: what ``_transitions`` reads (``Part`` in ``native/sample.c``: column,
        offset, bytes, window column, frames); without ``next_of``/``stack`` the outs are the large columns."""
        spec = block.rows
        stored, record = block.stored, block.stored_record
        index = {name: at + (block.packed is not None) for at, name in enumerate(large)}
        c = spec.depth

        def source(name: str) -> tuple[int, int, int]:
            f = stored[name]
            if name in record.offsets:
                return 0, record.offsets[name], f.row_bytes
            return index[name], 0, f.row_bytes

        outs: list[Out] = []
        parts: list[tuple[int, ...]] = []
        if block.packed is not None:
            parts.append((0, 0, record.itemsize, c, 0))
        for nxt, src in spec.next_of:  # a source stored whole: the next row's
            if spec.stacked(src) is None:
                parts.append((*source(src), c + 1, 0))
                outs.append((nxt, stored[src].shape, stored[src].dtype))
        for s in spec.stack:
            for name, last in frames.stack_columns(spec, s).items():
                parts.append((*source(s.name), last, s.k))
                outs.append((name, (s.k, *stored[s.name].shape), stored[s.name].dtype))
                self.stacks[name] = s
        for name, col in large.items():  # the rest, the row's own
            if spec.stacked(name) is None:
                parts.append((index[name], 0, col[0].nbytes, c, 0))
                outs.append((name, col.shape[1:], col.dtype))
        for i, col in enumerate(block.row.values()):
            parts.append((len(index) + (block.packed is not None) + i, 0, col.itemsize, c, 0))
        return outs, parts

    @staticmethod
    def serves(src: Source) -> bool:
        """Whether ``src``'s samples with replacement can be one call: its sampler's draw is one
        the C call makes (``Sampler.served``), and the columns fit a plan."""
        if src.options.sampler.served is None:
            return False  # only its own draw: never a built-in one in its place
        block = src.block
        spec = block.rows  # the parts: at most the columns, and a second stack of each
        columns = (block.packed is not None) + len(block.large) + len(block.row) + len(spec.stack)
        if spec.depth + spec.ahead + 1 > MAX_COLUMNS:
            return False
        return native.lib is not None and getattr(src.ring, "native_view", None) is not None and columns <= MAX_COLUMNS

    def close(self) -> None:
        """Release the plan's views of the block (``ReplayBuffer.close``)."""
        self.lib.read_close(self.plan)

    def __call__(self, src: Source, n: int, out: dict[str, np.ndarray] | None, calls: int,
                 keyed: tuple[int, int, int] | None = None) -> Batch | None:
        """``draw(src, n, out=out, calls=calls)`` in one call, or ``None``: ``draw`` must run.
        ``keyed``: a rank's part of a global draw (``Rank.keyed``), the ids ``ranks.draw`` gives."""
        if out is not None and any(s.axis and name in out for name, s in self.stacks.items()):
            return None  # the C call writes a stack's frames in a row; the field interleaves them
        record = self.record
        rec = None
        outs: list[np.ndarray] = []
        if record is not None:  # the packed record, gathered as a structured array: its fields are views
            if out is None:
                rec = np.empty(n, record.dtype)
            else:
                block = out.get("_block")  # none given: the reader's path (a frames buffer's makes one)
                if block is None or not (
                        block.flags.c_contiguous and block.dtype == np.uint8 and block.shape == (n, record.itemsize)):
                    return None  # the reader's numpy gather takes it
                rec = block.view(record.dtype).reshape(n)
            outs.append(rec)
        large = large_outs(self.large, n, out) if self.large else {}
        if large is None:
            return None  # an out the C copies do not take: the reader's path
        outs += large.values()
        row = {name: np.empty(n, dtype) for name, dtype in self.row.items()} if self.row else _NO_ROW
        outs += row.values()
        ids, ok = np.empty(n, np.int64), np.empty(n, np.bool_)
        leaves: np.ndarray | None = None
        weight: np.ndarray | None = None
        if self.tree:  # prioritized, or uniform under max_use (leaf 1 for each row with uses left)
            sampler = src.options.sampler
            leaves = np.empty(n)
            beta = 0.0
            if sampler.prioritized:  # served "tree": Prioritized's weights
                weight = np.empty(n, np.float32)
                beta = cast(Prioritized, sampler).beta_at(calls)
            bad = self.sample(self.plan, tuple(outs), ids, ok, _THREAD.nogil, leaves, weight, beta, keyed)
        else:
            bad = self.sample(self.plan, tuple(outs), ids, ok, _THREAD.nogil, keyed)
        if bad < 0:
            return None
        for name, s in self.stacks.items():  # frames (n, k, *frame) in the field's layout
            if out is None or name not in out:
                large[name] = frames.assemble(s, large[name])
            else:
                large[name] = out[name]
        if bad:  # rows still not intact after the C rounds: the reader's loop (waits, reaps, gives up)
            rows = Rows(ok, None if rec is None else rec.view(np.uint8).reshape(n, -1), large, row)
            # under max_use the positions that are ok have counted their use, the others not
            ids, rows, leaves = fetch(src.block, src.ring, ids, redrawer(src, n, True), reap=src.reap, values=leaves,
                                      out=out, what=lambda: f"sample({n}) of buffer {src.name!r}", rows=rows,
                                      claim=Uses(src) if self.counting else None,
                                      unclaimed=np.flatnonzero(~ok) if self.counting else None)
            if weight is not None:
                prios = src.priorities
                assert prios is not None
                weight = src.options.sampler.weights(prios.tree, leaves, calls)
        extras = {"index": ids}
        if row:  # a plain uniform buffer has no per-row column to hand out: skip the loop
            extras.update((EXTRA[name], a) for name, a in row.items() if name in EXTRA)
        if weight is not None:
            extras["weight"] = weight
        if large:
            fields = {name: large[name] if name in large else rec[name] for name in self.names}  # type: ignore[index]
        else:
            fields = {name: rec[name] for name in self.names}  # type: ignore[index]
        return Batch(fields, extras, block=rec, record=record)  # the block's bytes when asked (Batch.block)
