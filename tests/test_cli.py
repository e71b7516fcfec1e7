"""The ``shmbuffer`` command, run as a subprocess: ls, inspect, gc (after a SIGKILLed creator),
save / load and bench."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shmbuffer as sb
from shmbuffer.shm import segment

from .conftest import MUJOCO, seq_of, transition
from .test_segment import write_file

Make = Callable[..., sb.ReplayBuffer]
ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONWARNINGS": "error", "PYTHONPATH": str(ROOT)}


def cli(*args: str, ok: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([sys.executable, "-m", "shmbuffer.cli", *args], capture_output=True, text=True,
                         timeout=timeout, env=ENV, cwd=ROOT)
    if ok:
        assert out.returncode == 0 and out.stderr == "", out.stdout + out.stderr
    return out


@pytest.fixture
def cleanup() -> Iterator[list[str]]:
    """Names of blocks a test makes outside this process: removed at teardown, whatever happened."""
    names: list[str] = []
    yield names
    for n in names:
        try:
            os.unlink(segment.path_of(n))
        except FileNotFoundError:
            pass


def test_ls(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=100, lanes=2, name=name)
    buf.push(transition(0, 30), lane=0)
    buf.push(transition(30, 40), lane=1)
    buf.push(transition(70, 30), lane=1)  # lane 1 wraps: 30 + 50 rows held
    entry = next(e for e in json.loads(cli("ls", "--json").stdout) if e["name"] == name)
    assert entry == {
        "name": name, "schema": "obs[17]f4 action[6]f4 reward f4 next_obs[17]f4 done b1", "rows": 80,
        "capacity": 100, "lanes": 2, "bytes": os.path.getsize(segment.path_of(name)),
        "creator_pid": os.getpid(), "alive": True,
    }
    line = next(ln for ln in cli("ls").stdout.splitlines() if ln.startswith(name))
    assert "80/100" in line and str(os.getpid()) in line and "alive" in line


def test_inspect(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=64, lanes=2, name=name, sampler=sb.Prioritized())
    buf.push(transition(0, 40), lane=np.arange(40) % 2)
    buf.sample(5)
    info = json.loads(cli("inspect", name, "--json").stdout)
    assert info["rows"] == 40 and info["capacity"] == 64 and info["creator_pid"] == os.getpid()
    assert info["options"] == buf.options.to_json() and info["stats"] == buf.stats
    assert info["lanes"] == [{"lane": i, "first": 0, "stop": 20, "rows": 20, "capacity": 32} for i in (0, 1)]
    rows = transition(0, 40)
    for f in info["fields"]:
        a = rows[f["name"]]
        assert f["min"] == a.min() and f["max"] == a.max() and f["mean"] == pytest.approx(a.mean())
    text = cli("inspect", name).stdout
    assert "lane 1: rows [0, 20)  20/32" in text and "sampled 5" in text
    out = cli("inspect", name + "-none", ok=False)
    assert out.returncode == 1 and f"no buffer named {name + '-none'!r}" in out.stderr


CREATOR = """
    import os, signal, sys, time
    import shmbuffer as sb
    from shmbuffer.shm import _tracker
    from tests.conftest import MUJOCO, transition
    buf = sb.ReplayBuffer(MUJOCO, 100, name={name!r})
    buf.push(transition(0, 7))
    # as if its watchdog had died with it: nothing removes the block at its death
    os.kill(_tracker.watchdog_pid(), signal.SIGKILL)
    os.waitpid(_tracker.watchdog_pid(), 0)
    print("ready", flush=True)
    time.sleep(120)
"""


def test_gc_removes_blocks_of_dead_creators_only(make: Make, name: str, cleanup: list[str]) -> None:
    dead, live = name + "-dead", name + "-live"
    cleanup.append(dead)
    make(MUJOCO, capacity=10, name=live)
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(CREATOR.format(name=dead))],
                            stdout=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        assert "removed 0, kept 1 live" in cli("gc", dead).stdout
        assert os.path.exists(segment.path_of(dead))
        proc.kill()
        proc.wait(10)
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    time.sleep(0.2)
    assert os.path.exists(segment.path_of(dead)), "its watchdog should not have removed it"
    entry = next(e for e in json.loads(cli("ls", "--json").stdout) if e["name"] == dead)
    assert entry["alive"] is False and entry["creator_pid"] == proc.pid and entry["rows"] == 7
    out = cli("gc", "--dry-run").stdout  # every block: a dry run touches nothing
    assert f"would remove {segment.path_of(dead)} (creator pid {proc.pid} is dead" in out
    assert segment.path_of(live) not in out
    assert os.path.exists(segment.path_of(dead))
    out = cli("gc", dead, live).stdout
    assert f"removed {segment.path_of(dead)}" in out and "removed 1, kept 1 live" in out
    assert not os.path.exists(segment.path_of(dead)) and os.path.exists(segment.path_of(live))


def test_gc_removes_unreadable_blocks_only_with_force(name: str, cleanup: list[str]) -> None:
    cleanup.append(name)
    write_file(name, b"not a buffer" * 100)
    out = cli("gc", name).stdout
    assert f"skipped {name}: not a readable shmbuffer block" in out and "--force" in out
    assert os.path.exists(segment.path_of(name))
    entry = next(e for e in json.loads(cli("ls", "--json").stdout) if e["name"] == name)
    assert "is not a shmbuffer block" in entry["error"]
    out = cli("gc", "--force", "--dry-run", name).stdout
    assert "would remove" in out and os.path.exists(segment.path_of(name))
    out = cli("gc", "--force", name).stdout
    assert f"removed {segment.path_of(name)} (not readable" in out
    assert not os.path.exists(segment.path_of(name))


CREATING = """
    import os, signal, time
    from shmbuffer.shm import _tracker
    real = os.posix_fallocate
    def slow(fd, offset, length):  # stands for the seconds a fallocate of many GB takes
        real(fd, offset, length)
        # as if its watchdog had died with it: nothing removes the block at its death
        os.kill(_tracker.watchdog_pid(), signal.SIGKILL)
        os.waitpid(_tracker.watchdog_pid(), 0)
        print("allocating", flush=True)
        time.sleep(120)
    os.posix_fallocate = slow
    import shmbuffer as sb
    from tests.conftest import MUJOCO
    sb.ReplayBuffer(MUJOCO, 1000, name={name!r})
"""


def test_gc_removes_a_block_whose_creator_died_creating_it(name: str, cleanup: list[str]) -> None:
    """No magic yet, but the header names the creator: gc keeps the block while its creator is
    alive (it is being created) and removes it once the creator is dead, without --force."""
    cleanup.append(name)
    path = segment.path_of(name)
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(CREATING.format(name=name))],
                            stdout=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "allocating"
        assert "removed 0, kept 1 live, skipped 0" in cli("gc", name).stdout
        assert os.path.exists(path)
        proc.kill()
        proc.wait(10)
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    time.sleep(0.2)
    assert os.path.exists(path), "its watchdog should not have removed it"
    with open(path, "rb") as f:
        assert f.read(8) == bytes(8)  # killed before the magic
    out = cli("gc", "--dry-run", name).stdout
    assert f"would remove {path} (creator pid {proc.pid} died while creating it" in out and os.path.exists(path)
    out = cli("gc", name).stdout
    assert f"removed {path} (creator pid {proc.pid} died while creating it" in out and "removed 1, kept 0 live" in out
    assert not os.path.exists(path)


def test_gc_keeps_a_block_without_magic_or_creator_unless_forced(name: str, cleanup: list[str]) -> None:
    cleanup.append(name)
    write_file(name, bytes(4096))  # nobody on record: it could be a block a live process just opened
    out = cli("gc", name, timeout=60).stdout
    assert f"skipped {name}: not a readable shmbuffer block" in out and os.path.exists(segment.path_of(name))
    assert f"removed {segment.path_of(name)} (not readable" in cli("gc", "--force", name).stdout
    assert not os.path.exists(segment.path_of(name))


def test_save_and_load(make: Make, name: str, tmp_path: Path, cleanup: list[str]) -> None:
    buf = make(MUJOCO, capacity=50, name=name)
    buf.push(transition(0, 50))
    buf.push(transition(50, 20))
    out = cli("save", name, str(tmp_path / "ckpt")).stdout
    assert f"saved 50 rows of {name!r}" in out
    copy = name + "-copy"
    cleanup.append(copy)
    proc = subprocess.Popen([sys.executable, "-m", "shmbuffer.cli", "load", str(tmp_path / "ckpt"), "--name", copy,
                             "--capacity", "100"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().startswith(f"loaded 50 rows into {copy!r}")
        other = sb.ReplayBuffer.attach(copy)
        try:
            rows = other.get(slice(None))
            assert np.array_equal(rows.index, np.arange(20, 70)) and np.array_equal(seq_of(rows), rows.index)
            assert other.capacity == 100
        finally:
            other.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert proc.stderr is not None and proc.stderr.read() == ""
    finally:
        proc.kill()
        proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
    assert not os.path.exists(segment.path_of(copy))
    out = cli("load", str(tmp_path / "nothing"), "--name", copy, ok=False)
    assert out.returncode == 1 and "does not exist" in out.stderr


def test_checkpoint_and_resume(make: Make, name: str, tmp_path: Path, cleanup: list[str]) -> None:
    """``shmbuffer checkpoint`` writes every row the first time, then only the new ones;
    ``shmbuffer resume`` holds the last complete checkpoint until interrupted."""
    buf = make(MUJOCO, capacity=50, name=name)
    buf.push(transition(0, 30))
    out = cli("checkpoint", name, str(tmp_path / "c")).stdout
    assert f"checkpoint 1 of {name!r}" in out and "30 rows (every row" in out
    buf.push(transition(30, 5))
    out = cli("checkpoint", name, str(tmp_path / "c"), "--no-sync").stdout
    assert f"checkpoint 2 of {name!r}" in out and "35 rows (5 new rows, 0 edited" in out
    copy = name + "-copy"
    cleanup.append(copy)
    proc = subprocess.Popen([sys.executable, "-m", "shmbuffer.cli", "resume", str(tmp_path / "c"), "--name", copy],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().startswith(f"resumed 35 rows into {copy!r}")
        other = sb.ReplayBuffer.attach(copy)
        try:
            rows = other.get(slice(None))
            assert np.array_equal(rows.index, np.arange(35)) and np.array_equal(seq_of(rows), rows.index)
        finally:
            other.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert proc.stderr is not None and proc.stderr.read() == ""
    finally:
        proc.kill()
        proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
    assert not os.path.exists(segment.path_of(copy))
    out = cli("resume", str(tmp_path / "nothing"), "--name", copy, ok=False)
    assert out.returncode == 1 and "does not exist" in out.stderr


def test_demo_gives_every_env_its_own_lane(make: Make, name: str) -> None:
    """``--workers 3`` makes 12 envs, which do not divide the default capacity: the demo used one
    lane for all, the envs' steps interleaved, and every 3-step return was a 1-step one.
    It rounds the capacity up instead."""
    from shmbuffer import demo

    assert demo.buffer_size(100_000, 12) == (100_008, 12)
    assert demo.buffer_size(100_000, 8) == (100_000, 8)
    capacity, lanes = demo.buffer_size(1_000, 12)
    schema = sb.Schema(obs=((2,), "float32"), action=((), "int64"), reward=((), "float32"),
                       next_obs=((2,), "float32"), done=((), "bool"))
    buf = make(schema, capacity, lanes=lanes, episodes=True, name=name, seed=0)
    g = np.arange(12)
    for t in range(50):  # as the collector pushes: one row per env and step, env g into lane g % lanes
        step = np.stack([g, np.full(12, t)], axis=1).astype(np.float32)
        buf.push(obs=step, action=np.zeros(12, np.int64), reward=np.ones(12), next_obs=step + np.array([0, 1]),
                 done=np.zeros(12, bool), lane=g % buf.lanes, episode=g << 32)
    batch = buf.sample(256, n_step=3)
    t = batch.obs[:, 1].astype(np.int64)
    assert np.array_equal(batch.steps, np.minimum(3, 50 - t))  # the write head cuts only the last two
    assert np.array_equal(batch.next_obs, batch.obs + np.stack([0 * t, batch.steps], axis=1))  # the same env
    assert np.allclose(batch.reward, [sum(0.99**i for i in range(s)) for s in batch.steps])


def test_bench() -> None:
    out: dict[str, Any] = json.loads(cli("bench", "--seconds", "0.05", "--json").stdout)
    assert out["memcpy_gb_s"] > 0 and out["sample_batches_s_of_256"] > 0
    assert out["push_rows_s_batches_of_256"] > out["push_rows_s_one_at_a_time"] > 0


def test_python_dash_m_shmbuffer_runs_the_command() -> None:
    out = subprocess.run([sys.executable, "-m", "shmbuffer", "--version"], capture_output=True, text=True,
                         timeout=60, env=ENV, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.startswith("shmbuffer ") and out.stderr == "", out


@pytest.mark.parametrize("command", ["ls", "inspect", "gc", "save", "load", "bench", "info", "top"])
def test_every_subcommand_help_says_what_it_does_and_what_each_argument_is(
        command: str, capsys: pytest.CaptureFixture[str]) -> None:
    from shmbuffer import cli as command_line

    with pytest.raises(SystemExit) as done:
        command_line.main([command, "--help"])
    assert done.value.code == 0
    _usage, description, *rest = capsys.readouterr().out.split("\n\n")
    assert description.strip()[0].isupper() and description.strip().endswith("."), description
    arguments = "\n".join(rest)
    # argparse lists an argument without help text on a line of its own name only
    bare = [line for line in arguments.splitlines() if line.strip() and len(line.split()) == 1
            and not line.endswith(":")]
    assert not bare, f"arguments of {command} without help: {bare}"


def _cli(*args: str, stdout: Any = None) -> Any:
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    return subprocess.run([sys.executable, "-m", "shmbuffer.cli", *args], stdout=stdout if stdout is not None else subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, cwd=root, timeout=120)


def test_cli_output_into_a_closed_pipe_is_quiet(make: Make, name: str) -> None:
    """`shmbuffer inspect NAME --json | head` ended in a BrokenPipeError traceback. The reader end
    is closed before the command writes, so every write fails (no race with the pipe's buffer)."""
    import os

    buf = make(MUJOCO, capacity=16, name=name)
    buf.push(transition(0, 4))
    for args in (("inspect", name, "--json"), ("inspect", name), ("ls", "--json")):
        r, w = os.pipe()
        os.close(r)
        try:
            out = _cli(*args, stdout=w)
        finally:
            os.close(w)
        assert out.returncode == 0 and out.stderr == "", (args, out.stderr)


def test_cli_inspect_by_path_and_save_refuses_to_overwrite(make: Make, name: str, tmp_path: Any) -> None:
    import json

    from shmbuffer.shm import segment

    buf = make(MUJOCO, capacity=16, name=name)
    buf.push(transition(0, 4))
    info = json.loads(_cli("inspect", segment.path_of(name), "--json").stdout)
    assert info["rows"] == 4
    assert _cli("save", name, str(tmp_path / "s")).returncode == 0
    again = _cli("save", name, str(tmp_path / "s"))
    assert again.returncode == 1 and "--force" in again.stderr and "Traceback" not in again.stderr
    assert _cli("save", name, str(tmp_path / "s"), "--force").returncode == 0


def test_a_buffer_whose_sampler_class_the_command_lacks_is_inspected_and_saved(make: Make, name: str,
                                                                                tmp_path: Path) -> None:
    """The command line never imports a user's sampler module: it reads the rows anyway (they do
    not depend on the sampler), says which sampler the buffer needs, and saves it whole."""
    from .test_samplers import NewestPrioritized

    buf = make(sb.Schema(x=((), "int64")), 100, sampler=NewestPrioritized(k=3), name=name)
    buf.push(x=np.arange(20), priority=np.arange(1.0, 21.0))
    text = cli("inspect", name).stdout
    assert "damaged" not in text and "rows 20/100" in text
    assert ("sampler kind 'test-newest-prioritized' (class NewestPrioritized of module tests.test_samplers), not "
            "imported by this process") in text and "import tests.test_samplers" in text
    info = json.loads(cli("inspect", "--json", name).stdout)
    assert info["options"]["sampler"] == buf.sampler.to_json()
    assert info["fields"][0]["min"] == 0 and info["fields"][0]["max"] == 19
    cli("save", name, str(tmp_path / "s"))
    with sb.load(tmp_path / "s", name=name + "l") as back:  # this process has the class: it samples again
        assert back.sampler == NewestPrioritized(k=3) and set(back.sample(64).x.tolist()) == {17, 18, 19}
        assert back.priority(back.get(slice(None)).index).tolist() == buf.priority(buf.get(slice(None)).index).tolist()
