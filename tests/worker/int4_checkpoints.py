"""4-bit checkpoints for the int4 tests, written from a float tiny checkpoint (parent-process side).

Each writer returns ``(checkpoint, dequantized)``: the model in one on-disk format, and the float
checkpoint ``transformers`` runs as the reference, whose linear weights are what the stored tensors
denote, computed by the FORMAT'S REFERENCE DEQUANTIZATION (written here from the reference
implementation, independently of worker/layers/int4_formats.py) and asserted equal to the
quantization's own definition ``s * (q - z)``:

* :func:`save_rtn_dequantized`: ``--quantization int4``'s definition (symmetric, ``s = max|w| / 7``
  per group of 128 columns, 32 where the input size does not divide by 128, ``q = round(w / s)``).
* :func:`save_gptq`: GPTQ as AutoGPTQ packs it (``checkpoint_format: gptq``): ``qweight (K / 8, N)``
  int32 packed along K, ``qzeros (groups, N / 8)`` holding ``z - 1``, ``scales (groups, N)`` float16,
  ``g_idx (K,)`` int32; with ``desc_act`` a random column order (group ``i`` = columns
  ``perm[iG:(i+1)G]``, ``g_idx[perm[j]] = j // G``). Reference: AutoGPTQ's torch ``QuantLinear``
  dequantization (shift, mask, ``zeros + 1``, ``scales[g_idx] * (w - zeros[g_idx])``).
* :func:`save_awq`: AutoAWQ's GEMM layout: ``qweight (K, N / 8)`` packed along N in the order
  ``[0, 2, 4, 6, 1, 3, 5, 7]``, ``qzeros``, ``scales (groups, N)`` float16. Reference: AutoAWQ's
  ``dequantize_gemm`` (unpack, reverse order ``[0, 4, 1, 5, 2, 6, 3, 7]``, ``(w - z) * s``).
* :func:`save_compressed_tensors_w4a16`: quantized and packed by the ``compressed-tensors`` library
  (``pack-quantized``, its min-max observer); reference: the library's own decompression
  (unpack and ``dequantize``).

Asymmetric quantization here: ``s = (max - min) / 15`` per group, ``z = clamp(round(-min / s), 0, 15)``,
``q = clamp(round(w / s) + z, 0, 15)``.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from tests.tiny_models import TinyModelSpec
from tests.worker.int8_checkpoints import LINEAR_WEIGHT, _tensors, _write, round_head

#: The int4 tests' tiny Llama: GQA, untied head, hidden 64 and intermediate 256 (the down projection's
#: input divides by 128, the others' by 32; at tp 2 every rank's input by 32).
SPEC = TinyModelSpec("int4_gqa", "llama", {"hidden_size": 64, "intermediate_size": 256, "num_attention_heads": 4,
                                           "num_key_value_heads": 2, "vocab_size": 190,
                                           "tie_word_embeddings": False}, seed=5)

#: SPEC with a vocabulary of a multiple of 8, so that a packed LM head's zero points pack along it (GPTQ ``lm_head``).
SPEC_V192 = TinyModelSpec("int4_gqa_v192", "llama", {**SPEC.config, "vocab_size": 192}, seed=6)

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


def rtn_group(k: int) -> int:
    return 128 if k % 128 == 0 else 32


def quantize_groups(w: torch.Tensor, group: int, symmetric: bool,
                    scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w (N, K)`` -> ``(q (N, K) int64 in [0, 15], s (N, groups) float32 rounded to scale_dtype, z (N, groups))``."""
    n, k = w.shape
    wg = w.float().reshape(n, k // group, group)
    if symmetric:
        s = (wg.abs().amax(dim=2) / 7).to(scale_dtype).float()
        z = torch.full_like(s, 8.0)
    else:
        lo, hi = wg.amin(dim=2).clamp(max=0), wg.amax(dim=2).clamp(min=0)
        s = ((hi - lo) / 15).to(scale_dtype).float()
        z = torch.round(-lo / s).clamp(0, 15)
    q = (torch.round(wg / s[:, :, None]) + z[:, :, None]).clamp(0, 15).long().reshape(n, k)
    return q, s, z


def definition(q: torch.Tensor, s: torch.Tensor, z: torch.Tensor, g_idx: torch.Tensor) -> torch.Tensor:
    """``w[n, k] = s[n, g_idx[k]] * (q[n, k] - z[n, g_idx[k]])`` in float32."""
    return s[:, g_idx] * (q.float() - z[:, g_idx])


def _pack_int32(values: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """(R, C) codes -> (R, C / 8) int32, nibble i of each word holding the word's element order[i]."""
    r, c = values.shape
    v = values.long().reshape(r, c // 8, 8)
    word = torch.zeros(r, c // 8, dtype=torch.long)
    for i, j in enumerate(order):
        word |= (v[:, :, j] & 0xF) << (4 * i)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def _unpack_int32(packed: torch.Tensor) -> torch.Tensor:
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return ((packed.unsqueeze(-1) >> shifts) & 0xF).reshape(packed.shape[0], -1)


def gptq_reference_dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                              g_idx: torch.Tensor) -> torch.Tensor:
    """AutoGPTQ's QuantLinear (v1): returns the float weight ``(N, K)``."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    zeros = (qzeros.unsqueeze(2) >> shifts[None, None, :]) & 0xF  # (groups, N / 8, 8)
    zeros = ((zeros + 1) & 0xF).reshape(scales.shape)  # (groups, N)
    weight = (qweight.unsqueeze(1) >> shifts[None, :, None]) & 0xF  # (K / 8, 8, N)
    weight = weight.reshape(-1, weight.shape[2])  # (K, N)
    w = scales.float()[g_idx.long()] * (weight.float() - zeros.float()[g_idx.long()])  # (K, N)
    return w.t()


def awq_reference_dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                             group: int) -> torch.Tensor:
    """AutoAWQ's dequantize_gemm: returns the float weight ``(N, K)``."""
    reverse = torch.tensor(AWQ_REVERSE_ORDER)

    def unpack(t: torch.Tensor) -> torch.Tensor:
        nib = _unpack_int32(t).reshape(t.shape[0], -1, 8)  # (R, C, 8): nibble order
        return nib[:, :, reverse].reshape(t.shape[0], -1)

    iweight, izeros = unpack(qweight), unpack(qzeros)  # (K, N), (groups, N)
    izeros = izeros.repeat_interleave(group, dim=0)
    s = scales.float().repeat_interleave(group, dim=0)
    return ((iweight.float() - izeros.float()) * s).t()


def save_rtn_dequantized(source: Path, target: Path, pattern: re.Pattern[str] = LINEAR_WEIGHT) -> Path:
    """``source`` with each linear weight (names matching ``pattern``) replaced by its ``--quantization int4``
    round trip, and its LM head by the int8 one (:func:`~tests.worker.int8_checkpoints.round_head`)."""
    tensors = _tensors(source)
    for name, w in tensors.items():
        if pattern.match(name):
            group = rtn_group(w.shape[1])
            q, s, z = quantize_groups(w, group, symmetric=True)
            tensors[name] = definition(q, s, z, torch.arange(w.shape[1]) // group)
    round_head(source, tensors)  # int8 per vocabulary row (worker/lm_head_int8.py)
    return _write(source, target, tensors, lambda config: None)


def column_order(perms: dict[str, torch.Tensor], name: str, k: int, desc_act: bool,
                 act_order: re.Pattern[str] | None, generator: torch.Generator) -> torch.Tensor:
    """Weight ``name``'s GPTQ column order ``(k,)``: with ``desc_act`` (and ``name`` matching ``act_order``, None:
    every weight) a random permutation, else the identity; weights reading one input (q/k/v, gate/up,
    Mixtral's w1/w3) share theirs, as GPTQ derives it from the input (kept in ``perms``)."""
    key = (name.replace("k_proj", "q_proj").replace("v_proj", "q_proj").replace("up_proj", "gate_proj")
           .replace(".w3.", ".w1."))
    if key not in perms:
        ordered = desc_act and (act_order is None or act_order.match(name) is not None)
        perms[key] = torch.randperm(k, generator=generator) if ordered else torch.arange(k)
    return perms[key]


def save_gptq(source: Path, target: Path, dequantized_target: Path, *, group: int, sym: bool,
              desc_act: bool, seed: int = 0, pattern: re.Pattern[str] = LINEAR_WEIGHT,
              act_order: re.Pattern[str] | None = None, dynamic: dict | None = None,
              lm_head: bool = False) -> tuple[Path, Path]:
    """``source`` as a 4-bit GPTQ checkpoint (module docstring), and its dequantized float copy; the linear
    weights named by ``pattern`` are quantized (a MoE's per-expert modules with tests' MOE_LINEAR_WEIGHT).
    With ``desc_act``, the weights named by ``act_order`` (None: all) get a random column order, the others
    ``g_idx = k // G``; a layer's inputs shared by q/k/v, gate/up (Mixtral's w1/w3) share theirs."""
    tensors, out, dequantized = _tensors(source), {}, {}
    generator = torch.Generator().manual_seed(seed)
    perms: dict[str, torch.Tensor] = {}  # one act order per input: q/k/v share theirs, gate/up theirs (as GPTQ)
    for name, w in tensors.items():
        if not pattern.match(name):
            out[name] = dequantized[name] = w
            continue
        n, k = w.shape
        perm = column_order(perms, name, k, desc_act, act_order, generator)
        g_idx = torch.empty(k, dtype=torch.long)
        g_idx[perm] = torch.arange(k) // group
        q_perm, s, z = quantize_groups(w[:, perm], group, sym, torch.float16)  # groups over the act order
        q = torch.empty_like(q_perm)
        q[:, perm] = q_perm
        prefix = name.removesuffix(".weight")
        out[f"{prefix}.qweight"] = _pack_along_rows(q.t())  # (K / 8, N)
        out[f"{prefix}.qzeros"] = _pack_int32((z.t().long() - 1) & 0xF)  # (groups, N / 8)
        out[f"{prefix}.scales"] = s.t().to(torch.float16).contiguous()  # (groups, N)
        out[f"{prefix}.g_idx"] = g_idx.to(torch.int32)
        reference = gptq_reference_dequantize(out[f"{prefix}.qweight"], out[f"{prefix}.qzeros"],
                                              out[f"{prefix}.scales"], out[f"{prefix}.g_idx"])
        exact = definition(q, s, z, g_idx)
        assert torch.equal(reference, exact), name
        dequantized[name] = exact
    config = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": desc_act, "sym": sym,
              "checkpoint_format": "gptq", "damp_percent": 0.01, "true_sequential": True}
    if dynamic is not None:  # GPTQModel's per-module rules (the weights pattern leaves out stay float)
        config["dynamic"] = dynamic
    if lm_head:  # GPTQModel's packed head (``pattern`` must name lm_head.weight too)
        config["lm_head"] = True
    return (_write(source, target, out, lambda c: c.update(quantization_config=config)),
            _write(source, dequantized_target, dequantized, lambda c: None))


def _pack_along_rows(values: torch.Tensor) -> torch.Tensor:
    """(K, N) codes -> (K / 8, N) int32, nibble i of ``[r, n]`` holding row ``8r + i`` (GPTQ's qweight)."""
    return _pack_int32(values.t().contiguous()).t().contiguous()


def save_awq(source: Path, target: Path, dequantized_target: Path, *, group: int,
             pattern: re.Pattern[str] = LINEAR_WEIGHT, modules_to_not_convert: tuple[str, ...] = ()
             ) -> tuple[Path, Path]:
    """``source`` as an AutoAWQ GEMM checkpoint (module docstring), and its dequantized float copy; the linear
    weights ``pattern`` leaves out stay float, named in the config's ``modules_to_not_convert`` by
    ``modules_to_not_convert`` (AutoAWQ's way of keeping a module unquantized)."""
    tensors, out, dequantized = _tensors(source), {}, {}
    for name, w in tensors.items():
        if not pattern.match(name):
            out[name] = dequantized[name] = w
            continue
        q, s, z = quantize_groups(w, group, symmetric=False, scale_dtype=torch.float16)
        prefix = name.removesuffix(".weight")
        out[f"{prefix}.qweight"] = _pack_int32(q.t().contiguous(), AWQ_ORDER)  # (K, N / 8)
        out[f"{prefix}.qzeros"] = _pack_int32(z.t().long().contiguous(), AWQ_ORDER)  # (groups, N / 8)
        out[f"{prefix}.scales"] = s.t().to(torch.float16).contiguous()
        reference = awq_reference_dequantize(out[f"{prefix}.qweight"], out[f"{prefix}.qzeros"],
                                             out[f"{prefix}.scales"], group)
        exact = definition(q, s, z, torch.arange(w.shape[1]) // group)
        assert torch.equal(reference, exact), name
        dequantized[name] = exact
    config = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm",
              **({"modules_to_not_convert": list(modules_to_not_convert)} if modules_to_not_convert else {})}
    return (_write(source, target, out, lambda c: c.update(quantization_config=config)),
            _write(source, dequantized_target, dequantized, lambda c: None))


def save_compressed_tensors_w4a16(source: Path, target: Path, dequantized_target: Path, *, strategy: str,
                                  symmetric: bool, group: int | None = None, num_bits: int = 4,
                                  pattern: re.Pattern[str] = LINEAR_WEIGHT,
                                  actorder: str | None = None, ignore: tuple[str, ...] = ()) -> tuple[Path, Path]:
    """``source`` as a compressed-tensors ``pack-quantized`` W4A16 (``num_bits`` 8: W8A16) checkpoint written by
    the library; ``actorder`` (``weight`` / ``static``: a calibration order, the format unchanged) is written into
    its config as the library writes it. The linear weights ``pattern`` leaves out stay float, named in the
    config's ``ignore`` by ``ignore`` (llm-compressor's way of keeping a layer unquantized)."""
    scheme = {"num_bits": num_bits, "symmetric": symmetric, "strategy": strategy, "group_size": group,
              "actorder": actorder}
    return save_compressed_tensors_groups(source, target, dequantized_target, {"group_0": (["Linear"], scheme)},
                                          pattern=pattern, ignore=ignore)


def save_compressed_tensors_groups(source: Path, target: Path, dequantized_target: Path,
                                   groups: dict[str, tuple[list[str], dict]], *,
                                   pattern: re.Pattern[str] = LINEAR_WEIGHT,
                                   ignore: tuple[str, ...] = ()) -> tuple[Path, Path]:
    """``source`` as a compressed-tensors ``pack-quantized`` checkpoint written by the library, with one
    ``config_groups`` entry per ``groups`` item, ``name -> (targets, weights scheme)`` (``QuantizationArgs``
    fields: ``num_bits``, ``symmetric``, ``strategy``, ``group_size``, ``actorder``): each linear weight named by
    ``pattern`` is quantized by the first group whose targets match its module (an exact name, ``re:<regex>``, or
    ``Linear``: any), so groups of different schemes make a mixed-precision checkpoint (llm-compressor's W4A16 MLPs
    beside W8A16 attention, say). The reference is the library's own decompression."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    schemes = {name: QuantizationScheme(targets=targets, weights=QuantizationArgs(type="int", **weights))
               for name, (targets, weights) in groups.items()}
    config = QuantizationConfig(config_groups=schemes, ignore=["lm_head", *ignore],
                                format="pack-quantized", quantization_status="compressed").model_dump()
    tensors, out, dequantized = _tensors(source), {}, {}
    for name, w in tensors.items():
        if not pattern.match(name):
            out[name] = dequantized[name] = w
            continue
        prefix = name.removesuffix(".weight")
        scheme = next(s for s in schemes.values() if any(
            t == "Linear" or t == prefix or (t.startswith("re:") and re.match(t[3:], prefix)) for t in s.targets))
        args = scheme.weights
        assert args is not None
        n, k = w.shape
        g = k if args.strategy == "channel" else args.group_size
        wg = w.reshape(n, k // g, g)
        scale, zero_point = calculate_qparams(wg.amin(dim=2), wg.amax(dim=2), args)  # (N, groups)
        module = PackedQuantizationCompressor.compress(
            {"weight": w, "weight_scale": scale, "weight_zero_point": zero_point}, scheme)
        for key, value in module.items():
            out[f"{prefix}.{key}"] = value
        # The library's decompression unpacks and dequantizes (its ``dequantize``): the reference.
        dequantized[name] = PackedQuantizationCompressor.decompress(dict(module), scheme)["weight"].float()
    return (_write(source, target, out, lambda c: c.update(quantization_config=config)),
            _write(source, dequantized_target, dequantized, lambda c: None))


def save_compressed_tensors_group_actorder(source: Path, target: Path, dequantized_target: Path, *, group: int,
                                           symmetric: bool, seed: int = 0,
                                           act_order: re.Pattern[str] | None = None) -> tuple[Path, Path]:
    """``source`` as a compressed-tensors W4A16 checkpoint with ``actorder: group`` (older llm-compressor GPTQ):
    the columns of each weight named by ``act_order`` (None: all) grouped in a random order, stored in the
    checkpoint's column order with ``weight_g_idx (K,)`` int32 (column ``k`` in group ``weight_g_idx[k]``).

    The library no longer writes this variant (compressed-tensors 0.20 refuses ``actorder='group'``), so: the
    weight's columns are permuted into group order, quantized and their scales and zero points computed by the
    library (``calculate_qparams``, ``quantize``) as for a contiguous-group layer, the codes put back in the
    checkpoint's column order and packed by the library's ``pack_to_int32`` (zero points along the rows, as its
    compressor does). Reference: the format's dequantization with ``g_idx``, ``scale[:, g_idx] * (q -
    zero_point[:, g_idx])`` (the library's ``dequantize(..., g_idx)`` before the variant's removal), asserted
    equal to the library's own decompression of the permuted layer with its columns put back.
    """
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=group)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"], format="pack-quantized",
                                quantization_status="compressed").model_dump()
    config["config_groups"]["group_0"]["weights"]["actorder"] = "group"  # as the library wrote it until 2026
    tensors, out, dequantized = _tensors(source), {}, {}
    generator = torch.Generator().manual_seed(seed)
    perms: dict[str, torch.Tensor] = {}
    for name, w in tensors.items():
        if not LINEAR_WEIGHT.match(name):
            out[name] = dequantized[name] = w
            continue
        n, k = w.shape
        perm = column_order(perms, name, k, True, act_order, generator)  # group j: columns perm[jG:(j+1)G]
        g_idx = torch.empty(k, dtype=torch.long)
        g_idx[perm] = torch.arange(k) // group
        wp = w[:, perm]  # (N, K) in group order
        wg = wp.reshape(n, k // group, group)
        scale, zero_point = calculate_qparams(wg.amin(dim=2), wg.amax(dim=2), args)  # (N, groups)
        q_perm = quantize(x=wp, scale=scale, zero_point=zero_point, args=args, dtype=torch.int8)  # (N, K) signed
        q = torch.empty_like(q_perm)
        q[:, perm] = q_perm
        prefix = name.removesuffix(".weight")
        out[f"{prefix}.weight_packed"] = pack_to_int32(q, 4)
        out[f"{prefix}.weight_scale"] = scale
        out[f"{prefix}.weight_shape"] = torch.tensor([n, k])
        out[f"{prefix}.weight_g_idx"] = g_idx.to(torch.int32)
        if not symmetric:
            out[f"{prefix}.weight_zero_point"] = pack_to_int32(zero_point.to(torch.int8), 4, packed_dim=0).contiguous()
        exact = definition(q, scale.float(), zero_point.float(), g_idx)
        library = PackedQuantizationCompressor.decompress(
            dict(PackedQuantizationCompressor.compress({"weight": wp, "weight_scale": scale,
                                                         "weight_zero_point": zero_point}, scheme)),
            scheme)["weight"].float()  # (N, K) in group order
        back = torch.empty_like(library)
        back[:, perm] = library
        assert torch.equal(back, exact), name
        dequantized[name] = exact
    return (_write(source, target, out, lambda c: c.update(quantization_config=config)),
            _write(source, dequantized_target, dequantized, lambda c: None))
