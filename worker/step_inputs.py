"""One step's model inputs, built on the host in one buffer and copied to the device once.

Per step the model needs token ids, positions, KV slots, block tables, the rows
whose logits are sampled and the sampling parameters of those rows. Built as
separate tensors these are a dozen small host-to-device copies, each a driver
call and, from pageable memory, a synchronisation. Here every integer goes into
one ``int64`` buffer (the float parameters as float32 bit patterns inside it),
pinned on CUDA, copied with one non-blocking ``to(device)``; the fields are views
of the device copy. Masks are built on the device from those views.

The flat batch is reordered **decodes first** (see worker/attention.py): the
chunks that feed one token, in plan order, then the longer chunks in plan order.
With ``paged_kernel`` (the compiled CPU attention, worker/kernels/) the first
group is every chunk of at most ``MAX_PAGED_QUERY_LEN`` tokens (decodes,
speculative verification, short prompts), which that kernel reads through the
block tables, with their row offsets (``query_start_loc``) instead of a mask.
Without it, a chunk with proposals (speculative decoding) is laid out among the
decodes, one decode row per token: attention writes the whole step's K/V into the
cache before it reads, so row ``j`` attends over positions ``0 .. start_position + j``
through the block table like any decode, and the verification of a whole batch is
one batched attention call rather than one call per sequence.
``sample_rows`` maps the sampled chunks, in plan order, to their last row, so
the sampled tokens come back in the order of the plan. A chunk with proposals
(speculative decoding) also has ``spec_rows``: the rows of its last
``num_spec_tokens + 1`` tokens but the last, each of which samples the position
after it to verify the proposal there (worker/spec_verify.py).

Pure host arithmetic in Python lists: a decode step of ``S`` sequences costs
``O(S x blocks)`` list operations and no torch op but the buffer's creation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tpserve.step import SamplingParams, ScheduledChunk
from worker.attention import AttentionMetadata, PrefillChunk
from worker.sampler import SamplingTensors

_TWO_63 = 1 << 63
#: Longest chunk the compiled paged attention takes with the decodes (``paged_kernel``); longer
#: prompt chunks go to SDPA, whose blocked kernel wins once a chunk's queries share enough keys.
MAX_PAGED_QUERY_LEN = 16


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
    """

    input_ids: torch.Tensor
    attn: AttentionMetadata
    sample_rows: torch.Tensor | None
    sampling: SamplingTensors | None
    chunk_last_rows: tuple[int, ...] = ()
    spec_rows: torch.Tensor | None = None
    spec_sampling: SamplingTensors | None = None


class _Packer:
    """Appends int64 sections to one host list and hands out their device views after one copy."""

    def __init__(self) -> None:
        self.values: list[int] = []
        self.sections: dict[str, tuple[int, int]] = {}

    def add(self, name: str, values: Sequence[int]) -> None:
        start = len(self.values)
        self.values.extend(values)
        self.sections[name] = (start, len(self.values))

    def reserve(self, name: str, length: int) -> None:
        self.add(name, [0] * length)

    def to_device(self, device: torch.device, floats: dict[str, Sequence[float]]) -> dict[str, torch.Tensor]:
        """One host tensor (pinned for CUDA), float sections filled in, one copy; views by name."""
        host = torch.tensor(self.values, dtype=torch.int64)  # (L,)
        for name, values in floats.items():  # float32 pairs fill each reserved int64
            start, end = self.sections[name]
            host[start:end].view(torch.float32).copy_(torch.tensor(values, dtype=torch.float32))
        if device.type == "cuda":
            host = host.pin_memory()
        buffer = host.to(device, non_blocking=True)  # the step's one host-to-device copy
        return {name: buffer[start:end] for name, (start, end) in self.sections.items()}


def build_step_inputs(
    chunks: Sequence[ScheduledChunk],
    block_tables: Sequence[Sequence[int]],
    sampling: Sequence[SamplingParams],
    block_size: int,
    device: torch.device,
    *,
    with_sampling: bool = True,
    workspace: dict[str, torch.Tensor] | None = None,
    paged_kernel: bool = False,
    triton_decode: bool = False,
    num_prompt_tokens: Sequence[int] | None = None,
) -> StepInputs:
    """Build a step's inputs from its chunks, in plan order.

    Args:
        chunks: the plan's scheduled chunks (each ``num_tokens >= 1``).
        block_tables: each chunk's sequence's block ids after this step's additions,
            covering positions ``0 .. start_position + num_tokens - 1`` (the runner
            checked this).
        sampling: each chunk's sequence's sampling parameters.
        block_size: tokens per KV block.
        device: where the model runs.
        with_sampling: build the sampling tensors (only the rank that samples needs them).
        workspace: scratch tensors attention may keep across steps (see AttentionMetadata).
        paged_kernel: attention runs the compiled paged kernel (float32 CPU ranks with
            worker/kernels/ built): chunks up to ``MAX_PAGED_QUERY_LEN`` tokens join the decodes.
        triton_decode: the decode rows go to the Triton paged kernel (CUDA,
            worker/kernels/triton_attention.py): one row per sequence as without
            ``paged_kernel``, read through the block tables, so no mask is built.
        num_prompt_tokens: each chunk's sequence's prompt length, for dynamic NTK RoPE:
            then ``attn.rope_seq_lens`` holds ``max(prompt length, position + 1)`` per row
            (worker/layers/rotary.py); None: not built.

    Returns:
        The inputs; ``T = sum(num_tokens)`` rows, decodes first.
    """
    short = MAX_PAGED_QUERY_LEN if paged_kernel else 1  # the longest whole chunk of the first group
    first = [c.num_tokens <= short or (not paged_kernel and c.num_spec_tokens > 0) for c in chunks]
    order = [i for i in range(len(chunks)) if first[i]] + [i for i in range(len(chunks)) if not first[i]]
    # The first group's (plan index, context length) entries: with the kernel one per chunk (its rows
    # are causal over their own positions), else one per row, each a decode of its own position.
    group = [(i, chunks[i].start_position + (chunks[i].num_tokens if paged_kernel else j + 1))
             for i in order if first[i] for j in range(1 if paged_kernel else chunks[i].num_tokens)]
    num_decodes = sum(chunks[i].num_tokens for i in order if first[i])  # rows of the first group
    tokens: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    rope_seq_lens: list[int] = []
    last_row = [0] * len(chunks)  # plan index -> row of its last token
    packer = _Packer()
    prefill_specs: list[tuple[int, int, int, int]] = []  # (start row, end row, start position, plan index)
    for i in order:
        chunk, table = chunks[i], block_tables[i]
        row, start = len(tokens), chunk.start_position
        tokens.extend(chunk.token_ids)
        end = start + chunk.num_tokens
        positions.extend(range(start, end))
        pos = start
        while pos < end:  # one range per block the chunk touches
            block, offset = divmod(pos, block_size)
            take = min(block_size - offset, end - pos)
            base = table[block] * block_size + offset
            slots.extend(range(base, base + take))
            pos += take
        if num_prompt_tokens is not None:
            rope_seq_lens.extend(max(num_prompt_tokens[i], p + 1) for p in range(start, end))
        last_row[i] = row + chunk.num_tokens - 1
        if not first[i]:
            prefill_specs.append((row, len(tokens), start, i))
    packer.add("input_ids", tokens)
    packer.add("positions", positions)
    packer.add("slots", slots)
    if num_prompt_tokens is not None:
        packer.add("rope_seq_lens", rope_seq_lens)

    decode_blocks = 0
    if group:
        decode_blocks = -(-max(length for _, length in group) // block_size)
        rows: list[int] = []
        for i, _ in group:
            table = list(block_tables[i][:decode_blocks])
            rows.extend(table + [0] * (decode_blocks - len(table)))  # padding: masked out, or never read
        packer.add("decode_tables", rows)
        packer.add("decode_context_lens", [length for _, length in group])
        if paged_kernel:
            starts = [0]
            for i, _ in group:
                starts.append(starts[-1] + chunks[i].num_tokens)
            packer.add("decode_query_start_loc", starts)
    for n, (_, _, start, i) in enumerate(prefill_specs):
        if start > 0:
            context = start + chunks[i].num_tokens
            packer.add(f"table{n}", block_tables[i][: -(-context // block_size)])

    sampled = [i for i, c in enumerate(chunks) if c.sample]
    floats: dict[str, list[float]] = {}
    build_sampling = with_sampling and bool(sampled)
    if sampled:
        packer.add("sample_rows", [last_row[i] for i in sampled])
    if build_sampling:
        _add_sampling(packer, floats, "", [sampling[i] for i in sampled],
                      [chunks[i].start_position + chunks[i].num_tokens for i in sampled])
    # Speculative decoding: row j of a chunk's last k + 1 samples position start + j + 1 (the last row is above).
    spec = [(i, j) for i in sampled for j in range(chunks[i].num_tokens - 1 - chunks[i].num_spec_tokens,
                                                     chunks[i].num_tokens - 1)]
    if spec:
        packer.add("spec_rows", [last_row[i] - chunks[i].num_tokens + 1 + j for i, j in spec])
        if with_sampling:
            _add_sampling(packer, floats, "spec_", [sampling[i] for i, _ in spec],
                          [chunks[i].start_position + j + 1 for i, j in spec])

    dev = packer.to_device(device, floats)
    decode_tables = decode_mask = None
    if group:
        decode_tables = dev["decode_tables"].view(len(group), decode_blocks)  # (S, B)
    if group and not paged_kernel and not triton_decode:  # SDPA's mask: key position < context length
        key_pos = torch.arange(decode_blocks * block_size, device=device)  # (K,)
        decode_mask = (key_pos[None, :] < dev["decode_context_lens"][:, None]).view(num_decodes, 1, 1, -1)
    prefills = []
    for n, (row, end_row, start, _) in enumerate(prefill_specs):
        if start == 0:
            prefills.append(PrefillChunk(row, end_row, None, end_row - row, None))
            continue
        context = start + end_row - row
        key_pos = torch.arange(context, device=device)  # (C,)
        query_pos = torch.arange(start, start + end_row - row, device=device)  # (n,)
        mask = key_pos[None, :] <= query_pos[:, None]  # (n, C) causal with the chunk's offset
        prefills.append(PrefillChunk(row, end_row, dev[f"table{n}"], context, mask))
    attn = AttentionMetadata(
        positions=dev["positions"], slot_mapping=dev["slots"], num_decodes=num_decodes,
        decode_block_tables=decode_tables, decode_mask=decode_mask, prefills=tuple(prefills),
        workspace={} if workspace is None else workspace,
        decode_context_lens=dev["decode_context_lens"] if group else None,
        decode_query_start_loc=dev["decode_query_start_loc"] if group and paged_kernel else None,
        triton_decode=triton_decode and bool(group),
        rope_seq_lens=dev["rope_seq_lens"] if num_prompt_tokens is not None else None,
    )
    sampling_tensors = _sampling_tensors(dev, "", [sampling[i] for i in sampled]) if build_sampling else None
    spec_sampling = _sampling_tensors(dev, "spec_", [sampling[i] for i, _ in spec]) if spec and with_sampling else None
    return StepInputs(
        input_ids=dev["input_ids"], attn=attn,
        sample_rows=dev["sample_rows"] if sampled else None, sampling=sampling_tensors,
        chunk_last_rows=tuple(last_row), spec_rows=dev["spec_rows"] if spec else None, spec_sampling=spec_sampling,
    )


def _add_sampling(packer: _Packer, floats: dict[str, list[float]], prefix: str,
                  params: Sequence[SamplingParams], positions: Sequence[int]) -> None:
    """Packs the sampling parameters of some rows under ``prefix`` (positions: the token each row samples)."""
    packer.add(prefix + "top_k", [p.top_k for p in params])
    packer.add(prefix + "seeds", [p.seed - (1 << 64) if p.seed >= _TWO_63 else p.seed for p in params])  # int64 bits
    packer.add(prefix + "sample_positions", positions)
    packer.reserve(prefix + "temperature_top_p", len(params))  # float32 (temperature, top_p) per int64
    floats[prefix + "temperature_top_p"] = [x for p in params for x in (p.temperature, p.top_p)]


def _sampling_tensors(dev: dict[str, torch.Tensor], prefix: str, params: Sequence[SamplingParams]) -> SamplingTensors:
    """The device views of what :func:`_add_sampling` packed under ``prefix``."""
    pairs = dev[prefix + "temperature_top_p"].view(torch.float32)  # (2N,) float32
    return SamplingTensors(
        temperature=pairs[0::2], top_p=pairs[1::2], top_k=dev[prefix + "top_k"], seeds=dev[prefix + "seeds"],
        positions=dev[prefix + "sample_positions"], all_greedy=all(p.greedy for p in params),
        any_truncation=any(p.top_k > 0 or p.top_p < 1.0 for p in params),
    )
