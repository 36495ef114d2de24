"""One tiny seeded checkpoint of every registered family, by name: the ones the worker-level family tests
check (tests/worker/test_*), gathered for the tests that run each family once more (served end to end:
tests/e2e/test_every_family_serving.py; with an 8-bit KV cache: tests/worker/test_kv_cache_dtype.py).
"""

from __future__ import annotations

from tests.tiny_models import TINY_MODELS, TinyModelSpec

#: Every family's checkpoint name (dense, sliding-window, RoPE-scaled, mixture-of-experts, attention sinks,
#: partial RoPE, multi-head latent attention, hybrid state layers).
FAMILIES = ("qwen3_qk_norm", "phi3_fused", "mistral_window", "qwen2_window", "phi3_window", "gemma2", "gemma3",
            "llama_yarn", "llama_dynamic", "mixtral", "qwen3_moe", "qwen2_moe", "gpt_oss", "glm4_moe", "minimax_m2",
            "ernie4_5_moe", "granite", "cohere", "starcoder2", "llama4", "olmo2", "olmo3", "smollm3", "exaone4",
            "dsv3_q_lora", "dsv3_yarn", "dsv3_moe", "glm4_moe_lite", "lfm2", "granite4_hybrid_moe", "nemotron_h",
            "qwen3_next", "qwen3_5", "qwen3_5_moe")


def family_specs() -> dict[str, TinyModelSpec]:
    """Every tiny checkpoint of the family tests, by name."""
    import importlib

    from tests.worker import family_check

    specs = {spec.name: spec for spec in TINY_MODELS}
    for module in ("test_gemma2", "test_gemma3", "test_sliding_window_models", "test_rope_scaling_models",
                   "test_gpt_oss", "test_granite", "test_cohere", "test_starcoder2", "test_llama4", "test_olmo2",
                   "test_olmo3", "test_smollm3", "test_exaone4", "test_lfm2", "test_granite_moe_hybrid",
                   "test_nemotron_h", "test_qwen3_next"):
        importlib.import_module(f"tests.worker.{module}")  # each registers its checkpoints
    specs.update({name: spec for name, (spec, _window) in family_check._REGISTERED.items()})
    for module in ("test_mixtral", "test_qwen3_moe", "test_qwen2_moe", "test_glm4_moe", "test_minimax_m2",
                   "test_ernie4_5_moe"):
        spec = importlib.import_module(f"tests.worker.{module}").SPEC
        specs[spec.name] = spec
    from tests.worker import deepseek_v3_specs

    specs.update({spec.name: spec for spec in (deepseek_v3_specs.Q_LORA, deepseek_v3_specs.YARN,
                                               deepseek_v3_specs.MOE, deepseek_v3_specs.GLM4_MOE_LITE)})
    return specs
