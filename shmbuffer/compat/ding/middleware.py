"""DI-engine's middleware functions on a ``DequeBuffer``: ``use_time_check``, ``staleness_check``,
``sample_range_view``, ``clone_object``, ``group_sample``, ``padding``; each is called
``mw(action, chain, *args, **kwargs)`` (``apply_middleware``).
"""

from __future__ import annotations

import copy
import random
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

from .deque import DequeBuffer
from .row import BufferedData


def use_time_check(buffer_: DequeBuffer, max_use: float = float("inf")) -> Callable[..., Any]:
    """A row sampled ``max_use`` times is deleted; ``meta["use_count"]`` counts a row's samples
    (in this process, as in DI-engine)."""
    use_count: dict[Any, int] = defaultdict(int)

    def check(items: list[BufferedData]) -> None:
        gone = []
        for item in items:
            use_count[item.index] += 1
            item.meta["use_count"] = use_count[item.index]
            if use_count[item.index] >= max_use:
                gone.append(item.index)
        buffer_.delete(gone)
        for index in gone:
            use_count.pop(index, None)
        if len(use_count) > 2 * buffer_.size:  # rows overwritten before their last use
            held = set(buffer_.indices.ids().tolist())
            for index in [i for i in use_count if i not in held]:
                del use_count[index]

    def _use_time_check(action: str, chain: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        sampled = chain(*args, **kwargs)
        if action == "sample" and sampled:
            for group in ([sampled] if isinstance(sampled[0], BufferedData) else sampled):
                check(group)
        return sampled

    return _use_time_check


def staleness_check(buffer_: DequeBuffer, max_staleness: float = float("inf")) -> Callable[..., Any]:
    """Rows whose staleness (``train_iter_sample_data`` given to ``sample`` minus their
    ``meta["train_iter_data_collected"]``) exceeds ``max_staleness`` are deleted before a sample.
    A push without that meta key raises ``AssertionError`` (DI-engine's exception)."""

    def push(chain: Callable[..., Any], data: Any, *args: Any, **kwargs: Any) -> Any:
        meta = kwargs.get("meta", args[0] if args else None)
        if not isinstance(meta, Mapping) or "train_iter_data_collected" not in meta:
            raise AssertionError("staleness_check: push data with meta={'train_iter_data_collected': <train iter>}, "
                                 f"got meta={meta!r}")
        return chain(data, *args, **kwargs)

    def sample(chain: Callable[..., Any], train_iter_sample_data: int, *args: Any, **kwargs: Any) -> Any:
        stale = [item.index for item in buffer_.storage
                 if train_iter_sample_data - item.meta["train_iter_data_collected"] > max_staleness]
        if stale:
            buffer_.delete(stale)
        return chain(*args, **kwargs)

    def _staleness_check(action: str, chain: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if action == "push":
            return push(chain, *args, **kwargs)
        if action == "sample":
            return sample(chain, *args, **kwargs)
        return chain(*args, **kwargs)

    return _staleness_check


def sample_range_view(buffer_: DequeBuffer, start: int | None = None, end: int | None = None) -> Callable[..., Any]:
    """Sample only the rows at positions ``[start, end)`` (0 the oldest; a negative one counts
    back from ``buffer_.size``, as in DI-engine)."""
    if start is None and end is None:
        raise ValueError("sample_range_view: give start, end or both")
    if start and start < 0:
        start = buffer_.size + start
    if end and end < 0:
        end = buffer_.size + end
    sample_range = slice(start, end)

    def _sample_range_view(action: str, chain: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if action == "sample":
            return chain(*args, sample_range=sample_range)  # DI-engine drops the other keywords too
        return chain(*args, **kwargs)

    return _sample_range_view


def clone_object() -> Callable[..., Any]:
    """Nothing to do: a push pickles or copies ``data`` into shared memory, and every sample
    builds new objects, so the buffer's rows never share objects with their users."""

    def _clone_object(action: str, chain: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return chain(*args, **kwargs)

    return _clone_object


def group_sample(size_in_group: int, ordered_in_group: bool = True, max_use_in_group: bool = True) -> Callable[..., Any]:
    """With ``sample(n, groupby=...)``: at most ``size_in_group`` rows of each group, consecutive
    (``ordered_in_group``; ``max_use_in_group`` starts them where a whole window fits) or drawn
    without order (all of a shorter group, where DI-engine fails)."""

    def sample(chain: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if not kwargs.get("groupby"):
            raise ValueError("group_sample: sample with groupby=<meta key>")
        sampled = chain(*args, **kwargs)
        for i, group in enumerate(sampled):
            if ordered_in_group:
                end = max(0, len(group) - size_in_group) + 1 if max_use_in_group else len(group)
                start = random.choice(range(end))
                sampled[i] = group[start:start + size_in_group]
            else:
                sampled[i] = random.sample(group, k=min(size_in_group, len(group)))
        return sampled

    def _group_sample(action: str, chain: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if action == "sample":
            return sample(chain, *args, **kwargs)
        return chain(*args, **kwargs)

    return _group_sample


def padding(policy: str = "random") -> Callable[..., Any]:
    """Groups of a grouped sample padded to the longest: with copies of their own random rows
    (``"random"``) or with ``BufferedData(None, None, None)`` (``"none"``)."""
    if policy not in ("random", "none"):
        raise ValueError(f"padding: policy must be 'random' or 'none', got {policy!r}")

    def sample(chain: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        sampled = chain(*args, **kwargs)
        if not sampled or isinstance(sampled[0], BufferedData):
            return sampled
        longest = max(len(group) for group in sampled)
        for group in sampled:
            base = list(group)
            for _ in range(longest - len(base)):
                pad = copy.deepcopy(random.choice(base)) if policy == "random" else BufferedData(None, None, None)
                group.append(pad)
        return sampled

    def _padding(action: str, chain: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if action == "sample":
            return sample(chain, *args, **kwargs)
        return chain(*args, **kwargs)

    return _padding

