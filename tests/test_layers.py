"""Imports run one way: every module of the package imports only modules below it in the order
that docs/design.md states, so there is no cycle; and no module reads another's underscored names."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "shmbuffer"


def stated_order() -> list[str]:
    """The layers as docs/design.md lists them, lowest first, from its line ``Layers, lowest first:``."""
    text = (ROOT / "docs" / "design.md").read_text()
    match = re.search(r"Layers, lowest first:\s*((?:`[a-z0-9_]+`(?:\s*←\s*)?)+)", text)
    assert match, "docs/design.md must state the layers on a line 'Layers, lowest first: `a` ← `b` ...'"
    return re.findall(r"`([a-z0-9_]+)`", match.group(1))


def files(module: str) -> list[Path]:
    """The files of a module: ``module.py``, or every file of the subpackage ``module/``."""
    path = PACKAGE / f"{module}.py"
    return [path] if path.exists() else sorted((PACKAGE / module).rglob("*.py"))


def imports(path: Path) -> set[str]:
    """Modules of the package that ``path`` imports, anywhere in the file (functions included).
    In a subpackage's file ``..x`` is the package's module ``x``; ``.y`` is the subpackage's own."""
    found: set[str] = set()
    top = len(path.relative_to(PACKAGE).parts) if path.is_relative_to(PACKAGE) else 1
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level and node.level != top:
                continue
            if node.level == top and node.module:
                found.add(node.module.split(".")[0])
            elif node.level == top:  # from . import x, y
                found.update(alias.name for alias in node.names)
            elif node.module and node.module.split(".")[0] == "shmbuffer":
                parts = node.module.split(".")
                found.update([parts[1]] if len(parts) > 1 else [a.name for a in node.names])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "shmbuffer" and len(parts) > 1:
                    found.add(parts[1])
    return found


def modules() -> list[str]:
    """The package's modules: its files and its subpackages (each one layer)."""
    subpackages = [p.parent.name for p in PACKAGE.glob("*/__init__.py") if p.parent.name != "compat"]
    return sorted([p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"] + subpackages)


def test_every_module_has_a_layer() -> None:
    order = stated_order()
    assert sorted(order) == modules(), (
        f"docs/design.md's layers and the package's modules differ: missing there "
        f"{sorted(set(modules()) - set(order))}, not in the package {sorted(set(order) - set(modules()))}"
    )


@pytest.mark.parametrize("module", modules())
def test_imports_point_down(module: str) -> None:
    order = stated_order()
    rank = {name: i for i, name in enumerate(order)}
    found = set().union(*(imports(path) for path in files(module)))
    upward = sorted(m for m in found if m in rank and rank[m] >= rank[module])
    assert not upward, f"{module}.py imports {upward}, which are not below it in docs/design.md's layers"


def test_the_check_catches_an_upward_import(tmp_path: Path) -> None:
    """The parser sees imports in functions and every spelling of a package import."""
    src = tmp_path / "x.py"
    src.write_text("from . import ring\ndef f():\n    from .buffer import ReplayBuffer\n    import shmbuffer.cli\n"
                   "from shmbuffer import mixing\nfrom shmbuffer.loader import Loader\n")
    assert imports(src) == {"ring", "buffer", "cli", "mixing", "loader"}


def private_reads(path: Path) -> list[str]:
    """``obj._name`` reads in ``path`` where ``obj`` is not ``self``/``cls`` (another object's
    underscored attribute), other than dunders."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            out.append(f"{path.name}:{node.lineno}: .{node.attr}")
    return out


@pytest.mark.parametrize("module", modules())
def test_no_module_reads_another_objects_private_names(module: str) -> None:
    assert not [line for path in files(module) for line in private_reads(path)]
