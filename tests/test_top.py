"""``shmbuffer top`` on a live buffer with a writer process, and the progress line of long operations."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

import shmbuffer as sb
from shmbuffer import native
from shmbuffer.progress import Progress

from .conftest import MUJOCO, transition

Make = Callable[..., sb.ReplayBuffer]
ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONWARNINGS": "error", "PYTHONPATH": str(ROOT)}

WRITER = textwrap.dedent("""
    import sys, time
    import numpy as np
    import shmbuffer as sb
    from tests.conftest import transition

    buf = sb.ReplayBuffer.attach(sys.argv[1])
    print("ready", flush=True)
    i, t0 = 0, time.monotonic()
    while time.monotonic() - t0 < 60:
        buf.push(transition(i, 8))
        buf.sample(4)
        i += 8
        time.sleep(0.005)
""")


@pytest.fixture
def writer(make: Make, name: str) -> Iterator[tuple[sb.ReplayBuffer, subprocess.Popen[str]]]:
    """A buffer this process made and pushed to, and a process pushing 8 rows and sampling 4 at a time."""
    buf = make(MUJOCO, capacity=200_000, name=name)
    buf.push(transition(0, 10))  # this process is a writer too, idle from now on
    proc = subprocess.Popen([sys.executable, "-c", WRITER, name], stdout=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        yield buf, proc
    finally:
        proc.kill()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


def top(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([sys.executable, "-m", "shmbuffer.cli", "top", *args], capture_output=True, text=True,
                         timeout=timeout, env=ENV, cwd=ROOT)
    assert out.returncode == 0 and out.stderr == "", out.stdout + out.stderr
    return out


def test_top_once_json_measures_rates_per_writer(writer: tuple[sb.ReplayBuffer, subprocess.Popen[str]], name: str) -> None:
    _, proc = writer
    frame = json.loads(top("--once", "--json", "--interval", "0.5", name).stdout)
    (b,) = frame["buffers"]
    assert b["name"] == name and b["owner_uid"] == os.geteuid() and b["creator_pid"] == os.getpid()
    assert b["creator_alive"] is True and b["capacity"] == 200_000 and b["lanes"] == 1
    assert 10 < b["rows"] <= b["inserted"] and b["fill"] == b["rows"] / 200_000
    assert b["interval_s"] >= 0.5 and b["in_rows_s"] > 0 and b["out_rows_s"] > 0
    assert b["samples_per_insert_now"] == pytest.approx(b["out_rows_s"] / b["in_rows_s"])
    assert b["samples_per_insert"] == pytest.approx(b["sampled"] / b["inserted"])
    assert b["reaped"] == b["lost"] == b["lock_recoveries"] == 0
    assert b["lock_waits"] >= 0 and b["lock_waits_s"] >= 0
    writers = {w["pid"]: w for w in b["writers"]}
    assert set(writers) == {os.getpid(), proc.pid}
    mine, theirs = writers[os.getpid()], writers[proc.pid]
    assert mine["creator"] and not theirs["creator"] and mine["alive"] and theirs["alive"]
    assert mine["rows_held"] == 10 and mine["in_rows_s"] == 0 and mine["out_rows_s"] == 0  # idle here
    assert theirs["in_rows_s"] > 0 and theirs["out_rows_s"] > 0 and theirs["rows_held"] == b["rows"] - 10
    expected = "python" if os.environ.get("SHMBUFFER_PURE", "") not in ("", "0") else native.ACTIVE
    assert theirs["path"] == expected
    assert frame["host_path"] == expected


def test_top_once_plain_names_the_buffer_and_its_writers(writer: tuple[sb.ReplayBuffer, subprocess.Popen[str]],
                                                         name: str) -> None:
    _, proc = writer
    text = top("--once", "--interval", "0.2", name).stdout
    assert name in text and "rows/s" in text and "samples/insert" in text
    assert any(line.split()[:2] == [str(proc.pid), "attached"] for line in text.splitlines())


def test_top_refreshes_until_ctrl_c_and_exits_clean(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=100, name=name)
    buf.push(transition(0, 30))
    proc = subprocess.Popen([sys.executable, "-m", "shmbuffer.cli", "top", "--json", "--interval", "0.1", name],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
    try:
        assert proc.stdout is not None
        frames = [json.loads(proc.stdout.readline()) for _ in range(3)]  # one JSON object a refresh
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
        proc.wait(10)
    assert proc.returncode == 0 and err == ""
    assert [f["buffers"][0]["rows"] for f in frames] == [30, 30, 30]
    assert frames[0]["buffers"][0]["in_rows_s"] is None and frames[2]["buffers"][0]["in_rows_s"] == 0


def test_the_core_and_top_once_never_import_rich(make: Make, name: str) -> None:
    make(MUJOCO, capacity=10, name=name)
    code = textwrap.dedent(f"""
        import sys
        import shmbuffer, shmbuffer.cli, shmbuffer.top, shmbuffer.persistence, shmbuffer.collector
        assert shmbuffer.cli.main(["top", "--once", "--json", "--interval", "0.01", {name!r}]) == 0
        assert "rich" not in sys.modules, "rich imported"
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=ENV, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["buffers"][0]["name"] == name


# -- progress lines ---------------------------------------------------------------------------------
class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_silent_when_not_a_terminal() -> None:
    pipe = io.StringIO()
    with Progress("saving", 100, stream=pipe, delay=0.0) as line:
        for i in range(0, 101, 10):
            line.update(i)
    assert pipe.getvalue() == ""


def test_progress_shows_on_a_terminal_once_it_runs_long() -> None:
    tty = Terminal()
    with Progress("saving", 100, stream=tty, delay=60.0) as line:
        line.update(50)
    assert tty.getvalue() == ""  # a quick operation shows nothing
    tty = Terminal()
    with Progress("saving", 100, stream=tty, delay=0.0) as line:
        line.update(50)
    assert tty.getvalue().startswith("\rsaving:  50.0% (50/100 rows") and tty.getvalue().endswith("\n")


def test_save_load_and_from_arrays_print_nothing_off_a_terminal(make: Make, name: str, tmp_path: Path,
                                                                 capfd: pytest.CaptureFixture[str]) -> None:
    buf = make(MUJOCO, capacity=1000, name=name)
    buf.push(transition(0, 500))
    buf.save(tmp_path / "save")
    with sb.load(tmp_path / "save", name=f"{name}-loaded") as again:
        assert len(again) == 500
    with sb.from_arrays(MUJOCO, transition(0, 50), name=f"{name}-arrays") as made:
        assert len(made) == 50
    out, err = capfd.readouterr()
    assert out == err == ""
    buf.save(tmp_path / "again", progress=True)  # asked for: shown at once, terminal or not
    assert "saving" in capfd.readouterr().err


def test_top_shows_the_lock_waits(make: Make, name: str) -> None:
    """One locker waited for the lock: ``top`` reads the lock's own count."""
    import threading

    buf = make(MUJOCO, capacity=8, name=name)
    other = sb.ReplayBuffer.attach(buf.handle)
    try:
        with buf.ring.lock:
            t = threading.Thread(target=lambda: other.ring.lock.acquire() or other.ring.lock.release())
            t.start()
            t.join(0.2)
        t.join(5)
    finally:
        other.close()
    (b,) = json.loads(top("--once", "--json", "--interval", "0.1", name).stdout)["buffers"]
    assert b["lock_waits"] == 1 and b["lock_waits_s"] == 0
    assert "lock waits 1" in top("--once", name).stdout


def test_top_shows_how_far_a_device_copy_is_behind(name: str) -> None:
    pytest.importorskip("torch")
    from shmbuffer import top
    from shmbuffer.device import DeviceReplay

    buf = sb.ReplayBuffer(sb.Schema(x=((3,), "float32")), 64, name=name)
    try:
        buf.push(x=np.ones((10, 3), np.float32))
        assert top.read(name, None)[0]["device_lag_rows"] is None
        dev = DeviceReplay(buf, "cpu", refresher=False)
        buf.push(x=np.ones((5, 3), np.float32))
        got = top.read(name, None)[0]
        assert got["device_lag_rows"] == 5 and got["device_lag_ms"] >= 0
        assert "device copy 5 rows" in "\n".join(top.lines({"host_path": "x", "buffers": [got]}))
        dev.close()
        assert top.read(name, None)[0]["device_lag_rows"] is None
    finally:
        buf.close()
        buf.unlink()


def test_top_reads_a_buffer_whose_sampler_class_it_lacks(make: Make, name: str) -> None:
    from .test_samplers import NewestK

    buf = make(sb.Schema(x=((), "int64")), 100, sampler=NewestK(3), name=name)
    buf.push(x=np.arange(20))
    (b,) = json.loads(top("--once", "--json", "--interval", "0.1", name).stdout)["buffers"]
    assert "error" not in b and b["rows"] == 20
