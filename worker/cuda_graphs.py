"""CUDA graphs for decode steps: the forward pass captured once per batch size, replayed every step.

A decode step launches a dozen kernels per layer, each doing little work, so on a
GPU a small batch waits on the host that launches them (hundreds of launches,
a few microseconds each) more than on the memory it streams. Capturing the forward
pass into a CUDA graph once and replaying it makes a step one launch. vLLM and
SGLang do the same for decode batches of the common sizes (vLLM's capture sizes
1, 2, 4 and multiples of 8, the default here too).

A graph replays the kernels it recorded on the addresses it recorded, so:

* the step's inputs are copied into static buffers (token ids, positions, KV
  slots, block tables, context lengths), sized for the largest batch and for
  ``max_model_len`` tokens of context, and the graph of batch size ``B`` reads
  their first ``B`` rows;
* attention is the Triton paged kernel (worker/kernels/triton_attention.py),
  whose shapes depend on ``B`` only: it reads the context lengths from the
  device, so one graph serves every context length;
* a step of ``S`` sequences replays the graph of the smallest capture size
  ``B >= S``. The ``B - S`` padding rows feed token 0 at position 0, write their
  keys and values into the *null block* (one block past the allocator's ids,
  that no sequence owns) and attend over that one slot; their outputs are
  dropped.

Steps that a graph does not take run eagerly: any prefill or multi-token chunk,
more sequences than the largest capture size, a longer block table than the
buffers hold, or a draft model (its proposals run passes of their own).

Memory: the graphs share one memory pool, captured largest first so the
smaller ones reuse its blocks (vLLM's order); each keeps its output alive.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tpserve.step import ScheduledChunk
from worker.attention import AttentionMetadata
from worker.step_inputs import StepInputs

#: vLLM's default capture sizes (``cudagraph_capture_sizes``): 1, 2, 4, then multiples of 8 up to 512.
MAX_CAPTURE_SIZE = 512


def default_capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """vLLM's capture sizes up to the smallest one that holds ``max_num_seqs`` sequences.

    Raises:
        ValueError: ``max_num_seqs < 1``.
    """
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = []
    for size in [1, 2, 4, *range(8, MAX_CAPTURE_SIZE + 1, 8)]:
        sizes.append(size)
        if size >= max_num_seqs:
            break
    return tuple(sizes)


class DecodeGraphs:
    """Captured decode forward passes of one rank's model, one per batch size.

    Args:
        model: the rank's :class:`~worker.models.base.CausalLM`; its forward must
            take an :class:`AttentionMetadata` with ``triton_decode``.
        kv_caches: the rank's caches, per layer ``(num_blocks + 1, block_size, KVH, d)``:
            block ``null_block = num_blocks`` is the padding rows' (see the module docstring).
        null_block: the block id no sequence owns.
        block_size: tokens per block.
        max_model_len: longest context a graph takes, in tokens (sizes the block tables).
        capture_sizes: batch sizes to capture, each ``>= 1``.
        capture: record CUDA graphs (CUDA only). False runs the same static-buffer
            forward eagerly at the padded size: the padding, the buffers and the null
            block are then checkable on the CPU (tests/worker/test_cuda_graphs.py).

    Raises:
        ValueError: an empty or non-positive size list, ``capture`` off CUDA.
    """

    def __init__(self, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], null_block: int,
                 block_size: int, max_model_len: int, capture_sizes: Sequence[int], *, capture: bool = True) -> None:
        sizes = sorted(set(capture_sizes))
        if not sizes or sizes[0] < 1:
            raise ValueError(f"capture sizes must be positive, got {list(capture_sizes)}")
        device = kv_caches[0][0].device
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the cache is on {device}")
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = tuple(sizes)
        self.capture = capture
        self.null_block = null_block
        self.null_slot = null_block * block_size
        self.max_blocks = -(-max_model_len // block_size)
        largest = sizes[-1]
        index = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(largest, **index)  # (B,)
        self.positions = torch.zeros(largest, **index)  # (B,)
        self.slot_mapping = torch.full((largest,), self.null_slot, **index)  # (B,)
        self.block_tables = torch.full((largest, self.max_blocks), null_block, **index)  # (B, max_blocks)
        self.context_lens = torch.ones(largest, **index)  # (B,)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}  # size -> (size, hidden) static output
        self.num_replays = 0  # steps run from a graph (tests, logs)

    def _forward(self, size: int) -> torch.Tensor:
        """The model on the buffers' first ``size`` rows -> ``(size, hidden)``."""
        meta = AttentionMetadata(
            positions=self.positions[:size], slot_mapping=self.slot_mapping[:size], num_decodes=size,
            decode_block_tables=self.block_tables[:size], decode_mask=None, prefills=(),
            decode_context_lens=self.context_lens[:size], triton_decode=True,
        )
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, meta)

    def capture_all(self) -> None:
        """Warm up and capture every size, largest first, inside ``inference_mode``.

        Every rank of a tensor-parallel group must call it, with the same sizes: the
        warm-up passes all-reduce (the captured ones record NCCL's kernels).
        """
        with torch.inference_mode():
            pool = torch.cuda.graph_pool_handle() if self.capture else None
            for size in reversed(self.sizes):
                self._forward(size)  # warm-up, outside the graph: Triton compiles, cuBLAS picks its kernels
                if not self.capture:
                    continue
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._outputs[size] = self._forward(size)
                self._graphs[size] = graph
            if self.capture:
                torch.cuda.synchronize()

    def padded_size(self, num_seqs: int) -> int | None:
        """The capture size a step of ``num_seqs`` sequences replays; None when it exceeds the largest."""
        for size in self.sizes:
            if size >= num_seqs:
                return size
        return None

    def takes(self, chunks: Sequence[ScheduledChunk], inputs: StepInputs) -> bool:
        """Whether a step (its plan's chunks and built inputs) can replay a graph.

        Pure decodes only (one token each, nothing to verify), at most the largest
        capture size, block tables within the buffers, the Triton decode path.
        """
        meta = inputs.attn
        return (bool(chunks) and meta.triton_decode and not meta.prefills
                and meta.num_decodes == len(chunks) <= self.sizes[-1]
                and all(c.num_tokens == 1 and not c.num_draft_tokens for c in chunks)
                and meta.decode_block_tables.shape[1] <= self.max_blocks)

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """Replay the step (``takes`` said yes) -> final hidden states ``(S, hidden)``.

        The returned rows are a view of the graph's static output: read them
        before the next step.
        """
        meta = inputs.attn
        num_seqs = meta.num_decodes
        size = self.padded_size(num_seqs)
        width = meta.decode_block_tables.shape[1]
        self.input_ids[:num_seqs].copy_(inputs.input_ids)
        self.positions[:num_seqs].copy_(meta.positions)
        self.slot_mapping[:num_seqs].copy_(meta.slot_mapping)
        self.block_tables[:num_seqs, :width].copy_(meta.decode_block_tables)  # columns past width: never read
        self.context_lens[:num_seqs].copy_(meta.decode_context_lens)
        if size > num_seqs:  # padding rows: a step of more sequences may have left real slots there
            self.input_ids[num_seqs:size].zero_()
            self.positions[num_seqs:size].zero_()
            self.slot_mapping[num_seqs:size].fill_(self.null_slot)
            self.block_tables[num_seqs:size, 0].fill_(self.null_block)
            self.context_lens[num_seqs:size].fill_(1)
        self.num_replays += 1
        if not self.capture:
            return self._forward(size)[:num_seqs]
        self._graphs[size].replay()
        return self._outputs[size][:num_seqs]
