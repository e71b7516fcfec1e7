"""The janitor (``shmbuffer.shm.janitor``): it removes a block once the process it watches is gone,
only when the block's creator is dead, and runs as ``python -m`` (what Ray's shards start)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import shmbuffer as sb
from shmbuffer.shm import janitor
from shmbuffer.shm.segment import read_header, remove

SCHEMA = {"x": {"shape": (2,), "dtype": "float32"}}


def dead_pid() -> int:
    """The id of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_live_creators_block_is_kept() -> None:
    with sb.ReplayBuffer(SCHEMA, 8) as buf:
        assert janitor.watch(buf.name, dead_pid(), poll=0.01) is False
        assert Path(f"/dev/shm/shmbuffer-{buf.name}").exists()


def test_a_missing_block_is_nothing_to_do() -> None:
    assert janitor.watch("no-such-block-here", dead_pid(), poll=0.01) is False


def test_it_waits_for_the_process() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    reaper = threading.Thread(target=proc.wait)  # our child: reaped as it exits, or it stays a zombie
    reaper.start()
    t = time.monotonic()
    janitor.watch("no-such-block-here", proc.pid, poll=0.05)
    assert time.monotonic() - t >= 0.3
    reaper.join()


def test_a_dead_creators_block_is_removed() -> None:
    """A creator killed with its watchdog (as Ray kills an actor's children): the block stays until the janitor."""
    code = ("import time, shmbuffer as sb\n"
            "from shmbuffer.shm import _tracker\n"
            "buf = sb.ReplayBuffer({'x': {'shape': (2,), 'dtype': 'float32'}}, 8)\n"
            "print(buf.name, _tracker._watch[1], flush=True)\n"
            "time.sleep(60)\n")
    with subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                          start_new_session=True) as proc:
        name, watchdog = proc.stdout.readline().split()  # type: ignore[union-attr]
        block = Path(f"/dev/shm/shmbuffer-{name}")
        try:
            assert block.exists()
            os.kill(int(watchdog), signal.SIGKILL)  # the watchdog first, then its creator
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            assert janitor.watch(name, proc.pid, poll=0.01) is True
            assert not block.exists()
        finally:
            if block.exists():
                remove(name, read_header(name).ident)


def test_it_runs_as_a_module() -> None:
    out = subprocess.run([sys.executable, "-m", "shmbuffer.shm.janitor"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "usage" in out.stderr
    out = subprocess.run([sys.executable, "-m", "shmbuffer.shm.janitor", "no-such-block-here", str(dead_pid())],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
