"""The scaling gauges under a real load (docs/design/observability.md, "Scaling signals"): one sequence slot
(``--max-num-seqs 1``)
and three concurrent requests, so two wait while one runs; then idle again.

Autoscalers and the Gateway API Inference Extension's endpoint picker read these; vLLM's
names must carry tpserve's values exactly (coordinator/load_gauges.py).
"""

from __future__ import annotations

import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.cluster import RunningCluster

LOAD_GAUGES = ("num_requests_waiting", "num_requests_running", "kv_cache_usage_perc", "saturation",
               "kv_cache_free_blocks", "kv_cache_total_blocks")
Sample = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(cluster: RunningCluster) -> Sample:
    """Every sample of /metrics, keyed by (name, sorted labels)."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{cluster.metrics_port}/metrics", timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body) for s in family.samples}


def stable_scrape(cluster: RunningCluster) -> dict[str, float]:
    """The unlabelled gauges, from two consecutive scrapes that agree (the engine sets them between
    steps, so one scrape may fall between two sets)."""
    for _ in range(100):
        first, second = (load_gauges(scrape(cluster)) for _ in range(2))
        if first == second:
            return first
    raise AssertionError("the load gauges changed between every two scrapes")


def load_gauges(samples: Sample) -> dict[str, float]:
    return {name: value for (name, labels), value in samples.items()
            if name.split(":")[1] in LOAD_GAUGES and not labels}


def test_waiting_running_usage_and_saturation_under_load_and_idle(shared_servers) -> None:
    cluster = shared_servers.get(None, 1, "--max-num-seqs", "1")
    idle = stable_scrape(cluster)
    total = idle["tpserve:kv_cache_total_blocks"]
    assert total > 0
    for name in ("num_requests_waiting", "num_requests_running", "kv_cache_usage_perc"):
        assert idle[f"tpserve:{name}"] == idle[f"vllm:{name}"] == 0, name
    assert idle["tpserve:saturation"] == 0

    def long_request(_: int):
        return cluster.client.generate("Once upon a time", max_tokens=400, ignore_eos=True, temperature=0)

    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(long_request, i) for i in range(3)]
        deadline = time.monotonic() + 120
        while True:
            loaded = stable_scrape(cluster)
            if loaded["tpserve:num_requests_waiting"] >= 1 and loaded["tpserve:num_requests_running"] == 1:
                break
            assert time.monotonic() < deadline, loaded
            assert not all(f.done() for f in futures), [f.exception() or f.result().usage for f in futures]
            time.sleep(0.01)
        results = [f.result() for f in futures]
    assert [r.usage.completion_tokens for r in results] == [400] * 3
    # One slot, full: the queue holds the others and the replica reads saturated.
    assert 1 <= loaded["vllm:num_requests_waiting"] == loaded["tpserve:num_requests_waiting"] <= 2
    assert loaded["vllm:num_requests_running"] == loaded["tpserve:num_requests_running"] == 1
    assert loaded["tpserve:saturation"] == 1
    usage = loaded["tpserve:kv_cache_usage_perc"]
    assert 0 < usage < 1 and usage == loaded["vllm:kv_cache_usage_perc"]
    assert usage == 1 - loaded["tpserve:kv_cache_free_blocks"] / total

    done = stable_scrape(cluster)
    for name in ("num_requests_waiting", "num_requests_running", "kv_cache_usage_perc"):
        assert done[f"tpserve:{name}"] == done[f"vllm:{name}"] == 0, name
    assert done["tpserve:saturation"] == 0


def test_router_info_series_describe_the_pool_and_no_adapters(shared_servers) -> None:
    """The endpoint picker's optional series: the KV pool's shape, and LoRA info saying none."""
    cluster = shared_servers.get(None, 1, "--max-num-seqs", "1")
    samples = scrape(cluster)
    total = samples[("tpserve:kv_cache_total_blocks", ())]
    info = {dict(labels)["block_size"]: dict(labels)["num_gpu_blocks"]
            for (name, labels), value in samples.items() if name == "vllm:cache_config_info" and value == 1}
    assert info == {"16": str(int(total))}
    (lora,) = [(dict(labels), value) for (name, labels), value in samples.items() if name == "vllm:lora_requests_info"]
    assert lora[0] == {"max_lora": "0", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    assert abs(lora[1] - time.time()) < 24 * 3600  # a timestamp, as vLLM's
