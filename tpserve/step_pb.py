"""Conversion of the step protocol between its dataclasses and its protobuf messages.

Protobuf stops at the gRPC edge (TGI's ``from_pb`` / ``to_pb``): the scheduler and the
model runner see only :mod:`tpserve.step`. No torch.
"""

from __future__ import annotations

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


def plan_to_pb(plan: StepPlan) -> pb.StepPlan:
    """Encodes a plan for the wire."""
    return pb.StepPlan(
        step_id=plan.step_id,
        new_seqs=[
            pb.NewSequence(
                seq_id=seq.seq_id,
                sampling=_sampling_to_pb(seq.sampling),
                num_prompt_tokens=seq.num_prompt_tokens,
                history_token_ids=seq.history_token_ids,
                prompt_token_ids=seq.prompt_token_ids,
            )
            for seq in plan.new_seqs
        ],
        scheduled=[
            pb.ScheduledChunk(
                seq_id=chunk.seq_id,
                token_ids=chunk.token_ids,
                start_position=chunk.start_position,
                new_block_ids=chunk.new_block_ids,
                sample=chunk.sample,
                num_spec_tokens=chunk.num_spec_tokens,
                num_draft_tokens=chunk.num_draft_tokens,
            )
            for chunk in plan.scheduled
        ],
        finished_seq_ids=plan.finished_seq_ids,
        trimmed_block_tables=[pb.TrimmedBlockTable(seq_id=seq_id, num_blocks=num_blocks)
                              for seq_id, num_blocks in plan.trimmed_block_tables],
    )


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
            )
            for seq in msg.new_seqs
        ),
        scheduled=tuple(
            ScheduledChunk(
                seq_id=chunk.seq_id,
                token_ids=tuple(chunk.token_ids),
                start_position=chunk.start_position,
                new_block_ids=tuple(chunk.new_block_ids),
                sample=chunk.sample,
                num_spec_tokens=chunk.num_spec_tokens,
                num_draft_tokens=chunk.num_draft_tokens,
            )
            for chunk in msg.scheduled
        ),
        finished_seq_ids=tuple(msg.finished_seq_ids),
        trimmed_block_tables=tuple((t.seq_id, t.num_blocks) for t in msg.trimmed_block_tables),
    )


def _sampling_to_pb(params: SamplingParams) -> pb.WorkerSamplingParams:
    return pb.WorkerSamplingParams(
        temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=params.seed,
        min_p=params.min_p, repetition_penalty=params.repetition_penalty, presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty, logit_bias=dict(params.logit_bias), min_tokens=params.min_tokens,
        min_tokens_stop_ids=params.min_tokens_stop_ids, logprobs=params.logprobs, top_logprobs=params.top_logprobs,
        grammar=params.grammar, grammar_stop_ids=params.grammar_stop_ids, prompt_logprobs=params.prompt_logprobs,
    )


def _sampling_from_pb(msg: pb.WorkerSamplingParams) -> SamplingParams:
    # float32 on the wire: every rank reads the same rounded values (0.5, 0.9, 1.1 ...),
    # and rank 0 alone samples, so nothing depends on the coordinator's float64 copy.
    return SamplingParams(
        temperature=msg.temperature, top_k=msg.top_k, top_p=msg.top_p, seed=msg.seed, min_p=msg.min_p,
        repetition_penalty=msg.repetition_penalty, presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty, logit_bias=tuple(sorted(msg.logit_bias.items())),
        min_tokens=msg.min_tokens, min_tokens_stop_ids=tuple(msg.min_tokens_stop_ids), logprobs=msg.logprobs,
        top_logprobs=msg.top_logprobs, grammar=msg.grammar, grammar_stop_ids=tuple(msg.grammar_stop_ids),
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
    )


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
