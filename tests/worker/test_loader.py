"""Checkpoint loading: layouts, tied heads, and errors that name the offending weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.worker.loader_helpers import _load, _rewrite
from tpserve.model_config import ModelConfig
from worker.loader import checkpoint_files


def test_sharded_checkpoint_is_read_through_its_index(tiny_checkpoints: dict[str, Path]) -> None:
    files = checkpoint_files(tiny_checkpoints["sharded_linear_rope"])
    assert len(set(files.values())) > 1
    model = _load(tiny_checkpoints["sharded_linear_rope"])
    reference = load_file(files["model.layers.1.mlp.down_proj.weight"])["model.layers.1.mlp.down_proj.weight"]
    torch.testing.assert_close(model.model.layers[1].mlp.down_proj.weight, reference)


def test_missing_weight_is_named(tiny_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    broken = _rewrite(tiny_checkpoints["gqa_tied"], tmp_path / "m",
                      lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match=r"missing weights: \['model.layers.1.self_attn.k_proj.weight'\]"):
        _load(broken)


def test_unexpected_weight_is_named(tiny_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    def add(tensors: dict) -> None:
        tensors["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)

    broken = _rewrite(tiny_checkpoints["gqa_tied"], tmp_path / "m", add)
    with pytest.raises(ValueError, match=r"does not use: \['model.layers.0.self_attn.q_norm.weight'\]"):
        _load(broken)


def test_misshaped_weight_is_named(tiny_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    def shrink(tensors: dict) -> None:
        tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"][:-1]

    broken = _rewrite(tiny_checkpoints["gqa_tied"], tmp_path / "m", shrink)
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.up_proj.weight'.*shape \[127, 64\]"):
        _load(broken)


def test_rotary_inv_freq_buffers_are_skipped(tiny_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    def add(tensors: dict) -> None:
        tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)

    _load(_rewrite(tiny_checkpoints["gqa_tied"], tmp_path / "m", add))


def test_untied_model_without_lm_head_is_refused_naming_it(tiny_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """It was served tied (the embedding as its head): another model's logits, silently."""
    source = tiny_checkpoints["mqa_untied_bias"]
    assert not ModelConfig.from_pretrained(source).tie_word_embeddings
    untied = _load(source)
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight
    headless = _rewrite(source, tmp_path / "m", lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ValueError, match=r"tie_word_embeddings=false but the checkpoint has no lm_head.weight"):
        _load(headless)


def test_tied_checkpoint_has_no_separate_head(tiny_checkpoints: dict[str, Path]) -> None:
    assert "lm_head.weight" not in checkpoint_files(tiny_checkpoints["gqa_tied"])
    model = _load(tiny_checkpoints["gqa_tied"])
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_no_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        checkpoint_files(tmp_path)
