"""How many KV blocks one rank can hold: sized from the device's memory unless the user says.

Order of precedence (docs/design/scheduling.md, "KV cache sizing"):

1. ``--num-gpu-blocks-override N``: exactly ``N`` blocks, no measurement (vLLM's flag).
2. ``--kv-cache-memory-bytes B``: as many blocks as fit in ``B`` bytes.
3. CUDA (vLLM's rule): load the weights, run a profiling step as large as the
   scheduler can ever send (:func:`profile_plans`), then give the cache
   ``gpu_memory_utilization * total - used_at_peak`` bytes, where ``used_at_peak``
   is everything in use on the GPU at the profile's peak (this process's tensors
   at their peak, its CUDA context and NCCL buffers, any other process), read from
   ``torch.cuda.mem_get_info`` and the caching allocator's statistics.
4. CPU: ``gpu_memory_utilization * CPU_MEMORY_FRACTION`` of the host's available
   memory (``MemAvailable`` of /proc/meminfo, and no more than the cgroup's limit less
   its usage in a container, read after the weights are loaded),
   split evenly between the host's ranks, and never more than ``max_num_seqs``
   sequences of ``max_model_len`` tokens (more blocks could never be used, and a
   CPU cache is zeroed in RAM at start-up); a hybrid's states come on top of that cap
   (:func:`cpu_kv_cache_bytes`).

The coordinator takes the smallest count over the ranks and refuses to start when
one ``max_model_len`` sequence does not fit (launch/leader.py).

Weight-only int8 (``--quantization int8``) needs no rule of its own, because both
measurements are taken after loading: on CUDA the profile's peak holds the int8
weights and scales as allocated (the float slices quantized while loading are freed,
and ``empty_cache`` returns them, before the peak is reset), plus the matmul's
temporaries; on the CPU ``MemAvailable`` is read after the load, so the bytes the
int8 weights did not take are available to the cache. :func:`weight_bytes` is what
the rank reports as its weights' size.

Hybrid models (worker/state_cache.py) split the budget the rules above give: first the live state
slots, one per ``--max-num-seqs`` sequence; then ``STATE_CHECKPOINT_SHARE`` of what is left for
checkpoint slots (prefix caching's saved states; none without prefix caching); the rest is KV blocks
of the attention layers (:func:`cache_split`). With ``--num-gpu-blocks-override`` the blocks are as
given and the states come on top, checkpoints sized as that share of the blocks' bytes. On the CPU
the cap of rule 4 counts the states too: it was the KV cache's alone, and the states taken out of it
left a hybrid fewer than ``max_num_seqs`` full sequences (at ``--max-num-seqs 1`` fewer than one: every
hybrid refused to start with its default sizing, "raise --gpu-memory-utilization" no help).

An 8-bit KV cache (``--kv-cache-dtype fp8|int8``) needs none either: the layout's
``bytes_per_block`` counts 1 byte per element (its per-layer scales are Python floats, not
cache memory), so every rule above turns the same budget into twice the blocks of a 16-bit
cache and four times those of a float32 one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from tpserve.step import NewSequence, SamplingParams, ScheduledChunk, StepPlan

#: Share of the host's available memory a CPU rank group may turn into KV cache
#: (before ``gpu_memory_utilization``): the rest is left to activations, the
#: tokenizer, the coordinator and whatever else shares the host.
CPU_MEMORY_FRACTION = 0.5
#: Share of a hybrid model's cache budget, after its live states, given to state checkpoints (prefix caching).
STATE_CHECKPOINT_SHARE = 0.1
#: Profiling rows sample with top-p, so that the sampler's sort is part of the peak.
_PROFILE_SAMPLING = SamplingParams(temperature=1.0, top_p=0.9, seed=0)

if TYPE_CHECKING:  # torch is imported where it is used: worker/server.py imports this before torch
    import torch


@dataclass(frozen=True)
class CacheSizing:
    """What sizing needs to know (the coordinator's flags, passed to every rank).

    Attributes:
        gpu_memory_utilization: share of the device's memory tpserve may use, in (0, 1].
        max_num_batched_tokens: most tokens of one step.
        max_num_seqs: most sequences of one step.
        max_model_len: longest sequence in tokens; None: the model's ``max_position_embeddings``.
        num_local_ranks: ranks of the group on this host (they share its RAM).
        kv_cache_memory_bytes: explicit per-rank budget, or None.
        num_gpu_blocks_override: explicit block count, or None.
        num_speculative_tokens: proposals per sequence per step (speculative decoding;
            0: off): a verification step computes logits on up to k + 1 rows per sequence.
        enable_prefix_caching: a hybrid model keeps state checkpoints for prefix hits (False: none).
    """

    @property
    def checkpoint_share(self) -> float:
        """The share of a hybrid's budget, after its live states, that state checkpoints take."""
        return STATE_CHECKPOINT_SHARE if self.enable_prefix_caching else 0.0

    gpu_memory_utilization: float = 0.9
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int | None = None
    num_local_ranks: int = 1
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    num_speculative_tokens: int = 0
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of ``model``'s parameters and buffers as allocated (int8 weights: 1 byte per element).

    Tied parameters count once. Includes the norms, the embedding, the LM head, the int8
    layers' float32 scales and the rotary tables: everything loading puts on the device
    except the KV cache.
    """
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def available_host_memory_bytes(meminfo: str | Path = "/proc/meminfo", cgroup: str | Path = "/sys/fs/cgroup") -> int:
    """The memory this process may still take, in bytes: the host's available memory (Linux
    ``MemAvailable``; psutil elsewhere), and no more than its cgroup's limit less the cgroup's usage.

    A container's ``/proc/meminfo`` shows the node's memory, not the pod's limit: a CPU rank that sized
    its cache from it could be OOM-killed by its own cache (cgroup v2 ``memory.max`` and
    ``memory.current``; v1 ``memory/memory.limit_in_bytes`` and ``memory.usage_in_bytes``).

    Raises:
        RuntimeError: neither source is readable; pass ``--kv-cache-memory-bytes``.
    """
    available = None
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024  # the file counts kB
    except OSError:
        pass
    if available is None:
        try:
            import psutil
        except ImportError as exc:
            raise RuntimeError(f"cannot read the available memory ({meminfo}, psutil); "
                               "pass --kv-cache-memory-bytes") from exc
        available = int(psutil.virtual_memory().available)
    room = cgroup_room_bytes(Path(cgroup))
    return available if room is None else min(available, room)


def cgroup_room_bytes(cgroup: Path) -> int | None:
    """The cgroup's memory limit less its usage, in bytes; None without a limit (or a readable cgroup)."""
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            limit_text = (cgroup / limit_file).read_text().strip()
            usage = int((cgroup / usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit_text == "max" or not limit_text.isdigit() or int(limit_text) >= 2**62:  # v1's "no limit"
            return None
        return max(int(limit_text) - usage, 0)
    return None


def cpu_kv_cache_bytes(sizing: CacheSizing, available_bytes: int, bytes_per_block: int, block_size: int,
                       state_bytes_per_slot: int = 0) -> int:
    """The CPU rule (item 4 of the module docstring), in bytes. ``state_bytes_per_slot``: a hybrid model's state
    per sequence (0: attention only); the cap then holds ``max_num_seqs`` live states and their sequences' KV
    blocks after :func:`cache_split` sets the checkpoints' share aside."""
    share = int(sizing.gpu_memory_utilization * CPU_MEMORY_FRACTION * available_bytes) // sizing.num_local_ranks
    blocks_per_seq = -(-sizing.max_model_len // block_size)
    kv_cap = sizing.max_num_seqs * blocks_per_seq * bytes_per_block
    if state_bytes_per_slot:  # live states first; the checkpoints take their share of the rest
        kv_cap = sizing.max_num_seqs * state_bytes_per_slot + math.ceil(kv_cap / (1 - sizing.checkpoint_share)) + \
            bytes_per_block  # a block's slack for the rounding down in cache_split
    return min(share, kv_cap)


def cuda_kv_cache_bytes(device: torch.device, utilization: float, profile: Callable[[], int]) -> int:
    """The CUDA rule (item 3): run ``profile`` and measure what is left.

    Args:
        device: the rank's GPU (the calling thread's current device).
        utilization: ``gpu_memory_utilization``.
        profile: runs the largest step; returns the bytes of the temporary KV
            cache it allocated (counted in the peak, but not an activation).

    Returns:
        Bytes the KV cache may take.

    Raises:
        ValueError: nothing is left for the cache; the message gives the numbers.
    """
    import torch

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    profile_cache_bytes = profile()
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    peak = torch.cuda.max_memory_allocated(device) - profile_cache_bytes  # weights + activations
    non_torch = total - free - torch.cuda.memory_reserved(device)  # CUDA context, NCCL, other processes
    used_at_peak = peak + non_torch
    budget = int(utilization * total) - used_at_peak
    torch.cuda.empty_cache()  # return the profile's activations to the driver before the cache is allocated
    if budget <= 0:
        raise ValueError(
            f"no memory left for the KV cache on {device}: gpu_memory_utilization={utilization} of "
            f"{total / 2**30:.1f} GiB is {utilization * total / 2**30:.1f} GiB, and the weights, the profiled "
            f"step's activations and other users already take {used_at_peak / 2**30:.1f} GiB; raise "
            f"--gpu-memory-utilization, lower --max-num-batched-tokens, or use more ranks"
        )
    return budget


def profile_plans(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                  block_size: int, num_speculative_tokens: int = 0) -> tuple[int, list[StepPlan]]:
    """The steps the CUDA profile runs, and the KV blocks they need.

    1. the largest prefill step: ``max_num_batched_tokens`` tokens over
       ``min(max_num_seqs, max_num_batched_tokens)`` sequences, one token each
       plus the rest in chunks of at most ``max_model_len`` tokens, all sampling;
    2. the largest decode step: that many sequences, each decoding at position
       ``max_model_len - 1`` (attention over a full context). Their block tables
       repeat block 0, so the profile cache stays small while the attention's
       working memory is that of full contexts;
    3. with speculative decoding, the largest verification step: that many sequences,
       each with as many proposals (at most ``num_speculative_tokens``) as the token
       budget allows, ending at ``max_model_len - 1`` (logits on every one of their rows);
    4. a step that drops every sequence.

    Returns:
        ``(num_blocks, plans)``.
    """
    num_seqs = min(max_num_seqs, max_num_batched_tokens)
    lengths = [1] * num_seqs
    rest, i = max_num_batched_tokens - num_seqs, 0
    while rest > 0 and i < num_seqs:
        extra = min(rest, max_model_len - 1)
        lengths[i] += extra
        rest, i = rest - extra, i + 1
    new, chunks, next_block = [], [], 0
    for seq_id, length in enumerate(lengths):
        num_blocks = -(-length // block_size)
        new.append(NewSequence(seq_id, _PROFILE_SAMPLING))
        chunks.append(ScheduledChunk(seq_id, (0,) * length, 0, tuple(range(next_block, next_block + num_blocks))))
        next_block += num_blocks
    prefill = StepPlan(0, tuple(new), tuple(chunks))
    full_table = (0,) * -(-max_model_len // block_size)
    decode_ids = range(num_seqs, 2 * num_seqs)
    decode = StepPlan(
        1,
        tuple(NewSequence(s, _PROFILE_SAMPLING) for s in decode_ids),
        tuple(ScheduledChunk(s, (0,), max_model_len - 1, full_table) for s in decode_ids),
        finished_seq_ids=tuple(range(num_seqs)),
    )
    plans = [prefill, decode]
    num_spec = min(num_speculative_tokens, (max_num_batched_tokens - num_seqs) // num_seqs, max_model_len - 1)
    if num_spec > 0:
        spec_ids = range(2 * num_seqs, 3 * num_seqs)
        start = max_model_len - 1 - num_spec
        plans.append(StepPlan(
            2, tuple(NewSequence(s, _PROFILE_SAMPLING) for s in spec_ids),
            tuple(ScheduledChunk(s, (0,) * (num_spec + 1), start, full_table, num_spec_tokens=num_spec)
                  for s in spec_ids),
            finished_seq_ids=tuple(decode_ids)))
        decode_ids = spec_ids
    return next_block, plans + [StepPlan(len(plans), finished_seq_ids=tuple(decode_ids))]


def num_kv_blocks(runner, sizing: CacheSizing, read_available: Callable[[], int] = available_host_memory_bytes) -> int:
    """KV blocks this rank can hold, by the precedence of the module docstring.

    Args:
        runner: the rank's :class:`~worker.model_runner.ModelRunner`, weights loaded,
            no KV cache yet (the CUDA profile allocates and frees a small one).
        sizing: the flags.
        read_available: the host's available memory in bytes (tests replace it).

    Raises:
        ValueError: on CUDA, nothing is left for the cache.
    """
    if sizing.num_gpu_blocks_override is not None:
        return sizing.num_gpu_blocks_override
    if sizing.max_model_len is None:
        sizing = replace(sizing, max_model_len=runner.config.max_position_embeddings)
    layout = runner.kv_layout
    if sizing.kv_cache_memory_bytes is not None:
        budget = sizing.kv_cache_memory_bytes
    elif runner.ctx.device.type == "cuda":
        budget = cuda_kv_cache_bytes(runner.ctx.device, sizing.gpu_memory_utilization, lambda: _profile(runner, sizing))
    else:
        budget = cpu_kv_cache_bytes(sizing, read_available(), layout.bytes_per_block, layout.block_size,
                                    runner.state_bytes_per_slot)
    return layout.num_blocks_for_budget(budget)


def cache_split(runner, sizing: CacheSizing, read_available: Callable[[], int] = available_host_memory_bytes
                ) -> tuple[int, int]:
    """``(KV blocks, state slots)`` this rank can hold: :func:`num_kv_blocks`' budget, split for a hybrid model
    as the module docstring says (``state slots`` 0 for an attention-only model).

    Raises:
        ValueError: as :func:`num_kv_blocks`; a hybrid's budget does not hold ``max_num_seqs`` states.
    """
    num_blocks = num_kv_blocks(runner, sizing, read_available)
    slot_bytes = runner.state_bytes_per_slot
    if not slot_bytes:
        return num_blocks, 0
    block_bytes = runner.kv_layout.bytes_per_block
    if sizing.num_gpu_blocks_override is not None:
        return num_blocks, sizing.max_num_seqs + int(sizing.checkpoint_share * num_blocks * block_bytes) // slot_bytes
    left = num_blocks * block_bytes - sizing.max_num_seqs * slot_bytes  # after the live states
    if left <= 0:
        raise ValueError(f"the cache budget ({num_blocks * block_bytes / 2**20:.1f} MiB) does not hold "
                         f"--max-num-seqs {sizing.max_num_seqs} sequences' states of {slot_bytes} bytes each; "
                         "lower --max-num-seqs or give the cache more memory")
    num_checkpoints = int(sizing.checkpoint_share * left) // slot_bytes
    return (left - num_checkpoints * slot_bytes) // block_bytes, sizing.max_num_seqs + num_checkpoints


def _profile(runner, sizing: CacheSizing) -> int:
    """Run :func:`profile_plans` on ``runner``; returns the temporary cache's bytes (freed again)."""
    num_blocks, plans = profile_plans(sizing.max_num_batched_tokens, sizing.max_num_seqs, sizing.max_model_len,
                                      runner.kv_layout.block_size, sizing.num_speculative_tokens)
    runner.init_kv_cache(num_blocks, num_state_slots=1)  # a hybrid's profile plans use state slot 0 only
    try:
        for plan in plans:
            runner.execute(plan)
    finally:
        runner.free_kv_cache()
    return num_blocks * runner.kv_layout.bytes_per_block
