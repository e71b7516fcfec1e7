"""Which implementation runs the hot path: the C extension ``shmbuffer._native`` or pure Python.

The extension (``_native.c``, built by ``pip install``; optional, so a machine without a compiler
still installs the package) holds the tree's ``find`` and ``update`` (``sumtree.py``), a whole
prioritized draw and its importance weights (``samplers.py``), an update's checks of ids and
priorities (``ring.py``, ``priorities.py``) and a whole ``update_priorities`` (``Priorities.try_update``), the reader's stamped ``gather`` and its reads of frame stacks (``reader.py``, ``frames.py``) and a
push's copies and commit (``buffer.py``), with real acquire/release atomics. The Python code stays the reference and the fallback: every caller
checks ``lib`` and runs its numpy code when it is ``None``. ``SHMBUFFER_PURE=1`` in the
environment forces the Python path (CI runs the protocol tests both ways).

``ACTIVE`` is ``"native"`` or ``"python"``; ``REASON`` says why; the choice is logged once, at
debug level, on the ``shmbuffer`` logger.
"""

from __future__ import annotations

import logging
import os
from types import ModuleType

lib: ModuleType | None = None
if os.environ.get("SHMBUFFER_PURE", "") not in ("", "0"):
    REASON = "SHMBUFFER_PURE is set"
else:
    try:
        from . import _native as lib  # type: ignore[attr-defined,no-redef]
    except ImportError as e:  # not built (no compiler at install time) or not loadable here
        REASON = f"the C extension is not available ({e})"
    else:
        REASON = "the C extension shmbuffer._native is loaded"
ACTIVE = "native" if lib is not None else "python"
logging.getLogger("shmbuffer").debug("shmbuffer hot path: %s (%s)", ACTIVE, REASON)
