"""A pytest plugin that runs TorchRL's own storage tests on ``shmbuffer.torchrl.ShmStorage``.

Wherever a ``parametrize`` mark lists ``LazyTensorStorage`` (alone, or first in a tuple such as
``(LazyTensorStorage, None)``), ``ShmStorage`` is added beside it with the same other values; the
test bodies are TorchRL's, untouched. Load it with ``-p shm_glue`` (see README.md).
"""

from __future__ import annotations

from typing import Any

import pytest
from _pytest.mark.structures import ParameterSet
from torchrl.data.replay_buffers.storages import LazyTensorStorage

from shmbuffer.torchrl import ShmStorage


def _beside(values: Any) -> list[Any] | None:
    """``values`` with a ShmStorage case after each LazyTensorStorage one, or None if none."""
    values = list(values)
    if any(v is ShmStorage or (isinstance(v, tuple) and v and v[0] is ShmStorage) for v in values):
        return None  # already done (a class mark is seen once per method)
    out = []
    for v in values:
        out.append(v)
        inner = v.values if isinstance(v, ParameterSet) else v
        if inner is LazyTensorStorage:
            out.append(ShmStorage)
        elif isinstance(inner, tuple) and inner and inner[0] is LazyTensorStorage:
            out.append((ShmStorage, *inner[1:]))
    return out if len(out) > len(values) else None


@pytest.hookimpl(tryfirst=True)
def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    for node in metafunc.definition.listchain():
        marks = node.own_markers
        for i, mark in enumerate(marks):
            if mark.name != "parametrize":
                continue
            args, kwargs = list(mark.args), dict(mark.kwargs)
            if len(args) >= 2:
                new = _beside(args[1])
                if new is not None:
                    args[1] = new
            elif "argvalues" in kwargs:
                new = _beside(kwargs["argvalues"])
                if new is not None:
                    kwargs["argvalues"] = new
            else:
                continue
            if new is not None:
                marks[i] = pytest.mark.parametrize(*args, **kwargs).mark
