"""shmbuffer: a replay buffer in shared memory, written by many processes, sampled by one learner."""

from .batch import Batch
from .buffer import BufferHandle, ReplayBuffer
from .collector import Collector, WorkerError
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
from .loader import Loader
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
    "Collector",
    "EmptyBufferError",
    "Field",
    "FieldError",
    "LayoutError",
    "Loader",
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
    "WorkerError",
    "export",
    "from_arrays",
    "load",
    "save",
]
