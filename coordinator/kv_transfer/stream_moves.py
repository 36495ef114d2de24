"""Moved streams carry their KV: a draining replica hands each ``tpserve.v1`` stream's blocks over, and
the replica the client continues it on pulls them instead of recomputing the tokens.

A client moves a broken stream to another replica with the tokens it received
(tpserve/stream_move.py). With ``--kv-transfer-config`` (a producer role), a replica that starts to
drain does not let its streams run out the grace: for each one it holds the sequence's computed
full blocks (prompt and output, :meth:`KVConnector.hand_over`) and ends the stream with
UNAVAILABLE, whose trailing metadata carries the hand-off (``x-tpserve-kv-transfer-params``, the
NIXL connector's fields). The client sends that metadata with the continuation; a replica with a
consumer role pulls the blocks of prompt + ``generated_token_ids`` before the continuation is
queued (:meth:`KVConnector.pull`) and computes only what follows the last full block. A replica
without the role, or a pull that fails, recomputes them, as a move always did. The draining replica
stops its ranks only once its holds ended (pulled, or ``hold_timeout_s``).

Engine-protocol streams (a gateway's) are not moved out: the gateway does not carry the metadata.
No torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import structlog

from coordinator.errors import UnavailableError
from coordinator.kv_transfer.connector import HeldBlocks, KVConnector
from coordinator.kv_transfer.params import parse_params
from tpserve.stream_move import KV_TRANSFER_PARAMS_KEY

if TYPE_CHECKING:
    from coordinator.engine import Engine
    from coordinator.request_table import RequestEntry
    from coordinator.validation import GenerateParams

log = structlog.get_logger(__name__)


class StreamMovedError(UnavailableError):
    """UNAVAILABLE for a stream moved out of a draining replica, its KV hand-off in the trailing metadata."""

    def __init__(self, message: str, kv_transfer_params_json: str) -> None:
        super().__init__(message)
        self.trailing_metadata = ((KV_TRANSFER_PARAMS_KEY, kv_transfer_params_json),)


class StreamMoves:
    """The ``tpserve.v1`` streams a replica may move out with their KV, and the pulls of moved-in ones.

    Args:
        connector: the replica's hand-offs (``--kv-transfer-config``).
        hold_timeout_s: how long a moved stream's blocks wait for their pull at most (the drain
            waits for them: ``--shutdown-grace-seconds``, so a drain takes no longer than before).
    """

    def __init__(self, connector: KVConnector, hold_timeout_s: float) -> None:
        self.connector, self.hold_timeout_s = connector, hold_timeout_s
        self._entries: set[RequestEntry] = set()

    def track(self, entry: RequestEntry) -> None:
        """A single-sample stream now running here (moved out on drain)."""
        self._entries.add(entry)

    def untrack(self, entry: RequestEntry) -> None:
        """Its handler ended."""
        self._entries.discard(entry)

    async def pull_moved_in(self, engine: Engine, params: GenerateParams,
                            metadata: Sequence[tuple[str, Any]] | None) -> tuple[HeldBlocks, GenerateParams]:
        """For a continuation that names its old replica's hand-off: pulls the blocks of its prompt and
        ``generated_token_ids``. Nothing (an empty hold) without one, or without the consumer role. Returns
        the hold and the parameters to run the continuation with (their prefix-cache namespace the pull's:
        ``HeldBlocks.namespace``).

        Raises:
            InvalidArgumentError: the metadata's hand-off is malformed (it names the field).
        """
        text = next((str(value) for key, value in metadata or () if key == KV_TRANSFER_PARAMS_KEY), None)
        if text is None or not params.generated_token_ids or not self.connector.config.is_consumer:
            return HeldBlocks(), params
        kv = parse_params(text)
        if not kv.do_remote_prefill:
            return HeldBlocks(), params
        tokens = [*params.prompt_token_ids, *params.generated_token_ids]
        held = await self.connector.pull(engine.scheduler, tokens, params.cache_namespace, kv)
        if held.namespace is not None:  # pulled from a peer that proved no secret: found under its own namespace
            params = dataclasses.replace(params, cache_namespace=held.namespace)
        return held, params

    async def move_out(self, engine: Engine) -> int:
        """Ends every tracked stream with :class:`StreamMovedError` after holding its blocks; returns how
        many moved. A no-op without the producer role."""
        if not self.connector.config.is_producer:
            return 0
        moved = 0
        for entry in list(self._entries):
            for state in list(entry.samples):
                seq = state.seq
                if seq.is_finished:
                    continue
                tokens = [*seq.prompt_token_ids, *seq.output_token_ids]
                handoff = await self.connector.hand_over(engine.scheduler, tokens, seq.cache_namespace,
                                                        self.hold_timeout_s)
                state.queue.put_nowait(StreamMovedError(
                    f"request {state.request_id}: this server is draining; continue on another replica with its KV",
                    handoff))
                moved += 1
        if moved:
            log.info("streams moved out with their KV", num_streams=moved)
        return moved
