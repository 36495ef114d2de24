"""Checkpoints for the int8 tests, written from a float tiny checkpoint (parent-process side).

* :func:`save_dequantized`: the float checkpoint with every decoder linear weight
  replaced by its int8 round trip ``q * scale`` (float32), and the LM head too (the
  tied embedding matrix of a tied model: :func:`round_head`, worker/lm_head_int8.py), for
  ``transformers`` to run as the reference of ``--quantization int8``. The quantization is written out
  here from its definition (``scale = max|w_row| / 127``, ``q = clamp(round(w /
  scale), -127, 127)``), independently of worker/layers/int8_weights.py.
* :func:`save_compressed_tensors`: the same model as a compressed-tensors int8
  weight-only checkpoint (format ``int-quantized``), quantized and serialised by the
  ``compressed-tensors`` library itself (its min-max observer: ``scale = max|w_row| /
  127.5``, int8 in [-128, 127], scales stored in bfloat16 like a real W8A16
  checkpoint), plus its dequantized copy: ``weight * weight_scale`` in float32, checked
  against the library's ``dequantize`` (which rounds to the scale's bfloat16).
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tpserve.model_config import ModelConfig
from worker.loader import checkpoint_files

#: Checkpoint names of the decoder's linear weights (quantized); the embedding and LM head are not.
LINEAR_WEIGHT = re.compile(r".*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$")
#: The same with Mixtral's expert names (``experts.{e}.w1/w2/w3``): every routed expert, not the router.
MOE_LINEAR_WEIGHT = re.compile(
    r".*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|experts\.\d+\.w[123])\.weight$")


def quantize_definition(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q (N, K) int8, scale (N,) float32): per output row, symmetric, absmax / 127, in float32."""
    scale = w.float().abs().amax(dim=1) / 127
    q = torch.round(w.float() / torch.where(scale > 0, scale, 1.0)[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def _tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in set(checkpoint_files(model_dir).values()):
        tensors.update(load_file(path))
    return tensors


def _write(source: Path, target: Path, tensors: dict[str, torch.Tensor], edit_config: Callable[[dict], None]) -> Path:
    target.mkdir(parents=True)
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        if (source / name).exists():
            shutil.copy(source / name, target / name)
    config = json.loads((source / "config.json").read_text())
    edit_config(config)
    (target / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, target / "model.safetensors")
    return target


def save_cast(source: Path, target: Path, dtype: torch.dtype) -> Path:
    """``source`` with every floating-point tensor in ``dtype`` and ``config.json``'s ``torch_dtype`` saying so (a
    float32 tiny checkpoint as releases store theirs: bfloat16 or float16)."""
    tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in _tensors(source).items()}
    return _write(source, target, tensors, lambda config: config.update(torch_dtype=str(dtype).removeprefix("torch.")))


def save_dequantized(source: Path, target: Path, pattern: re.Pattern[str] = LINEAR_WEIGHT) -> Path:
    """``source`` with each linear weight (names matching ``pattern``) replaced by ``q * scale`` of
    :func:`quantize_definition`, and its LM head rounded (:func:`round_head`)."""
    tensors = _tensors(source)
    for name, w in tensors.items():
        if pattern.match(name):
            q, scale = quantize_definition(w)
            tensors[name] = (q.float() * scale[:, None]).to(w.dtype)
    round_head(source, tensors)
    return _write(source, target, tensors, lambda config: None)


def round_head(source: Path, tensors: dict[str, torch.Tensor]) -> str:
    """The LM head of ``--quantization int8|int4`` on a CPU (worker/lm_head_int8.py) in ``tensors``, in place:
    int8 per vocabulary row (:func:`quantize_definition`), ``q * scale`` in float32. A tied model's head is its
    embedding matrix, rounded once for both; an untied model's ``lm_head.weight``. Returns the tensor's name."""
    tied = ModelConfig.from_pretrained(source).tie_word_embeddings
    name = next(n for n in tensors if n.endswith(("embed_tokens.weight", "embeddings.weight"))) if tied else \
        "lm_head.weight"
    q, scale = quantize_definition(tensors[name])
    tensors[name] = (q.float() * scale[:, None]).to(tensors[name].dtype)
    return name


def save_compressed_tensors(source: Path, target: Path, dequantized_target: Path) -> tuple[Path, Path]:
    """``source`` as a compressed-tensors int8 W8A16 checkpoint, and its dequantized float copy."""
    from compressed_tensors.compressors import IntQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"], format="int-quantized",
                                quantization_status="compressed").model_dump()
    tensors, dequantized = _tensors(source), {}
    compressed: dict[str, torch.Tensor] = {}
    for name, w in tensors.items():
        if not LINEAR_WEIGHT.match(name):
            compressed[name] = dequantized[name] = w
            continue
        prefix = name.removesuffix(".weight")
        scale, zero_point = calculate_qparams(w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True), args)
        module = IntQuantizationCompressor.compress(
            {"weight": w, "weight_scale": scale.to(torch.bfloat16), "weight_zero_point": zero_point}, scheme)
        for key, value in module.items():
            compressed[f"{prefix}.{key}"] = value
        # What the stored tensors denote, in float32. The library's own dequantize computes in the
        # scale's dtype (bfloat16), so it must agree up to bfloat16 rounding (one step: 2**-8 relative).
        exact = module["weight"].float() * module["weight_scale"].float()
        by_library = dequantize(module["weight"], module["weight_scale"], args=args, dtype=torch.float32)
        assert bool(((by_library - exact).abs() <= exact.abs() * 2**-8).all()), name
        dequantized[name] = exact
    assert all(compressed[n].dtype == torch.int8 for n in compressed if LINEAR_WEIGHT.match(n))
    return (_write(source, target, compressed, lambda c: c.update(quantization_config=config)),
            _write(source, dequantized_target, dequantized, lambda c: None))


#: Public names of the two helpers, for the other checkpoint writers (tests/worker/lowbit_checkpoints.py).
read_tensors = _tensors
write_checkpoint = _write
