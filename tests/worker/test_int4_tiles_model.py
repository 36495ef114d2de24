"""A Llama whose every projection takes the int4 tile layout, through ``ModelRunner`` at tp 1 and 2 (gloo).

The tiny Llama of tests/worker/test_int4.py keeps 64 input columns in most projections, so only its down
projection is repacked (worker/layers/int4_matmul.py, tile_layout_applies). This one has hidden 256,
intermediate 256, 4 heads of 64 and 2 KV heads: q/k/v (512 rows), o (256 x 256), gate/up (512 rows) and down
(256 x 256) all have rows a multiple of 16 and columns a multiple of 128 on each rank at tp 1 and 2 (tp 4
would give o and down 64 columns a rank, which groups of 128 cannot split: refused at load for RTN). Served as

* ``--quantization int4`` on its float checkpoint (RTN, groups of 128);
* an asymmetric GPTQ checkpoint with groups of 128 (zero points, ``offset = -s * z`` in the layout's offsets).

Each: every greedy token equals ``transformers``' on the DEQUANTIZED float checkpoint
(tests/worker/int4_checkpoints.py) in the standard scenarios (tests/worker/scenarios.py: 16 sequences at once,
chunked prefill, prefix hits, preemption: prefill-sized and decode-sized x through the tiles), and the logits
agree within atol = rtol = 1e-4 (the bound of tests/worker/test_int4.py: x is carried as 24-bit fixed point
per 128 columns). Measured max |diff| 5.0e-5 to 7.1e-5 (logits up to 28); on the same RTN model the row-major
layout's paths gave 6.9e-5 and the float model's 3.0e-5 (run once with ``use_int4_tiles(False)``). The load itself is checked in process: every projection's ``weight_scale`` is the tile
layout's ``(N / 16, K / G, 2, 16)``.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.tiny_models import TinyModelSpec, load_hf_model, save_tiny_model
from tests.worker.int4_checkpoints import save_gptq, save_rtn_dequantized
from tests.worker.scenarios import build_plans, hf_reference, standard_specs
from tests.worker.tp_harness import Job, StepRecord, run_jobs
from tpserve.model_config import ModelConfig
from worker.kernels import cpu_kernels_available
from worker.loader import load_model
from worker.parallel_state import ParallelContext

pytestmark = pytest.mark.skipif(not (cpu_kernels_available() and torch.ops.tpserve_cpu.int4_tiles_enabled()),
                                reason="this CPU has neither AMX-INT8 (given to this process) nor AVX512-VNNI: "
                                       "no layer takes the tile layout")

SPEC = TinyModelSpec("int4_tiles", "llama", {"hidden_size": 256, "intermediate_size": 256, "num_attention_heads": 4,
                                             "num_key_value_heads": 2, "vocab_size": 190,
                                             "tie_word_embeddings": False}, seed=11)
BLOCK_SIZE = 4
NUM_BLOCKS = 64
LOGIT_BOUND = 1e-4


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(SPEC, tmp_path_factory.mktemp("int4_tiles") / "float")


@pytest.fixture(scope="module")
def cases(float_dir: Path) -> dict[str, tuple[Job, list, dict, dict]]:
    root = float_dir.parent
    gptq, gptq_reference = save_gptq(float_dir, root / "gptq", root / "gptq_dq", group=128, sym=False,
                                     desc_act=False, seed=2)
    sources = {"rtn": (float_dir, save_rtn_dequantized(float_dir, root / "rtn_dq"), "int4"),
               "gptq_asym_g128": (gptq, gptq_reference, None)}
    out = {}
    for seed, (name, (checkpoint, reference, quantization)) in enumerate(sources.items()):
        specs = standard_specs(SPEC.config["vocab_size"], seed=seed)
        completions, logits = hf_reference(load_hf_model(reference), specs)
        plans, expected = build_plans(specs, completions, BLOCK_SIZE, NUM_BLOCKS, seed=seed)
        job = Job(name, str(checkpoint), tuple(plans), NUM_BLOCKS, BLOCK_SIZE, quantization=quantization)
        out[name] = (job, expected, completions, logits)
    return out


@pytest.fixture(scope="module")
def records_at(cases):
    cache: dict[int, dict[str, list[StepRecord]]] = {}

    def run(tp: int) -> dict[str, list[StepRecord]]:
        if tp not in cache:
            cache[tp] = run_jobs([job for job, *_ in cases.values()], tp_size=tp)
        return cache[tp]

    return run


def test_every_projection_is_loaded_in_the_tile_layout(float_dir: Path) -> None:
    config = replace(ModelConfig.from_pretrained(float_dir), quantization="int4")
    model = load_model(float_dir, config, ParallelContext.single(), torch.float32)
    scales = {name: tuple(p.shape) for name, p in model.named_parameters() if name.endswith("weight_scale")}
    assert len(scales) == 8  # 2 layers x (qkv, o, gate_up, down)
    for name, shape in scales.items():
        rows = {"qkv_proj": 512, "o_proj": 256, "gate_up_proj": 512, "down_proj": 256}[name.split(".")[-2]]
        assert shape == (rows // 16, 2, 2, 16), (name, shape)  # 256 input columns: 2 groups of 128


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", ["rtn", "gptq_asym_g128"])
def test_tile_layout_tokens_and_logits_match_transformers(tp: int, name: str, records_at, cases) -> None:
    _, expected, completions, logits = cases[name]
    records = records_at(tp)[name]
    assert len(records) == len(expected)
    worst = 0.0
    for step, (record, samples) in enumerate(zip(records, expected, strict=True)):
        assert record.sampled_token_ids == tuple(completions[s][i] for s, i in samples), f"step {step}"
        if samples:
            want = torch.stack([logits[s][i] for s, i in samples])  # (N, V)
            worst = max(worst, float((record.logits - want).abs().max()))
            torch.testing.assert_close(record.logits, want, atol=LOGIT_BOUND, rtol=LOGIT_BOUND,
                                       msg=lambda m: f"step {step}: {m}")
    print(f"{name} tp={tp}: max |logit diff| {worst:.2e}")
