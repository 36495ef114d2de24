"""Prefill/decode disaggregation on the coordinator: the hand-off's parameters (params.py), the
connections to the ranks' KV agents (rank_links.py), what a prefill replica holds and a decode
replica pulls (connector.py), moved streams' KV (stream_moves.py), and their metrics (metrics.py). The ranks move the bytes
(worker/kv_transfer/); the coordinator only decides which blocks. docs/design/cluster.md,
"Prefill/decode disaggregation". No torch."""
