"""A smoke test of an installed shmbuffer (a wheel or an sdist in a fresh venv; CI runs it from
outside the clone): it imports the installed package, not the clone's, runs the C extension, ships
``py.typed`` and the license, and a buffer works end to end, as does the command."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import numpy as np

import shmbuffer as sb
from shmbuffer import native

CLONE = Path(__file__).resolve().parent.parent
here = Path(sb.__file__).resolve().parent
assert not here.is_relative_to(CLONE), f"imported the clone's package ({here}), not the installed one"
assert native.ACTIVE == "native", f"the C extension is not running: {native.REASON}"
assert (here / "py.typed").is_file(), "py.typed is not installed"
assert metadata.version("shmbuffer") == sb.__version__
dist = metadata.distribution("shmbuffer")
assert any(Path(str(f)).name == "LICENSE" for f in dist.files or []), "the license is not installed"

schema = sb.Schema(obs=((4,), "float32"), action=((), "int64"), reward=((), "float32"), done=((), "bool"))
with sb.ReplayBuffer(schema, 1_000, sampler=sb.Prioritized()) as buf:
    w = sb.ReplayBuffer.attach(buf.handle)
    w.push(obs=np.ones((8, 4)), action=np.arange(8), reward=np.ones(8), done=np.zeros(8, bool))
    w.close()
    batch = buf.sample(16)
    buf.update_priorities(batch, np.ones(16))
    assert len(buf) == 8 and batch.obs.shape == (16, 4) and batch.weight.shape == (16,)
    name = buf.name
assert not os.path.exists(f"/dev/shm/shmbuffer-{name}")

command = Path(sys.executable).parent / "shmbuffer"
version = subprocess.run([command, "--version"], capture_output=True, text=True, check=True).stdout.strip()
assert version == f"shmbuffer {sb.__version__}", version
info = subprocess.run([command, "info"], capture_output=True, text=True, check=True).stdout
assert "hot path    C extension" in info, info
print(f"smoke test passed: shmbuffer {sb.__version__} from {here}, {native.ACTIVE} path")
print(info, end="")
