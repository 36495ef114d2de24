"""Prometheus metrics of the prefix cache's host tier (coordinator/kv_host_tier.py). No torch.

Names follow the ``tpserve:`` convention of coordinator/metrics.py; all exported from start-up
(at 0, and a tier of 0 blocks, when ``--kv-offloading-size`` is off):

- ``tpserve:kv_offload_hits``: prompt tokens copied back from the host tier instead of computed
  (tokens; a part of ``tpserve:prefix_cache_hits``);
- ``tpserve:kv_offload_stores`` / ``tpserve:kv_offload_evictions``: blocks copied into the tier,
  and blocks the full tier dropped to make room;
- ``tpserve:kv_offload_bytes{direction="to_host"|"to_device"}``: bytes the copies moved, summed
  over the group's ranks (each rank moves its own slice);
- ``tpserve:kv_offload_total_blocks`` / ``tpserve:kv_offload_used_blocks``: the tier's size and fill.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge

if TYPE_CHECKING:
    from coordinator.kv_cache_manager import KVCacheManager


class KvOffloadMetrics:
    """The host tier's counters and gauges, fed from the KV-cache manager's cumulative counts.

    Args:
        registry: the coordinator's registry.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.hits = Counter("tpserve:kv_offload_hits", "Prompt tokens copied back from the KV host tier instead of "
                            "computed (part of tpserve:prefix_cache_hits).", registry=r)
        self.stores = Counter("tpserve:kv_offload_stores", "KV blocks copied into the host tier when the device "
                              "pool evicted them.", registry=r)
        self.evictions = Counter("tpserve:kv_offload_evictions", "KV blocks the full host tier dropped to make room.",
                                 registry=r)
        self.bytes = Counter("tpserve:kv_offload_bytes", "Bytes copied between the KV cache and its host tier, "
                             "summed over ranks.", ["direction"], registry=r)
        for direction in ("to_host", "to_device"):
            self.bytes.labels(direction=direction)
        self.total_blocks = Gauge("tpserve:kv_offload_total_blocks", "Blocks the KV host tier holds (0: off).",
                                  registry=r)
        self.used_blocks = Gauge("tpserve:kv_offload_used_blocks", "Host-tier blocks holding a cached block.",
                                 registry=r)
        self._bytes_per_block = 0
        self._counted = (0, 0, 0, 0)  # host_tier_hits, num_hits, num_stores, num_evictions already added

    def configure(self, num_blocks: int, bytes_per_block: int) -> None:
        """A tier of ``num_blocks`` blocks; ``bytes_per_block``: one block's bytes summed over the ranks."""
        self.total_blocks.set(num_blocks)
        self._bytes_per_block = bytes_per_block

    def update(self, kv_cache: KVCacheManager) -> None:
        """Adds what the tier's cumulative counters gained since the last call (after every step)."""
        tier = kv_cache.host_tier
        if tier is None:
            return
        now = (kv_cache.host_tier_hits, tier.num_hits, tier.num_stores, tier.num_evictions)
        if now == self._counted:
            return
        tokens, loads, stores, evictions = (a - b for a, b in zip(now, self._counted))
        self.hits.inc(tokens)
        self.stores.inc(stores)
        self.evictions.inc(evictions)
        self.bytes.labels(direction="to_device").inc(loads * self._bytes_per_block)
        self.bytes.labels(direction="to_host").inc(stores * self._bytes_per_block)
        self.used_blocks.set(tier.num_used_slots)
        self._counted = now
