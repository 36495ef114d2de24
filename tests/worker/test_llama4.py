"""Llama 4 text at tensor-parallel degrees 1, 2 and 4 against ``transformers``.

A tiny seeded ``llama4_text`` checkpoint with every Llama 4 mechanism on: four layers, the
first three RoPE layers with chunked local attention (``attention_chunk_size`` 8, over
4-token blocks: prompts and generations span up to nine chunks) and QK L2 norm, the fourth
a NoPE layer over the whole context with attention temperature tuning (``floor_scale`` 4,
``attn_scale`` 0.5, so the scale grows within the test's lengths); MoE on layers 1 and 3
(``interleave_moe_layer_step`` 2: 4 experts stored fused, top-1 sigmoid routing scaling the
experts' input, a shared expert), dense SwiGLU (``intermediate_size_mlp``) on 0 and 2;
llama3 RoPE scaling on interleaved pairs. The scenario of tests/worker/family_check.py
(prefill chunks of 8 tokens: boundaries on the attention chunks' edges; prefix-cache hits,
preemption, prompt logprobs); head size 32, so the NoPE layer's decodes take the compiled
CPU kernel while the chunked layers take theirs through the chunked path. The MoE check of
tests/worker/moe_family_check.py (expert counts, batch invariance) and the CUDA-graph decode
path run on the same checkpoint.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.tiny_models import TinyModelSpec
from tests.worker.family_check import case, check, register

# Every registered family runs in one process group per degree (family_check.py): one test process for all.
pytestmark = pytest.mark.xdist_group("families")

CHUNK = 8
SPEC = TinyModelSpec("llama4", "llama4_text", {
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 190,
    "intermediate_size": 64, "intermediate_size_mlp": 128, "num_local_experts": 4, "num_experts_per_tok": 1,
    "interleave_moe_layer_step": 2, "attention_chunk_size": CHUNK, "use_qk_norm": True,
    "attn_temperature_tuning": True, "floor_scale": 4, "attn_scale": 0.5, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False, "pad_token_id": 0,
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
}, seed=44)
LLAMA4 = register(SPEC, CHUNK)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_llama4_matches_transformers(tp: int) -> None:
    check(LLAMA4, tp)


@pytest.fixture(scope="module")
def moe_case(tmp_path_factory: pytest.TempPathFactory):
    from tests.worker.moe_family_check import build_case

    return build_case(SPEC, tmp_path_factory.mktemp("llama4_moe"), moe_layers={1, 3}, top_k=1)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_llama4_moe_counts_and_batch_invariance(moe_case, tp: int) -> None:
    """tests/worker/moe_family_check.py: 16 prompts alone and at once, logits within 1e-5 of each other, and
    each MoE layer's expert counts summing to its tokens (top-1), none from the dense layers 0 and 2."""
    from tests.worker.moe_family_check import check_family

    check_family(moe_case, tp)


def test_llama4_layers() -> None:
    """Guards the test: 3 chunked RoPE layers and 1 NoPE layer; MoE on 1 and 3 (a meta-device model)."""
    import torch

    from tpserve.model_config import ModelConfig
    from worker.models.llama4 import Llama4ForCausalLM, Llama4MoE
    from worker.parallel_state import ParallelContext

    config = ModelConfig.from_pretrained(case(LLAMA4).jobs[0].model_dir)
    model = Llama4ForCausalLM(config, ParallelContext.single("meta"), torch.float32, tie_word_embeddings=False)
    attention = [layer.self_attn for layer in model.model.layers]
    assert [a.attn.attention_chunk_size for a in attention] == [CHUNK, CHUNK, CHUNK, None]
    assert [a.use_rope for a in attention] == [True, True, True, False]
    assert [a.qk_norm_eps is not None for a in attention] == [True, True, True, False]
    assert [a.temperature_tuning for a in attention] == [False, False, False, True]
    assert [isinstance(layer.feed_forward, Llama4MoE) for layer in model.model.layers] == [False, True, False, True]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed (the graphs' kernel)")
def test_llama4_decode_graphs_match_transformers() -> None:
    """The CUDA-graph decode path (captured on a GPU; elsewhere its static-buffer forward run eagerly with
    the Triton kernel in its interpreter): padded batches, decodes crossing attention-chunk edges."""
    import random

    import torch

    from tests.tiny_models import load_hf_model
    from tpserve.step import NewSequence, SamplingParams, ScheduledChunk, StepPlan
    from worker.model_runner import ModelRunner
    from worker.parallel_state import ParallelContext

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    model_dir = case(LLAMA4).jobs[0].model_dir
    hf = load_hf_model(Path(model_dir))
    rng = random.Random(5)
    texts = {s: [rng.randrange(3, 190) for _ in range(n)] for s, n in enumerate((5, 7, 10))}
    prompt_lens = {s: len(t) for s, t in texts.items()}
    for text in texts.values():  # 14 greedy tokens of transformers': positions past 8, 16 and 24
        for _ in range(14):
            with torch.no_grad():
                text.append(int(hf(torch.tensor([text])).logits[0, -1].argmax()))
    runner = ModelRunner(model_dir, ParallelContext.single(device), torch.float32, block_size=4)
    runner.init_kv_cache(48, cuda_graph_sizes=(1, 2, 4), max_model_len=64, capture=device.type == "cuda")
    free = list(range(48))
    random.Random(6).shuffle(free)
    tables: dict[int, list[int]] = {s: [] for s in texts}

    def chunk(seq: int, start: int, end: int) -> ScheduledChunk:
        new = [free.pop() for _ in range(-(-end // 4) - len(tables[seq]))]
        tables[seq] += new
        return ScheduledChunk(seq, tuple(texts[seq][start:end]), start, tuple(new))

    greedy = SamplingParams(temperature=0.0)
    runner.execute(StepPlan(0, tuple(NewSequence(s, greedy) for s in texts),
                            tuple(chunk(s, 0, n) for s, n in prompt_lens.items())))
    fed, checked = dict(prompt_lens), 0
    with torch.no_grad():
        expected = {s: hf(torch.tensor([t])).logits[0].float() for s, t in texts.items()}  # (L, V) each
    for step in range(1, 14):
        seqs = (0, 1, 2) if step < 8 else (2, 0)  # padded to 4, then to 2 (sequence 1 finished)
        finished = (1,) if step == 8 else ()
        result = runner.execute(StepPlan(step, scheduled=tuple(chunk(s, fed[s], fed[s] + 1) for s in seqs),
                                         finished_seq_ids=finished))
        for seq, token, logits in zip(seqs, result.sampled_token_ids, runner.last_logits, strict=True):
            torch.testing.assert_close(logits.cpu(), expected[seq][fed[seq]], atol=2e-4, rtol=1e-4)
            assert token == texts[seq][fed[seq] + 1]
            fed[seq] += 1
            checked += 1
    assert runner._graphs.num_replays == 13 and checked == 3 * 7 + 2 * 6
