"""The int8 LM head of ``--quantization int8|int4`` (worker/lm_head_int8.py).

End to end, the quantized tests' references round the head as the definition says
(tests/worker/int8_checkpoints.py ``round_head``): every ``--quantization int8`` and ``int4`` case
of test_int8.py, test_int4.py, the MoE, MLA and hybrid tests and the e2e serving tests compares
tpserve's logits with ``transformers``' on that model, tied and untied, at tp 1 and 2. Here: the
rule, and the layers against the definition (``q = round(w / s)``, ``s = max|w_row| / 127``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.worker.int8_checkpoints import quantize_definition
from worker.kernels import cpu_kernels_available
from worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from worker.lm_head_int8 import hold_lm_head_int8, takes_int8_head
from worker.parallel_state import ParallelContext

CPU = torch.device("cpu")


class _Model(nn.Module):
    def __init__(self, vocab: int, hidden: int, tied: bool) -> None:
        super().__init__()
        ctx = ParallelContext.single()
        self.embed_tokens = VocabParallelEmbedding(vocab, hidden, ctx, dtype=torch.float32)
        self.lm_head = ParallelLMHead(vocab, hidden, ctx, dtype=torch.float32)
        generator = torch.Generator().manual_seed(0)
        self.embed_tokens.weight.data.copy_(torch.randn(vocab, hidden, generator=generator))
        self.lm_head.weight.data.copy_(torch.randn(vocab, hidden, generator=generator) * 0.02)
        self.lm_head.weight.data[3].zero_()  # a row of zeros (a padding row): scale 0, logit 0
        if tied:
            self.lm_head.tie_to(self.embed_tokens)


def test_the_head_is_int8_when_the_server_quantizes_a_float_checkpoint_on_a_cpu() -> None:
    f32 = torch.float32
    assert takes_int8_head("int8", None, CPU, f32) == takes_int8_head("int4", None, CPU, f32) == cpu_kernels_available()
    assert not takes_int8_head(None, None, CPU, f32)  # a float model keeps its head
    assert not takes_int8_head("int4", "int4", CPU, f32)  # a published GPTQ / AWQ checkpoint: the head it publishes
    assert not takes_int8_head("fp8", None, CPU, f32)  # FP8 layers kept as fp8
    assert not takes_int8_head("int8", None, CPU, torch.bfloat16)
    assert not takes_int8_head("int8", None, torch.device("meta"), f32)


@pytest.mark.skipif(not cpu_kernels_available(), reason="the int8 head runs the compiled int8 kernel")
def test_untied_head_logits_equal_the_rounded_rows_and_the_embedding_stays_float() -> None:
    model = _Model(vocab=70, hidden=48, tied=False)
    w = model.lm_head.weight.detach().clone()  # (V, H)
    embedding = model.embed_tokens.weight.detach().clone()
    hidden = torch.randn(5, 48, generator=torch.Generator().manual_seed(1))  # (N, H)
    assert hold_lm_head_int8(model, tied=False) == w.numel() * 4
    q, s = quantize_definition(w)
    assert torch.equal(model.lm_head.qweight, q) and torch.equal(model.lm_head.weight_scale, s)
    logits = model.lm_head(hidden)  # (N, V) float32
    reference = hidden.double() @ (q.double() * s.double()[:, None]).t()
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits.double(), reference, atol=1e-5, rtol=1e-5)
    assert torch.equal(logits[:, 3], torch.zeros(5))
    # The rounding is real: the float head's logits differ by more than the bound above.
    assert (hidden @ w.t() - logits).abs().max() > 1e-4
    ids = torch.tensor([0, 3, 69])
    assert torch.equal(model.embed_tokens(ids), embedding[ids])  # untouched, float


@pytest.mark.skipif(not cpu_kernels_available(), reason="the int8 head runs the compiled int8 kernel")
def test_a_tied_embedding_gathers_the_heads_int8_rows() -> None:
    model = _Model(vocab=70, hidden=48, tied=True)
    w = model.embed_tokens.weight.detach().clone()
    assert hold_lm_head_int8(model, tied=True) == w.numel() * 4  # one matrix, released once
    assert model.embed_tokens.qweight is model.lm_head.qweight
    assert not hasattr(model.embed_tokens, "weight") and not hasattr(model.lm_head, "weight")
    q, s = quantize_definition(w)
    ids = torch.tensor([5, 0, 69, 5])
    assert torch.equal(model.embed_tokens(ids), q[ids].float() * s[ids, None])  # (T, H): q * s in float32


def test_hold_int8_refuses_rows_of_another_shape() -> None:
    head = ParallelLMHead(70, 48, ParallelContext.single(), dtype=torch.float32)
    with pytest.raises(ValueError, match=r"int8 rows must be \[70, 48\] int8"):
        head.hold_int8(torch.zeros(70, 47, dtype=torch.int8), torch.ones(70))
    with pytest.raises(ValueError, match="int8 rows must be"):
        head.hold_int8(torch.zeros(70, 48, dtype=torch.int8), torch.ones(69))
    assert head.weight.shape == (70, 48)  # nothing was replaced
