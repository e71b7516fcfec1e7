"""Shared-memory segments: one block per buffer, its byte layout, naming and lifecycle.

Layout version 2
----------------
A block is the file ``/dev/shm/shmbuffer-<name>`` (``PREFIX`` + the buffer's name). All integers
are little-endian (version 2 added the ``_edits`` column, ``protocol/layout.py``)::

    offset  size  content
    0       8     magic b"\\x93SHMBUF\\x00"
    8       4     layout version, uint32 (2)
    12      4     metadata length in bytes, uint32
    16      8     total block size in bytes, uint64
    24      8     data offset: where the first column starts, uint64, a multiple of 64
    32      8     creator pid, int64
    40      8     creator start time, float64 (seconds since the epoch, as psutil reports it)
    48      16    fingerprint of the schema (``Schema.fingerprint``), raw bytes
    64      n     metadata, UTF-8 JSON: {"schema": [...], "options": {...}, "columns": [...],
                  "pid_ns": [dev, ino]}
    data    ...   the columns, each aligned to 64 bytes; each "columns" entry gives its name,
                  shape, dtype (numpy ``dtype.str``) and offset from the data offset

``pid_ns`` is the ``st_dev`` and ``st_ino`` of the creator's ``/proc/self/ns/pid``: its pid
namespace. Liveness is judged by pid and start time (the creator's here, the writers' in
``ring.py``), and a pid means nothing in another pid namespace: a container that shares
``/dev/shm`` (``--ipc=host``) but not the pid namespace would see live writers as dead. So
``attach`` refuses a block made in another pid namespace (``UnsupportedPlatform``), and
``shmbuffer ls`` / ``gc`` call its creator's liveness unknown: ``gc`` removes such a block only when
named with ``--force``.

Reading a block checks all of it before anything is mapped: the header's sizes and offsets, and
the metadata's structure (pid namespace; columns with unique names, shapes of non-negative ints,
plain numeric dtypes, offsets aligned, in bounds and not overlapping). A damaged or crafted block
raises ``LayoutError``, never another exception. What "schema" and "options" mean belongs to
``buffer.py``, which checks them on attach.

Creation goes in this order: the file is created (``O_EXCL``, mode 0600) and at once registered
with this process's watchdog (``_tracker.py``); the header (magic left zero, creator pid and start
time included) and the metadata are written; the pages are reserved (``posix_fallocate``, seconds
for a block of GBs); the magic is written last, so a block that is still being created reads as
"not ready". A block without magic names its creator from the start, so ``shmbuffer gc`` can tell
one being created (its creator alive) from one whose creator died creating it
(``unfinished_creator``). Which columns exist and what they mean belongs to the modules that use
them (``ring.py`` for the commit protocol's columns, ``buffer.py`` for the fields); this module
only maps them.

Files and other users
---------------------
Another local user can create files in ``/dev/shm``, under our names too. So a file is read, mapped
or removed only if it is a regular file, owned by this process's effective user, with no
permission bits for group or others (our blocks are created 0600). It is opened with
``O_NOFOLLOW`` (no symbolic links) and ``O_NONBLOCK`` (a FIFO cannot hang the open); anything else
raises ``ForeignBlock``. Names are checked (``check_name``: no ``/``), so no name reaches outside
``/dev/shm``.

Lifecycle
---------
The creating process owns the block: ``unlink()`` removes its name and happens at the creator's
``close()``-and-exit or garbage collection (``weakref.finalize``), never in another process. A
creator may hand the block to another process (``give_up`` there, then ``take_over`` here: a
block that the first write in any process made belongs to the process that named it). Each
segment remembers the ``(st_dev, st_ino)`` of its file, and nothing here unlinks a path unless it is
still that file: a stale handle whose block was removed, and its name then reused by a new block,
leaves the new block alone (``unlink()`` does nothing then, as for a block already removed). A
creator killed by SIGKILL, even while it creates the block, still has its block removed, by its
watchdog, with the same check. A creation that fails (no space, an interrupt) removes the file and
unregisters it. Attaching maps the file with ``mmap`` directly and never registers anything, so
attaching processes never unlink on exit (the stdlib ``SharedMemory`` registers every attach with
multiprocessing's resource tracker, which unlinks by name when the process exits). ``close()``
unmaps this process's view; it raises ``BufferError`` while arrays made from the mapping are
alive, and may be called again once they are gone. Both are idempotent.

Blocks are created with mode 0600 and their pages reserved up front with ``posix_fallocate``: a
tmpfs that runs out of pages later kills the writer with SIGBUS, the worst failure a user of a
replay buffer can meet, so it is refused at creation instead. The creator then maps them all
(``MADV_POPULATE_WRITE``: 0.36 s a GB on a 2-core VM, against 0.48 s of faults, one a 4 KB page as
tmpfs has no huge pages, that made a first pass through the ring 6x slower for Atari rows).
Attaching processes map pages as they touch them.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import math
import mmap
import os
import re
import secrets
import stat
import struct
import time
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import psutil

from .. import native
from ..errors import ForeignBlock, LayoutError, OutOfSharedMemory, SegmentNotFound, ShmBufferError, UnsupportedPlatform
from . import _tracker

SHM_DIR = "/dev/shm"
PREFIX = "shmbuffer-"
MAGIC = b"\x93SHMBUF\x00"
VERSION = 2
ALIGN = 64
_HEADER = struct.Struct("<8sIIQQqd16s")
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,200}")
_DTYPE = re.compile(r"[<>|][biufc][0-9]{1,2}")
_MAX_META = 1 << 24
_MAX_DIMS = 32
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux's number, where Python's mmap lacks the name

#: What parsing a damaged block's "schema" or "options" can raise; callers turn it into LayoutError.
MALFORMED = (ShmBufferError, KeyError, IndexError, TypeError, ValueError, AttributeError, OverflowError,
             RecursionError)


@dataclass(frozen=True)
class ColumnSpec:
    """A column to allocate: ``shape`` includes the row dimension."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype[Any]

    @property
    def nbytes(self) -> int:
        """The bytes the column takes."""
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


@dataclass(frozen=True)
class Header:
    """The fixed part of a block's header and its metadata, read without mapping the block;
    ``ident`` is the ``(st_dev, st_ino)`` of the file it was read from."""

    name: str
    version: int
    size: int
    data_offset: int
    creator_pid: int
    creator_start: float
    fingerprint: str
    meta: dict[str, Any]
    ident: tuple[int, int] = (0, 0)

    @property
    def pid_ns(self) -> tuple[int, int]:
        """The creator's pid namespace (see the module docstring)."""
        dev, ino = self.meta["pid_ns"]
        return dev, ino

    @property
    def creator_state(self) -> str:
        """``"alive"``, ``"dead"``, or ``"unknown"`` when the creator is in another pid namespace."""
        if self.pid_ns != pid_namespace():
            return "unknown"
        return "alive" if process_alive(self.creator_pid, self.creator_start) else "dead"

    @property
    def creator_alive(self) -> bool:
        """True only when the creator is known to be alive (``creator_state``)."""
        return self.creator_state == "alive"


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
    """The file of buffer ``name``: ``/dev/shm/shmbuffer-NAME``."""
    return os.path.join(SHM_DIR, PREFIX + name)


def check_name(name: str) -> str:
    """``name`` if it is a valid buffer name (1-200 of ``A-Z a-z 0-9 _ . -``), else ``ValueError``."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(
            f"buffer name {name!r}: expected 1-200 characters from A-Z a-z 0-9 _ . -"
        )
    return name


def new_name() -> str:
    """A fresh buffer name: ``<pid>-<8 hex digits>``."""
    return f"{os.getpid()}-{secrets.token_hex(4)}"


def list_names() -> list[str]:
    """Names of every block of ours in ``/dev/shm`` (live or stale), sorted: the files with our
    prefix whose rest is a valid name."""
    try:
        entries = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    return sorted(e[len(PREFIX):] for e in entries if e.startswith(PREFIX) and _NAME.fullmatch(e[len(PREFIX):]))


def pid_namespace() -> tuple[int, int]:
    """This process's pid namespace: the ``(st_dev, st_ino)`` of ``/proc/self/ns/pid``."""
    st = os.stat("/proc/self/ns/pid")
    return st.st_dev, st.st_ino


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
    if not 0 < pid < 2**31:
        return False
    try:
        proc = psutil.Process(pid)
        return abs(proc.create_time() - started) < 0.01 and proc.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


def free_bytes() -> int:
    """Free bytes in ``/dev/shm``."""
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


_KINDS = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO", stat.S_IFLNK: "a symbolic link",
          stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device"}


def _check_ours(path: str, st: os.stat_result) -> None:
    """Raise ``ForeignBlock`` unless ``st`` is a regular file of this user, closed to others."""
    if not stat.S_ISREG(st.st_mode):
        what = f"is {_KINDS.get(stat.S_IFMT(st.st_mode), 'not a regular file')}, not a regular file"
    elif st.st_uid != os.geteuid():
        what = f"belongs to uid {st.st_uid}, not to this process's user (uid {os.geteuid()})"
    elif st.st_mode & 0o077:
        what = f"has mode {stat.S_IMODE(st.st_mode):04o}, open to other users (shmbuffer creates 0600)"
    else:
        return
    raise ForeignBlock(
        f"{path} {what}: shmbuffer reads, maps and removes only regular files of your own with mode "
        "0600, so it leaves this one alone; if you know where it came from, remove it by hand"
    )


def identity(name: str) -> tuple[int, int]:
    """The ``(st_dev, st_ino)`` of a block's file, after checking it is ours (``ForeignBlock``)."""
    path = path_of(check_name(name))
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise SegmentNotFound(_not_found(name)) from None
    _check_ours(path, st)
    return st.st_dev, st.st_ino


def remove(name: str, ident: tuple[int, int]) -> bool:
    """Unlink a block's name if it still names the file ``ident``; True if it did."""
    return _tracker.remove(path_of(check_name(name)), ident)


def _open(name: str, flags: int = os.O_RDONLY) -> tuple[int, os.stat_result]:
    """Open a block's file, refusing anything but a regular file of ours; the fd and its stat."""
    path = path_of(check_name(name))
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise SegmentNotFound(_not_found(name)) from None
    except OSError as exc:  # a link (ELOOP), a directory (EISDIR), another user's (EACCES)
        try:
            _check_ours(path, os.lstat(path))
        except FileNotFoundError:
            raise SegmentNotFound(_not_found(name)) from None
        raise ForeignBlock(f"{path} cannot be opened ({exc.strerror}): it is not a block this process can use") from None
    try:
        st = os.fstat(fd)
        _check_ours(path, st)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_header(name: str) -> Header:
    """Read a block's header and metadata with ``pread``, checking all of it; raises
    ``LayoutError`` if it is not one of ours or is damaged."""
    fd, st = _open(name)
    try:
        return _parse_header(name, fd, st)
    finally:
        os.close(fd)


def read_data(header: Header, offset: int, n: int) -> bytes:
    """``n`` bytes at ``offset`` from the data offset of the block ``header`` was read from."""
    fd, st = _open(header.name)
    try:
        if (st.st_dev, st.st_ino) != header.ident:
            raise SegmentNotFound(f"buffer {header.name!r} was removed and created anew while it was read")
        return os.pread(fd, n, header.data_offset + offset)
    finally:
        os.close(fd)


def _not_found(name: str) -> str:
    live = mine(list_names())  # other users' buffers are no business of this user
    listing = ", ".join(live[:10]) + (" ..." if len(live) > 10 else "") if live else "none"
    return (f"no buffer named {name!r} ({path_of(name)} does not exist); yours here: {listing}. "
            "`shmbuffer ls` lists them with their rows and creators; check the name (or pass buf.handle), "
            "and that the creator still runs: a buffer goes when its creator closes it or exits")


def mine(names: list[str]) -> list[str]:
    """Those of ``names`` whose file belongs to this process's user."""
    uid, out = os.geteuid(), []
    for name in names:
        try:
            if os.lstat(path_of(name)).st_uid == uid:
                out.append(name)
        except OSError:  # gone meanwhile
            pass
    return out


def unfinished_creator(name: str) -> tuple[int, float] | None:
    """The creator (pid, start time) of a block whose magic is not written yet: one being created,
    or one whose creator died creating it. ``None`` for a block with its magic, or one that names no
    creator (too short, another layout version, pid 0)."""
    fd, _ = _open(name)
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


def pid_namespace_of(name: str) -> tuple[int, int] | None:
    """The pid namespace a block's metadata names, finished or not; ``None`` when it names none
    that can be read (no header or metadata yet, damaged, or made by an older shmbuffer)."""
    fd, st = _open(name)
    try:
        raw = os.pread(fd, _HEADER.size, 0)
        if len(raw) < _HEADER.size:
            return None
        meta_len = _HEADER.unpack(raw)[2]
        if _HEADER.size + meta_len > st.st_size or meta_len > _MAX_META:
            return None
        meta = _json(name, os.pread(fd, meta_len, _HEADER.size))
    except LayoutError:
        return None
    finally:
        os.close(fd)
    ns = meta.get("pid_ns") if isinstance(meta, dict) else None
    return (ns[0], ns[1]) if ns is not None and _is_pid_ns(ns) else None


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _is_pid_ns(value: Any) -> bool:
    return isinstance(value, list) and len(value) == 2 and all(_is_count(v) for v in value)


def _json(name: str, raw: bytes) -> Any:
    try:
        return json.loads(raw.decode())
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise LayoutError(
            f"buffer {name!r} is damaged: its metadata is not valid UTF-8 JSON ({type(exc).__name__})"
        ) from None


def _parse_header(name: str, fd: int, st: os.stat_result, wait: float = 2.0) -> Header:
    size = st.st_size
    if size < _HEADER.size:
        raise LayoutError(f"{path_of(name)} is not a shmbuffer block ({size} bytes, too small)")
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
    if total != size or data_offset > size or data_offset % ALIGN or _HEADER.size + meta_len > data_offset:
        raise LayoutError(
            f"buffer {name!r} is damaged: header says {total} bytes, data at {data_offset} and "
            f"{meta_len} bytes of metadata, the file has {size} bytes"
        )
    if not (0 < pid < 2**31 and math.isfinite(started) and started > 0):
        raise LayoutError(f"buffer {name!r} is damaged: its header names creator pid {pid} started at {started}")
    if meta_len > _MAX_META:
        raise LayoutError(f"buffer {name!r} is damaged: {meta_len} bytes of metadata, at most {_MAX_META} expected")
    meta = _json(name, os.pread(fd, meta_len, _HEADER.size))
    _check_meta(name, meta, size - data_offset)
    return Header(name, version, total, data_offset, pid, started, fp.hex(), meta, (st.st_dev, st.st_ino))


def _check_meta(name: str, meta: Any, room: int) -> None:
    """Raise ``LayoutError`` unless ``meta`` holds what this module uses, well formed: ``pid_ns``
    and ``columns`` whose names are unique, shapes non-negative ints, dtypes plain numbers, offsets
    aligned, in the ``room`` bytes after the data offset, and not overlapping."""

    def damaged(what: str) -> LayoutError:
        return LayoutError(f"buffer {name!r} is damaged: its metadata {what}; remove it "
                           f"(`shmbuffer gc --force {name}`) and create it again")

    if not isinstance(meta, dict):
        raise damaged(f"is a JSON {type(meta).__name__}, expected an object")
    if not _is_pid_ns(meta.get("pid_ns")):
        raise damaged(f"has pid_ns {clip(meta.get('pid_ns'))}, expected [device, inode] (a block made by "
                      "an older shmbuffer has none: use the release that created it)")
    columns = meta.get("columns")
    if not isinstance(columns, list):
        raise damaged(f"has columns {clip(columns)}, expected a list")
    spans: list[tuple[int, int, str]] = []
    for col in columns:
        if not isinstance(col, dict) or set(col) != {"name", "shape", "dtype", "offset"}:
            raise damaged(f"has a column {clip(col)}, expected an object of name, shape, dtype and offset")
        cname, shape, dtype, offset = col["name"], col["shape"], col["dtype"], col["offset"]
        if not isinstance(cname, str) or any(cname == s[2] for s in spans):
            raise damaged(f"has a column named {clip(cname)}, expected a string used once")
        if not (isinstance(shape, list) and len(shape) <= _MAX_DIMS and all(_is_count(d) for d in shape)):
            raise damaged(f"gives column {cname!r} shape {clip(shape)}, expected a list of at most "
                          f"{_MAX_DIMS} non-negative ints")
        dt = _plain_dtype(dtype)
        if dt is None:
            raise damaged(f"gives column {cname!r} dtype {clip(dtype)}, expected a numeric dtype like '<f4'")
        if not _is_count(offset) or offset % ALIGN:
            raise damaged(f"gives column {cname!r} offset {clip(offset)}, expected a multiple of {ALIGN}")
        itemsize = dt.itemsize
        nbytes = math.prod(shape) * itemsize
        if math.prod(max(d, 1) for d in shape) * itemsize > room or offset + nbytes > room:
            raise damaged(f"puts column {cname!r} ({shape} {dtype} at +{offset}) past the end of the "
                          f"block's {room} bytes of data")
        spans.append((offset, offset + nbytes, cname))
    spans.sort()
    for (_, end, first), (start, _, second) in itertools.pairwise(spans):
        if start < end:
            raise damaged(f"has columns {first!r} and {second!r} overlapping")


def _plain_dtype(value: Any) -> np.dtype[Any] | None:
    """The dtype a column's ``dtype.str`` names, if it names a native numeric or bool one."""
    if not (isinstance(value, str) and _DTYPE.fullmatch(value)):
        return None
    try:
        dtype = np.dtype(value)
    except TypeError:
        return None
    return dtype if dtype.str == value and dtype.isnative else None


def clip(value: Any) -> str:
    """``repr(value)`` cut to 60 characters, for error messages about untrusted metadata."""
    try:
        text = repr(value)
    except RecursionError:
        return "a deeply nested value"
    return text if len(text) <= 60 else text[:57] + "..."


def _release(mm: mmap.mmap | None, path: str, owner_pid: int, ident: tuple[int, int]) -> None:
    """Finalizer: unmap, and unlink if this process created the block (and the name still names
    it). Must not reference the Segment; runs at garbage collection or interpreter exit."""
    if mm is not None:
        try:
            mm.close()
        except BufferError:
            pass  # arrays still alive at exit; the kernel unmaps when the process ends
    if os.getpid() == owner_pid:  # a forked child inherits this finalizer but owns nothing
        _tracker.remove(path, ident)
        _tracker.untrack(path, ident)


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
        self._ident = header.ident
        self._creator_pid = os.getpid() if created else -1
        self._unlinked = not created
        self.arrays = {}
        for col in header.meta["columns"]:
            dtype = np.dtype(col["dtype"])
            shape = tuple(col["shape"])
            arr = np.frombuffer(mm, dtype=dtype, count=math.prod(shape), offset=header.data_offset + col["offset"])
            self.arrays[col["name"]] = arr.reshape(shape)
        self._arm()

    def _arm(self) -> None:
        if self._finalizer is not None:
            self._finalizer.detach()
        unlink = self.owner and not self._unlinked
        self._finalizer = weakref.finalize(
            self, _release, self._mm, self._path, self._creator_pid if unlink else -1, self._ident
        )

    @property
    def owner(self) -> bool:
        """True in the process that created the block (not in a child forked from it)."""
        return self._creator_pid == os.getpid()

    @property
    def meta(self) -> dict[str, Any]:
        """The block's metadata (schema, options, columns) from its header."""
        return self.header.meta

    @property
    def closed(self) -> bool:
        """Whether this mapping is closed."""
        return self._mm is None

    @classmethod
    def create(cls, name: str | None, meta: dict[str, Any], columns: list[ColumnSpec], fingerprint: str) -> Segment:
        """Create block ``name`` (a new name if ``None``) with these columns: space checked and reserved, watched
        by the tracker, magic written last."""
        native.warn_if_missing()  # first use: say once if the C extension is missing (``native``)
        name = check_name(name) if name is not None else new_name()
        entries, at = [], 0
        for col in columns:
            entries.append({"name": col.name, "shape": list(col.shape), "dtype": col.dtype.str, "offset": at})
            at = _align(at + col.nbytes)
        blob = json.dumps({**meta, "columns": entries, "pid_ns": list(pid_namespace())}, separators=(",", ":")).encode()
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
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            raise FileExistsError(errno.EEXIST, _exists(name), path) from None
        try:
            st = os.fstat(fd)
            ident = (st.st_dev, st.st_ino)
            # first: from here on a creator killed by SIGKILL has its watchdog remove the block
            _tracker.track(path, ident)
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
            with contextlib.suppress(OSError):  # a kernel before 5.14 lacks it: pages map at first touch then
                mm.madvise(_MADV_POPULATE_WRITE)
            header = Header(name, VERSION, size, data_offset, pid, started, fingerprint, json.loads(blob), ident)
            mm[:8] = MAGIC  # last: the block is ready
            return cls(header, mm, created=True)
        except BaseException:
            st = os.fstat(fd)
            _tracker.remove(path, (st.st_dev, st.st_ino))
            _tracker.untrack(path, (st.st_dev, st.st_ino))
            raise
        finally:
            os.close(fd)

    @classmethod
    def attach(cls, name: str) -> Segment:
        """Map the existing block ``name`` after checking its header (layout version, ownership, pid namespace)."""
        native.warn_if_missing()
        fd, st = _open(name, os.O_RDWR)
        try:
            header = _parse_header(name, fd, st)
            if header.pid_ns != pid_namespace():
                raise UnsupportedPlatform(
                    f"buffer {name!r} was created in another pid namespace (its creator, pid "
                    f"{header.creator_pid} there, is not a process shmbuffer can see from here): shmbuffer "
                    "tells live writers from dead ones by pid, which is wrong across pid namespaces. "
                    "Run the processes that share a buffer in one pid namespace (docker: --pid=host, "
                    "or --pid=container:<the creator's container>, besides --ipc=host)"
                )
            mm = mmap.mmap(fd, st.st_size)
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

    def give_up(self) -> None:
        """Stop owning the block this process created: neither its ``close``-and-exit nor its
        watchdog removes it any more; the process that calls ``take_over`` does."""
        if self.owner and not self._unlinked:
            _tracker.untrack(self._path, self._ident)
        self._creator_pid, self._unlinked = -1, True
        self._arm()

    def take_over(self) -> None:
        """Own the block mapped here (another process made it and gave it up): this process's
        ``unlink``, exit or watchdog removes it, if the name still names this block."""
        if self.owner or self._mm is None:
            return
        _tracker.track(self._path, self._ident)
        self._creator_pid, self._unlinked = os.getpid(), False
        self._arm()

    def unlink(self) -> None:
        """Remove the block's name; mappings that exist stay valid. Idempotent. If the name no
        longer names this block (it was removed, and a new block may have taken the name), nothing
        is removed: the new block is not this handle's to remove."""
        _tracker.remove(self._path, self._ident)
        if self.owner and not self._unlinked:
            _tracker.untrack(self._path, self._ident)
        self._unlinked = True
        if self._mm is None:
            if self._finalizer is not None:
                self._finalizer.detach()
        else:
            self._arm()


def _exists(name: str) -> str:
    try:
        h = read_header(name)
        state = h.creator_state if h.creator_state != "unknown" else "in another pid namespace"
        who = f"created by pid {h.creator_pid}, {state}"
    except ShmBufferError as exc:
        who = str(exc)
    return f"a buffer named {name!r} already exists ({who}); pick another name, attach to it, or remove stale ones with `shmbuffer gc`"
