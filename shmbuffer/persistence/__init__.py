"""Saving and loading buffers, and plain numpy export/import.

``save(buf, path)`` writes the directory ``path/`` with two files; ``load(path, factory)`` makes a
new buffer in shared memory with the same schema, options, rows, row ids, priorities and use
counts. Nothing is pickled. ``export(buf)`` and ``from_arrays(schema, arrays, factory)`` trade all
rows as a dict of numpy arrays.

The package, lowest module first:

* ``format``: the save format, byte by byte (its docstring is the spec), one constant per format
  version, the tensors and the file's layout.
* ``snapshot``: a live buffer's rows as of one moment (``protocol/snapshot.py``: read through the
  reader's stamped gather while writers go on), copied into a sink.
* ``saving``: ``save``: the directory and its files, written safely.
* ``loading``: ``load``, with every entry checked, and one reader per format version (``READERS``).
* ``arrays``: ``export``, ``pieces``, ``from_arrays``, ``import_rows``, ``set_uses``, ``pending``.
* ``manifest``: the checkpoint format (its docstring is the spec): a manifest and chunks, checked.
* ``checkpoint``: ``checkpoint``: what changed since the last checkpoint, crash-safe.
* ``resume``: ``resume``: a new buffer as at the last complete checkpoint; ``resume_sampling``:
  another process's sampling state (a rank's step, a device copy's generator) as at it.

This module re-exports their public names.
"""

from __future__ import annotations

from .arrays import export, from_arrays, import_rows, pending, pieces, set_uses
from .checkpoint import checkpoint
from .format import (
    ALIGN,
    FORMAT,
    FORMAT_VERSION_1,
    FORMAT_VERSION_2,
    FORMAT_VERSION_3,
    MAX_BLOCK,
    MAX_HEADER,
    MAX_ROW,
    META,
    ROWS,
    VERSION,
    VERSIONS,
)
from .loading import READERS, load
from .manifest import CHECKPOINT_VERSION, MANIFEST
from .resume import resume, resume_sampling
from .saving import Progress, save
from .snapshot import CHUNK_BYTES, Buffer

__all__ = [
    "ALIGN", "CHECKPOINT_VERSION", "CHUNK_BYTES", "FORMAT", "FORMAT_VERSION_1", "FORMAT_VERSION_2", "FORMAT_VERSION_3",
    "MAX_BLOCK", "MAX_HEADER", "MAX_ROW", "MANIFEST", "META", "READERS", "ROWS", "VERSION", "VERSIONS", "Buffer",
    "Progress", "checkpoint", "export", "from_arrays", "import_rows", "load", "pending", "pieces", "resume", "resume_sampling", "save",
    "set_uses",
]
