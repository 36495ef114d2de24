"""The runner's state pool (worker/state_cache.py) and a hybrid's memory split (worker/memory.py).

The step's StateMetadata follows the flat batch's row order (decodes first, whatever the plan's
order), carries each sequence's checkpoints and keeps a sequence with one out of the decode
group; fresh chunks start from zeroed slots and restores copy checkpoints into live slots before
the step; the model's cache list interleaves KV pairs and state tuples by layer kind. The budget
goes to the live states first, then a share to checkpoints, the rest to KV blocks.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tpserve.step import NewSequence, SamplingParams, ScheduledChunk, StepPlan
from worker.memory import STATE_CHECKPOINT_SHARE, CacheSizing, cache_split
from worker.state_cache import StateCache, bytes_per_state_slot
from worker.step_inputs import build_step_inputs

CPU = torch.device("cpu")


class _Layer(nn.Module):
    """A state layer's shapes only: a (4, 2) float32 window and a (3,) float16 vector per slot."""

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        return ((4, 2), (3,))

    def state_dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.float32, torch.float16)


def test_the_pool_is_sized_from_the_layers_and_interleaved_with_the_kv_pairs() -> None:
    layers = {0: _Layer(), 2: _Layer()}
    assert bytes_per_state_slot(layers) == 2 * (4 * 2 * 4 + 3 * 2)
    cache = StateCache(layers, 5, CPU)
    assert [tuple(t.shape) for t in cache.states[2]] == [(5, 4, 2), (5, 3)]
    assert cache.states[2][1].dtype == torch.float16 and not cache.states[0][0].any()
    kv = [(torch.zeros(1), torch.zeros(1)), (torch.ones(1), torch.ones(1))]
    merged = cache.layer_caches(kv, 4)
    assert merged[0] is cache.states[0] and merged[1] is kv[0] and merged[2] is cache.states[2] and merged[3] is kv[1]
    with pytest.raises(ValueError, match="3 KV caches for 2 attention layers"):
        cache.layer_caches(kv + kv[:1], 4)
    with pytest.raises(ValueError, match=r"step 7: state slots \[5\] outside \[0, 5\)"):
        cache.check_slots(7, [0, 5])


def test_metadata_follows_the_row_order_and_keeps_checkpointed_sequences_out_of_the_decode_group() -> None:
    cache = StateCache({0: _Layer()}, 16, CPU)
    chunks = (ScheduledChunk(1, (5, 6, 7, 8, 9), 0, (0, 1), sample=False),  # a prefill: after the decodes
              ScheduledChunk(2, (3,), 9, ()),  # decodes
              ScheduledChunk(3, (4,), 4, ()),
              ScheduledChunk(4, (8,), 3, (2,)))  # one row that ends on a boundary: a checkpoint
    plan = StepPlan(3, scheduled=chunks, state_checkpoints=((1, 4, 12), (4, 1, 13), (1, 2, 11)))
    tables = [[0, 1, 2, 3]] * 4
    inputs = build_step_inputs(chunks, tables, [SamplingParams()] * 4, 4, CPU)
    meta = cache.metadata(plan, chunks, [7, 8, 9, 10], inputs.chunk_last_rows)
    assert meta.host_slots == (8, 9, 10, 7) and meta.slots.tolist() == [8, 9, 10, 7]  # decodes first
    assert meta.query_start_loc == (0, 1, 2, 3, 8)
    assert meta.num_decodes == 2  # seq 4 has a checkpoint: chunked form
    assert meta.checkpoints == ((), (), ((1, 13),), ((2, 11), (4, 12)))
    assert meta.segments(3) == [(3, 5, 11), (5, 7, 12), (7, 8, None)]
    assert meta.segments(2) == [(2, 3, 13)]
    plain = cache.metadata(StepPlan(4, scheduled=chunks[1:3]), chunks[1:3], [8, 9], (0, 1))
    assert plain.num_decodes == 2 and plain.checkpoints == ()


def test_prepare_zeroes_fresh_slots_then_restores_checkpoints() -> None:
    cache = StateCache({0: _Layer()}, 8, CPU)
    window = cache.states[0][0]
    for slot in range(8):
        window[slot] = slot + 1.0
    chunks = (ScheduledChunk(1, (5, 6), 0, (0,)), ScheduledChunk(2, (7,), 8, (1,)), ScheduledChunk(3, (4,), 3, ()))
    plan = StepPlan(0, (NewSequence(1, SamplingParams(), state_slot=1), NewSequence(2, SamplingParams(), state_slot=2)),
                    chunks, restored_states=((2, 6),))
    cache.prepare(plan, [1, 2, 3])
    assert window[:, 0, 0].tolist() == [1.0, 0.0, 7.0, 4.0, 5.0, 6.0, 7.0, 8.0]  # 1 fresh, 2 from checkpoint 6, 3 kept


class _Runner:
    """What cache_split reads of a runner: the layout's bytes per block, the bytes per state slot (and for the CPU
    rule, its device and the model's positions)."""

    def __init__(self, slot_bytes: int) -> None:
        self.state_bytes_per_slot = slot_bytes
        self.ctx = type("Ctx", (), {"device": torch.device("cpu")})()
        self.config = type("Config", (), {"max_position_embeddings": 640})()
        self.kv_layout = type("Layout", (), {"bytes_per_block": 1000, "block_size": 16,
                                             "num_blocks_for_budget": lambda self, b: b // 1000})()


def test_a_hybrid_budget_holds_the_live_states_then_checkpoints_then_kv_blocks() -> None:
    sizing = CacheSizing(max_num_seqs=8, max_model_len=64, kv_cache_memory_bytes=1_000_000)
    assert cache_split(_Runner(0), sizing) == (1000, 0)  # attention only: every byte is KV
    num_blocks, num_slots = cache_split(_Runner(2000), sizing)
    left = 1_000_000 - 8 * 2000
    checkpoints = int(STATE_CHECKPOINT_SHARE * left) // 2000
    assert (num_blocks, num_slots) == ((left - checkpoints * 2000) // 1000, 8 + checkpoints) == (886, 57)
    with pytest.raises(ValueError, match="does not hold --max-num-seqs 8 sequences' states of 200000 bytes"):
        cache_split(_Runner(200_000), sizing)
    override = CacheSizing(max_num_seqs=8, max_model_len=64, num_gpu_blocks_override=100)
    assert cache_split(_Runner(2000), override) == (100, 8 + 5)  # states on top: 10 % of 100 blocks' bytes


@pytest.mark.parametrize("max_num_seqs", [1, 4])
@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_the_cpu_cap_leaves_a_hybrid_max_num_seqs_whole_sequences(max_num_seqs: int,
                                                                  enable_prefix_caching: bool) -> None:
    """The CPU rule's cap (``max_num_seqs`` sequences of ``max_model_len``) was the KV cache's alone, and the states
    came out of it: at --max-num-seqs 1 a hybrid held 34 blocks of the 40 one 640-token sequence needs, so every
    hybrid refused to start with its default sizing. Without prefix caching no checkpoint slot is set aside."""
    sizing = CacheSizing(max_num_seqs=max_num_seqs, max_model_len=640, enable_prefix_caching=enable_prefix_caching)
    num_blocks, num_slots = cache_split(_Runner(2000), sizing, read_available=lambda: 64 << 30)  # RAM to spare
    assert max_num_seqs * 40 <= num_blocks <= max_num_seqs * 40 + 2  # the cap still binds (a rounding block or two)
    checkpoints = num_slots - max_num_seqs
    assert (checkpoints > 0) == enable_prefix_caching
