"""parlab.processes_vs_threads: the speed-ups lecture 00 asserts on are over the better of the
two measurements of one replica (the same work in either arrangement)."""

import pytest

from parlab import processes_vs_threads


def test_speedups_are_over_the_better_measurement_of_one_replica():
    throughput = {"threads": [200.0, 300.0, 250.0], "processes": [300.0, 540.0, 600.0]}
    got = processes_vs_threads.speedups(throughput)
    # the threads' own N_d = 1 run (200) was slowed by something else: 300 is one replica's rate
    assert got == {"threads": [pytest.approx(2 / 3), 1.0, pytest.approx(5 / 6)], "processes": [1.0, 1.8, 2.0]}


def test_speedups_need_one_replica_first():
    with pytest.raises(ValueError, match=r"must start with 1"):
        processes_vs_threads.speedups({"threads": [1.0, 2.0]}, replica_counts=(2, 4))
