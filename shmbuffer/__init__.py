"""shmbuffer: a replay buffer in shared memory, written by many processes, sampled by one learner."""

from .batch import Batch
from .buffer import BufferHandle, ReplayBuffer
from .errors import (
    CapacityError,
    ClosedError,
    EmptyBufferError,
    FieldError,
    LayoutError,
    OutOfSharedMemory,
    ReadOnlyError,
    SchemaError,
    SegmentNotFound,
    ShmBufferError,
    UnsupportedPlatform,
    WaitTimeout,
)
from .limiter import RateLimiter
from .mixing import Buffers, Mix
from .persistence import export, from_arrays, load, save
from .samplers import Prioritized, Uniform
from .schema import Field, Schema

__version__ = "0.1.0"

__all__ = [
    "Batch",
    "BufferHandle",
    "Buffers",
    "CapacityError",
    "ClosedError",
    "EmptyBufferError",
    "Field",
    "FieldError",
    "LayoutError",
    "Mix",
    "OutOfSharedMemory",
    "Prioritized",
    "RateLimiter",
    "ReadOnlyError",
    "ReplayBuffer",
    "Schema",
    "SchemaError",
    "SegmentNotFound",
    "ShmBufferError",
    "Uniform",
    "UnsupportedPlatform",
    "WaitTimeout",
    "export",
    "from_arrays",
    "load",
    "save",
]
