"""One step's model inputs: the flat batch, its KV slots and the selected backend's attention metadata.

Per step the model needs token ids, positions, KV slots, block tables, the rows
whose logits are sampled and the sampling parameters of those rows. On the host
they are built with tensor ops from the plan's chunks and the sequences' block
tables (an ``(S, B)`` tensor; the runner keeps it between steps in
worker/input_batch.py), then every integer goes into one ``int64`` buffer (the
float parameters as float32 bit patterns inside it), pinned on CUDA, copied with
one non-blocking ``to(device)``; the fields are views of the device copy. A decode step whose
every chunk samples takes its sampling parameters from the caller's
:class:`~worker.sampler.SamplingCache` instead (kept between steps; only the positions change).

The flat batch is reordered **decodes first** (see worker/attention.py): the
chunks the attention backend's decode group takes, in plan order, then the longer
chunks in plan order. Which chunks those are and what metadata the backend reads
is the backend's own :class:`~worker.attention_builders.AttentionMetadataBuilder`
(one per backend, chosen once by the runner): with the compiled CPU paged kernel
every chunk of at most ``MAX_PAGED_QUERY_LEN`` tokens, one entry per chunk; with
Triton or SDPA the one-token chunks and the chunks with proposals (speculative
decoding), one decode row per token.
``sample_rows`` maps the sampled chunks, in plan order, to their last row, so
the sampled tokens come back in the order of the plan. A chunk with proposals
(speculative decoding) also has ``spec_rows``: the rows of its last
``num_spec_tokens + 1`` tokens but the last, each of which samples the position
after it to verify the proposal there (worker/spec_verify.py).

Cost: ``O(S)`` Python over the plan's chunks (their token ids and positions), the
rest a fixed number of tensor ops whatever ``S``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from operator import add, attrgetter

import torch

from tpserve.step import SamplingParams, ScheduledChunk
from worker.attention import AttentionMetadata
from worker.attention_builders import (
    MAX_PAGED_QUERY_LEN,
    AttentionMetadataBuilder,
    DecodeGroup,
    PrefillSpec,
    select_metadata_builder,
)
from worker.sampler import SamplingCache, SamplingTensors, add_sampling, packed_sampling_tensors

__all__ = ["MAX_PAGED_QUERY_LEN", "StepInputs", "block_table_tensor", "build_step_inputs"]

_token_ids, _start_position, _sample, _num_spec_tokens = (
    attrgetter("token_ids"), attrgetter("start_position"), attrgetter("sample"), attrgetter("num_spec_tokens"))


@dataclass(frozen=True)
class StepInputs:
    """The model's inputs for one step, on the device.

    Attributes:
        input_ids: ``(T,) int64`` token of each row (decodes first).
        attn: the attention metadata (positions, slots, block tables, masks).
        sample_rows: ``(N,) int64`` row of the last token of each chunk with
            ``sample=True``, in plan order; None when nothing is sampled.
        sampling: those rows' sampling parameters; None when nothing is sampled
            or the caller did not ask for them (ranks other than 0).
        chunk_last_rows: host-side, the row of each chunk's last token, in plan
            order (prompt logprobs find a chunk's rows from it: worker/logprobs.py).
        spec_rows: ``(S,) int64`` with proposals in the step: for each sampled chunk
            with ``num_spec_tokens = k`` in plan order, the ``k`` rows before its last
            (row ``j`` samples the token at ``start_position + j + 1``); None without.
        spec_sampling: those rows' sampling parameters (rank 0); None otherwise.
        samples_every_row: host-side: ``sample_rows`` is ``0 .. T - 1`` (a decode step where
            every chunk samples), so the hidden states need no gather before the LM head.
    """

    input_ids: torch.Tensor
    attn: AttentionMetadata
    sample_rows: torch.Tensor | None
    sampling: SamplingTensors | None
    chunk_last_rows: tuple[int, ...] = ()
    spec_rows: torch.Tensor | None = None
    spec_sampling: SamplingTensors | None = None
    samples_every_row: bool = False


class _Packer:
    """Appends int64 sections (lists or host tensors) to one buffer and hands out their device views after one copy."""

    def __init__(self) -> None:
        self.parts: list[torch.Tensor] = []
        self.values: list[int] = []  # ints not yet turned into a part
        self.length = 0
        self.sections: dict[str, tuple[int, int]] = {}

    def add(self, name: str, values: Sequence[int] | torch.Tensor) -> None:
        """Appends ``values`` (ints, or a host ``int64`` tensor of any shape, flattened) as section ``name``."""
        if isinstance(values, torch.Tensor):
            self._flush()
            self.parts.append(values.reshape(-1))
            size = values.numel()
        else:
            self.values.extend(values)
            size = len(values)
        self.sections[name] = (self.length, self.length + size)
        self.length += size

    def reserve(self, name: str, length: int) -> None:
        self.add(name, [0] * length)

    def _flush(self) -> None:
        if self.values:
            self.parts.append(torch.tensor(self.values, dtype=torch.int64))
            self.values = []

    def to_device(self, device: torch.device, floats: dict[str, Sequence[float]]) -> dict[str, torch.Tensor]:
        """One host tensor (pinned for CUDA), float sections filled in, one copy; views by name."""
        self._flush()
        host = torch.cat(self.parts) if len(self.parts) != 1 else self.parts[0].clone()  # (L,)
        for name, values in floats.items():  # float32 pairs fill each reserved int64
            start, end = self.sections[name]
            host[start:end].view(torch.float32).copy_(torch.tensor(values, dtype=torch.float32))
        if device.type == "cuda":
            host = host.pin_memory()
        buffer = host.to(device, non_blocking=True)  # the step's one host-to-device copy
        return {name: buffer[start:end] for name, (start, end) in self.sections.items()}


def block_table_tensor(block_tables: Sequence[Sequence[int]]) -> torch.Tensor:
    """``(S, max blocks) int64`` of the given tables, padded with block 0 (read only under a mask, or never)."""
    width = max((len(t) for t in block_tables), default=0)
    return torch.tensor([[*t, *([0] * (width - len(t)))] for t in block_tables], dtype=torch.int64).view(-1, width)


def build_step_inputs(
    chunks: Sequence[ScheduledChunk],
    block_tables: torch.Tensor | Sequence[Sequence[int]],
    sampling: Sequence[SamplingParams],
    block_size: int,
    device: torch.device,
    *,
    with_sampling: bool = True,
    workspace: dict[str, torch.Tensor] | None = None,
    builder: AttentionMetadataBuilder | None = None,
    paged_kernel: bool = False,
    triton_decode: bool = False,
    num_prompt_tokens: Sequence[int] | None = None,
    sampling_cache: SamplingCache | None = None,
) -> StepInputs:
    """Build a step's inputs from its chunks, in plan order.

    Args:
        chunks: the plan's scheduled chunks (each ``num_tokens >= 1``).
        block_tables: each chunk's sequence's block ids after this step's additions,
            covering positions ``0 .. start_position + num_tokens - 1`` (the runner
            checked this): an ``(S, B) int64`` host tensor, rows in plan order and
            padded with block 0, or lists.
        sampling: each chunk's sequence's sampling parameters.
        block_size: tokens per KV block.
        device: where the model runs.
        with_sampling: build the sampling tensors (only the rank that samples needs them).
        workspace: scratch tensors attention may keep across steps (see AttentionMetadata); the
            decode path keeps a host ``row_offsets`` there too.
        builder: the attention backend's metadata builder (worker/attention_builders.py);
            None: the one ``paged_kernel`` / ``triton_decode`` select.
        paged_kernel: attention runs the compiled paged kernel (float32 CPU ranks with
            worker/kernels/ built): chunks up to ``MAX_PAGED_QUERY_LEN`` tokens join the decodes.
        triton_decode: the decode rows go to the Triton paged kernel (CUDA,
            worker/kernels/triton_attention.py): one row per sequence, read through the
            block tables, so no mask is built.
        num_prompt_tokens: each chunk's sequence's prompt length, for dynamic NTK RoPE:
            then ``attn.rope_seq_lens`` holds ``max(prompt length, position + 1)`` per row
            (worker/layers/rotary.py); None: not built.
        sampling_cache: a decode step whose every row samples takes its sampling tensors from
            it (kept by the caller between steps: worker/sampler.py's :class:`SamplingCache`).

    Returns:
        The inputs; ``T = sum(num_tokens)`` rows, decodes first.
    """
    if builder is None:
        builder = select_metadata_builder(paged_kernel=paged_kernel, triton_decode=triton_decode)
    tables = block_tables if isinstance(block_tables, torch.Tensor) else block_table_tensor(block_tables)  # (S, B)
    lens = list(map(len, map(_token_ids, chunks)))
    if lens.count(1) == len(chunks):  # every chunk one token (a decode step): rows in plan order
        return _decode_step_inputs(chunks, tables, sampling, block_size, device, with_sampling, workspace, builder,
                                   num_prompt_tokens, sampling_cache)
    starts = list(map(_start_position, chunks))
    short, spec_in_group = builder.max_group_query_len, builder.spec_rows_in_group
    first = [n <= short or (spec_in_group and c.num_spec_tokens > 0) for n, c in zip(lens, chunks)]
    num_first = sum(first)
    order = list(range(len(chunks))) if num_first == len(chunks) else \
        [i for i, f in enumerate(first) if f] + [i for i, f in enumerate(first) if not f]
    lens_o = [lens[i] for i in order]
    ends = list(accumulate(lens_o))  # row after each chunk's last, in row order
    last_row = [0] * len(chunks)  # plan index -> row of its last token
    for k, i in enumerate(order):
        last_row[i] = ends[k] - 1
    num_decodes = ends[num_first - 1] if num_first else 0
    packer = _Packer()
    packer.add("input_ids", [t for i in order for t in chunks[i].token_ids])
    positions, row_chunk = _flat_positions(order, lens_o, ends, starts)  # (T,), (T,) plan index of each row
    packer.add("positions", positions)
    packer.add("slots", tables[row_chunk, positions // block_size] * block_size + positions % block_size)
    if num_prompt_tokens is not None:
        packer.add("rope_seq_lens", torch.maximum(torch.tensor(num_prompt_tokens)[row_chunk], positions + 1))
    if num_first:
        context = max(map(add, starts, lens)) if num_first == len(chunks) else \
            max(starts[i] + lens[i] for i in order[:num_first])
        decode_blocks = -(-context // block_size)
        if builder.one_entry_per_chunk:  # one entry per chunk, its rows causal over their own positions
            entries = row_chunk.new_tensor(order[:num_first])  # (S,)
            packer.add("decode_context_lens", [starts[i] + lens[i] for i in order[:num_first]])
            packer.add("decode_query_start_loc", [0, *ends[:num_first]])
        else:  # one entry per row, each a decode of its own position
            entries = row_chunk[:num_decodes]
            packer.add("decode_context_lens", positions[:num_decodes] + 1)
        packer.add("decode_tables", tables[entries, :decode_blocks])
    prefill_tables = []  # (start row, end row, start position, whether it has a table)
    for k in range(num_first, len(order)):
        i, start = order[k], starts[order[k]]
        if start > 0:
            packer.add(f"table{k}", tables[i, : -(-(start + lens[i]) // block_size)])
        prefill_tables.append((k, ends[k] - lens[i], ends[k], start))

    sampled = [i for i, sample in enumerate(map(_sample, chunks)) if sample]
    if sampled:
        packer.add("sample_rows", [last_row[i] for i in sampled])
    floats: dict[str, list[float]] = {}
    build_sampling = with_sampling and bool(sampled)
    if build_sampling:
        add_sampling(packer, floats, "", [sampling[i] for i in sampled], [starts[i] + lens[i] for i in sampled])
    spec = _spec_rows(chunks, sampled, last_row) if any(map(_num_spec_tokens, chunks)) else []
    if spec:
        packer.add("spec_rows", [row for _, _, row in spec])
        if with_sampling:
            add_sampling(packer, floats, "spec_", [sampling[i] for i, _, _ in spec],
                          [chunks[i].start_position + j + 1 for i, j, _ in spec])

    dev = packer.to_device(device, floats)
    group = None
    if num_first:
        entries_count = dev["decode_context_lens"].numel()
        group = DecodeGroup(num_decodes, dev["decode_tables"].view(entries_count, -1), dev["decode_context_lens"],
                            dev.get("decode_query_start_loc"))
    prefills = [PrefillSpec(row, end, start, dev.get(f"table{k}")) for k, row, end, start in prefill_tables]
    attn = builder.build(dev["positions"], dev["slots"], group, prefills, block_size,
                         {} if workspace is None else workspace, dev.get("rope_seq_lens"))
    sampling_tensors = packed_sampling_tensors(dev, "", [sampling[i] for i in sampled]) if build_sampling else None
    spec_sampling = (packed_sampling_tensors(dev, "spec_", [sampling[i] for i, _, _ in spec])
                     if spec and with_sampling else None)
    return StepInputs(
        input_ids=dev["input_ids"], attn=attn,
        sample_rows=dev["sample_rows"] if sampled else None, sampling=sampling_tensors,
        chunk_last_rows=tuple(last_row), spec_rows=dev["spec_rows"] if spec else None, spec_sampling=spec_sampling,
    )


def _decode_step_inputs(chunks: Sequence[ScheduledChunk], tables: torch.Tensor, sampling: Sequence[SamplingParams],
                        block_size: int, device: torch.device, with_sampling: bool,
                        workspace: dict[str, torch.Tensor] | None, builder: AttentionMetadataBuilder,
                        num_prompt_tokens: Sequence[int] | None,
                        sampling_cache: SamplingCache | None = None) -> StepInputs:
    """:func:`build_step_inputs` of a step whose chunks are all one token (no proposals can be among them):
    the same inputs, without the reordering's passes. Row ``i`` is chunk ``i``, the decode group all of them."""
    num_rows = len(chunks)
    starts = list(map(_start_position, chunks))
    packer = _Packer()
    packer.add("input_ids", [c.token_ids[0] for c in chunks])
    positions = torch.tensor(starts, dtype=torch.int64)  # (S,)
    packer.add("positions", positions)
    packer.add("slots", tables.gather(1, (positions // block_size)[:, None]).view(-1) * block_size
               + positions % block_size)  # (S,)
    if num_prompt_tokens is not None:
        packer.add("rope_seq_lens", torch.maximum(torch.tensor(num_prompt_tokens, dtype=torch.int64), positions + 1))
    decode_blocks = -(-(max(starts) + 1) // block_size)
    packer.add("decode_context_lens", positions + 1)  # (S,) one entry per chunk and per row alike
    if builder.one_entry_per_chunk:
        packer.add("decode_query_start_loc", _row_offsets(num_rows + 1, workspace))  # (S + 1,) 0 .. S
    packer.add("decode_tables", tables[:, :decode_blocks])  # (S, blocks)
    all_sampled = all(map(_sample, chunks))
    # A chunk's last row is its index.
    sampled = range(num_rows) if all_sampled else [i for i, sample in enumerate(map(_sample, chunks)) if sample]
    sampled_params = sampling if all_sampled else [sampling[i] for i in sampled]
    if sampled:
        packer.add("sample_rows", sampled)
    floats: dict[str, list[float]] = {}
    build_sampling = with_sampling and bool(sampled)
    cached = build_sampling and all_sampled and sampling_cache is not None  # positions: decode_context_lens
    if build_sampling and not cached:
        add_sampling(packer, floats, "", sampled_params, [s + 1 for s in starts] if all_sampled else
                     [starts[i] + 1 for i in sampled])
    dev = packer.to_device(device, floats)
    group = DecodeGroup(num_rows, dev["decode_tables"].view(num_rows, -1), dev["decode_context_lens"],
                        dev.get("decode_query_start_loc"))
    attn = builder.build(dev["positions"], dev["slots"], group, [], block_size, {} if workspace is None else workspace,
                         dev.get("rope_seq_lens"))
    sampling_tensors = None
    if cached:  # the sampled positions, one past each row's, are the context lengths
        sampling_tensors = sampling_cache.tensors(sampled_params, dev["decode_context_lens"], device)
    elif build_sampling:
        sampling_tensors = packed_sampling_tensors(dev, "", sampled_params)
    return StepInputs(
        input_ids=dev["input_ids"], attn=attn, sample_rows=dev["sample_rows"] if sampled else None,
        sampling=sampling_tensors, chunk_last_rows=tuple(range(num_rows)), samples_every_row=all_sampled,
    )


def _row_offsets(length: int, workspace: dict[str, torch.Tensor] | None) -> torch.Tensor:
    """``(length,) int64`` ``0 .. length - 1`` on the host: a view of one kept in ``workspace`` (read only; the
    packer copies it into the step's buffer), as a fresh ``arange`` costs ~10 us a step."""
    if workspace is None:
        return torch.arange(length, dtype=torch.int64)
    kept = workspace.get("row_offsets")
    if kept is None or kept.numel() < length:
        kept = workspace["row_offsets"] = torch.arange(max(length, 1024), dtype=torch.int64)
    return kept[:length]


def _flat_positions(order: list[int], lens_o: list[int], ends: list[int],
                    starts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(T,) int64`` each row's position and ``(T,) int64`` its chunk's plan index, rows in ``order``."""
    order_t = torch.tensor(order, dtype=torch.int64)  # (S,)
    starts_o = torch.tensor([starts[i] for i in order], dtype=torch.int64)  # (S,)
    if ends[-1] == len(order):  # one token per chunk (decodes): row k is chunk order[k]
        return starts_o, order_t
    lens_t = torch.tensor(lens_o, dtype=torch.int64)  # (S,)
    first_rows = torch.tensor(ends, dtype=torch.int64) - lens_t  # (S,) each chunk's first row
    offsets = torch.arange(ends[-1]) - first_rows.repeat_interleave(lens_t)  # (T,) row within its chunk
    return starts_o.repeat_interleave(lens_t) + offsets, order_t.repeat_interleave(lens_t)


def _spec_rows(chunks: Sequence[ScheduledChunk], sampled: list[int],
               last_row: list[int]) -> list[tuple[int, int, int]]:
    """Speculative decoding: ``(plan index, j, row)`` of each verification row, row ``j`` of a chunk's last
    ``k + 1`` sampling position ``start + j + 1`` (the last row is the chunk's sample row)."""
    return [(i, j, last_row[i] - len(chunks[i].token_ids) + 1 + j)
            for i in sampled if chunks[i].num_spec_tokens
            for j in range(len(chunks[i].token_ids) - 1 - chunks[i].num_spec_tokens, len(chunks[i].token_ids) - 1)]
