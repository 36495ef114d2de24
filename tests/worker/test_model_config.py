"""ModelConfig: parsing Hugging Face config.json files and tensor-parallel split checks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tpserve.model_config import ModelConfig, _parse_attention_windows


def _llama(**overrides: object) -> dict:
    raw = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 172,
        "num_hidden_layers": 5,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
    }
    raw.update(overrides)
    return {k: v for k, v in raw.items() if v is not None}


def test_parses_stories260k(stories_dir: Path) -> None:
    config = ModelConfig.from_pretrained(stories_dir)
    assert config.model_type == "llama"
    assert config.architecture == "LlamaForCausalLM" and config.architectures == ("LlamaForCausalLM",)
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (512, 64, 172)
    assert (config.num_hidden_layers, config.total_num_heads, config.total_num_kv_heads) == (5, 8, 4)
    assert config.head_dim == 8
    assert config.rms_norm_eps == 1e-5 and config.rope_theta == 10000.0 and config.rope_scaling is None
    assert config.max_position_embeddings == 512
    assert config.tie_word_embeddings is True
    assert config.hidden_act == "silu"
    assert config.sliding_window is None and config.layer_types == ("full_attention",) * 5
    assert config.hf_config["model_type"] == "llama"
    assert config.bos_token_id == 1 and config.eos_token_ids == (2,)
    assert config.torch_dtype == "float32"


def test_parses_transformers5_layout_from_disk(tiny_checkpoints: dict[str, Path]) -> None:
    config = ModelConfig.from_pretrained(tiny_checkpoints["llama3_rope"])
    assert config.head_dim == 32  # explicit head_dim, not hidden / heads = 16
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    qwen = ModelConfig.from_pretrained(tiny_checkpoints["qwen2_qkv_bias"])
    assert qwen.architecture == "Qwen2ForCausalLM" and qwen.rope_theta == 1000000.0
    assert qwen.sliding_window is None  # transformers writes use_sliding_window: false
    llama_bias = ModelConfig.from_pretrained(tiny_checkpoints["mqa_untied_bias"])
    assert llama_bias.hf_value("attention_bias", False) is True and llama_bias.hf_value("mlp_bias", False) is True
    assert llama_bias.tie_word_embeddings is False and llama_bias.total_num_kv_heads == 1


def test_parses_transformers4_rope_scaling_and_defaults() -> None:
    raw = _llama(rope_theta=500000.0, num_key_value_heads=None, eos_token_id=[128001, 128009],
                 torch_dtype="bfloat16",
                 rope_scaling={"type": "linear", "factor": 4})
    config = ModelConfig.from_dict(raw)
    assert config.total_num_kv_heads == 8  # defaults to num_attention_heads
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert config.eos_token_ids == (128001, 128009)
    assert config.torch_dtype == "bfloat16"
    llama3 = ModelConfig.from_dict(_llama(rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}))
    # transformers falls back to max_position_embeddings when the original length is absent
    assert llama3.rope_scaling["original_max_position_embeddings"] == 512
    assert ModelConfig.from_dict(_llama(rope_scaling={"rope_type": "default"})).rope_scaling is None


def test_from_pretrained_reads_config_json(tmp_path: Path) -> None:
    raw = _llama(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=None)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    config = ModelConfig.from_pretrained(tmp_path)
    assert (config.model_type, config.architecture) == ("mistral", "MistralForCausalLM")


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ({"model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"]},
         ["GPTNeoXForCausalLM", "is not supported", "LlamaForCausalLM", "Qwen2ForCausalLM"]),
        ({"architectures": None}, ["no 'architectures'"]),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, ["rope_type='longrope'"]),
        ({"rope_scaling": {"rope_type": "dynamic"}}, ["dynamic", "factor"]),
        ({"partial_rotary_factor": 0.75}, ["partial_rotary_factor=0.75"]),  # Phi-4-mini's place for it
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, ["llama3", "low_freq_factor"]),
        ({"sliding_window": 0, "architectures": ["MistralForCausalLM"]}, ["sliding_window=0"]),
        ({"layer_types": ["full_attention"] * 4}, ["layer_types", "num_hidden_layers=5", "got 4"]),
        ({"layer_types": ["linear_attention"] * 5}, ["'linear_attention'"]),
        ({"vocab_size": None}, ["vocab_size"]),
    ],
)
def test_refuses_unsupported_configs(overrides: dict, words: list[str]) -> None:
    with pytest.raises(ValueError) as error:
        ModelConfig.from_dict(_llama(**overrides))
    for word in words:
        assert word in str(error.value)


def test_mistral_with_window_covering_every_position_is_full_attention() -> None:
    config = ModelConfig.from_dict(_llama(model_type="mistral", sliding_window=512))
    assert config.sliding_window is None and set(config.layer_types) == {"full_attention"}


def test_sliding_windows_per_layer_follow_transformers_defaults() -> None:
    """Mistral: every layer slides; Qwen2 without ``layer_types``: layers from ``max_window_layers`` on."""
    mistral = ModelConfig.from_dict(_llama(model_type="mistral", architectures=["MistralForCausalLM"],
                                           sliding_window=16))
    assert [mistral.layer_sliding_window(i) for i in range(5)] == [16] * 5
    qwen = ModelConfig.from_dict(_llama(model_type="qwen2", architectures=["Qwen2ForCausalLM"], sliding_window=8,
                                        use_sliding_window=True, max_window_layers=3))
    assert [qwen.layer_sliding_window(i) for i in range(5)] == [None, None, None, 8, 8]
    listed = ModelConfig.from_dict(_llama(architectures=["Qwen2ForCausalLM"], sliding_window=8, use_sliding_window=True,
                                          layer_types=["sliding_attention", "full_attention"] * 2 + ["sliding_attention"]))
    assert [listed.layer_sliding_window(i) for i in range(5)] == [8, None, 8, None, 8]


@pytest.mark.parametrize(("architecture", "extra", "want"), [
    # Qwen3-MoE: every layer once switched on; max_window_layers is Qwen2's and Qwen3's key, not its own
    ("Qwen3MoeForCausalLM", dict(use_sliding_window=True, max_window_layers=1), [8] * 5),
    ("Qwen3MoeForCausalLM", {}, [None] * 5),  # use_sliding_window absent: Qwen3MoeConfig's default is off
    ("Qwen2ForCausalLM", {}, [None] * 5),
    ("Qwen2MoeForCausalLM", dict(use_sliding_window=True, max_window_layers=4), [8, None, 8, None, None]),
    ("SmolLM3ForCausalLM", dict(use_sliding_window=True, no_rope_layers=[1, 1, 0, 1, 0]), [None, None, 8, None, 8]),
    ("SmolLM3ForCausalLM", dict(no_rope_layers=[1, 1, 0, 1, 0]), [None] * 5),
    # Families whose attention never reads the key: a converted config that carries it changes nothing
    ("DeepseekV3ForCausalLM", {}, [None] * 5), ("Glm4MoeForCausalLM", {}, [None] * 5),
    ("MiniMaxM2ForCausalLM", {}, [None] * 5), ("Ernie4_5_MoeForCausalLM", {}, [None] * 5),
    ("LlamaForCausalLM", dict(layer_types=["sliding_attention"] * 5), [None] * 5),
    ("Phi3ForCausalLM", {}, [8] * 5), ("MistralForCausalLM", {}, [8] * 5),
    # gpt-oss and Gemma 2 without layer_types: GptOssConfig's / Gemma2Config's alternation, local first (a fresh
    # user's check: gpt-oss slid every layer); an explicit layer_types is followed
    ("GptOssForCausalLM", {}, [8, None, 8, None, 8]), ("Gemma2ForCausalLM", {}, [8, None, 8, None, 8]),
    ("GptOssForCausalLM", dict(layer_types=["full_attention"] * 4 + ["sliding_attention"]), [None] * 4 + [8]),
])
def test_a_sliding_window_applies_where_transformers_applies_it(architecture: str, extra: dict, want: list) -> None:
    """The probe's faults: Qwen3-MoE windowed by Qwen2's max_window_layers rule, or with use_sliding_window absent,
    and families with no sliding window (DeepSeek V3, GLM-4.5, MiniMax-M2, ERNIE 4.5) windowing every layer when
    their config carried the key: tokens differed from transformers' from the first one. The rules are
    transformers' config classes' (tpserve/model_registry.py SLIDING_WINDOW_RULES)."""
    assert _windows(architecture, {**_llama(), "sliding_window": 8, **extra}) == want


def test_a_family_window_default_applies_where_config_json_has_no_key() -> None:
    """MistralConfig's 4096 (as transformers loads a config without the key); an explicit null is no window."""
    assert _windows("MistralForCausalLM", _llama(max_position_embeddings=8192)) == [4096] * 5
    assert _windows("MistralForCausalLM", {**_llama(max_position_embeddings=8192), "sliding_window": None}) == [None] * 5


def _windows(architecture: str, raw: dict) -> list[int | None]:
    """Each layer's window as ``architecture`` reads ``raw`` (the parser alone: the families' other keys aside)."""
    window, layer_types = _parse_attention_windows(raw, raw["num_hidden_layers"], raw["max_position_embeddings"],
                                                   architecture=architecture)
    return [window if layer_type == "sliding_attention" else None for layer_type in layer_types]


def test_rope_nested_by_layer_type_is_kept_per_type() -> None:
    """Gemma 3 (transformers 5): a local base for sliding layers, a scaled global one for full layers."""
    config = ModelConfig.from_dict(_llama(rope_theta=None, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}))
    assert config.layer_rope("sliding_attention") == (10000.0, None)
    assert config.layer_rope("full_attention") == (1000000.0, {"rope_type": "linear", "factor": 8.0})
    assert (config.rope_theta, config.rope_scaling) == config.layer_rope("full_attention")



@pytest.mark.parametrize(("model_type", "architecture"), [("llama", "LlamaForCausalLM"),
                                                          ("qwen3_moe", "Qwen3MoeForCausalLM"),
                                                          ("deepseek_v3", "DeepseekV3ForCausalLM")])
def test_rope_scaling_added_beside_rope_parameters_is_read_as_transformers_reads_it(
        tmp_path: Path, model_type: str, architecture: str) -> None:
    """A transformers-5 config (``rope_parameters``) with ``rope_scaling`` added, as Qwen's model cards enable
    YaRN: transformers reads ``rope_scaling`` whole (its base too: the top-level one, else 10000); reading
    ``rope_parameters`` first served plain RoPE, and let a ``longrope`` there through."""
    from transformers import AutoConfig

    AutoConfig.for_model(model_type, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                         max_position_embeddings=128, architectures=[architecture]).save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    for extra in ({}, {"rope_theta": 5e5}):
        edited = {**raw, **extra, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                   "original_max_position_embeddings": 32}}
        (tmp_path / "config.json").write_text(json.dumps(edited))
        reference = AutoConfig.from_pretrained(tmp_path).rope_parameters
        config = ModelConfig.from_pretrained(tmp_path)
        assert reference["rope_type"] == "yarn" and config.rope_theta == reference["rope_theta"]
        assert config.rope_theta == extra.get("rope_theta", 10000.0)
        assert config.rope_scaling is not None and config.rope_scaling["rope_type"] == "yarn"
        assert (config.rope_scaling["factor"], config.rope_scaling["original_max_position_embeddings"]) == (4.0, 32)
    (tmp_path / "config.json").write_text(json.dumps({**raw, "rope_scaling": {"rope_type": "longrope",
                                                                                "factor": 4.0}}))
    with pytest.raises(ValueError, match="rope_type='longrope' is not supported"):
        ModelConfig.from_pretrained(tmp_path)

def test_a_window_switched_off_is_full_attention() -> None:
    """Qwen2.5 checkpoints store a window with ``use_sliding_window: false``: not a sliding model."""
    config = ModelConfig.from_dict(_llama(model_type="qwen2", architectures=["Qwen2ForCausalLM"],
                                          sliding_window=128, use_sliding_window=False))
    assert config.sliding_window is None


def test_hf_value_reads_family_keys_with_their_types() -> None:
    config = ModelConfig.from_dict(_llama(attention_bias=True, partial_factor=1, name="x"))
    assert config.hf_value("attention_bias", False) is True
    assert config.hf_value("mlp_bias", False) is False  # absent: the default
    assert config.hf_value("name", None) == "x" and config.hf_value("absent", None) is None  # unchecked
    assert config.hf_value("partial_factor", 0.5) == 1.0 and isinstance(config.hf_value("partial_factor", 0.5), float)
    with pytest.raises(ValueError, match=r"config.json name='x' must be of type bool"):
        config.hf_value("name", False)
    with pytest.raises(ValueError, match=r"attention_bias=True must be of type int"):
        config.hf_value("attention_bias", 0)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_check_tensor_parallel_accepts_even_splits(tp: int) -> None:
    ModelConfig.from_dict(_llama(intermediate_size=256)).check_tensor_parallel(tp)


def test_check_tensor_parallel_accepts_replicated_kv_heads() -> None:
    ModelConfig.from_dict(_llama(intermediate_size=256, num_key_value_heads=2)).check_tensor_parallel(8)
    ModelConfig.from_dict(_llama(intermediate_size=256, num_key_value_heads=1)).check_tensor_parallel(4)


@pytest.mark.parametrize(
    ("overrides", "tp", "message"),
    [
        ({}, 3, "num_attention_heads=8 is not divisible by tensor_parallel_size=3"),
        ({}, 8, "intermediate_size=172 is not divisible by tensor_parallel_size=8"),
        ({"num_attention_heads": 12, "num_key_value_heads": 6, "intermediate_size": 192}, 4,
         "num_key_value_heads=6 is not divisible by tensor_parallel_size=4"),
        ({"num_attention_heads": 12, "num_key_value_heads": 4, "intermediate_size": 192}, 6,
         "tensor_parallel_size=6 is larger than num_key_value_heads=4 but not a multiple of it"),
        ({}, 0, "tensor_parallel_size must be >= 1"),
    ],
)
def test_check_tensor_parallel_names_the_dimension(overrides: dict, tp: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(_llama(**overrides)).check_tensor_parallel(tp)


def test_kv_cache_sizing_helpers() -> None:
    config = ModelConfig.from_dict(_llama())  # 5 layers, 4 KV heads of 8
    assert config.kv_cache_bytes_per_token(tp=1, dtype_size=4) == 2 * 5 * 4 * 8 * 4
    assert config.kv_cache_bytes_per_token(tp=2, dtype_size=2) == 2 * 5 * 2 * 8 * 2
    assert config.kv_cache_bytes_per_token(tp=8, dtype_size=2) == 2 * 5 * 1 * 8 * 2  # replicated head
    assert config.padded_vocab_size(3) == 513 and config.padded_vocab_size(4) == 512


def test_module_imports_no_torch() -> None:
    """The coordinator imports ModelConfig and must stay torch-free."""
    code = "import sys, tpserve.model_config; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])
