"""A progress line on stderr for long operations (save, load, ``from_arrays``, ``Collector.warm``).

It shows only when stderr is a terminal and the operation has run for ``delay`` seconds (two by
default), so scripts, logs, pipes and quick calls see nothing; it redraws one line with ``\\r``
at most five times a second and ends it when the operation ends.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


def human(n: float) -> str:
    """``n`` in a few characters: ``950``, ``12.3k``, ``4.5M``."""
    for unit in ("", "k", "M", "G", "T"):
        if abs(n) < 1000 or unit == "T":
            return f"{n:.0f}{unit}" if not unit else f"{n:.1f}{unit}"
        n /= 1000
    return f"{n:.1f}T"


class Progress:
    """``what``: ``done`` of ``total`` ``unit``, for a loop that calls ``update`` as it goes.

    :param show: ``None`` (default) shows it on a terminal after ``delay`` seconds; ``True``
        always shows it, at once (an explicit ``progress=True``); ``False`` never.
    """

    def __init__(self, what: str, total: int, unit: str = "rows", *, show: bool | None = None,
                 delay: float = 2.0, stream: TextIO | None = None) -> None:
        self.stream = sys.stderr if stream is None else stream
        self.what, self.total, self.unit = what, total, unit
        self.on = show is True or (show is None and _tty(self.stream))
        self.delay = 0.0 if show is True else delay
        self.t0 = self.shown = time.monotonic()
        self.drawn = False
        self.done = 0

    def update(self, done: int) -> None:
        """``done`` units are done in all."""
        self.done = done
        if not self.on:
            return
        now = time.monotonic()
        if now - self.t0 < self.delay or (self.drawn and now - self.shown < 0.2 and done < self.total):
            return
        self.shown, self.drawn = now, True
        pct = 100 * done / self.total if self.total else 100.0
        rate = done / max(now - self.t0, 1e-9)
        print(f"\r{self.what}: {pct:5.1f}% ({human(done)}/{human(self.total)} {self.unit}, "
              f"{human(rate)} {self.unit}/s, {now - self.t0:.0f} s)", end="", file=self.stream, flush=True)

    def add(self, n: int) -> None:
        """``n`` more units are done."""
        self.update(self.done + n)

    def close(self) -> None:
        """End the line, if one was drawn."""
        if self.drawn:
            print(file=self.stream, flush=True)  # end the line
            self.drawn = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or closed
        return False
