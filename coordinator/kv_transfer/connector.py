"""What a replica hands over (prefill side) and pulls (decode side): block ids, hashes, holds.

Prefill (``do_remote_decode``): the request runs as any other (the gateway asks for one token);
when it finishes, its prompt's full blocks are in the prefix cache. :meth:`KVConnector.hand_over`
takes a reference to them, has every rank hold its slice under a fresh unguessable id, and
returns the kv_transfer_params the decode replica needs. The blocks are freed when every rank
says ``done``: the decode rank acknowledged its read, or ``hold_timeout_s`` passed.

Decode (``do_remote_prefill``): before the request is queued, :meth:`KVConnector.pull` computes
the prompt's block hashes in the request's own namespace, keeps the blocks it already has
cached, allocates the rest, and has every rank pull its slice from the same rank of the prefill
replica (worker/kv_transfer/agent.py). Pulled blocks enter the prefix cache under those hashes,
so the scheduler admits the request as a prefix-cache hit and computes only what follows the
last full block (at most one block). Any failure (unreachable, refused, a hash or namespace
mismatch, another tensor-parallel degree, no free blocks, a timeout) frees the new blocks,
counts a fallback and lets the request prefill locally: no request is lost.

Every call to the ranks proves the group's control key (rank_links.py): no one but this
coordinator can make its ranks hold, release or pull. Without a cluster secret, a peer's K/V
proves nothing about where it came from, so a decode replica reads only a loopback peer and
caches what it pulled under a namespace of that request alone (``HeldBlocks.namespace``):
K/V of an impostor could at worst spoil the request that named it, never another's prefix cache.
A producer's holds take at most a share of its pool, in all and per tenant (hold_budget.py).

Everything here runs on the coordinator's event loop (the allocator has no lock); the bytes
move on the ranks' agent threads. No torch.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from coordinator.block_allocator import BlockAllocator
from coordinator.kv_cache_manager import prompt_block_hashes
from coordinator.kv_transfer import rank_links
from coordinator.kv_transfer.hold_budget import HoldBudget, HoldReservation
from coordinator.kv_transfer.metrics import KVTransferMetrics
from coordinator.kv_transfer.params import KVTransferParams, handoff_json
from coordinator.scheduler import Scheduler
from tpserve.kv_transfer_config import KVTransferConfig
from tpserve.kv_wire import unauthenticated_peer_refusal

log = structlog.get_logger(__name__)

#: Seconds past ``hold_timeout_s`` the coordinator waits for its ranks' ``done`` before it gives up on them.
DONE_GRACE_S = 5.0


@dataclass
class HeldBlocks:
    """Blocks a decode request holds until it ends (pulled, or already cached here).

    Attributes:
        allocator: the pool they belong to (a restarted group has a new one; then nothing is freed).
        block_ids: the blocks, in prompt order.
        num_pulled: how many of them were pulled from the prefill replica.
        on_freed: called once :meth:`release` freed blocks (the load gauges).
        namespace: the prefix-cache namespace the request must run under to find them (a namespace of its own
            when they came from a peer that proved no cluster secret); None: its own.
    """

    allocator: BlockAllocator | None = None
    block_ids: tuple[int, ...] = ()
    num_pulled: int = 0
    on_freed: Callable[[], None] | None = field(default=None, repr=False)
    namespace: bytes | None = None

    def release(self, scheduler: Scheduler) -> None:
        """Drops the hold (the blocks stay cached); a no-op after a group restart."""
        if self.allocator is not None and scheduler.allocator is self.allocator:
            self.allocator.free(reversed(self.block_ids))
            if self.on_freed is not None and self.block_ids:
                self.on_freed()
        self.allocator, self.block_ids = None, ()


class KVConnector:
    """One replica's hand-offs.

    Args:
        config: ``--kv-transfer-config``.
        tp_size: the replica's tensor-parallel degree (its ranks ``0..tp_size-1`` each run an agent).
        block_size: tokens per block.
        secret: the cluster secret the replicas' reads prove (None: none; then only loopback peers are read,
            and what is pulled is cached for its own request alone).
        metrics: where transfers are counted.
        kv_cache_dtype: ``--kv-cache-dtype``; a hand-over between replicas of two values is refused (an 8-bit
            cache's blocks are codes with per-token scales: worker/kv_quant.py).
        control_key: the group's control key, which the ranks' agents require of hold and pull (the launcher's,
            launch/local_ranks.py; None: the ranks refuse every hold and pull).

    Attributes:
        on_blocks_freed: called after a hold or a pull frees blocks outside a step (the load gauges then
            show it: launch/public_server.py sets the engine's gauge update).
    """

    def __init__(self, config: KVTransferConfig, tp_size: int, block_size: int, secret: str | None,
                 metrics: KVTransferMetrics, kv_cache_dtype: str = "auto", control_key: str | None = None) -> None:
        self.config, self.tp_size, self.block_size = config, tp_size, block_size
        self.secret, self.metrics, self.kv_cache_dtype = secret, metrics, kv_cache_dtype
        self.control_key = control_key
        self.budget = HoldBudget(config.max_hold_fraction, config.max_hold_fraction_per_tenant)
        self.on_blocks_freed: Callable[[], None] = lambda: None
        self._tasks: set[asyncio.Task] = set()

    # -- prefill side ----------------------------------------------------------------------------

    def reserve(self, scheduler: Scheduler, tenant: str, num_tokens: int) -> HoldReservation:
        """Reserves the hold of a hand-off of ``num_tokens`` tokens for ``tenant`` ("" anonymous), before the
        request is queued; pass it to :meth:`hand_over`, and release it if the request ends without one.

        Raises:
            ResourceExhaustedError: the hand-offs' share of the pool would be passed (hold_budget.py).
        """
        num_blocks = max((num_tokens - 1) // self.block_size, 0)
        return self.budget.reserve(tenant, num_blocks, scheduler.allocator.num_blocks)

    async def hand_over(self, scheduler: Scheduler, token_ids: list[int], namespace: bytes,
                        hold_timeout_s: float | None = None, reservation: HoldReservation | None = None) -> str:
        """Holds the computed full blocks of ``token_ids`` for a pull; returns their kv_transfer_params_json.

        Names no block (the other replica then computes them itself) when none is cached, or a rank
        cannot hold. The hold lasts ``hold_timeout_s`` seconds at most (None: the configuration's);
        ``reservation`` (:meth:`reserve`) becomes the hold's (the caller's is left empty) and is released when
        the hold ends. Runs to its end even if the caller
        is cancelled (the hold's release with it).
        """
        task = asyncio.ensure_future(self._hand_over(scheduler, token_ids, namespace,
                                                     self.config.hold_timeout_s if hold_timeout_s is None else hold_timeout_s,
                                                     reservation.take() if reservation else HoldReservation("", 0)))
        return await asyncio.shield(task)

    async def _hand_over(self, scheduler: Scheduler, token_ids: list[int], namespace: bytes,
                         hold_timeout_s: float, reservation: HoldReservation) -> str:
        cfg = self.config
        hashes = prompt_block_hashes(token_ids, namespace, self.block_size, (len(token_ids) - 1) // self.block_size)
        allocator = scheduler.allocator
        block_ids = allocator.lookup(hashes)  # the prefix still cached (all of it, unless evicted since)
        transfer_id = secrets.token_hex(16)
        if not block_ids:
            reservation.release()
            return self._handoff([], "")
        allocator.acquire(block_ids)
        hex_hashes = [h.hex() for h in hashes[:len(block_ids)]]
        holds = await asyncio.gather(*(rank_links.hold(
            cfg.side_channel_host, cfg.side_channel_port + rank, self.control_key or "", transfer_id, block_ids, hex_hashes,
            namespace.hex(), hold_timeout_s) for rank in range(self.tp_size)), return_exceptions=True)
        failed = [h for h in holds if isinstance(h, BaseException)]
        ok = [h for h in holds if isinstance(h, rank_links.RankHold)]
        if failed:
            for h in ok:
                await h.release()
            await asyncio.gather(*(h.done(DONE_GRACE_S) for h in ok))
            if scheduler.allocator is allocator:
                allocator.free(reversed(block_ids))
                self.on_blocks_freed()
            reservation.release()
            log.warning("kv hand-over failed: the decode replica will prefill", error=str(failed[0]))
            return self._handoff([], "")
        self.metrics.holds.inc()
        self._track(self._await_done(scheduler, allocator, block_ids, ok, hold_timeout_s, reservation))
        return self._handoff(block_ids, transfer_id)

    def _handoff(self, block_ids: list[int], transfer_id: str) -> str:
        cfg = self.config
        return handoff_json(cfg.resolved_engine_id, cfg.side_channel_host, cfg.side_channel_port, block_ids,
                            transfer_id, self.tp_size, self.block_size, self.kv_cache_dtype)

    async def _await_done(self, scheduler: Scheduler, allocator: BlockAllocator, block_ids: list[int],
                          holds: list[rank_links.RankHold], hold_timeout_s: float, reservation: HoldReservation) -> None:
        answers = await asyncio.gather(*(h.done(hold_timeout_s + DONE_GRACE_S) for h in holds))
        if scheduler.allocator is allocator:
            allocator.free(reversed(block_ids))
            self.on_blocks_freed()  # the usage and saturation gauges, which else wait for the next step
        reservation.release()
        self.metrics.holds.dec()
        if all(a.get("confirmed") for a in answers):  # blocks: each rank sent its slice of the same ones
            transport = self.config.transport
            self.metrics.blocks.labels("sent", transport).inc(max(int(a.get("blocks", 0)) for a in answers))
            self.metrics.bytes.labels("sent", transport).inc(sum(int(a.get("bytes", 0)) for a in answers))
        else:
            log.info("kv hold ended unread: blocks freed", num_blocks=len(block_ids))

    async def holds_ended(self) -> None:
        """Returns once every hold and release read in flight has ended (each is bounded by its timeout)."""
        while self._tasks:
            await asyncio.wait(list(self._tasks))

    def _track(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- decode side -----------------------------------------------------------------------------

    def _private_namespace(self, namespace: bytes, params: KVTransferParams) -> bytes | None:
        """Where pulled blocks are cached without a cluster secret: a namespace of this request alone (its hold's
        id chained to its namespace), so K/V from a peer that proved nothing is never another request's
        prefix-cache hit. None with a secret (the peer proved it: its blocks may serve the namespace's later
        requests)."""
        if self.secret:
            return None
        return hashlib.sha256(b"tpserve-kv-unauthenticated-pull|" + namespace + b"|"
                              + params.remote_request_id.encode()).digest()

    def refusal(self, params: KVTransferParams) -> str:
        """Why this replica cannot pull ``params``' blocks ("" when it can): one line, for the log."""
        if not self.config.is_consumer:
            return f"kv_role {self.config.kv_role} does not pull"
        if not self.secret:
            refused = unauthenticated_peer_refusal(params.remote_host)
            if refused:
                return refused
        if params.tp_size and params.tp_size != self.tp_size:
            return (f"the prefill replica's tensor-parallel degree {params.tp_size} is not this replica's "
                    f"{self.tp_size}: equal degrees are required")
        if params.block_size and params.block_size != self.block_size:
            return f"the prefill replica's block size {params.block_size} is not this replica's {self.block_size}"
        if params.kv_cache_dtype and params.kv_cache_dtype != self.kv_cache_dtype:
            return (f"the prefill replica's KV cache is --kv-cache-dtype {params.kv_cache_dtype}, this replica's "
                    f"{self.kv_cache_dtype}: both need the same --kv-cache-dtype")
        return ""

    async def pull(self, scheduler: Scheduler, token_ids: list[int], namespace: bytes,
                   params: KVTransferParams) -> HeldBlocks:
        """Pulls the prompt's full blocks named in ``params`` into this replica's prefix cache; the peer is
        asked for, and checked against, the hashes of ``namespace``, the request's own. Without a cluster
        secret they are cached under a namespace of the request alone, which the result's ``namespace``
        names: run the request under it (else they would not be found).

        Returns the blocks held for the request (release them when it ends); on any failure
        only the ones that were already cached here, the fallback counted and logged.
        """
        started = time.monotonic()
        num_blocks = min((len(token_ids) - 1) // self.block_size, len(params.remote_block_ids))
        if num_blocks <= 0:
            return HeldBlocks()
        reason = self.refusal(params)
        if reason:
            if params.kv_cache_dtype and params.kv_cache_dtype != self.kv_cache_dtype:  # the degrees are equal:
                # a read of no block tells the prefill's ranks at once; they refuse it on the layout and end the
                # hold (worker/kv_transfer/agent.py), so its blocks are not kept for hold_timeout_s
                self._track(self._pull_ranks(self._release_request(params, namespace)))
            return self._fallback("refused", reason, HeldBlocks())
        hashes = prompt_block_hashes(token_ids, namespace, self.block_size, num_blocks)
        private = self._private_namespace(namespace, params)
        cache_hashes = hashes if private is None else prompt_block_hashes(token_ids, private, self.block_size,
                                                                          num_blocks)
        allocator = scheduler.allocator
        cached = allocator.lookup(cache_hashes)  # without a secret: only a pull of this very hold's, earlier
        allocator.acquire(cached)
        held = HeldBlocks(allocator, tuple(cached), on_freed=self.on_blocks_freed,
                          namespace=private if cached else None)
        first = len(cached)
        new = allocator.allocate(num_blocks - first) if first < num_blocks else []
        if new is None:
            new, first = [], num_blocks  # pull none: the read then only frees the prefill replica's hold
            self._fallback("no_free_blocks", "too few free blocks to pull into", held)
        request = {"transfer_id": params.remote_request_id, "remote_host": params.remote_host,
                   "remote_port": params.remote_port, "first_block": first,
                   "remote_block_ids": params.remote_block_ids[first:first + len(new)], "local_block_ids": new,
                   "block_hashes": [h.hex() for h in hashes[first:first + len(new)]], "namespace": namespace.hex(),
                   "timeout_s": self.config.pull_timeout_s}
        if not new:  # every block cached here already: only tell the prefill replica to free its hold
            self._track(self._pull_ranks(request))
            return held
        task = asyncio.ensure_future(self._pull_ranks(request))
        try:
            answers = await asyncio.shield(task)
        except asyncio.CancelledError:  # the request went away: free the blocks once no rank writes them
            task.add_done_callback(lambda _: self._free(scheduler, allocator, new))
            held.release(scheduler)
            raise
        problem = next((str(a.get("error", "no answer")) for a in answers if not a.get("ok")), "")
        if problem or scheduler.allocator is not allocator:
            self._free(scheduler, allocator, new)
            return self._fallback("failed", problem or "the worker group restarted", held)
        listener = allocator.listener
        for index, block in enumerate(new, start=first):
            tokens = token_ids[index * self.block_size:(index + 1) * self.block_size] if listener else ()
            allocator.cache(block, cache_hashes[index], tokens, cache_hashes[index - 1] if index else None,
                            namespace if private is None else private)
        transport = self.config.transport
        self.metrics.blocks.labels("received", transport).inc(len(new))
        self.metrics.bytes.labels("received", transport).inc(sum(int(a.get("bytes", 0)) for a in answers))
        self.metrics.seconds.labels(transport).observe(time.monotonic() - started)
        return HeldBlocks(allocator, (*cached, *new), len(new), self.on_blocks_freed, private)

    def _free(self, scheduler: Scheduler, allocator: BlockAllocator, blocks: list[int]) -> None:
        """Frees blocks allocated for a pull that did not fill them (nothing after a group restart)."""
        if scheduler.allocator is allocator and blocks:
            allocator.free(reversed(blocks))
            self.on_blocks_freed()

    def _release_request(self, params: KVTransferParams, namespace: bytes) -> dict[str, Any]:
        """A pull of no block for the request's own hold: what only ends the prefill replica's hold."""
        return {"transfer_id": params.remote_request_id, "remote_host": params.remote_host,
                "remote_port": params.remote_port, "first_block": 0, "remote_block_ids": [], "local_block_ids": [],
                "block_hashes": [], "namespace": namespace.hex(), "timeout_s": self.config.pull_timeout_s}

    async def _pull_ranks(self, request: dict[str, Any]) -> list[dict[str, Any]]:
        cfg = self.config
        answers = await asyncio.gather(*(rank_links.pull(cfg.side_channel_host, cfg.side_channel_port + rank,
                                                         self.control_key or "", request)
                                         for rank in range(self.tp_size)), return_exceptions=True)
        return [a if isinstance(a, dict) else {"ok": False, "error": f"{type(a).__name__}: {a}"}
                for a in answers if not isinstance(a, asyncio.CancelledError)] or [{"ok": False}]

    def _fallback(self, reason: str, detail: str, held: HeldBlocks) -> HeldBlocks:
        self.metrics.fallbacks.labels(reason).inc()
        # A refusal is the configuration's (the same for every request of the pair), a failure the network's or
        # the peer's: two events, so that the warnings' rate limit (tpserve/log.py) keeps one of each.
        event = "kv pull refused: prefilling locally" if reason == "refused" else "kv pull failed: prefilling locally"
        log.warning(event, reason=reason, detail=detail)
        return held

