"""The exceptions shmbuffer raises, in one place.

Every error names the thing, what was expected, what came, and how to fix it. Each class also
derives from the builtin a caller would naturally catch (``ValueError`` for bad input,
``FileNotFoundError`` for a missing segment, ``TimeoutError`` for a wait that ran out).
"""

from __future__ import annotations

import pickle


class ShmBufferError(Exception):
    """Base class of every exception raised on purpose by shmbuffer."""


class SchemaError(ShmBufferError, ValueError):
    """A schema is malformed (bad name, shape or dtype), or two schemas do not match."""


class FieldError(ShmBufferError, ValueError):
    """Pushed data does not fit the schema: missing, unknown, wrong shape, ragged or unsafe dtype."""


class CapacityError(ShmBufferError, ValueError):
    """A request is larger than the buffer can ever hold (a push of more rows than a lane holds)."""


class EmptyBufferError(ShmBufferError, LookupError):
    """Sampling or reading rows that are not there (an empty buffer, too few rows, a bad index)."""


class SamplerError(ShmBufferError, ValueError):
    """A sampler's own ``draw`` returned what no draw may (not a 1-D integer array, more ids than
    asked, ids that never named a row): a bug of that sampler, which the message names."""


class UnknownSampler(ShmBufferError, LookupError):
    """A buffer or a save names a sampler kind that no class of this process defines: import the
    module the message names, or pass the class (``ReplayBuffer.attach(name, sampler=Class)``)."""


class PositionError(EmptyBufferError, IndexError):
    """``get(i)`` past the rows held: an ``IndexError`` too, as a sequence's index is."""


class UnknownIdError(FieldError, EmptyBufferError):
    """Ids that never named a row of the buffer: negative, or beyond every row pushed so far.
    Both a ``FieldError`` (bad input) and an ``EmptyBufferError`` (what ``take`` raised for them
    before); unlike a row overwritten since it was sampled, this is never a race."""


class SegmentNotFound(ShmBufferError, FileNotFoundError):
    """No shared-memory segment of that name exists."""


class LayoutError(ShmBufferError, ValueError):
    """A segment exists but is not a shmbuffer block of a layout this version can read."""


class ForeignBlock(LayoutError, PermissionError):
    """A file under our name that is not ours to read, map or remove: not a regular file, another
    user's, or open to other users (``segment.py``)."""


class OutOfSharedMemory(ShmBufferError, MemoryError):
    """``/dev/shm`` has too little free space for the requested buffer."""


class ClosedError(ShmBufferError, RuntimeError):
    """The buffer was closed in this process."""


def closed(name: str) -> ClosedError:
    """The ``ClosedError`` of buffer ``name``, saying how to get it back."""
    return ClosedError(
        f"buffer {name!r} is closed in this process; attach it again with ReplayBuffer.attach({name!r}) "
        "(or its handle) while its creator holds it, or use it inside its with block")


class WaitTimeout(ShmBufferError, TimeoutError):
    """A bounded wait ran out: a lock, a stalled writer, a rate limiter or a source with too few rows."""


class ReadOnlyError(ShmBufferError, PermissionError):
    """A push or clear on a buffer that was frozen (expert demonstrations, loaded data)."""


class UnsupportedPlatform(ShmBufferError, RuntimeError):
    """The platform lacks what the commit protocol needs (see ``ring.py``)."""


class UnknownName(ShmBufferError, AttributeError):
    """An attribute another replay buffer library has and shmbuffer names otherwise (``hints.py``)."""


class UnknownKeyword(ShmBufferError, TypeError):
    """A keyword a call does not take, often another library's (``hints.py``)."""


class ForeignCall(ShmBufferError, TypeError):
    """A constructor called in another library's form, such as cpprb's ``ReplayBuffer(size, env_dict)``
    or Stable-Baselines3's ``ReplayBuffer(buffer_size, observation_space, action_space)`` (``hints.py``)."""


class UnsafePickle(FieldError, pickle.UnpicklingError):
    """A stored object's pickle names a type the restricted unpickler does not load, or is not a
    pickle the buffer wrote (``shmbuffer.compat.ding``: ``trusted_pickles``)."""


class UnknownKey(ShmBufferError, KeyError):
    """A batch has no field or extra of that name (``Batch``); the message names what it has."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""  # KeyError would quote the whole sentence
