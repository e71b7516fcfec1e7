"""What users of other replay buffers reach for, and our name for it: the one table of hints.

A method, keyword or batch key of cpprb, Stable-Baselines3, TorchRL, DI-engine, MindSpore RL or
Velora that shmbuffer lacks ends in an error naming our equivalent (``Hint`` on ``ReplayBuffer``,
the ``**unknown`` keywords of ``ReplayBuffer`` and ``sample``, ``Batch``'s missing keys) instead
of a bare ``AttributeError``/``TypeError``/``KeyError``. Every entry comes from the library's page
in docs/migration/ (``tests/test_hints.py`` checks that each of their names is written there), and
each error names that page.
"""

from __future__ import annotations

from collections.abc import Mapping
from numbers import Integral
from typing import Any

from .errors import ForeignCall, UnknownKeyword, UnknownName

DOCS = "docs/migration/"
PAGES = {"cpprb": "cpprb", "TorchRL": "torchrl", "MindSpore RL": "mindspore", "DI-engine": "ding", "nerveX": "ding",
         "Velora": "velora", "Stable-Baselines3": "sb3", "SB3": "sb3"}


def page(whose: str) -> str:
    """The migration page of the library ``whose`` names first (``"cpprb's stack_compress"``:
    cpprb's), or the index when it names none."""
    for lib, name in PAGES.items():
        if whose.startswith(lib):
            return f"{DOCS}{name}.md"
    return f"{DOCS}index.md"


# name: (whose, what to use here). Methods and attributes of their buffers.
METHODS: dict[str, tuple[str, str]] = {
    "add": ("cpprb", "push(**fields), or shmbuffer.compat.cpprb.ReplayBuffer(size, env_dict) with cpprb's names"),
    "get_all_transitions": ("cpprb", "export() (a dict of the fields, index, ...) or get(slice(None)), or "
                                     "shmbuffer.compat.cpprb.ReplayBuffer's get_all_transitions()"),
    "export_data": ("DI-engine", "export(), or shmbuffer.compat.ding.DequeBuffer's export_data()"),
    "reset": ("MindSpore RL", "clear(), or shmbuffer.compat.mindspore.ReplayBuffer's reset()"),
    "get_stored_size": ("cpprb", "len(buf) or buf.size"),
    "get_buffer_size": ("cpprb", "buf.capacity"),
    "get_next_index": ("cpprb", "no equivalent; buf.stats['inserted'] counts the rows ever reserved"),
    "on_episode_end": ("cpprb", "no call: each push names its episode, push(..., episode=id), on a buffer made with episodes=True"),
    "get_max_priority": ("cpprb", "no equivalent"),
    "save_transitions": ("cpprb", "buf.save(directory), or shmbuffer.save(buf, directory)"),
    "load_transitions": ("cpprb", "ReplayBuffer.load(directory), or shmbuffer.load(directory)"),
    "extend": ("TorchRL", "push(...) with a leading dimension: k rows in one call"),
    "update_priority": ("TorchRL", "update_priorities(batch_or_ids, priorities)"),
    "empty": ("TorchRL", "clear()"),
    "write_count": ("TorchRL", "buf.stats['inserted']"),
    "dumps": ("TorchRL", "buf.save(directory), or shmbuffer.save(buf, directory)"),
    "loads": ("TorchRL", "ReplayBuffer.load(directory), or shmbuffer.load(directory)"),
    "insert": ("MindSpore RL", "push(**fields): fields by name, one row or k rows"),
    "get_item": ("MindSpore RL", "get(index): 0 is the oldest row, -1 the newest"),
    "destroy": ("MindSpore RL", "close(), plus unlink() in the creating process (a with block does both)"),
    "import_data": ("DI-engine", "ReplayBuffer.from_arrays(schema, arrays)"),
    "add_multi": ("Velora", "push(...) with a leading dimension: k rows in one call"),
    "state_dict": ("Velora", "export(): a dict of numpy arrays"),
    "buffer_size": ("Stable-Baselines3", "buf.capacity"),
    "n_envs": ("Stable-Baselines3", "buf.lanes (make the buffer with envs=n_envs)"),
}

# keyword: (whose, what to do here). Keywords of their constructors and sample calls.
KEYWORDS: dict[str, tuple[str, str]] = {
    "beta": ("cpprb's and MindSpore RL's sample(..., beta)",
             "beta is not given per call: fix it in sampler=Prioritized(beta=...), or anneal it to 1 "
             "over Prioritized(beta_steps=...) sample calls"),
    "env": ("Stable-Baselines3's sample(batch_size, env)",
            "there is no VecNormalize here: normalise the batch yourself, or use shmbuffer.sb3.ReplayBuffer"),
    "batch_size": ("the batch_size keyword",
                   "give the number of rows first: sample(n), or Loader(buf, batch_size) for batches ahead"),
    "return_info": ("TorchRL's sample(return_info=True)",
                    "the batch carries it: batch.index holds the ids, batch.weight the importance weights"),
    "indices": ("DI-engine's sample(indices=...)", "take(ids) reads rows by id"),
    "priorities": ("cpprb's add(priorities=...)", "push(..., priority=p)"),
    "infos": ("Stable-Baselines3's add(..., infos)", "there is no infos; store what you need as a field"),
    "meta": ("DI-engine's push(data, meta)", "pass episode=, priority= and lane= as keywords of push"),
    "Nstep": ("cpprb's Nstep={...}",
              "make the buffer with episodes=True and sample(n, n_step=3, gamma=0.99)"),
    "stack_compress": ("cpprb's stack_compress", "stack='obs'"),
    "default_dtype": ("cpprb's default_dtype", "give each field its dtype in the schema"),
    "mmap_prefix": ("cpprb's mmap_prefix", "no equivalent: the rows live in /dev/shm"),
    "observation_space": ("Stable-Baselines3's ReplayBuffer(buffer_size, observation_space, ...)",
                          "write a Schema from the spaces, or use shmbuffer.sb3.ReplayBuffer"),
    "action_space": ("Stable-Baselines3's ReplayBuffer(buffer_size, observation_space, action_space)",
                     "write a Schema from the spaces, or use shmbuffer.sb3.ReplayBuffer"),
    "buffer_size": ("Stable-Baselines3's buffer_size",
                    "ReplayBuffer(schema, capacity) with a Schema written from the spaces, or "
                    "shmbuffer.sb3.ReplayBuffer(buffer_size, observation_space, action_space) as a drop-in"),
    "size": ("cpprb's ReplayBuffer(size, env_dict)",
             "ReplayBuffer(env_dict, capacity): the schema first (an env_dict is one), the capacity second; "
             "or shmbuffer.compat.cpprb.ReplayBuffer(size, env_dict), cpprb's names on a shared buffer"),
    "env_dict": ("cpprb's ReplayBuffer(size, env_dict)",
                 "ReplayBuffer(env_dict, capacity): the schema first (an env_dict is one), the capacity second; "
                 "or shmbuffer.compat.cpprb.ReplayBuffer(size, env_dict), cpprb's names on a shared buffer"),
    "n_envs": ("Stable-Baselines3's n_envs", "envs=n_envs: one lane per env"),
    "device": ("the device keyword", "batch.to(device), or Loader(buf, batch_size, device=...)"),
    "handle_timeout_termination": ("Stable-Baselines3's handle_timeout_termination",
                                   "store done = terminated, and a truncated field if you want one"),
    "optimize_memory_usage": ("Stable-Baselines3's optimize_memory_usage", "next_of='obs'"),
    "storage": ("TorchRL's ReplayBuffer(storage=...)",
                "ReplayBuffer(schema, capacity), or TorchRL's buffer over shmbuffer.torchrl.ShmStorage(capacity)"),
    "max_size": ("TorchRL's storages' max_size",
                 "ReplayBuffer(schema, capacity), or TorchRL's buffer over shmbuffer.torchrl.ShmStorage(max_size)"),
    "prefetch": ("TorchRL's prefetch", "Loader(buf, batch_size, prefetch=k)"),
    "pin_memory": ("TorchRL's pin_memory", "Loader(buf, batch_size, device='cuda')"),
    "transform": ("TorchRL's transform", "no equivalent: transform the batch yourself"),
}

# key: (whose, what to read here). Keys (and attributes) of their sampled batches.
KEYS: dict[str, tuple[str, str]] = {
    "weights": ("cpprb", "batch.weight (or batch['weight'])"),
    "indexes": ("cpprb", "batch.index (or batch['index'])"),
    "priority_weight": ("TorchRL", "batch.weight (or batch['weight'])"),
    "observations": ("Stable-Baselines3", "the names of your schema's fields"),
    "next_observations": ("Stable-Baselines3", "the names of your schema's fields"),
    "actions": ("Stable-Baselines3", "the names of your schema's fields"),
    "rewards": ("Stable-Baselines3", "the names of your schema's fields"),
    "dones": ("Stable-Baselines3", "the names of your schema's fields"),
}


def name_error(obj: object, name: str) -> AttributeError:
    """The ``AttributeError`` for a missing attribute ``name`` of ``obj``: with our equivalent
    when another library has that name (``UnknownName``), else the plain one."""
    kind = obj.__name__ if isinstance(obj, type) else type(obj).__name__
    hint = METHODS.get(name)
    if hint is None:
        return AttributeError(f"{kind!r} object has no attribute {name!r}", name=name, obj=obj)
    whose, ours = hint
    return UnknownName(f"{kind} has no {name!r} ({whose}'s name); here: {ours}. See {page(whose)}.", name=name, obj=obj)


class Hint:
    """Another library's name on one of our classes (``METHODS``): reading it raises the
    ``UnknownName`` that names ours. A descriptor per name, so that reads of the class's own
    names never pass through a ``__getattr__``."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.__doc__ = f"Not here: {METHODS[name][1]}."

    def __get__(self, obj: object, owner: type | None = None) -> Any:
        raise name_error(obj if obj is not None else owner, self.name)


def keyword_error(call: str, unknown: dict[str, object]) -> TypeError:
    """The ``TypeError`` for keywords ``call`` does not take: with our equivalent when another
    library takes that keyword (``UnknownKeyword``)."""
    name = next(iter(unknown))
    hint = KEYWORDS.get(name)
    if hint is None:
        return UnknownKeyword(f"{call}() got an unexpected keyword argument {name!r}; see help({call}) and {DOCS}index.md")
    whose, ours = hint
    return UnknownKeyword(f"{call}() takes no {name!r} ({whose}); here: {ours}. See {page(whose)}.")


def constructor_error(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> TypeError | None:
    """The error for ``ReplayBuffer(*args, **kwargs)`` called in another library's form, or ``None``.

    Checked before Python binds the arguments, which would otherwise answer cpprb's
    ``ReplayBuffer(1000, env_dict={...})`` with "missing 1 required positional argument".
    """
    foreign = {k: v for k, v in kwargs.items() if k in KEYWORDS}
    if foreign:  # SB3's buffer_size=, TorchRL's storage=, cpprb's env_dict= ...
        return keyword_error("ReplayBuffer", foreign)
    if args and type(args[0]).__module__.split(".")[0] == "torchrl":  # a TorchRL storage
        return ForeignCall(f"ReplayBuffer({type(args[0]).__name__}(...)) is TorchRL's ReplayBuffer(storage=...); "
                           "here: ReplayBuffer(schema, capacity), or TorchRL's ReplayBuffer over "
                           f"shmbuffer.torchrl.ShmStorage(max_size), a shared storage. See {DOCS}torchrl.md.")
    if not args or not isinstance(args[0], Integral) or isinstance(args[0], bool):
        return None
    size = args[0]
    if len(args) >= 3:
        whose = "Stable-Baselines3's ReplayBuffer(buffer_size, observation_space, action_space)"
        ours = (f"ReplayBuffer(schema, {size}, envs=n_envs) with a Schema written from the spaces, or "
                f"shmbuffer.sb3.ReplayBuffer({size}, observation_space, action_space) as a drop-in")
    elif len(args) == 2 and isinstance(args[1], Mapping):
        whose = "cpprb's ReplayBuffer(size, env_dict)"
        ours = (f"ReplayBuffer(env_dict, {size}): the schema first (an env_dict is one), the capacity second; "
                f"or shmbuffer.compat.cpprb.ReplayBuffer({size}, env_dict), cpprb's names on a shared buffer")
    else:
        return ForeignCall(f"ReplayBuffer({size}, ...): the capacity came first; here the schema comes first, "
                           f"ReplayBuffer(schema, {size}). See {DOCS}index.md.")
    return ForeignCall(f"ReplayBuffer({size}, ...) is {whose}; here: {ours}. See {page(whose)}.")


def key_hint(name: str) -> str:
    """The sentence naming our equivalent of another library's batch key, or ``""``."""
    hint = KEYS.get(name)
    return "" if hint is None else f"; {name!r} is {hint[0]}'s name, here: {hint[1]} (see {page(hint[0])})"
