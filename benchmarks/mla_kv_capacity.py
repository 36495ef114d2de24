"""KV-cache tokens that fit in the same memory: multi-head latent attention's cache against per-head caching.

For the published configs of DeepSeek V3 (and R1), Kimi K2 and DeepSeek-V2-Lite, the pool a
rank sizes from a fixed budget, through the code the ranks run (worker/kv_cache.py's
``KVCacheLayout.for_model(...).num_blocks_for_budget``, the layout coming from
``ModelConfig.kv_cache_spec``):

* **latent** (what tpserve caches): ``kv_lora_rank + qk_rope_head_dim`` numbers per token per
  layer, the same on every tensor-parallel rank;
* **per-head** (the same model served as if it were multi-head attention, what an engine
  without MLA support caches): per head a key of ``qk_nope_head_dim + qk_rope_head_dim`` and a
  value of ``v_head_dim``, the heads split over the ranks;
* **8-bit latent** (``--kv-cache-dtype int8|fp8``): the latent's codes, 1 byte a number, and a
  2-byte scale per token of the latent and of the rope key (worker/layers/mla_attention.py).

No weights are needed: the configs are the checkpoints' ``config.json`` fields that size the
cache. bfloat16 cache, 16-token blocks, a 40 GiB budget per rank (what an 80 GB GPU has left
beside its share of a large model's weights). Run::

    .venv/bin/python benchmarks/mla_kv_capacity.py [--budget-gib 40] [--out benchmarks/results/mla_kv_capacity.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from tpserve.model_config import KVCacheSpec, ModelConfig  # noqa: E402
from worker.kv_cache import KVCacheLayout  # noqa: E402

_MLA_BASE = {"architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 129280, "intermediate_size": 18432,
             "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
             "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "kv_lora_rank": 512,
             "first_k_dense_replace": 3, "n_routed_experts": 256, "num_experts_per_tok": 8, "n_group": 8,
             "topk_group": 4, "moe_intermediate_size": 2048}
#: The cache-sizing fields of each model's published config.json.
MODELS = {
    "DeepSeek-V3 / R1": {**_MLA_BASE, "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128,
                         "q_lora_rank": 1536},
    "Kimi-K2": {**_MLA_BASE, "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 64,
                "q_lora_rank": 1536, "n_routed_experts": 384, "n_group": 1, "topk_group": 1},
    "DeepSeek-V2-Lite": {**_MLA_BASE, "hidden_size": 2048, "num_hidden_layers": 27, "num_attention_heads": 16,
                         "q_lora_rank": None, "intermediate_size": 10944, "n_routed_experts": 64, "n_group": 1,
                         "topk_group": 1, "num_experts_per_tok": 6, "moe_intermediate_size": 1408},
    "GLM-4.7-Flash": {**_MLA_BASE, "architectures": ["Glm4MoeLiteForCausalLM"], "hidden_size": 2048,
                      "num_hidden_layers": 47, "num_attention_heads": 20, "q_lora_rank": 768, "qk_nope_head_dim": 192,
                      "v_head_dim": 256, "intermediate_size": 10240, "n_routed_experts": 64, "n_group": 1,
                      "topk_group": 1, "num_experts_per_tok": 4, "moe_intermediate_size": 1536},
}
BLOCK_SIZE = 16
DTYPE = torch.bfloat16


def capacity(raw: dict, tp: int, budget_bytes: int) -> dict:
    """Tokens of cache that fit in ``budget_bytes`` on one rank of ``tp``, latent and per-head."""
    config = ModelConfig.from_dict({k: v for k, v in raw.items() if v is not None})
    latent = KVCacheLayout.for_model(config, tp, BLOCK_SIZE, DTYPE)
    heads = config.total_num_heads // tp
    per_head_spec = KVCacheSpec("per_head", (heads, raw["qk_nope_head_dim"] + raw["qk_rope_head_dim"]),
                                (heads, raw["v_head_dim"]))
    per_head = KVCacheLayout(config.num_hidden_layers, BLOCK_SIZE, per_head_spec, DTYPE)
    latent_tokens = latent.num_blocks_for_budget(budget_bytes) * BLOCK_SIZE
    per_head_tokens = per_head.num_blocks_for_budget(budget_bytes) * BLOCK_SIZE
    # --kv-cache-dtype int8 / fp8: 1-byte codes and a 2-byte scale per token of the latent and of the rope key.
    eight_bit = KVCacheLayout.for_model(config, tp, BLOCK_SIZE, torch.int8)
    eight_bit_tokens = eight_bit.num_blocks_for_budget(budget_bytes) * BLOCK_SIZE
    return {
        "tp": tp,
        "latent_elements_per_token_per_layer": latent.spec.elements_per_token,
        "per_head_elements_per_token_per_layer": per_head_spec.elements_per_token,
        "latent_bytes_per_token": latent.bytes_per_block // BLOCK_SIZE,
        "per_head_bytes_per_token": per_head.bytes_per_block // BLOCK_SIZE,
        "latent_tokens": latent_tokens,
        "per_head_tokens": per_head_tokens,
        "ratio": round(latent_tokens / per_head_tokens, 2),
        "latent_8_bit_bytes_per_token": eight_bit.bytes_per_block // BLOCK_SIZE,
        "latent_8_bit_tokens": eight_bit_tokens,
        "latent_8_bit_ratio": round(eight_bit_tokens / latent_tokens, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-gib", type=float, default=40.0, help="KV-cache memory per rank, GiB")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "mla_kv_capacity.json")
    args = parser.parse_args()
    budget = int(args.budget_gib * (1 << 30))
    results = {name: [capacity(raw, tp, budget) for tp in (1, 4 if raw["num_attention_heads"] % 8 else 8)]
               for name, raw in MODELS.items()}
    report = {"budget_bytes_per_rank": budget, "block_size": BLOCK_SIZE, "dtype": "bfloat16", "models": results}
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for name, rows in results.items():
        for row in rows:
            print(f"{name:18} tp={row['tp']}: latent {row['latent_elements_per_token_per_layer']:>5} vs per-head "
                  f"{row['per_head_elements_per_token_per_layer']:>6} numbers/token/layer -> "
                  f"{row['latent_tokens']:>10,} vs {row['per_head_tokens']:>9,} tokens ({row['ratio']}x); 8-bit latent "
                  f"{row['latent_8_bit_tokens']:>10,} ({row['latent_8_bit_ratio']}x the bfloat16 latent's)")


if __name__ == "__main__":
    main()
