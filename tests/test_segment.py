"""The block: its header, its refusal of damaged or foreign blocks, and the space check."""

from __future__ import annotations

import gc
import mmap
import os
import resource
import signal
import struct
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import shmbuffer as sb
from shmbuffer.shm import segment

from .conftest import MUJOCO

Make = Callable[..., sb.ReplayBuffer]
ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONWARNINGS": "error", "PYTHONPATH": str(ROOT)}


def test_header(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=1000, name=name)
    h = segment.read_header(name)
    assert h.version == segment.VERSION == 2
    assert h.creator_pid == os.getpid() and h.creator_alive
    assert h.fingerprint == MUJOCO.fingerprint
    assert h.meta["options"]["capacity"] == 1000 and sb.Schema.from_json(h.meta["schema"]) == MUJOCO
    assert h.data_offset % 64 == 0 and h.size == os.path.getsize(segment.path_of(name))
    assert all(c["offset"] % 64 == 0 for c in h.meta["columns"])
    assert name in segment.list_names()
    with open(segment.path_of(name), "rb") as f:
        assert f.read(8) == segment.MAGIC
    assert len(buf) == 0


def patch(name: str, offset: int, data: bytes) -> None:
    fd = os.open(segment.path_of(name), os.O_RDWR)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


def write_file(name: str, data: bytes) -> None:
    """Write ``data`` as the file of block ``name``, mode 0600 as shmbuffer makes them (files open
    to other users are refused before anything is read: test_hostile.py)."""
    fd = os.open(segment.path_of(name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def test_other_layout_version_is_refused(make: Make, name: str) -> None:
    make(MUJOCO, capacity=10, name=name)
    for other in (1, 3):  # version 1 had no _edits column
        patch(name, 8, struct.pack("<I", other))
        with pytest.raises(sb.LayoutError, match=f"has layout version {other}; this shmbuffer reads version 2"):
            sb.ReplayBuffer.attach(name)


def test_foreign_or_damaged_blocks_are_refused(make: Make, name: str) -> None:
    make(MUJOCO, capacity=10, name=name)
    patch(name, 16, struct.pack("<Q", 12345))
    with pytest.raises(sb.LayoutError, match="is damaged"):
        sb.ReplayBuffer.attach(name)
    patch(name, 0, b"NOTOURS!")
    with pytest.raises(sb.LayoutError, match="is not a shmbuffer block"):
        sb.ReplayBuffer.attach(name)


def test_schema_that_does_not_match_its_fingerprint(make: Make, name: str) -> None:
    make(MUJOCO, capacity=10, name=name)
    patch(name, 48, bytes(16))
    with pytest.raises(sb.LayoutError, match="does not match its fingerprint"):
        sb.ReplayBuffer.attach(name)


def test_tiny_file_and_uninitialised_block(name: str) -> None:
    path = segment.path_of(name)
    write_file(name, b"x")
    try:
        with pytest.raises(sb.LayoutError, match="too small"):
            sb.ReplayBuffer.attach(name)
        write_file(name, bytes(4096))
        with pytest.raises(sb.LayoutError, match="may still be being created"):
            sb.ReplayBuffer.attach(name)
    finally:
        os.unlink(path)


def test_refuses_when_dev_shm_is_too_small(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(segment, "free_bytes", lambda: 61 * 2**20)
    with pytest.raises(sb.OutOfSharedMemory, match=r"/dev/shm has 61 MiB free, the buffer needs 1\.7 GiB: lower capacity or enlarge /dev/shm \(docker: --shm-size\)"):
        sb.ReplayBuffer(MUJOCO, capacity=10_000_000, name=name)
    assert not os.path.exists(segment.path_of(name))


def test_fallocate_failure_leaves_nothing(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(sb.OutOfSharedMemory, match="ran out of space"):
        sb.ReplayBuffer(MUJOCO, capacity=100, name=name)
    assert not os.path.exists(segment.path_of(name))


def test_the_creators_first_pass_writes_into_mapped_pages(make: Make, name: str) -> None:
    """The creator maps every page of the block at creation: its first writes through the ring take
    no page fault each 4 KB (tmpfs has no huge pages), which made a first pass up to 10x slower."""
    probe = mmap.mmap(-1, 4096)
    try:
        probe.madvise(getattr(mmap, "MADV_POPULATE_WRITE", 23))
    except OSError:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14+)")
    finally:
        probe.close()
    buf = make(sb.Schema(obs=((4, 84, 84), "uint8")), capacity=600, name=name)
    rows = {"obs": np.ones((600, 4, 84, 84), np.uint8)}  # 16.9 MB: 4,134 pages of 4 KB
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buf.push(rows)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert faults < 200, f"{faults} page faults writing 4,134 pages"
    assert buf.sample(600, replace=False)["obs"].min() == 1


def test_the_creator_is_on_record_before_the_pages_are_reserved(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """While ``posix_fallocate`` runs (seconds for GBs) the block has no magic yet, but its header
    already names its creator, for ``shmbuffer gc``."""
    seen = []
    real = os.posix_fallocate

    def watched(fd: int, offset: int, length: int) -> None:
        with open(segment.path_of(name), "rb") as f:
            seen.append(f.read(8))
        seen.append(segment.unfinished_creator(name))
        real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", watched)
    with sb.ReplayBuffer(MUJOCO, capacity=100, name=name):
        assert seen == [bytes(8), (os.getpid(), segment.start_time())]
        assert segment.unfinished_creator(name) is None  # finished: the magic is there
        assert segment.read_header(name).creator_pid == os.getpid()


CREATING = """
    import os, time
    real = os.posix_fallocate
    def slow(fd, offset, length):  # stands for the seconds a fallocate of many GB takes
        real(fd, offset, length)
        print("allocating", flush=True)
        time.sleep(120)
    os.posix_fallocate = slow
    import shmbuffer as sb
    from tests.conftest import MUJOCO
    sb.ReplayBuffer(MUJOCO, 1000, name={name!r})
"""


def test_a_creator_killed_while_creating_leaves_nothing(name: str) -> None:
    """Registered with its watchdog before its pages are reserved: a creator killed then has its
    block removed by its watchdog."""
    path = segment.path_of(name)
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(CREATING.format(name=name))],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=ENV, cwd=ROOT)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "allocating"
        assert os.path.exists(path) and segment.unfinished_creator(name) == (proc.pid, segment.start_time(proc.pid))
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 10
        while os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(path), "the killed creator's watchdog should have removed its block"
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        if os.path.exists(path):
            os.unlink(path)


FAILING = """
    import errno, os
    def fail(fd, offset, length):
        raise {error}
    os.posix_fallocate = fail
    import shmbuffer as sb
    from tests.conftest import MUJOCO
    try:
        sb.ReplayBuffer(MUJOCO, 1000, name={name!r})
    except {caught}:
        print("refused", flush=True)
    assert not os.path.exists("/dev/shm/shmbuffer-" + {name!r})
"""


@pytest.mark.parametrize(("error", "caught"), [('OSError(errno.ENOSPC, "No space left on device")', "sb.OutOfSharedMemory"),
                                               ("KeyboardInterrupt", "KeyboardInterrupt")])
def test_a_failed_create_leaves_nothing_registered(error: str, caught: str, name: str) -> None:
    """The file is removed and its registration undone: the watchdog, which outlives the process,
    has nothing to remove, and nothing comes on stderr."""
    code = textwrap.dedent(FAILING.format(error=error, caught=caught, name=name))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=ENV, cwd=ROOT)
    assert out.returncode == 0 and out.stdout == "refused\n" and out.stderr == "", out.stdout + out.stderr
    assert not os.path.exists(segment.path_of(name))


def test_a_stale_handle_leaves_a_new_block_of_its_name_alone(name: str) -> None:
    """Someone removed the block (``shmbuffer gc``, a user) and a new one took its name: the old
    creator's and an old attacher's ``unlink()``, and the old creator's finalizer, remove nothing
    (their block's name is gone already, and the new block is not theirs to remove)."""
    path = segment.path_of(name)
    old = sb.ReplayBuffer(MUJOCO, capacity=10, name=name)
    seen = sb.ReplayBuffer.attach(name)
    os.unlink(path)
    new = sb.ReplayBuffer(MUJOCO, capacity=20, name=name)
    try:
        seen.unlink()
        old.unlink()
        assert os.path.exists(path)
        seen.close()
        old.close()
        del old, seen
        gc.collect()
        assert segment.read_header(name).meta["options"]["capacity"] == 20
        assert len(new) == 0
    finally:
        new.close()
        new.unlink()
    assert not os.path.exists(path)


def test_the_old_creators_finalizer_leaves_a_new_block_alone(name: str) -> None:
    path = segment.path_of(name)
    old = sb.ReplayBuffer(MUJOCO, capacity=10, name=name)
    os.unlink(path)
    new = sb.ReplayBuffer(MUJOCO, capacity=20, name=name)
    try:
        del old  # its finalizer runs now: it unlinks its own block, which is gone, and nothing else
        gc.collect()
        assert segment.read_header(name).meta["options"]["capacity"] == 20
    finally:
        new.close()
        new.unlink()


def test_human_sizes() -> None:
    assert segment.human(512) == "512 B"
    assert segment.human(61 * 2**20) == "61 MiB"
    assert segment.human(7.1 * 2**30) == "7.1 GiB"
