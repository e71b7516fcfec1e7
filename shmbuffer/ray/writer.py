"""Writers of a ``ShardedBuffer``: ``WriterTarget``, a small picklable value whose ``open()`` gives
a buffer attached to the shard on the caller's node (shared memory, as everywhere in shmbuffer),
else a ``RemoteWriter`` that checks rows as a local push does and sends them to a shard through Ray
in calls of ``batch_rows`` rows (``shmbuffer.ray`` says more).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import ray
from ray.exceptions import RayError, RayTaskError

from ..buffer import ReplayBuffer
from ..protocol.layout import Options
from ..protocol.push import normalise
from ..schema import Schema
from .shard import ShardInfo, ShardLostError, unwrap

__all__ = ["RemoteWriter", "WriterTarget", "connect"]


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
        connect(self.address, self.namespace)
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


def connect(address: str, namespace: str) -> None:
    """Connect this process to the Ray cluster at ``address`` unless it is connected already."""
    if not ray.is_initialized():
        ray.init(address=address, namespace=namespace, include_dashboard=False, log_to_driver=False)


class RemoteWriter:
    """Pushes to a shard on another node through Ray, in calls of ``batch_rows`` rows (see
    ``shmbuffer.ray``). ``flush()`` sends what is pending and waits; ``close()`` flushes.
    ``calls`` counts the push calls sent. Every check a push makes on its rows runs here, before
    anything is queued; what only the shard can refuse (a frozen shard: ``ReadOnlyError``) comes
    back as the shard raised it, from the next push or flush, and that call's rows are not written."""

    def __init__(self, target: WriterTarget, shard: ShardInfo) -> None:
        connect(target.address, target.namespace)
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
        # the local push's rules (protocol.push.normalise: fields, lanes, episodes, priorities)
        k, arrays, lane, episodes, prios, _ = normalise(self.schema, self.options, data, lane=lane, episode=episode,
                                                        priority=priority, fields=fields)
        arrays = {name: np.asarray(a, dtype=self.schema[name].dtype) for name, a in arrays.items()}
        lanes = np.broadcast_to(np.asarray(lane, np.int64), (k,)).copy()
        if episodes is not None:
            episodes = np.broadcast_to(episodes, (k,)).copy()
        if self._pending and (prios is None) != (self._pending[-1][3] is None):
            self.flush(wait=False)
        self._pending.append((arrays, lanes, episodes, prios))
        self._rows += k
        if self._rows >= self.target.batch_rows:
            self.flush(wait=False)  # sent now: Ray copies the arrays into its object store
        else:  # kept: the caller may reuse its arrays
            self._pending[-1] = ({name: a.copy() for name, a in arrays.items()}, lanes, episodes, prios)
        return k

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
            unwrap(reply)

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
