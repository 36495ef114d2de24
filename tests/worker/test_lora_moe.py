"""Multi-LoRA on mixture-of-experts families against ``peft``'s merged model in ``transformers``.

Mixtral (every layer sparse) and Qwen3-MoE (QK-norm, layer 1 dense) with four seeded ``peft``
adapters on the attention projections (rank 4 on q/k/v/o; rank 8 rsLoRA on q/v; rank 2 on
k/o; rank 6 on q/o) in a pool of 4 slots. (``peft`` turns MLP target names on these models
into ``target_parameters`` on the fused experts, which are refused, below.) 16 sequences run together, 3 or 4 under each of the base model and the four
adapters, half arriving a step later, some prefilled in chunks: the sparse layers take the
module path with the linears' batched LoRA, Qwen3-MoE's dense layer the compiled decode block.
Every greedy token must equal ``transformers``' greedy ``generate`` on the merged model of
the sequence's adapter and every sampled row's logits (float32) that model's within 1e-4,
at tp 1 and 2.

Refused at start-up in one line: peft's LoRA on the routed experts (``target_parameters``,
what ``peft`` makes of ``gate_proj`` / ``up_proj`` / ``down_proj`` on transformers' fused
experts) and an adapter tensor naming a routed expert's module.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from tests.tiny_models import load_hf_model, save_tiny_model
from tests.worker.lora_checkpoints import ALL_TARGETS, AdapterSpec, save_adapter
from tests.worker.moe_specs import MIXTRAL_SPEC, QWEN3_MOE_SPEC
from tests.worker.scenarios import SeqSpec, build_plans, hf_reference
from tests.worker.tp_harness import Job, run_jobs
from worker.lora_settings import LoRASettings

BLOCK_SIZE = 4
NUM_BLOCKS = 256
NUM_NEW_TOKENS = 5
NUM_SEQS = 16
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
ADAPTERS = (
    AdapterSpec("attn_r4", 4, 8.0, ATTENTION, seed=41),
    AdapterSpec("qv_r8_rslora", 8, 16.0, ("q_proj", "v_proj"), use_rslora=True, seed=42),
    AdapterSpec("k_o_r2", 2, 4.0, ("k_proj", "o_proj"), seed=43),
    AdapterSpec("q_o_r6", 6, 3.0, ("q_proj", "o_proj"), seed=44),
)
SPECS = {"mixtral": MIXTRAL_SPEC, "qwen3_moe": QWEN3_MOE_SPEC}


@functools.cache
def _root() -> Path:
    root = Path(tempfile.mkdtemp(prefix="tpserve-lora-moe-"))
    import atexit

    atexit.register(shutil.rmtree, root, True)
    return root


@functools.cache
def _case(name: str) -> tuple[Job, list, dict, dict, dict]:
    """The job of one MoE base with the four adapters, the expected samples per step, the reference, and
    the base model's own completions of the adapter sequences' prompts."""
    spec = SPECS[name]
    base_dir = save_tiny_model(spec, _root() / spec.name)
    rng = random.Random(1)
    vocab = spec.config["vocab_size"]
    models = [load_hf_model(base_dir)] + [save_adapter(base_dir, a, _root() / f"{name}-{a.name}")
                                          for a in ADAPTERS]
    seqs, slots, completions, logits, base_completions = [], {}, {}, {}, {}
    for seq_id in range(NUM_SEQS):
        slot = seq_id % len(models)  # slot 0: the base model
        prompt = tuple(rng.randrange(3, vocab) for _ in range(rng.randrange(4, 14)))
        seq = SeqSpec(seq_id, prompt, NUM_NEW_TOKENS, arrive_step=seq_id % 2,
                      prefill_chunk=4 if seq_id % 3 == 0 else None)
        seqs.append(seq)
        slots[seq_id] = slot
        got_tokens, got_logits = hf_reference(models[slot], [seq])
        completions.update(got_tokens)
        logits.update(got_logits)
        if slot:
            base_completions.update(hf_reference(models[0], [seq])[0])
    plans, want = build_plans(seqs, completions, BLOCK_SIZE, NUM_BLOCKS)
    plans = [dataclasses.replace(plan, new_seqs=tuple(dataclasses.replace(new, lora_slot=slots[new.seq_id])
                                                      for new in plan.new_seqs)) for plan in plans]
    assert max(len(plan.scheduled) for plan in plans) == NUM_SEQS  # all 16 at once
    assert any(len({slots[c.seq_id] for c in plan.scheduled}) == 5 for plan in plans)  # steps mix all five
    settings = LoRASettings(max_loras=4, max_lora_rank=8,
                            adapter_paths=tuple(str(_root() / f"{name}-{a.name}") for a in ADAPTERS))
    job = Job(f"lora_moe/{name}", str(base_dir), tuple(plans), NUM_BLOCKS, BLOCK_SIZE, lora=settings)
    return job, want, completions, logits, base_completions


@pytest.mark.parametrize("tp", [1, 2])
def test_moe_mixed_adapters_match_peft_merged_models(tp: int) -> None:
    cases = {name: _case(name) for name in SPECS}
    records = run_jobs([job for job, *_ in cases.values()], tp)
    for job, want, completions, logits, _ in cases.values():
        steps = records[job.name]
        assert len(steps) == len(want)
        for step, (record, samples) in enumerate(zip(steps, want, strict=True)):
            tokens = tuple(completions[seq_id][index] for seq_id, index in samples)
            assert record.sampled_token_ids == tokens, f"{job.name} step {step}"
            if samples:
                expected = torch.stack([logits[seq_id][index] for seq_id, index in samples])
                torch.testing.assert_close(record.logits, expected, atol=1e-4, rtol=1e-4)


def test_moe_adapters_change_the_tokens() -> None:
    """Each adapter moves some greedy token off the base model's (attention-only adapters are not no-ops)."""
    for name in SPECS:
        _, _, completions, _, base_completions = _case(name)
        for slot in range(1, 5):
            seq_ids = [i for i in range(NUM_SEQS) if i % 5 == slot]
            assert [completions[i] for i in seq_ids] != [base_completions[i] for i in seq_ids], f"{name} {slot}"


def test_routed_expert_adapters_are_refused_at_start_up() -> None:
    """peft's LoRA on Qwen3-MoE's fused experts (``target_parameters``) and a tensor naming an expert's
    module: each refused by the rank before serving, in one line naming the field or module."""
    from safetensors.torch import load_file, save_file

    from worker.model_runner import ModelRunner
    from worker.parallel_state import ParallelContext

    _case("qwen3_moe")
    base_dir = _root() / QWEN3_MOE_SPEC.name
    experts = _root() / "qwen3_moe-experts"
    save_adapter(base_dir, AdapterSpec("experts", 4, 8.0, ALL_TARGETS, seed=45), experts)
    ctx = ParallelContext.single("cpu")
    with pytest.raises(ValueError, match=r"target_parameters=\[.*\] is not supported \(LoRA on the routed MoE") \
            as error:
        ModelRunner(base_dir, ctx, torch.float32, BLOCK_SIZE, lora=LoRASettings(2, 8, (str(experts),)))
    assert "'gate_up_proj'" in str(error.value) and "'down_proj'" in str(error.value)
    assert "\n" not in str(error.value)
    odd = _root() / "qwen3_moe-expert-module"
    shutil.copytree(_root() / f"qwen3_moe-{ADAPTERS[1].name}", odd, dirs_exist_ok=True)
    tensors = load_file(odd / "adapter_model.safetensors")
    tensors = {k.replace("layers.0.self_attn.q_proj", "layers.0.mlp.experts.3.up_proj"): v for k, v in tensors.items()}
    save_file(tensors, odd / "adapter_model.safetensors")
    with pytest.raises(ValueError, match=r"experts\.3\.up_proj \(LoRA on routed MoE experts is not supported\)$"):
        ModelRunner(base_dir, ctx, torch.float32, BLOCK_SIZE, lora=LoRASettings(2, 8, (str(odd),)))
