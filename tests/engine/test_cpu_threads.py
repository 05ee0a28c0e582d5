"""The thread governor runs the CPU engine on the cores other work leaves free."""

from __future__ import annotations

from sonar_core.engine.cpu_threads import ThreadGovernor


class FakeMachine:
    """A clock and CPU counters that advance as a test says: ``other`` cores of other work and
    ``own`` cores of this process per second."""

    def __init__(self) -> None:
        self.now = 0.0
        self.busy = 0.0
        self.own = 0.0
        self.applied: list[int] = []

    def run(self, seconds: float, other: float, own: float = 1.0) -> None:
        self.now += seconds
        self.busy += (other + own) * seconds
        self.own += own * seconds

    def governor(self, max_threads: int = 2, cores: int = 2) -> ThreadGovernor:
        return ThreadGovernor(
            max_threads, cores, busy=lambda: self.busy, own=lambda: self.own, clock=lambda: self.now,
            set_threads=self.applied.append, interval_s=2.0,
        )


def test_a_busy_core_takes_one_thread_away_after_two_readings_and_gives_it_back():
    machine = FakeMachine()
    governor = machine.governor()
    for _ in range(2):
        machine.run(2.0, other=1.0)
        governor.observe()
    assert machine.applied == [1] and governor.threads == 1
    for _ in range(2):
        machine.run(2.0, other=0.0)
        governor.observe()
    assert machine.applied == [1, 2] and governor.threads == 2


def test_a_short_burst_does_not_change_the_pool():
    machine = FakeMachine()
    governor = machine.governor()
    for other in (1.0, 0.0, 1.0, 0.0):
        machine.run(2.0, other=other)
        governor.observe()
    assert machine.applied == [] and governor.threads == 2


def test_readings_wait_for_the_interval():
    machine = FakeMachine()
    governor = machine.governor()
    for _ in range(10):  # 10 steps of 0.1 s: one reading at most
        machine.run(0.1, other=2.0)
        governor.observe()
    assert machine.applied == []


def test_the_count_stays_between_one_and_the_starting_count():
    governor = FakeMachine().governor(max_threads=4, cores=8)
    assert [governor.free_cores(other) for other in (0.0, 3.0, 4.4, 4.6, 7.9, 20.0)] == [4, 4, 4, 3, 1, 1]


def test_without_proc_the_governor_does_nothing():
    applied: list[int] = []
    governor = ThreadGovernor(2, 2, busy=lambda: None, own=lambda: 0.0, clock=lambda: 100.0, set_threads=applied.append)
    governor.observe()
    assert applied == [] and governor.threads == 2
