"""shmbuffer: a replay buffer in shared memory, written by many processes, sampled by one learner."""

from .batch import Batch
from .buffer import BufferHandle, ReplayBuffer
from .collector import Collector, WorkerError
from .device import DeviceReplay
from .errors import (
    CapacityError,
    ClosedError,
    EmptyBufferError,
    FieldError,
    ForeignBlock,
    ForeignCall,
    LayoutError,
    OutOfSharedMemory,
    PositionError,
    ReadOnlyError,
    SamplerError,
    SchemaError,
    SegmentNotFound,
    ShmBufferError,
    UnknownIdError,
    UnknownKey,
    UnknownKeyword,
    UnknownName,
    UnknownSampler,
    UnsafePickle,
    UnsupportedPlatform,
    WaitTimeout,
)
from .hindsight import Hindsight
from .loader import Loader
from .mixing import Buffers, Mix
from .persistence import export, save
from .sampling.limiter import RateLimiter
from .sampling.samplers import Draw, Prioritized, Sampler, Uniform
from .schema import Field, Schema

__version__ = "0.1.0"

load = ReplayBuffer.load
"""``load(path, *, name=None, capacity=None, seed=None)``: a new buffer holding a save (``persistence.loading``)."""
from_arrays = ReplayBuffer.from_arrays
"""``from_arrays(schema, arrays, capacity=None, **options)``: a new buffer of these rows (``persistence.arrays``)."""

__all__ = [
    "Batch",
    "BufferHandle",
    "Buffers",
    "CapacityError",
    "DeviceReplay",
    "Draw",
    "ClosedError",
    "Collector",
    "EmptyBufferError",
    "Field",
    "FieldError",
    "ForeignCall",
    "ForeignBlock",
    "Hindsight",
    "LayoutError",
    "Loader",
    "Mix",
    "OutOfSharedMemory",
    "PositionError",
    "Prioritized",
    "RateLimiter",
    "ReadOnlyError",
    "ReplayBuffer",
    "Schema",
    "SchemaError",
    "SegmentNotFound",
    "ShmBufferError",
    "Sampler",
    "SamplerError",
    "Uniform",
    "UnknownIdError",
    "UnknownKey",
    "UnknownKeyword",
    "UnsafePickle",
    "UnknownName",
    "UnknownSampler",
    "UnsupportedPlatform",
    "WaitTimeout",
    "WorkerError",
    "export",
    "from_arrays",
    "load",
    "save",
]
