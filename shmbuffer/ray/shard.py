"""A shard: an actor holding an ordinary ``ReplayBuffer`` in its node's shared memory, and the
global row ids that name a shard's rows (``tag``, ``shard_of``, ``row_of``).

A global id is ``shard << SHIFT | row id``: the shard's index in bits 56..62 (bit 63 stays clear,
so ids stay non-negative int64), which allows ``MAX_SHARDS`` (127) shards. ``ShardActor`` is the
Ray actor (``num_cpus=0``); at its start it starts a janitor (``shmbuffer.shm.janitor``) outside
Ray's process tree that removes the shard's block once the actor's process is gone.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray

from ..buffer import ReplayBuffer
from ..errors import EmptyBufferError, ShmBufferError
from ..schema import Schema
from ..shm import janitor

__all__ = [
    "MAX_SHARDS", "SHIFT", "ShardActor", "ShardInfo", "ShardLost", "ShardLostError", "draw_rows", "row_of",
    "shard_of", "shard_state", "tag", "unwrap",
]

SHIFT = 56
"""Row ids carry their shard in the bits from here up: ``shard << 56 | row id``."""
MAX_SHARDS = 127
"""The most shards a ``ShardedBuffer`` has: indices 0 to 126 in bits 56..62 (bit 63 is the sign)."""
_ROW = (1 << SHIFT) - 1


class ShardLost(RuntimeWarning):
    """A shard's actor or node died; the learner goes on with the others (``ShardedBuffer.lost``)."""


class ShardLostError(ShmBufferError, ConnectionError):
    """A writer's shard is gone (its actor or node died) and the writer does not fail over."""


def tag(shard: int, ids: np.ndarray) -> np.ndarray:
    """Shard-local row ids as global ones."""
    return np.asarray(ids, np.int64) | np.int64(shard << SHIFT)


def shard_of(ids: Any) -> np.ndarray:
    """The shard index of each global row id (its high bits)."""
    return np.asarray(ids, np.int64) >> SHIFT


def row_of(ids: Any) -> np.ndarray:
    """The shard-local row id of each global row id (its low bits)."""
    return np.asarray(ids, np.int64) & _ROW


def shard_state(buf: ReplayBuffer) -> dict[str, Any]:
    """What the learner needs of a shard: its rows (``len``), the mass it is drawn by (``total``:
    the priority total, or the rows when uniform), its smallest leaf (``min``) and its counters."""
    prios = buf.priorities
    n = len(buf)
    prioritized = prios is not None and prios.prioritized
    stats = buf.stats
    return {"len": n, "total": prios.tree.total if prioritized else float(n),  # type: ignore[union-attr]
            "min": prios.tree.min if prioritized else 1.0,  # type: ignore[union-attr]
            "inserted": stats["inserted"], "sampled": stats["sampled"]}


def draw_rows(buf: ReplayBuffer, k: int) -> dict[str, Any]:
    """``k`` rows of ``buf`` with their leaves (prioritized) and the state they were drawn from;
    no rows when the buffer has none to give."""
    state = shard_state(buf)
    if k <= 0 or state["total"] <= 0:
        return {"fields": None, "index": None, "leaves": None, **state}
    try:
        batch = buf.sample(k)
    except EmptyBufferError:
        return {"fields": None, "index": None, "leaves": None, **shard_state(buf)}
    prios = buf.priorities
    leaves = buf.priority(batch.index) if prios is not None and prios.prioritized else None
    return {"fields": dict(batch.fields), "index": np.asarray(batch.index), "leaves": leaves, **state}


class _Shard:
    """The body of ``ShardActor``: one ``ReplayBuffer`` in this node's shared memory."""

    def __init__(self, schema: Schema, capacity: int, options: dict[str, Any], source: str | None = None) -> None:
        if source is None:
            self.buf = ReplayBuffer(schema, capacity, **options)
        else:  # a saved shard (ShardedBuffer.load): its rows, ids and priorities
            self.buf = ReplayBuffer.load(source, name=options["name"])
        self.pushes = 0
        try:  # Ray kills this actor's children with it: the janitor removes the block afterwards
            janitor.start(self.buf.name, os.getpid())
        except BaseException:
            self.buf.__exit__(None, None, None)
            raise

    def info(self) -> dict[str, Any]:
        return {"node": ray.get_runtime_context().get_node_id(), "name": self.buf.name, "pid": os.getpid(),
                "options": self.buf.options}

    def push(self, call: dict[str, Any]) -> tuple[str, Any]:
        """Push rows (``call``: the fields and, under ``_lane``, ``_episode``, ``_priority``, push's
        options); a refusal comes back as the exception (raised again by the writer as is)."""
        self.pushes += 1
        fields = {k: v for k, v in call.items() if k[0] != "_"}
        try:
            return "ok", int(self.buf.push(fields, lane=call.get("_lane"), episode=call.get("_episode"),
                                           priority=call.get("_priority")).size)
        except (ShmBufferError, ValueError, TypeError) as e:
            return "error", e

    def sample(self, k: int) -> dict[str, Any]:
        return draw_rows(self.buf, k)

    def state(self) -> dict[str, Any]:
        return shard_state(self.buf)

    def stats(self) -> dict[str, Any]:
        return {**self.buf.stats, "rows": len(self.buf), "pushes": self.pushes}

    def update_priorities(self, ids: np.ndarray, priorities: np.ndarray) -> tuple[str, Any]:
        try:
            return "ok", self.buf.update_priorities(ids, priorities)
        except (ShmBufferError, ValueError) as e:
            return "error", e

    def save(self, path: str) -> dict[str, Any]:
        return self.buf.save(path)

    def close(self) -> None:
        self.buf.__exit__(None, None, None)


ShardActor: Any = ray.remote(num_cpus=0)(_Shard)
"""The shard actor (``num_cpus=0``): create it with ``ShardActor.options(...).remote(schema,
capacity, options)``; ``ShardedBuffer`` does, one per node."""


def unwrap(reply: tuple[str, Any]) -> Any:
    """A shard's ``("ok", value)`` reply as its value; an ``("error", exception)`` reply raised."""
    status, value = reply
    if status == "error":
        raise value
    return value


@dataclass(frozen=True)
class ShardInfo:
    """One shard: its number, node, buffer name and actor name."""

    index: int
    node: str
    name: str
    actor: str
