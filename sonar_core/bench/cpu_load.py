"""How busy the machine was with other work while a row ran, in cores.

Latency on a shared CPU depends on what else runs: a second process on one of two cores more
than halves the speed of an engine whose threads wait for each other. Each row records the CPU
time the whole machine spent (``/proc/stat``, hypervisor steal included) minus the time spent by
the benchmark's own processes, divided by the row's wall time; tables show it next to the
figures, so a noisy row can be told from a slow engine. Linux only (None elsewhere).
"""

from __future__ import annotations

import resource
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

from sonar_core.cpu_usage import busy_cpu_seconds, process_cpu_seconds

T = TypeVar("T")


def _own_cpu_seconds(pids: tuple[int, ...]) -> float:
    own = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        own += usage.ru_utime + usage.ru_stime
    return own + sum(process_cpu_seconds(pid) for pid in pids)


class LoadMeter:
    """Measures the cores other work kept busy between :meth:`start` and :meth:`stop`.

    The benchmark's own CPU is this process plus its finished (waited-for) children, plus the
    running processes named in ``pids`` (a server started for the row).
    """

    def __init__(self, pids: tuple[int, ...] = ()) -> None:
        self.pids = pids
        self._start: tuple[float, float, float] | None = None

    def start(self) -> LoadMeter:
        busy = busy_cpu_seconds()
        self._start = None if busy is None else (time.monotonic(), busy, _own_cpu_seconds(self.pids))
        return self

    def stop(self) -> float | None:
        busy = busy_cpu_seconds()
        if self._start is None or busy is None:
            return None
        started, busy_before, own_before = self._start
        wall = time.monotonic() - started
        if wall <= 0:
            return None
        other = (busy - busy_before) - (_own_cpu_seconds(self.pids) - own_before)
        return max(other, 0.0) / wall


@dataclass(frozen=True)
class QuietPolicy:
    """When a row counts as measured on a quiet machine, and what to do when it is not.

    Before each attempt the benchmark waits (up to ``max_wait_s``) until other work keeps fewer
    than ``max_other_cpu`` cores busy; an attempt during which other work went above it is made
    again, up to ``max_attempts`` in all, and the quietest attempt is kept.
    """

    max_other_cpu: float
    max_attempts: int = 3
    max_wait_s: float = 300.0
    window_s: float = 2.0  # how long each look at the machine lasts while waiting

    def is_quiet(self, other_cpu: float | None) -> bool:
        return other_cpu is None or other_cpu <= self.max_other_cpu


def wait_until_quiet(policy: QuietPolicy) -> float | None:
    """Sample the machine in windows of ``policy.window_s`` until it is quiet or ``max_wait_s``
    has passed; return the last sample (None where /proc/stat does not exist)."""
    deadline = time.monotonic() + policy.max_wait_s
    while True:
        meter = LoadMeter().start()
        time.sleep(policy.window_s)
        other = meter.stop()
        if policy.is_quiet(other) or time.monotonic() >= deadline:
            return other


def quietest(
    policy: QuietPolicy | None,
    attempt: Callable[[int], tuple[T, float | None]],
    on_retry: Callable[[float | None], None] = lambda other: None,
) -> tuple[T, float | None, int]:
    """Run ``attempt(number)`` (which returns a value and the other-work load it saw) once, or,
    under a policy, until an attempt is quiet or the attempts run out; return the quietest value,
    its load and how many attempts were made."""
    if policy is not None:
        wait_until_quiet(policy)
    best_value, best_other = attempt(1)
    number = 1
    attempts = policy.max_attempts if policy is not None else 1
    while policy is not None and not policy.is_quiet(best_other) and number < attempts:
        on_retry(best_other)
        wait_until_quiet(policy)
        number += 1
        value, other = attempt(number)
        if other is None or best_other is None or other < best_other:
            best_value, best_other = value, other
    return best_value, best_other, number


@contextmanager
def competing_load(cores: int) -> Iterator[list[subprocess.Popen]]:
    """``cores`` processes that each spin one core until the block ends (a stand-in for the other
    tenants of a shared machine); none for 0. Yields the processes."""
    spinners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL)
        for _ in range(cores)
    ]
    try:
        yield spinners
    finally:
        for spinner in spinners:
            spinner.kill()
        for spinner in spinners:
            spinner.wait()
