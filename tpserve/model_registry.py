"""Which model families tpserve serves: a checkpoint's ``architectures`` name -> the worker class.

The table is plain strings, so this module imports no torch: the coordinator
reads it at start-up to refuse an unknown architecture before starting any
worker (tpserve/model_config.py), and each worker imports the named class
(worker/models/__init__.py) to build its shard.

A family is one file ``worker/models/<family>.py`` holding its ``*ForCausalLM``
class, and one line here per ``architectures`` name it serves (docs/design/models.md,
"Model families: the registry"). The class states its own weight mapping and reads its
own config keys; see worker/models/__init__.py for the contract.
"""

from __future__ import annotations

from collections.abc import Sequence

#: ``architectures`` name in config.json -> ``"module:Class"`` of the worker's model.
MODEL_REGISTRY: dict[str, str] = {
    "CohereForCausalLM": "worker.models.cohere:CohereForCausalLM",
    "DeepseekV3ForCausalLM": "worker.models.deepseek_v3:DeepseekV3ForCausalLM",
    "Exaone4ForCausalLM": "worker.models.exaone4:Exaone4ForCausalLM",
    "Gemma2ForCausalLM": "worker.models.gemma2:Gemma2ForCausalLM",
    "Glm4MoeLiteForCausalLM": "worker.models.glm4_moe_lite:Glm4MoeLiteForCausalLM",
    "Gemma3ForCausalLM": "worker.models.gemma3:Gemma3ForCausalLM",
    "GptOssForCausalLM": "worker.models.gpt_oss:GptOssForCausalLM",
    "Glm4MoeForCausalLM": "worker.models.glm4_moe:Glm4MoeForCausalLM",
    "MiniMaxM2ForCausalLM": "worker.models.minimax_m2:MiniMaxM2ForCausalLM",
    "Ernie4_5_MoeForCausalLM": "worker.models.ernie4_5_moe:Ernie4_5_MoeForCausalLM",
    "GraniteForCausalLM": "worker.models.granite:GraniteForCausalLM",
    "GraniteMoeHybridForCausalLM": "worker.models.granite_moe_hybrid:GraniteMoeHybridForCausalLM",
    "LlamaForCausalLM": "worker.models.llama:LlamaForCausalLM",
    "Llama4ForCausalLM": "worker.models.llama4:Llama4ForCausalLM",
    "MistralForCausalLM": "worker.models.llama:MistralForCausalLM",
    "MixtralForCausalLM": "worker.models.mixtral:MixtralForCausalLM",
    "NemotronHForCausalLM": "worker.models.nemotron_h:NemotronHForCausalLM",
    "Olmo2ForCausalLM": "worker.models.olmo2:Olmo2ForCausalLM",
    "Olmo3ForCausalLM": "worker.models.olmo3:Olmo3ForCausalLM",
    "Qwen2ForCausalLM": "worker.models.llama:Qwen2ForCausalLM",
    "Qwen2MoeForCausalLM": "worker.models.qwen2_moe:Qwen2MoeForCausalLM",
    "Phi3ForCausalLM": "worker.models.phi3:Phi3ForCausalLM",
    "Lfm2ForCausalLM": "worker.models.lfm2:Lfm2ForCausalLM",
    "Qwen3ForCausalLM": "worker.models.qwen3:Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM": "worker.models.qwen3_moe:Qwen3MoeForCausalLM",
    "Qwen3NextForCausalLM": "worker.models.qwen3_next:Qwen3NextForCausalLM",
    "Qwen3_5ForCausalLM": "worker.models.qwen3_5:Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM": "worker.models.qwen3_5:Qwen3_5MoeForCausalLM",
    "SmolLM3ForCausalLM": "worker.models.smollm3:SmolLM3ForCausalLM",
    "Starcoder2ForCausalLM": "worker.models.starcoder2:Starcoder2ForCausalLM",
}

#: Architectures whose attention is multi-head latent attention (DeepSeek-V2 paper, arXiv:2405.04434): their
#: KV cache holds one compressed latent and one shared RoPE key per token, not per-head keys and values
#: (:meth:`tpserve.model_config.ModelConfig.kv_cache_spec`). Kimi K2 checkpoints name DeepseekV3ForCausalLM;
#: GLM-4.7-Flash's Glm4MoeLiteForCausalLM is DeepSeek V3's attention with GLM's MoE layer pattern.
LATENT_ATTENTION_ARCHITECTURES = frozenset({"DeepseekV3ForCausalLM", "Glm4MoeLiteForCausalLM"})

#: Architectures whose weights load float only (their Mamba-2 mixers and stacked experts have no quantized layer
#: yet): ``--quantization`` and a checkpoint stored quantized are refused by the coordinator (launch/startup.py),
#: before any rank builds the model (which refuses them too).
FLOAT_ONLY_ARCHITECTURES = frozenset({"GraniteMoeHybridForCausalLM", "NemotronHForCausalLM"})

#: Architectures whose routed experts int8 and int4 weights cannot fill, with the checkpoint layout a refusal names:
#: their experts load into float stacks only (gpt-oss's MXFP4 experts as 8-bit codes on CPU ranks, without
#: ``--quantization``). ``--quantization int8`` / ``int4`` and a packed 4- or 8-bit checkpoint of them are refused by
#: the coordinator (launch/startup.py) before any rank starts, as each rank's experts refuse them
#: (worker/layers/moe_int8.py ``check_loadable``, from the classes' ``checkpoint_layout``).
FLOAT_EXPERTS_ARCHITECTURES: dict[str, str] = {"GptOssForCausalLM": "gpt-oss's stacked experts with biases",
                                               "Llama4ForCausalLM": "Llama 4's fused expert tensors"}

#: Hybrid architectures: Gated DeltaNet (linear attention, a per-sequence state; worker/layers/gated_delta_net.py)
#: layers beside full-attention ones, as ``layer_types`` says (``"linear_attention"`` / ``"full_attention"``).
LINEAR_ATTENTION_ARCHITECTURES = frozenset({"Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"})

#: Architectures whose ``transformers`` config class defaults ``tie_word_embeddings`` to True
#: (Gemma2Config, Gemma3TextConfig, CohereConfig, Ernie4_5_MoeConfig, Lfm2Config, SmolLM3Config, Starcoder2Config);
#: every other family's defaults to False.
TIED_BY_DEFAULT = frozenset({"CohereForCausalLM", "Ernie4_5_MoeForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
                             "Lfm2ForCausalLM", "SmolLM3ForCausalLM", "Starcoder2ForCausalLM"})


#: Architectures whose ``transformers`` model never ties its LM head to the embedding, whatever
#: ``tie_word_embeddings`` says (NemotronHForCausalLM's ``_tied_weights_keys`` is empty): the head is the
#: checkpoint's ``lm_head.weight``.
NEVER_TIED = frozenset({"NemotronHForCausalLM"})

#: How each architecture that reads ``sliding_window`` applies it, as its ``transformers`` config and model do,
#: and the window its config class assumes where config.json has no ``sliding_window`` key (an explicit null
#: is no window); every other family ignores the key (DeepSeek V3, GLM-4.5, MiniMax-M2, ERNIE 4.5, Llama,
#: Nemotron-H, ...: their configs may carry it, their attention never reads it), and so do we. Rules:
#:
#: - ``"all"``: every layer slides;
#: - ``"qwen2"``: only with ``use_sliding_window`` (default false), layers from ``max_window_layers`` (default 28) on;
#: - ``"qwen2_moe"``: only with ``use_sliding_window``, even-numbered layers (0, 2, ..) below ``max_window_layers``;
#: - ``"qwen3_moe"``: only with ``use_sliding_window``, every layer (Qwen3MoeConfig has no ``max_window_layers``);
#: - ``"smollm3"``: only with ``use_sliding_window``, the layers without RoPE (``no_rope_layers[i] == 0``);
#: - ``"alternate"``: ``layer_types``, else even-numbered layers (0, 2, ..) slide (GptOssConfig's, Gemma2Config's default);
#: - ``"layer_types"``: the layers ``layer_types`` (or the family's default pattern, its model file) names.
#:
#: An explicit ``layer_types`` in config.json is followed by every rule but ``"all"`` and ``"qwen3_moe"``.
SLIDING_WINDOW_RULES: dict[str, tuple[str, int | None]] = {
    "MistralForCausalLM": ("all", 4096), "MixtralForCausalLM": ("all", None), "Phi3ForCausalLM": ("all", None),
    "Starcoder2ForCausalLM": ("all", None),
    "Qwen2ForCausalLM": ("qwen2", 4096), "Qwen3ForCausalLM": ("qwen2", 4096), "Qwen2MoeForCausalLM": ("qwen2_moe", 4096),
    "Qwen3MoeForCausalLM": ("qwen3_moe", 4096), "SmolLM3ForCausalLM": ("smollm3", None),
    "Gemma2ForCausalLM": ("alternate", 4096), "Gemma3ForCausalLM": ("layer_types", 4096),
    "GptOssForCausalLM": ("alternate", 128), "Olmo3ForCausalLM": ("layer_types", 4096),
    "Exaone4ForCausalLM": ("layer_types", 4096),
}


#: Architectures that rotate only the first ``rotary_dim`` dimensions of each head (partial RoPE,
#: worker/layers/partial_rotary.py), with their ``transformers`` default ``partial_rotary_factor``;
#: every other family refuses a factor below 1 at start-up.
PARTIAL_ROTARY_DEFAULTS: dict[str, float] = {"Glm4MoeForCausalLM": 0.5, "MiniMaxM2ForCausalLM": 1.0,
                                             "Qwen3NextForCausalLM": 0.25, "Qwen3_5ForCausalLM": 0.25,
                                             "Qwen3_5MoeForCausalLM": 0.25}
#: (Gemma2Config, Gemma3TextConfig, CohereConfig, Starcoder2Config); every other family's defaults to False.
def ties_word_embeddings_by_default(architecture: str) -> bool:
    """Whether ``architecture``'s LM head shares the embedding when config.json does not say."""
    return architecture in TIED_BY_DEFAULT


def supported_architectures() -> tuple[str, ...]:
    """Every ``architectures`` name tpserve serves, sorted."""
    return tuple(sorted(MODEL_REGISTRY))


def resolve_architecture(architectures: Sequence[str]) -> str:
    """The first of a config's ``architectures`` that tpserve serves.

    Args:
        architectures: the ``architectures`` list of config.json (e.g. ``["LlamaForCausalLM"]``).

    Raises:
        ValueError: none is served (or the list is empty); the message names them and
            lists the supported architectures.
    """
    for name in architectures:
        if name in MODEL_REGISTRY:
            return name
    named = ", ".join(architectures) if architectures else "none (config.json has no 'architectures')"
    raise ValueError(f"architecture {named} is not supported; supported: {', '.join(supported_architectures())}")


def model_class_path(architecture: str) -> tuple[str, str]:
    """``(module, class name)`` of ``architecture``'s worker model.

    Raises:
        ValueError: ``architecture`` is not in :data:`MODEL_REGISTRY`.
    """
    target = MODEL_REGISTRY.get(resolve_architecture([architecture]))
    module, _, name = target.partition(":")  # type: ignore[union-attr]
    return module, name
