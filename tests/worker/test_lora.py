"""Batched multi-LoRA against ``peft``'s merged model in ``transformers`` (worker/layers/lora.py, worker/lora_adapters.py).

For a tiny Llama (GQA, tied embeddings) and a tiny Qwen3 (QK-norm), three seeded adapters
built with ``peft`` (rank 4 on all seven projections; rank 8 rsLoRA on q/v/down; rank 2 on
k/o/gate/up) are loaded into a pool of 4 slots (one left empty). 16 sequences run together:
4 prompts each under the base model and under each adapter, half arriving a step later
(prefills of one adapter beside decodes of others), some prefilled in chunks. Every greedy
token must equal ``transformers``' greedy ``generate`` on ``peft``'s merged model of the
sequence's adapter (the base model for base rows), and every sampled row's logits
(float32) that model's within 1e-4, at tp 1 and 2 (and tp 4 for the Llama).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import random
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from tests.tiny_models import TINY_MODELS, load_hf_model, save_tiny_model
from tests.worker.lora_checkpoints import ALL_TARGETS, AdapterSpec, save_adapter
from tests.worker.scenarios import SeqSpec, build_plans, hf_reference
from tests.worker.tp_harness import Job, run_jobs
from worker.lora_adapters import read_adapter_config
from worker.lora_settings import LoRASettings

BLOCK_SIZE = 4
NUM_BLOCKS = 256
NUM_NEW_TOKENS = 6
PROMPT_LENGTHS = (5, 11, 17, 8)
ADAPTERS = (
    AdapterSpec("all_r4", 4, 8.0, ALL_TARGETS, seed=11),
    AdapterSpec("qv_down_r8_rslora", 8, 16.0, ("q_proj", "v_proj", "down_proj"), use_rslora=True, seed=12),
    AdapterSpec("k_o_mlp_r2", 2, 4.0, ("k_proj", "o_proj", "gate_proj", "up_proj"), seed=13),
)
SETTINGS_SLOTS = 4  # one more than the adapters: an empty slot stays harmless
BASES = [spec for spec in TINY_MODELS if spec.name in ("gqa_tied", "qwen3_qk_norm")]


@functools.cache
def _root() -> Path:
    root = Path(tempfile.mkdtemp(prefix="tpserve-lora-"))
    import atexit

    atexit.register(shutil.rmtree, root, True)
    return root


@functools.cache
def _case(base_name: str) -> tuple[Job, list, dict, dict]:
    """The job of one base model with the three adapters, the expected samples per step, and the reference."""
    spec = next(s for s in BASES if s.name == base_name)
    base_dir = save_tiny_model(spec, _root() / spec.name)
    rng = random.Random(0)
    vocab = spec.config["vocab_size"]
    prompts = [tuple(rng.randrange(3, vocab) for _ in range(n)) for n in PROMPT_LENGTHS]
    models = [load_hf_model(base_dir)] + [save_adapter(base_dir, a, _root() / f"{spec.name}-{a.name}")
                                          for a in ADAPTERS]
    seqs, slots, completions, logits = [], {}, {}, {}
    for slot, model in enumerate(models):  # slot 0: the base model
        for i, prompt in enumerate(prompts):
            seq_id = 4 * slot + i
            seqs.append(SeqSpec(seq_id, prompt, NUM_NEW_TOKENS, arrive_step=i % 2,
                                prefill_chunk=4 if (slot + i) % 3 == 0 else None))
            slots[seq_id] = slot
        got_tokens, got_logits = hf_reference(model, seqs[-len(prompts):])
        completions.update(got_tokens)
        logits.update(got_logits)
    plans, want = build_plans(seqs, completions, BLOCK_SIZE, NUM_BLOCKS)
    plans = [dataclasses.replace(plan, new_seqs=tuple(dataclasses.replace(new, lora_slot=slots[new.seq_id])
                                                      for new in plan.new_seqs)) for plan in plans]
    assert any(len({slots[c.seq_id] for c in plan.scheduled}) == 4 for plan in plans)  # steps mix all four
    settings = LoRASettings(max_loras=SETTINGS_SLOTS, max_lora_rank=8,
                            adapter_paths=tuple(str(_root() / f"{spec.name}-{a.name}") for a in ADAPTERS))
    job = Job(f"lora/{spec.name}", str(base_dir), tuple(plans), NUM_BLOCKS, BLOCK_SIZE, lora=settings)
    return job, want, completions, logits


def _check(records: dict, cases: dict) -> None:
    """Every step's greedy tokens equal the reference's, its logits within 1e-4 (float32)."""
    for job, want, completions, logits in cases.values():
        steps = records[job.name]
        assert len(steps) == len(want)
        for step, (record, samples) in enumerate(zip(steps, want, strict=True)):
            tokens = tuple(completions[seq_id][index] for seq_id, index in samples)
            assert record.sampled_token_ids == tokens, f"{job.name} step {step}"
            if samples:
                expected = torch.stack([logits[seq_id][index] for seq_id, index in samples])
                torch.testing.assert_close(record.logits, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tp", [1, 2])
def test_mixed_adapters_match_peft_merged_models(tp: int) -> None:
    cases = {name: _case(name) for name in ("gqa_tied", "qwen3_qk_norm")}
    _check(run_jobs([job for job, *_ in cases.values()], tp), cases)


def test_llama_mixed_adapters_match_peft_merged_models_at_tp4() -> None:
    """tp 4 on the Llama (4 query heads, 2 KV heads: each KV head, and its adapters' k/v rows of B,
    replicated on two ranks; A of o_proj and down_proj split four ways)."""
    cases = {"gqa_tied": _case("gqa_tied")}
    _check(run_jobs([cases["gqa_tied"][0]], 4), cases)


def test_adapters_change_the_tokens() -> None:
    """The reference adapters are not no-ops: each moves some greedy token off the base model's."""
    _, _, completions, _ = _case("gqa_tied")
    base = [completions[i] for i in range(4)]
    for slot in range(1, 4):
        assert [completions[4 * slot + i] for i in range(4)] != base, ADAPTERS[slot - 1].name


def _config_dir(tmp_path: Path, **fields: object) -> Path:
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], **fields}
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    return tmp_path


def test_adapter_config_scaling(tmp_path: Path) -> None:
    assert read_adapter_config(_config_dir(tmp_path), 8).scaling == 2.0  # alpha / r
    assert read_adapter_config(_config_dir(tmp_path, use_rslora=True), 8).scaling == 4.0  # alpha / sqrt(r)


@pytest.mark.parametrize(("fields", "message"), [
    ({"modules_to_save": ["lm_head"]}, "modules_to_save=['lm_head'] is not supported"),
    ({"r": 16}, "r=16 exceeds --max-lora-rank 8"),
    ({"use_dora": True}, "use_dora=True is not supported"),
    ({"bias": "all"}, "bias='all' is not supported"),
    ({"peft_type": "IA3"}, "only LORA adapters are served"),
    ({"target_modules": ["q_proj", "lm_head"]}, "target_modules includes 'lm_head': LoRA on the embedding and "
                                                "the output head is not served"),
    ({"target_modules": ".*(embed_tokens|q_proj)"}, "target_modules includes 'embed_tokens'"),
])
def test_adapter_config_refusals(tmp_path: Path, fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")) as error:
        read_adapter_config(_config_dir(tmp_path, **fields), 8)
    assert "\n" not in str(error.value)


def test_mismatched_and_unknown_tensors_are_refused() -> None:
    """A Qwen3 adapter (head_dim 32) on the Llama base and a module the model lacks: refused naming the tensor."""
    from safetensors.torch import load_file, save_file

    from worker.model_runner import ModelRunner
    from worker.parallel_state import ParallelContext

    _case("gqa_tied"), _case("qwen3_qk_norm")
    llama_dir, qwen_adapter = _root() / "gqa_tied", _root() / f"qwen3_qk_norm-{ADAPTERS[0].name}"
    ctx = ParallelContext.single("cpu")
    with pytest.raises(ValueError, match=r"adapter tensor base_model\.model\.model\.layers\.0\.self_attn\.k_proj\.lora_B\.weight: "
                       r"checkpoint tensor has shape \[64, 4\], expected \[32, 4\]"):
        ModelRunner(llama_dir, ctx, torch.float32, BLOCK_SIZE, lora=LoRASettings(2, 8, (str(qwen_adapter),)))
    odd = _root() / "odd_module"
    shutil.copytree(_root() / f"gqa_tied-{ADAPTERS[0].name}", odd, dirs_exist_ok=True)
    tensors = load_file(odd / "adapter_model.safetensors")
    tensors = {k.replace("layers.1.mlp.up_proj", "layers.1.mlp.experts.0.up_proj"): v for k, v in tensors.items()}
    save_file(tensors, odd / "adapter_model.safetensors")
    with pytest.raises(ValueError, match=r"no LoRA-capable layer model\.layers\.1\.mlp\.experts\.0\.up_proj"):
        ModelRunner(llama_dir, ctx, torch.float32, BLOCK_SIZE, lora=LoRASettings(2, 8, (str(odd),)))


def test_pool_refusals() -> None:
    with pytest.raises(ValueError, match="2 --lora-modules do not fit --max-loras 1"):
        LoRASettings(1, 8, ("a", "b"))
    with pytest.raises(ValueError, match="--max-lora-rank must be >= 1"):
        LoRASettings(1, 0)


def test_step_groups_rows_by_adapter() -> None:
    """Rows of each adapter, wherever the flat batch puts its chunks; none at all for a base-only step."""
    from worker.layers.lora import LoRAStep

    step = LoRAStep(torch.device("cpu"))
    step.set_rows([0, 0], [3, 1], [3, 0])  # the base model only: no LoRA work this step
    assert step.groups == []
    # Plan order: a 3-token prefill (slot 2) at rows 2..4, decodes at rows 0 (slot 1) and 1 (none), a 2-token chunk (slot 1).
    step.set_rows([2, 1, 0, 1], [3, 1, 1, 2], [4, 0, 1, 6])
    assert [(index, rows.tolist()) for index, rows in step.groups] == [(0, [0, 5, 6]), (1, [2, 3, 4])]
    with pytest.raises(ValueError, match="lora slot -1 is negative"):
        step.set_rows([-1], [1], [0])


def test_cuda_ranks_refuse_lora_before_loading() -> None:
    """No Triton LoRA kernel yet: a CUDA rank refuses ``--enable-lora`` in one line, before reading a weight."""
    from worker.model_runner import ModelRunner
    from worker.parallel_state import ParallelContext

    _case("gqa_tied")
    with pytest.raises(ValueError, match="^--enable-lora is not supported on CUDA yet") as error:
        ModelRunner(_root() / "gqa_tied", ParallelContext.single("cuda:0"), torch.float32, BLOCK_SIZE,
                    lora=LoRASettings())
    assert "\n" not in str(error.value)
