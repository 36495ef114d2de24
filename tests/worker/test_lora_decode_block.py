"""LoRA in the compiled decode step (worker/layers/decode_block.py, worker/kernels/cpu_lora.cpp).

* ``lora_add_`` (punica's BGMV on the CPU) equals the per-adapter GEMM pairs on a batch that mixes
  adapter rows, base rows (-1) and a rank padded to the pool's, and refuses a slot outside the pool.
* With ``--enable-lora`` and no adapter row in a step, the compiled decode stack (and the
  tensor-parallel halves) still runs, and its hidden states and caches equal, bit for bit, those of
  a runner without LoRA: the base model's steps pay nothing.
* With adapter rows in decode steps (three adapters and the base model, 4 sequences each), the
  compiled path runs ``forward_lora`` / the blocks with the rows' slots, and every step's hidden
  states are within 1e-5 of the module path's (its linear layers' LoRA, by ``lora_add_`` and by
  the grouped GEMMs of hosts without the compiled kernels), with the same tokens.
  The base rows of that batch match the base model's alone; every adapter row moves.
  (Both paths against peft's merged model: tests/worker/test_lora.py.)
* With 8 such rows on an AVX-512 CPU the step runs in the parallel region (worker/kernels/cpu_decode_region.cpp),
  bit-identical to ``forward_lora``'s ops, o's and down's biases included.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import worker.layers.decode_block as decode_block
import worker.models.llama as llama
from tests.tiny_models import TINY_MODELS, save_tiny_model
from tests.worker.lora_checkpoints import ALL_TARGETS, AdapterSpec, save_adapter
from tpserve.step import NewSequence, SamplingParams, ScheduledChunk, StepPlan
from worker.kernels import _cpu_supports_avx2, cpu_kernels_available
from worker.lora_settings import LoRASettings
from worker.model_runner import ModelRunner
from worker.parallel_state import ParallelContext

pytestmark = pytest.mark.skipif(not (_cpu_supports_avx2() and shutil.which("c++")),
                                reason="the decode block and lora_add_ are compiled kernels: need AVX2 and a C++ compiler")

BLOCK_SIZE = 4
GREEDY = SamplingParams(temperature=0.0)
ADAPTERS = (
    AdapterSpec("all_r4", 4, 8.0, ALL_TARGETS, seed=31),
    AdapterSpec("qv_down_r8_rslora", 8, 16.0, ("q_proj", "v_proj", "down_proj"), use_rslora=True, seed=32),
    AdapterSpec("k_o_mlp_r2", 2, 4.0, ("k_proj", "o_proj", "gate_proj", "up_proj"), seed=33),
)


@pytest.mark.parametrize("avx512", [True, False], ids=["avx512_where_present", "avx2"])
@pytest.mark.parametrize(("parts", "width"), [([], 6), ([], 5), ([30, 21, 21], 6)],
                         ids=["one_part", "odd_rank", "fused_qkv"])
def test_lora_add_equals_grouped_gemms(parts: list[int], width: int, avx512: bool) -> None:
    """Rows of 3 slots (up to 7 rows each: tiles of 4 and their remainders) and base rows, one slot padded
    (rank 1 of 2 per part): ``y += (x @ A_s^T) @ B_s`` per row; a fused layer's ``B`` block diagonal."""
    assert cpu_kernels_available()
    generator = torch.Generator().manual_seed(0)
    num_slots, k, n, t = 3, 43, 72, 27  # k and the parts not multiples of 8: the tails too
    a = torch.randn(num_slots, width, k, generator=generator)
    b = torch.randn(num_slots, width, n, generator=generator)
    if parts:  # part p's 2 rows of B reach only its columns
        mask = torch.block_diag(*[torch.ones(2, w) for w in parts])  # (6, 72)
        b *= mask
    a[1, 1::2] = 0  # slot 1 holds a rank-1 adapter in each part: its padded rows of A are zero
    b[1, 1::2] = 0
    x = torch.randn(t, k, generator=generator)
    y = torch.randn(t, n, generator=generator)
    row_slots = torch.tensor([i % 4 - 1 for i in range(t)], dtype=torch.int64)  # -1, 0, 1, 2, -1, ...
    want = y.clone()
    for index in range(num_slots):
        rows = (row_slots == index).nonzero().flatten()
        want.index_add_(0, rows, (x[rows] @ a[index].T) @ b[index])
    got = y.clone()
    torch.ops.tpserve_cpu.lora_use_avx512(avx512)
    try:
        torch.ops.tpserve_cpu.lora_add_(got, x, a, b, row_slots, parts)
    finally:
        torch.ops.tpserve_cpu.lora_use_avx512(True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[row_slots == -1], y[row_slots == -1])  # base rows untouched
    with pytest.raises(RuntimeError, match="row 0 has slot index 3 outside"):
        torch.ops.tpserve_cpu.lora_add_(got, x, a, b, torch.full((t,), 3, dtype=torch.int64), [])


class _Steps:
    """A one-rank runner of ``checkpoint`` (with ``lora`` slots, or none) and its steps' final hidden states."""

    def __init__(self, checkpoint: Path, lora: LoRASettings | None, path: str, batched: bool = True) -> None:
        self.runner = ModelRunner(checkpoint, ParallelContext.single(), torch.float32, BLOCK_SIZE, lora=lora)
        self.runner.init_kv_cache(num_blocks=128)
        model = self.runner.model.model
        assert all(layer.decode_block for layer in model.layers) and model.decode_stack is not None
        if path != "stack":
            model.decode_stack = None  # "halves": the tensor-parallel form, layer by layer
        if path == "modules":
            for layer in model.layers:
                layer.decode_block = False
        if not batched:  # the linears' LoRA without lora_add_: a GEMM pair per adapter (no compiled kernels)
            assert self.runner.lora is not None
            for layer in self.runner.lora.layers.values():
                layer.lora.batched = False
        self.hidden: list[torch.Tensor] = []
        model.register_forward_hook(lambda module, args, out: self.hidden.append(out.clone()))


def _run(steps: _Steps, slots: list[int]) -> list[tuple[int, ...]]:
    """Prefill one prompt per entry of ``slots`` (sequence ``i`` under slot ``slots[i]``), then 8 decode steps
    of all of them; returns each step's sampled tokens."""
    prompts = [[3 + (5 * i + j) % 60 for j in range(3 + i % 5)] for i in range(len(slots))]
    new = tuple(NewSequence(i, GREEDY, lora_slot=slot) for i, slot in enumerate(slots))
    chunks = [ScheduledChunk(i, tuple(p), 0, tuple(range(8 * i, 8 * i + 8))) for i, p in enumerate(prompts)]
    positions = [len(p) for p in prompts]
    out = []
    for step in range(9):
        result = steps.runner.execute(StepPlan(step + 1, new if step == 0 else (), tuple(chunks), ()))
        out.append(tuple(result.sampled_token_ids))
        chunks = [ScheduledChunk(i, (token,), positions[i]) for i, token in enumerate(result.sampled_token_ids)]
        positions = [p + 1 for p in positions]
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, LoRASettings]]:
    """Llama (GQA, tied; MQA with o_proj and MLP biases) and Qwen3 (QK-norm) with the three adapters in a pool of 4
    slots."""
    root = tmp_path_factory.mktemp("lora_decode_block")
    out = {}
    for spec in TINY_MODELS:
        if spec.name in ("gqa_tied", "qwen3_qk_norm", "mqa_untied_bias"):
            base = save_tiny_model(spec, root / spec.name)
            paths = []
            for adapter in ADAPTERS:
                save_adapter(base, adapter, root / f"{spec.name}-{adapter.name}")
                paths.append(str(root / f"{spec.name}-{adapter.name}"))
            out[spec.name] = (base, LoRASettings(max_loras=4, max_lora_rank=8, adapter_paths=tuple(paths)))
    return out


def _count_calls(monkeypatch: pytest.MonkeyPatch, path: str) -> list[bool]:
    """Each compiled decode call of ``path``, as whether it had adapter rows."""
    calls: list[bool] = []
    if path == "stack":
        stack_call = decode_block.DecodeStack.__call__
        monkeypatch.setattr(decode_block.DecodeStack, "__call__", lambda self, *args: calls.append(
            decode_block.lora_row_slots(self._layers[0]) is not None) or stack_call(self, *args))
    else:
        forward = llama.decode_block_forward
        monkeypatch.setattr(llama, "decode_block_forward", lambda layer, *args: calls.append(
            decode_block.lora_row_slots(layer) is not None) or forward(layer, *args))
    return calls


@pytest.mark.parametrize("path", ["stack", "halves"])
@pytest.mark.parametrize("name", ["gqa_tied", "qwen3_qk_norm"])
def test_base_steps_with_lora_enabled_are_the_no_lora_path(name: str, path: str, checkpoints: dict,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    base, settings = checkpoints[name]
    calls = _count_calls(monkeypatch, path)
    with_lora = _Steps(base, settings, path)
    calls.clear()  # init_kv_cache's warm-up step
    tokens = _run(with_lora, [0] * 6)
    num_layers = 1 if path == "stack" else len(with_lora.runner.model.model.layers)
    # Every decode step (and the short prompts' prefill, which the paged kernel reads as decodes too)
    # took the compiled path, with no LoRA argument.
    assert len(calls) >= num_layers * 8 and not any(calls)
    without = _Steps(base, None, path)
    assert _run(without, [0] * 6) == tokens
    for step, (a, b) in enumerate(zip(with_lora.hidden, without.hidden, strict=True)):
        assert torch.equal(a, b), f"step {step}: max difference {(a - b).abs().max().item():.3g}"
    for (k_a, v_a), (k_b, v_b) in zip(with_lora.runner.kv_caches, without.runner.kv_caches, strict=True):
        assert torch.equal(k_a, k_b) and torch.equal(v_a, v_b)


@pytest.mark.parametrize("path", ["stack", "halves"])
@pytest.mark.parametrize("name", ["gqa_tied", "qwen3_qk_norm"])
def test_adapter_decode_steps_take_the_compiled_path(name: str, path: str, checkpoints: dict,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    base, settings = checkpoints[name]
    slots = [i % 4 for i in range(16)]  # the base model and the three adapters, 4 sequences each
    calls = _count_calls(monkeypatch, path)
    compiled = _Steps(base, settings, path)
    calls.clear()  # init_kv_cache's warm-up step
    tokens = _run(compiled, slots)
    num_layers = 1 if path == "stack" else len(compiled.runner.model.model.layers)
    assert len(calls) >= num_layers * 8 and all(calls)  # every decode step: compiled, with the adapter rows' slots
    for batched in (True, False):  # the module path with lora_add_, and with grouped GEMMs
        modules = _Steps(base, settings, "modules", batched)
        assert _run(modules, slots) == tokens
        for step, (a, b) in enumerate(zip(compiled.hidden, modules.hidden, strict=True)):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m, step=step: f"step {step}: {m}")
    without = _Steps(base, None, path)  # the base model alone: the adapters move their rows, not the others
    _run(without, [0] * len(slots))
    adapted = torch.tensor(slots) > 0
    torch.testing.assert_close(compiled.hidden[-1][~adapted], without.hidden[-1][~adapted], atol=1e-6, rtol=1e-6)
    assert (compiled.hidden[-1][adapted] - without.hidden[-1][adapted]).abs().amax(dim=1).min() > 1e-3


@pytest.mark.skipif(not (cpu_kernels_available() and torch.backends.cpu.get_cpu_capability() == "AVX512"),
                    reason="the float32 decode region is the streamed GEMV of an AVX-512 CPU")
@pytest.mark.parametrize("name", ["gqa_tied", "qwen3_qk_norm", "mqa_untied_bias"])
def test_adapter_decode_steps_in_the_region_equal_the_ops(name: str, checkpoints: dict) -> None:
    """8 sequences (the base model and the three adapters, two each) decode in the parallel region
    (worker/kernels/cpu_decode_region.cpp: each projection's adapter tiles split between the two threads, then o's
    and down's bias after their sums, as the op path adds them) and as ``forward_lora``'s ops
    (``use_decode_region(False)``): every step's hidden states, the tokens and the caches equal, bit for bit."""
    base, settings = checkpoints[name]
    slots = [i % 4 for i in range(8)]
    ops = torch.ops.tpserve_cpu
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        region = _Steps(base, settings, "stack")
        steps = ops.decode_region_steps()
        tokens = _run(region, slots)
        assert ops.decode_region_steps() - steps == 8  # every decode step; the prefill's 8 prompts are 40 rows
        ops.use_decode_region(False)
        try:
            op_path = _Steps(base, settings, "stack")
            assert _run(op_path, slots) == tokens
        finally:
            ops.use_decode_region(True)
    finally:
        torch.set_num_threads(before)
    for step, (a, b) in enumerate(zip(region.hidden, op_path.hidden, strict=True)):
        assert torch.equal(a, b), f"step {step}: max difference {(a - b).abs().max().item():.3g}"
    for (k_a, v_a), (k_b, v_b) in zip(region.runner.kv_caches, op_path.runner.kv_caches, strict=True):
        assert torch.equal(k_a, k_b) and torch.equal(v_a, v_b)
