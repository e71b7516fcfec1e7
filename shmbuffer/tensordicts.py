"""TensorDicts and tensorclasses as the rows of a shmbuffer and back, for ``torchrl.py``'s
``ShmStorage`` (extra ``torchrl``; imports torch and tensordict): nested keys as field names
(``field``), a TensorDict's tensors as numpy columns (``flatten``), a list of rows as one batch
(``stack_rows``), and the tensorclass of each nested key by name (``classes``, ``class_name``,
``import_class``: found among the modules already imported, never imported from a name a file
gave). Anything shared memory cannot hold is refused with ``TypeError``.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import numpy as np
import torch
from tensordict import LazyStackedTensorDict, TensorDictBase, is_non_tensor, is_tensor_collection, is_tensorclass

from .schema import RESERVED

__all__ = ["SEP", "class_name", "classes", "field", "flatten", "import_class", "stack_rows"]

SEP = "__"
"""What joins the parts of a nested key in a field name."""


def field(key: str | tuple[str, ...]) -> str:
    """The field name of a TensorDict key: nested keys joined by ``__``; a name a Batch keeps for
    itself (``weight``, ``mask`` ...) gets a trailing ``_``."""
    name = SEP.join(key) if isinstance(key, tuple) else key
    return name + "_" if name in RESERVED else name


def flatten(data: TensorDictBase, prefix: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    """The tensors of ``data`` by field name; anything else in it is refused."""
    out = {}
    try:
        items = list(data.items())
    except RuntimeError as e:  # a lazy stack of tensors of different shapes
        raise TypeError(f"ShmStorage: expected entries of one shape across the rows, got a ragged {type(data).__name__} "
                        f"({e}); shared memory holds fixed-shape columns: pad the entries, or use LazyStackStorage") from None
    for key, value in items:
        if isinstance(value, torch.Tensor):
            if prefix or key != "index":  # TorchRL's own: the slots a sample came from, set again at sampling
                out[field((*prefix, key) if prefix else key)] = value.detach().cpu().numpy()
        elif is_tensor_collection(value) and not is_non_tensor(value):
            out.update(flatten(value, (*prefix, key)))
        else:
            raise TypeError(f"ShmStorage: key {(*prefix, key) if prefix else key!r}: expected a tensor, got "
                            f"{type(value).__name__}; shared memory holds numeric columns only: keep non-tensor data "
                            "outside the storage, or use LazyTensorStorage")
    return out


def stack_rows(data: list[Any] | tuple[Any, ...]) -> Any:
    """A list of rows (tensors, TensorDicts or tensorclasses) as one batch, as TorchRL's storages do."""
    if data and all(isinstance(d, torch.Tensor) for d in data):
        stack: Any = torch.stack
    elif data and all(is_tensor_collection(d) for d in data):
        stack = LazyStackedTensorDict.maybe_dense_stack
    else:
        kinds = sorted({type(d).__name__ for d in data})
        raise TypeError(f"ShmStorage: expected a list of tensors, TensorDicts or tensorclasses, got a list of "
                        f"{', '.join(kinds) or 'nothing'}; pytrees are not stored (shared memory holds named "
                        "numeric columns): make the rows a TensorDict")
    try:
        return stack(list(data))
    except RuntimeError as e:
        raise RuntimeError(f"Stacking the elements of the list resulted in an error: {e}") from e


def classes(tc: Any, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], type]:
    """The tensorclass at each nested key of ``tc`` (``()`` for ``tc`` itself)."""
    out = {prefix: type(tc)}
    for f in dataclasses.fields(tc):
        value = getattr(tc, f.name)
        if is_tensorclass(value):
            out.update(classes(value, (*prefix, f.name)))
    return out


def class_name(cls: type) -> str:
    """``module:qualname`` of ``cls``, what ``import_class`` takes back."""
    return f"{cls.__module__}:{cls.__qualname__}"


def import_class(name: str) -> type:
    """The tensorclass ``class_name`` named, found among the modules this process has already
    imported; ``TypeError`` when it is not there, or is not one.

    Nothing is imported and no attribute hook runs: the name comes from a file (a dump's
    ``torchrl.json``, a state), and importing a module a file names runs whatever code sits under
    that name on ``sys.path`` (a ``payload.py`` beside the dump, with the working directory there)."""
    module, _, qualname = name.partition(":")
    obj: Any = sys.modules.get(module)
    for part in qualname.split(".") if obj is not None else ():
        # vars(), not getattr: a module's __getattr__ (PEP 562) may import, a class's may run code
        obj = vars(obj).get(part) if hasattr(obj, "__dict__") else None
        if obj is None:
            break
    if obj is None:
        raise TypeError(f"ShmStorage: the rows were written as tensorclass {name!r}, which is not among the modules "
                        f"imported here ({module!r} is {'imported' if module in sys.modules else 'not imported'}); "
                        "a class named by a file is never imported (that would run the code a file chose): import "
                        "its module before loading (a class defined inside a function cannot be found)")
    if not (isinstance(obj, type) and is_tensorclass(obj)):  # a name from a file: nothing else is built from it
        raise TypeError(f"ShmStorage: the rows name {name} as their tensorclass, which is a {type(obj).__name__}, "
                        "not a tensorclass: the state or dump is not one ShmStorage wrote")
    return obj
