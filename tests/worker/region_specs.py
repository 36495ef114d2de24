"""Tiny checkpoints whose every projection takes the int4 tile layout, for the CPU decode region's tests.

Rows a multiple of 16 and columns of 128 (on AMX-INT8 and AVX512-VNNI CPUs, ``--quantization int4`` repacks such
layers at load: worker/layers/int4_weights.py), so that their decode steps run in one parallel region
(worker/kernels/cpu_decode_region.cpp): at one rank (tests/worker/test_decode_block.py) and on two tensor-parallel
ranks, where each rank's slices keep those shapes (tests/worker/test_decode_region_tp.py); with AVX512-VNNI alone,
steps of up to 16 rows (``torch.ops.tpserve_cpu.int4_tiles_take_rows``). With the row-major layout
(``use_int4_tiles(False)``) the region takes them where ``linear_int4`` takes its AVX512-VNNI path (groups of
128, up to 4 rows of x: :func:`int4_vnni`).
"""

from __future__ import annotations

import torch

from tests.tiny_models import TinyModelSpec

INT4_TILES = TinyModelSpec("int4_tiles_block", "llama", {
    "hidden_size": 256, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
    "vocab_size": 190, "tie_word_embeddings": False}, seed=23)
QWEN2_INT4_TILES = TinyModelSpec("qwen2_int4_tiles_block", "qwen2", {
    "hidden_size": 256, "intermediate_size": 384, "num_attention_heads": 4, "num_key_value_heads": 1,
    "vocab_size": 170}, seed=24)  # q/k/v biases, MQA
MISTRAL_WINDOW_INT4_TILES = TinyModelSpec("mistral_window_int4_block", "mistral", {
    "hidden_size": 256, "intermediate_size": 256, "num_attention_heads": 8, "num_key_value_heads": 2,
    "head_dim": 32, "vocab_size": 150, "sliding_window": 6}, seed=25)
INT4_SPECS = {spec.name: spec for spec in (INT4_TILES, QWEN2_INT4_TILES, MISTRAL_WINDOW_INT4_TILES)}


def int4_vnni() -> bool:
    """Whether ``linear_int4``'s AVX512-VNNI path is on (an AVX512-VNNI CPU; it is on by default, and this leaves it
    on): then the decode region takes the row-major int4 layout's steps of up to 4 rows."""
    return bool(torch.ops.tpserve_cpu.use_vnni_int4(True))
