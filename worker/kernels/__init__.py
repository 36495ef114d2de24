"""tpserve's compiled CPU kernels (``*.cpp`` here), built once per machine and loaded on first use.

The ops land in ``torch.ops.tpserve_cpu``:

* ``linear_f32(x (M, K) f32, weight (N, K) f32, bias (N,) f32 | None) -> (M, N) f32``
* ``linear_int8(x (M, K) f32, qweight (N, K) int8, scale (N,) f32, bias (N,) f32 | None) -> (M, N) f32``,
  ``y = (x @ qweight.T) * scale + bias``
* ``linear_w16(x (M, K) f32, weight (N, K) bf16 | f16, bias (N,) f32 | None) -> (M, N) f32``: the weight
  widened exactly as it is read, so ``linear_f32``'s bits on ``weight.float()`` at half its bytes
* ``linear_int4(x (M, K) f32, qweight (N, K / 2) uint8, scale_offset (N, K / G, 2) f32, bias | None)
  -> (M, N) f32``: packed 4-bit codes with a (scale, offset) per group of G columns, widened in registers
  (cpu_linear_int4.cpp: the layout); ``dequantize_int4(qweight, scale_offset) -> (N, K) f32``;
  ``use_avx512_int4(enabled) -> bool``, ``use_vnni_int4`` and ``use_amx_int4`` switch its AVX-512, VNNI
  and AMX-INT8 paths (tests, A/B runs; cpu_linear_int4_amx.cpp: the tiles). A ``scale_offset`` of shape
  ``(N / 16, K / G, 2, 16)`` marks the tile layout W is repacked into at load on AMX-INT8 and AVX512-VNNI CPUs
  (cpu_linear_int4_tiles.cpp; worker/layers/int4_matmul.py, pack_tiles), which both ops read;
  ``int4_tiles_enabled() -> bool`` says whether layers are repacked, ``use_int4_tiles(enabled)`` switches it
* ``linear_w8(x (M, K) f32, qweight (N, K) uint8, scale_offset (N, K / G, 2) f32, bias | None) -> (M, N) f32``:
  8-bit codes with a (scale, offset) per group of G columns, widened in registers (cpu_linear_w8.cpp: group-wise
  or asymmetric 8-bit checkpoints); ``dequantize_w8(qweight, scale_offset) -> (N, K) f32``;
  ``use_avx512_w8(enabled) -> bool`` switches its AVX-512 path (tests)
* ``linear_fp8(x (M, K) f32, weight (N, K) float8_e4m3fn, scale (N, K / G) f32, bias | None) -> (M, N) f32``:
  e4m3 weights with a scale per row and group of G columns, converted in registers (cpu_linear_fp8.cpp);
  ``dequantize_fp8(weight, scale) -> (N, K) f32``
* ``paged_attention(q (T, H, d) f32, k_cache, v_cache (num_blocks, block_size, KVH, d) f32,
  block_tables (S, B) int64, query_start_loc (S + 1,) int64, context_lens (S,) int64, scale,
  sliding_window=0, logit_softcap=0.0, sinks=None, k_scale=None, v_scale=None, k_offset=None)
  -> (T, H, d) f32``: each sequence's few query tokens (causal; within the last ``sliding_window``
  positions when > 0, blocks before them unread; scores soft-capped when ``logit_softcap`` > 0)
  over its paged context (cpu_attention.cpp); an int8 / float8_e4m3fn cache with its bfloat16
  ``(num_blocks, KVH, block_size)`` scales and float32 ``(KVH, d)`` key offset (worker/kv_quant.py)
* ``rms_norm``, ``add_rms_norm``, ``silu_and_mul``, ``rotary_and_cache`` (``qk_norm_rotary_and_cache``:
  after a per-head q/k RMSNorm): the decoder layer's elementwise work in one pass each (cpu_elementwise.cpp)
* ``attention_block`` and ``mlp_block`` (a tensor-parallel rank's layer), and the class
  ``torch.classes.tpserve_cpu.DecodeLayers`` (one rank's whole stack): a Llama-family decode step as
  two calls a layer, or one call, of the kernels above, bit-identical to the module path
  (cpu_decode_block.cpp; worker/layers/decode_block.py); with LoRA adapter slots, each projection's
  low-rank sum for the step's adapter rows too. A ``DecodeLayers`` step whose projections are float32, int8, fp8
  (up to 8 rows, AVX-512) or int4 (tiles: any rows with AMX-INT8, up to 16 with AVX512-VNNI alone; row-major
  up to 4 rows, AVX512-VNNI), on a float32 or 8-bit cache
  without adapter rows, runs in one OpenMP parallel region, bit-identical to the ops (cpu_decode_region.cpp); ``use_decode_region(enabled) -> bool``
  switches it (tests, A/B runs), ``decode_region_steps() -> int`` counts the steps it ran
* ``lora_add_(y (T, N) f32, x (T, K) f32, lora_a (L, P*R, K) f32, lora_b (L, P*R, N) f32, row_slots (T,) int64,
  part_widths)``: ``y[t] += (x[t] @ lora_a[s].T) @ lora_b[s]`` in place for each row whose slot index
  ``s = row_slots[t]`` is not -1, a fused layer's ``lora_b`` block diagonal over ``part_widths``
  (punica's SGMV/BGMV; cpu_lora.cpp, worker/layers/lora.py); ``lora_use_avx512(enabled) -> bool`` switches
  its AVX-512 expand (tests)
* ``sampling_uniform(seeds (N,) int64, positions (N,) int64, vocab_size) -> (N, V) f32`` and
  ``exponential_race(probs (N, V) f32, log_u (N, V) f32) -> ((N,) int64, (N,) bool)``: the sampler's
  counter-based uniforms and the exponential race's argmax with the rows' finiteness (cpu_sampling.cpp;
  the same bits as worker/sampler.py's tensor ops)
* ``shm_collective(x, base, rank, num_ranks, max_bytes, seq, publish, reduce, spin_s, wait_s) -> bool``:
  one shared-memory all-reduce or exchange between same-host ranks (cpu_shm.cpp; the protocol is
  worker/comm/shm_allreduce.py's)
* ``use_avx512(enabled) -> bool``: switch the linears' AVX-512 path off and on (tests, A/B runs)

The GPU's counterpart of ``paged_attention`` is a Triton kernel, not built here:
triton_attention.py (``paged_decode_attention``, one query row per sequence).

They need an x86-64 CPU with AVX2 and FMA (the linears also use AVX-512 where the CPU has it),
a C++ compiler and ninja. The shared
library is built with ``torch.utils.cpp_extension`` into
``$TPSERVE_KERNEL_CACHE`` (default ``~/.cache/tpserve/kernels``) under a name that
hashes the source, the flags and the torch version, so a changed source or a
new torch rebuilds it and a process that finds it built only loads it (``python
-m worker.kernels`` builds it ahead, as ``deploy/setup.sh`` does). Where any of
this is missing, :func:`cpu_kernels_available` is False and the callers keep
torch's own GEMMs: the kernels are a speed-up, never a requirement.
``TPSERVE_CPU_KERNELS=0`` switches them off (for A/B measurements).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path

import torch

_SOURCES = sorted(Path(__file__).parent.glob("*.cpp"))
_HEADERS = sorted(Path(__file__).parent.glob("*.h"))
#: The sources compiled together, one translation unit per group (a "unity" build): torch's headers
#: cost about 5.5 s of compiler time per unit, most of a source's own, so five units took 45 CPU-s
#: (26 s on 2 cores) and these two take 17 (10 s). Files of one group share a unit's namespace, so
#: two of them must not define the same internal name (cpu_elementwise and cpu_sampling both have a
#: ``check_rows``). A source in no group is a unit of its own.
_UNITS = (("cpu_attention.cpp", "cpu_decode_block.cpp", "cpu_decode_region.cpp", "cpu_elementwise.cpp", "cpu_lora.cpp",
           "cpu_shm.cpp"),
          ("cpu_linear.cpp", "cpu_dequantize_int4.cpp", "cpu_linear_int4_amx.cpp", "cpu_linear_int4_tiles.cpp",
           "cpu_linear_int4.cpp", "cpu_linear_fp8.cpp", "cpu_linear_w8.cpp", "cpu_sampling.cpp"))
# -fopenmp: at::parallel_for is inline OpenMP in ATen's headers. -ffp-contract=off: no multiply-add
# is fused unless the source asks (the elementwise kernels keep torch's roundings).
_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-ffp-contract=off"]  # F16C: every AVX2 CPU has it
_log = logging.getLogger(__name__)


def _build_directory() -> Path:
    key = hashlib.sha256()
    for source in _SOURCES + _HEADERS:
        key.update(source.read_bytes())
    key.update(" ".join(_FLAGS).encode())
    key.update(repr(_UNITS).encode())
    key.update(torch.__version__.encode())
    root = Path(os.environ.get("TPSERVE_KERNEL_CACHE", Path.home() / ".cache" / "tpserve" / "kernels"))
    return root / key.hexdigest()[:16]


def _unit_sources(directory: Path) -> list[Path]:
    """Write one ``unit<i>.cpp`` per group of :data:`_UNITS` into ``directory``, each including its sources
    by absolute path (compiler messages still name them); returns the units and the ungrouped sources."""
    grouped = {name for unit in _UNITS for name in unit}
    by_name = {source.name: source for source in _SOURCES}
    units = []
    for i, unit in enumerate(_UNITS):
        path = directory / f"unit{i}.cpp"
        path.write_text("".join(f'#include "{by_name[name]}"\n' for name in unit if name in by_name))
        units.append(path)
    return units + [source for source in _SOURCES if source.name not in grouped]


def _build(directory: Path, library: Path) -> None:
    """Compile into a private directory, load it, then move the library into place atomically.

    A rank that starts while another builds either finds no library (and builds its
    own copy) or the finished one, never a half-written file.
    """
    import shutil
    import tempfile

    from torch.utils import cpp_extension

    directory.mkdir(parents=True, exist_ok=True)
    # A first build takes 10-35 s on 2 cores (up to 80 s on a busy one): say so, or a quiet rank looks hung.
    _log.warning("compiling the tpserve CPU kernels (first use of these sources, 10-80 s; cached in %s)",
                 directory)
    private = Path(tempfile.mkdtemp(prefix="build-", dir=directory))
    try:
        cpp_extension.load(name="tpserve_cpu_kernels", sources=[str(s) for s in _unit_sources(private)],
                           extra_cflags=_FLAGS,
                           extra_ldflags=["-fopenmp"], build_directory=str(private),
                           is_python_module=False, verbose=False)
        os.replace(private / library.name, library)
    finally:
        shutil.rmtree(private, ignore_errors=True)


def _cpu_supports_avx2() -> bool:
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


@functools.cache
def cpu_kernels_available() -> bool:
    """Whether ``torch.ops.tpserve_cpu`` is loaded in this process (built on the first call if need be).

    Never raises: a CPU without AVX2, a missing compiler or ninja, or a failed
    build logs one warning and returns False.
    """
    if os.environ.get("TPSERVE_CPU_KERNELS", "1") == "0" or not _cpu_supports_avx2():
        return False
    directory = _build_directory()
    library = directory / "tpserve_cpu_kernels.so"
    try:
        if library.exists():
            torch.ops.load_library(str(library))
        else:
            _build(directory, library)
    except Exception as exc:  # noqa: BLE001 - any build or load failure means: use torch's GEMMs
        _log.warning("tpserve CPU kernels unavailable, using torch's GEMMs: %s", exc)
        return False
    return hasattr(torch.ops.tpserve_cpu, "linear_f32")
