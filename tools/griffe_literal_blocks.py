"""A griffe extension for the API pages (mkdocs.yml, mkdocstrings ``extensions:``).

The docstrings open their examples as reStructuredText does, with a paragraph that is only ``::``
and then an indented block. Markdown already renders the indented block as code, so the ``::``
would show as a stray paragraph: this drops it (and turns a trailing ``text::`` into ``text:``).
"""

from __future__ import annotations

import re
from typing import Any

import griffe


class LiteralBlocks(griffe.Extension):
    """Removes reStructuredText's ``::`` literal-block markers from every docstring."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Rewrite ``obj``'s docstring, if it has one."""
        if obj.docstring is not None:
            text = re.sub(r"^[ \t]*::[ \t]*\n", "", obj.docstring.value, flags=re.M)
            obj.docstring.value = re.sub(r"(\S)::[ \t]*$", r"\1:", text, flags=re.M)
