"""``--enable-expert-parallel``'s start-up checks (tpserve/expert_parallel.py) and how the flag reaches a rank.

The flag goes CLI -> ``ParallelConfig.enable_expert_parallel`` -> the rank's JSON config
-> ``WorkerOptions`` -> ``ParallelContext`` (worker/server.py), like
``--tensor-parallel-size``. What ``tpserve serve`` prints for each refusal is in
tests/e2e/test_expert_parallel_serving.py.
"""

from __future__ import annotations

import pytest

from tpserve.cli import build_parser, serve_config
from tpserve.expert_parallel import check_expert_parallel, routed_experts
from tpserve.model_config import ModelConfig


def _config(architecture: str, model_type: str, **experts: object) -> ModelConfig:
    raw = {"model_type": model_type, "architectures": [architecture], "vocab_size": 128, "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, **experts}
    return ModelConfig.from_dict(raw)


MIXTRAL = _config("MixtralForCausalLM", "mixtral", num_local_experts=8, num_experts_per_tok=2)
QWEN3_MOE = _config("Qwen3MoeForCausalLM", "qwen3_moe", num_experts=12, num_experts_per_tok=2,
                    moe_intermediate_size=32)
LLAMA = _config("LlamaForCausalLM", "llama")


def test_the_expert_count_is_read_by_each_family_s_key() -> None:
    assert routed_experts(MIXTRAL) == ("num_local_experts", 8)
    assert routed_experts(QWEN3_MOE) == ("num_experts", 12)
    assert routed_experts(LLAMA) is None
    assert routed_experts(_config("Glm4MoeForCausalLM", "glm4_moe", n_routed_experts=16)) == ("n_routed_experts", 16)
    assert routed_experts(_config("Ernie4_5_MoeForCausalLM", "ernie4_5_moe", moe_num_experts=8)) == \
        ("moe_num_experts", 8)
    assert routed_experts(_config("Qwen2MoeForCausalLM", "qwen2_moe", num_experts=0)) is None  # every layer dense


def test_divisible_expert_counts_are_accepted() -> None:
    for tp in (1, 2, 4, 8):
        check_expert_parallel(MIXTRAL, tp)
    check_expert_parallel(QWEN3_MOE, 4)
    check_expert_parallel(QWEN3_MOE, 6)
    check_expert_parallel(LLAMA, 2, require_experts=False)  # a dense draft model beside a MoE target


@pytest.mark.parametrize(("config", "tp", "message"), [
    (QWEN3_MOE, 8, "num_experts=12 is not divisible by tensor_parallel_size=8 (each rank holds "
                      "num_experts / tensor_parallel_size whole experts)"),
    (MIXTRAL, 3, "num_local_experts=8 is not divisible by tensor_parallel_size=3"),
    (LLAMA, 2, "--enable-expert-parallel needs a mixture-of-experts model; LlamaForCausalLM has no routed experts"),
    (_config("GptOssForCausalLM", "gpt_oss", num_local_experts=8, num_experts_per_tok=2), 2,
     "--enable-expert-parallel is not supported for GptOssForCausalLM: its stacked, biased experts are split "
     "tensor-parallel only"),
    (_config("Llama4ForCausalLM", "llama4_text", num_local_experts=4, num_experts_per_tok=1), 2,
     "--enable-expert-parallel is not supported for Llama4ForCausalLM"),
    # Refused before any rank starts (a rank's refusal came once per rank, after loading, exit code 1)
    (_config("NemotronHForCausalLM", "nemotron_h", n_routed_experts=8, num_experts_per_tok=2,
             hybrid_override_pattern="*E"), 2,
     "--enable-expert-parallel is not supported for NemotronHForCausalLM: its squared-ReLU experts"),
])
def test_unservable_combinations_are_refused_in_one_line(config: ModelConfig, tp: int, message: str) -> None:
    with pytest.raises(ValueError) as error:
        check_expert_parallel(config, tp)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_the_flag_reaches_the_rank() -> None:
    from launch.local_ranks import LocalRanks
    from launch.topology import GroupLayout
    from tpserve.config import RankConfig
    from tpserve.embedded_model import default_model_dir
    from worker.main import worker_options

    for argv, expected in ((["--enable-expert-parallel"], True), ([], False)):
        config = serve_config(build_parser().parse_args(["serve", "--tensor-parallel-size", "2", *argv]))
        assert config.parallel.enable_expert_parallel is expected
        ranks = LocalRanks(config, default_model_dir(), GroupLayout(config.parallel.world_size), "json")
        sent = RankConfig.from_json(ranks.rank_config(1, "unix:///x", "file:///y").to_json())
        assert worker_options(sent).enable_expert_parallel is expected
