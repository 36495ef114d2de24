"""What a decode step keeps or computes faster than the tensor ops it replaces must equal them.

* the compiled sampler passes (worker/kernels/cpu_sampling.cpp, 8 tokens at a time) against the
  int64 tensor ops and torch's argmax, on a vocabulary that is not a multiple of 8 and with equal
  maxima in different vector lanes and in the scalar tail;
* :class:`worker.sampler.SamplingCache`: reused while a batch keeps its parameter objects, rebuilt
  when one changes, and the tokens equal those of the packed path;
* the RoPE cos/sin table (worker/layers/rotary.py) against the per-step computation.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from tpserve.step import SamplingParams
from worker.kernels import _cpu_supports_avx2, cpu_kernels_available
from worker.layers.rotary import RotaryEmbedding
from worker.sampler import SamplingCache, SamplingTensors, sample_tensors, sampling_uniform

needs_kernels = pytest.mark.skipif(not (_cpu_supports_avx2() and shutil.which("c++")),
                                   reason="needs an AVX2 CPU and a C++ compiler")


@needs_kernels
@pytest.mark.parametrize("vocab_size", [1, 7, 1003])
def test_the_vectorised_uniforms_equal_the_tensor_ops_in_every_lane_and_the_tail(vocab_size: int) -> None:
    assert cpu_kernels_available()
    seeds = torch.tensor([0, -1, 2**62, 12345], dtype=torch.int64)
    positions = torch.tensor([0, 4095, 1, 2**40], dtype=torch.int64)
    assert torch.equal(sampling_uniform(seeds, positions, vocab_size),
                       sampling_uniform(seeds, positions, vocab_size, kernel=False))


@needs_kernels
def test_the_vectorised_race_keeps_the_first_of_equal_maxima_across_lanes_and_the_tail() -> None:
    assert cpu_kernels_available()
    vocab_size = 1003  # 125 vectors of 8 and a tail of 3
    probs = torch.full((5, vocab_size), 1e-4)
    log_u = torch.full((5, vocab_size), -1.0)  # noise 1: the quotient is the probability
    probs[0, [17, 10, 3]] = 0.5  # lanes 1, 2, 3 of different vectors: the first is 3
    probs[1, [1001, 1002]] = 0.5  # only in the tail
    probs[2, [7, 1001]] = 0.5  # a vector lane and the tail
    probs[3, 500] = float("nan")  # not finite: flagged
    probs[4] = 0.0  # every quotient 0: token 0
    tokens, finite = torch.ops.tpserve_cpu.exponential_race(probs, log_u)
    assert tokens[[0, 1, 2, 4]].tolist() == [3, 1001, 7, 0]
    assert torch.equal(tokens[[0, 1, 2, 4]], (probs / -log_u).argmax(dim=-1)[[0, 1, 2, 4]])
    assert finite.tolist() == [True, True, True, False, True]


def test_the_sampling_cache_is_reused_for_the_same_objects_and_rebuilt_for_others() -> None:
    params = [SamplingParams(seed=3), SamplingParams(temperature=0.0), SamplingParams(top_k=5, seed=9)]
    cache = SamplingCache()
    positions = torch.tensor([4, 9, 2])
    first = cache.tensors(params, positions, torch.device("cpu"))
    again = cache.tensors(list(params), positions + 1, torch.device("cpu"))  # a new list, the same objects
    assert again.seeds is first.seeds and torch.equal(again.positions, positions + 1)
    swapped = [params[0], SamplingParams(temperature=0.0), params[2]]  # an equal value, another object
    assert cache.tensors(swapped, positions, torch.device("cpu")).seeds is not first.seeds
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 3
    packed = SamplingTensors.from_params(params, positions.tolist(), torch.device("cpu"))
    assert torch.equal(sample_tensors(logits, cache.tensors(params, positions, torch.device("cpu"))),
                       sample_tensors(logits, packed))


@pytest.mark.parametrize("num_rows", [1, 63, 64])
def test_the_rope_table_equals_the_per_step_computation(num_rows: int) -> None:
    rope = RotaryEmbedding(16, 10000.0, None, torch.device("cpu"), max_position=512)
    positions = torch.randint(0, 512, (num_rows,), generator=torch.Generator().manual_seed(num_rows))
    for table, computed in zip(rope(positions, torch.float32), rope._compute(positions, torch.float32, None)):
        assert table.shape == (num_rows, 1, 16) and torch.equal(table, computed)
    past = torch.tensor([511, 600])  # past the table: computed
    assert torch.equal(rope(past, torch.float32)[0], rope._compute(past, torch.float32, None)[0])
