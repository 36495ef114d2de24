"""Tiny seeded PEFT LoRA adapters built with ``peft``, and the reference: ``peft``'s merged model in ``transformers``.

The adapters' ``B`` matrices are random and non-zero (peft initialises ``B`` to zero, an
adapter that changes nothing), so every adapted projection moves the logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tests.tiny_models import load_hf_model


@dataclass(frozen=True)
class AdapterSpec:
    """One adapter: rank, alpha, rsLoRA and the checkpoint modules it targets."""

    name: str
    r: int
    alpha: float
    targets: tuple[str, ...]
    use_rslora: bool = False
    seed: int = 0


ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def save_adapter(base_dir: Path, spec: AdapterSpec, directory: Path) -> torch.nn.Module:
    """Build ``spec`` on the checkpoint at ``base_dir`` with seeded random A and B, save it (PEFT format)
    in ``directory``; return ``peft``'s merged model (``merge_and_unload``), float32, eval mode."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=spec.r, lora_alpha=spec.alpha, target_modules=list(spec.targets),
                        use_rslora=spec.use_rslora, lora_dropout=0.0, bias="none")
    model = get_peft_model(load_hf_model(base_dir), config)
    generator = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_A." in name:
                param.copy_(torch.randn(param.shape, generator=generator) / param.shape[1] ** 0.5)
            elif ".lora_B." in name:
                param.copy_(0.5 * torch.randn(param.shape, generator=generator) / spec.r ** 0.5)
    model.save_pretrained(directory)
    return model.merge_and_unload().float().eval()
