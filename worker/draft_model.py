"""The draft model of ``--speculative-method draft``: a small model of the same vocabulary on the same ranks.

Sharded over the same tensor-parallel group as the target (worker/loader.py), with
its own paged KV cache of the same number of blocks, indexed by the **same block
tables**: a block id names the same token positions in both caches, so the
coordinator's allocator, prefix cache and rollback cover the draft's K/V too. With an 8-bit
target cache (``--kv-cache-dtype fp8|int8``) the draft's is 8-bit too, with its own scale pools and
key offsets (worker/kv_quant.py), so that the pair's blocks shrink alike.

Per step (called by :class:`worker.model_runner.ModelRunner` before the target's pass):

1. the draft runs on the step's real tokens (every chunk, speculating or not), so its
   cache holds every position the target's does, prefix-cached blocks included;
2. for the chunks with ``num_draft_tokens = k``, it proposes greedily: ``d_1`` is the
   argmax at the chunk's last row, then k decode passes feed ``d_1 .. d_k`` one at a
   time (the argmax of pass j is ``d_{j+1}``; the last pass only writes ``d_k``'s
   K/V, which the target may accept). Rank 0 takes the argmax of the gathered logits
   and broadcasts the tokens, so every rank feeds the same ones.

Greedy proposals make the draft a deterministic proposer, like n-gram lookup: the
verification (worker/spec_verify.py) is then the rejection rule with a one-hot q for
greedy and sampled requests alike, and a seeded request keeps its tokens. Rejected
positions are rewritten by later steps in both caches.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import torch

from tpserve.model_config import ModelConfig
from tpserve.step import SamplingParams, ScheduledChunk
from worker.kv_cache import KVCacheLayout
from worker.kv_layers import eight_bit_layers
from worker.loader import load_model
from worker.parallel_state import ParallelContext
from worker.attention import paged_kernel_available
from worker.kernels.triton_attention import triton_attention_available
from worker.step_inputs import StepInputs, build_step_inputs

_GREEDY = SamplingParams(temperature=0.0)


class DraftModel:
    """This rank's shard of the draft model and its KV cache.

    Args:
        model_dir: the draft's Hugging Face checkpoint directory.
        ctx: the tensor-parallel group (the target's).
        dtype: weights and activations dtype.
        block_size: tokens per KV block (the target's).
        vocab_size: the target's vocabulary size; the draft's must equal it.
        kv_cache_dtype: the cache's storage dtype, the target's (``--kv-cache-dtype``): ``dtype`` (None), or
            ``int8`` / ``float8_e4m3fn`` codes with per-token scales and a calibrated key offset per layer
            (worker/kv_quant.py), as the target's cache holds them, so that the pair's blocks shrink alike.

    Raises:
        ValueError: another vocabulary size, a draft that cannot be split
            ``ctx.tp_size`` ways, or an unsupported checkpoint.
    """

    def __init__(self, model_dir: str | Path, ctx: ParallelContext, dtype: torch.dtype, block_size: int,
                 vocab_size: int, kv_cache_dtype: torch.dtype | None = None) -> None:
        self.config = ModelConfig.from_pretrained(model_dir)
        if self.config.vocab_size != vocab_size:
            raise ValueError(f"the draft model {model_dir} has vocab_size={self.config.vocab_size}; "
                             f"the target has {vocab_size}: they must share the tokenizer")
        self.config.check_tensor_parallel(ctx.tp_size)
        self.ctx = ctx
        self.block_size = block_size
        self.kv_layout = KVCacheLayout.for_model(self.config, ctx.tp_size, block_size, kv_cache_dtype or dtype)
        self.model = load_model(model_dir, self.config, ctx, dtype)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        #: An 8-bit cache: the draft's PagedAttention modules, which hold its scale pools and key offsets (the
        #: target's runner calibrates the offsets with its own, on the same prompt: ModelRunner.init_kv_cache),
        #: or its latent attention layers' scale pools (worker/kv_layers.py).
        self.kv_layers, self.latent_layers = eight_bit_layers(self.model) if self.kv_layout.quantized else ([], [])
        self._workspace: dict[str, torch.Tensor] = {}
        #: Whether the compiled paged attention takes the draft's steps (its head size may differ).
        self.paged_kernel = (paged_kernel_available(ctx.device, dtype, self.config.head_dim)
                             and not self.config.latent_attention)
        self.triton_decode = triton_attention_available(ctx.device, block_size)

    def init_kv_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` blocks per layer (the target's block ids), and an 8-bit cache's scale pools."""
        self.kv_caches = self.kv_layout.allocate(num_blocks, self.ctx.device)
        if self.scaled_layers:
            pools = self.kv_layout.allocate_scales(num_blocks, self.ctx.device)
            for attn, (first, second) in zip(self.scaled_layers, pools, strict=True):
                attn.set_kv_scales(first, second)

    @property
    def scaled_layers(self) -> list:
        """The layers that hold an 8-bit cache's scale pools, in layer order (empty with a float cache)."""
        return [*self.kv_layers, *self.latent_layers]

    def free_kv_cache(self) -> None:
        self.kv_caches = []

    def propose(self, chunks: Sequence[ScheduledChunk], tables: Sequence[list[int]],
                inputs: StepInputs) -> list[tuple[int, ...]]:
        """Runs the draft on the step and proposes for the chunks that ask; every rank gets the same tokens.

        Args:
            chunks: the step's chunks, in plan order (``num_draft_tokens`` on some).
            tables: their block tables, covering the proposals' positions too.
            inputs: the step's inputs built from ``chunks`` (the real tokens).

        Returns:
            Per chunk, its ``num_draft_tokens`` proposed tokens (empty for the others).
        """
        hidden = self.model(inputs.input_ids, inputs.attn.positions, self.kv_caches, inputs.attn)  # (T, hidden)
        asking = [i for i, chunk in enumerate(chunks) if chunk.num_draft_tokens]
        proposals: list[list[int]] = [[] for _ in chunks]
        if not asking:
            return [()] * len(chunks)
        rows = torch.tensor([inputs.chunk_last_rows[i] for i in asking], device=hidden.device)  # (A,)
        tokens = self._argmax(hidden[rows])  # d_1 of each
        for i, token in zip(asking, tokens):
            proposals[i].append(token)
        for step in range(1, max(chunks[i].num_draft_tokens for i in asking) + 1):
            active = [i for i in asking if chunks[i].num_draft_tokens >= step]  # they feed d_step
            feed = [ScheduledChunk(chunks[i].seq_id, (proposals[i][step - 1],),
                                   chunks[i].start_position + chunks[i].num_tokens - 1 + step) for i in active]
            decode = build_step_inputs(feed, [tables[i] for i in active], [_GREEDY] * len(active), self.block_size,
                                       self.ctx.device, with_sampling=False, workspace=self._workspace,
                                       paged_kernel=self.paged_kernel, triton_decode=self.triton_decode)
            hidden = self.model(decode.input_ids, decode.attn.positions, self.kv_caches, decode.attn)  # (A', hidden)
            wanting = [n for n, i in enumerate(active) if chunks[i].num_draft_tokens > step]  # they need d_{step+1}
            if not wanting:
                continue  # the last pass only writes d_k's K/V
            tokens = self._argmax(hidden[decode.sample_rows[wanting]])
            for n, token in zip(wanting, tokens):
                proposals[active[n]].append(token)
        return [tuple(p) for p in proposals]

    def _argmax(self, hidden: torch.Tensor) -> list[int]:
        """Greedy tokens of ``hidden (A, hidden_size)``: argmax on rank 0, broadcast to every rank."""
        logits = self.model.compute_logits(hidden)  # (A, vocab) on rank 0, else None
        tokens = logits.argmax(dim=-1) if logits is not None else torch.empty(
            hidden.shape[0], dtype=torch.int64, device=hidden.device)  # (A,)
        return self.ctx.broadcast_from_rank0(tokens).tolist()


def with_proposals(chunks: Sequence[ScheduledChunk], proposals: Sequence[tuple[int, ...]]) -> tuple[ScheduledChunk, ...]:
    """The chunks the target runs: each asking chunk's tokens followed by its proposals, to verify."""
    return tuple(
        dataclasses.replace(chunk, token_ids=chunk.token_ids + proposal, num_spec_tokens=len(proposal),
                            num_draft_tokens=0) if proposal else chunk
        for chunk, proposal in zip(chunks, proposals, strict=True))
