"""The model registry: architecture names to worker classes, family config and weight mapping."""

from __future__ import annotations

import dataclasses

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.e2e.cluster import free_port
from tpserve.model_config import ModelConfig
from tpserve.model_registry import MODEL_REGISTRY, resolve_architecture, supported_architectures
from worker.models import model_class
from worker.models.base import CausalLM
from worker.models.llama import Biases, LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM
from worker.parallel_state import ParallelContext

ROOT = Path(__file__).resolve().parents[2]


def _config(architecture: str = "LlamaForCausalLM", **overrides: object) -> ModelConfig:
    raw = {"architectures": [architecture], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
    return ModelConfig.from_dict({**raw, **overrides})


@pytest.mark.parametrize("architecture", sorted(MODEL_REGISTRY))
def test_every_registered_class_imports_and_is_a_causal_lm(architecture: str) -> None:
    cls = model_class(architecture)
    assert issubclass(cls, CausalLM) and cls.__name__ == architecture


def test_first_served_architecture_wins_and_unknown_ones_are_named() -> None:
    assert resolve_architecture(["FooForCausalLM", "Qwen2ForCausalLM"]) == "Qwen2ForCausalLM"
    with pytest.raises(ValueError, match="architecture GPTNeoXForCausalLM is not supported; supported: ") as error:
        model_class("GPTNeoXForCausalLM")
    assert all(name in str(error.value) for name in supported_architectures())


def test_each_llama_family_states_its_biases() -> None:
    assert LlamaForCausalLM.biases(_config()) == Biases()
    assert LlamaForCausalLM.biases(_config(attention_bias=True, mlp_bias=True)) == Biases(True, True, True)
    assert MistralForCausalLM.biases(_config("MistralForCausalLM", attention_bias=True)) == Biases()
    assert Qwen2ForCausalLM.biases(_config("Qwen2ForCausalLM")) == Biases(qkv=True)
    with pytest.raises(ValueError, match="attention_bias='yes' must be of type bool"):
        LlamaForCausalLM.biases(_config(attention_bias="yes"))


def test_the_family_refuses_its_unsupported_activation_before_any_weight() -> None:
    """The rank's own check, behind the coordinator's (tests/worker/test_model_config_rules.py ``llama-gelu``)."""
    config = dataclasses.replace(_config(), hidden_act="gelu")
    with pytest.raises(ValueError, match="hidden_act='gelu' is not supported by LlamaForCausalLM"):
        LlamaForCausalLM(config, ParallelContext.single("meta"), torch.float32, tie_word_embeddings=True)


def test_llama_weight_map_stacks_qkv_and_gate_up_and_inverts() -> None:
    model = Qwen2ForCausalLM(_config("Qwen2ForCausalLM"), ParallelContext.single("meta"), torch.float32,
                             tie_word_embeddings=False)
    params = dict(model.named_parameters())
    cases = {
        "model.layers.1.self_attn.k_proj.bias": ("model.layers.1.self_attn.qkv_proj.bias", "k"),
        "model.layers.0.mlp.up_proj.weight": ("model.layers.0.mlp.gate_up_proj.weight", 1),
        "model.layers.0.mlp.down_proj.weight": ("model.layers.0.mlp.down_proj.weight", None),
        "lm_head.weight": ("lm_head.weight", None),
    }
    for name, target in cases.items():
        assert model.weight_map(name) == target
        assert target[0] in params and target[1] in params[target[0]].shard_ids
        assert model.checkpoint_name(*target) == name
    assert model.weight_map("model.layers.0.self_attn.rotary_emb.inv_freq") is None


def test_serve_refuses_an_unknown_architecture_in_one_line(tmp_path: Path) -> None:
    config = {"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", "vocab_size": 64,
              "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "max_position_embeddings": 64}
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = subprocess.run([sys.executable, "-m", "launch.cli", "serve", "--model", str(tmp_path),
                          "--port", str(free_port())], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert "GPTNeoXForCausalLM is not supported" in lines[0] and "LlamaForCausalLM" in lines[0], lines[0]
