"""Load one rank's shard of a Hugging Face safetensors checkpoint into the model.

Checkpoint layouts: a single ``model.safetensors``, or shards listed by
``model.safetensors.index.json`` (``{"weight_map": {tensor name: file name}}``).

Each tensor is opened lazily with ``safe_open(file, framework="pt", device=...).get_slice(name)``
and handed to its parameter's ``weight_loader``, which reads only this rank's
rows or columns (see worker/layers/weights.py): no rank ever holds the full
tensor of a sharded weight. On CUDA the files are opened with the rank's GPU as
the device, so safetensors copies each slice from the memory-mapped file straight
to that GPU, and the cast into the parameter is a non-blocking copy on the GPU;
no CPU tensor of a weight is ever cast or kept. The model is built with
uninitialised parameters (no random initialisation), then filled here.

The loader knows no family: the model class comes from the registry
(worker/models/), and the model says where each checkpoint tensor goes
(``model.weight_map(name)`` -> parameter name and shard, or None to skip; the
Llama layout stacks q/k/v_proj into ``qkv_proj`` and gate/up_proj into
``gate_up_proj``: worker/models/base.py). The head is tied to the embedding when the
config says so (``tie_word_embeddings``, or the family's default); an untied model
without ``lm_head.weight`` is refused (tpserve/checkpoint.py), never served tied.

Weight-only int8 (``quantization="int8"``, tpserve/quantization.py): the linear
layers' ``weight`` is int8 and ``weight_scale`` float32. A compressed-tensors int8
checkpoint fills both (``<layer>.weight`` and ``<layer>.weight_scale``, fused like the
weights; a symmetric checkpoint's ``weight_zero_point``, if stored, must be zero); a
float checkpoint's weights are quantized while they are read, one tensor at a time
(worker/layers/int8_weights.py), so no rank holds more than one float tensor.

FP8 and MXFP4 checkpoints (tpserve/weight_formats.py) are dequantized while read: each
quantized tensor and its scale are one float32 source under the float checkpoint's name
(worker/dequantize.py), of which a rank decodes only its slice; the layers are float
(cast to ``dtype``) or, with ``--quantization int8``, requantized to int8 per channel;
with ``--quantization fp8`` an FP8 checkpoint's linear layers keep its e4m3 values and scales
(worker/layers/fp8_weights.py; the experts of an MoE are still dequantized).
One log line at start-up says which.

Weight-only int4 (``quantization="int4"``): a float checkpoint's linear weights are
quantized as they are read (``--quantization int4``); a 4-bit checkpoint's packed tensors
(GPTQ ``qweight``/``qzeros``/``scales``/``g_idx``, AWQ's, compressed-tensors'
``weight_packed``/``weight_scale``/``weight_zero_point``/``weight_shape``) are renamed to
their layer's ``weight`` and handed over as :class:`~worker.layers.int4_weights.PackedPart` s
(which part, which format, the stored name); the layer repacks them once all have arrived
(worker/layers/int4_weights.py), and a layer left incomplete is refused, named.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Collection
from pathlib import Path
from typing import Any

import structlog
import torch
from safetensors import safe_open

from tpserve.checkpoint import LM_HEAD, check_head_weights, checkpoint_files, tensor_dtypes
from tpserve.model_config import ModelConfig
from tpserve.quantization import Quantization, check_quantization_flag
from tpserve.weight_formats import WeightFormat, weight_format
from worker import dequantize
from worker.kv_quant import kv_scale_kind
from tpserve.quantization_int4 import LayerFormats, layer_formats
from worker.layers.int4_formats import PARTS
from worker.layers.fp8_weights import hold_unquantized_fp8
from worker.layers.int4_weights import PackedPart, finish_int4_layer, hold_unquantized
from worker.layers.moe_int4 import hold_unquantized_experts
from worker.lm_head_int8 import hold_lm_head_int8, takes_int8_head
from worker.layers_w16 import allocate_16bit_projections, keep_layers_16bit, takes_w16_layers
from worker.lm_head_w16 import keep_lm_head_16bit, takes_w16_head
from worker.layers.int8_groups import describe_8bit
from worker.models import model_class
from worker.models.base import CausalLM, ShardId
from worker.parallel_state import ParallelContext
from worker.load_progress import ShardProgress

ZERO_POINT_SUFFIX = ".weight_zero_point"
log = structlog.get_logger(__name__)


def load_model(
    model_dir: str | Path, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
    quantization: Quantization | None = None,
) -> CausalLM:
    """Build this rank's shard of the model (the class of ``config.architecture``) and fill it from ``model_dir``.

    Args:
        model_dir: directory with ``config.json`` and the safetensors files.
        config: the parsed ``config.json``.
        ctx: this rank's tensor-parallel group (rank and degree pick the slices).
        dtype: dtype the weights are cast to (int8 weights stay int8).
        quantization: ``--quantization``; a checkpoint stored quantized (``config.quantization``) is loaded as
            stored (the flag may repeat its kind; another value is refused).

    Raises:
        ValueError: ``quantization`` other than a quantized checkpoint's own kind; the family refuses a config
            value, the checkpoint lacks weights the
            model needs (``lm_head.weight`` of an untied model included), holds weights it does not know, or a tensor has the wrong shape
            (each error names them).
    """
    files = checkpoint_files(model_dir)  # tensor name -> file, listed from the headers (tpserve/checkpoint.py)
    check_head_weights(config, files)
    tied = config.tie_word_embeddings
    # Parameters are allocated uninitialised (torch.empty) on ctx.device: nothing
    # is randomly initialised, and each is written once, by its weight_loader.
    check_quantization_flag(config.hf_config, quantization)  # as the coordinator did (launch/startup.py)
    quantization = config.quantization or quantization
    model = model_class(config.architecture)(config, ctx, dtype, tie_word_embeddings=tied, quantization=quantization)
    fmt = weight_format(config.hf_config)
    qc = config.hf_config.get("quantization_config")
    int4 = layer_formats(qc) if config.quantization == "int4" and isinstance(qc, dict) else None
    w16 = takes_w16_layers(ctx.device, dtype)
    if w16:  # a 16-bit checkpoint's projections allocated in its type: the float32 copy never exists
        allocate_16bit_projections(model, _stored_dtypes(model, files))
    held = load_weights(model, files, ctx.device, fmt, int4)
    if takes_int8_head(quantization, config.quantization, ctx.device, dtype):
        released = hold_lm_head_int8(model, tied)
        if released:  # a pipeline stage may hold the tied embedding without the head
            what = "LM head" if model.has_head else "tied embedding (the LM head's matrix, on the last stage)"
            (log.info if ctx.tp_rank == 0 else log.debug)(
                f"{what} held as int8 per vocabulary row (--quantization {quantization}, worker/lm_head_int8.py)"
                + ("; the tied embedding gathers the same rows" if tied and model.has_head else ""),
                rank_float_bytes_released=released)
    elif takes_w16_head(ctx.device, dtype):
        kept, released = keep_lm_head_16bit(model)
        if kept is not None:
            name = str(kept).removeprefix("torch.")
            (log.info if ctx.tp_rank == 0 else log.debug)(
                f"LM head kept in {name}: its values on this rank are all {name} values, so it is widened as it "
                "is read, the float32 head's logits at half its bytes (worker/lm_head_w16.py)",
                rank_float_bytes_released=released)
    if w16:
        kept_layers, released, embedding = keep_layers_16bit(model)
        what = "decoder projections" + (" and the untied input embedding" if embedding else "")
        for kind, count in sorted(kept_layers.items(), key=str):
            name = str(kind).removeprefix("torch.")
            (log.info if ctx.tp_rank == 0 else log.debug)(
                f"weights kept in {name} ({what}): their values on this rank are all {name} values, so each is "
                "widened as it is read, the float32 model's outputs at half their bytes (worker/layers_w16.py)",
                matrices=count, rank_float_bytes_released=released)
    if held:  # once per stage, as the lines below
        (log.info if ctx.tp_rank == 0 else log.debug)("layers the checkpoint stores unquantized served in float",
                                                      layers=len(held), names=held[:6])
    if isinstance(qc, dict) and qc.get("kv_cache_scheme"):
        (log.info if ctx.tp_rank == 0 else log.debug)(
            "checkpoint kv_cache_scheme: its static k_scale / v_scale are not read (--kv-cache-dtype fp8 or int8 "
            "sets a scale per token and KV head)", kv_cache_scheme=qc["kv_cache_scheme"])
    head_fmt = getattr(getattr(model, "lm_head", None), "dequantized_from", None)  # a packed GPTQ head
    if head_fmt is not None:
        (log.info if ctx.tp_rank == 0 else log.debug)(
            f"the LM head is stored {head_fmt.bits}-bit ({head_fmt.method} lm_head): dequantized at load to "
            f"{str(dtype).removeprefix('torch.')}")
    for layer_fmt in sorted(int4.formats if int4 is not None else (), key=str):  # a line per format, 4- and 8-bit
        served_as = describe_8bit(layer_fmt) if layer_fmt.bits == 8 else "int4 codes as stored, group-wise"
        (log.info if ctx.tp_rank == 0 else log.debug)(
            f"{layer_fmt.bits}-bit {layer_fmt.method} weights ("
            f"{'per output channel' if layer_fmt.group_size == -1 else f'groups of {layer_fmt.group_size}'}, "
            f"{'symmetric' if layer_fmt.symmetric else 'zero points'}{', act-order' if layer_fmt.desc_act else ''}) "
            f"served as {served_as}")
    if fmt is not None and quantization == "fp8":
        (log.info if ctx.tp_rank == 0 else log.debug)(f"{fmt.description}: the linear layers keep them as fp8 "
                                                      "(--quantization fp8); other tensors dequantized at load")
    elif fmt is not None:
        float_name = str(dtype).removeprefix("torch.")
        served = {"int8": "int8 per-channel (--quantization int8)",
                  "int4": "int4 groups (--quantization int4, round-to-nearest)"}.get(quantization or "", float_name)
        if any(getattr(m, "mxfp4_w8", False) for m in model.modules()):  # worker/layers/moe_mxfp4.py
            line = (f"{fmt.description}: the routed experts held exactly as 8-bit codes with a scale per 32 (10 bits "
                    f"a weight, the w8 kernel); other tensors dequantized at load to {served}")
        elif (why_not := next((m.mxfp4_w8_why_not for m in model.modules()
                               if getattr(m, "mxfp4_w8_why_not", None)), None)) is not None:
            line = f"{fmt.description} dequantized at load to {served} (the routed experts too, not as 8-bit codes: " \
                   f"{why_not})"
        else:
            line = f"{fmt.description} dequantized at load to {served}"
        (log.info if ctx.tp_rank == 0 else log.debug)(line)
    return model.eval()


def read_device(device: torch.device) -> str:
    """Where safetensors puts the slices it reads: the rank's GPU, else the CPU (also for meta)."""
    return str(device) if device.type == "cuda" else "cpu"


def _int4_part(name: str, fmt: LayerFormats | None) -> tuple[str, str] | None:
    """``(the layer's weight name, part)`` of a 4-bit checkpoint's packed tensor, else None."""
    if fmt is None:
        return None
    stem, _, suffix = name.rpartition(".")
    part = PARTS[fmt.method].get(suffix)
    return None if part is None else (f"{stem}.weight", part)


#: Names of unused checkpoint tensors a refusal lists (a 32-layer GPTQ checkpoint read as float has ~900).
MAX_NAMES_LISTED = 8
#: Suffixes of packed quantized tensors (GPTQ, AWQ, compressed-tensors), which a float model does not use.
PACKED_SUFFIXES = (".qweight", ".qzeros", ".weight_packed", ".g_idx")


def unused_weights_message(names: list[str], packed: bool) -> str:
    """The refusal of checkpoint tensors the model does not use: the first :data:`MAX_NAMES_LISTED` and the count,
    and, where they are packed quantized tensors but the config declares no quantization (``packed`` False), why."""
    listed = names[:MAX_NAMES_LISTED] + ([f"... and {len(names) - MAX_NAMES_LISTED} more"]
                                         if len(names) > MAX_NAMES_LISTED else [])
    message = f"checkpoint has {len(names)} weights the model does not use: {listed}"
    if not packed and any(name.endswith(PACKED_SUFFIXES) for name in names):
        message += ("; they are packed quantized tensors (GPTQ / AWQ / compressed-tensors), but config.json has no "
                    "quantization_config (nor is there a quantize_config.json or quant_config.json beside it)")
    return message


def _check_plain_g_idx(name: str, path: Path, group_size: int) -> None:
    """A GPTQ layer without ``desc_act``: its stored ``g_idx (K,)`` must be the plain ``k // group_size`` (it is not
    read). AutoGPTQ's dequantization applies any ``g_idx``; one in act order under a config whose ``desc_act`` is
    false or unset would be served wrong (as vLLM serves it), so it is refused.

    Raises:
        ValueError: ``g_idx`` is not ``k // group_size`` (names the tensor).
    """
    with safe_open(str(path), framework="pt", device="cpu") as f:
        g_idx = f.get_tensor(name)
    k = g_idx.numel()
    plain = torch.arange(k) // (k if group_size == -1 else group_size)
    if g_idx.dim() != 1 or g_idx.dtype.is_floating_point or not torch.equal(g_idx.long(), plain):
        raise ValueError(f"{name} is not k // group_size (group_size={group_size}) but quantization_config's desc_act "
                         "is false or unset: an act-order checkpoint (set desc_act: true) or a corrupt g_idx")


def _stored_dtypes(model: CausalLM, files: dict[str, Path]) -> dict[str, set[str]]:
    """Per parameter of this stage's ``model``: the safetensors dtypes (``"BF16"``, ...) of the checkpoint tensors
    it receives, from the files' headers (no data read)."""
    stored: dict[str, set[str]] = defaultdict(set)
    for name, kind in tensor_dtypes(files).items():
        local = model.stage_checkpoint_name(name) if name.endswith(".weight") else None
        target = model.weight_map(local) if local is not None else None
        if target is not None:
            stored[target[0]].add(kind)
    return stored


def load_weights(model: CausalLM, files: dict[str, Path], device: torch.device | None = None,
                 fmt: WeightFormat | None = None, int4: LayerFormats | None = None) -> list[str]:
    """Fill every parameter of ``model`` from the checkpoint tensors in ``files``; returns the checkpoint's
    linear layers that a quantized checkpoint stores unquantized, held in float (names as stored, sorted).

    Args:
        model: parameters carrying ``weight_loader`` and ``shard_ids``; its ``weight_map``
            places each checkpoint tensor.
        files: tensor name -> file.
        device: the parameters' device; CUDA slices are read straight onto it.
        fmt: the FP8 / MXFP4 format the checkpoint stores, dequantized while read; None: float or int8.
        int4: the checkpoint's packed (4- or 8-bit) formats per layer (tpserve/quantization_int4.py), or None.

    Raises:
        ValueError: unexpected, missing or mis-shaped weights, named; a corrupt quantized
            tensor or scale (worker/dequantize.py), named.
    """
    packed: dict[str, dequantize.Packed] = {}
    if fmt is not None:
        files, packed = dequantize.plan(files, fmt)  # the float checkpoint's names
    params = dict(model.named_parameters())
    tied = getattr(model, "tie_word_embeddings", False)
    targets: dict[str, tuple[str, ShardId]] = {}
    parts: dict[str, str] = {}  # 4-bit checkpoint tensor -> its part (int4_formats.PARTS)
    unexpected = []
    zero_points = []
    # Pipeline stages: only this stage's tensors, its layers renumbered from 0; ``stored`` is
    # each one's name in the file (the same name with one stage).
    stored = {local: name for name in files if (local := model.stage_checkpoint_name(name)) is not None}
    files = {local: files[name] for local, name in stored.items()}
    for name in files:
        if tied and name == LM_HEAD:
            continue  # shared with the embedding
        if kv_scale_kind(name) is not None:
            continue  # an 8-bit KV cache's scales: worker/kv_quant.py reads them (unused with a float cache)
        if int4 is None and name.endswith(ZERO_POINT_SUFFIX):
            zero_points.append(name)  # symmetric int8: checked to be zero, nothing to load
            continue
        int4_part = _int4_part(name, int4)
        if int4 is not None and int4_part is not None and int4_part[1] == "g_idx":
            layer_fmt = int4.for_layer(stored[name].rpartition(".")[0])
            if not layer_fmt.desc_act:
                if layer_fmt.method == "gptq":
                    _check_plain_g_idx(stored[name], files[name], layer_fmt.group_size)
                continue  # k // group_size when not act-order: nothing to read
        if int4_part is not None:
            parts[name] = int4_part[1]
        target = model.weight_map(int4_part[0] if int4_part is not None else name)
        if target is None:
            continue  # not a weight (a recomputed buffer)
        param_name, shard_id = target
        param = params.get(param_name)
        # shard_id None on a stacked parameter: the checkpoint stores it fused as well (Phi-3's qkv_proj).
        if param is None or (shard_id is not None and shard_id not in param.shard_ids):  # type: ignore[attr-defined]
            unexpected.append(name)
        targets[name] = (param_name, shard_id)
    if unexpected:
        raise ValueError(unused_weights_message(sorted(unexpected), packed=int4 is not None or fmt is not None))
    held: list[str] = []
    if int4 is not None:
        held = _hold_unquantized_layers(model, targets, parts)
    elif packed:  # FP8 / MXFP4: float-stored layers of a model whose layers keep fp8 (--quantization fp8)
        held = _hold_unquantized_layers(model, targets, {name for name in targets if stored[name] in packed})

    loaded: set[tuple[str, ShardId]] = set()
    by_file: dict[Path, list[str]] = defaultdict(list)
    for name in targets:
        by_file[files[name]].append(name)
    progress = ShardProgress(by_file)  # one log line per file: bytes and time
    read_on = read_device(device or torch.device("cpu"))
    packed_files = dequantize.OpenFiles()  # FP8 / MXFP4 values and scales, read on the CPU
    for path, names in by_file.items():
        with progress.shard(path), safe_open(path, framework="pt", device=read_on) as f:
            for name in names:
                param_name, shard_id = targets[name]
                param = params[param_name]
                source: Any
                try:
                    if stored[name] in packed:
                        source = dequantize.source(packed[stored[name]], fmt, packed_files)  # type: ignore[arg-type]
                    else:
                        source = f.get_slice(stored[name])
                        if fmt is not None:
                            dequantize.check_not_fp8(stored[name], source.get_dtype(), fmt)
                    if name in parts:
                        assert int4 is not None
                        layer_fmt = int4.for_layer(stored[name].rpartition(".")[0])  # the file's module name
                        source = PackedPart(source, parts[name], layer_fmt, name)
                    param.weight_loader(param, source, shard_id)  # type: ignore[attr-defined]
                except ValueError as error:
                    if re.search(re.escape(stored[name].rpartition(".")[0]) + r"[.:]", str(error)):
                        raise  # it names the layer or its tensor at fault (a packed part's unpacker), not the last read
                    raise ValueError(f"weight {name!r}: {error}") from error
                shards = param.shard_ids if shard_id is None else (shard_id,)  # type: ignore[attr-defined]
                loaded |= {(param_name, shard) for shard in shards}
    packed_files.close()
    _check_zero_points({stored[n]: files[n] for n in zero_points}, [stored[n] for n in zero_points])
    _finish_int4(model)

    # Scales computed from a float weight while it was quantized (int8_weights.py) are not in the checkpoint.
    loaded |= {(name, shard) for name, p in params.items() for shard in getattr(p, "computed_shard_ids", ())}
    expected = {(name, shard) for name, p in params.items() for shard in p.shard_ids}  # type: ignore[attr-defined]
    missing = sorted(model.checkpoint_name(name, shard) for name, shard in expected - loaded)
    if missing:
        raise ValueError(f"checkpoint is missing weights: {missing}")
    return held


def _hold_unquantized_layers(model: CausalLM, targets: dict[str, tuple[str, ShardId]], quantized: Collection[str]
                             ) -> list[str]:
    """A quantized checkpoint's linear layers stored unquantized (left out by its ``ignore`` list, ``targets``,
    ``modules_to_not_convert``): held in float as stored, never quantized at load. ``quantized``: the checkpoint
    tensors that are packed (4- or 8-bit parts) or FP8 values kept as fp8 (``--quantization fp8``). Returns the
    layers held (the checkpoint's names, sorted).

    Raises:
        ValueError: a fused layer (q/k/v, gate/up) with some parts quantized and others not, or routed experts
            stored unquantized beside packed ones (names the tensor).
    """
    receiving = {targets[name][0] for name in quantized}  # parameters that receive quantized tensors
    held: list[str] = []
    for name, (param_name, _) in targets.items():
        if name in quantized or not name.endswith(".weight"):
            continue
        module = model.get_submodule(param_name.rpartition(".")[0])
        if getattr(module, "int4", False):  # FusedMoE built for packed experts
            if {f"{param_name.rpartition('.')[0]}.{stack}" for stack in ("gate_up_proj", "down_proj")} & receiving:
                raise ValueError(f"weight {name!r} is stored unquantized in a packed checkpoint beside packed experts "
                                 "of the same layer: mixed-precision experts are not served")
            hold_unquantized_experts(module)  # every expert of the layer stored float (ignore / "-:" rules)
            held.append(name.rpartition(".experts.")[0] + ".experts")
            continue
        int4_layer = getattr(module, "int4_pending", None) is not None
        if not (int4_layer or getattr(module, "fp8", False)) or getattr(module, "weight", None) is None:
            continue  # a float layer already (embedding, norms, router)
        if param_name in receiving:
            raise ValueError(f"weight {name!r} is stored unquantized in a quantized checkpoint beside quantized "
                             "parts of the same fused layer: not served")
        (hold_unquantized if int4_layer else hold_unquantized_fp8)(module)
        held.append(name.removesuffix(".weight"))  # the checkpoint's name (q_proj, not the fused qkv_proj)
    return sorted(set(held))


def _finish_int4(model: CausalLM) -> None:
    """Refuse incomplete 4-bit layers; switch the compiled decode layer off where a layer gathers its input
    (act-order GPTQ: the compiled layer has no column gather)."""
    permuted = False
    for module in model.modules():
        if getattr(module, "int4_pending", None) is not None:
            finish_int4_layer(module)
            permuted |= getattr(module, "input_perm", None) is not None
    if permuted:
        for module in model.modules():
            if hasattr(module, "decode_block"):
                setattr(module, "decode_block", False)  # noqa: B010 - an attribute of some modules only
            if hasattr(module, "decode_stack"):
                setattr(module, "decode_stack", None)  # noqa: B010


def _check_zero_points(files: dict[str, Path], names: list[str]) -> None:
    """A stored ``weight_zero_point`` of a symmetric checkpoint must be zero (the layers have none)."""
    for name in names:
        with safe_open(files[name], framework="pt") as f:
            if bool(f.get_tensor(name).any()):
                raise ValueError(f"weight {name!r} is not zero: asymmetric int8 is not supported")
