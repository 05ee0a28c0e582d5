"""Telling a busy machine from a slow engine: the other-work meter and the retry policy."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from sonar_core.bench.cpu_load import LoadMeter, QuietPolicy, busy_cpu_seconds, process_cpu_seconds, quietest

pytestmark = pytest.mark.skipif(busy_cpu_seconds() is None, reason="needs /proc/stat (Linux)")


def test_our_own_work_is_not_other_work() -> None:
    """A busy child of ours, named by pid, counts as our work; unnamed, it counts as other work."""
    child = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 1.0\nwhile time.time() < end: pass"])
    time.sleep(0.2)  # past the interpreter's start
    named = LoadMeter(pids=(child.pid,)).start()
    unnamed = LoadMeter().start()
    time.sleep(0.5)  # measured while the child spins
    other_unnamed = unnamed.stop()
    other_named = named.stop()
    child.wait()
    assert other_named is not None and other_unnamed is not None
    assert other_unnamed - other_named >= 0.1  # the child's share of a core moved out of "other"
    assert process_cpu_seconds(os.getpid()) > 0.0
    assert process_cpu_seconds(2**22 + 7) == 0.0  # no such process


def _policy() -> QuietPolicy:
    return QuietPolicy(max_other_cpu=0.5, max_attempts=3, max_wait_s=0.0, window_s=0.01)


def test_a_quiet_first_attempt_is_kept() -> None:
    calls: list[int] = []
    value, other, attempts = quietest(_policy(), lambda n: (calls.append(n) or f"run{n}", 0.1))
    assert (value, other, attempts, calls) == ("run1", 0.1, 1, [1])


def test_busy_attempts_are_repeated_and_the_quietest_kept() -> None:
    loads = {1: 1.5, 2: 0.9, 3: 1.2}
    retried: list[float | None] = []
    value, other, attempts = quietest(_policy(), lambda n: (f"run{n}", loads[n]), retried.append)
    assert (value, other, attempts) == ("run2", 0.9, 3)
    assert retried == [1.5, 0.9]


def test_without_a_policy_each_row_runs_once() -> None:
    assert quietest(None, lambda n: (n, 5.0)) == (1, 5.0, 1)


def test_a_competing_load_spins_while_the_block_runs_and_stops_with_it():
    import time

    from sonar_core.bench.cpu_load import competing_load

    with competing_load(1) as spinners:
        time.sleep(1.0)
        assert len(spinners) == 1 and spinners[0].poll() is None
        assert process_cpu_seconds(spinners[0].pid) > 0.2  # it spins (even on a busy machine)
    assert all(spinner.poll() is not None for spinner in spinners)
