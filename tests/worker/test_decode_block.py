"""The decode layer in two compiled calls (worker/layers/decode_block.py) equals the module path bit for bit.

Two runners of one checkpoint take the same steps: one as served (a decode step runs the
whole stack as one ``DecodeLayers`` call, or, in the tensor-parallel form, each layer as
``attention_block`` and ``mlp_block``), one with the decode block off (the modules, op by op). The steps mix what a decode step meets: a prefill of three
prompts (the module path in both), decodes of all three at growing contexts (past a
sliding window where the model has one), a short prompt that joins the decode group and
a preempted sequence that leaves it. The final hidden states of every step, the sampled
tokens and both KV caches at the end must be equal, not close: the two paths run the same
kernels in the same order. The checkpoints cover every projection with a bias (Llama's
o_proj and MLP biases, Qwen2's q/k/v), GQA and MQA, a head size of 32, Llama 3 RoPE,
Phi-3's fused checkpoint, a window, Qwen3's QK-norm, weight-only int8, and a group-wise 8-bit GPTQ
checkpoint (its layers' uint8 codes of K columns take the w8 op, not int4's, and the region's w8 rows), FP8
weights kept as e4m3, int4 in the tile layout, and 8-bit KV caches.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import worker.layers.decode_block as decode_block
import worker.models.llama as llama
from tests.tiny_models import TinyModelSpec, save_tiny_model
from tests.worker.lowbit_checkpoints import save_fp8_block
from tests.worker.region_specs import INT4_SPECS, INT4_TILES, MISTRAL_WINDOW_INT4_TILES, QWEN2_INT4_TILES, int4_vnni
from tests.worker.w8a16_checkpoints import save_gptq8
from tpserve.step import NewSequence, SamplingParams, ScheduledChunk, StepPlan
from worker.kernels import _cpu_supports_avx2, cpu_kernels_available
from worker.model_runner import ModelRunner
from worker.parallel_state import ParallelContext

pytestmark = pytest.mark.skipif(not (_cpu_supports_avx2() and shutil.which("c++")),
                                reason="the decode block is a compiled kernel: needs an AVX2 CPU and a C++ compiler")

BLOCK_SIZE = 4
GREEDY = SamplingParams(temperature=0.0)
WINDOW = 6
MISTRAL_WINDOW = TinyModelSpec("mistral_window_block", "mistral", {
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 150,
    "sliding_window": WINDOW}, seed=21)


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to ``n`` inside (the test process runs on one: tests/conftest.py)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class _Steps:
    """A runner, its steps' final hidden states, and its own block allocation (one table per sequence)."""

    def __init__(self, checkpoint: Path, quantization: str | None, decode_block: bool,
                 kv_cache_dtype: str = "auto") -> None:
        self.runner = ModelRunner(checkpoint, ParallelContext.single(), torch.float32, BLOCK_SIZE,
                                  quantization=quantization, kv_cache_dtype=kv_cache_dtype)
        self.runner.init_kv_cache(num_blocks=64)
        layers = self.runner.model.model.layers
        if not decode_block:
            self.runner.model.model.decode_stack = None
            for layer in layers:
                layer.decode_block = False
        self.supported = all(layer.decode_block for layer in layers)
        self.hidden: list[torch.Tensor] = []
        self.runner.model.model.register_forward_hook(lambda module, args, out: self.hidden.append(out.clone()))

    def step(self, plan: StepPlan) -> dict[int, int]:
        """The plan's sampled tokens by sequence (every chunk samples)."""
        result = self.runner.execute(plan)
        return dict(zip((chunk.seq_id for chunk in plan.scheduled), result.sampled_token_ids, strict=True))


def _run(steps: _Steps) -> list[dict[int, int]]:
    """Drive ``steps`` through the scenario of the module docstring; returns each step's sampled tokens."""
    prompts = {0: list(range(3, 8)), 1: list(range(20, 31)), 2: list(range(40, 60))}
    blocks = {seq: list(range(16 * seq, 16 * seq + 16)) for seq in range(4)}
    positions: dict[int, int] = {}
    last: dict[int, int] = {}
    out = []
    plan_id = 0

    def run(new: tuple[NewSequence, ...], chunks: list[ScheduledChunk], finished: tuple[int, ...] = ()) -> None:
        nonlocal plan_id
        plan_id += 1
        sampled = steps.step(StepPlan(plan_id, new, tuple(chunks), finished))
        for chunk in chunks:
            positions[chunk.seq_id] = chunk.start_position + len(chunk.token_ids)
        last.update(sampled)
        out.append(sampled)

    def prefill(seq: int) -> ScheduledChunk:
        return ScheduledChunk(seq, tuple(prompts[seq]), 0, tuple(blocks[seq]))

    def decode(seq: int) -> ScheduledChunk:
        return ScheduledChunk(seq, (last[seq],), positions[seq])

    run(tuple(NewSequence(s, GREEDY) for s in (0, 1, 2)), [prefill(s) for s in (0, 1, 2)])
    for _ in range(10):
        run((), [decode(s) for s in (0, 1, 2)])
    prompts[3] = [9, 8, 7]  # a short prompt: it joins the decode group's paged kernel
    run((NewSequence(3, GREEDY),), [decode(s) for s in (0, 1, 2)] + [prefill(3)])
    for _ in range(4):
        run((), [decode(s) for s in (0, 1, 2, 3)])
    run((), [decode(s) for s in (0, 2, 3)], finished=(1,))  # sequence 1 leaves the batch
    for _ in range(3):
        run((), [decode(s) for s in (0, 2, 3)])
    return out


@pytest.mark.parametrize("halves", [False, True], ids=["stack", "two_halves"])
@pytest.mark.parametrize(("name", "quantization", "kv_cache_dtype"), [
    ("gqa_tied", None, "auto"), ("mqa_untied_bias", None, "auto"), ("qwen2_qkv_bias", None, "auto"),
    ("llama3_rope", None, "auto"), ("phi3_fused", None, "auto"), ("mistral_window", None, "auto"),
    ("qwen3_qk_norm", None, "auto"), ("gqa_tied", "int8", "auto"), ("mqa_untied_bias", "int8", "auto"),
    ("gqa_tied_gptq8", None, "auto"), (INT4_TILES.name, "int4", "auto"), (QWEN2_INT4_TILES.name, "int4", "auto"),
    (MISTRAL_WINDOW_INT4_TILES.name, "int4", "auto"), ("gqa_tied", None, "int8"), ("qwen3_qk_norm", "int8", "fp8"),
    (MISTRAL_WINDOW_INT4_TILES.name, "int4", "fp8"), ("gqa_tied_fp8_weights", "fp8", "auto"),
])
def test_decode_block_equals_the_module_path(name: str, quantization: str | None, kv_cache_dtype: str, halves: bool,
                                             tiny_checkpoints: dict[str, Path], tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """``halves``: the tensor-parallel form, per layer (``attention_block``, the all-reduce, ``mlp_block``),
    here on one rank, where the all-reduce is the identity; else one rank's :class:`DecodeStack`, on two threads
    (the parallel region splits its work between them; the test process's default is one)."""
    with _threads(1 if halves else 2):
        _module_path_case(name, quantization, kv_cache_dtype, halves, tiny_checkpoints, tmp_path, monkeypatch)


def _module_path_case(name: str, quantization: str | None, kv_cache_dtype: str, halves: bool,
                      tiny_checkpoints: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if name == "mistral_window":
        checkpoint = save_tiny_model(MISTRAL_WINDOW, tmp_path / "mistral")
    elif name == "gqa_tied_gptq8":  # 8-bit GPTQ with zero points, group 32: grouped bytes, the w8 op
        checkpoint = save_gptq8(tiny_checkpoints["gqa_tied"], tmp_path / "gptq8", tmp_path / "gptq8_dq", group=32,
                                sym=False)[0]
    elif name == "gqa_tied_fp8_weights":  # block-scaled FP8 kept as e4m3 (--quantization fp8): linear_fp8
        checkpoint = save_fp8_block(tiny_checkpoints["gqa_tied"], tmp_path / "fp8", tmp_path / "fp8_dq",
                                    block=(32, 64))[0]
    elif name in INT4_SPECS:
        checkpoint = save_tiny_model(INT4_SPECS[name], tmp_path / name)
    else:
        checkpoint = tiny_checkpoints[name]
    calls = []
    if halves:
        forward = llama.decode_block_forward
        monkeypatch.setattr(llama, "decode_block_forward", lambda *args: calls.append(1) or forward(*args))
    else:
        stack_call = decode_block.DecodeStack.__call__
        monkeypatch.setattr(decode_block.DecodeStack, "__call__",
                            lambda self, *args: calls.append(1) or stack_call(self, *args))
    blocked = _Steps(checkpoint, quantization, decode_block=True, kv_cache_dtype=kv_cache_dtype)
    assert blocked.supported, "every layer of a Llama-family model on a float32 CPU takes the decode block"
    model = blocked.runner.model.model
    assert model.decode_stack is not None  # one rank
    if halves:
        model.decode_stack = None
    region_steps = torch.ops.tpserve_cpu.decode_region_steps()
    tokens = _run(blocked)
    region_steps = torch.ops.tpserve_cpu.decode_region_steps() - region_steps
    # One rank's stack runs each decode step in the parallel region where every projection's op is one the region
    # has (float32, int8, fp8 and grouped 8-bit: their decode paths on an AVX-512 CPU; int4: the tile layout of an
    # AMX-INT8 or AVX512-VNNI one, or the row-major layout's AVX512-VNNI path); the tensor-parallel halves (here:
    # the stack switched off) never do.
    decode_steps = len(tokens) - 1
    if quantization == "int4" and not torch.ops.tpserve_cpu.int4_tiles_enabled():
        # Row-major int4 (no tiles): the VNNI path takes up to 4 rows, every step but the one of 6 (three
        # decodes and a 3-token prompt).
        region_formats, expected = int4_vnni(), decode_steps - 1
    else:
        region_formats = quantization == "int4" or torch.backends.cpu.get_cpu_capability() == "AVX512"
        expected = decode_steps
    assert region_steps == (expected if not halves and region_formats else 0)
    per_step = 1 if not halves else len(model.layers)
    assert len(calls) == per_step * (len(tokens) - 1)  # every step but the first (a prefill) took it
    modules = _Steps(checkpoint, quantization, decode_block=False, kv_cache_dtype=kv_cache_dtype)
    assert _run(modules) == tokens
    assert len(calls) == per_step * (len(tokens) - 1)  # the module path never did
    assert len(blocked.hidden) == len(modules.hidden) == len(tokens)
    for step, (a, b) in enumerate(zip(blocked.hidden, modules.hidden, strict=True)):
        assert torch.equal(a, b), f"step {step}: max difference {(a - b).abs().max().item():.3g}"
    _assert_same_caches(blocked, modules)


def _assert_same_caches(a: _Steps, b: _Steps) -> None:
    """Both runners' KV caches equal, and an 8-bit cache's scale pools and key offsets too."""
    for (k_a, v_a), (k_b, v_b) in zip(a.runner.kv_caches, b.runner.kv_caches, strict=True):
        assert torch.equal(k_a, k_b) and torch.equal(v_a, v_b)
    for layer_a, layer_b in zip(a.runner.model.model.layers, b.runner.model.model.layers, strict=True):
        scales_a, scales_b = layer_a.self_attn.attn.kv_scales, layer_b.self_attn.attn.kv_scales
        assert (scales_a is None) == (scales_b is None)
        for x, y in zip(scales_a or (), scales_b or (), strict=True):
            assert torch.equal(x, y)


def _cpu_has_vnni() -> bool:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    return " avx512_vnni" in flags


@pytest.mark.skipif(not (cpu_kernels_available() and _cpu_has_vnni()),
                    reason="the row-major int4 layout's region path is linear_int4's AVX512-VNNI path")
def test_the_decode_region_on_the_row_major_int4_layout(tmp_path: Path) -> None:
    """int4 in the row-major layout and linear_int4 without its AMX paths (``use_int4_tiles(False)``,
    ``use_amx_int4(False)``: what a CPU with AVX512-VNNI but no AMX-INT8 runs), two threads: the steps of up to 4
    rows take the region through linear_int4's VNNI path (18 of the scenario's 19 decode steps; the one of 6 rows,
    the ops), and the hidden states, tokens and caches equal the module path's."""
    checkpoint = save_tiny_model(INT4_TILES, tmp_path / INT4_TILES.name)
    ops = torch.ops.tpserve_cpu
    ops.use_int4_tiles(False)
    ops.use_amx_int4(False)
    try:
        with _threads(2):
            blocked = _Steps(checkpoint, "int4", decode_block=True)
            modules = _Steps(checkpoint, "int4", decode_block=False)
            assert all(p.dim() == 3 for name, p in blocked.runner.model.named_parameters()
                       if name.endswith("weight_scale"))
            before = ops.decode_region_steps()
            tokens = _run(blocked)
            assert ops.decode_region_steps() - before == 18
            assert _run(modules) == tokens
    finally:
        ops.use_int4_tiles(True)
        ops.use_amx_int4(True)
    for step, (a, b) in enumerate(zip(blocked.hidden, modules.hidden, strict=True)):
        assert torch.equal(a, b), f"step {step}: max difference {(a - b).abs().max().item():.3g}"
    _assert_same_caches(blocked, modules)


def test_moe_layers_keep_the_module_path(tmp_path: Path) -> None:
    """A mixture-of-experts MLP is not the decode block's: Qwen3-MoE's sparse layer keeps the modules, its
    dense layer (``mlp_only_layers``) takes the block, and no stack covers a model that mixes them."""
    spec = TinyModelSpec("qwen3_moe_block", "qwen3_moe", {
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 180,
        "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True,
        "mlp_only_layers": [1], "tie_word_embeddings": False}, seed=22)
    runner = ModelRunner(save_tiny_model(spec, tmp_path / spec.name), ParallelContext.single(), torch.float32,
                         BLOCK_SIZE)
    assert [layer.decode_block for layer in runner.model.model.layers] == [False, True]
    assert runner.model.model.decode_stack is None


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_the_stack_follows_a_new_cache(kv_cache_dtype: str, tiny_checkpoints: dict[str, Path]) -> None:
    """As serving starts (a profile run, ``free_kv_cache``, the real ``init_kv_cache``): the stack keeps each step's
    cache arguments between steps (worker/layers/decode_block.py), so after a new cache (and, 8-bit, new scale
    pools) it must write and read the new one: the second run's tokens, hidden states and caches equal the module
    path's, and the old cache is left as the first run wrote it."""
    runs = {}
    for blocked in (True, False):
        steps = _Steps(tiny_checkpoints["gqa_tied"], None, decode_block=blocked, kv_cache_dtype=kv_cache_dtype)
        first = _run(steps)
        old = [(k.clone(), v.clone()) for k, v in steps.runner.kv_caches]
        old_refs = list(steps.runner.kv_caches)
        steps.runner.free_kv_cache()
        steps.runner.init_kv_cache(num_blocks=64)
        steps.hidden.clear()
        runs[blocked] = (first, _run(steps), steps)
        for (k, v), (k_old, v_old) in zip(old_refs, old, strict=True):  # the freed cache is not written again
            assert torch.equal(k, k_old) and torch.equal(v, v_old)
    (first_b, second_b, blocked_steps), (first_m, second_m, module_steps) = runs[True], runs[False]
    assert first_b == first_m and second_b == second_m == first_m
    for step, (a, b) in enumerate(zip(blocked_steps.hidden, module_steps.hidden, strict=True)):
        assert torch.equal(a, b), f"step {step} after the new cache: max difference {(a - b).abs().max().item():.3g}"
    for (k_a, v_a), (k_b, v_b) in zip(blocked_steps.runner.kv_caches, module_steps.runner.kv_caches, strict=True):
        assert torch.equal(k_a, k_b) and torch.equal(v_a, v_b)
        assert k_a.abs().sum() > 0  # written


@pytest.mark.skipif(not (cpu_kernels_available() and torch.ops.tpserve_cpu.int4_tiles_enabled()),
                    reason="the decode region's int4 needs the tile layout: an AMX-INT8 or AVX512-VNNI CPU")
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("quantization", ["int4", "gptq8", "int8", None])
def test_the_decode_region_equals_the_ops_at_many_rows(quantization: str | None, threads: int, tmp_path: Path) -> None:
    """13 sequences decode at once (int4: two passes of x's rows through the tiles, 10 and 3; 26 (sequence, KV
    head) items split between the threads), then 11 after two finish: the hidden states, tokens and caches equal
    the same stack's ops (``use_decode_region(False)``) bit for bit. int4 takes the region at every step (on AMX:
    the first too, whose prompts of 2 to 6 tokens the CPU paged kernel reads as the decode group's rows, several
    rows a sequence: 49 rows in 5 passes; on AVX512-VNNI alone the tiles take up to 16 rows, as the op). So does group-wise 8-bit (an 8-bit GPTQ checkpoint, group 32: passes of 4
    rows up to 64, as its op). float32 and int8 never do: their ops' streamed GEMV takes up to 8 rows, and
    beyond, the ops' tiles. On 1, 2 and 3 threads: the region's shares of every phase change with the team."""
    with _threads(threads):
        _many_rows_case(quantization, tmp_path)


@pytest.mark.skipif(not (cpu_kernels_available() and torch.ops.tpserve_cpu.int4_tiles_enabled()),
                    reason="the decode region's int4 needs the tile layout: an AMX-INT8 or AVX512-VNNI CPU")
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_the_decode_region_writes_and_reads_an_8_bit_cache(kv_cache_dtype: str, tmp_path: Path) -> None:
    """The same 13 int4 sequences on an 8-bit cache, two threads: the region writes each key and value row's codes
    and scale (the key less its offset) as rotary_and_cache does and reads them as paged_attention does, so the
    codes, scale pools, hidden states and tokens equal the ops' bit for bit."""
    with _threads(2):
        _many_rows_case("int4", tmp_path, kv_cache_dtype)


def _many_rows_case(quantization: str | None, tmp_path: Path, kv_cache_dtype: str = "auto") -> None:
    checkpoint = save_tiny_model(INT4_TILES, tmp_path / INT4_TILES.name)
    if quantization == "gptq8":  # its quantization_config says GPTQ: loaded as group-wise 8-bit, the w8 op
        checkpoint = save_gptq8(checkpoint, tmp_path / "gptq8", tmp_path / "gptq8_dq", group=32, sym=False)[0]
        quantization = None
        expected_steps = 9
    elif quantization == "int4":  # without AMX the first step's 49 rows take the op's float32 tiles (as the op)
        expected_steps = 9 if torch.ops.tpserve_cpu.int4_tiles_take_rows(49) else 8
    else:
        expected_steps = 0
    seqs = range(13)

    def run(steps: _Steps) -> list[dict[int, int]]:
        prompts = {s: [3 + (7 * s + i) % 180 for i in range(2 + s % 5)] for s in seqs}
        positions = {s: len(prompts[s]) for s in seqs}
        out = [steps.step(StepPlan(1, tuple(NewSequence(s, GREEDY) for s in seqs), tuple(
            ScheduledChunk(s, tuple(prompts[s]), 0, tuple(range(4 * s, 4 * s + 4))) for s in seqs)))]
        live, finished = list(seqs), ()
        for plan_id in range(2, 10):
            if plan_id == 6:
                live, finished = [s for s in live if s not in (4, 9)], (4, 9)
            out.append(steps.step(StepPlan(plan_id, (), tuple(ScheduledChunk(s, (out[-1][s],), positions[s])
                                                               for s in live), finished)))
            finished = ()
            for s in live:
                positions[s] += 1
        return out

    region = _Steps(checkpoint, quantization, decode_block=True, kv_cache_dtype=kv_cache_dtype)
    before = torch.ops.tpserve_cpu.decode_region_steps()  # (the runner's start-up may run a decode step)
    region_tokens = run(region)
    assert torch.ops.tpserve_cpu.decode_region_steps() - before == expected_steps
    torch.ops.tpserve_cpu.use_decode_region(False)
    try:
        ops = _Steps(checkpoint, quantization, decode_block=True, kv_cache_dtype=kv_cache_dtype)
        assert run(ops) == region_tokens
    finally:
        torch.ops.tpserve_cpu.use_decode_region(True)
    assert torch.ops.tpserve_cpu.decode_region_steps() - before == expected_steps  # the ops' run: none
    for step, (a, b) in enumerate(zip(region.hidden, ops.hidden, strict=True)):
        assert torch.equal(a, b), f"step {step}: max difference {(a - b).abs().max().item():.3g}"
    _assert_same_caches(region, ops)
