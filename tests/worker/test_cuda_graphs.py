"""Decode steps replayed from CUDA graphs against ``transformers``, with padding, joins and departures.

On a CUDA machine the runner captures real graphs; elsewhere it runs the very same
static-buffer forward eagerly (``capture=False``) with the Triton kernel in its
interpreter, so the padding rows, the buffers' reuse between batch sizes and the
null block are checked on every machine. The reference is ``transformers``' logits
of each sequence's whole text at every position it decoded.
"""

from __future__ import annotations

import importlib.util
import random
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

import pytest
import torch

from tests.tiny_models import TinyModelSpec, load_hf_model, save_tiny_model
from tests.worker.tp_harness import Job
from tpserve.step import NewSequence, SamplingParams, ScheduledChunk, StepPlan
from worker.cuda_graphs import DecodeGraphs, default_capture_sizes
from worker.kernels.triton_attention import split_plan
from worker.model_runner import ModelRunner
from worker.parallel_state import ParallelContext

DEVICE = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
GREEDY = SamplingParams(temperature=0.0)
BLOCK_SIZE = 4
NUM_BLOCKS = 48

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not installed (the graphs' attention is its kernel)")


def test_default_capture_sizes_follow_vllm_up_to_max_num_seqs() -> None:
    assert default_capture_sizes(1) == (1,)
    assert default_capture_sizes(3) == (1, 2, 4)
    assert default_capture_sizes(16) == (1, 2, 4, 8, 16)
    assert default_capture_sizes(20) == (1, 2, 4, 8, 16, 24)  # the smallest graph that holds 20
    assert default_capture_sizes(10_000)[-1] == 512
    with pytest.raises(ValueError, match="max_num_seqs"):
        default_capture_sizes(0)


class _Driver:
    """Runs plans on a runner, handing out shuffled blocks; records each sampled row's logits."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.free = list(range(NUM_BLOCKS))
        random.Random(0).shuffle(self.free)  # scattered blocks: the tables must be followed
        self.tables: dict[int, list[int]] = {}
        self.tokens: dict[int, list[int]] = {}
        self.logits: dict[int, list[tuple[int, torch.Tensor]]] = {}  # seq -> (position, logits)
        self.step_id = 0

    def step(self, prompts: Mapping[int, list[int]] = MappingProxyType({}), decode: tuple[int, ...] = (), finished: tuple[int, ...] = ()):
        chunks, new = [], []
        for seq in finished:
            self.free += self.tables.pop(seq)
        for seq in decode:
            chunks.append(self._chunk(seq, [self.tokens[seq][-1]], len(self.tokens[seq]) - 1))
        for seq, prompt in prompts.items():
            self.tables[seq], self.tokens[seq], self.logits[seq] = [], list(prompt), []
            new.append(NewSequence(seq, GREEDY))
            chunks.append(self._chunk(seq, prompt, 0))
        result = self.runner.execute(StepPlan(self.step_id, tuple(new), tuple(chunks), finished_seq_ids=finished))
        self.step_id += 1
        for chunk, token, logits in zip(chunks, result.sampled_token_ids, self.runner.last_logits):
            position = chunk.start_position + chunk.num_tokens - 1
            self.logits[chunk.seq_id].append((position, logits.cpu()))
            self.tokens[chunk.seq_id].append(token)

    def _chunk(self, seq: int, token_ids: list[int], start: int) -> ScheduledChunk:
        need = -(-(start + len(token_ids)) // BLOCK_SIZE) - len(self.tables[seq])
        blocks = [self.free.pop() for _ in range(need)]
        self.tables[seq] += blocks
        return ScheduledChunk(seq, tuple(token_ids), start, tuple(blocks))


@needs_triton
def test_decode_graphs_match_transformers_through_padding_joins_and_departures(
        tiny_checkpoints: dict[str, Path]) -> None:
    model_dir = tiny_checkpoints["mqa_untied_bias"]
    runner = ModelRunner(model_dir, ParallelContext.single(DEVICE), torch.float32, block_size=BLOCK_SIZE)
    # Tables of 2,048 tokens: the graphs' attention splits each context four ways (worker/kernels/
    # triton_attention.py's split_plan), most parts past these short contexts.
    runner.init_kv_cache(NUM_BLOCKS, cuda_graph_sizes=(1, 2, 4, 8), max_model_len=2048,
                         capture=DEVICE.type == "cuda")
    assert split_plan(8, 1, graphs_width := 2048 // BLOCK_SIZE, BLOCK_SIZE) == (4, graphs_width // 4)
    assert runner.cuda_graph_sizes == (1, 2, 4, 8)
    assert runner.kv_caches[0][0].shape[0] == NUM_BLOCKS + 1  # the padding rows' null block
    graphs: DecodeGraphs = runner._graphs
    rng = random.Random(1)
    vocab = runner.config.vocab_size
    prompt = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    driver = _Driver(runner)
    replays = []

    def decode(seqs: tuple[int, ...], times: int = 1) -> None:
        for _ in range(times):
            before = graphs.num_replays
            driver.step(decode=seqs)
            replays.append(graphs.num_replays - before)

    driver.step(prompts={s: prompt(3 + 2 * s) for s in range(5)})  # 5 prefills: eager
    decode((0, 1, 2, 3, 4), 3)  # padded to 8
    # 3 and 4 wait a step: padded to 4, row 3 held sequence 3's slot in the last step. The padding rows
    # write only into the null block: every slot but the step's own three is untouched.
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    decode((0, 1, 2))
    written = {(driver.tables[s][(len(driver.tokens[s]) - 2) // BLOCK_SIZE], (len(driver.tokens[s]) - 2) % BLOCK_SIZE)
               for s in range(3)}
    for (k0, v0), (k1, v1) in zip(before, runner.kv_caches):
        changed = ((k0 != k1) | (v0 != v1)).flatten(2).any(-1).nonzero().tolist()  # [(block, offset)]
        assert {tuple(c) for c in changed if c[0] != NUM_BLOCKS} == written
    decode((0, 1, 2, 3, 4))
    driver.step(finished=(3, 4), decode=(0, 1, 2))  # rows 3..7 held real slots in the last step
    replays.append(1)
    decode((0, 1, 2))
    driver.step(prompts={5: prompt(6)}, decode=(0, 1, 2))  # a prefill joins: eager
    replays.append(0)
    decode((0, 1, 2, 5), 2)  # exactly a capture size
    driver.step(finished=(0, 1, 2), decode=(5,))  # 1 sequence
    replays.append(1)
    decode((5,), 2)
    assert sum(replays) == graphs.num_replays == 12

    hf = load_hf_model(model_dir).to(DEVICE)
    for seq, rows in driver.logits.items():
        with torch.no_grad():
            expected = hf(torch.tensor([driver.tokens[seq][:-1]], device=DEVICE)).logits[0].float().cpu()  # (L, V)
        for position, logits in rows:
            torch.testing.assert_close(logits, expected[position], atol=2e-4, rtol=1e-4,
                                       msg=lambda m, s=seq, p=position: f"seq {s} position {p}: {m}")
            assert int(logits.argmax()) == int(expected[position].argmax())


@needs_triton
def test_steps_a_graph_does_not_take_run_eagerly(tiny_checkpoints: dict[str, Path]) -> None:
    runner = ModelRunner(tiny_checkpoints["gqa_tied"], ParallelContext.single(DEVICE), torch.float32,
                         block_size=BLOCK_SIZE)
    runner.init_kv_cache(NUM_BLOCKS, cuda_graph_sizes=(1, 2), max_model_len=8, capture=DEVICE.type == "cuda")
    graphs: DecodeGraphs = runner._graphs
    driver = _Driver(runner)
    driver.step(prompts={0: [5, 6, 7], 1: [8, 9], 2: [10]})  # prefills
    assert graphs.num_replays == 0
    driver.step(decode=(0, 1, 2))  # three sequences: more than the largest graph
    assert graphs.num_replays == 0
    driver.step(decode=(0, 1))
    assert graphs.num_replays == 1
    for _ in range(8):  # contexts 5 .. 12: a graph's tables hold max_model_len=8 tokens, eager past them
        driver.step(decode=(1,))
    assert graphs.num_replays == 1 + 4
    runner.free_kv_cache()
    assert runner.cuda_graph_sizes == ()


@needs_triton
def test_eager_steps_with_proposals_read_the_cache_through_the_triton_kernel(tiny_checkpoints: dict[str, Path]) -> None:
    """With graphs on, eager steps use the same kernel: a chunk verifying proposals is one row per token."""
    model_dir = tiny_checkpoints["gqa_tied"]
    runner = ModelRunner(model_dir, ParallelContext.single(DEVICE), torch.float32, block_size=BLOCK_SIZE)
    runner.init_kv_cache(NUM_BLOCKS, cuda_graph_sizes=(1,), max_model_len=32, capture=DEVICE.type == "cuda")
    text = [5, 17, 33, 9, 60, 2, 41, 7, 88]
    runner.execute(StepPlan(0, (NewSequence(0, GREEDY),), (ScheduledChunk(0, tuple(text[:6]), 0, (7, 3)),)))
    # The last real token and three proposals: their rows' logits verify positions 6, 7, 8.
    runner.execute(StepPlan(1, scheduled=(ScheduledChunk(0, tuple(text[5:]), 5, (11,), num_spec_tokens=3),)))
    verified = torch.cat([runner.last_spec_logits, runner.last_logits]).cpu()  # (4, V): positions 5 .. 8
    with torch.no_grad():
        expected = load_hf_model(model_dir).to(DEVICE)(torch.tensor([text], device=DEVICE)).logits[0, 5:].float()
    torch.testing.assert_close(verified, expected.cpu(), atol=2e-4, rtol=1e-4)


def _teacher_forced_plans(texts: dict[int, list[int]], prompt_lens: dict[int, int],
                          schedule: list[tuple[int, ...]]) -> tuple[list[StepPlan], list[list[tuple[int, int]]]]:
    """Plans that prefill every prompt, then decode ``schedule``'s sequences step by step, feeding ``texts``.

    Returns the plans and, per plan, the (sequence, position) of each sampled row.
    """
    free = list(range(NUM_BLOCKS))
    random.Random(2).shuffle(free)
    tables: dict[int, list[int]] = {s: [] for s in texts}
    fed = dict(prompt_lens)  # tokens of each sequence in the cache after the step

    def grow(seq: int, end: int) -> tuple[int, ...]:
        new = [free.pop() for _ in range(-(-end // BLOCK_SIZE) - len(tables[seq]))]
        tables[seq] += new
        return tuple(new)

    plans = [StepPlan(0, tuple(NewSequence(s, GREEDY) for s in texts),
                      tuple(ScheduledChunk(s, tuple(texts[s][: prompt_lens[s]]), 0, grow(s, prompt_lens[s]))
                            for s in texts))]
    rows = [[(s, prompt_lens[s] - 1) for s in texts]]
    alive = set(texts)
    for step, seqs in enumerate(schedule, start=1):
        finished = tuple(sorted(alive - set(seqs)))
        alive -= set(finished)
        chunks = tuple(ScheduledChunk(s, (texts[s][fed[s]],), fed[s], grow(s, fed[s] + 1)) for s in seqs)
        rows.append([(s, fed[s]) for s in seqs])
        for s in seqs:
            fed[s] += 1
        plans.append(StepPlan(step, scheduled=chunks, finished_seq_ids=finished))
    return plans, rows


#: Families whose graphs hold more than Llama's: OLMo 3 (the full-width QK norm's all-reduce, float32 RoPE per
#: layer type, 6-token windows) and EXAONE 4 (a global NoPE layer beside windowed local ones).
GRAPH_FAMILIES = {
    "olmo3": TinyModelSpec("graphs_olmo3", "olmo3", {"num_hidden_layers": 4, "num_attention_heads": 4,
                                                     "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 150,
                                                     "sliding_window": 6}, seed=21),
    "exaone4": TinyModelSpec("graphs_exaone4", "exaone4", {"num_hidden_layers": 4, "num_attention_heads": 4,
                                                           "num_key_value_heads": 2, "head_dim": 32,
                                                           "vocab_size": 150, "sliding_window": 6}, seed=22),
}


def _graph_case(model_dir: Path) -> tuple[Job, list, dict[int, torch.Tensor], dict[int, list[int]]]:
    """A teacher-forced decode job on ``model_dir``: ``(job, rows, expected logits, texts)``."""
    hf = load_hf_model(model_dir)
    rng = random.Random(3)
    prompt_lens = {s: 2 + 3 * s for s in range(3)}
    texts = {}
    for s, n in prompt_lens.items():  # each prompt and 8 greedy tokens of transformers' (no EOS stop)
        texts[s] = [rng.randrange(3, 130) for _ in range(n)]
        for _ in range(8):
            with torch.no_grad():
                texts[s].append(int(hf(torch.tensor([texts[s]])).logits[0, -1].argmax()))
    schedule = [(0, 1, 2)] * 3 + [(2, 0)] * 2 + [(0,)] * 2  # padded to 4, to 2, batch 1
    plans, rows = _teacher_forced_plans(texts, prompt_lens, schedule)
    job = Job(model_dir.name, str(model_dir), tuple(plans), NUM_BLOCKS, BLOCK_SIZE, cuda_graph_sizes=(1, 2, 4),
              max_model_len=32)
    with torch.no_grad():
        expected = {s: hf(torch.tensor([t])).logits[0].float() for s, t in texts.items()}  # (L, V) each
    return job, rows, expected, texts


@needs_triton
@pytest.mark.parametrize("tp", [2])
def test_decode_graphs_under_tensor_parallelism_match_transformers(tp: int, tmp_path: Path,
                                                                   tiny_checkpoints: dict[str, Path]) -> None:
    """Every rank replays its graph (the all-reduces inside it: NCCL on GPUs, the CPU's collective here), for
    Llama and :data:`GRAPH_FAMILIES`, in one process group."""
    from tests.worker.tp_harness import run_jobs

    if DEVICE.type == "cuda" and torch.cuda.device_count() < tp:
        pytest.skip(f"tp={tp} needs {tp} GPUs, {torch.cuda.device_count()} visible")
    model_dirs = [tiny_checkpoints["gqa_tied"]]
    model_dirs += [save_tiny_model(spec, tmp_path / name) for name, spec in GRAPH_FAMILIES.items()]
    cases = {model_dir.name: _graph_case(model_dir) for model_dir in model_dirs}
    records = run_jobs([case[0] for case in cases.values()], tp_size=tp, device=DEVICE.type)
    for name, (_job, rows, expected, texts) in cases.items():
        for record, step_rows in zip(records[name], rows, strict=True):
            for logits, (seq, position) in zip(record.logits, step_rows, strict=True):
                torch.testing.assert_close(logits, expected[seq][position], atol=2e-4, rtol=1e-4,
                                           msg=lambda m, name=name: f"{name}: {m}")
                assert int(logits.argmax()) == texts[seq][position + 1]  # the greedy text, token for token
