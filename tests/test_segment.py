"""The block: its header, its refusal of damaged or foreign blocks, and the space check."""

from __future__ import annotations

import os
import struct
from collections.abc import Callable

import pytest

import shmbuffer as sb
from shmbuffer import segment

from .conftest import MUJOCO

Make = Callable[..., sb.ReplayBuffer]


def test_header(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=1000, name=name)
    h = segment.read_header(name)
    assert h.version == segment.VERSION == 1
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


def test_other_layout_version_is_refused(make: Make, name: str) -> None:
    make(MUJOCO, capacity=10, name=name)
    patch(name, 8, struct.pack("<I", 2))
    with pytest.raises(sb.LayoutError, match="has layout version 2; this shmbuffer reads version 1"):
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
    with open(path, "wb") as f:
        f.write(b"x")
    try:
        with pytest.raises(sb.LayoutError, match="too small"):
            sb.ReplayBuffer.attach(name)
        with open(path, "wb") as f:
            f.write(bytes(4096))
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


def test_human_sizes() -> None:
    assert segment.human(512) == "512 B"
    assert segment.human(61 * 2**20) == "61 MiB"
    assert segment.human(7.1 * 2**30) == "7.1 GiB"
