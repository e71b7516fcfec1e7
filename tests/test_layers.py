"""Imports run one way: every module of the package imports only modules below it in the order
that docs/design.md states, so there is no cycle; no module reads another's underscored names; and
no module is over 700 lines."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "shmbuffer"


def stated_order() -> list[str]:
    """The modules as docs/design.md lists them, lowest first, from its line ``Layers, lowest first:``
    (dotted names below ``shmbuffer``: ``shm.segment``; a package's ``__init__`` is the package's name)."""
    text = (ROOT / "docs" / "design.md").read_text()
    match = re.search(r"Layers, lowest first:\s*((?:`[a-z0-9_.]+`(?:\s*←\s*)?)+)", text)
    assert match, "docs/design.md must state the layers on a line 'Layers, lowest first: `a` ← `b` ...'"
    return re.findall(r"`([a-z0-9_.]+)`", match.group(1))


def module_name(path: Path) -> str:
    """``shmbuffer/shm/segment.py`` -> ``shm.segment``; ``shmbuffer/native/__init__.py`` -> ``native``."""
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def resolve(name: str, known: set[str]) -> str | None:
    """The module of the package that the dotted ``name`` (below ``shmbuffer``) is or lies in."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports(path: Path, known: set[str] | None = None) -> set[str]:
    """Modules of the package that ``path`` imports, anywhere in the file (functions included), as
    dotted names below ``shmbuffer``; ``from .x import y`` counts ``x.y`` when that is a module."""
    here = module_name(path).split(".") if path.is_relative_to(PACKAGE) else []
    package = here if path.name == "__init__.py" else here[:-1]
    found: set[str] = set()

    def add(dotted: str) -> None:
        if known is None:
            found.add(dotted)
        elif (module := resolve(dotted, known)) is not None:
            found.add(module)

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                prefix = ".".join([*base, *(node.module.split(".") if node.module else [])])
            elif node.module and node.module.split(".")[0] == "shmbuffer":
                prefix = ".".join(node.module.split(".")[1:])
            else:
                continue
            for alias in node.names:
                full = f"{prefix}.{alias.name}" if prefix else alias.name
                if known is not None and full in known:
                    add(full)
                elif prefix:
                    add(prefix)
                elif known is None:
                    add(alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "shmbuffer" and len(parts) > 1:
                    add(".".join(parts[1:]))
    return found


def module_paths() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py")) if p != PACKAGE / "__init__.py"}


def modules() -> list[str]:
    return sorted(module_paths())


def test_every_module_has_a_layer() -> None:
    order = stated_order()
    assert sorted(order) == modules(), (
        f"docs/design.md's layers and the package's modules differ: missing there "
        f"{sorted(set(modules()) - set(order))}, not in the package {sorted(set(order) - set(modules()))}"
    )


def test_each_folder_is_one_layer() -> None:
    """A folder's modules stand together in the order, so that imports that point down between
    modules also point down between folders: no circle of folders."""
    order = stated_order()
    folders = [name.split(".")[0] for name in order]
    for folder in set(folders):
        at = [i for i, f in enumerate(folders) if f == folder]
        assert at == list(range(at[0], at[-1] + 1)), (
            f"the modules of shmbuffer/{folder}/ are split in docs/design.md's layers by "
            f"{sorted({order[i] for i in range(at[0], at[-1]) if folders[i] != folder})}")


@pytest.mark.parametrize("module", modules())
def test_imports_point_down(module: str) -> None:
    order = stated_order()
    rank = {name: i for i, name in enumerate(order)}
    found = imports(module_paths()[module], set(rank))
    upward = sorted(m for m in found - {module} if rank[m] >= rank[module])  # a package may load its own extension
    assert not upward, f"{module} imports {upward}, which are not below it in docs/design.md's layers"


def test_the_check_catches_an_upward_import(tmp_path: Path) -> None:
    """The parser sees imports in functions and every spelling of a package import."""
    src = tmp_path / "x.py"
    src.write_text("from . import ring\ndef f():\n    from .buffer import ReplayBuffer\n    import shmbuffer.cli\n"
                   "from shmbuffer import mixing\nfrom shmbuffer.loader import Loader\n")
    assert imports(src) == {"ring", "buffer", "cli", "mixing", "loader"}


def test_the_check_resolves_imports_from_a_folder() -> None:
    """Relative imports from inside a folder resolve to the package's dotted module names."""
    known = set(modules())
    assert "shm.segment" in imports(PACKAGE / "protocol" / "ring.py", known)
    assert "errors" in imports(PACKAGE / "protocol" / "ring.py", known)


def private_reads(path: Path) -> list[str]:
    """``obj._name`` reads in ``path`` where ``obj`` is not ``self``/``cls``/``super()`` (another
    object's underscored attribute), other than dunders."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super":
                continue  # the object's own name, as its base class has it
            out.append(f"{path.name}:{node.lineno}: .{node.attr}")
    return out


@pytest.mark.parametrize("module", modules())
def test_no_module_reads_another_objects_private_names(module: str) -> None:
    assert not private_reads(module_paths()[module])


def test_the_private_check_sees_another_objects_names_only(tmp_path: Path) -> None:
    src = tmp_path / "x.py"
    src.write_text("class A(B):\n    def f(self, o):\n        super()._setup(self._x, cls._y)\n"
                   "        return o._z, self.__dict__\n")
    assert [r.split(": ")[1] for r in private_reads(src)] == ["._z"]


MAX_LINES = 700


@pytest.mark.parametrize("module", modules())
def test_no_module_is_over_700_lines(module: str) -> None:
    """A module longer than this is doing more than one thing: split it along its parts."""
    lines = len(module_paths()[module].read_text().splitlines())
    assert lines <= MAX_LINES, f"shmbuffer/{module.replace('.', '/')}.py is {lines} lines, over {MAX_LINES}: split it"


def test_compat_sits_on_top() -> None:
    """Nothing in the package imports ``shmbuffer.compat``; the facades read no other object's
    underscored names (the rules tests/test_layers.py holds for the package's modules)."""
    from .test_layers import imports, module_paths, private_reads

    paths = module_paths()
    known = set(paths)
    facades = {m for m in paths if m.split(".")[0] == "compat"}
    below = [m for m, p in paths.items() if m not in facades and imports(p, known) & facades]
    assert not below, f"{below} import shmbuffer.compat"
    assert {"compat", "compat.ding", "compat.mindspore", "compat.nervex", "compat.velora"} <= facades
    assert not [r for m in facades for r in private_reads(paths[m])]


INTERNAL_COLUMNS = {"_stamp", "_lanes", "_stats", "_owner", "_writer_pid", "_writer_start", "_sampled", "_mutex"}


def protocol_reads(path: Path) -> list[str]:
    """What ``path`` reads of the commit protocol's internals: a buffer's ``ring`` (its
    reservations, cursors and stamps), a ``stamp`` array, or a protocol column by name."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in ("ring", "stamp"):
            out.append(f"{path.name}:{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Constant) and node.value in INTERNAL_COLUMNS:
            out.append(f"{path.name}:{node.lineno}: {node.value!r}")
    return out


def above_the_buffer() -> list[str]:
    order = stated_order()
    return order[order.index("buffer") + 1:]


@pytest.mark.parametrize("module", above_the_buffer())
def test_modules_above_the_buffer_leave_the_protocol_to_it(module: str) -> None:
    """The facades, integrations, top and the cli reach rows through the buffer's methods and
    ``protocol/``'s functions (``by_position.py``, ``census.py``): only ``protocol/`` reads stamps,
    cursors and the ring, so each rule of the commit protocol is written once."""
    found = protocol_reads(module_paths()[module])
    assert not found, f"shmbuffer/{module.replace('.', '/')} reads the protocol's internals: {found}"


def test_the_protocol_check_sees_a_ring_read(tmp_path: Path) -> None:
    src = tmp_path / "x.py"
    src.write_text("def f(buf):\n    n = buf.ring.next_slot()\n    return buf.block.arrays['_stamp'], n\n")
    assert [r.split(": ")[1] for r in protocol_reads(src)] == [".ring", "'_stamp'"]


def below_the_buffer() -> list[str]:
    order = stated_order()
    return [m for m in order[:order.index("buffer") + 1]
            if m.split(".")[0] not in ("native", "shm", "protocol")]


@pytest.mark.parametrize("module", below_the_buffer())
def test_readers_below_the_buffer_read_no_stamps(module: str) -> None:
    """The readers built on ``protocol.reader.Source`` (sequences, views, hindsight, the loader,
    persistence, the buffer) call the ring's methods and ``protocol/``'s functions: no stamp
    array, no protocol column by name."""
    found = [r for r in protocol_reads(module_paths()[module]) if not r.endswith(": .ring")]
    assert not found, f"shmbuffer/{module.replace('.', '/')} reads stamps or protocol columns: {found}"
