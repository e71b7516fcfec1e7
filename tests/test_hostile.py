"""A hostile or careless local user: files under our names that are not ours (another
user's, a FIFO, a directory, a symbolic link, a file open to others), names that reach outside
/dev/shm, blocks made in another pid namespace, a name reused after its creator died, and damaged
or crafted blocks, which must raise our errors only, never crash or hang a command."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import psutil
import pytest

import shmbuffer as sb
from shmbuffer import cli as cli_mod
from shmbuffer.shm import segment

from .conftest import MUJOCO, transition
from .test_cli import ENV, ROOT, cli
from .test_segment import write_file

Make = Callable[..., sb.ReplayBuffer]
HEADER = struct.Struct("<8sIIQQqd16s")  # the layout in segment.py's docstring
FIELDS = ("magic", "version", "meta_len", "total", "data_offset", "pid", "started", "fingerprint")


@pytest.fixture
def paths() -> Iterator[list[str]]:
    """Paths a test makes (files, FIFOs, links, directories): removed at teardown, whatever happened."""
    made: list[str] = []
    yield made
    for p in made:
        if os.path.isdir(p) and not os.path.islink(p):
            os.rmdir(p)
        elif os.path.lexists(p):
            os.unlink(p)


def block_bytes(make: Make, name: str, **options: Any) -> bytes:
    """The bytes of a real block with some rows in it."""
    buf = make(MUJOCO, capacity=64, lanes=2, name=name, **options)
    buf.push(transition(0, 40), lane=np.arange(40) % 2)
    with open(segment.path_of(name), "rb") as f:
        return f.read()


def parts(raw: bytes) -> tuple[dict[str, Any], bytes, bytes]:
    """A block's header fields, metadata bytes and data."""
    head = dict(zip(FIELDS, HEADER.unpack(raw[:HEADER.size]), strict=True))
    return head, raw[HEADER.size:HEADER.size + head["meta_len"]], raw[head["data_offset"]:]


def meta_of(raw: bytes) -> Any:
    return json.loads(parts(raw)[1])


def forge(raw: bytes, meta: Any = None, *, blob: bytes | None = None, **fields: Any) -> bytes:
    """``raw`` with other metadata (``meta`` as JSON, or the bytes ``blob``) and header ``fields``;
    the data moves down when the metadata no longer fits, the header says so unless ``fields``
    says otherwise."""
    head, old, data = parts(raw)
    blob = old if meta is None and blob is None else blob if blob is not None else json.dumps(meta).encode()
    place = max(head["data_offset"], -(-(HEADER.size + len(blob)) // 64) * 64)
    head.update(meta_len=len(blob), data_offset=place, total=place + len(data))
    head.update(fields)
    out = HEADER.pack(*head.values()) + blob
    return out + bytes(place - len(out)) + data


def edited(raw: bytes, change: Callable[[dict[str, Any]], Any]) -> bytes:
    meta = meta_of(raw)
    change(meta)
    return forge(raw, meta)


def quiet(argv: list[str]) -> int:
    """Run the command in this process, its output discarded; whatever it raises propagates."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return cli_mod.main(argv)


def probe(name: str) -> None:
    """Everything that reads a block: each may refuse it with one of our errors, nothing else."""
    calls: list[Callable[[], Any]] = [
        lambda: segment.read_header(name), lambda: segment.unfinished_creator(name),
        lambda: segment.pid_namespace_of(name), lambda: sb.ReplayBuffer.attach(name).close(),
        lambda: cli_mod._entry(name),
    ]
    for call in calls:
        with contextlib.suppress(sb.ShmBufferError):
            call()
    assert quiet(["inspect", name, "--json"]) in (0, 1)
    assert quiet(["gc", "--dry-run", name]) == 0
    assert quiet(["gc", name]) == 0


def nested(depth: int) -> Any:
    out: Any = []
    for _ in range(depth):
        out = [out]
    return out


def targeted(raw: bytes) -> dict[str, bytes]:
    """Damaged and crafted blocks, each made from the real block ``raw``."""
    meta = meta_of(raw)
    cols = [c["name"] for c in meta["columns"]]
    last, lanes_at = len(cols) - 1, cols.index("_lanes")

    def opt(key: str, value: Any) -> bytes:
        return edited(raw, lambda m: m["options"].__setitem__(key, value))

    def col(i: int, key: str, value: Any) -> bytes:
        return edited(raw, lambda m: m["columns"][i].__setitem__(key, value))

    def top(key: str, value: Any) -> bytes:
        return edited(raw, lambda m: m.__setitem__(key, value))

    def drop(key: str) -> bytes:
        return edited(raw, lambda m: m.pop(key))

    head = parts(raw)[0]
    return {
        "lanes=0": opt("lanes", 0), "lanes=-2": opt("lanes", -2), "lanes=3": opt("lanes", 3),
        "lanes='2'": opt("lanes", "2"), "lanes=2.0": opt("lanes", 2.0), "lanes=true": opt("lanes", True),
        "capacity=-64": opt("capacity", -64), "capacity=0": opt("capacity", 0), "capacity=10**30": opt("capacity", 10**30),
        "capacity=nested": opt("capacity", nested(900)), "episodes=nested": opt("episodes", nested(900)),
        "sampler=junk": opt("sampler", {"kind": "prioritized", "nope": 1}), "sampler=none": opt("sampler", None),
        "limiter=junk": opt("limiter", {"x": 1}), "options=list": top("options", [1]), "no options": drop("options"),
        "no schema": drop("schema"), "schema=junk": top("schema", [{"name": 1}]), "schema=str": top("schema", "x"),
        "schema=nested": top("schema", nested(900)), "schema=huge": top("schema", [{"name": "a", "shape": [2**62, 2**62], "dtype": "<f4"}]),
        "no columns": drop("columns"), "columns=dict": top("columns", {}), "columns=nested": top("columns", nested(900)),
        "no pid_ns": drop("pid_ns"), "pid_ns=str": top("pid_ns", ["a", "b"]), "pid_ns=-1": top("pid_ns", [-1, 2]),
        "overlap": col(1, "offset", meta["columns"][0]["offset"]), "past the end": col(last, "offset", 10**9),
        "offset unaligned": col(last, "offset", meta["columns"][last]["offset"] + 8), "offset -64": col(0, "offset", -64),
        "offset 2**70": col(0, "offset", 2**70), "offset 1.5": col(0, "offset", 1.5),
        "huge shape": col(0, "shape", [2**62, 2**62]), "zero and huge shape": col(0, "shape", [0, 2**62, 2**62]),
        "negative shape": col(0, "shape", [-1]), "shape=str": col(0, "shape", "17"), "40 dims": col(0, "shape", [1] * 40),
        "dtype object": col(0, "dtype", "|O"), "dtype str": col(0, "dtype", "<U4"), "dtype void": col(0, "dtype", "|V8"),
        "dtype big-endian": col(0, "dtype", ">i8"), "dtype int": col(0, "dtype", 5), "dtype <i3": col(0, "dtype", "<i3"),
        "dtype nested": col(0, "dtype", nested(900)), "duplicate names": col(1, "name", cols[0]),
        "name=int": col(0, "name", 3), "extra key": col(0, "extra", 1), "no _lanes": col(lanes_at, "name", "_other"),
        "_lanes f8": col(lanes_at, "dtype", "<f8"), "_lanes shape": col(lanes_at, "shape", [2, 4]),
        "column=list": edited(raw, lambda m: m["columns"].__setitem__(0, [1])),
        "meta=list": forge(raw, [1]), "meta=null": forge(raw, blob=b"null"), "meta=number": forge(raw, blob=b"7"),
        "nested 10000": forge(raw, blob=b"[" * 10000 + b"]" * 10000),
        "nested 10000 inside": forge(raw, blob=b'{"columns":' + b"[" * 10000 + b"]" * 10000 + b"}"),
        "not UTF-8": forge(raw, blob=b'{"\xff\xfe": 1}'), "not JSON": forge(raw, blob=b"{not json"),
        "empty metadata": forge(raw, blob=b""), "NaN": forge(raw, blob=b'{"columns": NaN}'),
        "meta_len 2**32-1": forge(raw, meta_len=2**32 - 1), "meta_len 0": forge(raw, meta_len=0),
        "total wrong": forge(raw, total=head["total"] + 64), "data offset unaligned": forge(raw, data_offset=head["data_offset"] + 8),
        "data offset past the end": forge(raw, data_offset=2**40), "data offset 0": forge(raw, data_offset=0),
        "version 1": forge(raw, version=1), "version 3": forge(raw, version=3), "pid -1": forge(raw, pid=-1), "pid 0": forge(raw, pid=0),
        "pid 2**40": forge(raw, pid=2**40), "started NaN": forge(raw, started=math.nan), "started inf": forge(raw, started=math.inf),
        "started -1": forge(raw, started=-1.0), "fingerprint zero": forge(raw, fingerprint=bytes(16)),
        "magic wrong": forge(raw, magic=b"NOTOURS!"), "truncated 100": raw[:100], "truncated 63": raw[:63],
        "truncated data": raw[:-64], "empty": b"",
    }


def test_damaged_and_crafted_blocks_raise_our_errors_only(make: Make, name: str, paths: list[str]) -> None:
    """Each block of ``targeted``, all at once: ls and gc list or skip each (no traceback, no
    hang), attach and inspect refuse each with LayoutError; an intact copy still attaches."""
    raw = block_bytes(make, name, sampler=sb.Prioritized())
    cases = targeted(raw)
    names = {label: f"{name}-{i}" for i, label in enumerate(cases)}
    for label, data in cases.items():
        paths.append(segment.path_of(names[label]))
        write_file(names[label], data)
    paths.append(segment.path_of(name + "-copy"))
    write_file(name + "-copy", raw)
    with sb.ReplayBuffer.attach(name + "-copy") as copy:
        assert len(copy) == 40
    listed = {e["name"] for e in json.loads(cli("ls", "--json", timeout=60).stdout)}
    out = cli("gc", *names.values(), timeout=60).stdout
    summary = re.fullmatch(r"removed 0, kept (\d+) live, skipped (\d+) unreadable", out.splitlines()[-1])
    assert summary is not None, out
    kept, skipped = map(int, summary.groups())
    assert kept + skipped == len(names)  # gc reads no more than the header and columns; the creator is alive
    for label, n in names.items():
        assert n in listed, label
        with pytest.raises(sb.LayoutError):
            sb.ReplayBuffer.attach(n)
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            assert cli_mod.main(["inspect", n]) == 1, label
        assert err.getvalue().startswith("shmbuffer inspect: "), (label, err.getvalue())
        probe(n)


RANDOM_VALUES: list[Any] = [0, -1, 1, 63, 64, 2**31, 2**64, -(2**70), 1.5, "", "x", "<f8", None, True, [], {}, [0], [-1, 2],
                            {"name": "x"}, nested(50)]


def mutate(raw: bytes, rng: np.random.Generator) -> bytes:
    """One random corruption of the header and metadata of ``raw``."""
    head = parts(raw)[0]
    kind = rng.integers(4)
    if kind == 0:  # bytes of the header or metadata overwritten (not the magic: a zero magic waits 2 s)
        out = bytearray(raw)
        for _ in range(int(rng.integers(1, 6))):
            out[int(rng.integers(8, head["data_offset"]))] = int(rng.integers(256))
        return bytes(out)
    if kind == 1:  # a value anywhere in the metadata replaced
        meta = meta_of(raw)
        node, key = meta, None
        while True:
            keys = list(node) if isinstance(node, dict) else list(range(len(node))) if isinstance(node, list) else []
            if not keys or (key is not None and rng.random() < 0.3):
                break
            key = keys[int(rng.integers(len(keys)))]
            parent, node = node, node[key]
        if key is not None:
            parent[key] = RANDOM_VALUES[int(rng.integers(len(RANDOM_VALUES)))]
        return forge(raw, meta)
    if kind == 2:  # a header field replaced
        field = FIELDS[1 + int(rng.integers(len(FIELDS) - 2))]
        value: Any = float(rng.choice([math.nan, -1.0, 1e300])) if field == "started" else int(rng.integers(-(2**31), 2**32))
        if field in ("version", "meta_len", "total", "data_offset"):
            value = abs(value)
        return forge(raw, **{field: value})
    return raw[:int(rng.integers(0, len(raw)))]  # cut short


def test_fuzzed_blocks_raise_our_errors_only(make: Make, name: str, paths: list[str]) -> None:
    """Random corruptions of a real block: read_header, attach, ls, inspect and gc each refuse one
    with our errors or handle it, never raise anything else, and never wait long."""
    raws = [block_bytes(make, name), block_bytes(make, name + "-p", sampler=sb.Prioritized(), max_use=3)]
    rng = np.random.default_rng(10)
    target = name + "-fuzz"
    paths.append(segment.path_of(target))
    for i in range(300):
        data = mutate(raws[i % 2], rng)
        write_file(target, data)
        t0 = time.monotonic()
        try:
            probe(target)
        except Exception as exc:
            raise AssertionError(f"case {i}: {type(exc).__name__}: {exc}") from exc
        assert time.monotonic() - t0 < 10, f"case {i} took {time.monotonic() - t0:.1f} s"
        if os.path.lexists(segment.path_of(target)):
            os.unlink(segment.path_of(target))


# -- files that are not ours ----------------------------------------------------------------------


def test_a_fifo_hangs_nothing(make: Make, name: str, paths: list[str]) -> None:
    fifo = name + "-fifo"
    paths.append(segment.path_of(fifo))
    os.mkfifo(segment.path_of(fifo), 0o600)
    entry = next(e for e in json.loads(cli("ls", "--json", timeout=30).stdout) if e["name"] == fifo)
    assert "is a FIFO, not a regular file" in entry["error"]
    out = cli("gc", "--force", fifo, timeout=30).stdout
    assert f"skipped {fifo}: {segment.path_of(fifo)} is a FIFO" in out and os.path.exists(segment.path_of(fifo))
    refused = cli("inspect", fifo, ok=False, timeout=30)
    assert refused.returncode == 1 and "is a FIFO" in refused.stderr
    with pytest.raises(segment.ForeignBlock, match="is a FIFO, not a regular file: shmbuffer reads, maps and removes only"):
        sb.ReplayBuffer.attach(fifo)
    with pytest.raises(FileExistsError, match="is a FIFO"):
        make(MUJOCO, capacity=10, name=fifo)


def test_a_directory_is_left_alone(name: str, paths: list[str]) -> None:
    path = segment.path_of(name)
    paths.append(path)
    os.mkdir(path, 0o700)
    out = cli("gc", "--force", name, timeout=30)
    assert f"skipped {name}: {path} is a directory" in out.stdout and os.path.isdir(path)
    assert "is a directory" in next(e for e in json.loads(cli("ls", "--json").stdout) if e["name"] == name)["error"]
    with pytest.raises(segment.ForeignBlock, match="is a directory"):
        sb.ReplayBuffer.attach(name)


def test_a_symbolic_link_is_not_followed(make: Make, name: str, paths: list[str]) -> None:
    make(MUJOCO, capacity=10, name=name)
    link = name + "-link"
    paths.append(segment.path_of(link))
    os.symlink(segment.path_of(name), segment.path_of(link))
    with pytest.raises(segment.ForeignBlock, match="is a symbolic link"):
        sb.ReplayBuffer.attach(link)
    out = cli("gc", "--force", link).stdout
    assert f"skipped {link}" in out and os.path.islink(segment.path_of(link)) and os.path.exists(segment.path_of(name))


def test_a_file_open_to_others_is_refused(make: Make, name: str) -> None:
    make(MUJOCO, capacity=10, name=name)
    os.chmod(segment.path_of(name), 0o666)  # as a squatter who made the name before us would
    with pytest.raises(segment.ForeignBlock, match="has mode 0666, open to other users"):
        sb.ReplayBuffer.attach(name)
    with pytest.raises(sb.LayoutError, match="open to other users"):
        segment.read_header(name)
    os.chmod(segment.path_of(name), 0o600)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_another_users_block_is_refused_and_kept(make: Make, name: str, paths: list[str]) -> None:
    """A block another user owns (a squatted name: they could read our rows, then truncate the
    file and kill our workers with SIGBUS) is neither attached, read nor removed."""
    raw = block_bytes(make, name)
    theirs = name + "-theirs"
    paths.append(segment.path_of(theirs))
    write_file(theirs, raw)
    os.chown(segment.path_of(theirs), 65534, 65534)
    with pytest.raises(segment.ForeignBlock, match="belongs to uid 65534, not to this process's user"):
        sb.ReplayBuffer.attach(theirs)
    assert theirs not in [e["name"] for e in json.loads(cli("ls", "--json").stdout)]  # ls lists yours
    entry = next(e for e in json.loads(cli("ls", "--all", "--json").stdout) if e["name"] == theirs)
    assert "belongs to uid 65534" in entry["error"]
    assert f"skipped {theirs}" in cli("gc", "--force", theirs).stdout and os.path.exists(segment.path_of(theirs))


def test_names_cannot_reach_outside_dev_shm(name: str, paths: list[str], tmp_path: Any) -> None:
    """``gc --force 'x/../../../some/dir/file'`` removed a file outside /dev/shm."""
    victim = tmp_path / "precious"
    victim.write_text("keep me")
    os.mkdir(segment.path_of(name), 0o700)  # /dev/shm/shmbuffer-NAME/.. is /dev/shm
    paths.append(segment.path_of(name))
    sneaky = f"{name}/../../..{victim}"
    assert os.path.samefile(segment.path_of(sneaky), victim)
    for args in (("gc", "--force", sneaky), ("inspect", sneaky), ("save", sneaky, str(tmp_path / "out"))):
        out = cli(*args, ok=False)
        assert out.returncode == 2 and "expected 1-200 characters from A-Z a-z 0-9 _ . -" in out.stderr, out.stderr
    assert victim.read_text() == "keep me"


def test_inspect_takes_the_path_or_the_file_name(make: Make, name: str) -> None:
    make(MUJOCO, capacity=10, name=name)
    for arg in (segment.path_of(name), segment.PREFIX + name, name):
        assert json.loads(cli("inspect", arg, "--json").stdout)["name"] == name


# -- pid namespaces --------------------------------------------------------------------------------


def test_a_block_of_another_pid_namespace_is_refused_and_kept(make: Make, name: str, paths: list[str]) -> None:
    """Its creator is pid 1 there; pid 1 here is another process, so judged from here it looked
    dead, and ``gc`` removed a live buffer."""
    raw = block_bytes(make, name)
    other = name + "-other"
    paths.append(segment.path_of(other))
    meta = meta_of(raw)
    meta["pid_ns"] = [1, 2]
    write_file(other, forge(raw, meta, pid=1, started=1.0e9))
    with pytest.raises(sb.UnsupportedPlatform, match=r"created in another pid namespace .* --pid=host"):
        sb.ReplayBuffer.attach(other)
    entry = next(e for e in json.loads(cli("ls", "--json").stdout) if e["name"] == other)
    assert entry["alive"] is None and entry["liveness"] == "other pid namespace: liveness unknown"
    assert "unknown" in next(ln for ln in cli("ls").stdout.splitlines() if ln.startswith(other))
    out = cli("gc", other).stdout
    assert f"kept {other}: its creator pid 1 in another pid namespace, liveness unknown; `shmbuffer gc --force {other}`" in out
    assert "removed 0, kept 0 live, skipped 0 unreadable, kept 1 of other pid namespaces" in out
    assert f"would remove {segment.path_of(other)}" not in cli("gc", "--dry-run", "--force").stdout  # not named
    assert os.path.exists(segment.path_of(other))
    assert f"removed {segment.path_of(other)} (creator pid 1 in another pid namespace" in cli("gc", "--force", other).stdout
    assert not os.path.exists(segment.path_of(other))


def test_a_block_being_created_in_another_pid_namespace_is_kept(make: Make, name: str, paths: list[str]) -> None:
    raw = block_bytes(make, name)
    other = name + "-other"
    paths.append(segment.path_of(other))
    dead = subprocess.Popen(["true"])
    dead.wait()
    meta = meta_of(raw)
    meta["pid_ns"] = [1, 2]
    write_file(other, forge(raw, meta, magic=bytes(8), pid=dead.pid, started=1.0e9))  # no magic yet
    assert segment.unfinished_creator(other) == (dead.pid, 1.0e9)
    out = cli("gc", other).stdout
    assert f"kept {other}: its creator pid {dead.pid} in another pid namespace" in out and os.path.exists(segment.path_of(other))


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, timeout=30)
    return probe.returncode == 0


IN_NAMESPACE = """
    import os, time
    import shmbuffer as sb
    from tests.conftest import MUJOCO
    buf = sb.ReplayBuffer(MUJOCO, 100, name={name!r})
    print(os.getpid(), flush=True)
    time.sleep(120)
"""


@pytest.mark.skipif(not _unshare_works(), reason="`unshare --pid --fork --mount-proc` is unavailable (it needs privileges)")
def test_a_real_other_pid_namespace(name: str, paths: list[str]) -> None:
    """A creator in its own pid namespace (a container with --ipc=host but not --pid=host): it is
    pid 1 there. Attaching from here is refused, ls and gc call its liveness unknown."""
    paths.append(segment.path_of(name))
    proc = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", sys.executable, "-c",
                             textwrap.dedent(IN_NAMESPACE.format(name=name))],
                            stdout=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "1"
        assert segment.read_header(name).creator_pid == 1
        assert segment.pid_namespace_of(name) != segment.pid_namespace()
        with pytest.raises(sb.UnsupportedPlatform, match="another pid namespace"):
            sb.ReplayBuffer.attach(name)
        assert next(e for e in json.loads(cli("ls", "--json").stdout) if e["name"] == name)["alive"] is None
        assert f"kept {name}: its creator pid 1 in another pid namespace" in cli("gc", name).stdout
        assert os.path.exists(segment.path_of(name))
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    # the namespace dies with its pid 1, and the kernel kills the watchdog too, which may or may not
    # have removed the block first; if it did not, gc here still cannot tell, and keeps it
    time.sleep(0.5)
    if os.path.exists(segment.path_of(name)):
        assert f"kept {name}" in cli("gc", name).stdout
        assert "removed 1" in cli("gc", "--force", name).stdout and not os.path.exists(segment.path_of(name))


# -- a name reused after its creator died ---------------------------------------------------------

HOLDER = """
    import time
    import shmbuffer as sb
    from tests.conftest import MUJOCO
    buf = sb.ReplayBuffer(MUJOCO, 100, name={name!r})
    print("ready", flush=True)
    time.sleep(120)
"""


def gone(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_dead_creators_cleanup_leaves_a_new_block_of_its_name_alone(make: Make, name: str) -> None:
    """A creator is killed, gc removes its block and the name is created anew at once; the dead
    creator's cleanup (its watchdog; multiprocessing's resource tracker, which unlinked by name and
    deleted the new block in 30 of 30 rounds) acts only after that, and must leave the new block."""
    path = segment.path_of(name)
    for _ in range(3):
        proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(HOLDER.format(name=name))],
                                stdout=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
            cleaners = psutil.Process(proc.pid).children()
            assert cleaners, "the creator should have a process that cleans up after it"
            for c in cleaners:
                c.suspend()  # it acts only after the name is taken again
            proc.kill()
            proc.wait(10)
            assert f"removed {path}" in cli("gc", name).stdout
            new = make(MUJOCO, capacity=10, name=name)
            for c in cleaners:
                c.resume()
            deadline = time.monotonic() + 20
            while not all(gone(c) for c in cleaners) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert all(gone(c) for c in cleaners), "the dead creator's cleanup should have finished"
            assert os.path.exists(path) and segment.read_header(name).creator_pid == os.getpid()
            new.close()
            new.unlink()
        finally:
            proc.kill()
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
    assert not os.path.exists(path)


def ignores_sigint(pid: int) -> bool:
    with open(f"/proc/{pid}/status") as f:
        mask = next(int(ln.split()[1], 16) for ln in f if ln.startswith("SigIgn:"))
    return bool(mask & (1 << (signal.SIGINT - 1)))


def test_the_watchdog_ignores_ctrl_c(name: str) -> None:
    """It runs in its own session: a terminal's Ctrl-C (SIGINT to the foreground process group)
    does not reach it, and it would ignore one anyway."""
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(HOLDER.format(name=name))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT,
                            start_new_session=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        (watchdog,) = psutil.Process(proc.pid).children()
        assert os.getsid(watchdog.pid) == watchdog.pid != os.getsid(proc.pid)
        deadline = time.monotonic() + 10
        while not ignores_sigint(watchdog.pid) and time.monotonic() < deadline:
            time.sleep(0.01)  # until it has started: before, a direct SIGINT ends a python starting up
        watchdog.send_signal(signal.SIGINT)
        time.sleep(0.3)
        assert watchdog.is_running() and not gone(watchdog)
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 10
        while os.path.exists(segment.path_of(name)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(segment.path_of(name))
        assert proc.stderr is not None and proc.stderr.read() == ""
    finally:
        proc.kill()
        proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
        if os.path.exists(segment.path_of(name)):
            os.unlink(segment.path_of(name))
