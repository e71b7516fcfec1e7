"""Rate limiting between writers and learners, as Reverb's ``SampleToInsertRatio``.

A learner that samples far faster than collectors insert overfits the few rows it has; one that
lags wastes data. With ``RateLimiter(samples_per_insert, min_size, error)`` a buffer keeps

    diff = samples_per_insert * inserted - sampled          (rows, all processes together)

inside the window ``[offset - error, offset + error]``, ``offset = samples_per_insert * min_size``:

* a sample of ``n`` rows waits until the buffer holds at least ``min_size`` rows and
  ``diff - n >= offset - error`` (the learner is not too far ahead);
* with ``block_writers``, a push of ``k`` rows waits until ``diff + samples_per_insert * k <=
  offset + error`` (the writers are not too far ahead).

``samples_per_insert=None`` only waits for ``min_size``. Waits poll the shared counters (with a
short sleep) and raise ``WaitTimeout`` after ``timeout`` seconds, saying which side is ahead.
With ``block_writers``, a sample of more rows than the window (``2 * error + samples_per_insert``)
could never be served, and is refused at once; without it, writers keep inserting until it fits. The
counters are the ring's ``inserted`` (rows ever reserved, across clears) and ``sampled`` (rows
ever handed out), 64-bit and never wrapping, checked and updated under the ring's lock together
with the reservation or the sample they allow, so the window holds exactly across processes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from .. import arguments
from ..errors import WaitTimeout


@dataclass(frozen=True)
class RateLimiter:
    """See the module docstring."""

    samples_per_insert: float | None = None
    min_size: int = 1
    error: float = float("inf")
    block_writers: bool = False
    timeout: float = 60.0

    def __post_init__(self) -> None:
        spi = self.samples_per_insert
        if spi is not None and not (spi > 0 and spi < float("inf")):
            raise ValueError(f"RateLimiter: samples_per_insert must be a positive number or None, got {spi!r}")
        if not isinstance(self.min_size, int) or self.min_size < 1:
            raise ValueError(f"RateLimiter: min_size must be an int >= 1, got {self.min_size!r}")
        if not self.error >= 0:
            raise ValueError(f"RateLimiter: error must be >= 0, got {self.error!r}")
        arguments.timeout(self.timeout, "RateLimiter: timeout", positive=True)

    @property
    def gates_writers(self) -> bool:
        """Whether a push may have to wait for samples (``block_writers`` with a ratio to hold)."""
        return self.block_writers and self.samples_per_insert is not None

    @property
    def offset(self) -> float:
        """The samples the ratio allows before ``min_size`` rows are in: ``samples_per_insert * min_size``."""
        return (self.samples_per_insert or 0.0) * self.min_size

    def can_sample(self, inserted: int, sampled: int, size: int, n: int) -> bool:
        """Whether a sample of ``n`` rows keeps the ratio, given the inserts and samples so far and the rows held."""
        if size < self.min_size:
            return False
        spi = self.samples_per_insert
        return spi is None or spi * inserted - sampled - n >= self.offset - self.error

    def can_insert(self, inserted: int, sampled: int, size: int, k: int) -> bool:
        """Whether a push of ``k`` rows keeps the ratio (always, unless ``gates_writers``)."""
        spi = self.samples_per_insert
        if not self.gates_writers or spi is None:
            return True
        return spi * (inserted + k) - sampled <= self.offset + self.error

    def check_sample_size(self, n: int) -> None:
        """With writers blocked, a sample wider than the whole window would wait forever."""
        if self.gates_writers and n > 2 * self.error + (self.samples_per_insert or 0.0):
            raise ValueError(
                f"RateLimiter: a sample of {n} rows can never fit the window of +-{self.error:g} rows; "
                "raise error above the batch size"
            )

    def wait(self, ready: Callable[[], bool], what: str, state: Callable[[], str], timeout: float | None = None) -> None:
        """Poll ``ready`` until it holds; ``WaitTimeout`` after ``timeout`` (default: the limiter's)."""
        if ready():
            return
        limit = self.timeout if timeout is None else arguments.timeout(timeout, f"{what}: timeout")
        deadline = time.monotonic() + limit
        pause = 0.0001
        while not ready():
            if time.monotonic() > deadline:
                raise WaitTimeout(f"{what} waited {limit:g} s for the rate limiter: {state()}")
            time.sleep(pause)
            pause = min(pause * 2, 0.005)

    def state(self, ring: Any) -> str:
        """The counters of ``ring`` against this window, for an error message."""
        spi = self.samples_per_insert
        diff = (spi or 0) * ring.inserted - ring.sampled
        return (f"{ring.inserted} rows inserted, {ring.sampled} sampled, samples_per_insert={spi}, "
                f"min_size={self.min_size}: diff {diff:g} vs window {self.offset:g} +- {self.error:g}")

    def to_json(self) -> dict[str, Any]:
        """The limiter as JSON (kept in the block's metadata; an infinite ``error`` as ``null``)."""
        out = asdict(self)
        out["error"] = None if self.error == float("inf") else self.error
        return out

    @classmethod
    def from_json(cls, spec: dict[str, Any] | None) -> RateLimiter | None:
        """The limiter that ``to_json`` gave (``None`` for none)."""
        if spec is None:
            return None
        spec = dict(spec)
        spec["error"] = float("inf") if spec["error"] is None else spec["error"]
        return cls(**spec)


def draw_admitted(limiter: RateLimiter | None, ring: Any, rows: int, timeout: float | None, draw: Callable[[], Any]) -> Any:
    """Run ``draw`` (a sample), counting its ``rows`` as sampled in ``ring`` (``ring.Ring``). With
    a limiter, wait until it admits them — tested and counted atomically under the ring's lock —
    before drawing, and give them back if the draw fails."""
    if limiter is None:
        result = draw()
        ring.count_sampled(rows)
        return result
    limiter.check_sample_size(rows)
    limiter.wait(lambda: ring.admit(lambda i, s, size: limiter.can_sample(i, s, size, rows), rows),
                 f"sample of {rows} rows", lambda: limiter.state(ring), timeout)
    try:
        return draw()
    except BaseException:
        ring.count_sampled(-rows)
        raise
