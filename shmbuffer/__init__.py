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
    SchemaError,
    SegmentNotFound,
    ShmBufferError,
    UnsupportedPlatform,
    WaitTimeout,
)
from .limiter import RateLimiter
from .samplers import Prioritized, Uniform
from .schema import Field, Schema

__version__ = "0.1.0"

__all__ = [
    "Batch",
    "BufferHandle",
    "CapacityError",
    "ClosedError",
    "EmptyBufferError",
    "Field",
    "FieldError",
    "LayoutError",
    "OutOfSharedMemory",
    "Prioritized",
    "RateLimiter",
    "ReplayBuffer",
    "Schema",
    "SchemaError",
    "SegmentNotFound",
    "ShmBufferError",
    "Uniform",
    "UnsupportedPlatform",
    "WaitTimeout",
]
