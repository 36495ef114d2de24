"""DeepSeek V3 (multi-head latent attention) at tensor-parallel degrees 1, 2 and 4 against ``transformers``.

The tiny checkpoints of tests/worker/deepseek_v3_specs.py (a low-rank or full-rank query,
interleaved RoPE or not, YaRN with its ``mscale`` correction, a DeepSeek MoE layer; GLM-4.7-Flash's
``Glm4MoeLiteForCausalLM``, the same attention with GLM's MoE layer pattern), each through
the scenario of tests/worker/family_check.py: greedy tokens and logits within 1e-4, alone and 16
at once, prompt logprobs, chunked prefill split inside a block (chunks of 6 tokens, blocks of 4),
prefix-cache hits (whole cached latent blocks, the rest prefilled) and preemption with recompute.
Prefill runs the expanded form, decode the absorbed one (worker/layers/mla_attention.py), so the
same tokens from both is part of the check. The MoE checkpoint also runs
tests/worker/moe_family_check.py (expert counts, logits alone and in a batch within 1e-5).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tests.worker import deepseek_v3_specs as specs
from tests.worker.family_check import check, register
from tests.worker.moe_family_check import build_case, check_family

# Every registered family runs in one process group per degree (family_check.py): one test process for all.
pytestmark = pytest.mark.xdist_group("families")

#: Chunks of 6 tokens over blocks of 4: every other chunk boundary falls inside a block.
CHUNK = 6
NAMES = [register(spec, CHUNK) for spec in (specs.Q_LORA, specs.Q_PROJ, specs.YARN, specs.MOE, specs.GLM4_MOE_LITE)]


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("name", NAMES)
def test_deepseek_v3_matches_transformers(name: str, tp: int) -> None:
    check(name, tp)


def test_deepseek_v3_moe_routes_alike_alone_and_in_a_batch(tmp_path: Path) -> None:
    """tests/worker/moe_family_check.py on the MoE checkpoint (tp 1, other weights): tokens and logits as
    ``transformers``', a prompt's logits alone and among 16 within 1e-5, and layer 1's expert counts =
    its tokens x 3 (none from layer 0)."""
    spec = dataclasses.replace(specs.MOE, name="dsv3_moe_counts", seed=46)
    check_family(build_case(spec, tmp_path, moe_layers={1}, top_k=3), 1)
