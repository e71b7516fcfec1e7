"""Every ```python block of the user documentation runs on its own, as written, as a subprocess:
exit status 0, nothing on stderr (warnings are errors), no segment of its own left in /dev/shm."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = tuple(sorted(str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")))
"""Every page of the documentation site (``docs/``, mkdocs.yml), each block of each."""
WITH_CODE = ("design.md", "samplers.md", "getting-started.md", "migration/cpprb.md", "migration/ding.md",
             "migration/velora.md", "migration/mindspore.md", "migration/torchrl.md", "migration/sb3.md")
"""The pages that must keep at least one runnable block."""
BLOCK = re.compile(r"^```python\n(.*?)^```", flags=re.S | re.M)
TIMEOUT = 120


def blocks(page: str) -> list[tuple[int, str]]:
    """``(line, code)`` of each ```python block of ``docs/page``, ``line`` where the code starts."""
    text = (ROOT / "docs" / page).read_text()
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in BLOCK.finditer(text)]


SNIPPETS = [pytest.param(page, code, id=f"{page}:{line}") for page in PAGES for line, code in blocks(page)]


@pytest.mark.parametrize("page", WITH_CODE)
def test_every_page_has_snippets(page: str) -> None:
    assert blocks(page), f"docs/{page} has no ```python block"


@pytest.mark.parametrize(("page", "code"), SNIPPETS)
def test_snippet_runs(page: str, code: str) -> None:
    env = {**os.environ, "PYTHONWARNINGS": "error", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"a snippet of docs/{page} ran past {TIMEOUT} s:\n{code}\n{out}{err}")
    # buffers made with the default name are called "<pid>-<token>", pid being the snippet's process
    left = sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"shmbuffer-{proc.pid}-"))
    for n in left:
        os.unlink(os.path.join("/dev/shm", n))
    assert proc.returncode == 0, f"a snippet of docs/{page} failed:\n{code}\n{out}{err}"
    assert err == "", f"a snippet of docs/{page} wrote to stderr:\n{code}\n{err}"
    assert not left, f"a snippet of docs/{page} left segments in /dev/shm: {left}"
