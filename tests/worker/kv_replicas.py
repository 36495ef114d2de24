"""Two "replicas" of two ranks each for the KV transfer's tests: every rank a real KVAgent
(worker/kv_transfer/agent.py) over loopback TCP with its own cache tensors, driven by the real coordinator
KVConnector (coordinator/kv_transfer/connector.py) over real BlockAllocators."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from prometheus_client import CollectorRegistry

from coordinator.block_allocator import BlockAllocator
from coordinator.kv_cache_manager import prompt_block_hashes
from coordinator.kv_transfer.connector import KVConnector
from coordinator.kv_transfer.metrics import KVTransferMetrics
from tests.e2e.pd import free_port_range
from tpserve.kv_transfer_config import KVTransferConfig
from worker.kv_transfer.agent import KVAgent
from worker.kv_transfer.transport import TcpTransport

BLOCK_SIZE, NUM_BLOCKS, NUM_LAYERS, TP = 4, 32, 2, 2
PROMPT = list(range(100, 119))  # 19 tokens: 4 full blocks, the 5th partial; (19 - 1) // 4 = 4 handed over
SECRET = "test-secret-0123456789"
CONTROL = "c0ntrol" * 8  # the group's control key (the launcher's, launch/local_ranks.py)


@dataclass
class Replica:
    agents: list[KVAgent]
    caches: list[list[tuple[torch.Tensor, torch.Tensor]]]  # per rank
    scheduler: SimpleNamespace
    connector: KVConnector
    registry: CollectorRegistry

    def metric(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0


def float_caches(seed: int, heads: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(NUM_BLOCKS, BLOCK_SIZE, heads, 8, generator=g),
             torch.randn(NUM_BLOCKS, BLOCK_SIZE, heads, 8, generator=g)) for _ in range(NUM_LAYERS)]


def eight_bit_caches(seed: int, heads: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """An 8-bit cache as a rank's block tensors list it (ModelRunner.block_tensors): per layer int8 codes
    ``(NUM_BLOCKS, BLOCK_SIZE, heads, 8)``, then per layer the bfloat16 scale pools ``(NUM_BLOCKS, heads, BLOCK_SIZE)``."""
    g = torch.Generator().manual_seed(seed)
    codes = [tuple(torch.randint(-127, 128, (NUM_BLOCKS, BLOCK_SIZE, heads, 8), generator=g, dtype=torch.int8)
                   for _ in range(2)) for _ in range(NUM_LAYERS)]
    scales = [tuple(torch.rand(NUM_BLOCKS, heads, BLOCK_SIZE, generator=g).to(torch.bfloat16) for _ in range(2))
              for _ in range(NUM_LAYERS)]
    return codes + scales  # type: ignore[return-value]


def make_replica(role: str, seed: int, secret: str | None = SECRET, codec: str = "", control: str = CONTROL,
             **extra: object) -> Replica:
    """Two ranks' agents with their caches: float32 ones, or with ``codec`` an 8-bit cache's (its codes' meaning)."""
    port = free_port_range(TP)
    config = KVTransferConfig(kv_connector="NixlConnector", kv_role=role, engine_id=role,
                              kv_connector_extra_config={"side_channel_port": port, **extra})
    caches = [(eight_bit_caches if codec else float_caches)(seed * 10 + rank) for rank in range(TP)]
    agents = []
    for rank in range(TP):
        agent = KVAgent("127.0.0.1", port + rank, rank, TP, secret, lambda c=caches[rank]: c,
                        TcpTransport(rank, TP, secret), lambda: codec, control_key=control)
        agent.start()
        agents.append(agent)
    registry = CollectorRegistry()
    scheduler = SimpleNamespace(allocator=BlockAllocator(NUM_BLOCKS, BLOCK_SIZE))
    connector = KVConnector(config, TP, BLOCK_SIZE, secret, KVTransferMetrics(registry), control_key=control)
    return Replica(agents, caches, scheduler, connector, registry)


def prefill_blocks(replica: Replica, namespace: bytes = b"") -> list[int]:
    """As a finished prefill leaves it: the prompt's full blocks computed and cached, unheld."""
    allocator = replica.scheduler.allocator
    hashes = prompt_block_hashes(PROMPT, namespace, BLOCK_SIZE, len(PROMPT) // BLOCK_SIZE)
    blocks = allocator.allocate(len(hashes))
    for block, h in zip(blocks, hashes):
        allocator.cache(block, h)
    allocator.free(reversed(blocks))
    return blocks


async def until(predicate, timeout_s: float = 5.0) -> None:
    """Lets the event loop run (the connector's hold tasks live on it) until ``predicate()``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
