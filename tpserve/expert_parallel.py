"""Start-up checks of ``--enable-expert-parallel`` (vLLM's flag) against a checkpoint's config.

With the flag, each rank of the tensor-parallel group holds ``num_experts / tp`` whole
experts of every mixture-of-experts layer (worker/layers/moe.py). These checks run in
the launcher before any rank starts, so that a combination the ranks cannot serve is
refused with one line naming the fields, as every other start-up refusal is.
"""

from __future__ import annotations

from tpserve.model_config import ModelConfig

#: The config keys families name their routed-expert count by, in the order the families
#: read them (Qwen: ``num_experts``, falling back to ``num_local_experts`` as
#: ``transformers`` 5 saves it; Mixtral, MiniMax-M2: ``num_local_experts``; DeepSeek, GLM-4.5:
#: ``n_routed_experts``; Ernie 4.5: ``moe_num_experts``).
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
#: Families whose experts are stored stacked in one tensor per layer and loaded by their own
#: tensor-parallel slicing (worker/layers/moe_stacked.py, worker/models/llama4.py), with the
#: reason: not split by whole experts yet.
NOT_EXPERT_PARALLEL = {
    "GptOssForCausalLM": "its stacked, biased experts are split tensor-parallel only",
    "Llama4ForCausalLM": "its fused expert tensors are split tensor-parallel only",
    "NemotronHForCausalLM": "its squared-ReLU experts are split tensor-parallel only",
}


def routed_experts(config: ModelConfig) -> tuple[str, int] | None:
    """``(key, count)`` of the model's routed experts, or None for a model without any (a dense model,
    or a MoE family's config with 0 experts: every layer dense)."""
    for key in EXPERT_COUNT_KEYS:
        count = config.hf_value(key, None, int)
        if count is not None:
            return (key, count) if count > 0 else None
    return None


def check_expert_parallel(config: ModelConfig, tensor_parallel_size: int, *, require_experts: bool = True) -> None:
    """Refuse ``--enable-expert-parallel`` where it cannot be served.

    With pipeline stages each stage splits its own layers' experts over its tensor-parallel
    group, so only ``tensor_parallel_size`` matters.

    Args:
        config: the checkpoint's config.
        tensor_parallel_size: the expert-parallel size (the experts are split over the tp group).
        require_experts: refuse a model without experts (False for a draft model, which may be dense).

    Raises:
        ValueError: one line naming the fields: no experts, or ``num_experts`` not divisible by
            ``tensor_parallel_size``.
    """
    if config.architecture in NOT_EXPERT_PARALLEL:
        raise ValueError(f"--enable-expert-parallel is not supported for {config.architecture}: "
                         f"{NOT_EXPERT_PARALLEL[config.architecture]}")
    experts = routed_experts(config)
    if experts is None:
        if require_experts:
            raise ValueError(f"--enable-expert-parallel needs a mixture-of-experts model; {config.architecture} "
                             f"has no routed experts ({' / '.join(EXPERT_COUNT_KEYS)} absent or 0)")
        return
    key, count = experts
    if count % tensor_parallel_size:
        raise ValueError(f"{key}={count} is not divisible by tensor_parallel_size={tensor_parallel_size} "
                         "(each rank holds num_experts / tensor_parallel_size whole experts)")
