"""The scaling signals' definitions (coordinator/load_gauges.py) and their export under
tpserve's and vLLM's names from one :meth:`Metrics.set_load` (docs/design/observability.md, "Scaling signals")."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from coordinator.load_gauges import kv_cache_usage, saturation
from coordinator.metrics import Metrics


def test_kv_cache_usage_is_the_held_fraction_of_the_pool() -> None:
    assert kv_cache_usage(64, 64) == 0.0
    assert kv_cache_usage(48, 64) == 0.25
    assert kv_cache_usage(0, 64) == 1.0
    assert kv_cache_usage(0, 0) == 0.0  # before the pool exists


@pytest.mark.parametrize(("running", "waiting", "max_num_seqs", "usage", "expected"), [
    (0, 0, 8, 0.0, 0.0),        # idle
    (2, 0, 8, 0.1, 0.25),       # slots bind first
    (2, 0, 8, 0.6, 0.6),        # KV blocks bind first
    (8, 0, 8, 0.3, 1.0),        # every slot taken
    (1, 0, 1, 0.01, 1.0),       # --max-num-seqs 1 with its one sequence
    (3, 1, 8, 0.4, 1.0),        # anything queued: full, whatever the ratios
    (0, 2, 8, 0.0, 1.0),
])
def test_saturation_is_the_binding_resource_or_one_while_a_request_waits(
        running: int, waiting: int, max_num_seqs: int, usage: float, expected: float) -> None:
    assert saturation(running, waiting, max_num_seqs, usage) == expected


def samples(metrics: Metrics) -> dict[str, float]:
    out = {}
    for line in generate_latest(metrics.registry).decode().splitlines():
        if not line.startswith("#") and "{" not in line:
            name, value = line.split()
            out[name] = float(value)
    return out


def test_set_load_sets_our_gauges_and_vllms_names_alike() -> None:
    metrics = Metrics()
    metrics.set_pool(num_blocks=200, block_size=16, max_num_seqs=4)
    idle = samples(metrics)
    assert (idle["tpserve:kv_cache_total_blocks"], idle["tpserve:kv_cache_free_blocks"]) == (200, 200)
    assert idle["tpserve:saturation"] == idle["vllm:kv_cache_usage_perc"] == 0
    metrics.set_load(num_running=2, num_waiting=0, num_free_blocks=150)
    half = samples(metrics)
    assert half["tpserve:num_requests_running"] == half["vllm:num_requests_running"] == 2
    assert half["tpserve:kv_cache_usage_perc"] == half["vllm:kv_cache_usage_perc"] == 0.25
    assert half["tpserve:saturation"] == 0.5  # 2 of 4 slots
    metrics.set_load(num_running=4, num_waiting=3, num_free_blocks=20)
    full = samples(metrics)
    assert full["tpserve:num_requests_waiting"] == full["vllm:num_requests_waiting"] == 3
    assert full["vllm:kv_cache_usage_perc"] == 0.9 and full["tpserve:saturation"] == 1
    exposed = generate_latest(metrics.registry).decode()
    assert 'vllm:cache_config_info{block_size="16",num_gpu_blocks="200"} 1.0' in exposed
    metrics.set_pool(num_blocks=100, block_size=16, max_num_seqs=4)  # a restarted group's new pool
    assert 'num_gpu_blocks="200"' not in generate_latest(metrics.registry).decode()
