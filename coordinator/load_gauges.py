"""The load gauges that autoscalers and inference-aware routers read (issue 48).

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
(no LoRA adapters)             vllm:lora_requests_info             max_lora="0", no adapters
kv_cache_total_blocks, block   vllm:cache_config_info              block_size, num_gpu_blocks
=============================  ==================================  ==========================

Everything is set where the engine sets its other gauges (once per step and on
admission, finish and abort), from counts the scheduler already keeps: no
per-token work.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Gauge


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


class LoadGauges:
    """The scaling and routing gauges of one registry, tpserve's names and vLLM's."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.kv_cache_usage_perc = Gauge(
            "tpserve:kv_cache_usage_perc", "KV cache usage as a fraction: 1 - free / total blocks (0-1, "
            "despite vLLM's name).", registry=r)
        self.saturation = Gauge(
            "tpserve:saturation", "Replica saturation, 0-1: max(running / max_num_seqs, KV cache usage), "
            "and 1 while a request waits.", registry=r)
        self.vllm_num_requests_waiting = Gauge(
            "vllm:num_requests_waiting", "= tpserve:num_requests_waiting (vLLM's name, for inference routers).",
            registry=r)
        self.vllm_num_requests_running = Gauge(
            "vllm:num_requests_running", "= tpserve:num_requests_running (vLLM's name, for inference routers).",
            registry=r)
        self.vllm_kv_cache_usage_perc = Gauge(
            "vllm:kv_cache_usage_perc", "= tpserve:kv_cache_usage_perc, 0-1 (vLLM's name, for inference routers).",
            registry=r)
        # The EPP's LoRA affinity reads this; tpserve serves no adapters, which it says (max_lora 0)
        # rather than leave the router to log a missing series. The value is a timestamp, as vLLM's.
        lora = Gauge("vllm:lora_requests_info", "LoRA adapters running and waiting (tpserve serves none).",
                     ["max_lora", "running_lora_adapters", "waiting_lora_adapters"], registry=r)
        lora.labels(max_lora="0", running_lora_adapters="", waiting_lora_adapters="").set(time.time())
        self._cache_config = Gauge("vllm:cache_config_info", "KV cache configuration (value 1; vLLM's name).",
                                   ["block_size", "num_gpu_blocks"], registry=r)
        self._max_num_seqs = 0
        self._num_total_blocks = 0

    def configure(self, num_total_blocks: int, block_size: int, max_num_seqs: int) -> None:
        """The pool (``num_total_blocks`` blocks of ``block_size`` tokens) and the sequence slots; at start-up."""
        self._num_total_blocks, self._max_num_seqs = num_total_blocks, max_num_seqs
        self._cache_config.clear()
        self._cache_config.labels(block_size=str(block_size), num_gpu_blocks=str(num_total_blocks)).set(1)

    def update(self, num_running: int, num_waiting: int, num_free_blocks: int) -> None:
        """Sets every gauge from the scheduler's counts (no per-token work: a handful of float sets)."""
        usage = kv_cache_usage(num_free_blocks, self._num_total_blocks)
        self.kv_cache_usage_perc.set(usage)
        self.saturation.set(saturation(num_running, num_waiting, self._max_num_seqs, usage))
        self.vllm_num_requests_waiting.set(num_waiting)
        self.vllm_num_requests_running.set(num_running)
        self.vllm_kv_cache_usage_perc.set(usage)
