"""Resuming from a checkpoint: ``resume(path, factory)`` makes a new buffer in shared memory holding
the last complete checkpoint in the folder ``path`` (``manifest.py``): the same schema, options,
rows at the same row numbers (ids, lanes, episodes), holes, priorities, use counts, counters and
the lanes' bounds, and gives back what belongs to a process rather than to the buffer (the pending
rows of ``next_of``/``stack`` lanes, the sampling generator's state) for ``ReplayBuffer.resume``
to put in place.

The manifest and every chunk it names are checked before any shared memory is made
(``manifest.read_manifest``, ``manifest.open_chunk``: each entry, the segments against the
chunks' blocks, the chunks' sizes, tokens and tensors); the rows as they are read, as ``load``
checks a save's (``_present`` 0 or 1 and a hole's bytes zeros, leaves and use counts together,
``_kind``). Whatever is malformed raises ``LayoutError`` naming the file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import FieldError, LayoutError
from ..frames import END, KIND, LEAD
from ..progress import Progress as Line
from ..protocol import snapshot
from ..protocol.frames_push import Last
from ..protocol.layout import ROW, SAMPLER, Counter, row_columns
from ..protocol.priorities import MAX_LEAF
from ..protocol.rows import pieces, slot
from ..protocol.snapshot import CHUNK_BYTES, Buffer, columns
from ..sample_paths import generator_from_state
from .format import tensor_of
from .loading import STATS, check_kinds, check_leaves, pread_into, read_piece
from .manifest import BLOCKS, ChunkFile, Manifest, open_chunk, read_manifest, row_tensors

__all__ = ["resume", "resume_sampling"]


def resume(path: str | os.PathLike[str], factory: Any, *, name: str | None = None,
           seed: Any = None) -> tuple[Buffer, Manifest, dict[int, Last]]:
    """A new buffer (made by ``factory``, ``ReplayBuffer``) holding the last complete checkpoint in
    ``path``, the checked manifest, and the pending rows per lane (``frames_push.Last``) that the
    checkpointing process had pushed last. A missing manifest raises ``FileNotFoundError``; a
    damaged, truncated or altered folder ``LayoutError`` naming the file, before any shared memory
    is made."""
    folder = Path(path)
    man = read_manifest(folder)
    assert man is not None
    saved = man.saved
    schema, opts = saved.schema, saved.opts
    opened: list[ChunkFile] = []
    try:
        for entry in man.chunks:
            opened.append(open_chunk(folder, entry, schema, opts))
        _check_segments(man, opened)
        values = _check_state(man, opened[-1], schema, opts)
        buf = factory(schema, opts.capacity, **opts.arguments(), name=name, seed=seed)
        try:
            lasts = _fill(buf, man, opened, values)
        except BaseException:
            buf.__exit__(None, None, None)
            raise
    finally:
        for ch in opened:
            ch.close()
    return buf, man, lasts


def resume_sampling(buf: Buffer, path: str | os.PathLike[str], device: Any = None) -> None:
    """Put this process's sampling state back as at the last complete checkpoint in ``path``, for a
    process that did not make the buffer with ``ReplayBuffer.resume`` (a rank attached to it, a
    learner with a device copy): its generator, or for a rank (``buf.ranked``) its step and epochs
    instead (the checkpoint's ``ranks``, of the same world size and seed; a rank's own generator
    only re-draws rows not intact, and the checkpoint holds the checkpointing rank's), and with
    ``device`` (a
    ``DeviceReplay`` of ``buf``) the copy's generator. Everything is checked before anything is
    set; ``FieldError`` names what the checkpoint lacks or has otherwise."""
    man = read_manifest(Path(path))
    assert man is not None
    if man.meta["schema"] != buf.schema.to_json() or man.meta["options"] != buf.options.to_json():
        raise FieldError(f"resume_sampling: {man.file} is a checkpoint of a buffer with another schema or options than "
                         f"{buf.name!r}: pass the folder this buffer was resumed from")
    rank, ranks = buf.ranked, man.ranks
    if rank is not None:
        mine = {"world_size": rank.world_size, "seed": rank.seed}
        if ranks is None or any(ranks[k] != v for k, v in mine.items()):
            got = None if ranks is None else {k: ranks[k] for k in mine}
            raise FieldError(f"resume_sampling: this process is rank {rank.rank} with {mine}, and {man.file} holds the "
                             f"step of ranks with {got}: attach with the world_size and seed of the checkpointed run "
                             "(a rank's checkpoint records them: call buf.checkpoint on one of its ranks)")
    if device is not None and man.device_generator is None:
        raise FieldError(f"resume_sampling: device= was given, and {man.file} holds no device copy's generator: "
                         "checkpoint with buf.checkpoint(path, device=the_copy)")
    rng = generator_from_state(man.generator, man.file) if man.generator is not None and rank is None else None
    if device is not None:
        device.generator_state = man.device_generator  # checks it: ValueError before anything else is set
    if rng is not None:
        buf.rng = rng
    if rank is not None and ranks is not None:
        rank.step, rank.epochs = ranks["step"], ranks["epochs"]


def _check_segments(man: Manifest, opened: list[ChunkFile]) -> None:
    for lane, segs in enumerate(man.segments):
        for n0, n1, c, b, at in segs:
            have = opened[c].rows[BLOCKS[b]]
            if at + n1 - n0 > have:
                raise LayoutError(f"{man.file}: lane {lane}'s rows [{n0}, {n1}) are rows {at}.. of block {BLOCKS[b]} of "
                                  f"{opened[c].file}, which has {have}: the manifest or the chunk is altered")


def _check_state(man: Manifest, newest: ChunkFile, schema: Any, opts: Any) -> dict[str, Any]:
    """The state tensors of the newest chunk against the manifest; the names of ``_last/``'s."""
    rows = man.saved.rows
    want = {c.name: (tensor_of(c.name, (), c.dtype).code, [rows]) for c in row_columns(opts) if c.saved == SAMPLER}
    names: list[str] = []
    if man.pending:
        names = list(opts.rows.rebuilt)
        for n in names:
            f = schema[n]
            t = tensor_of(n, f.shape, f.dtype)
            want[f"_last/{n}"] = (t.code, t.file_shape(len(man.pending)))
    got = {n: (e.code, list(e.shape)) for n, e in newest.entries.items() if n.split("/")[0] not in BLOCKS}
    if got != want:
        raise LayoutError(f"{newest.file}: state tensors {str(got)[:500]}, expected {want} for {man.file}: the chunk "
                          "or the manifest is altered")
    return {"names": names}


def _fill(buf: Buffer, man: Manifest, opened: list[ChunkFile], values: dict[str, Any]) -> dict[int, Last]:
    """Read the rows into the new buffer's slots with their stamps, then leaves, use counts,
    counters and bounds; returns the pending rows."""
    saved = man.saved
    files = [t for t in row_tensors(saved.schema, saved.opts) if t.name != "_present"]
    arrays = columns(buf)
    targets = {**buf.block.fields, **{c.name: arrays[c.name] for c in row_columns(saved.opts) if c.saved == ROW}}
    lc = buf.lane_capacity
    step = max(1, CHUNK_BYTES // max(1, sum(t.row_bytes for t in files)))
    present: list[np.ndarray] = []
    removed = False
    with Line(f"resuming {man.file.parent}", saved.rows) as line:
        done = 0
        for lane, ((first, stop, _), segs) in enumerate(zip(saved.lanes, man.segments, strict=True)):
            mask = np.zeros(stop - first, bool)
            for n0s, n1s, c, b, at in segs:
                src, block = opened[c], BLOCKS[b]
                for n0, n1, sl in pieces(lane, n0s, n1s, lc, step):
                    here, _ = read_piece(src.fd, src.file, src.offset, f"{block}/", at + n0 - n0s, files, targets, lane,
                                         n0, sl)
                    snapshot.restore(buf, sl, n0, here)
                    mask[n0 - first:n1 - first] = here
                    done += n1 - n0
                    line.update(done)
            present.append(mask)
            removed |= not mask.all()
    removed |= _internals(buf, man, opened[-1], present)
    check_kinds(buf, saved.lanes, opened[-1].file)
    if saved.max_priority is not None:
        arrays["_prio"][0] = saved.max_priority
    stats = saved.stats
    values_at = {at: stats.get(key, 0) for key, at in STATS.items()}
    values_at.update({Counter.INTERLEAVED: stats.get("interleaved", 0), Counter.EDITS: man.edits,
                      Counter.EDITS_BEGUN: man.edits})
    snapshot.restore_counters(buf, values_at, removed)
    for lane, (first, stop, base) in enumerate(saved.lanes):
        buf.ring.place(lane, base if max(base, stop - lc) == first else first, stop)
    return _lasts(man, opened[-1], values["names"], saved.schema)


def _internals(buf: Buffer, man: Manifest, newest: ChunkFile, present: list[np.ndarray]) -> bool:
    """Leaves and use counts of every row from the newest chunk, checked as a save's; returns
    whether a row is used up."""
    prios = buf.priorities
    if prios is None:
        return False
    rows, lc = man.saved.rows, buf.lane_capacity
    leaf = np.empty(rows, np.float64)
    pread_into(newest.fd, leaf, newest.offset("_leaf", 0, 8), newest.file)
    uses = None
    if prios.uses is not None:
        uses = np.empty(rows, np.uint32)
        pread_into(newest.fd, uses, newest.offset("_uses", 0, 4), newest.file)
    if not np.all((leaf >= 0) & (leaf <= MAX_LEAF)) or not prios.leaves_valid(leaf):
        raise LayoutError(f"{newest.file}: tensor '_leaf' holds negative or non-finite priorities, or leaves above "
                          f"{MAX_LEAF:g}: the chunk was altered")
    max_use = buf.options.max_use
    if uses is not None and uses.size and max_use is not None and int(uses.max()) > max_use:
        raise LayoutError(f"{newest.file}: tensor '_uses' holds {int(uses.max())}, more than max_use={max_use}")
    kind = columns(buf).get(KIND)
    up = False
    pos = 0
    for lane, ((first, stop, _), here) in enumerate(zip(man.saved.lanes, present, strict=True)):
        k = stop - first
        slots = slot(lane, np.arange(first, stop, dtype=np.int64), lc)
        lv, us = leaf[pos:pos + k], None if uses is None else uses[pos:pos + k]
        if (lv[~here] != 0).any() or (us is not None and (us[~here] != 0).any()):
            raise LayoutError(f"{newest.file}: a hole of lane {lane} has a leaf or use count that is not 0: the chunk "
                              "was altered")
        rows_ok = here if kind is None else here & (kind[slots] & (END | LEAD) == 0)
        up |= check_leaves(buf, lv, us, rows_ok, newest.file, lane, first)
        prios.tree.update(slots, lv)
        if us is not None:
            prios.uses[slots] = us
        pos += k
    return up


def _lasts(man: Manifest, newest: ChunkFile, names: list[str], schema: Any) -> dict[int, Last]:
    """The pending rows of the manifest, their values read from the newest chunk."""
    out: dict[int, Last] = {}
    got: dict[str, np.ndarray] = {}
    for n in names:
        f = schema[n]
        a = np.empty((len(man.pending), *f.shape), f.dtype)
        pread_into(newest.fd, a, newest.offset(f"_last/{n}", 0, 0), newest.file)
        got[n] = a
    for i, p in enumerate(man.pending):
        out[p["lane"]] = Last(p["row"], p["final"], p["episode"], {n: got[n][i].copy() for n in names})
    return out
