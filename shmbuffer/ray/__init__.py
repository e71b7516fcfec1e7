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
importance weights are one buffer's ``(leaf / min leaf) ** -beta`` (``samplers.importance_weights``)
with the minimum over every shard and ``beta`` annealed over this learner's sample calls. Row ids
carry their shard in bits 56..62 (``tag``, ``shard_of``, ``row_of``; at most ``MAX_SHARDS``, 127,
shards); ``batch.shard`` holds it too.

Prefetch. Remote shards are asked ahead: each keeps ``prefetch`` requests of one batch's rows in
flight; replies are shuffled on arrival (a shard's draw is stratified) and rows are taken from them
as the split asks. Prefetched rows were drawn up to ``prefetch`` batches ago, with the totals of
then (as a ``Loader`` samples ahead). The learner's own node's shard is read through shared memory
at the moment of the sample. ``force_remote=True`` treats every shard as remote (every node of a
one-machine test cluster shares ``/dev/shm``; a testing and benchmarking aid); ``remote_calls``
counts the calls made to shard actors.

Rate limiting. ``limiter=RateLimiter(samples_per_insert, min_size, error)`` on the learner keeps
rows sampled by this learner against rows inserted into all shards, waiting as the limiter waits
(``RateLimiter.wait``, asking the shards for their counters each try; ``block_writers`` is refused:
remote writers cannot see the learner's count without a round trip per push).

Faults. A shard whose actor or node dies is dropped: the learner is told once (a ``ShardLost``
warning, and ``lost`` lists it), its prefetched rows are discarded, later batches come from the
rest, and priority updates for its ids are dropped like updates of overwritten rows. Ray kills
an actor's child processes with it (the creator's watchdog of ``_tracker.py`` among them), so
each shard starts a janitor outside Ray's process tree (``shmbuffer.shm.janitor``, through
``setsid -f``) that removes the shard's block once the actor's process is gone: a killed actor,
or a learner that died or exited without ``close`` (Ray then kills the actors it owned), leaves
nothing in ``/dev/shm``. A ``RemoteWriter`` whose shard is gone raises ``ShardLostError`` naming it, or with
``failover=True`` writes to the next live shard (the rows of the call in flight when the shard
died are lost with it).

``save(path)`` writes one directory per shard (``shard-<i>``, on that shard's node, via its
actor) and ``manifest.json``, and ``ShardedBuffer.load(path)`` makes the shards again; ``stats`` and
``len`` add up the shards; ``ls()`` lists them as ``shmbuffer ls`` lists a node's buffers (each
shard shows in its own node's ``shmbuffer ls`` under the name ``<token>-s<i>``).

The modules: ``shard`` (the actor and the global ids), ``writer`` (``WriterTarget``,
``RemoteWriter``), ``sharded`` (``ShardedBuffer``). This package is the only part of shmbuffer
that imports Ray.
"""

from __future__ import annotations

from .shard import MAX_SHARDS, SHIFT, ShardActor, ShardInfo, ShardLost, ShardLostError, row_of, shard_of, tag
from .sharded import ShardedBuffer
from .writer import RemoteWriter, WriterTarget

__all__ = [
    "MAX_SHARDS", "SHIFT", "RemoteWriter", "ShardActor", "ShardInfo", "ShardLost", "ShardLostError", "ShardedBuffer",
    "WriterTarget", "row_of", "shard_of", "tag",
]
