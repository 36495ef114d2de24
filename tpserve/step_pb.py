"""Conversion of the step protocol between its dataclasses and its protobuf messages.

Protobuf stops at the gRPC edge (TGI's ``from_pb`` / ``to_pb``): the scheduler and the
model runner see only :mod:`tpserve.step`. No torch.
"""

from __future__ import annotations

from tpserve.sampling_fields import FIELDS
from tpserve.step import (
    NewSequence,
    PromptLogprobs,
    SampleLogprobs,
    SamplingParams,
    ScheduledChunk,
    StepPlan,
    StepResult,
)
from tpserve.v1 import worker_pb2 as pb

#: The version of the step protocol (worker.proto's StepPlan and StepResult as this module reads
#: and writes them), which every rank reports in GetStatus and the coordinator checks before the
#: group's first step: protobuf skips fields it does not know, so a rank of another version would
#: read a plan as a different batch, not fail. 0: no version (before 2); 2: the leading plain
#: decodes as columns (``StepPlan.decode_*``); 3: hybrid models' state slots (``NewSequence.state_slot``,
#: ``StepPlan.restored_states`` and ``state_checkpoints``); 4: and the host tier's copies (``StepPlan.kv_copies``);
#: 5: multi-step plans (``StepPlan.num_steps``).
STEP_PROTOCOL = 5

#: Step stream metadata (key, value) that asks a rank to answer a plan only when its step fails.
#: The coordinator opens every rank's stream but the sampling rank's with it: their answers carry
#: nothing it uses, and each one read costs it a gRPC read per step (vLLM's executor likewise has
#: only its output rank reply). A stream without it is answered plan for plan.
ERRORS_ONLY = ("tpserve-step-answers", "errors-only")


def plan_to_pb(plan: StepPlan) -> pb.StepPlan:
    """Encodes a plan for the wire."""
    msg = pb.StepPlan(
        step_id=plan.step_id,
        new_seqs=[
            pb.NewSequence(
                seq_id=seq.seq_id,
                sampling=_sampling_to_pb(seq.sampling),
                num_prompt_tokens=seq.num_prompt_tokens,
                history_token_ids=seq.history_token_ids,
                prompt_token_ids=seq.prompt_token_ids,
                lora_slot=seq.lora_slot,
                state_slot=seq.state_slot,
            )
            for seq in plan.new_seqs
        ],
        finished_seq_ids=plan.finished_seq_ids,
        trimmed_block_tables=[pb.TrimmedBlockTable(seq_id=seq_id, num_blocks=num_blocks)
                              for seq_id, num_blocks in plan.trimmed_block_tables],
    )
    if plan.restored_states or plan.state_checkpoints:  # hybrid models only
        msg.restored_states.extend([pb.StateRestore(seq_id=seq_id, slot=slot) for seq_id, slot in plan.restored_states])
        msg.state_checkpoints.extend([pb.StateCheckpoint(seq_id=seq_id, num_rows=rows, slot=slot)
                                      for seq_id, rows, slot in plan.state_checkpoints])
    if plan.kv_swap_out or plan.kv_swap_in:  # the host tier's copies (rare: evictions and tier hits)
        msg.kv_copies.swap_out_block_ids.extend([block for block, _ in plan.kv_swap_out])
        msg.kv_copies.swap_out_slots.extend([slot for _, slot in plan.kv_swap_out])
        msg.kv_copies.swap_in_slots.extend([slot for slot, _ in plan.kv_swap_in])
        msg.kv_copies.swap_in_block_ids.extend([block for _, block in plan.kv_swap_in])
    if plan.num_steps > 1:
        msg.num_steps = plan.num_steps
    # One chunk per running sequence per step: the hot part (docs/design/request-path.md, "Where a streamed token's
    # coordinator CPU goes"). The
    # leading plain decodes go as columns (worker.proto), the rest as chunk messages.
    scheduled = plan.scheduled
    num_decodes = _num_leading_decodes(scheduled)
    if num_decodes:
        head = scheduled[:num_decodes]
        msg.decode_seq_ids.extend([chunk.seq_id for chunk in head])
        msg.decode_token_ids.extend([chunk.token_ids[0] for chunk in head])
        msg.decode_start_positions.extend([chunk.start_position for chunk in head])
        grow_rows = [row for row, chunk in enumerate(head) if chunk.new_block_ids]
        if grow_rows:
            msg.decode_grow_rows.extend(grow_rows)
            msg.decode_grow_block_ids.extend([head[row].new_block_ids[0] for row in grow_rows])
        scheduled = scheduled[num_decodes:]
    # ``add`` builds a chunk in place, setting only the fields that differ from their defaults
    # (keyword arguments cost protobuf more than the values do).
    add = msg.scheduled.add
    for chunk in scheduled:
        if chunk.new_block_ids or chunk.num_spec_tokens or chunk.num_draft_tokens or not chunk.sample:
            add(seq_id=chunk.seq_id, token_ids=chunk.token_ids, start_position=chunk.start_position,
                new_block_ids=chunk.new_block_ids, sample=chunk.sample, num_spec_tokens=chunk.num_spec_tokens,
                num_draft_tokens=chunk.num_draft_tokens)
        else:
            add(seq_id=chunk.seq_id, token_ids=chunk.token_ids, start_position=chunk.start_position, sample=True)
    return msg


def plan_from_pb(msg: pb.StepPlan) -> StepPlan:
    """Decodes a plan from the wire.

    Raises:
        ValueError: sampling parameters out of range.
    """
    return StepPlan(
        step_id=msg.step_id,
        new_seqs=tuple(
            NewSequence(
                seq.seq_id,
                _sampling_from_pb(seq.sampling),
                num_prompt_tokens=seq.num_prompt_tokens,
                history_token_ids=tuple(seq.history_token_ids),
                prompt_token_ids=tuple(seq.prompt_token_ids),
                lora_slot=seq.lora_slot,
                state_slot=seq.state_slot,
            )
            for seq in msg.new_seqs
        ),
        # One chunk per running sequence, on every rank's critical path each step: positional
        # arguments in ScheduledChunk's field order (keywords cost a fifth more).
        scheduled=tuple(_decodes_from_pb(msg) + [
            ScheduledChunk(chunk.seq_id, tuple(chunk.token_ids), chunk.start_position, tuple(chunk.new_block_ids),
                           chunk.sample, chunk.num_spec_tokens, chunk.num_draft_tokens)
            for chunk in msg.scheduled
        ]),
        finished_seq_ids=tuple(msg.finished_seq_ids),
        trimmed_block_tables=tuple((t.seq_id, t.num_blocks) for t in msg.trimmed_block_tables),
        # Hybrid models only: attention-only plans pay a length check each.
        restored_states=tuple((r.seq_id, r.slot) for r in msg.restored_states) if msg.restored_states else (),
        state_checkpoints=(tuple((c.seq_id, c.num_rows, c.slot) for c in msg.state_checkpoints)
                           if msg.state_checkpoints else ()),
        **(_copies_from_pb(msg) if msg.HasField("kv_copies") else _NO_COPIES),
        num_steps=max(msg.num_steps, 1),
    )


#: A plan without host-tier copies (the tier off, or nothing moved this step).
_NO_COPIES: dict[str, tuple[tuple[int, int], ...]] = {}


def _copies_from_pb(msg: pb.StepPlan) -> dict[str, tuple[tuple[int, int], ...]]:
    """The host tier's copy orders from their columns (worker.proto, ``KvTierCopies``).

    Raises:
        ValueError: columns of different lengths.
    """
    copies = msg.kv_copies
    out_blocks, out_slots, in_slots, in_blocks = (copies.swap_out_block_ids, copies.swap_out_slots,
                                                  copies.swap_in_slots, copies.swap_in_block_ids)
    if len(out_blocks) != len(out_slots) or len(in_slots) != len(in_blocks):
        raise ValueError(f"step {msg.step_id}: malformed host-tier copies: {len(out_blocks)} blocks for "
                         f"{len(out_slots)} slots out, {len(in_slots)} slots for {len(in_blocks)} blocks in")
    return {"kv_swap_out": tuple(zip(out_blocks, out_slots)), "kv_swap_in": tuple(zip(in_slots, in_blocks))}


def _num_leading_decodes(scheduled: tuple[ScheduledChunk, ...]) -> int:
    """How many chunks at the head of a plan are plain decodes: one token, sampled, no
    proposals, at most one new block (what the plan's decode columns can carry)."""
    count = 0
    for chunk in scheduled:
        if (len(chunk.token_ids) != 1 or len(chunk.new_block_ids) > 1 or not chunk.sample or chunk.num_spec_tokens
                or chunk.num_draft_tokens):
            break
        count += 1
    return count


def _decodes_from_pb(msg: pb.StepPlan) -> list[ScheduledChunk]:
    """The plan's leading decodes from its columns (worker.proto, ``decode_seq_ids``).

    Raises:
        ValueError: columns of different lengths, or a new block for a row that is not there.
    """
    seq_ids, token_ids, positions = msg.decode_seq_ids, msg.decode_token_ids, msg.decode_start_positions
    if not seq_ids and not token_ids and not positions:
        return []
    grow_rows, grow_blocks = msg.decode_grow_rows, msg.decode_grow_block_ids
    if (len(token_ids) != len(seq_ids) or len(positions) != len(seq_ids) or len(grow_blocks) != len(grow_rows)
            or any(row >= len(seq_ids) for row in grow_rows)):
        raise ValueError(f"step {msg.step_id}: malformed decode columns: {len(seq_ids)} sequences, {len(token_ids)} "
                         f"tokens, {len(positions)} positions, new blocks {list(grow_rows)} -> {list(grow_blocks)}")
    chunks = [ScheduledChunk(seq_id, (token,), position) for seq_id, token, position in zip(seq_ids, token_ids, positions)]
    for row, block in zip(grow_rows, grow_blocks):
        chunk = chunks[row]
        chunks[row] = ScheduledChunk(chunk.seq_id, chunk.token_ids, chunk.start_position, (block,))
    return chunks


def _sampling_to_pb(params: SamplingParams) -> pb.WorkerSamplingParams:
    """Every worker field of the table (tpserve/sampling_fields.py) under its own name, then the derived ones."""
    msg = pb.WorkerSamplingParams(min_tokens_stop_ids=params.min_tokens_stop_ids, grammar=params.grammar,
                                  grammar_stop_ids=params.grammar_stop_ids)
    for spec in _WORKER_FIELDS:
        value = getattr(params, spec.name)
        if spec.type is dict:
            getattr(msg, spec.name).update(dict(value))
        elif value is not None:  # None: an optional field left unset (prompt_logprobs)
            setattr(msg, spec.name, value)
    return msg


def _sampling_from_pb(msg: pb.WorkerSamplingParams) -> SamplingParams:
    # float32 on the wire: every rank reads the same rounded values (0.5, 0.9, 1.1 ...),
    # and rank 0 alone samples, so nothing depends on the coordinator's float64 copy.
    values: dict[str, object] = {}
    for spec in _WORKER_FIELDS:
        if spec.type is dict:
            values[spec.name] = tuple(sorted(getattr(msg, spec.name).items()))
        elif spec.name in _OPTIONAL:
            values[spec.name] = getattr(msg, spec.name) if msg.HasField(spec.name) else None
        else:
            values[spec.name] = getattr(msg, spec.name)
    return SamplingParams(**values, min_tokens_stop_ids=tuple(msg.min_tokens_stop_ids), grammar=msg.grammar,
                          grammar_stop_ids=tuple(msg.grammar_stop_ids))


_WORKER_FIELDS = tuple(spec for spec in FIELDS if spec.on_worker)
#: Fields with presence on the wire (``optional`` in worker.proto): unset means None.
_OPTIONAL = frozenset(f.name for f in pb.WorkerSamplingParams.DESCRIPTOR.fields if f.has_presence
                      and f.message_type is None)


def result_to_pb(result: StepResult) -> pb.StepResult:
    """Encodes a step result for the wire."""
    return pb.StepResult(step_id=result.step_id, sampled_token_ids=result.sampled_token_ids, logprobs=[
        pb.SampleLogprobs(sample_index=lp.sample_index, logprob=lp.logprob, top_token_ids=lp.top_token_ids,
                          top_logprobs=lp.top_logprobs) for lp in result.logprobs], prompt_logprobs=[
        pb.PromptLogprobs(seq_id=p.seq_id, first_position=p.first_position, logprobs=p.logprobs,
                          top=[pb.TopTokens(token_ids=ids, logprobs=lps) for ids, lps in zip(p.top_token_ids,
                                                                                            p.top_logprobs, strict=True)])
        for p in result.prompt_logprobs], num_accepted_tokens=result.num_accepted_tokens,
        expert_token_counts=result.expert_token_counts, model_execute_time_s=result.model_execute_time_s,
        wait_time_s=result.wait_time_s)


def result_from_pb(msg: pb.StepResult) -> StepResult:
    """Decodes a step result from the wire (``msg.error`` is the caller's to check)."""
    return StepResult(step_id=msg.step_id, sampled_token_ids=tuple(msg.sampled_token_ids), logprobs=tuple(
        SampleLogprobs(lp.sample_index, lp.logprob, tuple(lp.top_token_ids), tuple(lp.top_logprobs))
        for lp in msg.logprobs), prompt_logprobs=tuple(
        PromptLogprobs(p.seq_id, p.first_position, tuple(p.logprobs), tuple(tuple(t.token_ids) for t in p.top),
                       tuple(tuple(t.logprobs) for t in p.top))
        for p in msg.prompt_logprobs), num_accepted_tokens=tuple(msg.num_accepted_tokens),
        expert_token_counts=tuple(msg.expert_token_counts), model_execute_time_s=msg.model_execute_time_s,
        wait_time_s=msg.wait_time_s)
