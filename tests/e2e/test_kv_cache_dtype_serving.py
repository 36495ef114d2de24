"""``tpserve serve --kv-cache-dtype int8`` at tp 2 and ``fp8`` at tp 4 on stories260k: the flag reaches every rank (the
pool is 1 byte per element and a 2-byte scale per token and KV head: 3.2x the blocks of the float32 cache at d = 8),
GetModelInfo reports it, and the served tokens are the 8-bit cache's: the same as a one-process tp 1 runner with
that cache (a head's per-token scales and key offset do not depend on the split), also with two pipeline stages; a
prefix-cache hit's tokens are exactly a miss's, and a moved stream continues token for token; a draft model's
cache is 8-bit too, and speculation keeps the tokens. Agreement with the float goldens is measured in tests/worker/test_kv_cache_dtype.py.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.e2e.cluster import serve
from tests.e2e.stories import wait_all_blocks_free
from tests.paths import STORIES_DIR, load_goldens, requires_stories

pytestmark = [pytest.mark.e2e, requires_stories]

BUDGET_BLOCKS = 600


@pytest.mark.parametrize("kv_cache_dtype, tp", [("int8", 2), ("fp8", 4)])
def test_8_bit_kv_cache_serving(kv_cache_dtype: str, tp: int, tmp_path: Path) -> None:
    import torch

    from tests.worker.kv8_helpers import eight_bit_runner, teacher_forced

    goldens = load_goldens()
    prompts = [g["prompt_token_ids"] for g in goldens]
    want = teacher_forced(eight_bit_runner(STORIES_DIR, kv_cache_dtype), prompts, None, 24)  # tp 1, one process
    log_path = tmp_path / "server.log"
    block_bytes = 2 * 5 * 16 * (4 // tp) * (8 + 2)  # a rank's block: K and V x 5 layers x 16 positions x its heads
    # x (8 codes of 1 byte + a 2-byte scale)
    with serve(STORIES_DIR, tp, "--kv-cache-dtype", kv_cache_dtype, "--log-format", "json",
               "--kv-cache-memory-bytes", str(BUDGET_BLOCKS * block_bytes), log_path=log_path) as cluster:
        info = cluster.client.model_info()
        assert info.kv_cache_dtype == kv_cache_dtype and info.num_kv_blocks == BUDGET_BLOCKS  # float32: 187
        assert info.tensor_parallel_size == tp
        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(lambda p: cluster.client.generate(p, max_tokens=24, temperature=0,
                                                                     ignore_eos=True), prompts))
        long = [1] + list(range(100, 144))  # 45 tokens, unseen: 2 full blocks to share
        miss, hit = (cluster.client.generate(long, max_tokens=16, temperature=0, ignore_eos=True) for _ in range(2))
        wait_all_blocks_free(cluster)
    assert [list(r.token_ids) for r in results] == want
    assert (miss.usage.cached_prompt_tokens, hit.usage.cached_prompt_tokens) == (0, 32)
    assert list(hit.token_ids) == list(miss.token_ids)
    lines = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
    loaded = [e for e in lines if e.get("event") == "shard loaded"]
    storage = str(dict(int8=torch.int8, fp8=torch.float8_e4m3fn)[kv_cache_dtype]).removeprefix("torch.")
    assert sorted(e["rank"] for e in loaded) == list(range(tp))
    assert {(e["kv_cache_dtype"], e["kv_cache_storage"]) for e in loaded} == {(kv_cache_dtype, storage)}  # the flag
    assert {e["num_kv_blocks_available"] for e in loaded} == {BUDGET_BLOCKS}
    calibrated = [e for e in lines if e.get("event") == "kv cache key offsets calibrated"]
    assert sorted(e["tp_rank"] for e in calibrated) == list(range(tp))  # once per rank, each naming itself


def test_8_bit_kv_cache_serving_with_a_draft_model() -> None:
    """``--speculative-method draft`` at tp 2, stories260k drafting for itself: the draft's cache is 8-bit too
    (worker/draft_model.py), the greedy tokens are the same 8-bit cache's without speculation, and nearly every
    proposal is accepted (a draft reading wrong K/V would propose other tokens)."""
    from tests.e2e.spec_decode import spec_counters
    from tests.worker.kv8_helpers import eight_bit_runner, teacher_forced

    prompts = [g["prompt_token_ids"] for g in load_goldens()]
    want = teacher_forced(eight_bit_runner(STORIES_DIR, "fp8"), prompts, None, 24)
    with serve(STORIES_DIR, 2, "--kv-cache-dtype", "fp8", "--speculative-method", "draft", "--speculative-model",
               str(STORIES_DIR), "--num-speculative-tokens", "3") as cluster:
        info = cluster.client.model_info()
        assert (info.kv_cache_dtype, info.speculative_method) == ("fp8", "draft")
        got = [list(cluster.client.generate(p, max_tokens=24, temperature=0, ignore_eos=True).token_ids)
               for p in prompts]
        counters = spec_counters(cluster)
        wait_all_blocks_free(cluster)
    assert got == want
    assert counters["tpserve:spec_decode_num_drafts_total"] > 20
    assert counters["tpserve:spec_decode_num_accepted_tokens_total"] > \
        0.9 * counters["tpserve:spec_decode_num_draft_tokens_total"]


def test_8_bit_kv_cache_serving_with_pipeline_stages() -> None:
    """Two pipeline stages: each calibrates its own layers (the calibration prompt flows through both
    stages as any step does); the tokens are tp 1's with the same cache."""
    from tests.worker.kv8_helpers import eight_bit_runner, teacher_forced

    prompts = [g["prompt_token_ids"] for g in load_goldens()]
    want = teacher_forced(eight_bit_runner(STORIES_DIR, "int8"), prompts, None, 24)
    with serve(STORIES_DIR, 1, "--pipeline-parallel-size", "2", "--kv-cache-dtype", "int8") as cluster:
        got = [list(cluster.client.generate(p, max_tokens=24, temperature=0, ignore_eos=True).token_ids)
               for p in prompts]
    assert got == want


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_a_moved_stream_continues_token_for_token(kv_cache_dtype: str) -> None:
    """A stream moved to another replica is re-sent with the tokens already delivered
    (``generated_token_ids``; docs/design/cluster.md): the replica prefills them into its 8-bit cache,
    rounded as decoding wrote them, and continues with the uninterrupted request's tokens."""
    from tpserve.client import build_request
    from tpserve.v1 import generate_pb2_grpc

    prompt = "Once upon a time, there was a little"
    with serve(STORIES_DIR, 1, "--kv-cache-dtype", kv_cache_dtype) as cluster:
        stub = generate_pb2_grpc.GenerationStub(cluster.client.channel)

        def stream(given: list[int]) -> list[int]:
            request = build_request(prompt, max_tokens=40, temperature=0, ignore_eos=True)
            request.generated_token_ids.extend(given)
            return [t for m in stub.GenerateStream(request, timeout=60) for t in m.token_ids]

        full = stream([])
        assert len(full) == 40
        for k in (1, 13, 27, 39):
            assert stream(full[:k]) == full[k:], k
