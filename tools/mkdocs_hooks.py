"""mkdocs hooks for the documentation site (mkdocs.yml ``hooks:``).

- Before the build, every gap that ``tools/docs_check.py`` finds (a public name without a
  docstring, a public module without an API page) is logged as a warning, so ``mkdocs build
  --strict`` fails on it.
- ``benchmarks/README.md``, ``benchmarks/HISTORY.md`` and their results (plots, tables) join the site as ``benchmarks/``, and
  links from the docs pages into ``benchmarks/`` (right on GitHub) are rewritten to the site's.
- ``<!-- shmbuffer-help -->`` in a page becomes the ``--help`` of every ``shmbuffer`` subcommand,
  ``<!-- shmbuffer-all -->`` a table of ``shmbuffer.__all__`` with cross-references to where each
  name is rendered (an unrendered name is an unresolved reference: a strict failure too).
- A code line too long for the column wraps with its continuation indented 4 columns past the
  line's own indentation (a wrapped Python line must not read as a dedent).
- A name in a table cell (``ReplayBuffer(storage=shmbuffer.torchrl.ShmStorage(N))``) may break after
  its dots, brackets, commas and ``=`` (``<wbr>``), never inside a word: without those points a long
  name widens its column past the page and the table's last column is cut off at 1280 px.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import posixpath
import re
import sys
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import docs_check  # noqa: E402

log = logging.getLogger("mkdocs.hooks.shmbuffer")
LINK = re.compile(r"\]\(([^()\s#]+)(#[^()\s]*)?\)")


def on_pre_build(config: Any) -> None:
    for line in docs_check.problems(ROOT):
        log.warning("docs_check: %s", line)


def on_files(files: Files, config: Any) -> Files:
    results = ROOT / "benchmarks" / "results"
    paths = [ROOT / "benchmarks" / "README.md", ROOT / "benchmarks" / "HISTORY.md", *sorted(results.glob("*.md")), *sorted(results.rglob("*.png")),
             *sorted(results.rglob("*.json"))]  # the reports in results/ subfolders are not pages
    for path in paths:
        if path.is_file():
            rel = path.relative_to(ROOT).as_posix()
            files.append(File(rel, str(ROOT), config["site_dir"], config["use_directory_urls"]))
    return files


def _rewrite_links(markdown: str, page: Any, config: Any) -> str:
    """Links from a docs page to files outside docs/ that the site mounts (``benchmarks/``)."""
    docs_dir = Path(config["docs_dir"]).resolve()
    real_page = Path(page.file.abs_src_path).resolve()
    if not real_page.is_relative_to(docs_dir):
        return markdown
    here = posixpath.dirname(page.file.src_uri)

    def fix(m: re.Match[str]) -> str:
        target, anchor = m.group(1), m.group(2) or ""
        if "://" in target or target.startswith(("/", "mailto:")):
            return m.group(0)
        real = (real_page.parent / target).resolve()
        if real.is_relative_to(docs_dir) or not real.is_relative_to(ROOT / "benchmarks"):
            return m.group(0)
        virtual = real.relative_to(ROOT).as_posix()
        return f"]({posixpath.relpath(virtual, here or '.')}{anchor})"

    return LINK.sub(fix, markdown)


def _cli_help() -> str:
    from shmbuffer.cli import main

    def run(args: list[str]) -> str:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            main(args)
        return out.getvalue().rstrip()

    os.environ["COLUMNS"] = "86"  # the code column holds 87 characters at 1280 px
    top = run(["--help"])
    subcommands = re.search(r"\{([a-z,]+)\}", top)
    assert subcommands, top
    parts = ["### `shmbuffer`", "", "```text", top, "```", ""]
    for name in subcommands.group(1).split(","):
        parts += [f"### `shmbuffer {name}`", "", "```text", run([name, "--help"]), "```", ""]
    return "\n".join(parts)


def _all_table() -> str:
    import griffe

    pkg = docs_check.load(ROOT)
    rows = ["| name | defined in |", "| --- | --- |"]
    for name in sorted(str(n).strip("'\"") for n in pkg.exports or []):
        member = pkg.members[name]
        path = member.target_path if member.is_alias else member.path
        module = path.rsplit(".", 1)[0]
        rows.append(f"| [`{name}`][{path}] | `{module}` |")
    del griffe
    return "\n".join(rows)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    markdown = _rewrite_links(markdown, page, config)
    if "<!-- shmbuffer-help -->" in markdown:
        markdown = markdown.replace("<!-- shmbuffer-help -->", _cli_help())
    if "<!-- shmbuffer-all -->" in markdown:
        markdown = markdown.replace("<!-- shmbuffer-all -->", _all_table())
    return markdown


CELL = re.compile(r"<t([dh])([^>]*)>(.*?)</t\1>", re.S)
CODE = re.compile(r"<code>([^<]*)</code>")
BREAK_AFTER = re.compile(r"([(\[,=/|]|\.(?![a-z]{1,4}\b))(?=[^\s)\],.])")  # a file's .py stays on its name


def break_points(html: str) -> str:
    """``html`` with a ``<wbr>`` after each dot (but a short suffix's: ``segment.py``), opening bracket,
    comma, ``=``, ``/`` and ``|`` of the code in its table cells (not before a closing bracket or a
    space: ``f()`` stays whole)."""

    def code(m: re.Match[str]) -> str:
        return "<code>" + BREAK_AFTER.sub(r"\1<wbr>", m.group(1)) + "</code>"

    def cell(m: re.Match[str]) -> str:
        return f"<t{m.group(1)}{m.group(2)}>" + CODE.sub(code, m.group(3)) + f"</t{m.group(1)}>"

    return CELL.sub(cell, html)


LINE = re.compile(r'<span id="(__span-\d+-\d+)">')
TAG = re.compile(r"<[^>]+>")


def hanging_indents(html: str) -> str:
    """Each code line's span (``pymdownx.highlight`` ``line_spans``) with a hanging indent: its first
    line where it was, the lines it wraps onto 4 columns right of its own indentation."""

    def line(m: re.Match[str]) -> str:
        end = html.find("\n", m.end())
        text = TAG.sub("", html[m.end():end if end >= 0 else len(html)])
        n = len(text) - len(text.lstrip(" ")) + 4
        return f'<span id="{m.group(1)}" class="code-line" style="padding-left:{n}ch;text-indent:-{n}ch">'

    return LINE.sub(line, html)


def on_page_content(html: str, page: Any, config: Any, files: Files) -> str:
    return hanging_indents(break_points(html))
