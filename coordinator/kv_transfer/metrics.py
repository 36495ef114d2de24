"""The KV transfer's Prometheus metrics (``tpserve:kv_transfer_*``), in the engine's registry.

Blocks and bytes per direction (``sent`` by a prefill replica, ``received`` by a decode
replica) and transport; the pull's latency; fallbacks to a local prefill by reason. A decode
replica's prompt tokens computed are ``tpserve:prefix_cache_queries_total`` less
``tpserve:prefix_cache_hits_total``: pulled blocks enter its prefix cache and count as hits.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

#: Why a decode replica prefilled a prompt itself (the fallbacks counter's label values).
FALLBACK_REASONS = ("refused", "failed", "no_free_blocks")
_TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class KVTransferMetrics:
    """Counters of one replica's transfers.

    Attributes:
        blocks, bytes: ``tpserve:kv_transfer_blocks_total`` / ``_bytes_total`` by ``direction``
            (sent, received) and ``transport``.
        seconds: ``tpserve:kv_transfer_seconds``, a pull's wall time on the decode replica
            (every rank's pull, from the request's arrival at the coordinator to the last answer).
        fallbacks: ``tpserve:kv_transfer_fallbacks_total`` by ``reason`` (:data:`FALLBACK_REASONS`): a decode
            replica prefilled a prompt itself: ``refused`` before any pull (another tensor-parallel degree,
            block size or ``--kv-cache-dtype``), ``failed`` (unreachable, refused by the prefill's ranks, timed
            out), ``no_free_blocks``.
        holds: ``tpserve:kv_transfer_holds``, prefill requests whose blocks wait for their pull now.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ("direction", "transport")
        self.blocks = Counter("tpserve:kv_transfer_blocks", "KV blocks moved between replicas.", labels,
                              registry=registry)
        self.bytes = Counter("tpserve:kv_transfer_bytes", "KV bytes moved between replicas (every rank's slice).",
                             labels, registry=registry)
        self.seconds = Histogram("tpserve:kv_transfer_seconds", "Wall time of one request's pull, every rank.",
                                 ("transport",), buckets=_TRANSFER_BUCKETS, registry=registry)
        self.fallbacks = Counter("tpserve:kv_transfer_fallbacks", "Decode requests prefilled locally instead.",
                                 ("reason",), registry=registry)
        for reason in FALLBACK_REASONS:  # each series from 0, so that a dashboard's rate sees the first fallback
            self.fallbacks.labels(reason)
        self.holds = Gauge("tpserve:kv_transfer_holds", "Prefill requests holding blocks for a pull.",
                           registry=registry)
