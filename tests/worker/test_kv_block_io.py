"""worker/kv_block_io.py: blocks read out of a paged cache and written back are bit-identical, for every
cache layout (per-head, latent, 8-bit codes), and bad input is refused before anything is written."""

from __future__ import annotations

import pytest
import torch

from tpserve.model_config import KVCacheSpec
from worker.kv_block_io import copy_blocks, gather_blocks, scatter_blocks
from worker.kv_cache import KVCacheLayout

LAYOUTS = {
    "per_head_f32": (KVCacheSpec("per_head", (2, 8), (2, 8)), torch.float32),
    "per_head_bf16": (KVCacheSpec("per_head", (1, 16), (1, 16)), torch.bfloat16),
    "latent": (KVCacheSpec("latent", (1, 12), (1, 4)), torch.float32),
    "int8": (KVCacheSpec("per_head", (2, 8), (2, 8)), torch.int8),
    "fp8": (KVCacheSpec("per_head", (2, 8), (2, 8)), torch.float8_e4m3fn),
}


def _filled(layout: KVCacheLayout, num_blocks: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    caches = layout.allocate(num_blocks, torch.device("cpu"))
    gen = torch.Generator().manual_seed(seed)
    for pair in caches:
        for cache in pair:
            values = torch.randint(-100, 100, cache.shape, generator=gen, dtype=torch.int32)
            cache.copy_(values.to(cache.dtype))
    return caches


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_blocks_round_trip_bit_exact_into_other_block_ids(name: str) -> None:
    spec, dtype = LAYOUTS[name]
    layout = KVCacheLayout(num_layers=3, block_size=4, spec=spec, dtype=dtype)
    source, target = _filled(layout, 10, seed=1), _filled(layout, 12, seed=2)
    untouched = [(k.clone(), v.clone()) for k, v in target]
    data = gather_blocks(source, [7, 2, 2 + 3])
    assert len(data) == 3 and data[0][0].shape == (3, 4, *spec.first) and data[0][1].shape == (3, 4, *spec.second)
    assert data[0][0].dtype == dtype
    scatter_blocks(target, [0, 11, 4], data)
    for (sk, sv), (tk, tv), (uk, uv) in zip(source, target, untouched):
        for src, dst in ((sk, tk), (sv, tv)):  # compared as bytes: fp8 has no ==
            assert torch.equal(dst[[0, 11, 4]].view(torch.uint8), src[[7, 2, 5]].view(torch.uint8))
        others = [b for b in range(12) if b not in (0, 11, 4)]
        assert torch.equal(tk[others].view(torch.uint8), uk[others].view(torch.uint8))
        assert torch.equal(tv[others].view(torch.uint8), uv[others].view(torch.uint8))
    # The copies are the gather's own: later writes to the source do not reach them.
    source[0][0].zero_()
    assert data[0][0].view(torch.uint8).any()


def test_bad_input_is_refused_before_any_write() -> None:
    layout = KVCacheLayout(num_layers=2, block_size=4, spec=KVCacheSpec("per_head", (2, 8), (2, 8)),
                           dtype=torch.float32)
    caches = _filled(layout, 6, seed=3)
    before = [(k.clone(), v.clone()) for k, v in caches]
    data = gather_blocks(caches, [1, 2])
    with pytest.raises(ValueError, match=r"block ids \[6\] outside \[0, 6\)"):
        gather_blocks(caches, [1, 6])
    with pytest.raises(ValueError, match="repeated block ids"):
        scatter_blocks(caches, [3, 3], data)
    with pytest.raises(ValueError, match="1 layers of data for a cache of 2 layers"):
        scatter_blocks(caches, [3, 4], data[:1])
    with pytest.raises(ValueError, match=r"layer 1 data \(2, 4, 2, 8\) torch.float16"):
        scatter_blocks(caches, [3, 4], [data[0], (data[1][0].half(), data[1][1])])
    with pytest.raises(ValueError, match="takes"):
        scatter_blocks(caches, [3], data)  # two rows for one block
    for (k, v), (bk, bv) in zip(caches, before):
        assert torch.equal(k, bk) and torch.equal(v, bv)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_copy_blocks_between_pools_equals_gather_then_scatter(name: str) -> None:
    spec, dtype = LAYOUTS[name]
    layout = KVCacheLayout(num_layers=2, block_size=4, spec=spec, dtype=dtype)
    source, direct, staged = _filled(layout, 10, seed=4), _filled(layout, 30, seed=5), _filled(layout, 30, seed=5)
    copy_blocks(source, (3, 9, 3), direct, (29, 0, 7))
    scatter_blocks(staged, [29, 0, 7], gather_blocks(source, [3, 9, 3]))
    for (dk, dv), (sk, sv) in zip(direct, staged):
        assert torch.equal(dk.view(torch.uint8), sk.view(torch.uint8)) and torch.equal(dv.view(torch.uint8),
                                                                                         sv.view(torch.uint8))
    assert torch.equal(direct[1][0][29].view(torch.uint8), source[1][0][3].view(torch.uint8))


def test_copy_blocks_refuses_mismatched_pools_and_ids() -> None:
    small = KVCacheLayout(num_layers=2, block_size=4, spec=KVCacheSpec("per_head", (2, 8), (2, 8)), dtype=torch.float32)
    other = KVCacheLayout(num_layers=2, block_size=4, spec=KVCacheSpec("per_head", (1, 8), (1, 8)), dtype=torch.float32)
    source, target = _filled(small, 4, seed=6), _filled(small, 8, seed=7)
    before = [(k.clone(), v.clone()) for k, v in target]
    with pytest.raises(ValueError, match="differ in layers, block shape or dtype"):
        copy_blocks(source, [0], _filled(other, 8, seed=8), [0])
    with pytest.raises(ValueError, match="2 source blocks for 1 destinations"):
        copy_blocks(source, [0, 1], target, [0])
    with pytest.raises(ValueError, match="repeated block ids"):
        copy_blocks(source, [0, 1], target, [5, 5])
    with pytest.raises(ValueError, match=r"block ids \[8\] outside \[0, 8\)"):
        copy_blocks(source, [0], target, [8])
    for (k, v), (bk, bv) in zip(target, before):
        assert torch.equal(k, bk) and torch.equal(v, bv)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the device pool to pinned host slots path")
@pytest.mark.parametrize("name", ["per_head_bf16", "fp8", "latent"])
def test_a_cuda_pool_round_trips_through_pinned_host_slots(name: str) -> None:
    from worker.kv_host_tier import HostKVTier

    spec, dtype = LAYOUTS[name]
    layout = KVCacheLayout(num_layers=2, block_size=4, spec=spec, dtype=dtype)
    host_filled = _filled(layout, 8, seed=9)
    caches = [(k.cuda(), v.cuda()) for k, v in host_filled]
    tier = HostKVTier(caches, 16)
    assert tier.slots[0][0].is_pinned() and tier.num_bytes == 16 * layout.bytes_per_block
    tier.copy(caches, [(5, 15), (2, 0)], ())
    for k, v in caches:
        k.zero_()
        v.zero_()
    tier.copy(caches, (), [(15, 1), (0, 6)])
    torch.cuda.synchronize()
    for (k, v), (hk, hv) in zip(caches, host_filled):
        assert torch.equal(k[[1, 6]].cpu().view(torch.uint8), hk[[5, 2]].view(torch.uint8))
        assert torch.equal(v[[1, 6]].cpu().view(torch.uint8), hv[[5, 2]].view(torch.uint8))
        assert not k[[0, 2, 3, 4, 5, 7]].view(torch.uint8).any()


def test_a_cpu_host_tier_holds_its_slots_and_runs_copies_out_before_copies_in() -> None:
    from worker.kv_host_tier import HostKVTier

    layout = KVCacheLayout(num_layers=2, block_size=4, spec=KVCacheSpec("per_head", (2, 8), (2, 8)),
                           dtype=torch.float32)
    caches = _filled(layout, 6, seed=10)
    original = [(k.clone(), v.clone()) for k, v in caches]
    tier = HostKVTier(caches, 12)
    assert tier.num_bytes == 12 * layout.bytes_per_block and not tier.slots[0][0].is_pinned()
    # Block 3 goes out to slot 11 and, in the same plan, slot 11's copy comes into block 4 and block 3
    # is overwritten by slot 0 (empty): the copy out must have read block 3 first.
    tier.copy(caches, [(3, 11)], [(11, 4), (0, 3)])
    for (k, v), (ok, ov) in zip(caches, original):
        assert torch.equal(k[4], ok[3]) and torch.equal(v[4], ov[3]) and not k[3].any()
    with pytest.raises(ValueError, match="num_slots >= 1"):
        HostKVTier(caches, 0)
