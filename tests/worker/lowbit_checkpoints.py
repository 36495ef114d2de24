"""FP8 and MXFP4 checkpoints for the tests, written in the published on-disk layouts from a float tiny checkpoint.

Each writer returns the quantized checkpoint and its dequantized float32 twin (every
quantized tensor replaced by what it denotes), which ``transformers`` runs as the
reference. What a stored tensor denotes is computed by the format's reference code, and
checked against this module's own definition of the format:

* :func:`save_fp8_block`: ``quant_method: fp8`` as DeepSeek V3 / Qwen3-FP8 publish it:
  ``weight`` ``float8_e4m3fn`` with ``weight_scale_inv`` float32 per ``block`` of the weight,
  ``scale = max|w_block| / 448`` (e4m3's largest value), ``q = e4m3(w / scale)``; dequantized
  by transformers' ``_dequantize_fp8_weight`` (integrations/finegrained_fp8.py).
* :func:`save_compressed_tensors_fp8`: llm-compressor's FP8_DYNAMIC (per output channel) and
  FP8 per tensor, quantized and serialised by the ``compressed-tensors`` library itself
  (``calculate_qparams``, ``FloatQuantizationCompressor``), scales in bfloat16 as published;
  dequantized by the library's ``dequantize``.
* :func:`save_mxfp4`: gpt-oss's stacked experts as ``<name>_blocks`` / ``<name>_scales``
  (:func:`pack_mxfp4`); dequantized by transformers' ``convert_moe_packed_tensors``
  (integrations/mxfp4.py).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from tests.tiny_models import TinyModelSpec
from tests.worker.int8_checkpoints import LINEAR_WEIGHT
from tests.worker.int8_checkpoints import read_tensors as _tensors
from tests.worker.int8_checkpoints import write_checkpoint as _write

#: The tiny MoE models of the FP8 and MXFP4 tests.
QWEN3_MOE = TinyModelSpec("qwen3_moe_fp8", "qwen3_moe", {
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 180,
    "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True,
    "mlp_only_layers": [1], "tie_word_embeddings": False}, seed=41)
GPT_OSS = TinyModelSpec("gpt_oss_mxfp4", "gpt_oss", {
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 190,
    "intermediate_size": 32, "num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": 8,
    "swiglu_limit": 7.0, "tie_word_embeddings": False, "pad_token_id": 0}, seed=42)
#: gpt-oss with experts 64 wide: at tp 2 each rank's 32 units are whole MXFP4 groups, so a CPU rank holds its
#: experts as 8-bit codes (worker/layers/moe_mxfp4.py) at tp 2 as well as at tp 1.
GPT_OSS_WIDE = TinyModelSpec("gpt_oss_mxfp4_wide", "gpt_oss", {**GPT_OSS.config, "intermediate_size": 64}, seed=43)
E4M3_MAX = 448.0
#: e2m1's eight magnitudes (OCP MX spec v1.0): code c in 0..7, sign in bit 3.
E2M1_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
MXFP4_EXPERTS = re.compile(r".*\.mlp\.experts\.(gate_up_proj|down_proj)$")


def quantize_fp8_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q (N, K) float8_e4m3fn, scale_inv (N / bn, K / bk) float32)`` with ``w ~= q * scale_inv`` per block."""
    bn, bk = block
    n, k = w.shape
    tiles = w.float().reshape(n // bn, bn, k // bk, bk)
    scale = tiles.abs().amax(dim=(1, 3)) / E4M3_MAX  # (N / bn, K / bk)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (tiles / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).reshape(n, k).to(torch.float8_e4m3fn)
    return q, scale


def fp8_blocks_definition(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """What a block-scaled FP8 weight denotes, from the format's definition: ``q[n, k] * scale[n // bn, k // bk]``."""
    return q.float() * scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)


def save_fp8_block(source: Path, target: Path, dequantized_target: Path, block: tuple[int, int],
                   pattern: re.Pattern[str] = LINEAR_WEIGHT, modules_to_not_convert: tuple[str, ...] = ()
                   ) -> tuple[Path, Path]:
    """``source`` with every tensor matching ``pattern`` block-scaled FP8; and the dequantized twin. The linear
    weights ``pattern`` leaves out stay float, named in ``modules_to_not_convert`` by ``modules_to_not_convert``."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    tensors, quantized, dequantized = _tensors(source), {}, {}
    for name, w in tensors.items():
        if not pattern.match(name):
            quantized[name] = dequantized[name] = w
            continue
        q, scale = quantize_fp8_blocks(w, block)
        reference = _dequantize_fp8_weight(q, scale, list(block), torch.float32)
        assert torch.equal(reference, fp8_blocks_definition(q, scale, block)), name
        quantized[name], quantized[name + "_scale_inv"] = q, scale
        dequantized[name] = reference
    config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": list(block), "modules_to_not_convert": ["lm_head", *modules_to_not_convert]}
    return (_write(source, target, quantized, lambda c: c.update(quantization_config=config)),
            _write(source, dequantized_target, dequantized, lambda c: None))


def save_compressed_tensors_fp8(source: Path, target: Path, dequantized_target: Path) -> tuple[Path, Path]:
    """``source`` as a compressed-tensors ``float-quantized`` checkpoint: attention per tensor, MLP per channel."""
    from compressed_tensors.compressors import FloatQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from compressed_tensors.quantization.utils import calculate_qparams

    dynamic = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True)
    schemes = {
        "attention": QuantizationScheme(targets=["re:.*self_attn.*"], weights=QuantizationArgs(
            num_bits=8, type="float", symmetric=True, strategy="tensor")),
        "mlp": QuantizationScheme(targets=["re:.*mlp.*"], input_activations=dynamic, weights=QuantizationArgs(
            num_bits=8, type="float", symmetric=True, strategy="channel")),
    }
    config = QuantizationConfig(config_groups=schemes, ignore=["lm_head"], format="float-quantized",
                                quantization_status="compressed").model_dump()
    tensors, quantized, dequantized = _tensors(source), {}, {}
    for name, w in tensors.items():
        if not LINEAR_WEIGHT.match(name):
            quantized[name] = dequantized[name] = w
            continue
        scheme = schemes["attention" if ".self_attn." in name else "mlp"]
        args = scheme.weights
        assert args is not None
        dims = dict(dim=1, keepdim=True) if args.strategy == "channel" else {}
        low, high = w.amin(**dims).reshape(-1, 1), w.amax(**dims).reshape(-1, 1)
        scale, zero_point = calculate_qparams(low, high, args)
        scale = scale.to(torch.bfloat16)
        module = FloatQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, scheme)
        assert module["weight"].dtype == torch.float8_e4m3fn and "weight_zero_point" not in module
        if args.strategy == "tensor":
            module["weight_scale"] = module["weight_scale"].reshape(1)  # stored as one value, as llm-compressor does
        prefix = name.removesuffix(".weight")
        for key, value in module.items():
            quantized[f"{prefix}.{key}"] = value
        exact = module["weight"].float() * module["weight_scale"].float().reshape(-1, 1)
        by_library = dequantize(module["weight"], module["weight_scale"].reshape(-1, 1).float(), args=args,
                                dtype=torch.float32)
        assert torch.equal(by_library, exact), name
        dequantized[name] = exact
    return (_write(source, target, quantized, lambda c: c.update(quantization_config=config)),
            _write(source, dequantized_target, dequantized, lambda c: None))


def pack_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's MXFP4 packing of a stacked expert weight ``(E, A, B)`` (A divisible by 32).

    The stored tensor is the transpose ``(E, B, A)`` cut into groups of 32 values along A.
    Per group: ``e = ceil(log2(max|v| / 6))`` (6 = e2m1's largest magnitude) stored as the
    e8m0 byte ``e + 127``; each value becomes the e2m1 code nearest to ``v / 2**e`` (magnitude
    index in bits 0-2, sign in bit 3); value ``2j`` goes in byte ``j``'s low nibble, ``2j + 1``
    in its high nibble.

    Returns:
        ``(blocks (E, B, A / 32, 16) uint8, scales (E, B, A / 32) uint8)``.
    """
    experts, a, b = w.shape
    groups = w.float().transpose(1, 2).reshape(experts, b, a // 32, 32)
    amax = groups.abs().amax(dim=-1)  # (E, B, G)
    exponent = torch.ceil(torch.log2(torch.where(amax > 0, amax / 6.0, torch.ones_like(amax)))).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent)[..., None]
    magnitude = (scaled.abs()[..., None] - E2M1_MAGNITUDES).abs().argmin(dim=-1)  # (E, B, G, 32) in 0..7
    codes = (magnitude | ((scaled < 0) & (magnitude > 0)).long() << 3).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exponent + 127).to(torch.uint8)


def mxfp4_definition(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """What MXFP4 ``(E, B, G, 16)`` / ``(E, B, G)`` denote as the float ``(E, A, B)``, from the format's definition."""
    table = torch.cat([E2M1_MAGNITUDES, -E2M1_MAGNITUDES])
    codes = torch.stack([blocks & 0xF, blocks >> 4], dim=-1).long()  # (E, B, G, 16, 2)
    values = table[codes].flatten(-2) * torch.exp2(scales.float() - 127)[..., None]  # (E, B, G, 32)
    return values.flatten(-2).transpose(1, 2)


def save_mxfp4(source: Path, target: Path, dequantized_target: Path) -> tuple[Path, Path]:
    """A float gpt-oss checkpoint with its stacked experts in MXFP4, as the gpt-oss release; and the dequantized twin."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    tensors, quantized, dequantized = _tensors(source), {}, {}
    for name, w in tensors.items():
        if not MXFP4_EXPERTS.match(name):
            quantized[name] = dequantized[name] = w
            continue
        blocks, scales = pack_mxfp4(w)
        reference = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        assert torch.equal(reference, mxfp4_definition(blocks, scales)), name
        assert (reference - w.float()).abs().max() <= w.float().abs().max() * 0.25, name  # a 4-bit round trip
        quantized[name + "_blocks"], quantized[name + "_scales"] = blocks, scales
        dequantized[name] = reference
    config = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    return (_write(source, target, quantized, lambda c: c.update(quantization_config=config)),
            _write(source, dequantized_target, dequantized, lambda c: None))

