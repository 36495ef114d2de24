"""``tpserve serve`` of a hybrid model (LFM2: short-convolution state layers beside attention layers).

A server (tp 1, then tp 2: each rank holds its channels' states) of the tiny seeded ``lfm2``
checkpoint of tests/worker/hybrid_specs.py (stories260k's vocabulary and tokenizer), prompts
prefilled in chunks of at most 24 tokens (``--max-num-batched-tokens``), block size 16, 4
sequences' states (``--max-num-seqs``):

* GetModelInfo reports the state slots: 4 sequences' states and some prefix checkpoints;
* prompts of 1 to 8 blocks (plus 3 tokens), each sent twice, then a prompt sharing its first half:
  every completion is ``transformers``' greedy one (so a hit's tokens are a miss's, and caching
  off would give the same); the repeat hits the longest saved boundary below its length (16 per
  block), the shared prefix its whole blocks; the per-kind metrics count the state hits;
* logprobs (within 1e-4 of ``transformers``' log-softmax), a choice constraint, ``n`` = 2 (each
  sample resumes from the prompt's saved state), and a stream moved to another replica mid-generation
  (re-sent with its delivered tokens) continuing token for token.

Under preemption (a 16-block pool for six long requests) every completion is still the greedy one.
Speculative decoding, LoRA, pipeline stages, the KV host tier and KV transfers are refused for a hybrid at start-up,
in one line each.
"""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.cluster import free_port, serve
from tests.paths import REPO_ROOT, STORIES_DIR, requires_stories
from tests.tiny_models import load_hf_model, save_servable_model
from tests.worker.hybrid_specs import LFM2

pytestmark = [pytest.mark.e2e, requires_stories]

MAX_TOKENS = 12
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def lfm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_servable_model(LFM2, tmp_path_factory.mktemp("lfm2"), STORIES_DIR)


def _greedy(model, prompt: list[int], max_tokens: int = MAX_TOKENS) -> tuple[list[int], list[float]]:
    """``transformers``' greedy tokens and their log-probabilities."""
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, eos_token_id=None, pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [float(torch.log_softmax(step[0].float(), dim=-1)[t]) for step, t in zip(out.logits, tokens)]
    return tokens, logprobs


# With multi-step scheduling each of a plan's 4 decode steps carries the sequences' live states on.
@pytest.mark.parametrize("tp, extra", [(1, ()), (2, ()), (2, ("--num-scheduler-steps", "4"))],
                         ids=["tp1", "tp2", "tp2-steps4"])
def test_lfm2_serving_with_prefix_states_logprobs_n_and_a_moved_stream(lfm2_dir: Path, tp: int,
                                                                       extra: tuple[str, ...]) -> None:
    from tpserve.client import build_request
    from tpserve.v1 import generate_pb2_grpc

    model = load_hf_model(lfm2_dir)
    rng = random.Random(44)
    prompts = {n: [1] + [rng.randrange(3, 512) for _ in range(BLOCK_SIZE * n + 2)] for n in range(1, 9)}
    shared = {n: prompts[n][:8 * n + 5] + [rng.randrange(3, 512) for _ in range(6)] for n in prompts}
    want = {n: _greedy(model, p) for n, p in prompts.items()}
    want_shared = {n: _greedy(model, p)[0] for n, p in shared.items()}
    with serve(lfm2_dir, tp, "--max-num-seqs", "4", "--max-num-batched-tokens", "24", *extra) as cluster:
        client = cluster.client
        info = client.model_info()
        assert info.num_state_slots == 4 and info.num_state_checkpoint_slots > 0 and info.num_kv_blocks > 0
        for n, prompt in prompts.items():
            miss, hit = (client.generate(prompt, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
                         for _ in range(2))
            other = client.generate(shared[n], max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
            assert list(miss.token_ids) == list(hit.token_ids) == want[n][0], n
            assert list(other.token_ids) == want_shared[n], n
            assert (miss.usage.cached_prompt_tokens, hit.usage.cached_prompt_tokens) == (0, BLOCK_SIZE * n), n
            assert other.usage.cached_prompt_tokens == (8 * n + 5) // BLOCK_SIZE * BLOCK_SIZE, n
        state_hits = cluster.metric("tpserve:prefix_cache_state_hits_total")
        assert state_hits >= 8 + sum(1 for n in prompts if 8 * n + 5 >= BLOCK_SIZE)
        assert cluster.metric("tpserve:prefix_cache_state_queries_total") >= 24

        scored = client.generate(prompts[3], max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=True)
        assert [lp.token_id for lp in scored.logprobs] == want[3][0]
        assert max(abs(lp.logprob - ref) for lp, ref in zip(scored.logprobs, want[3][1])) < 1e-4
        chosen = client.generate("Once upon a time", max_tokens=8, temperature=0, choices=["a dog", "the cat"])
        assert chosen.text in ("a dog", "the cat")

        samples: dict[int, list[int]] = {0: [], 1: []}
        cached: dict[int, int] = {}
        for chunk in client.generate_stream(prompts[5], n=2, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True):
            samples[chunk.index] += list(chunk.token_ids)
            if chunk.usage is not None:
                cached[chunk.index] = chunk.usage.cached_prompt_tokens
        assert samples == {0: want[5][0], 1: want[5][0]}
        assert cached == {0: 5 * BLOCK_SIZE, 1: 5 * BLOCK_SIZE}  # each sample resumed from the prompt's saved state

        stub = generate_pb2_grpc.GenerationStub(client.channel)

        def stream(given: list[int]) -> list[int]:
            request = build_request(prompts[4], max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
            request.generated_token_ids.extend(given)
            return [t for m in stub.GenerateStream(request, timeout=60) for t in m.token_ids]

        full = stream([])
        assert full == want[4][0]
        for k in (1, 6, 11):
            assert stream(full[:k]) == full[k:], k


def test_a_hybrid_serves_one_sequence_with_the_default_cpu_sizing(lfm2_dir: Path) -> None:
    """Every hybrid refused --max-num-seqs 1 on the CPU's default sizing ("the KV cache holds 544 tokens ... less
    than one sequence of max_model_len=640"): the cap of max_num_seqs whole sequences was the KV cache's alone and
    the states came out of it. Without prefix caching no state checkpoint is set aside either."""
    model = load_hf_model(lfm2_dir)
    prompt = [1] + [random.Random(5).randrange(3, 512) for _ in range(40)]
    want = _greedy(model, prompt)[0]
    for caching in ("--enable-prefix-caching", "--no-enable-prefix-caching"):
        with serve(lfm2_dir, 1, "--max-num-seqs", "1", caching) as cluster:
            info = cluster.client.model_info()
            assert info.num_kv_blocks >= -(-info.max_model_len // info.block_size), info
            assert info.num_state_slots >= 1
            assert (info.num_state_checkpoint_slots > 0) == (caching == "--enable-prefix-caching"), info
            result = cluster.client.generate(prompt, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
            assert list(result.token_ids) == want


@pytest.mark.parametrize("caching", ["--enable-prefix-caching", "--no-enable-prefix-caching"])
def test_preempted_hybrid_requests_recompute_their_state_and_give_the_greedy_tokens(lfm2_dir: Path,
                                                                                     caching: str) -> None:
    """A pool of 16 blocks (256 tokens) for six concurrent requests of 100-token prompts and 40 tokens:
    requests are preempted and their states rebuilt (with caching, resumed from saved prefix states;
    without, recomputed from zeroed slots that other sequences held), and every completion is still
    ``transformers``' greedy one: the same with caching on and off."""
    from concurrent.futures import ThreadPoolExecutor

    model = load_hf_model(lfm2_dir)
    rng = random.Random(7)
    stem = [1] + [rng.randrange(3, 512) for _ in range(63)]  # four shared blocks
    prompts = [stem + [rng.randrange(3, 512) for _ in range(36)] for _ in range(6)]
    want = [_greedy(model, p, 40)[0] for p in prompts]
    with serve(lfm2_dir, 1, "--num-gpu-blocks-override", "16", "--max-num-seqs", "6", caching) as cluster:
        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(lambda p: cluster.client.generate(p, max_tokens=40, temperature=0, ignore_eos=True),
                                prompts))
        assert cluster.metric("tpserve:num_preemptions_total") >= 1
    assert [list(r.token_ids) for r in got] == want


@pytest.mark.parametrize("flags, refusal", [
    (["--speculative-method", "ngram", "--num-speculative-tokens", "2"], "--speculative-method ngram"),
    (["--enable-lora"], "--enable-lora"),
    (["--pipeline-parallel-size", "2"], "--pipeline-parallel-size 2"),
    (["--num-cpu-blocks-override", "64"], "--kv-offloading-size / --num-cpu-blocks-override"),
    (["--kv-transfer-config", '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}'], "--kv-transfer-config"),
])
def test_what_a_hybrid_is_not_served_with_is_refused_in_one_line(lfm2_dir: Path, flags: list[str], refusal: str) -> None:
    out = subprocess.run([sys.executable, "-m", "launch.cli", "serve", "--port", str(free_port()), "--model",
                          str(lfm2_dir), *flags], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and refusal in lines[0] and "Lfm2ForCausalLM is a hybrid model" in lines[0], out.stderr
