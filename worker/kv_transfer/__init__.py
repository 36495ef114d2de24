"""A rank's side of the KV transfer: its agent (worker/kv_transfer/agent.py), the transports that
move its K/V slice to or from the same rank of another replica (transport.py), and the packing of
blocks into bytes (blocks.py). docs/design/cluster.md, "Prefill/decode disaggregation"."""
