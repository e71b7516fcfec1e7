"""A lock in shared memory that survives the death of its holder.

It is a POSIX mutex with the attributes ``PTHREAD_PROCESS_SHARED``, ``PTHREAD_MUTEX_ROBUST`` and
``PTHREAD_MUTEX_ERRORCHECK``, initialised once by the block's creator inside a 64-byte column and
called through ctypes (``benchmarks/README.md`` has its cost beside ``fcntl.flock``'s). When a
holder dies — SIGKILL included, and a zombie counts — the kernel walks its robust-futex list and the
next locker gets ``EOWNERDEAD``; it marks the mutex consistent and carries on, and
``recovered`` counts how often. ``multiprocessing.Lock`` would stay held forever instead. The mutex
also serialises the threads of one process, which ``flock`` on a shared descriptor would not.

The data a dead holder was changing may be half-updated: every critical section in shmbuffer is
written so that each prefix of it leaves a state the others can repair (see ``ring.py``). A
locker in C (``_native.push``, which runs no Python code under the lock) that finds the holder
dead cannot run those repairs: it marks the mutex consistent, sets the repair word (``REPAIR``)
and releases it; the next ``acquire`` here runs the repairs first, as if it had found the holder
dead itself, and clears the word once they are done.

Signals. A live holder must not stop half-way either: a ``KeyboardInterrupt`` raised inside a
critical section (or as ``__exit__`` starts) would leave the mutex held, or the state half-updated,
by a process that goes on (a notebook, a loop that catches it). So from just before the mutex is
taken until it is released, the Python handlers of ``DEFERRED`` wait (``defer_signals``): in the
main thread, the only one that runs them, each is swapped for one that notes the signal; the end
of the outermost critical section puts them back and runs them for the signals noted. Blocking
the signals with ``pthread_sigmask`` is not enough: the kernel hands a signal that the main
thread blocks to another thread (numpy's BLAS threads will do), whose C handler flags it, and the
main thread runs the Python handler all the same. While *waiting* for the mutex the handlers
run, between slices of 50 ms. Handlers of other signals are not deferred.

Unmapping. glibc links the robust mutexes a thread holds into a list through the mutexes' own
memory; the thread's next lock or unlock of any robust mutex writes to its neighbours in that
list. So the memory of a mutex that a thread of this process holds must never be unmapped: the
thread would then write to unmapped memory (a segfault) or into whatever is mapped there next.
``let_go`` is called before the memory goes (a buffer's ``close``, or the lock object's end): it
releases a mutex this thread holds, and keeps the memory of one another thread holds mapped
until the process exits.

Requires glibc's robust mutexes (Linux); ctypes releases the GIL while a call blocks.
"""

from __future__ import annotations

# ``_signal``: ``signal.signal`` and ``signal.getsignal`` wrap its functions and turn the old
# handler into an enum, which costs a caught ValueError (~1 us) for every Python handler
import _signal
import ctypes
import errno
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import UnsupportedPlatform, WaitTimeout

SIZE = 64
"""Bytes reserved for one mutex (glibc's pthread_mutex_t is 40 bytes on x86-64, 48 on aarch64)."""
REPAIR = 56
"""Byte offset of the repair word in those bytes: nonzero when a locker in C (``_native.push``)
found the holder dead and left its repairs to the next locker (``RobustLock``)."""
WAITS = 48
"""Byte offset of the wait count in those bytes (int64, after glibc's 40 or 48 bytes of mutex):
the times a locker found the lock held and waited for it, counted once it got it (so exactly)."""

_TID_MASK = 0x3FFFFFFF
"""The holder's thread id in a robust mutex's lock word, its first 4 bytes (the kernel's
``FUTEX_TID_MASK``: the robust-futex ABI)."""
_PINNED: list[np.ndarray] = []
"""The memory of mutexes held by another thread of this process when their buffer was closed:
kept mapped until the process exits (module docstring)."""

_PROCESS_SHARED = 1
_ROBUST = 1
_ERRORCHECK = 2


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _libc() -> Any:
    if not sys.platform.startswith("linux"):
        raise UnsupportedPlatform(f"shmbuffer needs Linux (robust process-shared mutexes, /dev/shm); this is {sys.platform}")
    lib = ctypes.CDLL(None)
    try:
        for fn in ("pthread_mutex_trylock", "pthread_mutex_unlock", "pthread_mutex_consistent",
                   "pthread_mutexattr_init", "pthread_mutexattr_setpshared", "pthread_mutexattr_setrobust",
                   "pthread_mutexattr_settype", "pthread_mutex_init", "pthread_mutexattr_destroy"):
            f = getattr(lib, fn)
            f.argtypes = [ctypes.c_void_p] + ([ctypes.c_int] if "attr_set" in fn else [])
            f.restype = ctypes.c_int
        lib.pthread_mutex_timedlock.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Timespec)]
        lib.pthread_mutex_timedlock.restype = ctypes.c_int
    except AttributeError as exc:
        raise UnsupportedPlatform(f"this C library lacks robust mutexes ({exc}); shmbuffer needs glibc") from None
    return lib


_LIB: Any = None


def _lib() -> Any:
    global _LIB
    if _LIB is None:
        _LIB = _libc()
    return _LIB


DEFERRED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGALRM, signal.SIGUSR1,
            signal.SIGUSR2)
"""Signals whose Python-level handlers wait while the main thread is in a critical section."""

_SIGNALS = tuple(int(s) for s in DEFERRED)
_main = threading.main_thread().ident  # the thread that runs Python signal handlers
_ident, _getsignal, _setsignal = threading.get_ident, _signal.getsignal, _signal.signal  # a push calls them
_depth = 0  # nesting of defer_signals() in the main thread
_saved: list[tuple[int, Any]] = []  # (signal, its own handler) while ``_note`` stands in for it
_noted: list[int] = []  # signals that came meanwhile


def _note(signum: int, frame: Any) -> None:
    _noted.append(signum)


def defer_signals() -> None:
    """Make the Python handlers of ``DEFERRED`` wait until the matching ``resume_signals()``
    (calls nest). Only the main thread runs Python handlers, so in other threads this does
    nothing. A handler that raises while they are being swapped raises here, deferring nothing."""
    global _depth
    if _ident() != _main:
        return
    if not _depth:
        try:
            for s in _SIGNALS:
                handler = _getsignal(s)
                if callable(handler) and handler is not _note:
                    _saved.append((s, handler))
                    _setsignal(s, _note)  # runs pending handlers first, which may raise
        except BaseException:
            _leave()
            raise
    _depth += 1


def resume_signals() -> None:
    """Undo one ``defer_signals()``. The outermost puts the handlers back and delivers the
    signals that came meanwhile to them: a ``KeyboardInterrupt`` is raised here then."""
    global _depth
    if _ident() != _main:
        return
    if _depth <= 0:
        raise RuntimeError("resume_signals() without defer_signals()")
    _depth -= 1
    if not _depth:
        _leave()


def _leave() -> None:
    """Put the handlers back, then run them for the signals that came meanwhile (each once, as
    the kernel merges a signal pending twice); the first exception one raises is raised."""
    error = None
    while _saved:
        s, handler = _saved[-1]
        try:
            _setsignal(s, handler)
        except BaseException as exc:  # a handler already put back ran first (its signal came) and raised
            error = error or exc
            continue  # put this one back all the same
        _saved.pop()
    if _noted:
        noted = sorted(set(_noted))
        _noted.clear()
        for s in noted:
            try:
                handler = _getsignal(s)
                if callable(handler):
                    handler(s, None)
            except BaseException as exc:
                error = error or exc
    if error is not None:
        raise error


def _forked() -> None:
    # the forking thread is the child's main thread; if another thread was deferring at the fork,
    # the child's handlers come back
    global _depth, _main
    _main = threading.get_ident()
    _depth = 0
    _noted.clear()
    _leave()


os.register_at_fork(after_in_child=_forked)


class RobustLock:
    """A robust, process-shared mutex living in ``memory`` (a uint8 array of ``SIZE`` bytes).

    ``with lock:`` acquires with the default timeout; ``acquire(timeout)`` raises ``WaitTimeout``
    when it expires. ``recovered`` counts acquisitions (in this process) that found the previous
    holder dead; ``on_recover`` is called, holding the lock, each time that happens.
    """

    default_timeout = 30.0

    def __init__(
        self, memory: np.ndarray, *, initialise: bool = False, on_recover: Callable[[], None] | None = None
    ) -> None:
        if memory.nbytes < SIZE or memory.ctypes.data % 8:
            raise ValueError(f"a RobustLock needs {SIZE} aligned bytes, got {memory.nbytes}")
        self.memory = memory
        """The mutex's bytes (and the repair word): for the C lockers (``_native.push``)."""
        self._repair = memory[REPAIR:REPAIR + 8].view(np.int64)
        self._waits = memory[WAITS:WAITS + 8].view(np.int64)
        self._ptr = ctypes.c_void_p(memory.ctypes.data)
        lib = _lib()
        self._trylock = lib.pthread_mutex_trylock
        self._unlock = lib.pthread_mutex_unlock
        self._timedlock = lib.pthread_mutex_timedlock
        self._consistent = lib.pthread_mutex_consistent
        self.recovered = 0
        self._on_recover = on_recover
        if initialise:
            attr = ctypes.create_string_buffer(64)
            _check(lib.pthread_mutexattr_init(attr), "pthread_mutexattr_init")
            _check(lib.pthread_mutexattr_setpshared(attr, _PROCESS_SHARED), "setpshared")
            _check(lib.pthread_mutexattr_setrobust(attr, _ROBUST), "setrobust")
            _check(lib.pthread_mutexattr_settype(attr, _ERRORCHECK), "settype")
            _check(lib.pthread_mutex_init(self._ptr, attr), "pthread_mutex_init")
            lib.pthread_mutexattr_destroy(attr)

    def acquire(self, timeout: float | None = None) -> None:
        """Take the mutex; ``WaitTimeout`` after ``timeout`` seconds (``default_timeout``). From
        here to ``release`` the handlers of ``DEFERRED`` wait (module docstring)."""
        deadline = None
        while True:
            defer_signals()
            try:
                rc = self._trylock(self._ptr) if deadline is None else self._wait(deadline)
            except BaseException:  # a handler of a signal that is not deferred raised as the call returned
                self._drop()
                resume_signals()
                raise
            if not rc or rc == errno.EOWNERDEAD:
                if deadline is not None:
                    self._waits[0] += 1  # held now: the count is exact
                if rc:
                    self._recover()
                elif self._repair[0]:  # a C locker found the holder dead (module docstring)
                    self._recover(consistent=True)
                return
            resume_signals()  # not held: a signal that came meanwhile (Ctrl-C while waiting) runs here
            if rc == errno.EDEADLK:
                raise RuntimeError("this thread already holds the buffer's lock (a re-entrant call)")
            if rc not in (errno.EBUSY, errno.ETIMEDOUT):
                _check(rc, "pthread_mutex_lock")
            limit = self.default_timeout if timeout is None else timeout
            if deadline is None:
                deadline = time.time() + limit
            elif time.time() >= deadline:
                raise WaitTimeout(
                    f"waited {limit:.1f} s for the buffer's lock; its holder is alive but stuck "
                    "(stopped with SIGSTOP, or in a debugger?)"
                )

    def _wait(self, deadline: float) -> int:
        # in slices: a blocked pthread call does not return for a signal, so Ctrl-C would only
        # be seen once the lock is free; between slices the signal handlers run
        until = min(deadline, time.time() + 0.05)
        ts = _Timespec(int(until), int((until % 1) * 1e9))
        return int(self._timedlock(self._ptr, ctypes.byref(ts)))

    def _recover(self, *, consistent: bool = False) -> None:
        # the previous holder died inside its critical section; the state it guarded is
        # repairable by construction (module docstring), so mark the mutex usable again
        if not consistent:
            self._consistent(self._ptr)
        self.recovered += 1
        if self._on_recover is not None:
            try:
                self._on_recover()
            except BaseException:
                self._repair[0] = 1  # still owed: the next locker tries again
                self.release()
                raise
        self._repair[0] = 0

    def _drop(self) -> None:
        """Give the mutex back if the call that was interrupted had taken it."""
        again = self._trylock(self._ptr)
        if again in (0, errno.EDEADLK, errno.EOWNERDEAD):
            if again == errno.EOWNERDEAD:  # its repairs are owed to the next locker
                self._consistent(self._ptr)
                self._repair[0] = 1
            self._unlock(self._ptr)

    def holder(self) -> int | None:
        """The thread id (``threading.get_native_id``) of the thread of this process that holds
        the mutex, or ``None`` (free, or held by another process)."""
        tid = int(self.memory[:4].view(np.int32)[0]) & _TID_MASK
        return tid if tid and os.path.exists(f"/proc/self/task/{tid}") else None

    def let_go(self, *, release: bool = True) -> None:
        """Before this mutex's memory may be unmapped (module docstring): held by this thread, it
        is released (with ``release``); held by another thread of this process (or by this one
        without ``release``), its memory stays mapped until the process exits."""
        tid = self.holder()
        if tid is None:
            return
        if release and tid == threading.get_native_id():
            self.release()
        else:
            _PINNED.append(self.memory)

    def __del__(self) -> None:
        try:
            self.let_go(release=False)  # nothing runs deferred handlers from a finalizer
        except Exception:  # a finalizer at interpreter exit (modules gone): the process ends anyway
            pass

    @property
    def waits(self) -> int:
        """Times a locker, in any process, found the lock held and waited for it (``top``)."""
        return int(self._waits[0])

    def release(self) -> None:
        """Release the lock (it must be held by this thread), then run the signal handlers deferred while it was
        held."""
        _check(self._unlock(self._ptr), "pthread_mutex_unlock")  # raises only when not held: nothing deferred
        resume_signals()

    def __enter__(self) -> RobustLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _check(rc: int, what: str) -> None:
    if rc:
        raise OSError(rc, f"{what} failed: {errno.errorcode.get(rc, rc)}")
