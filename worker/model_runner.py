"""One rank's step executor: applies a :class:`~tpserve.step.StepPlan`, runs the model, samples.

Every rank receives the same plan and runs the same forward pass on its shard;
rank 0 also gathers the logits and samples. The runner decides nothing: the
coordinator owns scheduling and block allocation; the runner keeps only what a
plan's delta needs, per sequence: its block table and its sampling parameters.

``execute(plan)`` applies the plan in the order of tpserve/step.py:

1. drop the sequences in ``finished_seq_ids``;
2. register each ``NewSequence`` (an id already known is reset: a preempted
   sequence comes back this way with its whole block table);
3. append each chunk's ``new_block_ids`` to its block table; build the flat batch
   (tokens, positions) and the :class:`~worker.attention.AttentionMetadata` once;
   run the model, which writes the chunk's K/V and attends over positions
   ``0 .. start_position + num_tokens - 1`` (a pure decode step on CUDA replays
   the model's CUDA graph of its padded batch size instead: worker/cuda_graphs.py);
4. compute logits only for the last token of chunks with ``sample=True``
   (and, for a chunk with proposals, for the rows before it that verify them),
   gather them on rank 0, sample there, in plan order; verify the proposals
   (worker/spec_verify.py).

The runner keeps each sequence's block table in a persistent batch
(worker/input_batch.py) and applies only the plan's delta to it; the attention
backend's metadata builder (worker/attention_builders.py) is chosen once, when the
backend is known. ``_run`` returns a :class:`~worker.step_output.StepOutput`.

Observing logits (tests, debugging): after ``execute``, rank 0's
``last_logits`` holds the step's ``(num_samples, vocab_size)`` float32 logits
(None on other ranks or when nothing was sampled); ``last_spec_logits`` the
``(S, vocab_size)`` logits of the verification rows (None without proposals).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from itertools import compress
from dataclasses import replace
from operator import attrgetter
from pathlib import Path
from typing import cast

import structlog
import torch

from tpserve.model_config import ModelConfig
from tpserve.quantization import Quantization
from tpserve.step import GRAMMAR_DEAD_END_TOKEN_ID, NewSequence, SamplingParams, ScheduledChunk, StepPlan, StepResult
from worker.attention import paged_kernel_available
from worker.attention_builders import select_metadata_builder
from worker.cuda_graphs import DecodeGraphs
from worker.draft_model import DraftModel, with_proposals
from worker.kv_cache import KVCacheLayout, PairedKVCacheLayout
from worker.kv_layers import eight_bit_layers
from worker.kv_host_tier import HostKVTier
from worker.kv_quant import CALIBRATION_TOKENS, KVScales, cache_dtype, calibrate, calibration_token_ids
from worker.layers.moe import count_triples, expert_layers, take_routed_counts
from worker.grammar import GrammarCache
from worker.input_batch import InputBatch
from worker.kernels.triton_attention import triton_attention_available
from worker.loader import load_model
from worker.lora_adapters import LoRAAdapters, check_lora_supported
from worker.lora_settings import LoRASettings
from worker.multi_step import run_steps
from worker.logits_processors import extend_history, with_processors
from worker.logprobs import prompt_logprobs, sample_logprobs
from worker.parallel_state import ParallelContext
from worker.pipeline_checks import check_pipeline
from worker.placeholders import fill_placeholders, has_placeholders
from worker.sampler import SamplingCache, sample_tensors
from worker.spec_verify import accept_proposals
from worker.state_cache import (DEFAULT_NUM_STATE_SLOTS, StateCache, bytes_per_state_slot, cacheless_layers,
                                check_state_layers)
from worker.sequence_state import SequenceState
from worker.step_inputs import StepInputs, build_step_inputs
from worker.step_output import StepOutput

log = structlog.get_logger(__name__)

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# The per-step scans over a batch's chunks and states, as C-level attribute reads (``any(map(...))``).
_new_block_ids = attrgetter("new_block_ids")
_tracks_history = attrgetter("tracks_history")
_reports_logprobs = attrgetter("reports_logprobs")
_uses_logits_controls = attrgetter("uses_logits_controls")
_seq_id, _sampling, _sample = attrgetter("seq_id"), attrgetter("sampling"), attrgetter("sample")


class ModelRunner:
    """Holds this rank's model shard and KV cache and executes step plans.

    Args:
        model_dir: Hugging Face checkpoint directory (``config.json``, safetensors).
        ctx: this rank's tensor-parallel group.
        dtype: weights, activations and KV cache dtype (float32, bfloat16, float16).
        block_size: tokens per KV block (the coordinator's ``--block-size``).
        quantization: ``--quantization`` ("int8", "int4" or None); a quantized checkpoint
            (compressed-tensors int8, GPTQ / AWQ / W4A16 int4) is loaded as stored (worker/loader.py).
        draft_model_dir: ``--speculative-model``: a draft model of the same vocabulary,
            run on the same ranks with its own cache (worker/draft_model.py); None: none.
            ``kv_layout`` then sizes both caches together.
        kv_cache_dtype: ``--kv-cache-dtype``: "auto" (the cache in ``dtype``), "fp8" or "int8"
            (1 byte per element, per-layer scales from the checkpoint or calibrated by the first
            ``init_kv_cache``; worker/kv_quant.py).
        lora: ``--enable-lora``: the adapter slots' pool and the adapters to load into it
            (worker/lora_adapters.py); None: no LoRA (the linear layers' one branch stays false).

    Raises:
        ValueError: the model cannot be split ``ctx.tp_size`` ways (the message
            names the dimension), an unsupported dtype or architecture, or a
            checkpoint with missing/unexpected weights;
            ``lora`` on CUDA, with a draft model or pipeline stages, or a refused adapter.
    """

    def __init__(self, model_dir: str | Path, ctx: ParallelContext, dtype: torch.dtype, block_size: int,
                 quantization: Quantization | None = None, draft_model_dir: str | Path | None = None,
                 kv_cache_dtype: str = "auto", lora: LoRASettings | None = None) -> None:
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype={dtype} is not supported; expected one of {SUPPORTED_DTYPES}")
        self.kv_cache_dtype = cache_dtype(kv_cache_dtype, dtype)
        if lora is not None:  # before the weights load: a refused combination costs nothing
            check_lora_supported(ctx.device.type, draft_model_dir is not None, ctx.pp.pp_size)
        self.config = ModelConfig.from_pretrained(model_dir)
        self.config.check_tensor_parallel(ctx.tp_size)
        check_pipeline(self.config, ctx.pp, draft_model_dir)
        self.ctx = ctx
        self.dtype = dtype
        self.block_size = block_size
        # Each pipeline stage sizes the cache of its own layers (the pool is the minimum over ranks).
        start, end = ctx.pp.layer_range(self.config.num_hidden_layers)
        # Hybrids (one stage): KV for the attention layers only; the state layers' pool is worker/state_cache.py's.
        self._target_layout = replace(KVCacheLayout.for_model(self.config, ctx.tp_size, block_size, self.kv_cache_dtype),
                                      num_layers=end - start - len(cacheless_layers(self.config, state=True)))
        if self.config.state_layer_indices and draft_model_dir is not None:
            raise ValueError("speculative decoding is not supported for hybrid models (their state layers "
                             "cannot roll back rejected tokens); start without --speculative-model")
        self.model = load_model(model_dir, self.config, ctx, dtype, quantization)
        self._state_layers = check_state_layers(self.model, self.config)
        self.state_bytes_per_slot = bytes_per_state_slot(self._state_layers)  # 0: attention only
        self._state: StateCache | None = None
        # An 8-bit cache: its PagedAttention modules hold the scale pools (one per cache) and the key offset
        # (calibrated by the first init_kv_cache; worker/kv_quant.py), in layer order; latent attention's
        # layers hold their latent and rope scale pools (worker/layers/mla_attention.py; no offset).
        self._kv_layers, self._latent_layers = eight_bit_layers(self.model) if self.kv_cache_dtype != dtype \
            else ([], [])
        self._kv_uncalibrated = bool(self._kv_layers)
        self._kv_codec: str | None = None  # kv_codec, computed once the offsets are calibrated
        self.lora = None if lora is None else self._attach_lora(lora)
        self.draft = None if draft_model_dir is None else DraftModel(draft_model_dir, ctx, dtype, block_size,
                                                                     self.config.vocab_size, self.kv_cache_dtype)
        self.kv_layout = self._target_layout if self.draft is None else \
            PairedKVCacheLayout(self._target_layout, self.draft.kv_layout)
        self._grammars = GrammarCache(model_dir, self.config.vocab_size)  # structured output, rank 0, lazily
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer; a hybrid's state layers: state tuples
        self.num_blocks = 0
        self.host_tier: HostKVTier | None = None  # the prefix cache's host slots (--kv-offloading-size)
        self.last_logits: torch.Tensor | None = None
        self.last_spec_logits: torch.Tensor | None = None
        self._seqs: dict[int, SequenceState] = {}
        self._batch = InputBatch(-(-self.config.max_model_len // block_size))  # block tables, kept between steps
        self._max_model_len = self.config.max_model_len
        self._workspace: dict[str, torch.Tensor] = {}  # attention's scratch, reused every step
        self._sampling_cache = SamplingCache()  # a steady decode batch's sampling tensors, kept between steps
        # The draft runs on the target's step inputs, so both must take the same attention path.
        # The compiled paged kernel reads per-head caches; latent attention reads its own (worker/layers/mla_attention.py).
        self._paged_kernel = (paged_kernel_available(ctx.device, dtype, self.config.head_dim)
                              and not self.config.latent_attention
                              and (self.draft is None or self.draft.paged_kernel))
        self._triton_decode = triton_attention_available(ctx.device, block_size)
        self._builder = select_metadata_builder(paged_kernel=self._paged_kernel, triton_decode=self._triton_decode)
        # Dynamic NTK RoPE rotates each row for its sequence's length (worker/layers/rotary.py): built per step,
        # which the decode graphs' static inputs do not carry, so such a model runs eagerly.
        scaling = self.config.rope_scaling
        self._dynamic_rope = scaling is not None and scaling["rope_type"] == "dynamic"
        self._graphs: DecodeGraphs | None = None
        # Mixture-of-experts layers, whose routed-token counts rank 0 reports every step.
        self._expert_layers = expert_layers(self.model) if ctx.is_sampler else []
        self._padding_counts: torch.Tensor | None = None  # (L, E): what one graph padding row routes

    def _attach_lora(self, settings: LoRASettings) -> LoRAAdapters:
        """The adapter slots on the model's projections (the combinations not served were refused already).

        The compiled decode layers stay on: a step without adapter rows runs them unchanged, one with
        adapter rows adds the low-rank sums inside them (worker/layers/decode_block.py)."""
        return LoRAAdapters(self.model, settings, self.ctx, self.dtype)

    def num_blocks_for_memory(self, kv_cache_memory_bytes: int) -> int:
        """KV blocks that fit in ``kv_cache_memory_bytes`` bytes on this rank (same on every rank)."""
        return self.kv_layout.num_blocks_for_budget(kv_cache_memory_bytes)

    def init_kv_cache(self, num_blocks: int, *, cuda_graph_sizes: Sequence[int] = (), max_model_len: int | None = None,
                      capture: bool = True, num_state_slots: int | None = None, num_host_blocks: int = 0) -> None:
        """Allocate ``num_blocks`` blocks per layer (block ids ``0 .. num_blocks - 1``) and capture decode graphs.

        Args:
            num_blocks: the KV blocks the coordinator allocates from.
            cuda_graph_sizes: decode batch sizes to capture (worker/cuda_graphs.py); empty,
                or a rank without the Triton decode path (off CUDA), with a draft model, dynamic
                RoPE or multi-head latent attention: every step runs eagerly. With graphs the cache
                holds one more block, the padding rows' null block.
            max_model_len: the longest context a graph takes (default: the model's).
            capture: False checks the graphs' static-buffer path eagerly (tests on the CPU).
            num_state_slots: hybrid models: the state pool's slots, live and checkpoint (worker/state_cache.py;
                None: ``DEFAULT_NUM_STATE_SLOTS``); their steps run eagerly, without decode graphs.
            num_host_blocks: slots of the prefix cache's host tier (worker/kv_host_tier.py); 0: none.
        """
        # Latent attention's decode reads its latents with torch ops through the block tables: in a graph that
        # is the static tables' full max_model_len width for every row, every step, so it runs eagerly.
        graphs = (bool(cuda_graph_sizes) and self.draft is None and not self._dynamic_rope
                  and not self.config.latent_attention and (self._triton_decode or not capture)
                  and not self._state_layers)  # a state layer's step reads per-step slots: eager
        if cuda_graph_sizes and self._state_layers:
            log.info("decode graphs off for a hybrid model: its state layers run eagerly")
        take_routed_counts(self._expert_layers)  # drop what earlier (profiling) passes routed
        self._graphs = None
        self.kv_caches = self._target_layout.allocate(num_blocks + graphs, self.ctx.device)
        if self._state_layers:  # per layer a KV pair or a state tuple (worker/models/base.py)
            self._state = StateCache(self._state_layers, num_state_slots or DEFAULT_NUM_STATE_SLOTS, self.ctx.device)
            merged = self._state.layer_caches(self.kv_caches, self.config.num_hidden_layers,
                                              cacheless_layers(self.config))  # Nemotron-H's MLP / MoE blocks: ()
            self.kv_caches = cast(list[tuple[torch.Tensor, torch.Tensor]], merged)  # state tuples at state layers
        if self._kv_layers or self._latent_layers:  # an 8-bit cache: each layer's scale pools, beside its codes
            pools = self._target_layout.allocate_scales(num_blocks + graphs, self.ctx.device)
            for attn, (first, second) in zip(self._scaled_layers, pools, strict=True):
                attn.set_kv_scales(first, second)
        if self.draft is not None:
            self.draft.init_kv_cache(num_blocks)
        self.num_blocks = num_blocks
        self.host_tier = None if not num_host_blocks else HostKVTier(self.block_tensors(), num_host_blocks)
        if self._kv_uncalibrated:  # before any graph captures the key offsets
            self._calibrate_kv_offsets()
        if graphs:
            # The graphs' attention, for the eager steps too (capture=False on the CPU: Triton's interpreter).
            self._triton_decode, self._paged_kernel = True, False
            self._builder = select_metadata_builder(triton_decode=True)
            self._graphs = DecodeGraphs(self.model, self.kv_caches, num_blocks, self.block_size,
                                        max_model_len or self.config.max_model_len, cuda_graph_sizes,
                                        capture=capture)
            self._graphs.capture_all()
        counts = take_routed_counts(self._expert_layers)  # the graphs' warm-ups
        if graphs and counts is not None:
            # The warm-ups ran every capture size with padding rows only (token 0 at position 0,
            # attending over itself): each such row routes alike, and a replay's padding rows
            # are subtracted from the step's counts (worker/cuda_graphs.py).
            self._padding_counts = counts // sum(self._graphs.sizes)  # (L, E)

    def _calibrate_kv_offsets(self) -> None:
        """Calibrate the 8-bit cache's per-layer key offsets on one fixed prompt (worker/kv_quant.py)."""
        num_tokens = min(CALIBRATION_TOKENS, self.num_blocks * self.block_size, self._max_model_len)
        blocks = tuple(range(-(-num_tokens // self.block_size)))
        chunk = ScheduledChunk(0, calibration_token_ids(self.config.vocab_size, num_tokens), 0, blocks, sample=False)
        plans = (StepPlan(0, (NewSequence(0, SamplingParams()),), (chunk,)), StepPlan(1, finished_seq_ids=(0,)))
        # A draft model runs on every step's tokens (propose), so the same prompt calibrates its layers too.
        layers = self._kv_layers + (self.draft.kv_layers if self.draft is not None else [])
        calibrate(layers, lambda: [self.execute(plan) for plan in plans])
        self._kv_uncalibrated = False
        offsets = torch.cat([cast(torch.Tensor, a.k_offset).flatten() for a in layers])  # every layer's, set now
        log.info("kv cache key offsets calibrated", dtype=str(self.kv_cache_dtype).removeprefix("torch."),
                 tp_rank=self.ctx.tp_rank, pp_rank=self.ctx.pp_rank, tokens=num_tokens, layers=len(layers),
                 draft_layers=len(layers) - len(self._kv_layers),
                 k_offset_min=float(offsets.min()), k_offset_max=float(offsets.max()))

    @property
    def kv_scales(self) -> list[KVScales]:
        """Each layer's ``(k_scale, v_scale, k_offset)`` of an 8-bit cache (worker/kv_quant.py; empty for a float
        cache): scale pools ``(num_blocks, KVH, block_size)`` bfloat16 and the key offset ``(KVH, d)`` float32."""
        return [cast(KVScales, a.kv_scales) for a in self._kv_layers]  # set at init

    @property
    def kv_codec(self) -> str:
        """What this rank's cache codes mean beyond their bytes, which a peer's blocks must share to be read here
        (a KV transfer's layout check, worker/kv_transfer/agent.py): "" for a float cache; for an 8-bit one its
        storage type and a digest of every layer's key offset (codes are stored less it; worker/kv_quant.py),
        so that two replicas whose calibrations differ in a bit refuse each other's blocks."""
        if not self._scaled_layers or self._kv_uncalibrated:
            return ""
        if self._kv_codec is None:  # once: the offsets are calibrated once and kept (a read asks per transfer)
            name = str(self.kv_cache_dtype).removeprefix("torch.")
            layers = self._kv_layers + (self.draft.kv_layers if self.draft is not None else [])
            digest = hashlib.sha256()
            for attn in layers:
                offset = cast(torch.Tensor, attn.k_offset).detach().to("cpu", torch.float32).contiguous()
                digest.update(offset.numpy().tobytes())
            # latent attention: per-token scales only, no offset
            self._kv_codec = f"{name}:k_offset={digest.hexdigest()[:16]}" if layers else name
        return self._kv_codec

    @property
    def _scaled_layers(self) -> list:
        """The target's layers that hold an 8-bit cache's scale pools (worker/kv_layers.py), in layer order."""
        return [*self._kv_layers, *self._latent_layers]

    @property
    def cuda_graph_sizes(self) -> tuple[int, ...]:
        """The decode batch sizes replayed from graphs (empty: every step eager)."""
        return () if self._graphs is None else self._graphs.sizes

    def block_tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """What a block is on this rank, as the host tier and a KV transfer copy it: every layer's ``(k, v)``
        cache, a draft model's after them, and an 8-bit cache's per-token scale pools ``(num_blocks, kv_heads,
        block_size)`` (worker/kv_quant.py: a block's codes mean nothing without them), the target's then the
        draft's. Empty before :meth:`init_kv_cache`."""
        layers = self._scaled_layers + (self.draft.scaled_layers if self.draft is not None else [])
        scales = [(attn.kv_scales[0], attn.kv_scales[1]) for attn in layers if attn.kv_scales]
        return self.kv_caches + (self.draft.kv_caches if self.draft is not None else []) + scales

    def free_kv_cache(self) -> None:
        """Drop the KV cache and every sequence (after the memory profile, before the real cache)."""
        self.kv_caches = []
        self._graphs = self._state = None
        self.host_tier = None
        if self.draft is not None:
            self.draft.free_kv_cache()
        self.num_blocks = 0
        for seq_id in self._seqs:
            self._batch.remove(seq_id)
        self._seqs.clear()

    @property
    def num_sequences(self) -> int:
        """Sequences this rank currently holds state for."""
        return len(self._seqs)

    def prepare_grammar(self, grammar: str) -> None:
        """Builds a structured-output grammar's matcher on rank 0 (blocking; any thread but the step's).

        Raises:
            ValueError: llguidance rejects the grammar.
        """
        if self.ctx.is_sampler:
            self._grammars.prepare(grammar)

    def execute(self, plan: StepPlan) -> StepResult:
        """Apply ``plan`` and return the sampled tokens (rank 0) or none (other ranks).

        A multi-step plan (``plan.num_steps > 1``) runs its decodes that many times
        (worker/multi_step.py) and answers ``num_steps`` tokens per chunk.

        Raises:
            RuntimeError: ``init_kv_cache`` was not called.
            ValueError: host-tier copies without a host tier or out of its range (nothing copied), or
                the plan names an unknown sequence, schedules one twice,
                uses a block id outside the cache, gives a sequence too few
                blocks for its context, or reaches past the config's ``max_model_len``.
                Finished and new sequences are applied before the check; no
                forward pass runs. A multi-step plan with a new sequence, or a chunk
                that is not a one-token decode that samples (nothing applied).
        """
        if plan.num_steps > 1:
            return run_steps(plan, self._execute_once)
        return self._execute_once(plan)

    def _execute_once(self, plan: StepPlan) -> StepResult:
        """One step of :meth:`execute`."""
        if not self.kv_caches:
            raise RuntimeError("init_kv_cache() must be called before execute()")
        if plan.kv_swap_out or plan.kv_swap_in:  # the host tier's copies come first (tpserve/step.py)
            if self.host_tier is None:
                raise ValueError(f"step {plan.step_id}: host-tier copies but this rank has no host tier")
            self.host_tier.copy(self.block_tensors(), plan.kv_swap_out, plan.kv_swap_in)
        seqs, batch = self._seqs, self._batch
        for seq_id in plan.finished_seq_ids:
            if seqs.pop(seq_id, None) is not None:
                batch.remove(seq_id)
        for seq_id, num_blocks in plan.trimmed_block_tables:  # blocks of rejected proposals, freed
            if seq_id in seqs:
                del seqs[seq_id].block_table[num_blocks:]
                batch.trim(seq_id, num_blocks)
        for new in plan.new_seqs:
            history = list(new.history_token_ids) if new.sampling.uses_token_history and self.ctx.is_sampler else None
            seqs[new.seq_id] = SequenceState(new.sampling, num_prompt_tokens=new.num_prompt_tokens,
                                              history=history, prompt_token_ids=new.prompt_token_ids,
                                              lora_slot=self._lora_slot(new.lora_slot), state_slot=new.state_slot)
            batch.add(new.seq_id)
            if new.sampling.grammar and self.ctx.is_sampler:  # built while the forward pass runs
                self._grammars.prefetch(new.sampling.grammar)
        states = self._check_chunks(plan)  # (S,) in plan order
        if has_placeholders(plan):  # async scheduling: the tokens sampled the step before
            plan = fill_placeholders(plan, [s.last_token for s in states], self.ctx)
        # Most decode steps add no block and track no history: the C-level scans skip the loop.
        if any(map(_new_block_ids, plan.scheduled)) or any(map(_tracks_history, states)):
            for chunk, state in zip(plan.scheduled, states):
                if chunk.new_block_ids:
                    state.block_table.extend(chunk.new_block_ids)
                    batch.append_blocks(chunk.seq_id, chunk.new_block_ids)
                if state.history is not None:
                    extend_history(state.history, chunk)  # the penalties' token counts (worker/logits_processors.py)
        self.last_logits = self.last_spec_logits = None
        if not plan.scheduled:
            return StepResult(step_id=plan.step_id)
        with torch.inference_mode():
            out = self._run(plan, states)
            expert_token_counts = self._expert_token_counts(out.num_padding_rows)  # after _run's host copy: no wait
        self.last_logits, self.last_spec_logits = out.logits, out.spec_logits
        if out.sampled_token_ids and not out.num_accepted_tokens:  # one token per sampling chunk, in order
            for state, token in zip(compress(states, map(_sample, plan.scheduled)), out.sampled_token_ids):
                # A dead end's sequence ends; a step already planned for it (async) must still embed a token.
                state.last_token = token if token != GRAMMAR_DEAD_END_TOKEN_ID else 0
        return StepResult(step_id=plan.step_id, sampled_token_ids=out.sampled_token_ids, logprobs=out.logprobs,
                          prompt_logprobs=out.prompt_logprobs, num_accepted_tokens=out.num_accepted_tokens,
                          expert_token_counts=expert_token_counts)

    def _lora_slot(self, slot: int) -> int:
        """A new sequence's adapter slot, checked: 0 (the base model) or a slot of the pool."""
        if slot and (self.lora is None or not 0 < slot <= self.lora.settings.max_loras):
            raise ValueError(f"lora_slot={slot} but " + ("LoRA is not enabled" if self.lora is None else
                                                         f"the pool has slots 1..{self.lora.settings.max_loras}"))
        return slot

    def _expert_token_counts(self, num_padding_rows: int) -> tuple[int, ...]:
        """This step's routed tokens per (MoE layer, expert), less a replayed graph's padding rows."""
        counts = take_routed_counts(self._expert_layers)  # (L, E) or None
        if counts is not None and num_padding_rows and self._padding_counts is not None:
            counts -= num_padding_rows * self._padding_counts
        return count_triples(self._expert_layers, counts)

    def _check_chunks(self, plan: StepPlan) -> list[SequenceState]:
        """Each scheduled chunk's sequence state, in plan order, after the checks ``execute`` documents."""
        states: list[SequenceState] = []
        seen: set[int] = set()
        seqs, num_blocks, block_size, max_model_len = self._seqs, self.num_blocks, self.block_size, self._max_model_len
        for chunk in plan.scheduled:
            state = seqs.get(chunk.seq_id)
            if state is None:
                raise ValueError(f"step {plan.step_id}: seq_id={chunk.seq_id} is not known to this worker")
            if chunk.seq_id in seen:
                raise ValueError(f"step {plan.step_id}: seq_id={chunk.seq_id} is scheduled twice")
            seen.add(chunk.seq_id)
            states.append(state)
            new_blocks = chunk.new_block_ids
            if new_blocks and not all(0 <= b < num_blocks for b in new_blocks):
                bad = [b for b in new_blocks if not 0 <= b < num_blocks]
                raise ValueError(f"step {plan.step_id}: block ids {bad} outside [0, {num_blocks})")
            num_tokens = len(chunk.token_ids)
            if (num_tokens == 1 and chunk.start_position >= 0 and not chunk.num_spec_tokens
                    and not chunk.num_draft_tokens
                    and chunk.start_position < min((len(state.block_table) + len(new_blocks)) * block_size,
                                                   max_model_len)):
                continue  # a decode that fits: the common case, the checks below all pass
            if num_tokens < 1 or chunk.start_position < 0:
                raise ValueError(f"step {plan.step_id}: seq_id={chunk.seq_id} has an empty chunk or negative start")
            if chunk.num_spec_tokens and (chunk.num_spec_tokens >= chunk.num_tokens or not chunk.sample):
                raise ValueError(f"step {plan.step_id}: seq_id={chunk.seq_id} has num_spec_tokens="
                                 f"{chunk.num_spec_tokens}: needs sample and fewer than its {chunk.num_tokens} tokens")
            if chunk.num_draft_tokens and (self.draft is None or chunk.num_spec_tokens or not chunk.sample):
                raise ValueError(f"step {plan.step_id}: seq_id={chunk.seq_id} has num_draft_tokens="
                                 f"{chunk.num_draft_tokens}: needs a draft model, sample and no num_spec_tokens")
            end = chunk.start_position + chunk.num_tokens + chunk.num_draft_tokens
            capacity = (len(state.block_table) + len(new_blocks)) * block_size
            if end > capacity:
                raise ValueError(
                    f"step {plan.step_id}: seq_id={chunk.seq_id} needs {end} KV slots, its blocks hold {capacity}"
                )
            if end > max_model_len:
                raise ValueError(
                    f"step {plan.step_id}: seq_id={chunk.seq_id} reaches position {end - 1}, "
                    f"the model's longest context is {max_model_len}"
                )
        return states

    def _run(self, plan: StepPlan, states: list[SequenceState]) -> StepOutput:
        """Forward the flat batch and sample (``states``: the chunks' sequences); inside ``inference_mode``."""
        chunks = plan.scheduled
        inputs = self._inputs(chunks, states)
        if self._state is not None:  # hybrid models: fresh or restored slots, then the step's StateMetadata
            meta = self._state.begin_step(plan, [s.state_slot for s in states], inputs.chunk_last_rows)
            inputs = replace(inputs, attn=replace(inputs.attn, state=meta))
        if self.lora is not None:  # the step's rows grouped by adapter, for every adapted layer
            self.lora.step.set_rows([s.lora_slot for s in states], [len(c.token_ids) for c in chunks],
                                    inputs.chunk_last_rows)
        if self.draft is not None:  # it runs on every step's tokens: its cache follows the target's
            proposals = self.draft.propose(chunks, [s.block_table for s in states], inputs)
            if any(proposals):  # the target verifies them in its one pass
                chunks = with_proposals(chunks, proposals)
                inputs = self._inputs(chunks, states)
        num_padding_rows = 0
        if self._graphs is not None and self._graphs.takes(chunks, inputs):
            hidden = self._graphs.run(inputs)  # (T, hidden), a replayed CUDA graph
            num_padding_rows = self._graphs.padded_size(len(chunks)) - len(chunks)
        else:
            stage = self.ctx.pp
            received = None if stage.is_first else stage.recv_prev(  # (T, hidden): the previous stage's output
                inputs.input_ids.shape[0], self.config.hidden_size, self.dtype, self.ctx.device)
            args = (inputs.input_ids, inputs.attn.positions, self.kv_caches, inputs.attn)
            # Only models that split into stages (CausalLM.supports_pipeline) take the received hidden states.
            hidden = self.model(*args) if received is None else self.model(*args, received)  # (T, hidden)
            if not stage.is_last:
                stage.send_next(hidden)  # to the next stage, which samples or sends on (worker/pipeline.py)
                return StepOutput(num_padding_rows=num_padding_rows)
        reporting = any(map(_reports_logprobs, states))
        scored = prompt_logprobs(self.model, hidden, chunks, states, inputs.chunk_last_rows) if reporting else ()
        if inputs.sample_rows is None:
            return StepOutput(prompt_logprobs=scored, num_padding_rows=num_padding_rows)
        if inputs.samples_every_row and inputs.spec_rows is None:  # a decode step: every row, in order
            sampled_hidden = hidden  # (N, hidden)
        else:
            rows = inputs.sample_rows if inputs.spec_rows is None else torch.cat([inputs.sample_rows, inputs.spec_rows])
            sampled_hidden = hidden[rows]  # (N + S, hidden)
        logits = self.model.compute_logits(sampled_hidden)  # (N + S, vocab) on rank 0, else None
        if logits is None:
            return StepOutput(prompt_logprobs=scored, num_padding_rows=num_padding_rows)
        logits = logits.float()  # (N + S, vocab) float32
        num_samples = plan.num_samples
        logits, spec_logits = logits[:num_samples], logits[num_samples:]  # (N, vocab), (S, vocab)
        sampling = inputs.sampling
        if any(map(_uses_logits_controls, states)):  # the same object when no sampled row uses a control
            sampling = with_processors(sampling, chunks, states, self.ctx.device, self._grammars)
        tokens = sample_tensors(logits, sampling)  # (N,)
        logprobs = sample_logprobs(logits, tokens, [s.sampling for c, s in zip(chunks, states) if c.sample]) \
            if reporting else ()
        if inputs.spec_rows is None:
            return StepOutput(_mark_dead_ends(tokens.tolist(), sampling), logprobs, scored, (),  # the step's one
                              logits, num_padding_rows=num_padding_rows)  # host copy (two with logprobs)
        # Sequences with proposals use no logits control (SamplingParams.allows_speculation).
        spec_tokens = sample_tensors(spec_logits, inputs.spec_sampling)  # (S,)
        both = _mark_dead_ends(torch.cat([tokens, spec_tokens]).tolist(), sampling)  # one copy for both
        token_ids, num_accepted = accept_proposals([c for c in chunks if c.sample], both[:num_samples],
                                                   both[num_samples:])
        return StepOutput(token_ids, logprobs, scored, num_accepted, logits, spec_logits, num_padding_rows)

    def _inputs(self, chunks: Sequence[ScheduledChunk], states: list[SequenceState]) -> StepInputs:
        """The step's inputs, block tables from the persistent batch."""
        return build_step_inputs(
            chunks, self._batch.tables(list(map(_seq_id, chunks))), list(map(_sampling, states)), self.block_size,
            self.ctx.device, with_sampling=self.ctx.is_sampler, workspace=self._workspace, builder=self._builder,
            num_prompt_tokens=[s.num_prompt_tokens for s in states] if self._dynamic_rope else None,
            sampling_cache=self._sampling_cache,
        )


def _mark_dead_ends(token_ids: list[int], sampling) -> tuple[int, ...]:
    """``token_ids`` with the rows whose grammar allowed no token (``sampling.dead_end_rows``) set to
    ``GRAMMAR_DEAD_END_TOKEN_ID``: their sampled token means nothing (worker/logits_processors.py)."""
    for row in sampling.dead_end_rows if sampling is not None else ():
        token_ids[row] = GRAMMAR_DEAD_END_TOKEN_ID
    return tuple(token_ids)
