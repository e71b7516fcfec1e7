"""The paths a sample call takes on a buffer (``ReplayBuffer.sample``): its checks, the one C call
where it serves (``protocol/draw_gather.py``), else the reader's draw (``reader.draw``); hindsight
relabelling (``hindsight.py``) or n-step returns (``sequences.add_n_step``) on top; and the rows
counted as sampled, through the rate limiter when the buffer has one (``sampling/limiter.py``).

``SamplePaths`` is one buffer's, in one process: it keeps the one call (made at the first sample
that it serves, again for a new generator) and whether to try it. It takes the buffer as an
argument (a ``Source`` with a length), never holds it.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from . import hindsight as her
from . import hints, native, sequences
from .batch import Batch
from .errors import EmptyBufferError, LayoutError
from .protocol import reader
from .protocol.draw_gather import DrawGather
from .protocol.gather import check_out
from .protocol.reader import Source, count
from .sampling import ranks
from .sampling.samplers import Draw, check_batch_size

__all__ = ["Buffer", "SamplePaths", "generator_from_state", "generator_state"]


class Buffer(Source, Protocol):
    """What a sample call needs of a buffer: the reader's ``Source`` and ``len``."""

    def __len__(self) -> int:
        """The rows held now (``ReplayBuffer.__len__``)."""


class SamplePaths:
    """One buffer's sample calls in this process (see the module docstring)."""

    one_call: DrawGather | None = None
    """The one-call sample (``DrawGather``), made at the first sample that it serves."""
    one_calls = True
    """Whether samples try the one call (``False`` once it serves none of this buffer's, or to test
    the Python path)."""

    def sample(self, src: Buffer, n: int, replace: bool, n_step: int, gamma: float, fields: dict[str, str] | None,
               out: dict[str, np.ndarray] | None, timeout: float | None, hindsight: her.Hindsight | None,
               unknown: dict[str, Any]) -> Batch:
        """``ReplayBuffer.sample`` (its docstring says what each argument does)."""
        if out is not None:
            check_batch_size(n)
            out = check_out(src.block, n, out)
        one = self.one_call
        rank = src.ranked
        if (one is not None and self.one_calls and type(n) is int and n > 0 and replace is True and n_step == 1
                and hindsight is None and timeout is None and not unknown and one.rng is src.rng
                and src.options.limiter is None):
            # the usual call, as one C call with no checks left to make (the rest below is the same)
            calls = ranks.next_call(rank, src.priorities)  # beta's sample call, counted
            batch = one(src, n, out, calls, None if rank is None else rank.keyed(n))
            if batch is None:  # what the call does not serve (an empty buffer ...): the Python path
                reader.check_transitions(src, n, True)
                batch = reader.draw(src, n, out=out, calls=calls, first=first_draw(src, n, True))
            src.ring.count_sampled(n)
            if rank is not None:
                rank.step += 1
            return batch
        if unknown:  # another library's keyword (cpprb's beta, SB3's env ...): name ours
            raise hints.keyword_error("sample", unknown)
        # with hindsight, its own check below refuses any n_step but 1
        n, timeout = sequences.check_sample(src, n, 1 if hindsight is not None else n_step, gamma, fields, timeout)
        if hindsight is not None:
            if not isinstance(hindsight, her.Hindsight):
                raise TypeError(f"sample: hindsight must be a shmbuffer.Hindsight, got {type(hindsight).__name__}")
            if n_step != 1 or not replace:
                raise ValueError("sample: hindsight relabelling draws with replacement and one step a transition; "
                                 "leave n_step=1 and replace=True")
            her.plan_for(src, hindsight)
        reader.check_transitions(src, n, replace)

        def draw() -> Batch:
            calls = ranks.next_call(rank, src.priorities)  # beta's sample call, counted
            batch = None if hindsight is None else her.sample(src, hindsight, n, out=out, calls=calls,
                                                              first=first_draw(src, n, True))
            if batch is None and replace and self.one_calls:
                one = self.one_call
                if one is None or one.rng is not src.rng:  # made at the first sample, again for a new rng
                    one = self.make_one_call(src)
                if one is not None:
                    batch = one(src, n, out, calls, None if rank is None else rank.keyed(n))
            if batch is None:
                batch = reader.draw(src, n, replace=replace, out=out, calls=calls, first=first_draw(src, n, replace))
            if n_step > 1:
                sequences.add_n_step(src, batch, int(n_step), float(gamma), fields)
            if rank is not None:
                rank.step += 1
            return batch

        return count(src, n, timeout, draw)

    def make_one_call(self, src: Source) -> DrawGather | None:
        """The one-call sample of ``src`` (``DrawGather``), or ``None`` where it serves none."""
        self.close()
        if not DrawGather.serves(src):
            self.one_calls = False
            return None
        self.one_call = DrawGather(native.lib, src)
        return self.one_call

    def close(self) -> None:
        """Release the one call's views of the block (``ReplayBuffer.close``). Idempotent."""
        if self.one_call is not None:
            self.one_call.close()
        self.one_call = None


def first_draw(src: Buffer, n: int, replace: bool) -> Draw | None:
    """A rank's part of this step's global draw (``ranks.draw``); ``None`` alone (the reader draws)."""
    rank = src.ranked
    if rank is None:
        return None
    if not replace and n * rank.world_size > len(src.ring):
        raise EmptyBufferError(
            f"sample({n}, replace=False): the ranks' global batch of {n} x world_size={rank.world_size} distinct "
            f"rows is more than the {len(src.ring)} rows buffer {src.name!r} holds; sample fewer rows a rank, "
            "draw with repeats (replace=True), or wait until writers have pushed more")
    prios = src.priorities
    return ranks.draw(src.options.sampler, src.ring, prios.tree if prios is not None else None, rank, n, replace)


def generator_state(paths: SamplePaths | None, rng: np.random.Generator) -> dict[str, Any]:
    """The state of a buffer's sampling generator ``rng``, for a checkpoint. The one-call sample's
    own generator (``DrawGather``, in ``paths``) is made again from ``rng`` at the next sample, so that
    what is drawn after the checkpoint follows from this state alone."""
    if paths is not None:
        paths.close()
    return dict(rng.bit_generator.state)


def generator_from_state(state: dict[str, Any], file: Any) -> np.random.Generator:
    """A generator in ``state`` (``generator_state``'s); ``LayoutError`` naming ``file`` when it is
    not a numpy bit generator's state."""
    kind = state.get("bit_generator")
    maker = getattr(np.random, kind, None) if kind in ("PCG64", "PCG64DXSM", "MT19937", "Philox", "SFC64") else None
    try:
        if maker is None:
            raise ValueError(f"bit_generator {kind!r}")
        bits = maker()
        bits.state = state
    except (TypeError, ValueError, KeyError, OverflowError) as exc:
        raise LayoutError(f"{file}: checkpoint.generator is not a numpy bit generator's state ({exc}); the manifest "
                          "is damaged: resume from another folder") from None
    return np.random.Generator(bits)
