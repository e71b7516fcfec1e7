"""Sampling on the learner's device from a copy of the buffer's rows: ``DeviceReplay``.

``DeviceReplay(buf, device="cuda")`` is a ``DeviceRows`` (``device/rows.py``: the rows on the
device, their refresh from shared memory by the reader's stamp rule, and the usable slots) with
lag bounds, a background refresher (``device/refresher.py``) and the samples.

Between refreshes the device copy lags the shared buffer: the rows committed since the last one
are not drawn yet, and a row overwritten, updated or deleted since (or during it) is still drawn
from the device copy (whole: the row as it was committed). ``max_lag_rows`` and ``max_lag_s``
bound that lag: a ``sample`` refreshes first when more rows were inserted since the last refresh
began than ``max_lag_rows``, or when rows came in and it began more than ``max_lag_s`` ago
(``lag()`` measures both), or, under a row bound, when an ``update()`` or ``delete()`` ran. A sample that finds a
bound broken while a refresh is under way waits for that refresh and looks again, so it refreshes
itself only when that one did not bring the copy within the bound. Otherwise a sample never
waits for a refresh's copies, only for its changes of the slot lists (``device/rows.py``). The
default is ``max_lag_s=0.01`` and no row bound: the refresher refreshes at half the bound (every
5 ms at most), which a training loop cannot tell from no lag (measured in
``benchmarks/HISTORY.md``), and a sample waits only when the refresher fell behind.
``max_lag_rows=0`` makes every sample see every row committed before it (each sample then
refreshes while writers push). A ``clear()`` always makes the next sample refresh: a cleared row
is never drawn. A sample that finds no row to draw in the copy while the buffer holds rows (writers
lapping a small ring faster than the copy refreshes) refreshes and draws again, for up to
``reader.GIVE_UP`` seconds as the host's reader waits for rows being written, then raises
``WaitTimeout``; only an empty buffer raises ``EmptyBufferError`` at once. Each refresh publishes ``INSERTED`` and the time it began in the block
(``Counter.DEVICE_ROWS``/``DEVICE_AT``), which ``shmbuffer top`` shows as the copy's lag.

``sample(n)`` asks the buffer's sampler what may draw in its place (``Sampler.served``): a
uniform sampler's rows are drawn on the device, uniformly over the usable slots
(``torch.randint``; on the CPU with the C extension the draw, from its own xoshiro256** stream
seeded by ``seed``, and the copy of the rows drawn are one call, as the host's one-call sample
is: ``native/learner.c``'s ``device_sample``, which draws under the lock and copies outside it,
drawing again any row whose slot a refresh dropped meanwhile, as ``dropped`` shows); any other
sampler draws on the host, by its own ``draw`` (a prioritized one
from the shared sum tree, with ``ReplayBuffer.sample``'s importance weights; a user's sampler as
it draws), keeping the drawn rows the device holds as committed and drawing again for the others.
On a rank's attach (``sampling/ranks.py``) each draw is the rank's part of the step's keyed global
draw (uniform: positions among the usable slots; else the host's keyed draw), without the one call.
``update_priorities`` writes the shared tree, so every process sees it. A batch has the fields,
shapes and dtypes of ``ReplayBuffer.sample``'s, as tensors on the device, with ``index`` (ids),
``episode`` and ``weight`` as there.

With frames stored once (``next_of``/``stack``) the device copy holds the stored rows and a host
mirror of their kinds; a draw plans each transition on the host by ``frames.py``'s read rules
(``center``, ``stack_plan``: a window row counts when the copy holds that exact row) and rebuilds
it on the device (one gather of the planned frames, stacks assembled there); rows that are not
transitions (end, lead, a lane's newest with ``next_of``) are drawn again. ``len`` counts rows
held, not transitions.

``sample_sequences`` serves windows of one lane and episode (burn-in, mask, time major) from the
rows the copy holds, planned on the host from a mirror of their episode ids.

With ``max_use`` the rows are drawn on the host from the tree of uses, each row kept counts a
use (``reader.Uses``, given back when the sample raises), so no row is handed out more than
``max_use`` times on either path; a rate limiter holds ``sample`` and ``sample_sequences`` as it
holds the host's (``reader.count``). Not done on the device yet, and refused with the alternative
named: n-step returns and sequences over frames stored once;
groups and whole episodes stay ``ReplayBuffer``'s. The device must hold the copy: on CUDA the bytes needed are checked against
``torch.cuda.mem_get_info`` before anything is allocated.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import arguments
from ..batch import Batch, torch_views
from ..errors import ClosedError, EmptyBufferError, FieldError, WaitTimeout
from ..frames import Stack, assemble, stack_columns, stack_plan
from ..frames import center as frames_center
from ..protocol import refresh
from ..protocol.reader import GIVE_UP, Source, Uses, count, draw_ids, held, nothing_to_draw, short_of_uses
from ..protocol.refresh import DONE, ERROR, INSERTED
from ..protocol.rows import committed, committed_of_id, lane_of, number_of, slot, slot_of_id, window
from ..sampling import ranks
from ..sampling.samplers import drawn_by
from ..sequences import check_sample, check_windows, n_step_fields, n_step_return, window_mask
from .refresher import PACE_S, Refresher, forget
from .rows import DeviceRows

_ROUNDS = 8
"""Rounds of drawing again (prioritized) for rows the device copy does not hold, before a sync."""
DEFAULT_MAX_LAG_S = 0.01
"""``max_lag_s`` by default: a sample refreshes first when the last refresh began longer ago."""
DEFAULT_PACE_S = PACE_S
"""Seconds the background refresher waits between looks at the lag."""
REFRESH_AT = 0.5
"""The background refresher refreshes once the lag reaches this share of a bound (of ``max_lag_s``:
a refresh every 5 ms at most by default, each copying the rows of those 5 ms in a few copies), so
that a sample seldom finds a bound broken; without bounds, whenever rows came in."""


def _torch() -> Any:
    import torch

    return torch


class _DrawGaveFewer(EmptyBufferError):
    """A user's draw gave fewer ids than asked (it has no more rows to draw from), or a batch used up
    the last rows (``max_use``): a refresh of the copy would not change that."""


class DeviceReplay(DeviceRows):
    """A copy of ``buf``'s rows on ``device``, refreshed from shared memory (see the module docstring).

    :param buf: the buffer (any process's handle to it: writers elsewhere keep pushing).
    :param device: a torch device (``"cuda"``, ``"cuda:1"``, ``"cpu"``).
    :param max_lag_rows: a sample refreshes first when more rows than this were inserted since the
        last refresh began (``None``: no bound by rows; ``0``: every sample sees every row
        committed before it).
    :param max_lag_s: a sample refreshes first when the last refresh began longer ago than this
        (``None``: no bound by time). The default, 10 ms, is a few training steps: with the
        background refresher the lag stays under half of it and a sample waits only when the
        refresher falls behind (a loaded machine). With both bounds ``None`` only the refresher
        and ``sync()`` refresh.
    :param chunk: rows per piece of a refresh (and of the staging memory on CUDA).
    :param seed: the device generator's seed (uniform draws).
    :param refresher: refresh in a background thread (``DEFAULT_PACE_S`` apart), stopped by
        ``close()``, before a fork (started again in the parent, not in the child) and at exit.
    """

    def __init__(self, buf: Source, device: Any = "cuda", *, max_lag_rows: int | None = None,
                 max_lag_s: float | None = DEFAULT_MAX_LAG_S, chunk: int = 16384, seed: int | None = None,
                 refresher: bool = True) -> None:
        torch = _torch()
        opts = buf.options
        for name, value in (("max_lag_rows", max_lag_rows), ("chunk", chunk)):
            if value is not None and (type(value) is not int or value < (1 if name == "chunk" else 0)):
                raise ValueError(f"DeviceReplay: {name} must be an int >= {1 if name == 'chunk' else 0}, got {value!r}")
        if max_lag_s is not None:
            arguments.timeout(max_lag_s, "DeviceReplay: max_lag_s")
        seeds = arguments.seeds(seed, "DeviceReplay: seed")
        super().__init__(buf, device, chunk)
        self.max_lag_rows, self.max_lag_s = max_lag_rows, max_lag_s
        self.spec = opts.rows
        """The buffer's rows variant: with frames stored once (``next_of``/``stack``) a draw plans transitions."""
        self._gen = torch.Generator(device=self.device)
        self._gen.manual_seed(int(seeds.generate_state(1)[0]))
        self._rng = seeds.spawn(1)[0].generate_state(4, np.uint64)
        """The C uniform draw's xoshiro256** state (CPU, C extension: ``native/learner.c``)."""
        self._outs = [(name, dev.shape[1:], dev.numpy().dtype) for name, dev in self.rows.items()] \
            if self._draw_call is not None else []
        self._refresher = Refresher()
        self.sync()
        if refresher:
            self.start_refresher()

    # -- the background refresher ---------------------------------------------------------------
    def refresh_if_behind(self, stop: threading.Event | None = None) -> bool:
        """Refresh now if the copy is half a bound behind (``REFRESH_AT``; without bounds, if
        anything changed): what the background refresher does every ``DEFAULT_PACE_S``. Returns
        whether it refreshed (not once ``stop`` is set or the copy closed)."""
        if not self._behind(REFRESH_AT):
            return False
        with self._refreshing:
            if (stop is not None and stop.is_set()) or self.closed:
                return False
            self._refresh()
        return True

    def start_refresher(self) -> None:
        """Start the background refresher (``refresher=True`` does at construction; a fork starts
        the parent's again): a thread in C that never takes the GIL where a refresh is one C call,
        else a Python thread. Nothing happens when it runs or the copy is closed."""
        if self.closed:
            return
        bounds = [-1.0 if b is None else REFRESH_AT * b for b in (self.max_lag_rows, self.max_lag_s)]
        self._refresher.start(self, lambda: self.native_refresher(DEFAULT_PACE_S, bounds[0], bounds[1]))

    def stop_refresher(self) -> None:
        """End the background refresher (joined: a refresh under way ends first); samples then
        refresh by the bounds alone. Idempotent."""
        self._refresher.stop()

    @property
    def refreshing(self) -> bool:
        """Whether the background refresher runs now."""
        return self._refresher.running

    @property
    def generator_state(self) -> dict[str, Any]:
        """The state of the copy's random draws as JSON values (the torch generator's, the C
        uniform draw's): ``buf.checkpoint(path, device=...)`` records it and setting it back
        (``buf.resume_sampling(path, device=...)``) makes the copy draw on as it would have."""
        return {"torch": bytes(self._gen.get_state().numpy()).hex(), "xoshiro": [int(v) for v in self._rng]}

    @generator_state.setter
    def generator_state(self, state: dict[str, Any]) -> None:
        torch = _torch()
        try:
            raw = torch.frombuffer(bytearray(bytes.fromhex(state["torch"])), dtype=torch.uint8)
            words = np.array(state["xoshiro"], np.uint64)
            if words.shape != self._rng.shape:
                raise ValueError(f"{words.size} xoshiro words")
            self._gen.set_state(raw)
        except (TypeError, ValueError, KeyError, RuntimeError, OverflowError) as exc:
            raise ValueError(f"DeviceReplay.generator_state: expected what generator_state returns (torch: the hex of a "
                             f"torch generator's state, xoshiro: 4 ints), got {str(state)[:200]} ({exc})") from None
        self._rng[:] = words

    def close(self) -> None:
        """Stop the refresher and drop the views of the shared columns (so that ``buf.close()`` can
        unmap them) and the device memory. Idempotent; the copy cannot sync or sample afterwards."""
        self.stop_refresher()
        forget(self)
        with self._refreshing, self.lock:
            if self.closed:
                return
            self._release_rows()
            refresh.publish(self.buf, int(self.state[INSERTED]), 0)  # top: no device copy now

    def __enter__(self) -> DeviceReplay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _behind(self, share: float) -> bool:
        """Whether the copy is more than ``share`` of a bound behind: rows came in (or rows were
        updated or deleted) and the last refresh began longer ago than ``share * max_lag_s``, or
        more than ``share * max_lag_rows`` rows came in, or (under a row bound) an ``update()`` or
        a ``delete()`` ran; or a ``clear()`` happened since. Without bounds (``share < 1``: the refresher's
        question) whenever something changed."""
        rows_bound, seconds_bound = self.max_lag_rows, self.max_lag_s
        if self._one_call is None:
            return refresh.behind(self.buf, self.state, self.bases, rows_bound, seconds_bound, share)
        return bool(self._one_call[0].behind(  # refresh.behind in one C call (native/learner.c's behind)
            *refresh.sources(self.buf)[1:3], self.state, self.bases,
            -1 if rows_bound is None else int(share * rows_bound),
            -1 if seconds_bound is None else int(share * seconds_bound * 1e9), share < 1))

    def _maybe_sync(self) -> None:
        """Refresh before a sample where a bound would break. A refresh under way (the
        refresher's) is waited for, and the bound looked at again: the sample refreshes itself
        only for the rows that one left behind."""
        failures = self._refresher.failures
        if failures:
            raise failures.pop()
        if self.state[ERROR]:
            raise ValueError(f"DeviceReplay of buffer {self.buf.name!r}: the background refresher stopped on "
                             "inconsistent slot lists (a bug: please report it); close() and make a new copy")
        for attempt in range(4):  # each time another refresh was done meanwhile: look again (the last refreshes)
            seen = int(self.state[DONE]) if attempt < 3 else -1
            if not self._behind(1.0):
                return
            with self._refreshing:
                if not self._behind(1.0) or self._refresh(seen) >= 0:
                    return

    # -- sampling -------------------------------------------------------------------------------
    def sample(self, n: int, *, n_step: int = 1, gamma: float = 0.99, fields: dict[str, str] | None = None,
               timeout: float | None = None) -> Batch:
        """``n`` rows drawn on the device (with replacement), as ``ReplayBuffer.sample`` draws them;
        ``n_step > 1`` turns them into n-step transitions on the device, as ``ReplayBuffer.sample``
        does (``sequences.add_n_step``: the following rows of the row's lane and episode that the
        device copy holds as committed; ``batch.steps``). With ``max_use`` each row drawn counts a
        use, and with a rate limiter the sample waits for it (``timeout``), as there."""
        n, timeout = check_sample(self.buf, n, n_step, gamma, fields, timeout)
        if n_step != 1 and self.spec.once:
            raise FieldError(f"sample(n_step={n_step}): the device copy does not rebuild n-step returns over "
                             "frames stored once (next_of/stack) yet: buf.sample(n, n_step=...) does")
        return count(self.buf, n, timeout, lambda: self._sample_waiting(n, int(n_step), float(gamma), fields))

    def _sample_waiting(self, n: int, n_step: int, gamma: float, fields: dict[str, str] | None) -> Batch:
        """``sample``'s draw: rows the copy lacks while the buffer holds some (writers lapping a
        small ring faster than it refreshes) are refreshed and drawn again, as the host's reader
        waits; a host draw that gave fewer ids than asked has no more to give: said at once."""
        deadline = 0.0
        while True:
            try:
                return self._step(self._sample_once(n, n_step, gamma, fields))
            except EmptyBufferError as e:
                if self.closed or held(self.buf) == 0 or isinstance(e, _DrawGaveFewer):
                    raise
                deadline = deadline or time.monotonic() + GIVE_UP
                if time.monotonic() > deadline:
                    raise WaitTimeout(f"sample({n}): the device copy of buffer {self.buf.name!r} held no row to draw for "
                                      f"{GIVE_UP:.0f} s while the buffer holds {held(self.buf)}: writers overwrite "
                                      "rows faster than the copy refreshes; give the buffer a larger capacity") from None
                time.sleep(0.0005)
                self.sync()

    def _sample_once(self, n: int, n_step: int, gamma: float, fields: dict[str, str] | None) -> Batch:
        """``sample`` once: ``EmptyBufferError`` when the copy holds no row to draw."""
        if self.closed:
            raise ClosedError(f"DeviceReplay of buffer {self.buf.name!r} is closed")
        self._maybe_sync()
        # what the sampler lets the device draw in its place; with max_use, the host's tree (uses)
        served = self.buf.options.sampler.served if self.buf.options.max_use is None else None
        if served == "uniform" and self._draw_call is not None and not self.spec.once and self.buf.ranked is None:
            batch = self._uniform_one_call(n)  # takes the lock itself, in C
            if n_step > 1:
                with self.lock:
                    if self.closed:  # since the draw (another thread): the device columns are gone
                        raise ClosedError(f"DeviceReplay of buffer {self.buf.name!r} is closed")
                    self._n_step(batch, n_step, gamma, fields)
            return batch
        with self.lock:
            if self.closed:
                raise ClosedError(f"DeviceReplay of buffer {self.buf.name!r} is closed")
            # the tree's draw, or a sampler's own: drawn on the host, read from the device copy
            batch = self._uniform(n) if served == "uniform" else self._host_drawn(n)
            if n_step > 1:
                self._n_step(batch, n_step, gamma, fields)
        return batch

    def _uniform(self, n: int) -> Batch:
        if self.spec.once:  # transitions only: end and lead rows, a lane's newest with next_of, drawn again
            ids = self._draw_held(n, lambda got: self._transitions(got)[0])
            if ids is not None:
                return self._frames_batch(ids, None)
            raise EmptyBufferError(f"sample({n}): the device copy of buffer {self.buf.name!r} holds no whole "
                                   "transitions yet (an episode's final observation and each lane's newest row, "
                                   "which waits for its next, are not): push, then sync() or sample again")
        m = len(self)
        if m == 0:
            raise EmptyBufferError(f"sample({n}): the device copy of buffer {self.buf.name!r} holds no rows yet "
                                   "(push, then sync() or sample again)")
        pick = self._pick(m, n, True)
        if m < self.capacity:  # else every slot is usable: the draw is the slot
            pick = self._usable_slots().index_select(0, pick)
        return self._batch(pick, self._ids_of(pick), None)

    def _uniform_one_call(self, n: int) -> Batch:
        """``_uniform`` as one C call (``native/learner.c``'s ``device_sample``: the draw over the
        usable slots under the lock and the copy of their rows outside it, checked by the slots'
        last drops), into new tensors."""
        draw = self._draw_call
        if draw is None:
            raise ClosedError(f"DeviceReplay of buffer {self.buf.name!r} is closed")
        lib, *args = draw
        outs = [np.empty((n, *shape), dtype) for _, shape, dtype in self._outs]
        ids = np.empty(n, np.int64)
        if not lib.device_sample(*args[:5], self._rng, args[5], tuple(outs), ids, self.lanes):
            if self.closed:
                raise ClosedError(f"DeviceReplay of buffer {self.buf.name!r} is closed")
            raise EmptyBufferError(f"sample({n}): the device copy of buffer {self.buf.name!r} holds no rows yet "
                                   "(push, then sync() or sample again)")
        torch = _torch()
        got = {name: torch.from_numpy(a) for (name, _, _), a in zip(self._outs, outs, strict=True)}
        return self._batch_of(got, torch.from_numpy(ids), None)

    def _host_drawn(self, n: int) -> Batch:
        """``n`` rows the buffer's sampler draws on the host (from the shared tree, or its own
        ``draw``), those the device copy does not hold drawn again; its weights, if any. With
        ``max_use`` each row kept counts a use (``reader.Uses``), a row used up meanwhile is drawn
        again, and the uses are given back when the sample raises."""
        torch = _torch()
        buf = self.buf
        prios, sampler = buf.priorities, buf.options.sampler
        calls = ranks.next_call(buf.ranked, prios)
        uses = Uses(buf) if buf.options.max_use is not None else None
        ids = np.empty(n, np.int64)
        leaves = np.ones(n, np.float64)
        claimed = np.zeros(n, bool)
        todo = np.arange(n)
        fewer = False
        try:
            for round_ in range(2 * _ROUNDS):
                if round_ == _ROUNDS:
                    buf.reap()  # a dead writer's odd rows keep the leaves they took until reaped
                    self.lock.release()  # a refresh takes _refreshing first (the refresher's order)
                    try:
                        self.sync()  # rows drawn from the tree that the device copy does not hold yet
                    finally:
                        self.lock.acquire()
                    done = np.setdiff1d(np.arange(n), todo)  # the sync may have copied newer rows over them
                    stale = done[~self._servable(ids[done])]  # a kept transition's older frames lapped, too
                    if uses is not None and claimed[stale].any():
                        uses.give_back(ids, stale[claimed[stale]], leaves)
                        claimed[stale] = False
                    todo = np.union1d(todo, stale)
                d = draw_ids(buf, todo.size, round_ > 0)
                got = d.ids
                if got.shape[0] != todo.size:
                    fewer = True
                    break
                ok = self._servable(got)
                ids[todo[ok]] = got[ok]
                if d.leaves is not None:
                    leaves[todo[ok]] = d.leaves[ok]
                if uses is not None:  # used up meanwhile: drawn again
                    refused = uses.claim(ids, todo[ok])
                    claimed[np.setdiff1d(todo[ok], refused)] = True
                    ok &= ~np.isin(todo, refused)
                todo = todo[~ok]
                if todo.size == 0:
                    break
            by = drawn_by(sampler)
            if todo.size and fewer and uses is not None and held(buf) == 0:
                nothing_to_draw(buf, n, final=True)  # every row used up: as the host's sample says it
            if todo.size:
                raise (_DrawGaveFewer if by and fewer else EmptyBufferError)(
                    f"sample({n}): the device copy of buffer {buf.name!r} holds none of the rows the sampler draws "
                    "(nothing pushed yet, or every row being written)"
                    + (f", or {by} gave fewer ids than asked (it has no more rows to draw from)" if by else ""))
            weights = sampler.weights(prios.tree if prios is not None else None, leaves, calls) if sampler.weighted else None
            w = None if weights is None else torch.from_numpy(np.ascontiguousarray(weights)).to(self.device)
            if self.spec.once:
                return self._frames_batch(ids, w)
            return self._batch(torch.from_numpy(self._window(ids)[1]).to(self.device), torch.from_numpy(ids).to(self.device), w)
        except BaseException as e:
            if uses is not None and claimed.any():
                uses.give_back(ids, np.flatnonzero(claimed), leaves)
                try:  # the batch itself used up the rows: said as the host says it
                    if isinstance(e, EmptyBufferError):
                        short_of_uses(buf, n)
                except EmptyBufferError as short:
                    raise _DrawGaveFewer(str(short)) from None
            raise

    def _servable(self, ids: np.ndarray) -> np.ndarray:
        """Which of ``ids`` the copy can serve now: rows it holds, transitions where frames are stored once."""
        return self._transitions(ids)[0] if self.spec.once else self._window(ids)[0]

    def _batch(self, slots: Any, ids: Any, weight: Any, rebuilt: dict[str, Any] | None = None) -> Batch:
        """The batch of the rows in device ``slots``; ``rebuilt``: the fields read from other rows
        (frames stored once), not from their own."""
        got = dict(rebuilt or {})
        got.update({name: dev.index_select(0, slots) for name, dev in self.rows.items() if name not in got})
        return self._batch_of(got, ids, weight)

    def _batch_of(self, got: dict[str, Any], ids: Any, weight: Any, lead: tuple[int, ...] | None = None) -> Batch:
        """The batch of rows copied from the device columns (``got``: one tensor per column; with
        ``lead``, the windows' leading dimensions, its rows flattened)."""
        packed = got.pop("_record", None)
        if packed is not None:
            packed = packed.view(_torch().uint8)
        small = torch_views(packed, self.record) if packed is not None and self.record is not None else {}
        extras: dict[str, Any] = {"index": ids}
        extras.update({key: got.pop(name) for name, key in self.extras.items() if name in got})
        if weight is not None:
            extras["weight"] = weight
        fields = {name: got[name] if name in got else small[name] for name in self.buf.block.schema.names}
        if lead is not None:
            fields = {name: a.reshape(*lead, *a.shape[1:]) for name, a in fields.items()}
        return Batch(fields, extras, block=packed, record=self.record, lead=lead)

    def _n_step(self, batch: Batch, n_step: int, gamma: float, names: dict[str, str] | None) -> None:
        """``sequences.add_n_step`` on the device, in place: a following row counts while the
        device copy holds it committed (``held``) in the row's lane and episode."""
        torch = _torch()
        reward, next_obs, done = n_step_fields(self.buf, names)
        cols = self._stored_columns(torch)
        ids = batch.index
        m, lanes, lc = ids.shape[0], self.lanes, self.lane_capacity
        nums = number_of(ids, lanes)[:, None] + torch.arange(1, n_step, device=self.device)[None, :]
        lane = lane_of(ids, lanes)[:, None]
        slots = slot(lane, nums, lc)
        ok = (self._held_dev[slots] == committed(nums)) & (cols["_episode"][slots] == batch.episode[:, None])
        mask = torch.cat([torch.ones((m, 1), dtype=torch.bool, device=self.device), ok], 1).cumprod(1).bool()
        rewards = torch.cat([batch.fields[reward].reshape(m, 1), cols[reward][slots]], 1).double()
        dones = torch.cat([batch.fields[done].reshape(m, 1), cols[done][slots]], 1)
        ret, steps, last_done = n_step_return(rewards, dones, mask, gamma)
        more = steps > 1
        at = slots[torch.arange(m, device=self.device), (steps - 2).clamp(min=0)]
        following = torch.where(more.reshape(m, *[1] * (batch.fields[next_obs].dim() - 1)), cols[next_obs][at],
                                batch.fields[next_obs])
        batch.fields[next_obs].copy_(following)
        batch.fields[reward].copy_(ret.reshape(batch.fields[reward].shape))
        batch.fields[done].copy_(last_done.reshape(batch.fields[done].shape))
        batch.extras["steps"] = steps

    def _draw_held(self, n: int, accept: Callable[[np.ndarray], np.ndarray]) -> np.ndarray | None:
        """``n`` ids of usable rows drawn uniformly on the device, those ``accept`` refuses drawn
        again (a bounded number of rounds); ``None`` when they could not all be drawn."""
        ids = np.empty(n, np.int64)
        todo = np.arange(n)
        for round_ in range(4 * _ROUNDS):
            if len(self) == 0:
                return None
            pick = self._pick(len(self), todo.size, round_ == 0)
            got = self._ids_of(self._usable_slots().index_select(0, pick)).cpu().numpy()
            ok = accept(got)
            ids[todo[ok]] = got[ok]
            todo = todo[~ok]
            if todo.size == 0:
                return ids
        return None

    def _pick(self, m: int, k: int, first: bool) -> Any:
        """``k`` positions in ``[0, m)`` of the usable slots, on the device: a rank's ``first`` draw of a
        sample its part of the step's global draw (``ranks.positions``; every rank's copy, refreshed
        alike, holds the same slots), else the device generator's."""
        torch = _torch()
        if first and self.buf.ranked is not None:
            return torch.from_numpy(ranks.positions(self.buf.ranked, k, m)).to(self.device)
        return torch.randint(m, (k,), device=self.device, generator=self._gen)

    def _step(self, batch: Batch) -> Batch:
        """``batch``, a rank's step counted (``ReplayBuffer``'s: the attach's one count of samples)."""
        if self.buf.ranked is not None:
            self.buf.ranked.step += 1
        return batch

    def _window_ids(self, anchors: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """Ids of the rows ``anchor + offset`` of each anchor's lane (the copy's ``held`` says which
        it holds: no bounds here)."""
        lanes = self.lanes
        return window(anchors, offsets, lanes, np.zeros(lanes, np.int64), np.full(lanes, np.iinfo(np.int64).max))[0]

    # -- frames stored once: transitions rebuilt on the device (frames.py's read rules) ------------
    def _transitions(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, dict[str, tuple[Stack, np.ndarray, np.ndarray]]]:
        """Which of ``ids`` the device copy can serve as transitions, by ``frames.center`` and
        ``frames.stack_plan`` over their windows (a window row counts when the copy holds that
        exact row, as a stamp check would pass it); the windows' ids and the plan of each field a
        stack fills (``frames.stack_columns``): its stack, window columns and padding zeros."""
        spec = self.spec
        win = self._window_ids(ids, np.arange(-spec.depth, spec.ahead + 1))
        ok, slots = self._window(win)
        kind = self.kinds[slots]
        valid = frames_center(spec, ok, kind)
        plans = {}
        for s in spec.stack:
            for name, last in stack_columns(spec, s).items():
                cols, zero, fine = stack_plan(ok, kind, last, s.k)
                valid &= fine
                plans[name] = (s, cols, zero)
        return valid, win, plans

    def _frames_batch(self, ids: np.ndarray, weight: Any) -> Batch:
        """The transitions ``ids`` (each servable: ``_transitions``) rebuilt on the device: the
        stacks from their planned frames, the next fields from the next rows, the rest the row's own."""
        torch = _torch()
        spec = self.spec
        valid, win, plans = self._transitions(ids)
        assert valid.all()
        m, c = ids.shape[0], spec.depth
        cols = self._stored_columns(torch)

        def at(chosen: np.ndarray) -> Any:
            return torch.from_numpy(slot_of_id(chosen.reshape(-1), self.lanes, self.lane_capacity)).to(self.device)

        got = {nxt: cols[src].index_select(0, at(win[:, c + 1])) for nxt, src in spec.next_of if spec.stacked(src) is None}
        for name, (s, chosen, zero) in plans.items():
            frames = cols[s.name].index_select(0, at(win[np.arange(m)[:, None], chosen]))
            frames = frames.reshape(m, s.k, *frames.shape[1:])
            if zero.any():
                frames[torch.from_numpy(zero).to(self.device)] = 0
            got[name] = assemble(s, frames)
        return self._batch(at(win[:, c]), torch.from_numpy(ids).to(self.device), weight, got)

    def _stored_columns(self, torch: Any) -> dict[str, Any]:
        """Every stored field's whole device column (the small ones views of the packed block), and ``Block.row``'s."""
        out: dict[str, Any] = {}
        if "_record" in self.rows:
            out.update(torch_views(self.rows["_record"].view(torch.uint8), self.buf.block.stored_record))
        out.update({name: dev for name, dev in self.rows.items() if name != "_record"})
        return out

    def sample_sequences(self, n: int, length: int, *, burn_in: int = 0, time_major: bool = False) -> Batch:
        """``n`` windows of ``length`` consecutive steps of one lane and episode (plus ``burn_in``
        before) gathered on the device, as ``ReplayBuffer.sample_sequences`` serves them: fields
        ``(n, burn_in + length, ...)`` (or time major), ``batch.mask`` the steps that exist (the
        copy holds them, of the anchor's episode, contiguous from the anchor), zeros elsewhere,
        ``batch.index`` -1 there. Anchors are drawn uniformly over the rows the copy holds."""
        what = f"sample_sequences({n}, {length})"
        check_windows(self.buf, what, n, length, burn_in)
        if self.spec.once:
            raise FieldError(f"{what}: the device copy does not serve windows over frames stored once "
                             "(next_of/stack) yet: buf.sample_sequences(...) does")
        return count(self.buf, n * (length + burn_in), None, lambda: self._windows(n, length, burn_in, time_major))

    def _windows(self, n: int, length: int, burn_in: int, time_major: bool) -> Batch:
        """``sample_sequences``' draw and gather."""
        if self.closed:
            raise ClosedError(f"DeviceReplay of buffer {self.buf.name!r} is closed")
        self._maybe_sync()
        offsets = np.arange(-burn_in, length)
        with self.lock:
            anchors = self._draw_held(n, lambda got: self._window(got)[0])
            if anchors is None:
                raise EmptyBufferError(f"sample_sequences({n}, {length}): the device copy of buffer "
                                       f"{self.buf.name!r} holds no rows yet")
            ids = self._window_ids(anchors, offsets)
            held, slots = self._window(ids)
            own = self.episodes[slot_of_id(anchors, self.lanes, self.lane_capacity)]
            mask = window_mask(held & (self.episodes[slots] == own[:, None]), burn_in)
            return self._step(self._window_batch(np.where(mask, ids, -1), np.where(mask, slots, 0), mask, time_major))

    def _window(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Which of ``ids`` (any shape) the copy holds as committed, and their slots."""
        there = ids >= 0
        safe = np.where(there, ids, 0)
        slots = slot_of_id(safe, self.lanes, self.lane_capacity)
        return there & (self.held[slots] == committed_of_id(safe, self.lanes)), slots

    def _window_batch(self, ids: np.ndarray, slots: np.ndarray, mask: np.ndarray, time_major: bool) -> Batch:
        torch = _torch()
        order = slots.T if time_major else slots
        where = torch.from_numpy(np.ascontiguousarray(order).reshape(-1)).to(self.device)
        hole = torch.from_numpy(~np.ascontiguousarray(mask.T if time_major else mask).reshape(-1)).to(self.device)
        got = {name: dev.index_select(0, where) for name, dev in self.rows.items() if name not in self.buf.block.row}
        for col in got.values():
            col[hole] = 0
        index = torch.from_numpy(np.ascontiguousarray(ids.T if time_major else ids)).to(self.device)
        batch = self._batch_of(got, index, None, order.shape)
        batch.extras["mask"] = torch.from_numpy(np.ascontiguousarray(mask.T if time_major else mask)).to(self.device)
        return batch

    def update_priorities(self, ids: Any, priorities: Any) -> None:
        """Set the priorities of rows ``ids`` in the shared tree (``ReplayBuffer.update_priorities``:
        every process sees them); device tensors are accepted."""
        def host(a: Any) -> Any:
            return a.detach().cpu().numpy() if hasattr(a, "detach") else a

        self.buf.update_priorities(host(ids), host(priorities))  # type: ignore[attr-defined]
