"""A save's ``pushed`` (format version 3, ``format.py``): the saving process's last row of each
lane, which its next push there continues (``frames_push.Last``: the row's stacks and next
observation as pushed). ``lasts`` and ``entries`` give them for ``meta.json`` (``saving.py``);
``value`` reads a value back and ``check`` checks each row a load put in against its entry
(``loading.py``), whose loading process then continues the lanes (``ReplayBuffer.pusher``).
"""

from __future__ import annotations

import base64
import binascii
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import LayoutError
from ..frames import END, KIND, LEAD, frames_of
from ..protocol.frames_push import Last
from ..protocol.rows import slot
from ..protocol.snapshot import Buffer, Run, columns, restored

__all__ = ["check", "entries", "lasts", "value"]


def lasts(buf: Buffer) -> dict[int, Last]:
    """With ``next_of``/``stack``: per lane, this process's last row there when its next push
    continues that row's episode; a forked child's pusher is its parent's, and holds none."""
    pusher = buf.pusher
    if pusher is None or pusher.pid != os.getpid():
        return {}
    return {lane: last for lane, last in pusher.last.items() if not last.final}


def entries(runs: list[Run], lasts: dict[int, Last]) -> list[dict[str, Any]]:
    """``meta.json``'s ``pushed``: each of ``lasts`` whose row its lane's run saved as its newest
    (not a hole); each value's bytes (C order, little-endian) in base64."""
    out = []
    for lane, last in sorted(lasts.items()):
        run = runs[lane]
        if run.keep <= last.row == run.end - 1 == run.stop - 1 and not run.hole_mask(last.row, last.row + 1)[0]:
            out.append({"lane": lane, "row": last.row, "episode": last.episode,
                        "values": {n: base64.b64encode(np.ascontiguousarray(v, v.dtype.newbyteorder("<")).tobytes()).decode()
                                   for n, v in sorted(last.values.items())}})
    return out


def value(text: str, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
    """The value of shape ``shape`` and dtype ``dtype`` that ``entries`` wrote as ``text``;
    ``ValueError`` saying what was expected when it is not."""
    nbytes = math.prod(shape) * dtype.itemsize
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"base64 of {nbytes} bytes") from None
    if len(raw) != nbytes:
        raise ValueError(f"base64 of {nbytes} bytes")
    return np.frombuffer(raw, dtype.newbyteorder("<")).reshape(shape).astype(dtype)


def check(buf: Buffer, pushed: dict[int, Last], file: Path) -> None:
    """Each ``pushed`` row against the rows a load put into ``buf`` (the next push continues it):
    a saved step (not an end or lead row) whose episode goes on, of the episode id given, each
    stacked field's stored frame the newest frame of the stack given; ``LayoutError`` if not."""
    spec = buf.options.rows  # only a version-3 save, which has frames (loading checked it), has pushed rows
    arrays, fields = columns(buf), buf.block.fields
    for lane, last in pushed.items():
        at = int(slot(lane, np.array([last.row], np.int64), buf.lane_capacity)[0])
        why = None
        if not restored(buf, np.array([at]))[0] or arrays[KIND][at] & (END | LEAD):
            why = "is not a saved step"
        elif any(fields[name][at].any() for name in spec.ends if name in fields):
            why = "ends its episode"
        elif last.episode is not None and "_episode" in arrays and int(arrays["_episode"][at]) != last.episode:
            why = f"is of episode {int(arrays['_episode'][at])}, not {last.episode}"
        elif any(not np.array_equal(frames_of(s, last.values[s.name][None])[0, -1], fields[s.name][at])
                 for s in spec.stack):
            why = "holds frames other than the newest of its stacks in pushed"
        if why is not None:
            raise LayoutError(f"{file}: row {last.row} of lane {lane} (meta.json's pushed) {why}; the file was altered")
