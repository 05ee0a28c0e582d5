"""How busy the machine was with other work while a row ran, in cores.

Latency on a shared CPU depends on what else runs: a second process on one of two cores more
than halves the speed of an engine whose threads wait for each other. Each row records the CPU
time the whole machine spent (``/proc/stat``, hypervisor steal included) minus the time spent by
the benchmark's own processes, divided by the row's wall time; tables show it next to the
figures, so a noisy row can be told from a slow engine. Linux only (None elsewhere).
"""

from __future__ import annotations

import os
import resource
import time


def busy_cpu_seconds() -> float | None:
    """CPU seconds all cores spent busy since boot (user, nice, system, irq, softirq, steal)."""
    try:
        with open("/proc/stat", encoding="ascii") as handle:
            fields = handle.readline().split()
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def process_cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of a running process (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


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
