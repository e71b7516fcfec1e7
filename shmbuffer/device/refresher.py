"""The background refresher of a device copy: a thread that keeps the copy within its lag bounds.

Every ``PACE_S`` the thread looks whether its copy is half a bound behind and refreshes it then.
On the CPU with the C extension the thread is C's (``DeviceRows.native_refresher``,
``native/refresh.c``): the look and the refresh never take the GIL, so the learner's thread runs
Python all the while and never waits to hand the GIL over; an error stops it (``state[ERROR]``),
which the next sample raises. Elsewhere (no extension, CUDA) it is a Python thread that asks
``DeviceReplay.refresh_if_behind``; it holds its copy only while it refreshes (a copy nobody holds
is collected, and the loop ends; the C thread's capsule ends it then), and an error ends it and is
handed to the learner's next sample.

Lifecycle: it is stopped (joined) by ``close()``, before every ``os.fork()`` (so that a process
forks without a thread of ours: Python 3.12 warns about forking with threads; started again in the
parent, not in the child, whose copy refreshes only when its samples need it, copying every row
again: ``DeviceRows.forget_rows``) and at exit.
"""

from __future__ import annotations

import atexit
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol

PACE_S = 0.001
"""Seconds the background refresher waits between looks at the lag."""


class Refreshed(Protocol):
    """What the refresher asks of its copy (``DeviceReplay``)."""

    closed: bool

    def refresh_if_behind(self, stop: threading.Event | None = None) -> bool:
        """Refresh if half a bound behind; whether it did."""

    def start_refresher(self) -> None:
        """Start the refresher again (after a fork, in the parent)."""

    def stop_refresher(self) -> None:
        """End the refresher (before a fork, at exit)."""

    @property
    def refreshing(self) -> bool:
        """Whether the refresher runs."""


class Refresher:
    """One copy's background thread (see the module docstring)."""

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        """The Python thread while it runs."""
        self.native: Any = None
        """The C thread while it runs: the extension and ``native/refresh.c``'s capsule."""
        self.starts = 0
        """Times a thread was started."""
        self.stop_event = threading.Event()
        """Set to end the thread."""
        self.failures: list[BaseException] = []
        """The thread's error, raised by the copy's next sample."""

    def start(self, dev: Refreshed, native: Callable[[], Any]) -> None:
        """Start the thread for ``dev`` (nothing happens when it runs): ``native()``'s C thread (it gives the
        extension and the thread's capsule), or where that gives ``None`` a Python one."""
        if self.thread is not None or self.native is not None:
            return
        self.starts += 1
        self.native = native()
        if self.native is not None:
            _live.add(dev)
            return
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=_loop, args=(weakref.ref(dev), self.stop_event, self.failures),
                                       name="shmbuffer-refresher", daemon=True)
        self.thread.start()
        _live.add(dev)

    def stop(self) -> None:
        """End the thread (joined: a refresh under way ends first). Idempotent."""
        if self.native is not None:
            lib, capsule = self.native
            lib.refresher_stop(capsule)
            self.native = None
        thread = self.thread
        if thread is None:
            return
        self.stop_event.set()
        if thread is not threading.current_thread():
            thread.join()
        self.thread = None

    @property
    def running(self) -> bool:
        """Whether the thread runs now."""
        if self.native is not None:
            lib, capsule = self.native
            return bool(lib.refresher_running(capsule))
        return self.thread is not None and self.thread.is_alive()


def _loop(ref: weakref.ref[Any], stop: threading.Event, failed: list[BaseException]) -> None:
    while not stop.wait(PACE_S):
        dev = ref()
        if dev is None or dev.closed:
            return
        try:
            dev.refresh_if_behind(stop)
        except Exception as exc:  # handed to the learner's next sample
            failed.append(exc)
            return
        del dev


_live: weakref.WeakSet[Any] = weakref.WeakSet()
"""The device copies of this process whose refresher may run (stopped before a fork, at exit)."""
_paused: list[Any] = []


def forget(dev: Refreshed) -> None:
    """``dev`` has no refresher any more (closed)."""
    _live.discard(dev)


def _pause_all() -> None:
    _paused[:] = [dev for dev in list(_live) if dev.refreshing]
    for dev in _paused:
        dev.stop_refresher()


def _resume_all() -> None:
    for dev in _paused:
        dev.start_refresher()
    _paused.clear()


def _forget_all() -> None:
    _paused.clear()  # a forked child has no refresher: its samples refresh by the bounds
    _live.clear()


def _close_all() -> None:
    for dev in list(_live):
        dev.stop_refresher()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_pause_all, after_in_parent=_resume_all, after_in_child=_forget_all)
atexit.register(_close_all)  # before the buffers' finalizers (registered earlier, run later)
