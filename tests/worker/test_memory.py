"""KV cache sizing: precedence of the flags, the CUDA rule (mocked), the CPU rule, the profiling steps."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from coordinator.block_allocator import check_pool_holds_a_full_sequence
from tests.worker.cuda_mock import GIB, FakeCuda
from tpserve.embedded_model import default_model_dir
from worker.memory import (
    CPU_MEMORY_FRACTION,
    CacheSizing,
    _profile,
    available_host_memory_bytes,
    cpu_kv_cache_bytes,
    cuda_kv_cache_bytes,
    num_kv_blocks,
    profile_plans,
)
from worker.model_runner import ModelRunner
from worker.parallel_state import ParallelContext


def _fake_runner(device: str, bytes_per_block: int = 1 << 20, block_size: int = 16) -> SimpleNamespace:
    layout = SimpleNamespace(bytes_per_block=bytes_per_block, block_size=block_size,
                             num_blocks_for_budget=lambda budget: max(0, budget // bytes_per_block))
    return SimpleNamespace(kv_layout=layout, ctx=SimpleNamespace(device=torch.device(device)),
                           config=SimpleNamespace(max_position_embeddings=4096), state_bytes_per_slot=0)


def test_explicit_blocks_then_explicit_bytes_win_over_measuring() -> None:
    runner = _fake_runner("cuda:0")  # would profile, but must not
    assert num_kv_blocks(runner, CacheSizing(num_gpu_blocks_override=7, kv_cache_memory_bytes=1 << 30)) == 7
    assert num_kv_blocks(runner, CacheSizing(kv_cache_memory_bytes=10 << 20)) == 10


def test_cuda_rule_takes_utilization_of_total_minus_what_the_profile_used(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = FakeCuda(total=80 * GIB, free=20 * GIB, reserved=58 * GIB, peak=40 * GIB).install(monkeypatch)
    profiled = []
    budget = cuda_kv_cache_bytes(torch.device("cuda", 0), 0.9, lambda: profiled.append(cuda.events[:]) or GIB)
    # 72 GiB allowed; at the peak: 39 GiB of weights and activations (40 minus the 1 GiB profile
    # cache) plus 2 GiB outside torch's allocator (80 - 20 free - 58 reserved).
    assert budget == int(0.9 * 80 * GIB) - (39 * GIB + 2 * GIB)
    assert profiled == [["empty_cache", "reset_peak_memory_stats"]]  # peak reset before the profile


def test_cuda_rule_refuses_when_nothing_is_left(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeCuda(total=80 * GIB, free=2 * GIB, reserved=76 * GIB, peak=75 * GIB).install(monkeypatch)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.9 of 80.0 GiB is 72.0 GiB.*take 77.0 GiB"):
        cuda_kv_cache_bytes(torch.device("cuda", 0), 0.9, lambda: 0)


def test_cpu_rule_splits_available_memory_and_caps_at_what_can_be_used() -> None:
    runner = _fake_runner("cpu", bytes_per_block=1 << 20, block_size=16)
    sizing = CacheSizing(gpu_memory_utilization=0.8, max_num_seqs=64, max_model_len=4096, num_local_ranks=2)
    available = 16 * GIB
    share = int(0.8 * CPU_MEMORY_FRACTION * available) // 2  # 3.2 GiB per rank
    assert num_kv_blocks(runner, sizing, lambda: available) == share // (1 << 20)
    # 2 sequences of 4096 tokens can never use more than 2 * 256 blocks.
    capped = CacheSizing(max_num_seqs=2, max_model_len=4096, num_local_ranks=2)
    assert num_kv_blocks(runner, capped, lambda: available) == 2 * 256
    assert cpu_kv_cache_bytes(capped, available, 1 << 20, 16) == 512 << 20


def test_available_host_memory_is_read_from_meminfo(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       32000000 kB\nMemFree:         1000 kB\nMemAvailable:   12345678 kB\n")
    assert available_host_memory_bytes(meminfo, tmp_path) == 12345678 * 1024  # no cgroup files there
    assert available_host_memory_bytes() > 0  # this machine's


def test_profile_plans_cover_the_largest_prefill_and_decode_steps() -> None:
    num_blocks, (prefill, decode, drop) = profile_plans(max_num_batched_tokens=300, max_num_seqs=8,
                                                        max_model_len=128, block_size=16)
    lengths = [c.num_tokens for c in prefill.scheduled]
    assert sum(lengths) == 300 and len(lengths) == 8 and max(lengths) <= 128
    assert all(c.sample for c in prefill.scheduled + decode.scheduled)
    assert num_blocks == sum(-(-n // 16) for n in lengths)
    assert [(c.num_tokens, c.start_position, len(c.new_block_ids)) for c in decode.scheduled] == [(1, 127, 8)] * 8
    assert set(decode.finished_seq_ids) == {c.seq_id for c in prefill.scheduled}
    assert set(drop.finished_seq_ids) == {c.seq_id for c in decode.scheduled}


def test_profile_plans_with_speculation_add_the_largest_verification_step() -> None:
    _, (_, decode, verify, drop) = profile_plans(max_num_batched_tokens=30, max_num_seqs=8, max_model_len=128,
                                                 block_size=16, num_speculative_tokens=4)
    # 8 sequences and a budget of 30 tokens: 2 proposals each (3 rows), ending at position 127.
    assert [(c.num_tokens, c.start_position, c.num_spec_tokens) for c in verify.scheduled] == [(3, 125, 2)] * 8
    assert sum(c.num_tokens for c in verify.scheduled) <= 30
    assert set(verify.finished_seq_ids) == {c.seq_id for c in decode.scheduled}
    assert set(drop.finished_seq_ids) == {c.seq_id for c in verify.scheduled}
    assert len(profile_plans(8, 8, 128, 16, num_speculative_tokens=4)[1]) == 3  # no budget left for proposals


def test_profile_runs_on_a_real_runner_and_leaves_no_cache_behind() -> None:
    runner = ModelRunner(default_model_dir(), ParallelContext.single(), torch.float32, block_size=16)
    sizing = CacheSizing(max_num_batched_tokens=600, max_num_seqs=8, max_model_len=runner.config.max_position_embeddings,
                         num_speculative_tokens=3)
    cache_bytes = _profile(runner, sizing)
    assert cache_bytes == profile_plans(600, 8, sizing.max_model_len, 16)[0] * runner.kv_layout.bytes_per_block
    assert runner.kv_caches == [] and runner.num_sequences == 0


def test_coordinator_refuses_a_pool_smaller_than_one_full_sequence() -> None:
    check_pool_holds_a_full_sequence(num_blocks=32, block_size=16, max_model_len=512)  # exactly one fits
    with pytest.raises(ValueError, match=r"holds 496 tokens \(31 blocks of 16\).*max_model_len=512"):
        check_pool_holds_a_full_sequence(num_blocks=31, block_size=16, max_model_len=512)


@pytest.mark.parametrize("files, room", [
    ({"memory.max": "max\n", "memory.current": "100\n"}, None),  # v2 without a limit
    ({"memory.max": "8589934592\n", "memory.current": "1073741824\n"}, 7 * 1024**3),  # a pod limit of 8 GiB
    ({"memory/memory.limit_in_bytes": "9223372036854771712\n", "memory/memory.usage_in_bytes": "5\n"}, None),  # v1
    ({"memory/memory.limit_in_bytes": "4096\n", "memory/memory.usage_in_bytes": "5000\n"}, 0),
    ({}, None),
])
def test_a_container_is_sized_by_its_cgroup_not_the_node(tmp_path, files, room) -> None:
    """A pod's /proc/meminfo shows the node: a CPU rank sized from it alone could be OOM-killed by its cache."""
    from worker.memory import cgroup_room_bytes

    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cgroup_room_bytes(tmp_path) == room
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 99999999 kB\nMemAvailable: 20000000 kB\n")
    expected = 20000000 * 1024 if room is None else min(room, 20000000 * 1024)
    assert available_host_memory_bytes(meminfo, tmp_path) == expected
