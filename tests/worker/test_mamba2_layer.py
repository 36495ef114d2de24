"""The Mamba-2 mixer (worker/layers/mamba2.py, ssd.py) against ``transformers``' ``Mamba2Mixer``.

One mixer with seeded random weights (chunk size 8, so a 21-row prompt spans three chunks), loaded
into ours through the parameters' weight loaders. Checked: a whole prompt in one prefill gives the
reference's outputs; the same prompt in chunks (state carried) and then one row at a time (the
recurrent step) gives the same outputs and states; sequences batched in one step (a decode group and
prefills) give what each gives alone; a checkpoint slot receives the state at its row; tensor-parallel
shards' partial outputs sum to the whole layer's; groups that cannot split are refused; bfloat16
activations keep float32 states.
"""

from __future__ import annotations

import pytest
import torch

from tests.worker.shard_fakes import ShardOnlyContext
from worker.layers.mamba2 import Mamba2Mixer, Mamba2Spec
from worker.parallel_state import ParallelContext
from worker.state_metadata import StateMetadata

SPEC = Mamba2Spec(hidden_size=32, num_heads=8, head_dim=8, n_groups=2, d_state=16, conv_kernel=4, chunk_size=8,
                  norm_eps=1e-5)
NUM_SLOTS = 6


def _reference(spec: Mamba2Spec, seed: int = 0) -> torch.nn.Module:
    from transformers import Mamba2Config
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer as HfMamba2Mixer

    config = Mamba2Config(hidden_size=spec.hidden_size, num_heads=spec.num_heads, head_dim=spec.head_dim,
                          expand=spec.intermediate_size // spec.hidden_size, n_groups=spec.n_groups,
                          state_size=spec.d_state, conv_kernel=spec.conv_kernel, chunk_size=spec.chunk_size,
                          layer_norm_epsilon=spec.norm_eps, use_bias=spec.proj_bias, use_conv_bias=spec.conv_bias,
                          num_hidden_layers=1)
    mixer = HfMamba2Mixer(config, layer_idx=0).float().eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in mixer.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.2 * noise if name == "norm.weight" else noise / param.shape[-1] ** 0.5)
    return mixer


def _ours(reference: torch.nn.Module, spec: Mamba2Spec, ctx: ParallelContext) -> Mamba2Mixer:
    mixer = Mamba2Mixer(spec, ctx, torch.float32)
    checkpoint = dict(reference.named_parameters())
    for name, param in mixer.named_parameters():
        param.weight_loader(param, checkpoint[name].detach(), None)
    return mixer


def _states(mixer: Mamba2Mixer) -> tuple[torch.Tensor, ...]:
    return tuple(torch.zeros(NUM_SLOTS, *shape, dtype=dtype)
                 for shape, dtype in zip(mixer.state_shapes(), mixer.state_dtypes(), strict=True))


def _meta(slots: list[int], lengths: list[int], num_decodes: int,
          checkpoints: tuple[tuple[tuple[int, int], ...], ...] = ()) -> StateMetadata:
    starts = [0]
    for length in lengths:
        starts.append(starts[-1] + length)
    return StateMetadata(torch.tensor(slots, dtype=torch.int64), tuple(starts), num_decodes, checkpoints)


@pytest.fixture(scope="module")
def reference() -> torch.nn.Module:
    return _reference(SPEC)


@pytest.fixture(scope="module")
def prompt() -> torch.Tensor:
    return torch.randn(21, SPEC.hidden_size, generator=torch.Generator().manual_seed(7))


def _reference_out(reference: torch.nn.Module, u: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return reference(u[None])[0]  # (L, hidden): the chunked torch path from zero state


def test_one_prefill_matches_transformers(reference, prompt):
    mixer = _ours(reference, SPEC, ParallelContext.single())
    state = _states(mixer)
    out = mixer(prompt, state, _meta([3], [21], 0))
    torch.testing.assert_close(out, _reference_out(reference, prompt), atol=1e-5, rtol=0)
    assert state[1][3].abs().sum() > 0 and state[1][0].abs().sum() == 0  # only the sequence's slot written


def test_chunks_then_recurrent_steps_match_one_prefill(reference, prompt):
    mixer = _ours(reference, SPEC, ParallelContext.single())
    whole_state = _states(mixer)
    whole = mixer(prompt, whole_state, _meta([1], [21], 0))
    state = _states(mixer)
    outs = [mixer(prompt[:7], state, _meta([1], [7], 0)), mixer(prompt[7:13], state, _meta([1], [6], 0))]
    outs += [mixer(prompt[t:t + 1], state, _meta([1], [1], 1)) for t in range(13, 21)]  # the recurrent form
    torch.testing.assert_close(torch.cat(outs), whole, atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.cat(outs), _reference_out(reference, prompt), atol=1e-5, rtol=0)
    for carried, once in zip(state, whole_state, strict=True):
        torch.testing.assert_close(carried[1], once[1], atol=1e-5, rtol=0)


def test_batched_step_equals_each_sequence_alone(reference, prompt):
    mixer = _ours(reference, SPEC, ParallelContext.single())
    other = torch.randn(13, SPEC.hidden_size, generator=torch.Generator().manual_seed(8))
    state = _states(mixer)
    mixer(prompt[:12], state, _meta([0], [12], 0))  # two sequences mid-way, slots 0 and 2
    mixer(other[:9], state, _meta([2], [9], 0))
    third = torch.randn(11, SPEC.hidden_size, generator=torch.Generator().manual_seed(9))
    # One step: decodes of slots 0 and 2 (the recurrent group), then two fresh prompts (slots 4 and 5).
    rows = torch.cat([prompt[12:13], other[9:10], third, prompt[13:16]])
    mixed_state = tuple(s.clone() for s in state)
    mixed = mixer(rows, mixed_state, _meta([0, 2, 4, 5], [1, 1, 11, 3], 2))
    alone = [mixer(prompt[12:13], state, _meta([0], [1], 1)), mixer(other[9:10], state, _meta([2], [1], 1)),
             mixer(third, state, _meta([4], [11], 0)), mixer(prompt[13:16], state, _meta([5], [3], 0))]
    torch.testing.assert_close(mixed, torch.cat(alone), atol=1e-5, rtol=0)
    torch.testing.assert_close(mixed[:1], _reference_out(reference, prompt[:13])[12:], atol=1e-5, rtol=0)
    for got, want in zip(mixed_state, state, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_checkpoint_slot_holds_the_state_at_its_row(reference, prompt):
    mixer = _ours(reference, SPEC, ParallelContext.single())
    state = _states(mixer)
    whole = mixer(prompt, state, _meta([0], [21], 0, (((8, 4), (16, 5)),)))  # save after rows 8 and 16
    torch.testing.assert_close(whole, _reference_out(reference, prompt), atol=1e-5, rtol=0)
    for rows, slot in ((8, 4), (16, 5)):
        alone = _states(mixer)
        mixer(prompt[:rows], alone, _meta([1], [rows], 0))
        for saved, want in zip(state, alone, strict=True):
            torch.testing.assert_close(saved[slot], want[1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("n_groups", [2, 1])
def test_tensor_parallel_shards_sum_to_the_layer(n_groups, prompt):
    spec = Mamba2Spec(**{**SPEC.__dict__, "n_groups": n_groups})
    reference = _reference(spec, seed=3)
    full = _ours(reference, spec, ParallelContext.single())
    want = full(prompt, _states(full), _meta([0], [21], 0))
    torch.testing.assert_close(want, _reference_out(reference, prompt), atol=1e-5, rtol=0)
    if n_groups == 1:  # the group's norm spans both ranks: the multi-process model tests cover it
        assert Mamba2Mixer(spec, ShardOnlyContext(tp_rank=0, tp_size=2, device=torch.device("cpu")),
                           torch.float32).num_groups == 1  # replicated on each rank
        return
    partials = []
    for rank in range(2):
        shard = _ours(reference, spec, ShardOnlyContext(tp_rank=rank, tp_size=2, device=torch.device("cpu")))
        assert shard.state_shapes() == ((32 + 2 * 16, 3), (4, 8, 16))
        partials.append(shard(prompt, _states(shard), _meta([0], [21], 0)))
    torch.testing.assert_close(partials[0] + partials[1], want, atol=1e-5, rtol=0)


def test_groups_that_cannot_split_are_refused():
    spec = Mamba2Spec(**{**SPEC.__dict__, "n_groups": 4, "groups_key": "mamba_n_groups"})
    with pytest.raises(ValueError, match="mamba_n_groups=4 is not divisible by tensor_parallel_size=8"):
        Mamba2Mixer(spec, ShardOnlyContext(tp_rank=0, tp_size=8, device=torch.device("cpu")), torch.float32)


def test_bfloat16_activations_keep_float32_states(reference, prompt):
    """``--dtype bfloat16``: weights and activations in bfloat16, states float32; the outputs stay within
    bfloat16's rounding of the float32 reference, through chunks and recurrent steps."""
    mixer = Mamba2Mixer(SPEC, ParallelContext.single(), torch.bfloat16)
    checkpoint = dict(reference.named_parameters())
    for name, param in mixer.named_parameters():
        param.weight_loader(param, checkpoint[name].detach(), None)
    state = _states(mixer)
    assert [s.dtype for s in state] == [torch.float32, torch.float32]
    u = prompt.bfloat16()
    outs = [mixer(u[:13], state, _meta([2], [13], 0))]
    outs += [mixer(u[t:t + 1], state, _meta([2], [1], 1)) for t in range(13, 21)]
    out = torch.cat(outs)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), _reference_out(reference, prompt), atol=5e-2, rtol=5e-2)
