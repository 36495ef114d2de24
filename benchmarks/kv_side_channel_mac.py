"""What authenticating the KV side channel's frames costs (tpserve/kv_wire.py): one rank's pull of a
transfer over loopback with a cluster secret (every frame, the K/V included, tagged with keyed BLAKE2b)
against the same pull without one (no tags), and the tag alone over the same bytes.

    PYTHONPATH=. python benchmarks/kv_side_channel_mac.py --blocks 8 32 --repeats 7 \
        --out benchmarks/results/kv_side_channel_mac.json

A block here is a tp-1 rank's of a Llama-8B-like cache: 16 tokens x 8 KV heads x 128 x float16 x K and V
x ``--layers`` (2 MiB at 32 layers). Prints one JSON object per transfer size (``--blocks``, one or more);
medians of ``--repeats`` pulls; ``--out`` writes them with the host, date and load.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import platform
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from prometheus_client import CollectorRegistry

from coordinator.block_allocator import BlockAllocator
from coordinator.kv_cache_manager import prompt_block_hashes
from coordinator.kv_transfer.connector import KVConnector
from coordinator.kv_transfer.metrics import KVTransferMetrics
from coordinator.kv_transfer.params import parse_params
from tests.e2e.pd import free_port_range
from tpserve.kv_transfer_config import KVTransferConfig
from tpserve.kv_wire import new_control_key
from worker.kv_transfer.agent import KVAgent
from worker.kv_transfer.transport import TcpTransport

BLOCK_SIZE = 16


def _side(role: str, secret: str | None, caches, num_blocks: int):
    port, control = free_port_range(1), new_control_key()
    agent = KVAgent("127.0.0.1", port, 0, 1, secret, lambda: caches, TcpTransport(0, 1, secret), control_key=control)
    agent.start()
    config = KVTransferConfig(kv_connector="NixlConnector", kv_role=role, kv_connector_extra_config={
        "side_channel_port": port, "pull_timeout_s": 120.0, "hold_timeout_s": 120.0, "max_hold_fraction": 1.0,
        "max_hold_fraction_per_tenant": 1.0})
    scheduler = SimpleNamespace(allocator=BlockAllocator(num_blocks, BLOCK_SIZE))
    return agent, scheduler, KVConnector(config, 1, BLOCK_SIZE, secret, KVTransferMetrics(CollectorRegistry()),
                                         control_key=control)


def pull_ms(secret: str | None, blocks: int, layers: int, repeats: int) -> float:
    """Median wall time of a hand-over and pull of ``blocks`` blocks, milliseconds."""
    shape = (blocks + 1, BLOCK_SIZE, 8, 128)
    producer = [(torch.randn(shape, dtype=torch.float16), torch.randn(shape, dtype=torch.float16)) for _ in range(layers)]
    consumer = [(torch.zeros(shape, dtype=torch.float16), torch.zeros(shape, dtype=torch.float16)) for _ in range(layers)]
    p_agent, p_sched, p_conn = _side("kv_producer", secret, producer, blocks + 1)
    d_agent, _, d_conn = _side("kv_consumer", secret, consumer, blocks + 1)
    times = []
    try:
        for repeat in range(repeats):
            prompt = [repeat * 100_000 + i for i in range(blocks * BLOCK_SIZE + 1)]
            hashes = prompt_block_hashes(prompt, b"", BLOCK_SIZE, blocks)
            ids = p_sched.allocator.allocate(blocks)
            for block, h in zip(ids, hashes):
                p_sched.allocator.cache(block, h)
            p_sched.allocator.free(reversed(ids))

            async def run():
                kv = parse_params(await p_conn.hand_over(p_sched, prompt, b""))
                scheduler = SimpleNamespace(allocator=BlockAllocator(blocks + 1, BLOCK_SIZE))
                started = time.perf_counter()
                held = await d_conn.pull(scheduler, prompt, b"", kv)
                elapsed = time.perf_counter() - started
                assert held.num_pulled == blocks, held
                await p_conn.holds_ended()
                return elapsed

            times.append(asyncio.run(run()))
    finally:
        p_agent.close()
        d_agent.close()
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, nargs="+", default=[32], help="transfer sizes in blocks (one run each)")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", help="write the runs there as JSON (e.g. benchmarks/results/kv_side_channel_mac.json)")
    args = parser.parse_args()
    runs = [_run(blocks, args.layers, args.repeats) for blocks in args.blocks]
    for run in runs:
        print(json.dumps(run))
    if args.out:
        Path(args.out).write_text(json.dumps({
            "recorded": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "host": platform.platform(),
            "cpu_count": os.cpu_count(), "load_average_1min": round(os.getloadavg()[0], 2),
            "layers": args.layers, "repeats": args.repeats, "runs": runs}, indent=1) + "\n")


def _run(blocks: int, layers: int, repeats: int) -> dict:
    """One transfer size: the pull without and with a cluster secret (median ms) and one keyed BLAKE2b pass."""
    num_bytes = blocks * layers * 2 * BLOCK_SIZE * 8 * 128 * 2
    data, key = os.urandom(num_bytes), os.urandom(32)
    tag_times = []
    for _ in range(repeats):
        started = time.perf_counter()
        hashlib.blake2b(data, key=key, digest_size=32).digest()
        tag_times.append(time.perf_counter() - started)
    tag_ms = statistics.median(tag_times) * 1e3
    plain, tagged = (pull_ms(None, blocks, layers, repeats),
                     pull_ms("a-cluster-secret-of-enough-length", blocks, layers, repeats))
    return {"blocks": blocks, "bytes": num_bytes, "pull_ms_without_secret": round(plain, 1),
            "pull_ms_with_secret": round(tagged, 1), "overhead_pct": round(100 * (tagged / plain - 1), 1),
            "blake2b_tag_ms": round(tag_ms, 1), "blake2b_gib_per_s": round(num_bytes / 2**30 / (tag_ms / 1e3), 2)}


if __name__ == "__main__":
    main()
