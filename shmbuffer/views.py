"""Zero-copy, read-only views of a buffer's live memory (``ReplayBuffer.view`` and ``column``):
no stamp check, so writers coming round the ring overwrite what a view shows; ``get``, ``take``
and ``sample`` give stamped copies instead (``protocol/reader.py``). A buffer that stores
observations once for several rows (``next_of``/``stack``, ``frames.py``) has no whole rows in
memory, and so no views of them.
"""

from __future__ import annotations

import numpy as np

from .batch import Batch
from .errors import FieldError
from .protocol import reader
from .protocol.layout import Counter
from .protocol.reader import Source

__all__ = ["column", "view"]


def view(src: Source, start: int, stop: int, lane: int) -> Batch:
    """``ReplayBuffer.view``: logical rows ``[start, stop)`` of ``lane``, the rows ``len`` counts."""
    src.options.rows.whole("view", "read with sample, take or get")
    if src.block.counters[Counter.REMOVED]:
        start, stop = _positions_with_holes(src, start, stop, lane)
    where, ids = src.ring.contiguous(start, stop, lane)
    fields = {name: _readonly(col[where]) for name, col in src.block.fields.items()}
    return Batch(fields, {"index": ids})


def column(src: Source, name: str) -> np.ndarray:
    """``ReplayBuffer.column``: the whole field ``name``, ``(capacity, *shape)``, in slot order."""
    src.block.schema[name]
    if name in src.options.rows.rebuilt:
        raise FieldError(f"column({name!r}): the buffer stores {name!r} once for several rows (next_of/stack), "
                         "so it has no column of whole rows; read rows with sample, take or get")
    return _readonly(src.block.fields[name])


def _positions_with_holes(src: Source, start: int, stop: int, lane: int) -> tuple[int, int]:
    """``view``'s positions among the rows of ``lane`` that count (``reader.counted_ids``) as
    positions among all its held slots; ``ValueError`` when rows between them are gone."""
    ring = src.ring
    if not 0 <= lane < ring.lanes:
        raise ValueError(f"lane: expected a lane in [0, {ring.lanes}), got {lane}")
    ids = reader.counted_ids(src)
    mine = ids[ids % ring.lanes == lane] // ring.lanes
    lo, hi, step = slice(start, stop).indices(mine.size)
    if step != 1 or hi < lo:
        raise ValueError(f"view({start}, {stop}): expected 0 <= start <= stop within {mine.size} rows")
    first = int(ring.bounds()[0][lane])
    if hi == lo:
        return 0, 0
    if int(mine[hi - 1] - mine[lo]) != hi - lo - 1:
        raise ValueError(f"view({start}, {stop}): rows between them were deleted or used up, and a view "
                         "cannot skip them: take get(slice) for a copy of the rows that are there")
    return int(mine[lo]) - first, int(mine[lo]) - first + hi - lo


def _readonly(a: np.ndarray) -> np.ndarray:
    v = a.view()
    v.flags.writeable = False
    return v
