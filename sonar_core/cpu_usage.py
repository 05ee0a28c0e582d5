"""CPU time from /proc: the whole machine's busy time and one process's, in seconds (Linux).

Both the engine (which sizes its thread pool to the cores other work leaves free,
:mod:`sonar_core.engine.cpu_threads`) and the benchmark (which reports how busy the machine was
while a row ran, :mod:`sonar_core.bench.cpu_load`) read them; neither imports the other.
"""

from __future__ import annotations

import os


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
