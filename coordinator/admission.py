"""What a request must pass before the engine queues it: the engine takes requests, the KV
cache can ever hold it, and rank 0 has built its grammar.

Checked for a whole ``n`` > 1 request at once when it arrives (``Engine.admit``, with its
queue places held in coordinator/request_table.py), so that no sample of it is refused
after another has streamed. No torch.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import structlog

from coordinator.block_allocator import num_blocks_for
from coordinator.engine_state import EngineState
from coordinator.errors import DeadlineExceededError, ResourceExhaustedError, TpserveError, UnavailableError
from coordinator.scheduler import Scheduler
from coordinator.validation import GenerateParams
from coordinator.worker_client import WorkerGroup, WorkerGroupError

if TYPE_CHECKING:
    from coordinator.request_table import RequestEntry

log = structlog.get_logger(__name__)


def check_admissible(state: EngineState, reason: str | None, params: GenerateParams, scheduler: Scheduler,
                     max_model_len: int, admitted: bool = False) -> None:
    """Refuses a request the engine cannot take (the queue's bound is the request table's).

    Args:
        state: the engine's life-cycle state; ``reason``: why it is RECOVERING or DEAD.
        params: the request.
        scheduler: its KV cache's size (blocks, block size).
        max_model_len: longest sequence in tokens.
        admitted: a sample of a request admitted before a drain began (taken while draining).

    Raises:
        UnavailableError: the worker group is down or restarting, or the server is draining.
        ResourceExhaustedError: the request can never fit in the KV cache.
    """
    if state is EngineState.DEAD:
        raise UnavailableError(f"the worker group is down: {reason}")
    if state is EngineState.RECOVERING:
        raise UnavailableError(f"the worker group is restarting after a failure ({reason}); retry shortly")
    if state is EngineState.DRAINING and not admitted:
        raise UnavailableError("the server is draining")
    longest = min(len(params.prompt_token_ids) + params.max_tokens, max_model_len)
    if num_blocks_for(longest, scheduler.block_size) > scheduler.allocator.num_blocks:
        raise ResourceExhaustedError(
            f"the request needs up to {longest} tokens of KV cache; the cache holds "
            f"{scheduler.allocator.num_blocks * scheduler.block_size}")


async def prepare_grammar(workers: WorkerGroup, grammar: str, deadline: float | None, timeout_s: float | None,
                          entry: RequestEntry | None = None) -> None:
    """Has rank 0 build a structured-output grammar before the request is scheduled, so
    that no step waits for it (docs/design/sampling.md, "Grammars compile in child processes"). The coordinator
    compiled it already,
    under its time limit (coordinator/grammar_compiler.py); if rank 0 cannot be asked, the
    step that first samples the request builds it instead (worker/grammar.py).

    Args:
        deadline: the client's deadline (``time.monotonic()``), None for none; ``timeout_s``: its length.
        entry: the request, whose ``grammar_s`` gets the build's start and end (its trace's grammar span).

    Raises:
        DeadlineExceededError: the client's deadline passed meanwhile.
        TpserveError: rank 0 refused a grammar the coordinator accepted (INTERNAL: a bug).
    """
    started = time.monotonic()
    remaining = None if deadline is None else max(deadline - started, 0.0)
    try:
        await asyncio.wait_for(workers.prepare_grammar(grammar), remaining)
        if entry is not None:
            entry.grammar_s = (started, time.monotonic())
    except asyncio.TimeoutError:
        raise DeadlineExceededError(f"deadline of {timeout_s:.3f} s exceeded while rank 0 built the "
                                    "request's grammar") from None
    except WorkerGroupError as exc:
        log.warning("grammar not prepared; the step builds it", error=str(exc))
    except ValueError as exc:
        raise TpserveError(f"rank 0 refused a grammar the coordinator accepted: {exc}") from None
