"""Pacing a background save's writes (``async_save(..., write_bytes_per_s=...)``).

Written at full speed, a background save's first half second costs a training step on the
same host ~10-15% (page-cache copies, writeback and memory bandwidth, which no CPU priority
buys back: ``benchmarks/results/profiles.md``); spread over a few seconds, each step loses
a few percent and the steps lose less in all."""

from __future__ import annotations

import math
import threading
import time


class Pace:
    """Spaces writes out to at most ``bytes_per_s`` (None: no limit), shared by the threads
    writing one save: each write waits for its slot, which starts once the earlier slots'
    bytes have had their time."""

    def __init__(self, bytes_per_s: float | None) -> None:
        number = isinstance(bytes_per_s, (int, float)) and not isinstance(bytes_per_s, bool)
        if bytes_per_s is not None and not (number and bytes_per_s > 0 and math.isfinite(bytes_per_s)):
            raise ValueError(f"write_bytes_per_s must be a positive number of bytes per second, not {bytes_per_s!r}")
        self.bytes_per_s = bytes_per_s
        self._next = time.monotonic()
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> None:
        """Wait for the slot of a write of ``nbytes``."""
        if self.bytes_per_s is None:
            return
        with self._lock:
            now = time.monotonic()
            start = max(self._next, now)
            self._next = start + nbytes / self.bytes_per_s
        if start > now:
            time.sleep(start - now)
