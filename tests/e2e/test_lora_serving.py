"""``tpserve serve --enable-lora --lora-modules a=... b=...``: each request's adapter, end to end.

A tiny Llama at stories260k's vocabulary and two seeded adapters built with ``peft``
(tests/worker/lora_checkpoints.py). Requests for the base model and for each adapter,
sent at once, each get ``transformers``' greedy tokens of their model (``peft``'s merged
model for an adapter); the prefix cache keeps adapters apart (a prompt computed under
``a`` is no hit for ``b`` or the base model, and is one for ``a``); an unknown adapter is
NOT_FOUND naming it. At tp 1 and 2 (the adapters split across the ranks like their layers).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch

from tests.e2e.cluster import serve
from tests.paths import STORIES_DIR, requires_stories
from tests.tiny_models import load_hf_model, save_servable_model
from tests.worker.lora_checkpoints import ALL_TARGETS, AdapterSpec, save_adapter

pytestmark = [pytest.mark.e2e, requires_stories]

BLOCK_SIZE, MAX_TOKENS = 16, 8
PROMPT = [1] + [(37 * i) % 500 + 5 for i in range(39)]  # 40 tokens: two whole blocks cacheable
ADAPTERS = (AdapterSpec("a", 4, 8.0, ALL_TARGETS, seed=21),
            AdapterSpec("b", 8, 16.0, ("q_proj", "v_proj", "down_proj"), use_rslora=True, seed=22))


def _greedy(model: torch.nn.Module) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=MAX_TOKENS,
                             min_new_tokens=MAX_TOKENS, eos_token_id=None, pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


# tp 2 with plans of 4 decode steps too: each step of a plan groups its rows by adapter again.
@pytest.mark.parametrize("tp, extra", [(1, ()), (2, ()), (2, ("--num-scheduler-steps", "4"))],
                         ids=["tp1", "tp2", "tp2-steps4"])
def test_requests_generate_with_their_adapter(tmp_path: Path, tp: int, extra: tuple[str, ...]) -> None:
    base_dir = save_servable_model("gqa_tied", tmp_path / "base", STORIES_DIR)
    want = {"": _greedy(load_hf_model(base_dir))}
    for spec in ADAPTERS:
        want[spec.name] = _greedy(save_adapter(base_dir, spec, tmp_path / spec.name))
    assert want["a"] != want[""] and want["b"] != want[""]  # the adapters change the tokens
    modules = [f"{spec.name}={tmp_path / spec.name}" for spec in ADAPTERS]
    with serve(base_dir, tp, "--enable-lora", "--lora-modules", *modules, "--max-loras", "2", "--max-lora-rank", "8",
               "--block-size", str(BLOCK_SIZE), *extra) as cluster:
        client = cluster.client

        def generate(name: str):
            return client.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True,
                                   lora_name=name or None)

        first = generate("a")  # fills the cache under a
        assert first.token_ids == want["a"] and first.usage.cached_prompt_tokens == 0
        with ThreadPoolExecutor(3) as pool:  # at once: steps that mix the base model and both adapters
            results = dict(zip(("", "b", "a"), pool.map(generate, ("", "b", "a"))))
        assert {name: r.token_ids for name, r in results.items()} == {n: want[n] for n in ("", "b", "a")}
        assert results[""].usage.cached_prompt_tokens == 0  # a's blocks are no hit for the base model
        assert results["b"].usage.cached_prompt_tokens == 0  # nor for another adapter
        assert results["a"].usage.cached_prompt_tokens == 2 * BLOCK_SIZE  # but are for a
        with pytest.raises(grpc.RpcError) as error:
            generate("nope")
        assert error.value.code() == grpc.StatusCode.NOT_FOUND
        assert "lora_name 'nope' is not a served adapter; served: a, b" in error.value.details()
