"""The newer families under the real scheduler and model runner (one process): n-gram speculative
decoding gives ``transformers``' greedy tokens, and structured output follows its format.

Each family of ``FAMILIES`` (a spec of tests/tiny_models.py, or one given there) is rebuilt with stories260k's
tokenizer and its 512-token vocabulary (seeded random weights). Speculation: 6 prompts
generate 48 greedy tokens each, all batched together, with ``NgramProposer`` proposing
from each sequence's own text; every completion must equal ``generate(do_sample=False)``,
and proposals must have been made, accepted and rejected (otherwise the test proves
nothing). Structured output: tests/worker/test_structured_output.py's JSON-schema scenario.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from coordinator.block_allocator import BlockAllocator
from coordinator.ngram_proposer import NgramProposer
from coordinator.scheduler import Scheduler
from coordinator.sequence import Sequence, StopParams
from coordinator.spec_decode import AdaptiveSpeculation
from tests.paths import requires_stories
from tests.tiny_models import TinyModelSpec, load_hf_model, save_servable_model
from tests.worker.structured import SCHEMA, complete
from tpserve.step import SamplingParams
from tpserve.v1 import generate_pb2 as pb
from worker.model_runner import ModelRunner
from worker.parallel_state import ParallelContext

pytestmark = requires_stories

#: tests/tiny_models.py specs run here, and EXAONE 4's (speculative chunks through windowed RoPE layers
#: and a global NoPE layer, post-norms); its window (6) is shorter than the prompts and generations.
FAMILIES = ("qwen3_qk_norm", TinyModelSpec("exaone4_engine", "exaone4", {
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "sliding_window": 6, "sliding_window_pattern": 4}, seed=23))
NUM_NEW_TOKENS = 48
BLOCK_SIZE = 4
NUM_BLOCKS = 128
PROMPTS = [[1, 403, 407, 261], [1, 9, 30, 77, 101, 5], [1, 250], [1, 33, 44, 55, 66, 77, 88, 99], [1, 500, 12],
           [1, 7, 7, 7, 7]]


@pytest.fixture(scope="module", params=FAMILIES, ids=lambda family: getattr(family, "name", family))
def family_model(request: pytest.FixtureRequest, stories_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    name = getattr(request.param, "name", request.param)
    return save_servable_model(request.param, tmp_path_factory.mktemp(name) / name, stories_dir)


def test_ngram_speculation_gives_transformers_greedy_tokens(family_model: Path) -> None:
    model = load_hf_model(family_model)
    with torch.no_grad():
        expected = [model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=NUM_NEW_TOKENS,
                                   min_new_tokens=NUM_NEW_TOKENS, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                    for p in PROMPTS]
    runner = ModelRunner(family_model, ParallelContext.single(), torch.float32, block_size=BLOCK_SIZE)
    runner.init_kv_cache(num_blocks=NUM_BLOCKS)
    scheduler = Scheduler(BlockAllocator(NUM_BLOCKS, BLOCK_SIZE), max_num_seqs=8, max_num_batched_tokens=64,
                          proposer=NgramProposer(3, 1, 3))
    seqs = []
    for seq_id, prompt in enumerate(PROMPTS):
        seq = Sequence(seq_id, list(prompt), SamplingParams(temperature=0.0), StopParams(NUM_NEW_TOKENS, frozenset()),
                       256)
        seq.speculation = AdaptiveSpeculation(min_acceptance=0.0)  # keep proposing, right or wrong
        seqs.append(seq)
        scheduler.add(seq)
    while scheduler.has_work():
        plan = scheduler.schedule()
        scheduler.update(plan, runner.execute(plan))
        scheduler.check_invariants()
    assert [seq.output_token_ids for seq in seqs] == expected
    spec = scheduler.spec
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens, spec  # some accepted, some rejected


def test_json_schema_completions_validate(family_model: Path) -> None:
    import jsonschema

    texts = complete(family_model, pb.ResponseFormat(json_schema=json.dumps(SCHEMA)))
    values = [json.loads(text) for text in texts]
    for value in values:
        jsonschema.validate(value, SCHEMA)
    assert len({json.dumps(v) for v in values}) > 10  # sampled, not one forced answer
