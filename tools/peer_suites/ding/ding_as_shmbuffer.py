"""A pytest plugin (``-p ding_as_shmbuffer``) that makes DI-engine's import paths for its buffer
resolve to ``shmbuffer.compat.ding``: every module name DI-engine's buffer tests import from is
registered, in ``sys.modules``, as that one module. Nothing of DI-engine is imported."""

from __future__ import annotations

import sys

from shmbuffer.compat import ding as facade

NAMES = (
    "ding", "ding.data", "ding.data.buffer", "ding.data.buffer.buffer",
    "ding.data.buffer.middleware", "ding.data.buffer.middleware.padding",
)

for name in NAMES:
    sys.modules[name] = facade


def pytest_configure(config: object) -> None:
    config.addinivalue_line("markers", "unittest: DI-engine's marker for its unit tests")  # type: ignore[attr-defined]
