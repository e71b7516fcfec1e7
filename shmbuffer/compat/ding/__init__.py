"""DI-engine's ``ding.data.buffer`` (``DequeBuffer``, ``BufferedData``, its middleware) on a
shared-memory ``ReplayBuffer``.

::

    from shmbuffer.compat.ding import DequeBuffer, PriorityExperienceReplay, use_time_check

    buffer = DequeBuffer(size=10)
    buffer.use(PriorityExperienceReplay(buffer, IS_weight=True))
    buffer.push({"obs": np.zeros(4), "reward": 1.0}, meta={"priority": 2.0})
    buffer.push("any object", meta={"group": "a", "note": [1, 2]})
    data = buffer.sample(2)                 # [BufferedData(data=..., index=id, meta={...}), ...]

**A row.** DI-engine keeps any object; shared memory keeps fixed-size rows. The first push fixes
the row's layout (``Layout``):

* columns: each value of a ``dict`` ``data`` that is a Python ``int``/``float``/``bool``, a numpy
  number or numeric array, or a CPU torch tensor without grad, gets a field of its own, named by
  its key, in its shape and dtype (a bare such ``data`` gets the field ``ding_data``). These are
  copied without pickling, and ``buffer.buffer`` (the ``ReplayBuffer``) samples them as arrays.
* ``ding_object``: a fixed-size ``uint8`` slot holding what the columns do not take, encoded as
  ``codec`` specifies: the other keys of a dict, or the whole ``data`` when it does not fit the
  columns (another type, shape or dtype, a missing key). Its size is ``object_bytes`` (default:
  1 KiB, or 4 times the first push's encoding if larger); a push whose encoding is larger raises
  ``ValueError`` naming both sizes, and changes nothing.
* ``ding_meta``: the same for ``meta`` (``meta_bytes``, default 256 bytes, or 4 times the
  first), so ``meta`` takes any keys (``group``, ``env``, ``episode``, ``label``, ...).

Every row reads back as pushed: a value of a column in its Python type (``int``, ``float``,
numpy, torch), the rest decoded. The slots live in the row, under the row's commit stamp like
every field, so a reader never sees a half-written object. Any process that can attach to the
block can write a slot's bytes (and anyone can edit a ``save_data`` file), so by default slots
hold plain data in this facade's own encoding, not pickles (``codec``'s docstring is its byte
format): ``None``, ``bool``, ``int``, ``float``, ``complex``, ``str``, ``bytes``, lists, tuples,
sets, dicts (and ``OrderedDict``, ``Counter``, ``defaultdict``, ``deque``), ``range``, ``slice``,
numpy arrays, scalars and dtypes of numbers, bools, fixed-width strings and datetimes, torch
tensors, ``BufferedData``. Reading runs no code, makes no object that holds a pointer (no object
array or dtype) and allocates nothing larger than the slot. Anything else raises ``UnsafePickle``
naming it, at the push (nothing is stored); bytes a reader does not read as that encoding raise
``UnsafePickle`` naming the row, and the process and the buffer go on. ``DequeBuffer(size,
trusted_pickles=True)`` pickles any class instead, and loads pickles, for buffers whose every
writer is trusted; a buffer without it refuses a pickle it finds, naming what the pickle names.

**Middleware** has DI-engine's signature, ``mw(action, chain, *args, **kwargs)`` for the actions
``push``, ``sample``, ``update``, ``delete`` and ``clear``; the first middleware used is the
outermost, as in DI-engine (``apply_middleware``). This package's middleware
(``PriorityExperienceReplay``, ``use_time_check``, ``staleness_check``, ``clone_object``,
``group_sample``, ``padding``, ``sample_range_view``) are such functions; only
``PriorityExperienceReplay`` also shapes the storage (the sum tree in shared memory), so it is
used before the first push.

What differs from DI-engine is listed in docs/migration/ding.md: ``index`` is the row's id
(an ``int`` that never repeats) where DI-engine has a uuid string; ``PriorityExperienceReplay``
draws from the buffer's shared sum tree at the end of the chain (so a middleware used after it sees
``size``, not DI-engine's ``indices=``); ``priority_idx`` is the row's slot; a meta without the
``groupby`` key puts its row in no group; ``ignore_insufficient`` also covers too few groups.

The modules: ``codec`` (the slots' bytes, ``BufferedData``), ``row`` (the row: columns, slots,
``Layout``), ``deque``
(``DequeBuffer``, ``apply_middleware``, ``PriorityExperienceReplay``) and ``middleware`` (the
other middleware).
"""

from __future__ import annotations

from .deque import DequeBuffer, PriorityExperienceReplay, apply_middleware
from .middleware import clone_object, group_sample, padding, sample_range_view, staleness_check, use_time_check
from .row import DATA, META, META_BYTES, OBJECT, OBJECT_BYTES, BufferedData, Column, Layout  # noqa: F401  (the row's names, here too)

__all__ = [
    "BufferedData", "DequeBuffer", "Layout", "PriorityExperienceReplay", "apply_middleware", "clone_object",
    "group_sample", "padding", "sample_range_view", "staleness_check", "use_time_check",
]
