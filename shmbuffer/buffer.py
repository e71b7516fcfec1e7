"""The replay buffer: fields in shared memory, pushed to by any process, sampled by the learner.

::

    buf = ReplayBuffer(Schema(obs=((4,), "float32"), reward=((), "float32")), capacity=100_000)
    buf.push(obs=o, reward=r)                  # one row, or k rows with a leading dimension
    batch = buf.sample(256)                    # batch.obs, batch["obs"], batch.index
    other = ReplayBuffer.attach(buf.handle)    # in any process

The block, its handle and its lifecycle (``attach``, ``close``, ``unlink``, ``with``) are
``MappedBlock``'s (``mapped.py``), which ``ReplayBuffer`` extends. A buffer pickles as its handle:
a spawned worker attaches a ``ReplayBuffer``.

``sample`` and ``get`` return stamped copies (never a torn row); ``view`` and ``column`` return
zero-copy, read-only views of live memory. Each method hands its call to the module that does it
(``protocol/``, ``sample_paths.py``, ``sequences.py``, ``views.py``, ``persistence/``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from types import ModuleType
from typing import Any

import numpy as np

from . import arguments, hints, persistence, sequences, views
from . import hindsight as her
from .batch import Batch
from .errors import FieldError, closed
from .loader import Loader
from .mapped import BufferHandle, MappedBlock
from .protocol import edits, push, reader
from .protocol.frames_push import Pusher
from .protocol.layout import UNIFORM, Options
from .protocol.priorities import Priorities
from .protocol.push import Copier
from .sample_paths import SamplePaths, generator_from_state, generator_state
from .sampling.limiter import RateLimiter
from .sampling.ranks import Rank
from .sampling.samplers import Sampler
from .schema import Schema, as_schema
from .shm.segment import Segment

__all__ = ["BufferHandle", "Options", "ReplayBuffer"]


class ReplayBuffer(MappedBlock):
    """A fixed-schema ring of rows in one shared-memory block (see the module docstring).

    :param schema: the fields: a ``Schema`` or a cpprb ``env_dict``.
    :param capacity: rows held in all; the oldest are overwritten first.
    :param sampler: ``Uniform()`` (default) or ``Prioritized(alpha, beta, beta_steps, eps)``.
    :param max_use: a row leaves the sampling set once drawn this many times (default: never).
    :param lanes: equal parts of the ring, each keeping its writer's steps consecutive (sequences,
        n-step returns); with several, every push names its lanes (``lane=``) unless ``envs`` is given.
    :param envs: one lane per env of a vector env (sets ``lanes``): a push of ``k`` rows without
        ``lane=`` is ``k / envs`` steps of every env, env-major; row ``i`` goes to lane ``i % envs``.
    :param episodes: every push names the episode of its rows (``push(..., episode=id)``);
        sequences, n-step returns, groups and whole episodes need it.
    :param limiter: a ``RateLimiter`` holding samples per insert in a window, for every process.
    :param next_of: store a next observation once (cpprb's ``next_of``, SB3's
        ``optimize_memory_usage``): ``"obs"`` reads a row's ``next_obs`` from the ``obs`` of the next
        row of its lane (``{"next_obs": "obs"}`` names both). Each env pushes its steps in order into
        its own lane, the last marked by ``done``/``terminated``/``truncated`` (``frames.py``).
    :param stack: store one frame of a stacked observation a row (cpprb's ``stack_compress``):
        ``"obs"``, ``{"obs": k}`` or ``{"obs": (k, axis)}``; reads rebuild the stacks.
    :param name: the block's name in ``/dev/shm`` (default: the pid and a random token).
    :param seed: seeds this process's sampling (an int or a ``numpy.random.Generator``).
    """

    _paths: SamplePaths | None = None
    ranked: Rank | None = None
    """This process's rank of several learners (``attach(..., rank=, world_size=, seed=)``, see
    ``sampling/ranks.py``): its sample calls draw their part of one global batch; ``None``: alone.
    ``ranked.step`` counts its sample calls (set it to resume a run's draws)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> ReplayBuffer:
        error = hints.constructor_error(args, kwargs)  # cpprb's, SB3's, TorchRL's forms: name ours
        if error is not None:
            raise error
        return super().__new__(cls)

    def __init__(
        self, schema: Schema | Mapping[str, Any], capacity: int, *, sampler: Sampler = UNIFORM,
        max_use: int | None = None, lanes: int | None = None, episodes: bool = False,
        limiter: RateLimiter | None = None, name: str | None = None, seed: int | np.random.Generator | None = None,
        envs: int | None = None, next_of: str | Mapping[str, str] | None = None,
        stack: str | Mapping[str, Any] | None = None, **unknown: Any,
    ) -> None:
        if unknown:  # another library's keyword (SB3's device, cpprb's Nstep ...): name ours
            raise hints.keyword_error("ReplayBuffer", unknown)
        schema = as_schema(schema)
        opts = Options.make(schema, capacity, sampler=sampler, max_use=max_use, lanes=lanes, envs=envs,
                            episodes=episodes, limiter=limiter, next_of=next_of, stack=stack)
        self._create(name, schema, opts, seed)

    def _setup(self, segment: Segment, schema: Schema, opts: Options, seed: Any, *, initialise: bool) -> None:
        rng = arguments.generator(seed, "ReplayBuffer: seed")  # before anything is laid on the segment
        super()._setup(segment, schema, opts, seed, initialise=initialise)  # the block, ring and tree
        self._copier = Copier(self.block, self.ring, opts.envs)
        self._pusher = Pusher.of(opts.rows, schema, self.block.stored)
        self._paths = SamplePaths()
        self._fast_push = push.fast_push(self, self._copier, self._pusher)
        SEATS.seat(self, self._copier.plan if self._fast_push is not None else None)  # buf.push: an attribute read
        self.rng = rng
        """This process's random generator for sampling."""

    @classmethod
    def attach(
        cls, handle: BufferHandle | str, *, schema: Schema | Mapping[str, Any] | None = None,
        seed: int | np.random.Generator | None = None, sampler: type[Sampler] | ModuleType | None = None,
        rank: int | None = None, world_size: int | None = None,
    ) -> ReplayBuffer:
        """Map an existing buffer by handle or name (``MappedBlock.attach``; ``sampler``: the class
        or module of a sampler of the user's, as there). With ``rank`` and
        ``world_size`` (data-parallel learners, ``torchrun``), this process is rank ``rank`` of
        ``world_size`` learners sampling the buffer as one: ``sample(n)`` returns this rank's ``n``
        rows of one global batch of ``n * world_size``, an epoch its part of each global batch,
        the draws keyed on ``seed`` (the same int on every rank) and the rank's step; the batches
        of the ranks joined in rank order are what one process with ``world_size=1`` draws
        (``sampling/ranks.py``; docs: "Several learners")."""
        ranked = Rank.make(rank, world_size, seed)  # checked before the block is mapped
        own = seed if ranked is None else np.random.default_rng([ranked.seed, ranked.rank])
        self = super().attach(handle, schema=schema, seed=own, sampler=sampler)
        self.ranked = ranked
        return self

    def __dir__(self) -> list[str]:
        return [name for name in super().__dir__() if name not in hints.METHODS]  # the hints set below

    # -- identity and lifecycle (the rest is MappedBlock's) --------------------------------------
    def __reduce__(self) -> tuple[Any, ...]:
        return (_attach_by_handle, (self.handle,))  # a subclass's pickle attaches a ReplayBuffer too

    def _close(self, *, defer: bool) -> None:
        if self._segment is not None:
            SEATS.unseat(self)  # push is the method again, which says closed; one held elsewhere keeps this buffer
            if self._copier is not None:
                self._copier.close()  # the one-call push's views of the block (a held push's too)
            if self._paths is not None:
                self._paths.close()  # the one-call sample's
            self._fast_push = None
            self._copier = None  # type: ignore[assignment]
        super()._close(defer=defer)  # then the ring's lock and the mapping

    def __repr__(self) -> str:
        if self.closed:
            return f"ReplayBuffer({self.name!r}, closed)"
        lanes = f", lanes={self.lanes}" if self.lanes > 1 else ""
        return f"ReplayBuffer({self.name!r}, {len(self)}/{self.capacity} rows{lanes}, {self.schema})"

    # -- size ----------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """The number of rows the buffer holds before the oldest are overwritten (all lanes together)."""
        return self.ring.capacity

    @property
    def lanes(self) -> int:
        """The number of lanes (``envs=N`` gives one per env; 1 by default)."""
        return self.ring.lanes

    @property
    def lane_capacity(self) -> int:
        """The rows one lane holds: ``capacity // lanes``."""
        return self.ring.lane_capacity

    def __len__(self) -> int:
        """Rows held now, counting rows being written; not rows deleted, used up (``max_use``) or
        lost (once the buffer had one, ``len`` scans the held slots: ``reader.held``)."""
        return reader.held(self)

    @property
    def size(self) -> int:
        """The same as ``len(buf)``: the rows held now."""
        return len(self)

    @property
    def full(self) -> bool:
        """Whether every slot has been written since the last ``clear()``: the next push overwrites
        the oldest rows (SB3's ``full``). Slots count whatever they hold: rows deleted or lost, and
        with ``next_of``/``stack`` end rows too, so ``len`` may be below the capacity."""
        return len(self.ring) == self.ring.capacity

    @property
    def stats(self) -> dict[str, int]:
        """Counters shared by every process: inserted, sampled, reclaimed, lock_recoveries."""
        return self.ring.stats

    def clear(self) -> None:
        """Forget every row (MindSpore's ``reset``). Ids keep growing; see ``Ring.clear``."""
        edits.clear(self)

    def freeze(self) -> None:
        """Make the buffer read-only for every process (expert data): pushes and clears raise
        ``ReadOnlyError``; sampling and priority updates go on. There is no unfreezing."""
        self.ring.freeze()

    @property
    def frozen(self) -> bool:
        """Whether ``freeze()`` made the buffer read-only (pushes then raise ``ReadOnlyError``)."""
        return self.ring.frozen

    def reap(self) -> np.ndarray:
        """Mark the rows of writers that died mid-push as empty (and out of the priority tree);
        return their slots. Readers do this by themselves when rows stay odd."""
        return edits.reap(self)

    # -- writing -------------------------------------------------------------------------------
    def push(
        self, data: Mapping[str, Any] | None = None, /, *, lane: int | Any = None, episode: int | Any = None,
        priority: float | Any = None, timeout: float | None = None, resume: bool = False,
        flush: bool | Any = False, **fields: Any,
    ) -> np.ndarray:
        """Append one row, or ``k`` rows given with a leading dimension; return their ids.
        Everything is checked before the buffer is touched: on any error it is exactly as it was.

        :param data: the fields as one mapping, or a list of row mappings (or give them as
            keywords). A ``"priority"`` key that is not a field is the rows' priority (Ape-X).
        :param lane: a lane number, or one per row; required with several lanes unless ``envs``.
        :param episode: the rows' episode id (one, or one per row); required with ``episodes``.
        :param priority: the rows' priority (one, or one per row), else the largest given so far.
        :param timeout: how long a rate limiter that blocks writers may hold this push.
        :param resume: with ``stack``, an episode's first row may hold real older frames (an
            episode whose earlier steps this buffer lacks), kept in lead rows never drawn.
        :param flush: with ``next_of``, each lane's last row of this push becomes a transition now
            (``True``, or one flag per row): its next observation goes in an end row after it.
        """
        one = self._fast_push  # the usual push as one C call (push.fast_push); None: the steps decide
        if (one is not None and priority is None and timeout is None and not resume and flush is False
                and (data is None or not fields)):
            ids = one(fields if data is None else data, lane, episode)
            if ids is not None:
                return ids
        return push.push(self, self._copier, data, lane=lane, episode=episode, priority=priority,
                         timeout=timeout, fields=fields, pusher=self._pusher, resume=resume, fast=one, flush=flush)

    def check(
        self, data: Mapping[str, Any] | None = None, /, *, lane: int | Any = None, episode: int | Any = None,
        priority: float | Any = None, **fields: Any,
    ) -> tuple[int, dict[str, np.ndarray], int | np.ndarray, np.ndarray | None, np.ndarray | None]:
        """Everything ``push`` checks before it touches the buffer, without touching it: raises
        what ``push`` would; returns the row count and the checked rows and options."""
        return push.check(self, self._copier, data, lane=lane, episode=episode, priority=priority, fields=fields)

    def update_priorities(self, rows: Batch | Any, priorities: Any) -> int:
        """Set the priorities of sampled rows (a batch, or its ``index``), from any process; rows
        overwritten since are skipped. Returns how many were updated. Unknown ids and NaN,
        infinite or negative priorities raise ``FieldError`` and change nothing."""
        return edits.update_priorities(self, rows.index if isinstance(rows, Batch) else rows, priorities)

    def update(self, rows: Batch | Any, data: Mapping[str, Any] | None = None, /, *,
               priority: float | Any = None, **fields: Any) -> int:
        """Overwrite the given fields of stored rows (a batch, or its ``index``), from any process;
        returns how many rows were updated (rows gone since are skipped). No reader sees a row
        half-updated (``protocol/edits.py``). A ``priority`` sets the rows' priorities too.
        Everything is checked first: on any error nothing changed."""
        return edits.update(self, rows, data, fields, priority)

    def delete(self, rows: Batch | Any) -> int:
        """Remove stored rows (a batch, or its ``index``), from any process: never sampled, taken,
        got, counted, exported or saved again. Returns how many were deleted (gone ones skipped)."""
        return edits.delete(self, rows)

    def priority(self, ids: Any) -> np.ndarray:
        """The tree leaf of each row, the sampler's ``leaf`` of its priority (``Prioritized``'s:
        ``(priority + eps) ** alpha``; 0 once used up or gone; 1 for
        a uniform row under ``max_use``); ``FieldError`` without a tree."""
        return Priorities.leaves_of(self.priorities, self.ring.slots(self.ring.check_ids(ids, "priority")))

    def uses(self, ids: Any) -> np.ndarray:
        """How many times each row was drawn (``max_use`` buffers only)."""
        return Priorities.uses_of(self.priorities, self.ring.slots(self.ring.check_ids(ids, "uses")))

    # -- reading -------------------------------------------------------------------------------
    def sample(
        self, n: int, *, replace: bool = True, n_step: int = 1, gamma: float = 0.99,
        fields: dict[str, str] | None = None, out: dict[str, np.ndarray] | None = None,
        timeout: float | None = None, hindsight: her.Hindsight | None = None, **unknown: Any,
    ) -> Batch:
        """``n`` rows drawn by the buffer's sampler, as one gathered copy. Rows being written are
        re-drawn, so the batch has ``n`` rows; ``batch.index`` holds their ids, ``batch.weight``
        the importance weights of a prioritized buffer.

        :param replace: ``False`` draws ``n`` distinct rows.
        :param n_step: > 1 turns rows into n-step transitions (``sequences.add_n_step``) and adds
            ``batch.steps``: bootstrap with ``gamma ** steps``.
        :param gamma: the discount of n-step returns.
        :param fields: names of the reward, next_obs and done fields when they are not called so.
        :param out: arrays to gather into (``"_block"`` for the packed record, one per large
            field: the loader's pinned staging memory); the batch then holds their views.
        :param timeout: how long a rate limiter may hold this sample (default: the limiter's).
        :param hindsight: a ``Hindsight`` spec: goals relabelled (``hindsight.py``).
        """
        paths = self._paths
        if paths is None:
            raise closed(self.name)
        return paths.sample(self, n, replace, n_step, gamma, fields, out, timeout, hindsight, unknown)

    def sample_sequences(self, n: int, length: int, *, burn_in: int = 0, time_major: bool = False) -> Batch:
        """``n`` windows of ``length`` consecutive steps of one episode (plus ``burn_in`` steps
        before), fields ``(n, burn_in + length, ...)`` or, ``time_major``, ``(burn_in + length, n,
        ...)``. ``batch.mask`` marks the steps that exist: a window stops at its episode's ends,
        the write head and rows being written; the rest is zeros. See ``sequences.py``."""
        return self._step(reader.count(self, n * (length + burn_in), None, lambda: sequences.sample_sequences(
            self, n, length, burn_in=burn_in, time_major=time_major)))

    def sample_groups(self, groups: int, size: int, *, ordered: bool = True, replace: bool = True,
                      short: bool = False) -> Batch:
        """``groups`` groups of ``size`` rows of one episode each, fields ``(groups, size, ...)``:
        consecutive steps when ``ordered``, else distinct steps in random order (DI-engine's
        ``groupby="episode"``); episodes drawn in proportion to their rows (``sequences.py``).

        :param replace: ``False``: every group from another episode (DI-engine's default).
        :param short: also draw episodes of fewer than ``size`` rows, whole; ``batch.mask`` marks
            the rows that exist."""
        return self._step(reader.count(self, groups * size, None, lambda: sequences.sample_groups(
            self, groups, size, ordered=ordered, replace=replace, short=short)))

    def sample_episodes(self, n: int, *, replace: bool = False) -> list[Batch]:
        """``n`` distinct complete episodes (the next one has started in their lane), each a batch
        of its rows in order; with ``replace=True`` drawn in proportion to their length. A rate
        limiter does not hold it back."""
        return self._step(sequences.sample_episodes(self, n, replace=replace))

    def _step(self, drawn: Any) -> Any:
        """``drawn``, a rank's step counted (its next sample draws the next global batch)."""
        if self.ranked is not None:
            self.ranked.step += 1
        return drawn

    def epoch(self, batch_size: int, *, shuffle: bool = True, drop_last: bool = False) -> Iterator[Batch]:
        """Every row held now, once, in batches of ``batch_size`` (PPO's epochs). Rows overwritten
        during the epoch drop out of their batch; the last batch is short unless ``drop_last``."""
        return reader.epoch(self, batch_size, shuffle=shuffle, drop_last=drop_last)

    def take(self, ids: Any) -> Batch:
        """Rows by id (an earlier ``batch.index``; DI-engine's ``sample(indices=...)``), as a
        stamped copy. Ids that never existed raise ``FieldError``; rows that are gone
        (overwritten, cleared, or being written) ``EmptyBufferError`` naming them."""
        return reader.take(self, ids)

    def get(self, index: int | slice | Any) -> Batch:
        """Rows by position among those ``len`` counts (``reader.counted_ids``): 0 the oldest, -1 the
        newest, lane by lane. An int gives single-row fields; a slice or ints give rows. A row
        being written is waited for (up to a second). Once rows were lost, or with
        ``next_of``/``stack``, each call scans the held rows: read many with one ``get(slice)``."""
        return reader.get(self, index)

    def view(self, start: int, stop: int, *, lane: int = 0) -> Batch:
        """Zero-copy, read-only views of rows ``[start, stop)`` of ``lane`` (``get``'s positions):
        live memory, which writers overwrite (``get`` gives stamped copies). ``ValueError`` when
        the rows wrap past the lane's end or have gone rows between them (``views.py``)."""
        return views.view(self, start, stop, lane)

    def column(self, name: str) -> np.ndarray:
        """A zero-copy, read-only view of a whole field, ``(capacity, *shape)``, in slot order."""
        return views.column(self, name)

    def loader(self, batch_size: int = 256, **kwargs: Any) -> Loader:
        """A ``Loader`` over this buffer: batches on a device, sampled ahead (``loader.py``)."""
        return Loader(self, batch_size, **kwargs)

    # -- persistence (persistence/) -------------------------------------------------------------
    def save(self, path: str | os.PathLike[str], *, progress: bool | Callable[[int, int], None] | None = None,
             wait: float = 1.0, overwrite: bool = False) -> dict[str, Any]:
        """Save to the directory ``path`` (safetensors + JSON) while writers may go on."""
        return persistence.save(self, path, progress=progress, wait=wait, overwrite=overwrite)

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, name: str | None = None, capacity: int | None = None,
             seed: int | np.random.Generator | None = None) -> ReplayBuffer:
        """A new buffer holding a save: the same rows, ids, priorities and uses (Velora's ``load``)."""
        return persistence.load(path, cls, name=name, capacity=capacity, seed=seed)

    def checkpoint(self, path: str | os.PathLike[str], *, wait: float = 1.0, sync: bool = True,
                   device: Any = None) -> dict[str, Any]:
        """Write a checkpoint to the folder ``path``: every row the first time, then only what changed
        since the last checkpoint there (new rows, rows updated or deleted, every row's priority and
        use count, the counters, this process's pending ``next_of`` steps and sampling generator, a
        rank's step and epochs, and with ``device`` (a ``DeviceReplay`` of this buffer) the copy's
        generator), while writers go on; crash-safe (``persistence/manifest.py``).
        ``ReplayBuffer.resume`` reads it, ``resume_sampling`` the state of other processes."""
        state = self._device_generator("checkpoint", device)
        pusher = self._pusher
        pending = pusher.last if pusher is not None and pusher.pid == os.getpid() else None
        rank = self.ranked
        ranks = None if rank is None else {"world_size": rank.world_size, "seed": rank.seed, "step": rank.step,
                                           "epochs": rank.epochs}
        return persistence.checkpoint(self, path, wait=wait, sync=sync, pending=pending, ranks=ranks,
                                      generator=generator_state(self._paths, self.rng), device_generator=state)

    def resume_sampling(self, path: str | os.PathLike[str], *, device: Any = None) -> None:
        """Put this process's sampling state back as at the last complete checkpoint in ``path``
        (``ReplayBuffer.resume`` does it for the process it makes the buffer in): the sampling
        generator, a rank's step and epochs (an ``attach(..., rank=, world_size=, seed=)`` of the
        resumed buffer: it then draws what the rank drew after the checkpoint), and with ``device``
        (a ``DeviceReplay`` of this buffer) the copy's generator (``persistence/resume.py``)."""
        self._device_generator("resume_sampling", device)
        persistence.resume_sampling(self, path, device)

    def _device_generator(self, what: str, device: Any) -> dict[str, Any] | None:
        """``device``'s generator state, after checking that it is a device copy of this buffer."""
        if device is None:
            return None
        of = getattr(getattr(device, "buf", None), "name", None)
        if of != self.name or not hasattr(type(device), "generator_state"):
            raise FieldError(f"{what}: device must be a DeviceReplay of buffer {self.name!r}, got "
                             f"{type(device).__name__}{'' if of is None else f' of buffer {of!r}'}")
        state: dict[str, Any] = device.generator_state
        return state

    @classmethod
    def resume(cls, path: str | os.PathLike[str], name: str | None = None) -> ReplayBuffer:
        """A new buffer as at the last complete checkpoint in ``path``: the same rows, ids, lanes,
        episodes, priorities, uses, counters, pending steps and sampling generator, so that it draws
        what the checkpointed buffer drew after the checkpoint (``persistence/resume.py``)."""
        buf, man, lasts = persistence.resume(path, cls, name=name)
        try:
            if buf.pusher is not None:
                buf.pusher.last = lasts
            if man.generator is not None:
                buf.rng = generator_from_state(man.generator, man.file)
        except BaseException:
            buf.__exit__(None, None, None)
            raise
        return buf

    def export(self) -> dict[str, np.ndarray]:
        """All rows as numpy arrays in ``get`` order, plus ``index`` (and ``episode``)."""
        return persistence.export(self)

    @property
    def pusher(self) -> Pusher | None:
        """With ``next_of``/``stack``: this process's memory of the rows it pushed last into each
        lane (``protocol.frames_push.Pusher``), which its next push continues; a save keeps it and
        a load gives it to the loading process. ``None`` without."""
        return self._pusher

    def pending(self) -> dict[str, np.ndarray]:
        """With ``next_of``: the rows ``export`` leaves out, each lane's newest row this process
        pushed that waits for its next observation, as transitions with ``export``'s keys."""
        return persistence.pending(self, self._pusher)

    @classmethod
    def from_arrays(cls, schema: Schema | Mapping[str, Any], arrays: Mapping[str, Any],
                    capacity: int | None = None, **options: Any) -> ReplayBuffer:
        """A new buffer of these rows (DI-engine's ``import_data``)."""
        return persistence.from_arrays(as_schema(schema), arrays, cls, capacity, **options)


def _attach_by_handle(handle: BufferHandle) -> ReplayBuffer:
    return ReplayBuffer.attach(handle)


for _name in hints.METHODS:  # another library's name (cpprb's get_stored_size ...) names ours
    if not hasattr(ReplayBuffer, _name):  # (a name of ours stays ours: tests/test_hints.py)
        setattr(ReplayBuffer, _name, hints.Hint(_name))

SEATS = push.NativePush(ReplayBuffer)
