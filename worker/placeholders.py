"""Async scheduling on the ranks: a decode's placeholder becomes the token sampled the step before.

Under async scheduling (``--async-scheduling``; tpserve/step.py) the coordinator plans step
t+1 before step t's result reaches it, so a sequence that t samples decodes in t+1 with
``PLACEHOLDER_TOKEN_ID`` as its token. The sampling rank remembers each sequence's last
sampled token (``ModelRunner``); here the plan's placeholders are replaced with those tokens
before anything else of the step reads them (block tables, penalty history, grammar,
inputs), so the rest of the step is that of an ordinary plan. With tensor parallelism the
other ranks get the tokens from the sampling rank in one collective of ``(P,)`` int64 (P:
the placeholders), issued by every rank at the same point of the same plan: an all-reduce
to which only the sampling rank adds anything (zeros elsewhere), so that it takes the
all-reduce's fastest path (shared memory on one host: microseconds, where a gloo
broadcast over loopback TCP costs a round trip).

This is vLLM v1's async scheduling ("the worker uses the sampled token ids of the previous
step as inputs"), without a device-resident copy: on a GPU the tokens make one host round
trip already, in the step's result.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from operator import attrgetter, itemgetter

import torch

from tpserve.step import PLACEHOLDER_TOKEN_ID, ScheduledChunk, StepPlan
from worker.parallel_state import ParallelContext

_first_token = itemgetter(0)
_token_ids = attrgetter("token_ids")


def has_placeholders(plan: StepPlan) -> bool:
    """Whether a chunk of ``plan`` feeds a placeholder (a C-level scan of each chunk's first token)."""
    return PLACEHOLDER_TOKEN_ID in map(_first_token, map(_token_ids, plan.scheduled))


def fill_placeholders(plan: StepPlan, last_tokens: Sequence[int | None], ctx: ParallelContext) -> StepPlan:
    """``plan`` with each placeholder replaced by its sequence's last sampled token.

    Args:
        plan: a plan with at least one placeholder (:func:`has_placeholders`).
        last_tokens: per chunk of ``plan.scheduled``, on the sampling rank, the token its
            sequence was sampled last (None: none yet); ignored on the other ranks.
        ctx: this rank's group; every rank of the stage calls this for the same plan.

    Raises:
        ValueError: a placeholder in a chunk that is not a plain one-token decode, a plan
            with placeholders in a pipeline of several stages (the first stage does not
            sample), or a placeholder for a sequence the sampling rank has sampled nothing
            for (raised on every rank alike, after the broadcast).
    """
    chunks = list(plan.scheduled)
    rows = [i for i, chunk in enumerate(chunks) if chunk.token_ids[0] == PLACEHOLDER_TOKEN_ID]
    for i in rows:
        chunk = chunks[i]
        if len(chunk.token_ids) != 1 or chunk.num_spec_tokens or chunk.num_draft_tokens:
            raise ValueError(f"step {plan.step_id}: seq_id={chunk.seq_id}: a placeholder token in a chunk that "
                             "is not a one-token decode")
    if not (ctx.pp.is_first and ctx.pp.is_last):
        raise ValueError(f"step {plan.step_id}: placeholder tokens (async scheduling) need one pipeline stage")
    tokens = [PLACEHOLDER_TOKEN_ID if last_tokens[i] is None else last_tokens[i] for i in rows] \
        if ctx.is_sampler else [0] * len(rows)
    if ctx.tp_size > 1:  # a broadcast from the sampling rank, as a sum over zeros elsewhere (exact)
        tokens = ctx.all_reduce(torch.tensor(tokens, dtype=torch.int64, device=ctx.device)).tolist()
    for i, token in zip(rows, tokens):
        chunk = chunks[i]
        if token == PLACEHOLDER_TOKEN_ID:
            raise ValueError(f"step {plan.step_id}: seq_id={chunk.seq_id} feeds a placeholder, but no token was "
                             "sampled for it")
        chunks[i] = ScheduledChunk(chunk.seq_id, (token,), chunk.start_position, chunk.new_block_ids, chunk.sample)
    return replace(plan, scheduled=tuple(chunks))
