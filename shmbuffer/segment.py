"""Shared-memory segments: one block per buffer, its byte layout, naming and lifecycle.

Layout version 1
----------------
A block is the file ``/dev/shm/shmbuffer-<name>`` (``PREFIX`` + the buffer's name). All integers
are little-endian::

    offset  size  content
    0       8     magic b"\\x93SHMBUF\\x00"
    8       4     layout version, uint32 (1)
    12      4     metadata length in bytes, uint32
    16      8     total block size in bytes, uint64
    24      8     data offset: where the first column starts, uint64, a multiple of 64
    32      8     creator pid, int64
    40      8     creator start time, float64 (seconds since the epoch, as psutil reports it)
    48      16    fingerprint of the schema (``Schema.fingerprint``), raw bytes
    64      n     metadata, UTF-8 JSON: {"schema": [...], "columns": [...], "options": {...}}
    data    ...   the columns, each aligned to 64 bytes; each "columns" entry gives its name,
                  shape, dtype (numpy ``dtype.str``) and offset from the data offset

Creation goes in this order: the file is created (``O_EXCL``) and at once registered with the
resource tracker; the header (magic left zero, creator pid and start time included) and the
metadata are written; the pages are reserved (``posix_fallocate``, seconds for a block of GBs); the
magic is written last, so a block that is still being created reads as "not ready". A block
without magic names its creator from the start, so ``shmbuffer gc`` can tell one being created
(its creator alive) from one whose creator died creating it (``unfinished_creator``). Which
columns exist and what they mean belongs to the modules that use them (``ring.py`` for the commit
protocol's columns, ``buffer.py`` for the fields); this module only maps them.

Lifecycle
---------
The creating process owns the block: ``unlink()`` removes its name and happens at the creator's
``close()``-and-exit or garbage collection (``weakref.finalize``), never in another process. It is
also registered with multiprocessing's resource tracker, right after the file is created, so a
creator killed by SIGKILL, even while it creates the block, still has its block removed when its
tracker notices. A creation that fails (no space, an interrupt) removes the file and unregisters.
Attaching maps ``/dev/shm/NAME`` with ``mmap`` directly and never touches a resource tracker, so
attaching processes cause no warnings and never unlink on exit (the stdlib ``SharedMemory``
registers every attach, and an unrelated process's tracker then unlinks the block when that
process exits). ``close()`` unmaps this process's view; it raises
``BufferError`` while arrays made from the mapping are alive, and may be called again once they are
gone. Both are idempotent.

Blocks are created with mode 0600 and their pages reserved up front with ``posix_fallocate``: a
tmpfs that runs out of pages later kills the writer with SIGBUS, the worst failure a user of a
replay buffer can meet, so it is refused at creation instead.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import re
import secrets
import struct
import time
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import psutil

from .errors import LayoutError, OutOfSharedMemory, SegmentNotFound, ShmBufferError

SHM_DIR = "/dev/shm"
PREFIX = "shmbuffer-"
MAGIC = b"\x93SHMBUF\x00"
VERSION = 1
ALIGN = 64
_HEADER = struct.Struct("<8sIIQQqd16s")
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,200}")


@dataclass(frozen=True)
class ColumnSpec:
    """A column to allocate: ``shape`` includes the row dimension."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype[Any]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


@dataclass(frozen=True)
class Header:
    """The fixed part of a block's header and its metadata, read without mapping the block."""

    name: str
    version: int
    size: int
    data_offset: int
    creator_pid: int
    creator_start: float
    fingerprint: str
    meta: dict[str, Any]

    @property
    def creator_alive(self) -> bool:
        return process_alive(self.creator_pid, self.creator_start)


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def human(nbytes: float) -> str:
    """``61 MiB``, ``7.1 GiB``: sizes in error messages and listings."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit in ("B", "KiB", "MiB") else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def path_of(name: str) -> str:
    return os.path.join(SHM_DIR, PREFIX + name)


def check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(
            f"buffer name {name!r}: expected 1-200 characters from A-Z a-z 0-9 _ . -"
        )
    return name


def new_name() -> str:
    return f"{os.getpid()}-{secrets.token_hex(4)}"


def list_names() -> list[str]:
    """Names of every block of ours in ``/dev/shm`` (live or stale), sorted."""
    try:
        entries = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    return sorted(e[len(PREFIX):] for e in entries if e.startswith(PREFIX))


_START_TIMES: dict[int, float] = {}


def start_time(pid: int | None = None) -> float:
    """The start time psutil reports for ``pid`` (this process by default); pid + start time
    names a process uniquely even after its pid is reused."""
    pid = os.getpid() if pid is None else pid
    if pid not in _START_TIMES:
        _START_TIMES[pid] = psutil.Process(pid).create_time()
    return _START_TIMES[pid]


def process_alive(pid: int, started: float) -> bool:
    """True while the process ``pid`` that started at ``started`` runs; a zombie counts as dead."""
    if pid <= 0:
        return False
    try:
        proc = psutil.Process(pid)
        return abs(proc.create_time() - started) < 0.01 and proc.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


def free_bytes() -> int:
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def _open(name: str, flags: int = os.O_RDONLY) -> int:
    try:
        return os.open(path_of(check_name(name)), flags)
    except FileNotFoundError:
        raise SegmentNotFound(_not_found(name)) from None


def read_header(name: str) -> Header:
    """Read a block's header and metadata with ``pread``; raises if it is not one of ours."""
    fd = _open(name)
    try:
        return _parse_header(name, fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def _not_found(name: str) -> str:
    live = list_names()
    listing = ", ".join(live[:10]) + (" ..." if len(live) > 10 else "") if live else "none"
    return f"no buffer named {name!r} ({path_of(name)} does not exist); buffers here: {listing}"


def unfinished_creator(name: str) -> tuple[int, float] | None:
    """The creator (pid, start time) of a block whose magic is not written yet: one being created,
    or one whose creator died creating it. ``None`` for a block with its magic, or one that names no
    creator (too short, another layout version, pid 0)."""
    fd = _open(name)
    try:
        raw = os.pread(fd, _HEADER.size, 0)
    finally:
        os.close(fd)
    if len(raw) < _HEADER.size or raw[:8] != bytes(8):
        return None
    _, version, _, _, _, pid, started, _ = _HEADER.unpack(raw)
    if version != VERSION or pid <= 0 or not started > 0:
        return None
    return int(pid), float(started)


def _parse_header(name: str, fd: int, size: int, wait: float = 2.0) -> Header:
    deadline = time.monotonic() + wait
    while True:
        raw = os.pread(fd, _HEADER.size, 0)
        if len(raw) == _HEADER.size and raw[:8] == MAGIC:
            break
        if len(raw) == _HEADER.size and raw[:8] == bytes(8) and time.monotonic() < deadline:
            time.sleep(0.005)  # the creator writes the magic last: it may still be initialising
            continue
        raise LayoutError(
            f"{path_of(name)} is not a shmbuffer block (magic {raw[:8]!r}, expected {MAGIC!r}"
            f"{'; it may still be being created' if raw[:8] == bytes(8) else ''})"
        )
    _, version, meta_len, total, data_offset, pid, started, fp = _HEADER.unpack(raw)
    if version != VERSION:
        raise LayoutError(
            f"buffer {name!r} has layout version {version}; this shmbuffer reads version {VERSION}: "
            "use the shmbuffer release that created it"
        )
    if total != size or data_offset > size or _HEADER.size + meta_len > data_offset:
        raise LayoutError(
            f"buffer {name!r} is damaged: header says {total} bytes and data at {data_offset}, "
            f"the file has {size} bytes"
        )
    try:
        meta = json.loads(os.pread(fd, meta_len, _HEADER.size))
    except ValueError as exc:
        raise LayoutError(f"buffer {name!r}: its metadata is not valid JSON ({exc})") from None
    return Header(name, version, total, data_offset, pid, started, fp.hex(), meta)


def _release(mm: mmap.mmap | None, path: str, owner_pid: int, registered: bool) -> None:
    """Finalizer: unmap, and unlink if this process created the block. Must not reference the
    Segment; runs at garbage collection or interpreter exit."""
    if mm is not None:
        try:
            mm.close()
        except BufferError:
            pass  # arrays still alive at exit; the kernel unmaps when the process ends
    if os.getpid() == owner_pid:  # a forked child inherits this finalizer but owns nothing
        _unlink(path, registered)


def _unlink(path: str, registered: bool) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    if registered:
        from multiprocessing import resource_tracker

        try:
            resource_tracker.unregister("/" + os.path.basename(path), "shared_memory")
        except Exception:  # the tracker may already be gone at interpreter exit
            pass


class Segment:
    """A mapped block: its header, metadata and numpy views of its columns."""

    # class-level defaults, so close() works after a half-finished __init__
    _mm: mmap.mmap | None = None
    _finalizer: weakref.finalize | None = None
    _creator_pid = -1
    _unlinked = True
    arrays: dict[str, np.ndarray] = {}  # noqa: RUF012 (replaced per instance)

    def __init__(self, header: Header, mm: mmap.mmap, created: bool) -> None:
        self.name = header.name
        self.header = header
        self._mm = mm
        self._path = path_of(header.name)
        self._creator_pid = os.getpid() if created else -1
        self._unlinked = not created
        self.arrays = {}
        for col in header.meta["columns"]:
            dtype = np.dtype(col["dtype"])
            shape = tuple(col["shape"])
            count = int(np.prod(shape, dtype=np.int64))
            arr = np.frombuffer(mm, dtype=dtype, count=count, offset=header.data_offset + col["offset"])
            self.arrays[col["name"]] = arr.reshape(shape)
        self._arm()

    def _arm(self) -> None:
        if self._finalizer is not None:
            self._finalizer.detach()
        unlink = self.owner and not self._unlinked
        self._finalizer = weakref.finalize(
            self, _release, self._mm, self._path, self._creator_pid if unlink else -1, unlink
        )

    @property
    def owner(self) -> bool:
        """True in the process that created the block (not in a child forked from it)."""
        return self._creator_pid == os.getpid()

    @property
    def meta(self) -> dict[str, Any]:
        return self.header.meta

    @property
    def closed(self) -> bool:
        return self._mm is None

    @classmethod
    def create(cls, name: str | None, meta: dict[str, Any], columns: list[ColumnSpec], fingerprint: str) -> Segment:
        name = check_name(name) if name is not None else new_name()
        entries, at = [], 0
        for col in columns:
            entries.append({"name": col.name, "shape": list(col.shape), "dtype": col.dtype.str, "offset": at})
            at = _align(at + col.nbytes)
        blob = json.dumps({**meta, "columns": entries}, separators=(",", ":")).encode()
        data_offset = _align(_HEADER.size + len(blob))
        size = data_offset + max(at, ALIGN)
        free = free_bytes()
        if size > free:
            raise OutOfSharedMemory(
                f"{SHM_DIR} has {human(free)} free, the buffer needs {human(size)}: lower capacity "
                "or enlarge /dev/shm (docker: --shm-size)"
            )
        path = path_of(name)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except FileExistsError:
            raise FileExistsError(errno.EEXIST, _exists(name), path) from None
        registered = False
        try:
            from multiprocessing import resource_tracker

            # first: from here on a creator killed by SIGKILL has its tracker remove the block
            resource_tracker.register("/" + PREFIX + name, "shared_memory")
            registered = True
            pid, started = os.getpid(), start_time()
            raw = _HEADER.pack(bytes(8), VERSION, len(blob), size, data_offset, pid, started, bytes.fromhex(fingerprint))
            try:
                # the creator is on record before the seconds a large fallocate takes (shmbuffer gc)
                head, done = raw + blob, 0
                while done < len(head):
                    done += os.pwrite(fd, head[done:], done)
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                raise OutOfSharedMemory(
                    f"{SHM_DIR} ran out of space reserving {human(size)} for buffer {name!r} "
                    f"({human(free_bytes())} free now): lower capacity or enlarge /dev/shm "
                    "(docker: --shm-size)"
                ) from None
            mm = mmap.mmap(fd, size)
            header = Header(name, VERSION, size, data_offset, pid, started, fingerprint, json.loads(blob))
            mm[:8] = MAGIC  # last: the block is ready
            return cls(header, mm, created=True)
        except BaseException:
            _unlink(path, registered)
            raise
        finally:
            os.close(fd)

    @classmethod
    def attach(cls, name: str) -> Segment:
        path = path_of(check_name(name))
        fd = _open(name, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size < _HEADER.size:
                raise LayoutError(f"{path} is not a shmbuffer block ({size} bytes, too small)")
            header = _parse_header(name, fd, size)
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return cls(header, mm, created=False)

    def close(self, *, defer: bool = False) -> None:
        """Unmap this process's view. Idempotent. While arrays made from the mapping are alive,
        raise ``BufferError`` — or, with ``defer``, let go of it: the mapping then goes away with
        the last of those arrays."""
        if self._mm is None:
            return
        self.arrays = {}
        try:
            self._mm.close()
        except BufferError:
            if not defer:
                raise BufferError(
                    f"buffer {self.name!r}: arrays made from its shared memory are still alive (from "
                    "view(), column() or torch tensors of them); delete them and call close() again"
                ) from None
        self._mm = None
        if not (self.owner and not self._unlinked) and self._finalizer is not None:
            self._finalizer.detach()

    def unlink(self) -> None:
        """Remove the block's name; mappings that exist stay valid. Idempotent."""
        if self._unlinked and not os.path.exists(self._path):
            return
        _unlink(self._path, registered=self.owner and not self._unlinked)
        self._unlinked = True
        if self._mm is None:
            if self._finalizer is not None:
                self._finalizer.detach()
        else:
            self._arm()


def _exists(name: str) -> str:
    try:
        h = read_header(name)
        who = f"created by pid {h.creator_pid}, {'alive' if h.creator_alive else 'dead'}"
    except ShmBufferError as exc:
        who = str(exc)
    return f"a buffer named {name!r} already exists ({who}); pick another name, attach to it, or remove stale ones with `shmbuffer gc`"
