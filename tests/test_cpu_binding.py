"""Which cores a CPU rank binds to (tpserve/cpu_binding.py, ``--cpu-omp-threads-bind``)."""

from __future__ import annotations

import os
import threading

import pytest

from tpserve.config import ClusterConfig
from tpserve.cpu_binding import (bind_process, default_num_threads, format_cpulist, parse_bind, parse_cpulist,
                                 rank_binding)


def test_cpulists_parse_and_print_as_linux_writes_them() -> None:
    assert parse_cpulist("0-3,8,10-11") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpulist(" 5 ") == {5}
    assert format_cpulist([11, 0, 1, 2, 3, 8, 10]) == "0-3,8,10-11"
    assert format_cpulist([4]) == "4"
    for bad in ("", "a", "3-1", "-1", "0-", "1,,2"):
        with pytest.raises(ValueError, match="not a cpulist"):
            parse_cpulist(bad)


def test_explicit_lists_may_not_share_a_core() -> None:
    assert parse_bind("0-1|2-3") == (frozenset({0, 1}), frozenset({2, 3}))
    assert parse_bind("auto") == "auto" and parse_bind("nobind") == "nobind"
    with pytest.raises(ValueError, match=r"local rank 1's cores \[1\] are another rank's too"):
        parse_bind("0-1|1-2")


@pytest.mark.parametrize(("local_world_size", "threads", "expected"), [
    (2, 1, [{6}, {7}]),                 # a core each, counted from the last: the first six stay free
    (2, 3, [{2, 3, 4}, {5, 6, 7}]),     # consecutive cores per rank
    (4, 2, [{0, 1}, {2, 3}, {4, 5}, {6, 7}]),
])
def test_auto_gives_each_rank_cores_of_its_own_from_the_last(local_world_size, threads, expected) -> None:
    cores = [rank_binding("auto", r, local_world_size, threads, range(8)).cores for r in range(local_world_size)]
    assert cores == expected


def test_auto_follows_the_cores_the_process_may_use() -> None:
    allowed = {2, 3, 9, 12}  # a cpuset: not 0..n-1
    assert [rank_binding("auto", r, 2, 1, allowed).cores for r in range(2)] == [{9}, {12}]


def test_auto_binds_nothing_where_it_would_stack_ranks_or_change_nothing() -> None:
    over = rank_binding("auto", 0, 4, 1, range(2))
    assert over.cores is None and "4 ranks x 1 threads outnumber the 2 cores" in over.reason
    alone = rank_binding("auto", 0, 1, 1, range(8))
    assert alone.cores is None and alone.reason == "the host's only rank"
    assert rank_binding("0", 0, 1, 1, range(2)).cores == {0}  # an explicit list binds it all the same


def test_nobind_and_explicit_lists() -> None:
    assert rank_binding("nobind", 0, 2, 1, range(2)).cores is None
    assert rank_binding("0,2|1,3", 1, 2, 1, range(4)).cores == {1, 3}
    with pytest.raises(ValueError, match="names 2 core lists for 3 ranks"):
        rank_binding("0|1", 0, 3, 1, range(4))
    with pytest.raises(ValueError, match=r"local rank 1's cores \[9\] are not among those this process may run on "
                                         r"\(0-3\)"):
        rank_binding("0|9", 1, 2, 1, range(4))


def test_threads_default_to_the_ranks_share_of_the_allowed_cores_or_their_list() -> None:
    assert default_num_threads("auto", 0, 2, range(8)) == 4
    assert default_num_threads("auto", 0, 3, range(2)) == 1  # never 0
    assert default_num_threads("auto", 0, 2, {4, 5, 6}) == 1  # the cpuset, not the machine
    assert default_num_threads("0-2|3", 0, 2, range(8)) == 3
    assert default_num_threads("0-2|3", 1, 2, range(8)) == 1


def test_the_configuration_refuses_a_bad_value_and_lists_that_miss_a_rank() -> None:
    assert ClusterConfig().load.cpu_omp_threads_bind == "auto"
    ok = ClusterConfig.load_from(overrides={"load": {"cpu_omp_threads_bind": "0|1"},
                                            "parallel": {"tensor_parallel_size": 2}})
    assert ok.load.cpu_omp_threads_bind == "0|1"
    with pytest.raises(ValueError, match="not a cpulist"):
        ClusterConfig.load_from(overrides={"load": {"cpu_omp_threads_bind": "all"}})
    with pytest.raises(ValueError, match="names 2 core lists for 4 ranks per host"):
        ClusterConfig.load_from(overrides={"load": {"cpu_omp_threads_bind": "0|1"},
                                           "parallel": {"tensor_parallel_size": 4}})
    # Across hosts the lists are per host: 4 ranks on 2 nodes is 2 per host.
    two_hosts = ClusterConfig.load_from(overrides={"load": {"cpu_omp_threads_bind": "0|1"}, "parallel": {
        "tensor_parallel_size": 4, "nnodes": 2, "master_addr": "10.0.0.1"}})
    assert two_hosts.load.cpu_omp_threads_bind == "0|1"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="binding to a part of the cores needs two of them")
def test_bind_process_binds_every_thread_and_the_threads_started_after() -> None:
    """In a child process, so that this test process keeps its cores."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        seen = pool.apply(_bind_and_look, (sorted(os.sched_getaffinity(0))[-1],))
    assert seen["before"] == seen["after"] == seen["started_after"] == [seen["core"]]


def _bind_and_look(core: int) -> dict:
    ready, done = threading.Event(), threading.Event()
    tid: list[int] = []

    def early() -> None:
        tid.append(threading.get_native_id())
        ready.set()
        done.wait()

    thread = threading.Thread(target=early)
    thread.start()
    ready.wait()
    bind_process(frozenset({core}))
    out: dict = {"core": core, "before": sorted(os.sched_getaffinity(tid[0])), "after": sorted(os.sched_getaffinity(0))}
    late: list = []
    later = threading.Thread(target=lambda: late.append(sorted(os.sched_getaffinity(0))))
    later.start()
    later.join()
    out["started_after"] = late[0]
    done.set()
    thread.join()
    return out
