"""Structured output: every seeded completion of a random-weights model follows its format.

A random-weights Llama (stories260k's tokenizer, seeded weights: it prefers nothing)
samples at temperature 1 under each response_format; the coordinator's validation builds
the llguidance grammar, the real scheduler and model runner run the batch in one process.
50 completions under a JSON schema all parse and validate with ``jsonschema``; a regex and
a choice list likewise. A schema llguidance rejects is INVALID_ARGUMENT. An extra eos id
in ``generation_config.json`` that is also ordinary text ends a grammar request only where
the grammar is complete (docs/design/sampling.md, "A grammar request ends only where its grammar does").
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from coordinator.errors import InvalidArgumentError
from coordinator.tokenizer import Tokenizer
from coordinator.validation import validate_request
from tests.paths import requires_stories
from tests.worker.structured import SCHEMA, complete
from tpserve.v1 import generate_pb2 as pb

pytestmark = requires_stories

REGEX = r"[a-z]{2,5}-[0-9]{3}"
CHOICES = ["red", "green", "light blue"]


@pytest.fixture(scope="module")
def random_model(stories_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).float()
    directory = tmp_path_factory.mktemp("random_llama")
    model.save_pretrained(directory, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (stories_dir / name).is_file():
            shutil.copy(stories_dir / name, directory / name)
    return directory


def test_json_schema_completions_all_parse_and_validate(random_model: Path) -> None:
    import jsonschema

    texts = complete(random_model, pb.ResponseFormat(json_schema=json.dumps(SCHEMA)))
    values = [json.loads(text) for text in texts]
    for value in values:
        jsonschema.validate(value, SCHEMA)
    assert len({json.dumps(v) for v in values}) > 10  # sampled, not one forced answer


def test_regex_and_choices_completions_all_match(random_model: Path) -> None:
    texts = complete(random_model, pb.ResponseFormat(regex=REGEX))
    assert all(re.fullmatch(REGEX, text) for text in texts), texts
    choices = complete(random_model, pb.ResponseFormat(choices=pb.Choices(choices=CHOICES)), max_tokens=12)
    assert set(choices) <= set(CHOICES) and len(set(choices)) > 1, choices


def test_formats_llguidance_rejects_are_invalid_argument(random_model: Path) -> None:
    tokenizer = Tokenizer.from_pretrained(random_model)
    for response_format, message in [
        (pb.ResponseFormat(json_schema="{not json"), "response_format.json_schema is not valid JSON"),
        (pb.ResponseFormat(json_schema='{"type": "objectx"}'), "response_format.json_schema is not supported"),
        (pb.ResponseFormat(regex="(a"), "response_format.regex is not supported"),
        (pb.ResponseFormat(choices=pb.Choices()), "response_format.choices must have 1 to 256"),
    ]:
        request = pb.GenerateRequest(text="Hi", sampling_params=pb.SamplingParams(response_format=response_format))
        with pytest.raises(InvalidArgumentError, match=re.escape(message)):
            validate_request(request, tokenizer, 512, 256)


def test_an_extra_eos_id_that_is_also_text_ends_json_only_where_it_is_complete(random_model: Path,
                                                                               tmp_path: Path) -> None:
    """``eos_token_id: [2, id of "i"]`` and a strong bias towards "i": the grammar allows "i" inside
    a JSON string, and before the fix the sampler took it there, which ended every output at
    its first string as a complete stop (``{"name":"``). An eos id is now an end, allowed only
    where the JSON is complete (``complete`` also checks every sequence finished with STOP)."""
    from tokenizers import Tokenizer as HFTokenizer

    token_i = HFTokenizer.from_file(str(random_model / "tokenizer.json")).token_to_id("i")  # 417, not "▁i"
    model = tmp_path / "model"
    shutil.copytree(random_model, model)
    (model / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, token_i]}))
    texts = complete(model, pb.ResponseFormat(json_schema=json.dumps(SCHEMA)), logit_bias={token_i: 20.0})
    import jsonschema

    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_a_grammar_built_in_the_background_masks_as_one_built_in_the_step(random_model: Path) -> None:
    """Rank 0 builds a request's grammar before it is scheduled (PrepareGrammar, GrammarCache.prepare),
    or at the latest when the plan arrives (GrammarCache.prefetch); the mask after a prefix is the same, eos (2) is held back until the JSON is complete, and a
    grammar llguidance refuses still raises when the matcher is asked for."""
    from coordinator.structured_output import grammar_for
    from worker.grammar import GrammarCache, GrammarState

    grammar = grammar_for(pb.ResponseFormat(json_schema=json.dumps(SCHEMA)))
    direct, prefetched = GrammarCache(random_model, 512), GrammarCache(random_model, 512)
    prefetched.prepare(grammar)  # PrepareGrammar: built and waited for, off the step thread
    assert prefetched.prefetch(grammar).done()  # the step finds it built
    prefix = direct._llm_tokenizer().tokenize_str('{"name":"ab"')
    masks = [GrammarState(cache.matcher(grammar)).allowed(prefix, cache, (2,)) for cache in (direct, prefetched)]
    assert (masks[0] == masks[1]).all() and 0 < masks[0].sum() < 512 and not masks[0][2]
    bad = '{"grammars": [{"lark_grammar": "start: nope"}]}'  # an undefined rule
    prefetched.prefetch(bad)
    with pytest.raises(ValueError, match="grammar rejected"):
        prefetched.matcher(bad)


def test_a_grammar_at_a_dead_end_fails_its_sequence_alone(random_model: Path) -> None:
    """A format that compiles and starts, then allows no token: a JSON array of 100,000 ``1``s hits llguidance's
    parser limits after ``[`` (a regex like ``(a{1000}){1000}`` does after its first token). Rank 0 reports
    ``GRAMMAR_DEAD_END_TOKEN_ID`` for it (not token 0 under an all ``-inf`` mask, which the coordinator took as
    a complete ``stop``), the scheduler ends it (ABORT: the engine fails the request with INVALID_ARGUMENT)
    and frees its blocks, a regex request in the same batch completes, and a second request with the dead
    end's grammar meets the same end (its failed matcher was dropped, not copied)."""
    from coordinator.block_allocator import BlockAllocator
    from coordinator.scheduler import Scheduler
    from coordinator.sequence import FinishReason, Sequence, StopParams
    from tpserve.step import GRAMMAR_DEAD_END_TOKEN_ID
    from worker.model_runner import ModelRunner
    from worker.parallel_state import ParallelContext

    tokenizer = Tokenizer.from_pretrained(random_model)
    runner = ModelRunner(random_model, ParallelContext.single(), torch.float32, block_size=16)
    runner.init_kv_cache(num_blocks=64)
    scheduler = Scheduler(BlockAllocator(64, 16), max_num_seqs=8, max_num_batched_tokens=4096)
    huge_array = pb.ResponseFormat(json_schema='{"type": "array", "items": {"const": 1}, "minItems": 100000}')
    seqs = []
    for seq_id, (response_format, temperature) in enumerate([(huge_array, 0.0), (pb.ResponseFormat(regex=REGEX), 1.0),
                                                             (huge_array, 1.0)]):
        params = validate_request(pb.GenerateRequest(text="Once upon a time", sampling_params=pb.SamplingParams(
            temperature=temperature, seed=seq_id, max_tokens=40, response_format=response_format)), tokenizer, 512, 256)
        seqs.append(Sequence(seq_id, params.prompt_token_ids, params.sampling,
                             StopParams(params.max_tokens, tokenizer.eos_token_ids), 256))
    scheduler.add(seqs[0])
    scheduler.add(seqs[1])
    dead_ends = []
    while scheduler.has_work():
        plan = scheduler.schedule()
        result = runner.execute(plan)
        dead_ends += [token for token in result.sampled_token_ids if token == GRAMMAR_DEAD_END_TOKEN_ID]
        scheduler.update(plan, result)
        if seqs[0].is_finished and seqs[2].seq_id not in {s.seq_id for s in scheduler.running} \
                and not seqs[2].is_finished and seqs[2] not in scheduler.waiting:
            scheduler.add(seqs[2])  # after the first dead end: the grammar cache's entry was dropped
    assert dead_ends == [GRAMMAR_DEAD_END_TOKEN_ID] * 2
    assert [seq.finish_reason for seq in seqs] == [FinishReason.ABORT, FinishReason.STOP, FinishReason.ABORT]
    assert [tokenizer.decode(seqs[i].output_token_ids) for i in (0, 2)] == ["[", "["]  # the dead end's token not kept
    assert re.fullmatch(REGEX, tokenizer.decode(seqs[1].output_token_ids[:-1]))
    assert scheduler.allocator.num_free_blocks == 64
