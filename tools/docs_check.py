"""The documentation covers every public name: each public module, class, function, method and
property of shmbuffer has a docstring, and each public module has a page in the API reference.

Public means: a module whose dotted name has no part starting with ``_``; in it, the classes and
functions it defines (not those it imports) whose names do not start with ``_`` (only those listed
in ``__all__`` when the module has one), and their methods, properties and nested classes of the
same kind; module-level attributes only where ``__all__`` lists them. Instance and class attributes
are described in their class's docstring, dunder methods (``__init__``) in the class's too.

Run ``python tools/docs_check.py`` (it prints each gap and exits 1), or build the site: the hook
``tools/mkdocs_hooks.py`` logs each gap as a warning, which ``mkdocs build --strict`` turns into a
failed build. Needs griffe (the ``docs`` extra); reads the sources statically, imports nothing.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path

import griffe

ROOT = Path(__file__).resolve().parent.parent

KNOWN_GAPS: frozenset[str] = frozenset()
"""Public names known to lack a docstring, in files this check may not edit yet."""


def load(root: Path = ROOT, package: str = "shmbuffer") -> griffe.Module:
    """The package as griffe reads it from ``root`` (no import)."""
    return griffe.load(package, search_paths=[str(root)], docstring_parser=None, resolve_aliases=False)


def _checked(obj: griffe.Object) -> bool:
    return obj.is_class or obj.is_function or (obj.is_attribute and "property" in obj.labels)


def _members(obj: griffe.Object, listed: set[str] | None) -> Iterator[griffe.Object]:
    for name, member in obj.members.items():
        if member.is_alias or name.startswith("_") or (listed is not None and name not in listed):
            continue
        if _checked(member):
            yield member
            if member.is_class:
                yield from _members(member, None)


def public_modules(pkg: griffe.Module) -> Iterator[griffe.Module]:
    """The package and its public modules, recursively."""
    yield pkg
    for name, member in pkg.members.items():
        if not member.is_alias and member.is_module and not name.startswith("_"):
            yield from public_modules(member)  # type: ignore[arg-type]


def public_names(pkg: griffe.Module) -> Iterator[tuple[str, bool]]:
    """``(dotted name, has a docstring)`` of every public name."""
    for module in public_modules(pkg):
        yield module.path, bool(module.docstring)
        listed = None
        if "__all__" in module.members:
            listed = {str(n).strip("'\"") for n in (module.exports or [])}
        for obj in _members(module, listed):
            yield obj.path, bool(obj.docstring)
        if listed is not None:  # attributes that __all__ lists
            for name in sorted(listed):
                member = module.members.get(name)
                if member is not None and not member.is_alias and member.is_attribute and "property" not in member.labels:
                    yield member.path, bool(member.docstring)


def api_pages(docs: Path) -> set[str]:
    """The modules that a page of ``docs/api`` renders with ``::: module``."""
    found = set()
    for page in (docs / "api").glob("*.md"):
        found.update(re.findall(r"^::: ([\w.]+)\s*$", page.read_text(), flags=re.M))
    return found


def problems(root: Path = ROOT, package: str = "shmbuffer", known: frozenset[str] = KNOWN_GAPS) -> list[str]:
    """Every gap, one line each: a public name without a docstring, a known gap that has one now,
    a public module without an API page."""
    pkg = load(root, package)
    names = dict(public_names(pkg))
    out = [f"{name}: public, but has no docstring" for name, doc in names.items() if not doc and name not in known]
    out += [f"{name}: listed in KNOWN_GAPS (tools/docs_check.py) but documented now: remove it from the list"
            for name in sorted(known) if names.get(name, False)]
    out += [f"{name}: listed in KNOWN_GAPS but not a public name" for name in sorted(known) if name not in names]
    pages = api_pages(root / "docs")
    out += [f"{m.path}: a public module without a page in docs/api (a line '::: {m.path}')"
            for m in public_modules(pkg) if m.path != package and m.path not in pages]
    return out


def main() -> int:
    """Print each gap; exit status 1 if there is one."""
    found = problems()
    for line in found:
        print(line)
    print(f"docs_check: {len(found)} gap(s)" if found else "docs_check: every public name has a docstring and a page")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
