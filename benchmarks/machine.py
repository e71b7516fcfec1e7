"""What the numbers were measured on: CPU, cores, memory, load, software versions, GPU."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

from .peers import version

PACKAGES = ["numpy", "torch", "shmbuffer", "cpprb", "torchrl", "tensordict", "stable-baselines3", "gymnasium",
            "matplotlib", "psutil"]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit() -> str | None:
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "shmbuffer"], cwd=root, capture_output=True,
                               text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty shmbuffer/" if dirty else "")


def now() -> str:
    """The time in UTC, to the second (ISO 8601)."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def gpu() -> str:
    try:
        import torch
    except ImportError:
        return "unknown (torch is not installed)"
    if not torch.cuda.is_available():
        return "no GPU"
    return ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))


def info() -> dict[str, Any]:
    import psutil

    vm = psutil.virtual_memory()
    try:
        import torch

        threads: int | None = torch.get_num_threads()
    except ImportError:
        threads = None
    return {
        "date": now(),
        "cpu": cpu_model(),
        "logical_cores": os.cpu_count(),
        "physical_cores": psutil.cpu_count(logical=False),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_gib": round(vm.total / 2**30, 1),
        "memory_available_gib": round(vm.available / 2**30, 1),
        "dev_shm_free_gib": round(psutil.disk_usage("/dev/shm").free / 2**30, 1) if Path("/dev/shm").exists() else None,
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "os": f"{platform.system()} {platform.release()}",
        "python": sys.version.split()[0],
        "packages": {p: version(p) or "not installed" for p in PACKAGES},
        "torch_threads_main": threads,
        "gpu": gpu(),
        "shmbuffer_commit": git_commit(),
        "shmbuffer_path": _path(),
    }


def _path() -> str:
    """Which implementation ran shmbuffer's hot path: "native" (the C extension) or "python"."""
    try:
        from shmbuffer import native
    except ImportError:  # a shmbuffer from before the native path
        return "python"
    return f"{native.ACTIVE} ({native.REASON})"
