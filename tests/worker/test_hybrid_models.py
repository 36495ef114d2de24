"""Qwen3-Next, Qwen3.5 and Qwen3.5-MoE (worker/models/qwen3_next.py, qwen3_5.py) against ``transformers``, tp 1 and 2.

Run without the runner (tests/worker/delta_net_harness.py), tokens teacher-forced: 8 prompts of 3 to 83 tokens
(the longest three span two 64-row DeltaNet chunks), 32 greedy tokens each, from ``transformers``' ``generate``.

* **alone**: each prompt in one prefill (the chunked form), then 31 decode steps (the recurrent step);
* **16 at once**: every prompt twice, prefilled 13 tokens a step (the state carried from step to step) beside
  the decode group of the sequences already generating, the DeltaNet chunk cut to 8 rows so chunk edges fall
  inside every prefill; checkpoints at every 8-token block boundary of a prompt; the even second copies start
  from their first copy's latest checkpoint (state copied, KV blocks shared), the odd ones from scratch.

Every completion row's argmax must be ``transformers``' greedy token; every row's logits (float32) within
``1e-4 + 1e-4 * |logit|`` of ``transformers``' on the same path (the prompt rows its prefill's, the completion
rows its decode steps'), and every prompt token's logprob within 1e-4.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tests.tiny_models import TinyModelSpec, load_hf_model, save_tiny_model
from tests.worker.delta_net_harness import Scenario, run_scenarios
from tests.worker.hybrid_specs import GATED_DELTA_NET_SPECS

PROMPT_LENGTHS = (3, 9, 17, 30, 41, 66, 70, 83)
NUM_NEW_TOKENS = 32
#: family_check.py's tolerances. They hold because the checkpoints' DeltaNet queries are correlated with their keys
#: (tests/tiny_models.py's ``_correlate_queries_with_keys``): with independent random projections the reference's
#: own float32 paths disagreed by up to 5e-4 (its decode steps against its prefill, its float32 against float64).
ATOL, RTOL, LOGPROB_ATOL = 1e-4, 1e-4, 1e-4


class Case:
    """A checkpoint, its reference, and the two scenarios' sequences."""

    def __init__(self, spec: TinyModelSpec, directory: Path) -> None:
        save_tiny_model(spec, directory)
        self.model_dir = str(directory)
        model = load_hf_model(directory)
        rng = random.Random(spec.seed)
        self.prompts = [tuple(rng.randrange(3, model.config.vocab_size) for _ in range(n)) for n in PROMPT_LENGTHS]
        model.generation_config.eos_token_id = None  # exactly NUM_NEW_TOKENS
        self.completions, self.logits = [], []
        for prompt in self.prompts:
            # The reference's own paths: its prefill (chunked form) for the prompt rows, its decode steps
            # (recurrent form) for the completion's; the two differ by up to ~4e-5 on these checkpoints.
            out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NUM_NEW_TOKENS,
                                 pad_token_id=0, output_logits=True, return_dict_in_generate=True)
            self.completions.append(out.sequences[0, len(prompt):].tolist())
            with torch.no_grad():
                prompt_logits = model(torch.tensor([prompt])).logits[0, :-1].float()  # (P - 1, V)
            self.logits.append(torch.cat([prompt_logits, torch.cat(out.logits).float()]))  # (P + 31, V)
        self.tokens = [p + tuple(c[:-1]) for p, c in zip(self.prompts, self.completions)]  # what is fed
        n = len(self.prompts)
        steps = NUM_NEW_TOKENS  # one prefill + 31 decodes
        self.alone = Scenario(tuple((i, t, len(p), steps * i, None)
                                    for i, (t, p) in enumerate(zip(self.tokens, self.prompts))), prefill_chunk=1000)
        firsts = [(i, t, len(p), 0, None) for i, (t, p) in enumerate(zip(self.tokens, self.prompts))]
        seconds = [(n + i, t, len(p), 1 if i % 2 else 3, None if i % 2 else i)
                   for i, (t, p) in enumerate(zip(self.tokens, self.prompts))]
        self.together = Scenario(tuple(firsts + seconds), prefill_chunk=13, chunk_size=8)

    def check(self, results: dict[int, tuple[int, torch.Tensor]], num_seqs: int) -> None:
        assert len(results) == num_seqs
        hits = 0
        for seq_id, (first, logits) in results.items():
            i = seq_id % len(self.prompts)
            prompt_len = len(self.prompts[i])
            hits += first > 0
            reference = self.logits[i][first:]  # (rows, V): rows first .. P + 30
            assert logits.shape == reference.shape
            torch.testing.assert_close(logits, reference, rtol=RTOL, atol=ATOL)
            greedy = logits[prompt_len - 1 - first:].argmax(-1).tolist()
            assert greedy == self.completions[i], f"sequence {seq_id}"
            # Prompt logprobs: row r predicts the token at position first + r + 1.
            prompt = self.prompts[i]
            rows = range(prompt_len - 1 - first)
            ours = torch.log_softmax(logits[:len(rows)], -1)
            ref = torch.log_softmax(reference[:len(rows)], -1)
            for r in rows:
                token = prompt[first + r + 1]
                assert abs(float(ours[r, token]) - float(ref[r, token])) < LOGPROB_ATOL, f"{seq_id} row {r}"
        if num_seqs > len(self.prompts):
            assert hits >= 3  # the even second copies of the longer prompts started from a checkpoint


@pytest.fixture(scope="module", params=GATED_DELTA_NET_SPECS, ids=lambda s: s.name)
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Case:
    return Case(request.param, tmp_path_factory.mktemp(request.param.name))


@pytest.mark.parametrize("tp", [1, 2])
def test_hybrid_family_matches_transformers(case: Case, tp: int) -> None:
    alone, together = run_scenarios(case.model_dir, [case.alone, case.together], tp)
    case.check(alone, len(case.prompts))
    case.check(together, 2 * len(case.prompts))


@pytest.mark.parametrize("flag", ["int8", "int4"])
def test_a_float_only_hybrid_family_is_refused_quantization_at_start_up(tmp_path: Path, flag: str) -> None:
    """Granite 4.0 H and Nemotron-H load their Mamba-2 and expert weights float only: the coordinator refuses
    ``--quantization`` in one line before any rank starts (tpserve/model_registry.py FLOAT_ONLY_ARCHITECTURES),
    not each rank after its start."""
    from launch.startup import StartupError, read_model_config
    from tests.worker.hybrid_specs import GRANITE_HYBRID_MOE, NEMOTRON_H

    for spec, architecture in ((GRANITE_HYBRID_MOE, "GraniteMoeHybridForCausalLM"),
                               (NEMOTRON_H, "NemotronHForCausalLM")):
        model_dir = save_tiny_model(spec, tmp_path / spec.name)
        assert read_model_config(model_dir, 1).architecture == architecture  # served without the flag
        with pytest.raises(StartupError) as error:
            read_model_config(model_dir, 1, quantization=flag)
        assert str(error.value) == (f"cannot serve {model_dir} with --quantization {flag}: {architecture}'s Mamba-2 "
                                    "and expert weights load float only; serve a float checkpoint without "
                                    "--quantization")
