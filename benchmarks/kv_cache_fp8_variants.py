"""Candidate accuracy improvements to the fp8 KV cache, each simulated and measured against the float32 cache.

The shipped fp8 cache (worker/kv_quant.py) stores each (token, KV head) row ``y`` (keys less a calibrated
per-channel offset) as e4m3 codes of ``y / s`` with ``s = bf16(absmax(y) / 448)``. Each candidate below is
a rounding of the rows, applied by a float32 cache that stores the rounded rows
(tests/worker/kv8_helpers.py ``rounded_cache_runner``): every attention path then reads exactly what such
a cache would hold, without writing its kernels first. The ``fp8`` row simulates the shipped scheme; it
must give the served fp8 cache's figures (its tokens, and its logits up to the kernels' summation order:
tests/worker/test_kv_cache_dtype.py checks it), which validates the method.

Candidates (sources):

* ``fp8_scale_float32``: the scale unrounded (float32: 2 more bytes per row);
* ``fp8_scale_pow2``: ``s = 2^ceil(log2(absmax / 448))`` (exact scaling: MX formats' E8M0 scales, OCP MX v1.0);
* ``fp8_scale_mse``: ``s = r * absmax / 448`` with the clipping ratio ``r`` in 1.0, 0.95, .., 0.6 that
  minimises the row's squared error (the clipping search of AWQ's ``auto_clip`` and llm-compressor's MSE
  observer, per token);
* ``fp8_value_offset``: values less a calibrated per-channel mean too (as the keys), added back on reading;
* ``fp8_hadamard``: rows (less the offset) times the normalised Hadamard matrix ``H_d`` before rounding,
  rotated back after (QuaRot, arXiv:2404.00456; the query and the output would be rotated alike);
* ``fp8_full_precision_tail``: the block being written kept in float32, rounded once its last slot is written
  (KIVI's full-precision residual, arXiv:2402.02750);
* ``fp8_first_block_full_precision``: positions 0 .. block_size - 1 kept in float32 (the attention-sink
  tokens, StreamingLLM arXiv:2309.17453; IntactKV arXiv:2403.01241);
* ``fp8_first_block_bfloat16``: the same block rounded to bfloat16 instead: what a second, 16-bit pool for
  each sequence's first block (the design the float32 figure suggested) would hold;
* ``fp8_first_position_full_precision``: position 0 alone (the BOS sink) kept in float32;
* ``fp8_static_channel``: no per-row scale (a block then takes exactly half a 16-bit block's bytes): a static
  scale per layer, KV head and channel, twice the channel's absmax over the calibration prompt (of the keys
  less their offset, and of the values) over 448 (e4m3 is a float format: the headroom costs only the
  subnormal range at the bottom); ``fp8_static_tensor``: the same with one scale per layer for keys and one
  for values (the largest channel's: vLLM's calibrated ``k_scale`` / ``v_scale``);
* ``int8_static_channel``: int8 codes with a static scale per layer, KV head and channel and no per-row
  scale (exactly 2x the blocks), calibrated on the model's own greedy continuation of BOS
  (:data:`GENERATED_CALIBRATION_TOKENS` tokens: in the model's distribution, where the seeded random ids
  of the fp8 static rows give atypical activations), ``1.25 x`` that text's absmax per channel over 127
  (``int8_static_channel_no_headroom``: ``1.0 x``); keys less their offset, values as they are (the static
  per-channel int8 of SmoothQuant-style calibration, KIVI's per-channel keys);
* ``int7_packed_e8m0``, ``int7_packed_e5m3``, ``int7_packed_bf16``: a per-row scale kept *inside* an exact 2x
  pool: 7-bit codes (+-63) in each byte's high bits and the row's scale spread over the ``d`` low bits (a row
  of ``d >= 8`` bytes has 8 spare bits: a power-of-two E8M0 scale, OCP MX v1.0, or an unsigned 8-bit float
  with 3 mantissa bits rounded up, NVFP4's E4M3 scale idea with the exponent range of a float32's; from
  ``d >= 16``, a bfloat16 scale), keys less the offset; the bfloat16 row at ``d = 8`` is the bound such a
  packing could reach there;
* ``int8``, ``bfloat16`` for scale.

Each on the samples of benchmarks/kv_cache_dtype.py (stories260k's goldens, the embedded model's 4 prompts,
32 seeded prompts on each): free-running and teacher-forced agreement with the float32 cache's lines, and
the teacher-forced logit error against the float32 cache's logits (RMS and max over their standard
deviation: the steady measure).

``sixteen_bit_activations``: the served 8-bit caches (int8, fp8) under ``--dtype bfloat16`` and ``float16``
against that server's own 16-bit cache (``--kv-cache-dtype auto``), on the same samples: how much the
free-running figure on 4 or 5 lines depends on which near-ties the activations' own rounding meets.

    python benchmarks/kv_cache_fp8_variants.py --out benchmarks/results/kv_cache_fp8_variants.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.kv_cache_dtype import (  # noqa: E402
    agreement_samples,
    positional_share,
    prefix_share,
)
from tests.worker.kv8_helpers import (  # noqa: E402
    RoundRows,
    eight_bit_runner,
    rounded_cache_runner,
    sixteen_bit,
    teacher_forced,
)
from worker.kv_quant import as_cached, calibration_token_ids  # noqa: E402
from worker.model_runner import ModelRunner  # noqa: E402
from worker.parallel_state import ParallelContext  # noqa: E402

E4M3 = torch.float8_e4m3fn
#: The clipping ratios ``fp8_scale_mse`` tries, largest first (ties keep the larger).
CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6)
#: Length of ``int8_static_channel``'s calibration text (the model's own greedy tokens), and its scales'
#: headroom over that text's absmax per channel (values beyond are clipped).
GENERATED_CALIBRATION_TOKENS = 256
INT8_STATIC_HEADROOMS = {"int8_static_channel": 1.25, "int8_static_channel_no_headroom": 1.0}


def e4m3(y: torch.Tensor, scale: str) -> torch.Tensor:
    """Rows ``y (..., d)`` float32 rounded through e4m3 codes with a per-row scale chosen by ``scale``:
    ``bf16`` (the shipped rule), ``float32``, ``pow2`` or ``mse`` (module docstring)."""
    base = y.abs().amax(-1, keepdim=True).clamp_min(2.0**-100) / 448  # (..., 1)

    def through(s: torch.Tensor) -> torch.Tensor:
        return (y / s).clamp(-448, 448).to(E4M3).float() * s

    if scale == "float32":
        return through(base)
    if scale == "pow2":
        return through(torch.exp2(torch.ceil(torch.log2(base))))
    if scale == "bf16":
        return through(base.to(torch.bfloat16).float())
    best, best_error = None, None
    for ratio in CLIP_RATIOS:
        rounded = through((base * ratio).to(torch.bfloat16).float())
        error = (rounded - y).pow(2).sum(-1, keepdim=True)
        if best is None or best_error is None:
            best, best_error = rounded, error
        else:
            better = error < best_error
            best, best_error = torch.where(better, rounded, best), torch.where(better, error, best_error)
    assert best is not None
    return best


def int7_packed(y: torch.Tensor, scale: str) -> torch.Tensor:
    """Rows ``y (..., d)`` float32 rounded through 7-bit codes (+-63) with a per-row scale chosen by ``scale``
    (``e8m0``, ``e5m3`` or ``bf16``: the scale the codes' spare low bits can hold; module docstring), rounded
    up so that no code saturates."""
    base = y.abs().amax(-1, keepdim=True).clamp_min(2.0**-100) / 63  # (..., 1)
    exponent = torch.floor(torch.log2(base))
    if scale == "e8m0":
        s = torch.exp2(torch.ceil(torch.log2(base)))
    elif scale == "e5m3":
        s = torch.ceil(base / torch.exp2(exponent) * 8) / 8 * torch.exp2(exponent)
    else:
        s = base.to(torch.bfloat16).float()
    return (y / s).round().clamp(-63, 63) * s


def hadamard(d: int) -> torch.Tensor:
    """The normalised Sylvester Hadamard matrix ``(d, d)`` float32 (``d`` a power of 2): orthogonal."""
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / d**0.5


def channel_means(model_dir: Path) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the mean key and value ``(KVH, d)`` over the calibration prompt (worker/kv_quant.py's)."""
    means: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def record(k: torch.Tensor, v: torch.Tensor, layer: int, positions: torch.Tensor | None):
        means[layer] = (k.mean(0), v.mean(0))
        return k, v

    runner = rounded_cache_runner(model_dir, record)
    teacher_forced(runner, [list(calibration_token_ids(runner.config.vocab_size, 128))], [[0]])
    return [means[i] for i in sorted(means)]


def channel_absmax(model_dir: Path, k_offsets: list[torch.Tensor], prompt: list[int] | None = None
                   ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the absmax of the keys less ``k_offsets`` and of the values ``(KVH, d)`` over ``prompt``
    (token ids; None: the calibration prompt, 128 seeded ids)."""
    amax: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def record(k: torch.Tensor, v: torch.Tensor, layer: int, positions: torch.Tensor | None):
        amax[layer] = ((k - k_offsets[layer]).abs().amax(0), v.abs().amax(0))
        return k, v

    runner = rounded_cache_runner(model_dir, record, num_blocks=64)
    tokens = list(calibration_token_ids(runner.config.vocab_size, 128)) if prompt is None else prompt
    teacher_forced(runner, [tokens], [[0]])
    return [amax[i] for i in sorted(amax)]


def generated_text(model_dir: Path, num_tokens: int = GENERATED_CALIBRATION_TOKENS) -> list[int]:
    """The model's own greedy continuation of its BOS token (id 1), ``1 + num_tokens`` ids: a calibration text
    in the model's distribution without a dataset (random ids give atypical activations: a static scale set
    on them clips real prompts' values)."""
    runner = eight_bit_runner(model_dir, "auto", num_blocks=64)
    return [1, *teacher_forced(runner, [[1]], None, num_tokens)[0]]


def candidates(model_dir: Path, block_size: int) -> dict[str, tuple[RoundRows, bool]]:
    """Name -> (row rounding, whether rows wait in full precision until their block is full)."""
    k_offsets = [k_offset for _, _, k_offset in eight_bit_runner(model_dir, "fp8").kv_scales]  # the served offsets
    v_means = [v for _, v in channel_means(model_dir)]

    def fp8(scale: str = "bf16", value_offset: bool = False, rotate: bool = False) -> RoundRows:
        def rows(k, v, layer, positions):
            mu_k = k_offsets[layer]
            mu_v = v_means[layer] if value_offset else torch.zeros_like(mu_k)
            if not rotate:
                return e4m3(k - mu_k, scale) + mu_k, e4m3(v - mu_v, scale) + mu_v
            h = hadamard(k.shape[-1])
            return e4m3((k - mu_k) @ h.T, scale) @ h + mu_k, e4m3((v - mu_v) @ h.T, scale) @ h + mu_v
        return rows

    def shipped(k, v, layer, positions):  # worker/kv_quant.py itself
        return as_cached(k, E4M3, k_offsets[layer]), as_cached(v, E4M3)

    def kept(first: int, dtype: torch.dtype = torch.float32) -> RoundRows:
        def rows(k, v, layer, positions):
            rk, rv = shipped(k, v, layer, positions)
            keep = (positions < first)[:, None, None]
            return torch.where(keep, k.to(dtype).float(), rk), torch.where(keep, v.to(dtype).float(), rv)
        return rows

    def int8(k, v, layer, positions):
        return as_cached(k, torch.int8, k_offsets[layer]), as_cached(v, torch.int8)

    amax = channel_absmax(model_dir, k_offsets)

    def static(per_tensor: bool) -> RoundRows:
        def through(y: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
            scale = (a.amax() if per_tensor else a).clamp_min(2.0**-100) * 2 / 448  # (KVH, d) or ()
            return (y / scale).clamp(-448, 448).to(E4M3).float() * scale

        def rows(k, v, layer, positions):
            (ak, av), mu_k = amax[layer], k_offsets[layer]
            return through(k - mu_k, ak) + mu_k, through(v, av)
        return rows

    generated = channel_absmax(model_dir, k_offsets, generated_text(model_dir))

    def int8_static(headroom: float) -> RoundRows:
        def through(y: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
            scale = a.clamp_min(2.0**-100) * headroom / 127  # (KVH, d)
            return (y / scale).round().clamp(-127, 127) * scale

        def rows(k, v, layer, positions):
            (ak, av), mu_k = generated[layer], k_offsets[layer]
            return through(k - mu_k, ak) + mu_k, through(v, av)
        return rows

    def packed(scale: str) -> RoundRows:
        def rows(k, v, layer, positions):
            mu_k = k_offsets[layer]
            return int7_packed(k - mu_k, scale) + mu_k, int7_packed(v, scale)
        return rows

    return {"bfloat16": (sixteen_bit(torch.bfloat16), False), "int8": (int8, False), "fp8": (shipped, False),
            "fp8_scale_float32": (fp8("float32"), False), "fp8_scale_pow2": (fp8("pow2"), False),
            "fp8_scale_mse": (fp8("mse"), False), "fp8_value_offset": (fp8(value_offset=True), False),
            "fp8_hadamard": (fp8(rotate=True), False), "fp8_full_precision_tail": (shipped, True),
            "fp8_first_block_full_precision": (kept(block_size), False),
            "fp8_first_block_bfloat16": (kept(block_size, torch.bfloat16), False),
            "fp8_first_position_full_precision": (kept(1), False),
            "fp8_static_channel": (static(False), False), "fp8_static_tensor": (static(True), False),
            **{name: (int8_static(headroom), False) for name, headroom in INT8_STATIC_HEADROOMS.items()},
            **{f"int7_packed_{scale}": (packed(scale), False) for scale in ("e8m0", "e5m3", "bf16")}}


def study() -> dict:
    """Per sample and candidate: agreement with the float32 cache's lines and the logit error (module docstring)."""
    samples = agreement_samples()
    out: dict = {}
    for sample, (model_dir, prompts, num_tokens, num_blocks) in samples.items():
        reference = eight_bit_runner(model_dir, "auto", num_blocks=num_blocks)
        want = teacher_forced(reference, prompts, None, num_tokens)
        want_logits: list[torch.Tensor] = []
        teacher_forced(reference, prompts, want, logits=want_logits)
        ref = torch.stack(want_logits)
        out[sample] = {"tokens": len(prompts) * num_tokens}
        for name, (rows, when_full) in candidates(model_dir, 16).items():
            runner = rounded_cache_runner(model_dir, rows, when_full=when_full, num_blocks=num_blocks)
            free = teacher_forced(runner, prompts, None, num_tokens)
            logits: list[torch.Tensor] = []
            forced = teacher_forced(runner, prompts, want, logits=logits)
            diff = torch.stack(logits) - ref
            out[sample][name] = {
                "free_running": round(prefix_share(free, want), 4),
                "free_running_positional": round(positional_share(free, want), 4),
                "teacher_forced": round(positional_share(forced, want), 4),
                "lines_diverging": sum(f != w for f, w in zip(free, want, strict=True)),
                "logit_error_over_std": {"rms": round(float(diff.pow(2).mean().sqrt() / ref.std()), 5),
                                         "max": round(float(diff.abs().max() / ref.std()), 4)},
            }
    return out


def sixteen_bit_activations() -> dict:
    """Per activation dtype (``--dtype bfloat16`` / ``float16``), sample and 8-bit cache: agreement with that
    server's own 16-bit cache (``--kv-cache-dtype auto``), free-running and teacher-forced (module docstring)."""
    samples = agreement_samples()
    out: dict = {}
    for name, dtype in (("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        out[name] = {}
        for sample, (model_dir, prompts, num_tokens, num_blocks) in samples.items():
            def runner(kv_cache_dtype: str) -> ModelRunner:
                r = ModelRunner(model_dir, ParallelContext.single(), dtype, block_size=16,
                                kv_cache_dtype=kv_cache_dtype)
                r.init_kv_cache(num_blocks)
                return r
            want = teacher_forced(runner("auto"), prompts, None, num_tokens)
            out[name][sample] = {"tokens": len(prompts) * num_tokens}
            for cache in ("int8", "fp8"):
                free = teacher_forced(runner(cache), prompts, None, num_tokens)
                forced = teacher_forced(runner(cache), prompts, want)
                out[name][sample][cache] = {"free_running": round(prefix_share(free, want), 4),
                                            "teacher_forced": round(positional_share(forced, want), 4),
                                            "lines_diverging": sum(f != w for f, w in zip(free, want, strict=True))}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = {"machine": f"{platform.machine()} {torch.get_num_threads()} threads", "torch": torch.__version__,
              "study": study(), "sixteen_bit_activations": sixteen_bit_activations()}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
