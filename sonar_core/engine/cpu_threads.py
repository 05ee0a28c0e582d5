"""The CPU engine's intra-op thread count, kept at the cores that other work leaves free.

PyTorch runs every operator on a pool of threads that meet at a barrier when the operator ends.
When another process keeps one of the engine's cores busy, the thread sharing that core is
descheduled for a scheduler slice at a time, and every operator (about a thousand per decode
step) waits for it at the barrier while its partner spins: throughput falls far more than in
proportion to the core lost (a 5-8x collapse measured with one busy core of two). Fewer threads
than cores avoid the barrier stalls, so the engine measures, every half second of work, how many
cores other processes used (the machine's busy CPU time from ``/proc/stat`` minus this process's)
and runs on the rest: never more than the thread count it started with (``OMP_NUM_THREADS`` or
``torch.set_num_threads`` set by the user), never fewer than one. A change needs two readings in
a row, so a short burst of other work does not make the pool flap.
"""

from __future__ import annotations

import logging
import math
import os
import resource
import time
from collections.abc import Callable

import torch

from sonar_core.cpu_usage import busy_cpu_seconds

logger = logging.getLogger("sonar.engine")

# Seconds of engine work between two readings of the machine's load. Short, because every step
# taken on a stalled pool is slow (with 2 s, the first request after the load began ran at half
# the speed of the rest); long enough for /proc/stat's 100 Hz ticks (0.5 s on two cores is 100
# ticks, so a reading is good to a few hundredths of a core).
INTERVAL_S = 0.5


def own_cpu_seconds() -> float:
    """CPU seconds of this process, all of its threads (spinning pool threads included)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class ThreadGovernor:
    """Adjusts ``torch.set_num_threads`` to the free cores; call :meth:`observe` once per step.

    ``busy`` and ``own`` give the machine's and this process's CPU seconds, ``clock`` the time;
    they default to /proc, getrusage and the monotonic clock, and tests pass their own. Without
    /proc (not Linux) the governor does nothing.
    """

    def __init__(
        self,
        max_threads: int,
        cores: int,
        *,
        busy: Callable[[], float | None] = busy_cpu_seconds,
        own: Callable[[], float] = own_cpu_seconds,
        clock: Callable[[], float] = time.monotonic,
        set_threads: Callable[[int], None] = torch.set_num_threads,
        interval_s: float = INTERVAL_S,
    ) -> None:
        self.max_threads = max(1, max_threads)
        self.cores = max(1, cores)
        self.threads = self.max_threads
        self._busy, self._own, self._clock, self._set_threads = busy, own, clock, set_threads
        self.interval_s = interval_s
        self._last = self._reading()
        self._proposed: int | None = None

    @classmethod
    def for_this_machine(cls) -> ThreadGovernor:
        """A governor over the cores this process may run on, from the current thread count."""
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        return cls(torch.get_num_threads(), cores)

    def _reading(self) -> tuple[float, float, float] | None:
        busy = self._busy()
        return None if busy is None else (self._clock(), busy, self._own())

    def observe(self) -> None:
        """Take a reading when the interval has passed, and apply a thread count that two
        readings in a row agree on."""
        if self._last is None or self._clock() - self._last[0] < self.interval_s:
            return
        now = self._reading()
        if now is None:
            return
        (then, busy_then, own_then), (at, busy_now, own_now) = self._last, now
        self._last = now
        other = max(0.0, (busy_now - busy_then) - (own_now - own_then)) / (at - then)
        target = self.free_cores(other)
        if target == self.threads:
            self._proposed = None
        elif target == self._proposed:
            logger.info(
                "other processes use %.1f of %d cores: running on %d thread%s (was %d)",
                other, self.cores, target, "" if target == 1 else "s", self.threads,
            )
            self._set_threads(target)
            self.threads, self._proposed = target, None
        else:
            self._proposed = target

    def free_cores(self, other: float) -> int:
        """The thread count for ``other`` cores of other work: the cores left, to the nearest
        core (a core more than half taken by other work stalls the barrier more than its thread
        adds), between 1 and the starting count."""
        return max(1, min(self.max_threads, math.floor(self.cores - other + 0.5)))
