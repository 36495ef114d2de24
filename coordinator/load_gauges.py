"""The load gauges that autoscalers and inference-aware routers read (docs/design/observability.md, "Scaling signals").

Kubernetes autoscalers (HPA through the Prometheus Adapter, KEDA's prometheus
trigger) and the Gateway API Inference Extension's endpoint picker (EPP, used by
llm-d and KServe) read a small standard set: queue length, running requests,
KV-cache utilisation as a fraction, and a saturation signal. The EPP's default
model-server protocol names vLLM's series, so they are exported under those exact
names beside tpserve's own, with the same values: an EPP or llm-d scheduler works
with no metric flags. Mapping (docs/kubernetes.md, "Autoscaling"):

=============================  ==================================  ==========================
tpserve                        vLLM (exported as well)             meaning
=============================  ==================================  ==========================
tpserve:num_requests_waiting   vllm:num_requests_waiting           sequences queued
tpserve:num_requests_running   vllm:num_requests_running           sequences holding KV blocks
tpserve:kv_cache_usage_perc    vllm:kv_cache_usage_perc            1 - free / total blocks, 0-1
tpserve:saturation             (none)                              0-1, see :func:`saturation`
(LoRA adapters)                vllm:lora_requests_info             max_lora, adapters in use
kv_cache_total_blocks, block   vllm:cache_config_info              block_size, num_gpu_blocks
=============================  ==================================  ==========================

The engine hands over its counts where it sets its other gauges (once per step and
on admission, finish and abort): three integers stored; the gauges are computed when
Prometheus scrapes. No per-token work, and next to none per step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


def kv_cache_usage(num_free_blocks: int, num_total_blocks: int) -> float:
    """The fraction of the KV block pool held by sequences, in [0, 1] (0 before the pool exists).

    Blocks kept only for the prefix cache count as free (they are evicted on demand),
    as in vLLM's ``kv_cache_usage_perc``.
    """
    if num_total_blocks <= 0:
        return 0.0
    return min(max(1.0 - num_free_blocks / num_total_blocks, 0.0), 1.0)


def saturation(num_running: int, num_waiting: int, max_num_seqs: int, kv_usage: float) -> float:
    """How full the replica is, in [0, 1]: 1 means a new request would wait.

    ``max(running / max_num_seqs, kv_usage)``, and 1 while anything is queued. A
    replica is full when either resource runs out (sequence slots or KV blocks),
    whichever comes first, and a non-empty queue proves it is full whatever the
    ratios say (a long prompt can wait for blocks at 90 % usage). Bounded, so an
    HPA ``AverageValue`` target such as 0.8 reads "keep 20 % headroom"; demand past
    capacity is measured by ``num_requests_waiting``, the second metric of the
    manifests (k8s/components/autoscaling-*).
    """
    if num_waiting > 0:
        return 1.0
    slots = num_running / max_num_seqs if max_num_seqs > 0 else 0.0
    return min(max(slots, kv_usage), 1.0)


class LoadGauges(Collector):
    """The scaling and routing gauges of one registry, tpserve's names and vLLM's.

    A collector: :meth:`update` only stores the scheduler's three counts (one tuple, so a
    scrape from the metrics thread sees one consistent snapshot), and the gauges are
    derived from them when Prometheus scrapes, not on every step.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self._pool = (0, 0, 0)  # (blocks in the pool, tokens per block, max_num_seqs)
        self._load = (0, 0, 0)  # (running, waiting, free blocks)
        self._started = time.time()  # vllm:lora_requests_info's value, a timestamp as vLLM's
        self._max_loras = 0
        self._lora_in_use: Callable[[], list[str]] = list
        registry.register(self)

    def configure_lora(self, max_loras: int, in_use: Callable[[], list[str]]) -> None:
        """``--max-loras`` and the adapters in use (names with requests in flight; called at each scrape,
        on the metrics thread: it must only copy), for ``vllm:lora_requests_info``; at start-up."""
        self._max_loras, self._lora_in_use = max_loras, in_use

    def configure(self, num_total_blocks: int, block_size: int, max_num_seqs: int) -> None:
        """The pool (``num_total_blocks`` blocks of ``block_size`` tokens) and the sequence slots; at start-up."""
        self._pool = (num_total_blocks, block_size, max_num_seqs)

    def update(self, num_running: int, num_waiting: int, num_free_blocks: int) -> None:
        """The scheduler's counts, read at the next scrape (no per-step or per-token work beyond this store)."""
        self._load = (num_running, num_waiting, num_free_blocks)

    def describe(self) -> Iterator[Metric]:
        """The families (registration checks their names against the registry's)."""
        return self.collect()

    def collect(self) -> Iterator[Metric]:
        """The gauges, from the latest :meth:`update`."""
        (num_total_blocks, block_size, max_num_seqs), (running, waiting, free) = self._pool, self._load
        usage = kv_cache_usage(free, num_total_blocks)
        yield GaugeMetricFamily("tpserve:kv_cache_usage_perc", "KV cache usage as a fraction: 1 - free / total "
                                "blocks (0-1, despite vLLM's name).", value=usage)
        yield GaugeMetricFamily("tpserve:saturation", "Replica saturation, 0-1: max(running / max_num_seqs, "
                                "KV cache usage), and 1 while a request waits.",
                                value=saturation(running, waiting, max_num_seqs, usage))
        yield GaugeMetricFamily("vllm:num_requests_waiting", "= tpserve:num_requests_waiting (vLLM's name, for "
                                "inference routers).", value=waiting)
        yield GaugeMetricFamily("vllm:num_requests_running", "= tpserve:num_requests_running (vLLM's name, for "
                                "inference routers).", value=running)
        yield GaugeMetricFamily("vllm:kv_cache_usage_perc", "= tpserve:kv_cache_usage_perc, 0-1 (vLLM's name, for "
                                "inference routers).", value=usage)
        # The endpoint picker's LoRA affinity reads this (max_lora 0 without --enable-lora, rather than
        # leave the router to log a missing series). The adapters with requests in flight, queued ones
        # included, are listed as running: the coordinator counts them per adapter, not per state.
        lora = GaugeMetricFamily("vllm:lora_requests_info", "LoRA adapters with requests in flight (as running).",
                                 labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
        lora.add_metric([str(self._max_loras), ",".join(sorted(self._lora_in_use())), ""], self._started)
        yield lora
        cache = GaugeMetricFamily("vllm:cache_config_info", "KV cache configuration (value 1; vLLM's name).",
                                  labels=["block_size", "num_gpu_blocks"])
        if num_total_blocks:
            cache.add_metric([str(block_size), str(num_total_blocks)], 1)
        yield cache
