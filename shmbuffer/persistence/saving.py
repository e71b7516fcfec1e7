"""Saving a buffer: ``save(buf, path)`` writes the directory ``path/`` with the two files of the
format (``format.py``), while writers may go on pushing (the rows are a ``snapshot.Snapshot``).

Files
-----
``save`` creates ``path`` with mode 0700 when it does not exist; an existing ``path`` must be a
directory (not a symbolic link) of the saving user, and may hold a save only with
``overwrite=True``. Both files are written under fresh names (``.NAME.<save_id>.tmp``) opened
with ``O_CREAT | O_EXCL | O_NOFOLLOW`` relative to the opened directory, made mode 0600 whatever
the umask, and renamed into place (rows first, ``meta.json`` last): nothing is ever written
through a link someone planted, and nobody else can read a save.

``rows.safetensors`` is sized for the first layout (every lane's first piece read) and its header
space reserved; the header is written last, for the final layout (its numbers only shrink when
rows are dropped, so it always fits). The save's format version is ``format.version_of`` its
options and its ``pushed`` lanes.

The saving process's pushes
---------------------------
With ``next_of``/``stack``, the process that pushed a lane's newest row remembers it
(``frames_push.Last``): its next push into the lane continues that episode (with ``next_of``, it
completes the step waiting for its next observation). A save by that process writes this state as
``pushed`` (format version 3) for each lane whose newest row it kept, and a load gives it to the
loading process: the rows are saved as they are (a waiting step stays waiting, ``pending`` gives
it), so a full lane loses none of them. A save by another process has no such state: the rows
are saved as they are.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import secrets
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from .. import arguments
from ..progress import Progress as Line
from . import pushed
from .format import ALIGN, FORMAT, FORMAT_VERSION_3, META, ROWS, Layout, Tensor, tensors, version_of
from .snapshot import CHUNK_BYTES, Buffer, Snapshot, copy_rows

__all__ = ["FileSink", "Progress", "create_file", "open_folder", "pwrite", "release", "save"]

Progress = bool | Callable[[int, int], None] | None
"""``save``'s ``progress``: True for a line on stderr, False for none, a callable
``(done_bytes, total_bytes)``, or None (a line on a terminal once the save runs long)."""
_CREATE = os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_RDWR | os.O_CLOEXEC


def pwrite(fd: int, a: np.ndarray | bytes | memoryview, offset: int) -> None:
    """Write all of ``a`` into ``fd`` at ``offset`` (``os.pwrite`` again until every byte is written)."""
    view = np.ascontiguousarray(a).reshape(-1).view(np.uint8).data if isinstance(a, np.ndarray) else memoryview(a)
    while view.nbytes:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


class _Bar:
    """Progress through a callback ``(done_bytes, total_bytes)``, or as a line on stderr
    (``progress.Progress``: ``True`` always, ``None`` on a terminal once it runs long)."""

    def __init__(self, progress: Progress, what: str, total: int) -> None:
        self.call = progress if callable(progress) else None
        self.line = Line(what, total, "bytes", show=None if progress is None else progress is True)
        self.done = 0

    def add(self, nbytes: int) -> None:
        """``nbytes`` more are done."""
        self.done += nbytes
        if self.call is not None:
            self.call(self.done, self.line.total)
        self.line.update(self.done)

    def close(self) -> None:
        self.line.close()


class FileSink:
    """The rows go to ``rows.safetensors`` through ``fd``, after a header of the planned size."""

    def __init__(self, fd: int, tensors: list[Tensor], save_id: str, version: int) -> None:
        self.fd, self.tensors, self.save_id, self.version = fd, tensors, save_id, version
        self.data_start = 0

    def start(self, plan: Layout) -> None:
        """Place the data section after the header that ``plan`` gives."""
        # the final header is never longer: its numbers only shrink when rows are dropped
        self.data_start = -(-(8 + len(plan.header(self.tensors, self.save_id, self.version))) // ALIGN) * ALIGN
        os.ftruncate(self.fd, self.data_start + plan.data_bytes)

    def write(self, offset: int, a: np.ndarray) -> None:
        """Write ``a`` at ``offset`` of the data section."""
        pwrite(self.fd, a, self.data_start + offset)

    def move(self, src: int, dst: int, nbytes: int) -> None:
        """Move ``nbytes`` of the data section from ``src`` to ``dst`` (rows dropped before them)."""
        for done in range(0, nbytes, CHUNK_BYTES):
            k = min(CHUNK_BYTES, nbytes - done)
            pwrite(self.fd, os.pread(self.fd, k, self.data_start + src + done), self.data_start + dst + done)

    def finish(self, final: Layout) -> None:
        """Cut the file to ``final``'s data and write its header."""
        os.ftruncate(self.fd, self.data_start + final.data_bytes)
        head = final.header(self.tensors, self.save_id, self.version)
        pwrite(self.fd, struct.pack("<Q", self.data_start - 8) + head + b" " * (self.data_start - 8 - len(head)), 0)



def save(buf: Buffer, path: str | os.PathLike[str], *, progress: Progress = None, wait: float = 1.0,
         overwrite: bool = False) -> dict[str, Any]:
    """Write ``buf``'s rows to the directory ``path`` as ``meta.json`` and ``rows.safetensors`` (see
    ``format.py``), while writers may go on pushing. ``path`` is created (mode 0700) if it
    does not exist; an existing one must be a directory of this user, not a symbolic link, and may
    hold a save only with ``overwrite=True`` (it is replaced). The files are created afresh (never
    through a link), mode 0600 whatever the umask, and renamed into place. ``progress``: True for a
    progress line on stderr, False for none, or a callable ``(done_bytes, total_bytes)`` called after
    each piece; by default a line on a terminal once the save has run for two seconds.
    ``wait``: seconds to wait for rows being written when the save starts. Returns a summary: path,
    rows (saved), holes (empty rows kept as holes), bytes, seconds, dropped (rows within the bounds
    at the start that were neither saved nor holes), moved (whether the tensors had to be moved
    over rows dropped late)."""
    t0 = time.perf_counter()
    if not isinstance(path, str | os.PathLike) or not os.fspath(path):  # Path("") is the current folder
        raise ValueError(f"save: path: expected a folder's path (a str or os.PathLike, not empty), got {path!r}; "
                         "name the folder to save into, e.g. save('runs/buffer')")
    wait = arguments.timeout(wait, "save: wait")
    folder = Path(path)
    dfd, made = open_folder(folder)
    save_id = secrets.token_hex(8)
    tmp, meta_tmp = f".{ROWS}.{save_id}.tmp", f".{META}.{save_id}.tmp"
    try:
        if not overwrite:
            _refuse_a_save(folder, dfd)
        files = tensors(buf.schema, buf.options)
        lasts = pushed.lasts(buf)  # before the snapshot: this process pushes nothing while it saves
        snap = Snapshot(buf, wait)
        bar = _Bar(progress, f"saving {buf.name!r}", sum(r.end - r.keep for r in snap.runs) * sum(t.row_bytes for t in files))
        fd = create_file(tmp, dfd)
        try:
            # the header (sized before the rows are read) names the version: ``pushed`` may lose a lane
            # whose newest row writers dropped meanwhile, but the version stays
            version = version_of(buf.options, bool(pushed.entries(snap.runs, lasts)))
            sink = FileSink(fd, files, save_id, version)
            final, moved = copy_rows(snap, files, sink, bar.add)
        finally:
            os.close(fd)
            bar.close()
        kept = pushed.entries(snap.runs, lasts)
        fd = create_file(meta_tmp, dfd)
        try:
            pwrite(fd, (json.dumps(_meta(buf, snap, files, final, save_id, version, kept), indent=1) + "\n").encode(), 0)
        finally:
            os.close(fd)
        if not overwrite:
            _refuse_a_save(folder, dfd)  # one made while this one ran
        os.replace(tmp, ROWS, src_dir_fd=dfd, dst_dir_fd=dfd)
        os.replace(meta_tmp, META, src_dir_fd=dfd, dst_dir_fd=dfd)
    except BaseException:
        for name in (tmp, meta_tmp):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=dfd)
        if made:
            with contextlib.suppress(OSError):
                os.rmdir(folder)  # only while empty
        raise
    finally:
        os.close(dfd)
    holes = sum(r.hole_count() for r in snap.runs)
    return {
        "path": str(folder), "rows": final.rows - holes, "holes": holes, "bytes": sink.data_start + final.data_bytes,
        "seconds": time.perf_counter() - t0,
        "dropped": sum(r.stop - r.first for r in snap.runs) - final.rows,
        "moved": moved,
    }


def open_folder(folder: Path) -> tuple[int, bool]:
    """The save directory opened (created with mode 0700 when it does not exist), and whether it
    was created here. An existing one must be a real directory (not a link) of this user: another
    user's directory, or a link they could point elsewhere, would let them read or swap the save."""
    made = False
    if not os.path.lexists(folder):
        folder.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):  # someone else made it meanwhile: checked below
            os.mkdir(folder, 0o700)
            made = True
    expected = f"expected a directory of yours (or a path that does not exist) for {META} and {ROWS}"
    if os.path.islink(folder):
        raise FileExistsError(f"save: {folder} is a symbolic link; {expected}: pass the directory it points to")
    try:
        dfd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except (NotADirectoryError, FileNotFoundError):  # a file, a link or nothing (it was swapped meanwhile)
        raise FileExistsError(f"save: {folder} exists and is not a directory; {expected}") from None
    try:
        st = os.fstat(dfd)
        if st.st_uid != os.geteuid():
            raise PermissionError(
                f"save: {folder} belongs to user {st.st_uid}, not to you (user {os.geteuid()}): its owner could "
                f"read or replace the save; {expected}"
            )
        if made:
            os.fchmod(dfd, 0o700)  # whatever the umask
    except BaseException:
        os.close(dfd)
        raise
    return dfd, made


def _refuse_a_save(folder: Path, dfd: int) -> None:
    there = []
    for name in (META, ROWS):
        with contextlib.suppress(FileNotFoundError):
            os.stat(name, dir_fd=dfd, follow_symlinks=False)
            there.append(name)
    if there:
        raise FileExistsError(
            f"save: {folder} already holds a save ({' and '.join(there)}); pass overwrite=True to replace "
            "it, or choose another path"
        )


def create_file(name: str, dfd: int) -> int:
    """A new file ``name`` in the directory ``dfd``, mode 0600 whatever the umask: never an
    existing file, never through a link."""
    fd = os.open(name, _CREATE, 0o600, dir_fd=dfd)
    try:
        os.fchmod(fd, 0o600)
    except BaseException:
        os.close(fd)
        raise
    return fd


@functools.cache
def release() -> str:
    """This release's version, for a save's ``shmbuffer_version``."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("shmbuffer")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def _meta(buf: Buffer, snap: Snapshot, files: list[Tensor], layout: Layout, save_id: str, version: int,
          kept: list[dict[str, Any]]) -> dict[str, Any]:
    """``meta.json``'s object (``format.py``)."""
    out = {
        "format": FORMAT,
        "format_version": version,
        "shmbuffer_version": release(),
        "save_id": save_id,
        "name": buf.name,
        "schema": buf.schema.to_json(),
        "options": buf.options.to_json(),
        "rows": layout.rows,
        "lanes": [{"first": r.keep, "stop": r.end, "base": r.base} for r in snap.runs],
        "sampler_state": None if snap.max_priority is None else {"max_priority": snap.max_priority},
        "stats": snap.stats,
        "counters": snap.counters,
        "tensors": [t.to_json(layout.rows) for t in files],
    }
    if version == FORMAT_VERSION_3:
        out["pushed"] = kept
    return out


