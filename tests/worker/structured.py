"""A JSON schema and a helper that completes under it, shared by the structured-output and engine-family tests."""

from __future__ import annotations

from pathlib import Path

import torch

from coordinator.block_allocator import BlockAllocator
from coordinator.scheduler import Scheduler
from coordinator.sequence import Sequence, StopParams
from coordinator.tokenizer import Tokenizer
from coordinator.validation import validate_request
from tpserve.v1 import generate_pb2 as pb
from worker.model_runner import ModelRunner
from worker.parallel_state import ParallelContext

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "ok"],
          "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "ok": {"type": "boolean"}}}
NUM = 50


def complete(model_dir: Path, response_format: pb.ResponseFormat, max_tokens: int = 80,
             logit_bias: dict[int, float] | None = None) -> list[str]:
    tokenizer = Tokenizer.from_pretrained(model_dir)
    runner = ModelRunner(model_dir, ParallelContext.single(), torch.float32, block_size=16)
    runner.init_kv_cache(num_blocks=NUM * 8)
    scheduler = Scheduler(BlockAllocator(NUM * 8, 16), max_num_seqs=NUM, max_num_batched_tokens=4096)
    seqs = []
    for seed in range(NUM):
        request = pb.GenerateRequest(text="Once upon a time", sampling_params=pb.SamplingParams(
            temperature=1.0, seed=seed, max_tokens=max_tokens, response_format=response_format,
            logit_bias=logit_bias or {}))
        params = validate_request(request, tokenizer, 512, 256)
        seq = Sequence(seed, params.prompt_token_ids, params.sampling,
                       StopParams(params.max_tokens, tokenizer.eos_token_ids), 256)
        seqs.append(seq)
        scheduler.add(seq)
    while scheduler.has_work():
        plan = scheduler.schedule()
        scheduler.update(plan, runner.execute(plan))
    assert all(seq.finish_reason.value == "stop" for seq in seqs)  # every grammar completed before max_tokens
    # The stop token ends a sequence but is not returned (as the engine does).
    return [tokenizer.decode(seq.output_token_ids[:-1] if seq.stopped_on_token() else seq.output_token_ids)
            for seq in seqs]
