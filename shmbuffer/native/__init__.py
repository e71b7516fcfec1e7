"""Which implementation runs the hot path: the C extension ``shmbuffer.native._native`` or pure Python.

The extension (the C files of this folder: ``module.c`` says what each holds, ``layout.h`` states
the block's layout and row arithmetic that ``tests/test_native.py`` checks against the Python
definitions; built by ``pip install``; optional, so a machine without a compiler still installs
the package) holds the tree's ``find`` and ``update`` (``sumtree.py``), a whole prioritized draw
and its importance weights (``samplers.py``), an update's checks of ids and priorities
(``ring.py``, ``priorities.py``) and a whole ``update_priorities`` (``Priorities.try_update``), the
reader's stamped ``gather`` and its reads of frame stacks (``reader.py``, ``frames.py``) and a
push's copies, reservation and commit (``buffer.py``, ``ring.py``), with acquire/release atomics.
The Python code stays the reference and the fallback: every caller checks ``lib`` and runs its
numpy code when it is ``None``. ``SHMBUFFER_PURE=1`` in the environment forces the Python path
(CI runs the protocol tests both ways).

Big gathers (a sample's or a read's copies of at least ``POOL_BYTES``, 4 MiB, in all, such as 256
Atari rows; frame stacks too) split their copies over a small pool of native threads
(``pool.c``), the calling thread included: at most as many as the CPUs the process may use
(``sched_getaffinity``) and at most 4, created at the first big gather, idle on a condition
variable, renewed in a forked child. Smaller copies (256 MuJoCo rows) stay on the calling thread.
Left automatic, a gather that had to wait for a worker whose CPU was taken by other work makes the
next big gathers (8 to 256) copy on the calling thread alone before the threads are tried again.
``lib.set_threads(k)`` sets the count (``k = 1``: off, ``0``: automatic; it returns the count in
effect; fewer threads than there are ends them) and ``lib.threads()`` says it; every ``os.fork()``
first ends them (``os.register_at_fork``), so that a process forks without Python's warning about
forking with threads being about ours; ``SHMBUFFER_THREADS=k`` in the environment does the same
once, at import (``THREADS``).

``ACTIVE`` is ``"native"`` or ``"python"``; ``REASON`` says why; the choice is logged once, at
debug level, on the ``shmbuffer`` logger, and ``shmbuffer info`` prints both. When the extension is
missing and ``SHMBUFFER_PURE`` did not ask for the Python path, the first buffer a process tree
creates or attaches warns once (``MissingExtensionWarning``, a ``RuntimeWarning``) and says how to
build the extension.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import warnings
from types import ModuleType

lib: ModuleType | None = None
"""The C extension module ``shmbuffer.native._native``, or ``None`` when the Python path runs."""
PURE = os.environ.get("SHMBUFFER_PURE", "") not in ("", "0")
"""Whether ``SHMBUFFER_PURE`` (set and not ``0``) asked for the pure-Python path."""
REASON: str
"""Why ``ACTIVE`` is what it is, in one line (the import error when the extension is missing)."""
if PURE:
    REASON = "SHMBUFFER_PURE is set"
else:
    try:
        from . import _native as lib  # type: ignore[attr-defined, no-redef]
    except ImportError as e:  # not built (no compiler at install time) or not loadable here
        if importlib.util.find_spec(f"{__package__}._native") is None:
            REASON = "the C extension is not available: shmbuffer.native._native was not built (no C compiler when pip installed shmbuffer?)"
        else:
            REASON = f"the C extension is not available: shmbuffer.native._native is there but does not load ({e})"
    else:
        REASON = "the C extension shmbuffer.native._native is loaded"
MISSING = lib is None and not PURE
"""Whether the extension failed to load without ``SHMBUFFER_PURE`` asking for the Python path (what
``warn_if_missing`` warns about; tests that swap ``lib`` for ``None`` do not change it)."""
ACTIVE = "native" if lib is not None else "python"
"""``"native"`` (the C extension runs the hot path) or ``"python"`` (its pure-Python fallback)."""
logging.getLogger("shmbuffer").debug("shmbuffer hot path: %s (%s)", ACTIVE, REASON)


MAX_THREADS = 1024
"""The most copy threads ``SHMBUFFER_THREADS`` may ask for (the extension uses at most 4)."""


def _threads_from_env() -> int | None:
    """``SHMBUFFER_THREADS`` applied to the extension's copy threads (``set_threads``): the count
    in effect, or ``None`` when it is unset, not a whole number >= 0, or the extension is missing."""
    value = os.environ.get("SHMBUFFER_THREADS", "").strip()
    if not value or lib is None:
        return None
    try:
        k = int(value)
        if not 0 <= k <= MAX_THREADS:
            raise ValueError(value)
    except ValueError:
        logging.getLogger("shmbuffer").warning("SHMBUFFER_THREADS=%r ignored: expected a whole number in [0, %d]",
                                               value, MAX_THREADS)
        return None
    return int(lib.set_threads(k))


THREADS = _threads_from_env()
"""The copy threads ``SHMBUFFER_THREADS`` asked for (the count in effect, the caller included), or
``None`` when it is unset (automatic: ``lib.threads()`` says the count)."""
if lib is not None and hasattr(os, "register_at_fork"):
    # the copy threads are joined before every fork: a process forks with no thread of ours (so
    # Python 3.12's warning about forking with threads is not about them); the next big gather
    # starts them again, in the parent and in the child
    os.register_at_fork(before=lib.stop_threads)

WARNED = "SHMBUFFER_WARNED_NO_EXTENSION"
"""The environment variable set once the warning is given, so that the worker processes a program
starts (which inherit it) do not repeat it."""


class MissingExtensionWarning(RuntimeWarning):
    """The C extension ``shmbuffer.native._native`` could not be loaded, so the hot path runs in Python.

    Given once, at the first buffer a process tree creates or attaches, never when
    ``SHMBUFFER_PURE`` asks for the Python path. Filter it like any warning
    (``warnings.filterwarnings("ignore", category=MissingExtensionWarning)``) or set
    ``SHMBUFFER_PURE=1`` to run the Python path on purpose.
    """


def missing_message() -> str:
    """What the warning says: why the extension is missing and how to get it."""
    return (
        f"shmbuffer runs its pure-Python hot path: {REASON}. Push, sample and prioritized replay are "
        "several times slower without the C extension. To build it, install a C compiler and the "
        "Python headers (Debian/Ubuntu: apt-get install build-essential python3-dev), then reinstall "
        "from the clone: pip install --force-reinstall --no-deps -e . (`shmbuffer info` says which path "
        "runs and why). Set SHMBUFFER_PURE=1 to choose the Python path on purpose and silence this warning."
    )


def warn_if_missing() -> None:
    """Warn (``MissingExtensionWarning``) if the extension is missing and not on purpose; once per
    process tree. Called when a buffer's block is created or attached (``segment.py``)."""
    if not MISSING or os.environ.get(WARNED):
        return
    os.environ[WARNED] = "1"
    warnings.warn(missing_message(), MissingExtensionWarning, stacklevel=2)
