"""The whole forward pass on ``device="meta"`` in bfloat16 at tp 1, built through the real ModelRunner.

A meta tensor has a shape, a dtype and a device but no data, so on meta:

* any host sync inside a layer (``.item()``, ``int(t)``, ``bool(t)``, ``.tolist()``)
  raises, since there is no value to read;
* every aten op of the model forward, the LM head and the sampler runs under
  :class:`DeviceGuard`, which records any tensor it receives or returns that is
  not on meta (scalars aside): a tensor created on the wrong device (a
  ``torch.arange`` without ``device=``) fails the test even where the meta kernel
  would accept it (``mm`` does).

The runner builds the step's metadata and host-side sampling parameters as it
does on a GPU (on the host, then one copy to the device: outside the guard).
The only step that cannot run on meta is the intended one copy of the sampled
token ids to the host at the end of ``execute``; the spy below returns host
zeros in its place.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import worker.model_runner as model_runner
from tests.tiny_models import TinyModelSpec, save_tiny_model
from tests.worker.device_guard import DeviceGuard
from tpserve.step import NewSequence, SamplingParams, ScheduledChunk, StepPlan
from worker.model_runner import ModelRunner
from worker.parallel_state import ParallelContext
from worker.sampler import sample_tensors


#: Families whose layers go beyond Llama's: the full-width QK norm and float32 RoPE per layer type (OLMo 3), NoPE
#: layers (SmolLM3; EXAONE 4's global one), post-norms; each with a 6-token window on some layers.
_DIMS = {"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 150,
         "sliding_window": 6}
META_FAMILIES = {
    "olmo3": TinyModelSpec("meta_olmo3", "olmo3", _DIMS),
    "smollm3": TinyModelSpec("meta_smollm3", "smollm3", {**_DIMS, "use_sliding_window": True, "pad_token_id": 0}),
    "exaone4": TinyModelSpec("meta_exaone4", "exaone4", _DIMS),
}


@pytest.fixture(params=[("mqa_untied_bias", None), ("mqa_untied_bias", "int8"), *((f, None) for f in META_FAMILIES)],
                ids=["float", "int8", *META_FAMILIES])
def guarded_runner(tiny_checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest,
                   tmp_path: Path):
    """A meta runner (float, or weight-only int8) whose model forward, LM head and sampler run under one DeviceGuard."""
    name, quantization = request.param
    model_dir = (save_tiny_model(META_FAMILIES[name], tmp_path / name) if name in META_FAMILIES
                 else tiny_checkpoints[name])
    runner = ModelRunner(model_dir, ParallelContext.single("meta"), torch.bfloat16, 4, quantization=quantization)
    guard = DeviceGuard()
    sampled: list[tuple[torch.Tensor, torch.Tensor]] = []
    model = runner.model

    def guarded(fn):
        def call(*args, **kwargs):
            with guard:
                return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(model, "forward", guarded(model.forward))
    monkeypatch.setattr(model, "compute_logits", guarded(model.compute_logits))

    def spy_sample(logits, tensors):
        assert tensors.temperature.device.type == "meta"  # built on the host, copied once with the step's inputs
        tokens = guarded(sample_tensors)(logits, tensors)  # (N,) on meta
        sampled.append((logits, tokens))
        return torch.zeros(tokens.shape, dtype=torch.int64)  # stands for the one device -> host copy

    monkeypatch.setattr(model_runner, "sample_tensors", spy_sample)
    return runner, guard, sampled


def test_forward_pass_on_meta_in_bf16_stays_on_the_device_without_host_sync(guarded_runner) -> None:
    runner, guard, sampled = guarded_runner
    assert {p.device.type for p in runner.model.parameters()} == {"meta"}
    int8 = {torch.int8, torch.float32} if runner.model.quantization else set()  # int8 weights, float32 scales
    assert {p.dtype for p in runner.model.parameters()} == {torch.bfloat16} | int8
    runner.init_kv_cache(num_blocks=16)
    greedy, seeded = SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=5)
    prefill = StepPlan(0, (NewSequence(0, greedy), NewSequence(1, seeded), NewSequence(2, seeded)), (
        ScheduledChunk(0, (5, 6, 7, 8, 9), 0, (3, 1)),
        ScheduledChunk(1, (10, 11), 0, (0,)),
        ScheduledChunk(2, (12, 13, 14), 0, (2,), sample=False),  # a first prompt chunk
    ))
    mixed = StepPlan(1, scheduled=(
        ScheduledChunk(0, (42,), 5),  # decode
        ScheduledChunk(1, (43,), 2),  # decode
        ScheduledChunk(2, (15, 16, 17, 18), 3, (4,)),  # the prompt's last chunk
    ))
    assert runner.execute(prefill).sampled_token_ids == (0, 0)
    assert runner.execute(mixed).sampled_token_ids == (0, 0, 0)
    assert guard.violations == []
    assert guard.num_ops > 100  # the guard really saw the layers
    vocab_size = runner.config.vocab_size
    for (logits, tokens), num_rows in zip(sampled, (2, 3), strict=True):
        assert logits.device.type == "meta" and logits.dtype == torch.float32 and logits.shape == (num_rows, vocab_size)
        assert tokens.device.type == "meta" and tokens.dtype == torch.int64 and tokens.shape == (num_rows,)


def test_the_guard_catches_a_tensor_on_the_wrong_device_and_a_host_sync() -> None:
    """The guard itself: what it must flag (a test that cannot fail proves nothing)."""
    x, host = torch.ones(4, 4, device="meta"), torch.ones(4, 4)
    guard = DeviceGuard()
    with guard:
        x @ host  # the meta kernel of mm accepts a CPU operand; the guard does not
        torch.arange(4)  # created on the CPU
    assert [v.split(":")[0] for v in guard.violations] == ["aten.mm.default", "aten.arange.default"]
    with pytest.raises(RuntimeError, match="meta"), DeviceGuard():
        x.sum().item()
