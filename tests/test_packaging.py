"""Packaging truth: the version in one place, ``shmbuffer --version`` and ``shmbuffer info``, the
``py.typed`` marker, and the warning, once, when the C extension is missing (never when
``SHMBUFFER_PURE`` asks for the Python path)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import shmbuffer
from shmbuffer import native

ROOT = Path(__file__).resolve().parent.parent


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("SHMBUFFER_PURE", native.WARNED)}
    return {**env, "PYTHONPATH": str(ROOT), **extra}


def _python(code: str, **extra: str) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                         timeout=120, env=_env(**extra), cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    return out


def test_packaging_version_is_the_pyprojects() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    match = re.search(r'^version = "([^"]+)"', pyproject, flags=re.M)
    assert match and match.group(1) == shmbuffer.__version__
    assert f"## {shmbuffer.__version__}" in (ROOT / "CHANGELOG.md").read_text()


def test_packaging_py_typed_and_license_ship() -> None:
    assert (ROOT / "shmbuffer" / "py.typed").is_file()
    assert 'shmbuffer = ["py.typed"]' in (ROOT / "pyproject.toml").read_text()
    assert (ROOT / "LICENSE").read_text().startswith("MIT License")


def test_packaging_cli_version() -> None:
    out = subprocess.run([sys.executable, "-m", "shmbuffer.cli", "--version"], capture_output=True, text=True,
                         timeout=120, env=_env(), cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == f"shmbuffer {shmbuffer.__version__}", out


def test_packaging_cli_info_says_the_path_and_why() -> None:
    code = "import sys; from shmbuffer.cli import main; sys.exit(main(['info', '--json']))"
    for pure in ("1", "0"):
        info = json.loads(_python(code, SHMBUFFER_PURE=pure).stdout)
        if pure == "1":
            assert info["hot_path"] == "python" and info["hot_path_reason"] == "SHMBUFFER_PURE is set"
        else:  # whatever this checkout has built: the same answer as the module gives
            assert (info["hot_path"], info["hot_path_reason"]) == (native.ACTIVE, native.REASON) or native.PURE
        assert info["shmbuffer"] == shmbuffer.__version__
        assert info["dependencies"]["numpy"] and info["shm"]["size_bytes"] >= info["shm"]["free_bytes"] > 0
        assert info["cpu"]["count"] >= 1 and isinstance(info["gpu"]["cuda"], bool)
    text = _python("import sys; from shmbuffer.cli import main; sys.exit(main(['info']))", SHMBUFFER_PURE="1").stdout
    assert "pure Python: SHMBUFFER_PURE is set" in text and "/dev/shm" in text and "free of" in text


# a program using two buffers (create twice, attach once) with the C extension made unimportable:
# the warning comes once, at the first buffer, not at import
MISSING = """
import sys, warnings
{block}
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as at_import:
    import shmbuffer as sb
    from shmbuffer import native
assert not at_import, [str(w.message) for w in at_import]
schema = sb.Schema(x=((), "float32"))
with warnings.catch_warnings(record=True) as seen:
    with sb.ReplayBuffer(schema, 8) as a, sb.ReplayBuffer(schema, 8) as b:
        w = sb.ReplayBuffer.attach(a.handle)
        w.push(x=1.0)
        w.close()
        b.push(x=2.0)
print(native.ACTIVE)
print(len(seen))
for w in seen:
    print(w.category.__name__, "|", w.message)
"""
BLOCK = 'sys.modules["shmbuffer.native._native"] = None  # as if it had not been built'


def test_packaging_missing_extension_warns_once_at_first_use() -> None:
    lines = _python(MISSING.format(block=BLOCK)).stdout.splitlines()
    assert lines[0] == "python" and lines[1] == "1", lines
    category, message = lines[2].split(" | ", 1)
    assert category == "MissingExtensionWarning"
    assert "the C extension is not available: shmbuffer.native._native was not built" in message
    assert "build-essential" in message
    assert "pip install --force-reinstall --no-deps -e ." in message and "SHMBUFFER_PURE=1" in message
    assert issubclass(native.MissingExtensionWarning, RuntimeWarning)


def test_packaging_missing_extension_warns_not_again_in_workers() -> None:
    """A worker started by a program that was warned inherits the note and stays quiet."""
    lines = _python(MISSING.format(block=BLOCK), **{native.WARNED: "1"}).stdout.splitlines()
    assert lines[:2] == ["python", "0"], lines


def test_packaging_pure_on_purpose_does_not_warn() -> None:
    lines = _python(MISSING.format(block=BLOCK), SHMBUFFER_PURE="1").stdout.splitlines()
    assert lines[:2] == ["python", "0"], lines


def test_every_package_folder_ships() -> None:
    """Each folder of shmbuffer with an ``__init__.py`` is listed in pyproject's ``packages`` (the wheel
    takes only those)."""
    listed = re.search(r"^packages = \[(.*?)\]", (ROOT / "pyproject.toml").read_text(), re.M | re.S)
    assert listed, "pyproject.toml has no packages = [...] line"
    names = set(re.findall(r'"([a-z0-9_.]+)"', listed.group(1)))
    folders = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "shmbuffer").rglob("__init__.py")}
    assert folders == names, (sorted(folders - names), sorted(names - folders))
