"""A watchdog that removes the blocks a process created when it dies, SIGKILL included, and only
those blocks.

multiprocessing's resource tracker unlinks by name. A creator was killed, ``shmbuffer gc`` removed
its block, a new buffer was created under the same name, and the old tracker then unlinked the new
block. This watchdog unlinks a path only while it is still the file that was registered: the same
``(st_dev, st_ino)``.

The first ``Segment.create`` in a process starts the process's watchdog (``track``): ``python -I -S
<this file> <creator pid>``. It imports only the standard library, runs in its own session (Ctrl-C
in a terminal does not reach it), writes nothing (its stdout and stderr are /dev/null) and opens no
file in /dev/shm, so it keeps no block alive. Its stdin is the read end of a pipe, and the creator
holds the write end (close-on-exec, and closed in forked children). The creator writes one line
per event, ``+ DEV INO PATH`` once it has created a file and ``- DEV INO PATH`` once it has removed
it or given it up. The watchdog stops when its stdin reaches EOF, or when its parent is no longer
the creator (checked every 0.5 s, so a process that still holds the pipe open cannot keep it
waiting). It then removes each path still registered, if that path is still the registered file.

``lstat`` then ``unlink`` is not atomic. If someone removes the file and creates a new one under
the same name between those two calls, a window of microseconds, the new file is removed.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading

_lock = threading.Lock()
_watch: tuple[int, int, int] | None = None  # (creator pid, watchdog pid, write end of its pipe)
_held: set[tuple[str, tuple[int, int]]] = set()


def remove(path: str, ident: tuple[int, int]) -> bool:
    """Unlink ``path`` if it is still the file ``ident`` (``st_dev``, ``st_ino``) names; True if
    it was removed."""
    try:
        st = os.lstat(path)
        if (st.st_dev, st.st_ino) != ident:
            return False
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def _line(op: str, path: str, ident: tuple[int, int]) -> bytes:
    return f"{op} {ident[0]} {ident[1]} {path}\n".encode()


def _start() -> tuple[int, int, int]:
    read, write = os.pipe()  # both close-on-exec; posix_spawn's dup2 makes fd 0 inheritable
    try:
        devnull = [(os.POSIX_SPAWN_OPEN, fd, os.devnull, os.O_WRONLY, 0) for fd in (1, 2)]
        args = [sys.executable, "-I", "-S", os.path.abspath(__file__), str(os.getpid())]
        pid = os.posix_spawn(sys.executable, args, os.environ,
                             file_actions=[(os.POSIX_SPAWN_DUP2, read, 0), *devnull], setsid=True)
    except BaseException:
        os.close(write)
        raise
    finally:
        os.close(read)
    return os.getpid(), pid, write


def _send(data: bytes) -> None:
    """Write to this process's watchdog, starting one first if it has none (or its watchdog
    died: the new one is told every block this process still holds)."""
    global _watch
    for attempt in (0, 1):
        if _watch is None:
            _watch = _start()
            if attempt:
                data = b"".join(_line("+", path, ident) for path, ident in _held)
        try:
            os.write(_watch[2], data)  # under PIPE_BUF per line: each line arrives whole
            return
        except OSError:
            if attempt:
                raise
            os.close(_watch[2])
            _watch = None


def track(path: str, ident: tuple[int, int]) -> None:
    """Have ``path`` removed when this process dies, if it is still the file ``ident``."""
    with _lock:
        _held.add((path, ident))
        _send(_line("+", path, ident))


def untrack(path: str, ident: tuple[int, int]) -> None:
    """Forget ``path``: it was removed, or given up. Never raises (it runs at exit)."""
    with _lock:
        _held.discard((path, ident))
        if _watch is not None:
            try:
                os.write(_watch[2], _line("-", path, ident))
            except OSError:
                pass  # no watchdog: nothing for it to remove


def watchdog_pid() -> int | None:
    """The pid of this process's watchdog, if it has started one."""
    return _watch[1] if _watch is not None else None


def _forget_in_child() -> None:
    """A forked child owns none of its parent's blocks: it closes its copy of the pipe, so the
    watchdog sees EOF when the parent dies, and starts its own watchdog if it creates a block."""
    global _watch, _lock
    if _watch is not None:
        try:
            os.close(_watch[2])
        except OSError:
            pass
    _watch, _lock = None, threading.Lock()
    _held.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def main(creator: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    held: set[tuple[str, tuple[int, int]]] = set()
    pending = b""
    while True:
        gone = os.getppid() != creator  # the creator died: read what is left, without waiting
        if not select.select([0], [], [], 0 if gone else 0.5)[0]:
            if gone:
                break
            continue
        chunk = os.read(0, 65536)
        if not chunk:
            break
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            try:
                op, dev, ino, path = line.decode().split(" ", 3)
                entry = (path, (int(dev), int(ino)))
            except ValueError:
                continue
            if op == "+":
                held.add(entry)
            else:
                held.discard(entry)
    for path, ident in held:
        try:
            remove(path, ident)
        except OSError:
            pass


if __name__ == "__main__":
    main(int(sys.argv[1]))
