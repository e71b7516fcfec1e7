"""A janitor that removes a block once a given process is gone and the block's creator is dead.

``start(name, pid)`` runs ``python -m shmbuffer.shm.janitor <name> <pid>`` through ``setsid -f``:
the janitor's parent has exited by the time ``start`` returns, so it is nobody's child and lives in
its own session. It checks every 0.5 s whether ``pid`` is alive; once it is not, it reads the
block's header and removes the block if its creator is dead (``Header.creator_state``), then exits.
It also exits when the block is already gone.

Why: Ray kills an actor's child processes with the actor, the creator's watchdog
(``_tracker.py``) among them, so a killed shard actor (``shmbuffer.ray``) would leave its block in
``/dev/shm``. The janitor, outside Ray's process tree, removes it. Without ``setsid`` (util-linux)
no janitor starts and ``shmbuffer gc`` cleans up after a crash.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

from .segment import read_header, remove

POLL = 0.5
"""Seconds between two checks of the watched process."""


def start(name: str, pid: int) -> bool:
    """Start a janitor for block ``name`` that waits for process ``pid``; ``False`` when
    ``setsid`` is missing (no janitor). Raises what ``subprocess.run`` raises if the start fails."""
    if shutil.which("setsid") is None:
        return False
    subprocess.run(["setsid", "-f", sys.executable, "-m", __name__, name, str(pid)],
                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   check=True, timeout=30)
    return True


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists (one we may not signal counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def watch(name: str, pid: int, poll: float = POLL) -> bool:
    """Wait until ``pid`` is gone, then remove block ``name`` if its creator is dead; whether it
    removed it."""
    while alive(pid):
        time.sleep(poll)
    try:
        header = read_header(name)
    except Exception:  # the block is gone or unreadable: nothing to remove
        return False
    if header.creator_state == "dead":
        return remove(name, header.ident)
    return False


def main(argv: list[str] | None = None) -> int:
    """``python -m shmbuffer.shm.janitor NAME PID``."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m shmbuffer.shm.janitor NAME PID", file=sys.stderr)
        return 2
    watch(args[0], int(args[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
