"""Conversion of the step protocol between its dataclasses and its protobuf messages.

Protobuf stops at the gRPC edge (TGI's ``from_pb`` / ``to_pb``): the scheduler and the
model runner see only :mod:`tpserve.step`. No torch.
"""

from __future__ import annotations

from tpserve.step import NewSequence, SamplingParams, ScheduledChunk, StepPlan, StepResult
from tpserve.v1 import worker_pb2 as pb


def plan_to_pb(plan: StepPlan) -> pb.StepPlan:
    """Encodes a plan for the wire."""
    return pb.StepPlan(
        step_id=plan.step_id,
        new_seqs=[
            pb.NewSequence(
                seq_id=seq.seq_id,
                sampling=pb.WorkerSamplingParams(
                    temperature=seq.sampling.temperature,
                    top_k=seq.sampling.top_k,
                    top_p=seq.sampling.top_p,
                    seed=seq.sampling.seed,
                ),
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
            )
            for chunk in plan.scheduled
        ],
        finished_seq_ids=plan.finished_seq_ids,
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
                # float32 on the wire: round-trip exact for the values clients send
                # (0, 0.5, 0.9 ... are compared after the same float32 rounding on every rank).
                SamplingParams(
                    temperature=seq.sampling.temperature,
                    top_k=seq.sampling.top_k,
                    top_p=seq.sampling.top_p,
                    seed=seq.sampling.seed,
                ),
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
            )
            for chunk in msg.scheduled
        ),
        finished_seq_ids=tuple(msg.finished_seq_ids),
    )


def result_to_pb(result: StepResult) -> pb.StepResult:
    """Encodes a step result for the wire."""
    return pb.StepResult(step_id=result.step_id, sampled_token_ids=result.sampled_token_ids)


def result_from_pb(msg: pb.StepResult) -> StepResult:
    """Decodes a step result from the wire (``msg.error`` is the caller's to check)."""
    return StepResult(step_id=msg.step_id, sampled_token_ids=tuple(msg.sampled_token_ids))
