"""The Gated DeltaNet mixer (worker/layers/gated_delta_net.py) against ``transformers``' modules, rank by rank.

``Qwen3NextGatedDeltaNet`` (grouped ``in_proj_qkvz`` / ``in_proj_ba``) and ``Qwen3_5GatedDeltaNet`` (separate
projections) with seeded weights; our layer is loaded from the same tensors through its parameters'
``weight_loader`` at tp 1 and each rank of tp 2 (one process, identity all-reduce: each rank returns its
partial ``out_proj`` product, and the partials must sum to the reference's output). Three steps over a pool
of state slots: two prompts prefilled together (70 rows, past one 64-row chunk, checkpointed at rows 32
and 64; and 9 rows), then both decoding together (the recurrent step), then one decoding beside the other's
next prefill chunk, then a third sequence resuming from the first one's row-32 checkpoint. Every row must
equal the reference run over each whole sequence at once within 2e-5.
"""

from __future__ import annotations

import pytest
import torch

from tests.worker.shard_fakes import RecordingSource, ShardOnlyContext
from worker.layers.gated_delta_net import (GatedDeltaNet, GatedDeltaNetSizes, GroupedProjectionGatedDeltaNet,
                                           SeparateProjectionGatedDeltaNet)
from worker.state_metadata import StateMetadata, copy_state_slots

transformers = pytest.importorskip("transformers")

SIZES = GatedDeltaNetSizes(hidden_size=64, num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=8,
                           conv_kernel=4, eps=1e-6)
NUM_SLOTS = 8


def _reference(kind: str) -> torch.nn.Module:
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    config_class = (transformers.Qwen3NextConfig if kind == "qwen3_next" else transformers.Qwen3_5TextConfig)
    config = config_class(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                          linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                          linear_value_head_dim=8, linear_conv_kernel_dim=4, layer_types=["linear_attention"])
    module = (Qwen3NextGatedDeltaNet if kind == "qwen3_next" else Qwen3_5GatedDeltaNet)(config, 0).float().eval()
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in module.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.2 * noise if name == "norm.weight" else noise / param.shape[-1] ** 0.5)
    return module


def _ours(kind: str, reference: torch.nn.Module, tp: int, rank: int) -> tuple[GatedDeltaNet, dict[str, int]]:
    """Our layer for rank ``rank`` of ``tp``, loaded from the reference's tensors; rows read per tensor."""
    ctx = ShardOnlyContext(tp_rank=rank, tp_size=tp, device=torch.device("cpu"))
    layer_class = GroupedProjectionGatedDeltaNet if kind == "qwen3_next" else SeparateProjectionGatedDeltaNet
    layer = layer_class(SIZES, ctx, torch.float32)
    params = dict(layer.named_parameters())
    assert set(params) == {name for name, _ in reference.named_parameters()}  # the checkpoint's names
    rows_read = {}
    for name, tensor in reference.named_parameters():
        source = RecordingSource(tensor.detach())
        params[name].weight_loader(params[name], source, None)
        rows_read[name] = sum(len(range(*index[0].indices(tensor.shape[0]))) for index in source.reads)
    return layer, rows_read


def _run(layer: GatedDeltaNet, x: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """The three steps and the resumed sequence (module docstring); each sequence's rows of output, in order."""
    state = tuple(torch.zeros((NUM_SLOTS, *shape), dtype=dtype)
                  for shape, dtype in zip(layer.state_shapes(), layer.state_dtypes(), strict=True))
    out: dict[int, list[torch.Tensor]] = {0: [], 1: [], 2: []}
    slots = {0: 0, 1: 1, 2: 2}

    def step(chunks: list[tuple[int, int, int]], num_decodes: int,
             checkpoints: tuple[tuple[tuple[int, int], ...], ...] = ()) -> None:
        rows = torch.cat([x[s][a:b] for s, a, b in chunks])
        starts = [0]
        for _, a, b in chunks:
            starts.append(starts[-1] + b - a)
        ids = tuple(slots[s] for s, _, _ in chunks)
        meta = StateMetadata(torch.tensor(ids), tuple(starts), num_decodes, checkpoints, ids)
        y = layer(rows, state, meta)
        for i, (s, _, _) in enumerate(chunks):
            out[s].append(y[starts[i]:starts[i + 1]])

    step([(0, 0, 70), (1, 0, 9)], 0, (((32, 5), (64, 6)), ()))  # two prefills, checkpoints into slots 5, 6
    step([(0, 70, 71), (1, 9, 10)], 2)  # the decode group
    step([(0, 71, 72), (1, 10, 14)], 1)  # a decode beside a prefill chunk
    copy_state_slots([state], torch.tensor([5]), torch.tensor([2]))  # a prefix hit at row 32
    step([(2, 32, 40)], 0)
    return {s: torch.cat(chunks) for s, chunks in out.items()}


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5"])
def test_ranks_partials_sum_to_the_reference(kind: str) -> None:
    reference = _reference(kind)
    gen = torch.Generator().manual_seed(9)
    x = {0: torch.randn(72, 64, generator=gen), 1: torch.randn(14, 64, generator=gen)}
    x[2] = x[0]
    with torch.no_grad():
        want = {0: reference(x[0][None])[0], 1: reference(x[1][None])[0]}
    want[2] = want[0][32:40]
    for tp in (1, 2):
        partials = []
        for rank in range(tp):
            layer, rows_read = _ours(kind, reference, tp, rank)
            with torch.no_grad():
                partials.append(_run(layer, x))
            conv_channels = 2 * 2 * 16 + 4 * 8
            assert rows_read["conv1d.weight"] == conv_channels // tp  # only this rank's channels
            assert rows_read["A_log"] == rows_read["dt_bias"] == 4 // tp
        for s in (0, 1, 2):
            got = sum(p[s] for p in partials)
            assert got.shape == want[s].shape
            torch.testing.assert_close(got, want[s], rtol=0, atol=2e-5, msg=lambda m, s=s, tp=tp: f"tp {tp} seq {s}: {m}")
        assert want[0].abs().max() > 0.1
