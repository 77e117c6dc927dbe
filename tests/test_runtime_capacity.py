"""What a cluster checks before it starts: world sizes that cannot work are refused with a
ValueError that says why and what to do, crowded cores get a warning, a slow start shows
progress, and the usual small clusters print nothing new."""

import os
import warnings

import numpy as np
import pytest

import parlab
from parlab.runtime import capacity
from parlab.runtime.placement import resolve

pytestmark = pytest.mark.timeout(120)
MiB = 2**20


@pytest.mark.parametrize("world_size", [2.5, 4.0, "4", True, None])
def test_a_world_size_that_is_not_a_whole_number_is_refused(world_size):
    with pytest.raises(ValueError, match="whole number of ranks"):
        resolve(world_size, gpu_count=0)


def test_any_integer_type_is_a_world_size():
    # An ipywidgets slider or numpy gives integers that are not Python ints.
    placement = resolve(np.int64(3), gpu_count=0)
    assert placement.world_size == 3 and type(placement.world_size) is int


def test_more_ranks_than_memory_holds_is_refused_with_the_numbers():
    room = 99 * capacity.IDLE_RANK_BYTES
    capacity.refuse_impossible(99, room, None)
    with pytest.raises(ValueError) as info:
        capacity.refuse_impossible(100, room, None)
    message = str(info.value)
    assert "world_size=100 needs about 14.6 GiB" in message
    assert f"about {capacity.IDLE_RANK_BYTES // MiB} MiB" in message
    assert "only 14.5 GiB is available; use at most 99 ranks" in message


def test_more_ranks_than_open_files_allow_is_refused_with_the_numbers():
    limit = 1024
    largest = (limit - capacity.BASE_OPEN_FILES) // capacity.PARENT_FILES_PER_RANK
    capacity.refuse_impossible(largest, None, limit)
    with pytest.raises(ValueError, match=f"the limit is 1024; use at most {largest} ranks, or raise .*ulimit -n"):
        capacity.refuse_impossible(largest + 1, None, limit)


def test_unknown_limits_are_not_checked():
    capacity.refuse_impossible(10**6, None, None)


def test_crowded_cores_get_a_warning_with_the_numbers_and_what_to_do():
    assert capacity.crowding_warning(8, cores=2) is None
    message = capacity.crowding_warning(100, cores=2)
    assert message.startswith("world_size=100 on 2 CPU core(s): the ranks time-share the cores")
    assert f"about {100 * capacity.START_CPU_S_PER_RANK / 2:.0f} s" in message
    assert message.endswith("Up to 8 ranks give the same results faster.")


def test_only_a_slow_start_shows_progress():
    assert not any(capacity.start_is_slow(n, cores=2) for n in (1, 2, 3, 4))
    assert capacity.start_is_slow(5, cores=2) and capacity.start_is_slow(100, cores=2)


def test_check_refuses_warns_and_says_when_to_show_progress():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert capacity.check(4, cores=2, available_bytes=2**40, open_files_limit=2**16) is False
    with pytest.warns(UserWarning, match="world_size=100 on 2 CPU core"):
        assert capacity.check(100, cores=2, available_bytes=2**40, open_files_limit=2**16) is True
    with pytest.raises(ValueError, match="use at most 6 ranks"):
        capacity.check(100, cores=2, available_bytes=6 * capacity.IDLE_RANK_BYTES, open_files_limit=2**16)


def test_available_memory_reads_memavailable(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:  1000 kB\nMemAvailable:   23000000 kB\n")
    assert capacity.available_memory(str(meminfo)) == 23000000 * 1024
    assert capacity.available_memory(str(tmp_path / "absent")) is None
    if os.path.exists("/proc/meminfo"):
        assert capacity.available_memory() > 0


def test_a_cluster_beyond_this_machines_memory_is_refused_before_any_process_starts(monkeypatch):
    monkeypatch.setattr(capacity, "available_memory", lambda: 3 * capacity.IDLE_RANK_BYTES)
    with pytest.raises(ValueError, match="world_size=5 needs about .* use at most 3 ranks"):
        parlab.Cluster(world_size=5)


def test_a_slow_start_shows_a_progress_bar_and_a_small_cluster_prints_nothing(monkeypatch, capsys):
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    with parlab.Cluster(world_size=2) as cluster:
        assert cluster.run(lambda: "ok") == ["ok", "ok"]
    assert capsys.readouterr() == ("", "")

    monkeypatch.setattr(os, "cpu_count", lambda: 1)  # 3 ranks on 1 core start slowly
    with parlab.Cluster(world_size=3) as cluster:
        out, err = capsys.readouterr()
        assert out == ""
        assert "ranks started" in err and "3/3" in err
        assert cluster.run(lambda: "ok") == ["ok"] * 3
        assert capsys.readouterr() == ("", "")  # calls on started ranks show no bar
