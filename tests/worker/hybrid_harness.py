"""Run a hybrid model (state layers beside attention) without the runner: hand-built caches and metadata.

The model is built and filled by the project's loader (worker/loader.py); this harness allocates
each layer's cache itself (attention: paged K/V blocks; a state layer: its state tuple, from
``state_shapes()``; Nemotron-H's MLP-only and MoE-only layers: nothing), lays out each step's flat
batch as the runner does (decode group first, then prefill chunks), builds the
:class:`AttentionMetadata` with SDPA's builder and the :class:`StateMetadata` beside it, and runs
``forward`` and ``compute_logits``. Every sequence owns slot ``i`` of the state pool and blocks
``[i * blocks_per_seq, (i + 1) * blocks_per_seq)`` of the KV pool.

:func:`generate` runs a schedule of prompts (greedy, every prompt row's logits kept) at tp 1 in this
process, or at tp 2 as gloo ranks (tests/worker/rank_processes.py). No ``transformers`` here.
"""

from __future__ import annotations

import dataclasses
import pickle
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from tests.worker.rank_processes import spawn_ranks
from tpserve.model_config import ModelConfig
from worker.attention import PagedAttention
from worker.attention_builders import DecodeGroup, PrefillSpec, SdpaMetadataBuilder
from worker.layers.mamba2 import Mamba2Mixer
from worker.loader import load_model
from worker.parallel_state import ParallelContext, destroy_distributed, init_distributed
from worker.state_metadata import StateMetadata, zero_state_slots

BLOCK_SIZE = 4
BLOCKS_PER_SEQ = 16  # 64 positions per sequence


@dataclass(frozen=True)
class Schedule:
    """Prompts and how to run them.

    Attributes:
        prompts: token ids per sequence.
        max_tokens: greedy tokens generated per sequence.
        first_chunk: a prompt longer than this is prefilled in two chunks (state and KV carried),
            the second in the next step, beside the other sequences' decodes; 0: whole prompts.
        together: every sequence in the same steps (else one sequence at a time).
    """

    prompts: tuple[tuple[int, ...], ...]
    max_tokens: int
    first_chunk: int = 0
    together: bool = True


@dataclass
class _Seq:
    index: int
    tokens: list[int]
    prompt_len: int
    done: int = 0  # tokens whose K/V and state are in the caches


def layer_caches(model: torch.nn.Module, num_seqs: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, ...]]:
    """Each decoder layer's cache: K/V blocks for attention, the state tuple for Mamba-2, () otherwise."""
    layers = model.model.layers if hasattr(model, "model") else model.backbone.layers
    caches: list[tuple[torch.Tensor, ...]] = []
    for layer in layers:
        kinds = [m for m in layer.modules() if isinstance(m, (Mamba2Mixer, PagedAttention))]
        if kinds and isinstance(kinds[0], Mamba2Mixer):
            mixer = kinds[0]
            caches.append(tuple(torch.zeros(num_seqs, *shape, dtype=d)
                                for shape, d in zip(mixer.state_shapes(), mixer.state_dtypes(), strict=True)))
        elif kinds:
            attn = kinds[0]
            shape = (num_seqs * BLOCKS_PER_SEQ, BLOCK_SIZE, attn.num_kv_heads, attn.head_size)
            caches.append((torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)))
        else:
            caches.append(())
    return caches


def _table(index: int) -> torch.Tensor:
    return torch.arange(index * BLOCKS_PER_SEQ, (index + 1) * BLOCKS_PER_SEQ, dtype=torch.int64)


def _step(model, caches, chunks: list[tuple[_Seq, int]]) -> dict[int, torch.Tensor]:
    """One forward over ``chunks`` (sequence, rows), decodes (1 row, past the prompt) first.

    Returns each sequence's logits ``(rows, vocab)`` float32 (rank 0), its rows in order.
    """
    ids, positions, slots_of_rows, starts = [], [], [], [0]
    for seq, rows in chunks:
        ids += seq.tokens[seq.done:seq.done + rows]
        positions += list(range(seq.done, seq.done + rows))
        slots_of_rows += [int(_table(seq.index)[p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
                          for p in range(seq.done, seq.done + rows)]
        starts.append(starts[-1] + rows)
    num_decodes = sum(1 for seq, rows in chunks if rows == 1 and seq.done >= seq.prompt_len)
    fresh = torch.tensor([seq.index for seq, _ in chunks if seq.done == 0], dtype=torch.int64)
    if len(fresh):
        zero_state_slots([c for c in caches if len(c) and c[0].dim() == 3], fresh)  # a new sequence's state
    group = None
    if num_decodes:
        decodes = [seq for seq, _ in chunks[:num_decodes]]
        group = DecodeGroup(num_decodes, torch.stack([_table(s.index) for s in decodes]),
                            torch.tensor([s.done + 1 for s in decodes], dtype=torch.int64), None)
    prefills = [PrefillSpec(starts[i], starts[i + 1], seq.done, _table(seq.index) if seq.done else None)
                for i, (seq, _) in enumerate(chunks) if i >= num_decodes]
    positions_t = torch.tensor(positions, dtype=torch.int64)
    attn = SdpaMetadataBuilder().build(positions_t, torch.tensor(slots_of_rows, dtype=torch.int64), group, prefills,
                                       BLOCK_SIZE, {}, None)
    host_slots = tuple(seq.index for seq, _ in chunks)
    state = StateMetadata(torch.tensor(host_slots, dtype=torch.int64), tuple(starts), num_decodes, (), host_slots)
    attn = dataclasses.replace(attn, state=state)
    with torch.no_grad():
        hidden = model(torch.tensor(ids, dtype=torch.int64), positions_t, caches, attn)  # (T, hidden)
        logits = model.compute_logits(hidden)  # (T, vocab) on rank 0
    out = {}
    for i, (seq, rows) in enumerate(chunks):
        seq.done += rows
        if logits is not None:
            out[seq.index] = logits[starts[i]:starts[i + 1]].float()
    return out


def run_schedule(model, schedule: Schedule, ctx: ParallelContext | None = None,
                 dtype: torch.dtype = torch.float32) -> list[tuple[list[int], torch.Tensor]]:
    """Greedy generation over ``schedule``: per sequence, (its tokens after the prompt, its logits for every
    row it ran, ``(prompt_len + max_tokens - 1, vocab)``). Meaningful on rank 0."""
    seqs = [_Seq(i, list(p), len(p)) for i, p in enumerate(schedule.prompts)]
    caches = layer_caches(model, len(seqs), dtype)
    logits: dict[int, list[torch.Tensor]] = {s.index: [] for s in seqs}
    groups = [seqs] if schedule.together else [[s] for s in seqs]
    for group in groups:
        while any(len(s.tokens) - s.prompt_len < schedule.max_tokens for s in group):
            decodes = [(s, 1) for s in group if s.done >= s.prompt_len
                       and len(s.tokens) - s.prompt_len < schedule.max_tokens]
            prefills = []
            for s in group:
                if s.done < s.prompt_len:
                    rest = s.prompt_len - s.done
                    first = schedule.first_chunk if s.done == 0 and schedule.first_chunk else rest
                    prefills.append((s, min(rest, first)))
            out = _step(model, caches, decodes + prefills)
            sampling = [s for s, _ in decodes + prefills if s.done >= s.prompt_len]  # the prompt is in
            tokens = torch.tensor([int(out[s.index][-1].argmax()) if s.index in out else 0 for s in sampling],
                                  dtype=torch.int64)  # greedy, on rank 0
            if ctx is not None and ctx.tp_size > 1:
                torch.distributed.broadcast(tokens, src=0)  # every rank feeds rank 0's tokens back
            for s, _ in decodes + prefills:
                if s.index in out:
                    logits[s.index].append(out[s.index])
            for s, token in zip(sampling, tokens.tolist(), strict=True):
                s.tokens.append(token)
    return [(s.tokens[s.prompt_len:], torch.cat(logits[s.index]) if logits[s.index] else torch.empty(0))
            for s in seqs]


def _rank_main(rank: int, model_dir: str, schedule: Schedule, init_method: str, out_path: str,
               expert_parallel: bool = False) -> None:
    torch.set_num_threads(1)
    ctx = init_distributed(rank, 2, init_method, "cpu", 60.0)
    ctx = dataclasses.replace(ctx, enable_expert_parallel=expert_parallel)
    try:
        config = ModelConfig.from_pretrained(model_dir)
        model = load_model(model_dir, config, ctx, torch.float32)
        results = run_schedule(model, schedule, ctx)
        if rank == 0:
            with open(out_path, "wb") as f:
                pickle.dump(results, f)
    finally:
        destroy_distributed()


def generate(model_dir: Path, schedule: Schedule, tp_size: int = 1,
             expert_parallel: bool = False) -> list[tuple[list[int], torch.Tensor]]:
    """:func:`run_schedule` on the checkpoint at ``model_dir``, at tp 1 (here) or 2 (gloo ranks; with
    ``expert_parallel``, whole experts per rank)."""
    if tp_size == 1:
        config = ModelConfig.from_pretrained(model_dir)
        model = load_model(model_dir, config, ParallelContext.single("cpu"), torch.float32)
        return run_schedule(model, schedule)
    with tempfile.TemporaryDirectory() as tmp, socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        out_path = str(Path(tmp) / "rank0.pkl")
        spawn_ranks(_rank_main, (str(model_dir), schedule, f"tcp://127.0.0.1:{port}", out_path, expert_parallel),
                    nprocs=tp_size)
        with open(out_path, "rb") as f:
            return pickle.load(f)
