"""Past one machine: buffer shards on Ray, writers on any node, one learner sampling them all.

::

    ray.init(address="auto")
    with ShardedBuffer(schema, capacity=1_000_000, sampler=Prioritized()) as buf:   # one shard a node
        target = buf.writer()                 # picklable: hand it to a Collector or any process
        ...                                   # writers: target.open().push(...)
        batch = buf.sample(256)               # as if from one buffer of every shard's rows
        buf.update_priorities(batch, td)      # each id goes home to its shard

Shards. A shard is an ordinary ``ReplayBuffer`` created by a ``ShardActor`` (a Ray actor that
reserves no CPU) in the shared memory of its node, one per node by default. Ray is not on a
node's local data path: a process on the shard's node attaches by the buffer's name and pushes
through shared memory as everywhere else in shmbuffer.

Writers. ``ShardedBuffer.writer()`` is a ``WriterTarget``, a small picklable value; its ``open()``
gives a buffer attached to the shard on the caller's node when there is one (the node is the
caller's Ray node, or the one the target was pinned to by ``target.handle`` in a Ray-connected
process, which is what a ``Collector`` reads), else a ``RemoteWriter``: it checks every push as a
local push does (the same ``FieldError``, nothing sent), gathers rows and sends them as numpy
arrays through Ray's object store once ``batch_rows`` are pending, waiting for the previous call
before sending the next (one call in flight bounds the memory). A process that is not a Ray
worker connects to the cluster itself (``address``) on its first remote push.

Sampling. A batch of ``n`` is split over the shards by a multinomial draw over their priority
totals (prioritized) or row counts (uniform); each shard draws its share by its own sampler. A row
is then drawn with probability ``leaf / sum of every shard's leaves``, exactly one buffer's; the
importance weights are one buffer's ``(leaf / min leaf) ** -beta`` with the minimum over every
shard and ``beta`` annealed over this learner's sample calls. Row ids carry their shard in bits
56..62 (``tag``, ``shard_of``, ``row_of``); ``batch.shard`` holds it too.

Prefetch. Remote shards are asked ahead: each keeps ``prefetch`` requests of one batch's rows in
flight; replies are shuffled on arrival (a shard's draw is stratified) and rows are taken from them
as the split asks. Prefetched rows were drawn up to ``prefetch`` batches ago, with the totals of
then (as a ``Loader`` samples ahead). The learner's own node's shard is read through shared memory
at the moment of the sample. ``force_remote=True`` treats every shard as remote (every node of a
one-machine test cluster shares ``/dev/shm``; a testing and benchmarking aid); ``remote_calls``
counts the calls made to shard actors.

Rate limiting. ``limiter=RateLimiter(samples_per_insert, min_size, error)`` on the learner keeps
rows sampled by this learner against rows inserted into all shards (``block_writers`` is refused:
remote writers cannot see the learner's count without a round trip per push).

Faults. A shard whose actor or node dies is dropped: the learner is told once (a ``ShardLost``
warning, and ``lost`` lists it), its prefetched rows are discarded, later batches come from the
rest, and priority updates for its ids are dropped like updates of overwritten rows. Ray kills
an actor's child processes with it (the creator's watchdog of ``_tracker.py`` among them), so
each shard starts a janitor outside Ray's process tree (``setsid -f``) that removes the shard's
block once the actor's process is gone: a killed actor, or a learner that died or exited without
``close`` (Ray then kills the actors it owned), leaves nothing in ``/dev/shm``. A
``RemoteWriter`` whose shard is gone raises ``ShardLostError`` naming it, or with
``failover=True`` writes to the next live shard (the rows of the call in flight when the shard
died are lost with it).

``save(path)`` writes one directory per shard (``shard-<i>``, on that shard's node, via its
actor) and ``manifest.json``, and ``ShardedBuffer.load(path)`` makes the shards again; ``stats`` and ``len`` add up the shards; ``shards()`` lists them as
``shmbuffer ls`` lists a node's buffers (each shard shows in its own node's ``shmbuffer ls`` under
the name ``<token>-s<i>``).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
import warnings
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import ray
from ray.exceptions import GetTimeoutError, RayError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from .batch import Batch
from .buffer import ReplayBuffer
from .errors import EmptyBufferError, FieldError, ShmBufferError, UnknownIdError, WaitTimeout
from .protocol.layout import UNIFORM, Options
from .protocol.priorities import check_priorities
from .sampling.limiter import RateLimiter
from .sampling.samplers import Prioritized, Sampler, sampler_from_json
from .schema import Schema, stack_rows

__all__ = [
    "RemoteWriter", "ShardActor", "ShardLost", "ShardLostError", "ShardedBuffer", "WriterTarget",
    "row_of", "shard_of", "tag",
]

SHIFT = 56
"""Row ids carry their shard in the bits from here up: ``shard << 56 | row id`` (255 shards)."""
MAX_SHARDS = 127
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


# -- the shard: an actor holding an ordinary buffer -------------------------------------------------
def _state(buf: ReplayBuffer) -> dict[str, Any]:
    prios = buf.priorities
    n = len(buf)
    prioritized = prios is not None and prios.prioritized
    stats = buf.stats
    return {"len": n, "total": prios.tree.total if prioritized else float(n),  # type: ignore[union-attr]
            "min": prios.tree.min if prioritized else 1.0,  # type: ignore[union-attr]
            "inserted": stats["inserted"], "sampled": stats["sampled"]}


def _draw(buf: ReplayBuffer, k: int) -> dict[str, Any]:
    """``k`` rows of ``buf`` with their leaves (prioritized) and the state they were drawn from;
    no rows when the buffer has none to give."""
    state = _state(buf)
    if k <= 0 or state["total"] <= 0:
        return {"fields": None, "index": None, "leaves": None, **state}
    try:
        batch = buf.sample(k)
    except EmptyBufferError:
        return {"fields": None, "index": None, "leaves": None, **_state(buf)}
    prios = buf.priorities
    leaves = buf.priority(batch.index) if prios is not None and prios.prioritized else None
    return {"fields": dict(batch.fields), "index": np.asarray(batch.index), "leaves": leaves, **state}


_JANITOR = """
import os, sys, time
from shmbuffer.shm.segment import read_header, remove
name, pid = sys.argv[1], int(sys.argv[2])
while True:
    time.sleep(0.5)
    try:
        os.kill(pid, 0)
        continue
    except ProcessLookupError:
        pass
    except PermissionError:
        continue
    try:
        header = read_header(name)
    except Exception:
        break
    if header.creator_state == "dead":
        remove(name, header.ident)
    break
"""
"""The shard's janitor (``python -c``, outside Ray's process tree): once the actor's process is
gone, it removes the shard's block if its creator is dead. Ray kills an actor's child processes
with it (the creator's watchdog, ``_tracker.py``, among them) when the learner that owns the
actor dies or the actor is killed; the janitor is started through ``setsid -f``, so its parent
has exited and nobody's child is killed with the actor."""


class _Shard:
    """The body of ``ShardActor``: one ``ReplayBuffer`` in this node's shared memory."""

    def __init__(self, schema: Schema, capacity: int, options: dict[str, Any], source: str | None = None) -> None:
        if source is None:
            self.buf = ReplayBuffer(schema, capacity, **options)
        else:  # a saved shard (ShardedBuffer.load): its rows, ids and priorities
            self.buf = ReplayBuffer.load(source, name=options["name"])
        self.pushes = 0
        if shutil.which("setsid") is None:  # util-linux; without it `shmbuffer gc` cleans up after a crash
            return
        try:
            subprocess.run(["setsid", "-f", sys.executable, "-c", _JANITOR, self.buf.name, str(os.getpid())],
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           check=True, timeout=30)
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
        return _draw(self.buf, k)

    def state(self) -> dict[str, Any]:
        return _state(self.buf)

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


def _ok(reply: tuple[str, Any]) -> Any:
    status, value = reply
    if status == "error":
        raise value
    return value


# -- writers -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ShardInfo:
    """One shard: its number, node, buffer name and actor name."""

    index: int
    node: str
    name: str
    actor: str


@dataclass(frozen=True)
class WriterTarget:
    """Where writers push: every shard of a ``ShardedBuffer``; small, plain and picklable.

    :param shards: the shards (``ShardedBuffer.shards``).
    :param schema: their schema; ``options`` their options.
    :param namespace: the Ray namespace of the shard actors; ``address`` the cluster's, for
        processes that are not Ray workers.
    :param node: the node to write from (``handle`` pins it); None: the caller's Ray node.
    :param force_remote: push through Ray even when the shard's memory is on this node (testing
        and benchmarking).
    :param batch_rows: rows a remote writer gathers before one call.
    :param failover: a remote writer whose shard is gone writes to the next live one.
    """

    shards: tuple[ShardInfo, ...]
    schema: Schema
    options: Options
    namespace: str
    address: str
    node: str | None = None
    force_remote: bool = False
    batch_rows: int = 256
    failover: bool = False

    @property
    def lanes(self) -> int:
        """The lanes of each shard (the shards share their options)."""
        return self.options.lanes

    @property
    def handle(self) -> WriterTarget:
        """This target pinned to the caller's node (what a ``Collector`` hands its workers)."""
        if self.node is None and ray.is_initialized():
            return replace(self, node=ray.get_runtime_context().get_node_id())
        return self

    @property
    def stats(self) -> dict[str, int]:
        """The counters of the shard this target writes to from here (``Collector.warm`` reads them)."""
        shard = self.home()
        if self.local(shard):
            with ReplayBuffer.attach(shard.name) as buf:
                return buf.stats
        _connect(self.address, self.namespace)
        return dict(ray.get(ray.get_actor(shard.actor, namespace=self.namespace).stats.remote()))

    def home(self) -> ShardInfo:
        """The shard on this target's node, else the first one."""
        node = self.node
        if node is None and ray.is_initialized():
            node = ray.get_runtime_context().get_node_id()
        for shard in self.shards:
            if shard.node == node:
                return shard
        return self.shards[0]

    def local(self, shard: ShardInfo) -> bool:
        """Whether ``shard`` is on this process's Ray node (and so is written through shared memory), unless
        ``force_remote``."""
        if self.force_remote:
            return False
        node = self.node
        if node is None and ray.is_initialized():
            node = ray.get_runtime_context().get_node_id()
        return node == shard.node

    def open(self, *, seed: int | np.random.Generator | None = None) -> ReplayBuffer | RemoteWriter:
        """A writer: the shard on this node attached through shared memory, else a ``RemoteWriter``."""
        shard = self.home()
        if self.local(shard):
            return ReplayBuffer.attach(shard.name, seed=seed)
        return RemoteWriter(self, shard)


def _connect(address: str, namespace: str) -> None:
    if not ray.is_initialized():
        ray.init(address=address, namespace=namespace, include_dashboard=False, log_to_driver=False)


class RemoteWriter:
    """Pushes to a shard on another node through Ray, in calls of ``batch_rows`` rows (see the
    module docstring). ``flush()`` sends what is pending and waits; ``close()`` flushes.
    ``calls`` counts the push calls sent. Every check a push makes on its rows runs here, before
    anything is queued; what only the shard can refuse (a frozen shard: ``ReadOnlyError``) comes
    back as the shard raised it, from the next push or flush, and that call's rows are not written."""

    def __init__(self, target: WriterTarget, shard: ShardInfo) -> None:
        _connect(target.address, target.namespace)
        self.target = target
        self.shard = shard
        self.schema = target.schema
        self.options = target.options
        self.lanes = target.options.lanes
        self.calls = 0
        self._pending: list[tuple[dict[str, np.ndarray], np.ndarray, np.ndarray | None, np.ndarray | None]] = []
        self._rows = 0
        self._inflight: Any = None
        self._closed = False
        try:
            self._actor = ray.get_actor(shard.actor, namespace=target.namespace)
        except ValueError as e:  # Ray's answer for a named actor that died
            self._lost(e)

    def push(self, data: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None, /, *, lane: Any = None,
             episode: Any = None, priority: Any = None, timeout: float | None = None, **fields: Any) -> int:
        """Check rows as ``ReplayBuffer.push`` does and queue them; send once ``batch_rows`` are
        pending. Returns how many rows were queued (ids are the shard's, not known yet).
        ``timeout`` is accepted for the ``Collector`` and ignored."""
        if self._closed:
            raise ShardLostError(f"this writer to shard {self.shard.index} is closed")
        if data is not None:
            if fields:
                raise TypeError("push() takes a mapping or keyword fields, not both")
            fields = dict(data) if isinstance(data, Mapping) else stack_rows(data, self.schema)
        if priority is None and "priority" in fields and "priority" not in self.schema:
            priority = fields.pop("priority")
        k, arrays = self.schema.validate(fields)
        arrays = {name: np.asarray(a, dtype=self.schema[name].dtype) for name, a in arrays.items()}
        lanes = self._lanes(k, lane)
        episodes = None
        if self.options.episodes:
            if episode is None:
                raise FieldError("push: this buffer keeps episodes (episodes=True): give episode= (one id, or one per row)")
            episodes = np.broadcast_to(np.asarray(episode, np.int64), (k,)).copy()
        if priority is not None and not isinstance(self.options.sampler, Prioritized):
            raise FieldError("priority: this buffer samples uniformly; create it with sampler=Prioritized(...)")
        prios = None if priority is None else check_priorities(priority, k, "push: priority")
        if self._pending and (prios is None) != (self._pending[-1][3] is None):
            self.flush(wait=False)
        self._pending.append((arrays, lanes, episodes, prios))
        self._rows += k
        if self._rows >= self.target.batch_rows:
            self.flush(wait=False)  # sent now: Ray copies the arrays into its object store
        else:  # kept: the caller may reuse its arrays
            self._pending[-1] = ({name: a.copy() for name, a in arrays.items()}, lanes, episodes, prios)
        return k

    def _lanes(self, k: int, lane: Any) -> np.ndarray:
        lanes = self.lanes
        if lane is None:
            if lanes == 1:
                return np.zeros(k, np.int64)
            envs = self.options.envs
            if envs is None:
                raise FieldError(f"push: the buffer has {lanes} lanes; give lane= (one, or one per row)")
            if k % envs:
                raise FieldError(f"push: {k} rows into a buffer made with envs={envs}: push a multiple of {envs} rows")
            return np.arange(k, dtype=np.int64) % envs
        a = np.broadcast_to(np.asarray(lane), (k,))
        if a.dtype.kind not in "iu" or a.min() < 0 or a.max() >= lanes:
            raise FieldError(f"push: lane must be integers in [0, {lanes}), got {np.asarray(lane).tolist()!r}")
        return a.astype(np.int64)

    def flush(self, *, wait: bool = True) -> None:
        """Send the pending rows (after the previous call came back); ``wait``: and wait for them."""
        if self._pending:
            parts = self._pending
            fields = (parts[0][0] if len(parts) == 1
                      else {name: np.concatenate([p[0][name] for p in parts]) for name in self.schema.names})
            lanes = np.concatenate([p[1] for p in parts])
            episodes = None if parts[0][2] is None else np.concatenate([p[2] for p in parts])
            prios = None if parts[0][3] is None else np.concatenate([p[3] for p in parts])
            self._settle()
            self._pending, self._rows = [], 0
            call: dict[str, Any] = dict(fields)  # one argument: Ray serializes each argument apart
            if self.lanes > 1:
                call["_lane"] = lanes
            if episodes is not None:
                call["_episode"] = episodes
            if prios is not None:
                call["_priority"] = prios
            self._send(call)
        if wait:
            self._settle()

    def _send(self, call: dict[str, Any]) -> None:
        self.calls += 1
        self._inflight = (self._actor.push.remote(call), call)

    def _settle(self) -> None:
        """Wait for the call in flight; on a dead shard fail over (resend it) or raise."""
        while self._inflight is not None:
            ref, call = self._inflight
            try:
                reply = ray.get(ref)
            except RayTaskError:
                raise
            except RayError as e:
                self._lost(e)
                self._send(call)
                continue
            self._inflight = None
            _ok(reply)

    def _lost(self, error: BaseException) -> None:
        gone = self.shard
        others = [s for s in self.target.shards if s.index != gone.index]
        if self.target.failover:
            for shard in others:
                try:
                    actor = ray.get_actor(shard.actor, namespace=self.target.namespace)
                    ray.get(actor.state.remote(), timeout=30)
                except (RayError, ValueError):
                    continue
                self.shard, self._actor = shard, actor
                self.target = replace(self.target, shards=tuple(others))
                return
        self._closed = True
        self._inflight = None
        raise ShardLostError(
            f"shard {gone.index} ({gone.name!r} on node {gone.node[:12]}) is gone ({type(error).__name__}); "
            f"rows pushed to it since the last flush are lost. Write to another shard: open the target again, "
            f"or make it with failover=True (ShardedBuffer.writer(failover=True))") from error

    def close(self) -> None:
        """Send what is pending and wait for it. Idempotent."""
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True

    def __enter__(self) -> RemoteWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- the learner ---------------------------------------------------------------------------------
@dataclass
class _Remote:
    """A remote shard as the learner sees it: the actor, requests in flight, rows received."""

    actor: Any
    inflight: deque[Any] = field(default_factory=deque)
    chunks: deque[dict[str, Any]] = field(default_factory=deque)


class ShardedBuffer:
    """Shards of one buffer on several Ray nodes, sampled as one (see the module docstring).

    :param schema: the fields, as for ``ReplayBuffer``.
    :param capacity: rows held by each shard.
    :param nodes: Ray node ids to put a shard on, one each (default: every alive node).
    :param sampler: ``Uniform()`` or ``Prioritized(...)``, for every shard and across them.
    :param prefetch: requests kept in flight to each remote shard (0: a round trip per batch).
    :param limiter: a ``RateLimiter`` over the whole system (samples by this learner per row
        inserted into any shard).
    :param force_remote: read every shard through Ray, even the one on this node (testing and
        benchmarking: nodes on one machine share ``/dev/shm``).
    :param seed: seeds the split over shards and the shuffling of prefetched rows.
    :param timeout: seconds to wait for the shards to start.
    :param sources: a saved shard's directory per node (``load`` gives them): the shards hold its
        rows, ids and priorities instead of starting empty.
    :param options: more ``ReplayBuffer`` options for each shard (``lanes``, ``envs``,
        ``episodes``, ``max_use``).
    """

    _closed = True
    _actors: list[Any] = []  # noqa: RUF012  (a class default so close() works after a failed __init__)

    def __init__(
        self, schema: Schema | Mapping[str, Any], capacity: int, *, nodes: Sequence[str] | None = None,
        sampler: Sampler = UNIFORM, prefetch: int = 2, limiter: RateLimiter | None = None,
        force_remote: bool = False, seed: int | None = None, timeout: float = 120.0,
        sources: Sequence[str] | None = None, **options: Any,
    ) -> None:
        if not ray.is_initialized():
            raise RuntimeError("ShardedBuffer: connect to a Ray cluster first (ray.init(address=...))")
        schema = schema if isinstance(schema, Schema) else Schema(schema)
        if nodes is None:
            nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        nodes = list(nodes)
        if sources is not None and len(sources) != len(nodes):
            raise ValueError(f"ShardedBuffer: {len(sources)} sources for {len(nodes)} nodes; give one per node")
        if not 1 <= len(nodes) <= MAX_SHARDS:
            raise ValueError(f"ShardedBuffer: expected 1 to {MAX_SHARDS} nodes, got {len(nodes)}")
        if limiter is not None and limiter.block_writers:
            raise ValueError("ShardedBuffer: limiter=RateLimiter(block_writers=True) is not supported across "
                             "shards; the learner's side holds the ratio (block_writers=False)")
        if prefetch < 0:
            raise ValueError(f"ShardedBuffer: prefetch must be >= 0, got {prefetch!r}")
        self.schema, self.sampler, self.prefetch, self.limiter = schema, sampler, prefetch, limiter
        self.rng = np.random.default_rng(seed)
        self.token = f"sb{os.getpid()}-{secrets.token_hex(3)}"
        self.namespace = ray.get_runtime_context().namespace
        self.address = ray.get_runtime_context().gcs_address
        self.force_remote = force_remote
        self.remote_calls = 0
        self.lost: list[int] = []
        self._calls = 0
        self._sampled = 0
        self._chunk = 1
        self._closed = False
        self._actors = []
        self._local: ReplayBuffer | None = None
        self._local_index = -1
        self._remote: dict[int, _Remote] = {}
        self._state: dict[int, dict[str, Any]] = {}
        opts = {"sampler": sampler, **options}
        try:
            for i, node in enumerate(nodes):
                name = f"{self.token}-s{i}"
                self._actors.append(ShardActor.options(
                    name=name, namespace=self.namespace, num_cpus=0, max_restarts=0,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                ).remote(schema, capacity, {**opts, "name": name}, None if sources is None else str(sources[i])))
            infos = ray.get([a.info.remote() for a in self._actors], timeout=timeout)
            self.shards = tuple(ShardInfo(i, info["node"], info["name"], f"{self.token}-s{i}")
                                for i, info in enumerate(infos))
            self.options: Options = infos[0]["options"]
            here = ray.get_runtime_context().get_node_id()
            for shard, actor in zip(self.shards, self._actors, strict=True):
                if shard.node == here and not force_remote and self._local is None:
                    self._local = ReplayBuffer.attach(shard.name)
                    self._local_index = shard.index
                else:
                    self._remote[shard.index] = _Remote(actor)
            for i, rem in self._remote.items():
                self._state[i] = ray.get(rem.actor.state.remote(), timeout=timeout)
                self.remote_calls += 1
        except BaseException:
            self.close()
            raise

    # -- writers ---------------------------------------------------------------------------
    def writer(self, *, force_remote: bool | None = None, batch_rows: int = 256, failover: bool = False,
               node: str | None = None) -> WriterTarget:
        """A ``WriterTarget`` for writers anywhere (``force_remote`` defaults to the buffer's)."""
        return WriterTarget(self.shards, self.schema, self.options, self.namespace, self.address, node,
                            self.force_remote if force_remote is None else force_remote, batch_rows, failover)

    # -- the state of every shard ----------------------------------------------------------
    @property
    def alive(self) -> list[int]:
        """The indices of the shards not lost."""
        return [s.index for s in self.shards if s.index not in self.lost]

    def _drop(self, i: int, error: BaseException) -> None:
        if i in self.lost:
            return
        self.lost.append(i)
        self._remote.pop(i, None)
        self._state.pop(i, None)
        shard = self.shards[i]
        warnings.warn(ShardLost(f"shard {i} ({shard.name!r} on node {shard.node[:12]}) is gone "
                                f"({type(error).__name__}); sampling goes on from shards {self.alive}"), stacklevel=3)

    def _states(self) -> dict[int, dict[str, Any]]:
        """The latest known state of each live shard (the local one read now)."""
        out = dict(self._state)
        if self._local is not None:
            out[self._local_index] = _state(self._local)
        return out

    def refresh(self, timeout: float = 60.0) -> dict[int, dict[str, Any]]:
        """Ask every remote shard for its state now (one round trip, all at once)."""
        refs = {i: rem.actor.state.remote() for i, rem in self._remote.items()}
        self.remote_calls += len(refs)
        for i, ref in refs.items():
            try:
                self._state[i] = ray.get(ref, timeout=timeout)
            except GetTimeoutError:
                continue
            except RayError as e:
                self._drop(i, e)
        return self._states()

    def __len__(self) -> int:
        return sum(s["len"] for s in self.refresh().values())

    @property
    def stats(self) -> dict[str, Any]:
        """Counters summed over the live shards, per shard (with ``pushes``, the push calls its
        actor served), the learner's own, and ``lost``. A round trip to every shard."""
        per: dict[int, dict[str, Any]] = {}
        refs = {i: self._actors[i].stats.remote() for i in self.alive}  # the local one too: its push calls
        self.remote_calls += len(refs)
        for i, ref in refs.items():
            try:
                per[i] = ray.get(ref, timeout=60)
            except RayError as e:
                self._drop(i, e)
        keys = ("inserted", "sampled", "reclaimed", "lock_recoveries", "rows")
        total = {k: sum(int(s[k]) for s in per.values()) for k in keys}
        return {**total, "learner_sampled": self._sampled, "remote_calls": self.remote_calls,
                "lost": list(self.lost), "shards": {i: per[i] for i in sorted(per)}}

    def ls(self) -> list[dict[str, Any]]:
        """Each shard as a row: number, node, buffer name, rows, inserted, alive (``shmbuffer ls``)."""
        st = self.stats["shards"]
        return [{"shard": s.index, "node": s.node, "name": s.name, "alive": s.index in st,
                 "rows": st[s.index]["rows"] if s.index in st else None,
                 "inserted": st[s.index]["inserted"] if s.index in st else None} for s in self.shards]

    # -- sampling --------------------------------------------------------------------------
    def _mass(self, state: dict[str, Any]) -> float:
        return float(state["total"]) if isinstance(self.sampler, Prioritized) else float(state["len"])

    def _wait_limiter(self, n: int, timeout: float | None) -> None:
        limiter = self.limiter
        if limiter is None:
            return

        def ready(states: dict[int, dict[str, Any]]) -> bool:
            inserted = sum(s["inserted"] for s in states.values())
            size = sum(s["len"] for s in states.values())
            return limiter.can_sample(inserted, self._sampled, size, n)

        if ready(self._states()):
            return
        limit = limiter.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        while not ready(self.refresh()):
            if time.monotonic() > deadline:
                states = self._states()
                raise WaitTimeout(
                    f"sample of {n} rows waited {limit:g} s for the rate limiter: "
                    f"{sum(s['inserted'] for s in states.values())} rows inserted into {len(states)} shards, "
                    f"{self._sampled} sampled, samples_per_insert={limiter.samples_per_insert}, "
                    f"min_size={limiter.min_size}")
            time.sleep(0.01)

    def _ask(self, i: int, k: int) -> None:
        rem = self._remote[i]
        rem.inflight.append(rem.actor.sample.remote(k))
        self.remote_calls += 1

    def _receive(self, i: int, reply: dict[str, Any]) -> None:
        rem = self._remote[i]
        self._state[i] = {k: reply[k] for k in ("len", "total", "min", "inserted", "sampled")}
        if reply["index"] is None or not len(reply["index"]):
            return
        order = self.rng.permutation(len(reply["index"]))  # a shard's draw is stratified: any prefix is fair
        rem.chunks.append({"fields": {k: v[order] for k, v in reply["fields"].items()},
                           "index": reply["index"][order],
                           "leaves": None if reply["leaves"] is None else reply["leaves"][order], "at": 0})

    def _take(self, i: int, k: int) -> list[dict[str, Any]]:
        """Up to ``k`` prefetched rows of remote shard ``i`` (fewer when it has none to give)."""
        rem = self._remote[i]
        out: list[dict[str, Any]] = []
        while k > 0:
            if not rem.chunks:
                if not rem.inflight:
                    return out
                reply = ray.get(rem.inflight.popleft())
                self._receive(i, reply)
                self._ask(i, self._chunk)
                if reply["index"] is None:
                    return out
                continue
            c = rem.chunks[0]
            a, b = c["at"], min(c["at"] + k, len(c["index"]))
            out.append({"fields": {f: v[a:b] for f, v in c["fields"].items()}, "index": c["index"][a:b],
                        "leaves": None if c["leaves"] is None else c["leaves"][a:b]})
            k -= b - a
            c["at"] = b
            if b == len(c["index"]):
                rem.chunks.popleft()
        return out

    def _poll(self) -> None:
        """Take in the prefetched replies that have come (their states are newer); a remote shard
        that looked empty is asked now (its reply waited for), so rows pushed since are seen."""
        for i in list(self._remote):
            rem = self._remote[i]
            try:
                if self._mass(self._state[i]) <= 0:
                    if rem.inflight:
                        self._receive(i, ray.get(rem.inflight.popleft()))
                        self._ask(i, self._chunk)
                    else:
                        self.remote_calls += 1
                        self._state[i] = ray.get(rem.actor.state.remote())
                if rem.inflight:
                    ready, _ = ray.wait(list(rem.inflight), num_returns=len(rem.inflight), timeout=0)
                    while rem.inflight and rem.inflight[0] in ready:
                        self._receive(i, ray.get(rem.inflight.popleft()))
                        self._ask(i, self._chunk)
            except RayError as e:
                self._drop(i, e)

    def sample(self, n: int, *, timeout: float | None = None) -> Batch:
        """``n`` rows drawn as one buffer of every shard's rows would draw them (the module
        docstring). ``batch.index`` are global ids (``shard_of``), ``batch.shard`` the shards;
        prioritized batches have ``weight``. ``EmptyBufferError`` when no shard has rows."""
        if (type(n) is not int and not isinstance(n, np.integer)) or n <= 0:
            raise ValueError(f"sample: expected a positive number of rows, got {n!r}")
        n = int(n)
        self._wait_limiter(n, timeout)
        self._chunk = n
        if self.prefetch:
            for i, rem in self._remote.items():
                while len(rem.inflight) < self.prefetch:
                    self._ask(i, n)
        self._poll()
        parts: list[tuple[int, dict[str, Any]]] = []
        want = n
        rounds = 0
        states: dict[int, dict[str, Any]] = {}
        while want > 0:
            states = self._states()
            idx = list(states)
            mass = np.array([self._mass(states[i]) for i in idx])
            if mass.sum() <= 0 and self._remote:  # remote states may be stale: ask once more
                states = self.refresh()
                idx = list(states)
                mass = np.array([self._mass(states[i]) for i in idx])
            if mass.sum() <= 0 or rounds > 1000:
                raise EmptyBufferError(f"sample({n}): no shard holds a row that can be drawn "
                                       f"(shards {self.alive}, lost {self.lost}); push rows first")
            counts = self.rng.multinomial(want, mass / mass.sum())
            want = 0
            direct = {}
            for i, c in zip(idx, counts, strict=True):
                if not c:
                    continue
                if i == self._local_index and self._local is not None:
                    got = _draw(self._local, int(c))
                    if got["index"] is not None:
                        parts.append((i, got))
                        want += int(c) - len(got["index"])
                    else:
                        want += int(c)
                elif not self.prefetch:
                    direct[i] = (self._remote[i].actor.sample.remote(int(c)), int(c))
                    self.remote_calls += 1
                else:
                    try:
                        got_parts = self._take(i, int(c))
                    except RayError as e:
                        self._drop(i, e)
                        want += int(c)
                        continue
                    parts.extend((i, p) for p in got_parts)
                    want += int(c) - sum(len(p["index"]) for p in got_parts)
            for i, (ref, c) in direct.items():
                try:
                    reply = ray.get(ref)
                except RayError as e:
                    self._drop(i, e)
                    want += c
                    continue
                self._state[i] = {k: reply[k] for k in ("len", "total", "min", "inserted", "sampled")}
                if reply["index"] is not None:
                    parts.append((i, reply))
                    want += c - len(reply["index"])
                else:
                    want += c
            rounds += 1
        self._calls += 1
        self._sampled += n
        return self._join(parts, states)

    def _join(self, parts: list[tuple[int, dict[str, Any]]], states: dict[int, dict[str, Any]]) -> Batch:
        fields = {name: np.concatenate([p["fields"][name] for _, p in parts]) for name in self.schema.names}
        index = np.concatenate([tag(i, p["index"]) for i, p in parts])
        shard = np.concatenate([np.full(len(p["index"]), i, np.int16) for i, p in parts])
        extras: dict[str, Any] = {"index": index, "shard": shard}
        sampler = self.sampler
        if isinstance(sampler, Prioritized):
            leaves = np.concatenate([p["leaves"] for _, p in parts])
            mins = [s["min"] for s in states.values() if s["len"] and np.isfinite(s["min"]) and s["min"] > 0]
            low = min(mins) if mins else float("inf")
            beta = sampler.beta_at(self._calls - 1)
            if not np.isfinite(low) or low <= 0:
                extras["weight"] = np.ones(leaves.shape[0], np.float32)
            else:
                with np.errstate(over="ignore"):
                    extras["weight"] = np.power(np.maximum(leaves, low) / low, -beta).astype(np.float32)
        return Batch(fields, extras)

    def update_priorities(self, rows: Batch | Any, priorities: Any) -> int:
        """Send each row's priority to its shard; returns how many rows were updated. Rows
        overwritten since, and rows of lost shards, are skipped. Priorities, and ids that name no
        shard, are checked before any shard is touched (``FieldError``, ``UnknownIdError``); ids a
        shard never had raise ``UnknownIdError`` from that shard, which then changed nothing, but
        the other shards of the call may have been updated (a check would cost a round trip)."""
        ids = rows.index if isinstance(rows, Batch) else rows
        if hasattr(ids, "detach"):
            ids = ids.detach().cpu().numpy()
        ids = np.asarray(ids).reshape(-1)
        if ids.size and ids.dtype.kind not in "iu":
            raise FieldError(f"update_priorities: expected integer row ids (batch.index), got dtype {ids.dtype}")
        ids = ids.astype(np.int64)
        p = check_priorities(priorities, ids.size, "update_priorities: priority")
        shard = shard_of(ids)
        bad = (ids < 0) | (shard >= len(self.shards))
        if bad.any():
            raise UnknownIdError(
                f"update_priorities: ids {ids[bad][:5].tolist()} name no shard of this buffer (shards 0 to "
                f"{len(self.shards) - 1} in bits {SHIFT}+): pass batch.index as it came; nothing was changed")
        done = 0
        refs = {}
        for i in np.unique(shard).tolist():
            mine = shard == i
            local_ids, local_p = row_of(ids[mine]), p[mine]
            if i == self._local_index and self._local is not None:
                done += self._local.update_priorities(local_ids, local_p)
            elif i in self._remote:
                refs[i] = self._remote[i].actor.update_priorities.remote(local_ids, local_p)
                self.remote_calls += 1
        for i, ref in refs.items():
            try:
                reply = ray.get(ref)
            except RayError as e:
                self._drop(i, e)
                continue
            done += _ok(reply)
        return done

    # -- persistence and lifecycle -----------------------------------------------------------
    def save(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        """One directory per live shard (``shard-<i>``, written by its actor on its node) and
        ``manifest.json`` naming them; returns the manifest."""
        root = Path(path)
        root.mkdir(parents=True, exist_ok=False)
        refs = {}
        for shard in self.shards:
            if shard.index in self.lost:
                continue
            refs[shard.index] = self._actors[shard.index].save.remote(str(root / f"shard-{shard.index}"))
        self.remote_calls += len(refs)
        saved = []
        for i, ref in refs.items():
            try:
                meta = ray.get(ref)
            except RayError as e:
                self._drop(i, e)
                continue
            saved.append({"shard": i, "node": self.shards[i].node, "dir": f"shard-{i}",
                          "rows": int(meta.get("rows", -1)) if isinstance(meta, dict) else -1})
        manifest = {"format": "shmbuffer-shards", "version": 1, "schema": self.schema.to_json(),
                    "sampler": self.sampler.to_json(), "shards": saved, "lost": list(self.lost)}
        (root / "manifest.json").write_text(json.dumps(manifest, indent=1))
        return manifest

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, nodes: Sequence[str] | None = None, **kwargs: Any) -> ShardedBuffer:
        """Shards holding a ``save``: shard ``i`` is loaded on the node that saved it (or on
        ``nodes[i]``) from ``<path>/shard-<i>``, which must be on that node's filesystem; ids keep
        their shard. ``kwargs``: the constructor's (``prefetch``, ``limiter``, ``seed`` ...)."""
        root = Path(path)
        manifest = json.loads((root / "manifest.json").read_text())
        if manifest.get("format") != "shmbuffer-shards" or manifest.get("version") != 1:
            raise ValueError(f"{root / 'manifest.json'}: expected format 'shmbuffer-shards' version 1, got "
                             f"{manifest.get('format')!r} version {manifest.get('version')!r}")
        saved = sorted(manifest["shards"], key=lambda m: m["shard"])
        if [m["shard"] for m in saved] != list(range(len(saved))):
            raise ValueError(f"{root}: the save holds shards {[m['shard'] for m in saved]} (shard(s) "
                             f"{manifest.get('lost')} were lost before it); ids name their shard by number, "
                             "so load needs every shard from 0")
        if nodes is None:
            alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
            gone = [m["shard"] for m in saved if m["node"] not in alive]
            if gone:
                raise ValueError(f"load: the nodes that saved shard(s) {gone} are not in the cluster; "
                                 "give nodes=[...], one per shard, each holding its shard-<i> directory")
            nodes = [m["node"] for m in saved]
        return cls(Schema.from_json(manifest["schema"]), 1, nodes=nodes,
                   sampler=sampler_from_json(manifest["sampler"]),
                   sources=[str(root / m["dir"]) for m in saved], **kwargs)

    @property
    def closed(self) -> bool:
        """Whether ``close()`` has been called."""
        return self._closed

    def close(self, timeout: float = 30.0) -> None:
        """Close the local view, remove every shard (its block and its actor). Idempotent."""
        if self._closed and not self._actors:
            return
        self._closed = True
        if self._local is not None:
            try:
                self._local.close()
            except BufferError:
                pass
            self._local = None
        refs = []
        for i, actor in enumerate(self._actors):
            if i not in self.lost:
                try:
                    refs.append(actor.close.remote())
                except RayError:
                    pass
        if refs:
            try:
                ray.wait(refs, num_returns=len(refs), timeout=timeout)
            except RayError:
                pass
        for actor in self._actors:
            try:
                ray.kill(actor)
            except (RayError, ValueError):
                pass
        self._actors = []
        self._remote.clear()

    def __enter__(self) -> ShardedBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self.shards)} shards, lost {self.lost}"
        return f"ShardedBuffer({self.token!r}, {state}, {self.schema})"
