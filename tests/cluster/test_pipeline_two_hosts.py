"""A pipelined group over two hosts: each host one stage of tp 2 (``--nnodes 2 --pipeline-parallel-size 2``).

The hosts are network namespaces joined by a veth pair (tests/cluster/hosts.py): the
leader (node-rank 0: coordinator + ranks 0, 1 = stage 0, layers 0-2 and the
embedding) and a headless node (ranks 2, 3 = stage 1, layers 3-4, the final norm and
LM head; rank 2 samples). Tensor parallelism stays within a host (shared memory),
only the stage-to-stage hidden states cross the link. The references are the shared
goldens (Hugging Face ``transformers``): every golden alone and sixteen at once;
then a rank of the headless stage is killed, and the group fails its requests
(INTERNAL) and exits exactly as a tensor-parallel group does with
``--worker-recovery-timeout-seconds 0``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator

import pytest

from tests.cluster.hosts import (
    LEADER_IP,
    LEADER_PUBLIC_IP,
    descendants,
    netns_unavailable,
    serve_argv,
    stop_process_group,
    two_hosts,
)
from tests.cluster.two_hosts import (
    MASTER_PORT,
    PUBLIC_PORT,
    START_TIMEOUT_S,
    STEP_TIMEOUT_S,
    Group,
    check_a_killed_rank_fails_the_requests_and_stops_the_group,
    check_goldens_alone,
    check_goldens_sixteen_at_once,
)
from tests.paths import STORIES_DIR, requires_stories
from tpserve.client import Client
from tpserve.stream_move import MovePolicy

pytestmark = [pytest.mark.e2e, requires_stories]


def pipeline_flags(node_rank: int) -> list[str]:
    flags = ["--model", str(STORIES_DIR), "--tensor-parallel-size", "2", "--pipeline-parallel-size", "2",
             "--nnodes", "2", "--node-rank", str(node_rank), "--master-addr", LEADER_IP,
             "--master-port", str(MASTER_PORT), "--step-timeout-seconds", str(STEP_TIMEOUT_S),
             "--distributed-timeout-seconds", str(STEP_TIMEOUT_S), "--worker-start-timeout-seconds",
             str(START_TIMEOUT_S)]
    if node_rank == 0:
        return flags + ["--host", LEADER_PUBLIC_IP, "--port", str(PUBLIC_PORT), "--worker-recovery-timeout-seconds", "0"]
    return flags + ["--headless"]


@pytest.fixture(scope="module")
def group(tmp_path_factory) -> Iterator[Group]:
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)
    logs = tmp_path_factory.mktemp("pipeline-two-hosts")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    leader_log, headless_log = logs / "leader.log", logs / "headless.log"
    with two_hosts() as hosts:
        procs = []
        client = Client(f"{LEADER_PUBLIC_IP}:{PUBLIC_PORT}", move_policy=MovePolicy(max_moves=0))
        try:
            procs.append(hosts.run(hosts.leader, "host-a", serve_argv(*pipeline_flags(0)), leader_log, env))
            procs.append(hosts.run(hosts.headless, "host-b", serve_argv(*pipeline_flags(1)), headless_log, env))
            client.wait_ready(timeout_s=START_TIMEOUT_S)
            pids = descendants(procs[0].pid) + descendants(procs[1].pid)
            yield Group(procs[0], procs[1], leader_log, headless_log, client, pids, lambda: procs[1])
        finally:
            client.close()
            for proc in procs:
                stop_process_group(proc)


def test_each_host_is_one_stage(group: Group) -> None:
    info = group.client.model_info()
    assert (info.tensor_parallel_size, info.pipeline_parallel_size) == (2, 2)
    group.worker_pids()  # 4 ranks, 2 per host
    headless = group.headless_log.read_text()
    ranks = set(re.findall(r"(?<![\w])rank=(\d+)", headless))  # not tp_rank=/pp_rank=, which the shard line has
    assert {"2", "3"} <= ranks and "0" not in ranks


def test_goldens_token_for_token_alone(group: Group) -> None:
    check_goldens_alone(group)


def test_goldens_token_for_token_sixteen_at_once(group: Group) -> None:
    check_goldens_sixteen_at_once(group)


def test_killing_a_rank_of_the_last_stage_fails_requests_and_stops_the_group(group: Group) -> None:
    check_a_killed_rank_fails_the_requests_and_stops_the_group(group, 3)
