"""Run a Gated DeltaNet hybrid without the runner (its tests' rank side; the Mamba-2 hybrids': hybrid_harness.py).

The harness does what the runner and the coordinator will do for a hybrid model: it loads the checkpoint with
the project's loader, allocates each attention layer's paged KV cache and each state layer's state pool
(``(num_slots, *state_shapes())``), gives every sequence a live state slot (zeroed before its first chunk),
builds the step's :class:`~worker.attention.AttentionMetadata` with :func:`worker.step_inputs.build_step_inputs`
and the :class:`~worker.state_metadata.StateMetadata` by hand (decode group first), saves a checkpoint at
every block boundary of a prompt, and can start a sequence from another's checkpoint (a prefix hit: its state
copied into the new live slot, the prefix's KV blocks shared).

Tokens are teacher-forced: a sequence is fed its prompt and then the reference's greedy completion, and rank 0
keeps the logits of every row it computed, so the test checks each argmax against the reference's token (the
greedy tokens the model would produce) and each row's logits against the reference's. Imports no ``transformers``.
"""

from __future__ import annotations

import dataclasses
import pickle
import socket
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tests.worker.rank_processes import spawn_ranks
from tpserve.model_config import ModelConfig
from tpserve.step import SamplingParams, ScheduledChunk
from worker.layers.gated_delta_net import GatedDeltaNet
from worker.loader import load_model
from worker.parallel_state import ParallelContext, destroy_distributed, init_distributed
from worker.state_metadata import StateMetadata, copy_state_slots, zero_state_slots
from worker.step_inputs import build_step_inputs

BLOCK_SIZE = 8
NUM_BLOCKS = 512
NUM_SLOTS = 256
GREEDY = SamplingParams(temperature=0.0)


@dataclass
class Sequence:
    """One sequence's tokens (prompt + teacher-forced completion) and what the harness knows of it."""

    tokens: tuple[int, ...]
    prompt_len: int
    slot: int
    table: list[int] = field(default_factory=list)
    num_computed: int = 0
    first_row: int = 0  # the first position whose logits this sequence computed (a prefix hit skips some)
    checkpoints: dict[int, int] = field(default_factory=dict)  # prompt position (block boundary) -> slot
    logits: list[torch.Tensor] = field(default_factory=list)  # rank 0: per chunk, (rows, vocab)


class HybridHarness:
    """A model, its caches and state pool, and the sequences being run on them (one per rank)."""

    def __init__(self, model_dir: str, ctx: ParallelContext, chunk_size: int | None = None) -> None:
        config = ModelConfig.from_pretrained(model_dir)
        self.ctx = ctx
        self.model = load_model(model_dir, config, ctx, torch.float32)
        self.caches: list[tuple[torch.Tensor, ...]] = []
        self.states: list[tuple[torch.Tensor, ...]] = []
        for layer in self.model.model.layers:
            if layer.linear_attn is not None:
                mixer: GatedDeltaNet = layer.linear_attn
                if chunk_size is not None:
                    mixer.chunk_size = chunk_size
                state = tuple(torch.zeros((NUM_SLOTS, *shape), dtype=dtype)
                              for shape, dtype in zip(mixer.state_shapes(), mixer.state_dtypes(), strict=True))
                self.states.append(state)
                self.caches.append(state)
            else:
                shape = (NUM_BLOCKS, BLOCK_SIZE, layer.self_attn.num_kv_heads, config.head_dim)
                self.caches.append((torch.zeros(shape), torch.zeros(shape)))
        self.seqs: dict[int, Sequence] = {}
        self.next_block, self.next_slot = 1, 0

    def _slot(self) -> int:
        self.next_slot += 1
        return self.next_slot - 1

    def add(self, seq_id: int, tokens: tuple[int, ...], prompt_len: int, prefix_of: int | None = None) -> None:
        """A new sequence; ``prefix_of``: start from that sequence's last prompt checkpoint before the last prompt token."""
        seq = self.seqs[seq_id] = Sequence(tokens, prompt_len, self._slot())
        zero_state_slots(self.states, torch.tensor([seq.slot]))
        if prefix_of is None:
            return
        donor = self.seqs[prefix_of]
        hit = max((p for p in donor.checkpoints if p < prompt_len and donor.tokens[:p] == tokens[:p]), default=0)
        if hit:
            copy_state_slots(self.states, torch.tensor([donor.checkpoints[hit]]), torch.tensor([seq.slot]))
            seq.table = donor.table[:hit // BLOCK_SIZE]  # full blocks, shared read-only
            seq.num_computed = seq.first_row = hit

    def step(self, plan: list[tuple[int, int]]) -> None:
        """Run one step: ``(seq_id, num_tokens)`` per chunk; one-token chunks must come first (the decode group)."""
        lens = [n for _, n in plan]
        assert sorted(lens, key=lambda n: n > 1) == lens, "one-token chunks first (the attention decode group)"
        chunks, checkpoints = [], []
        for seq_id, n in plan:
            seq = self.seqs[seq_id]
            start = seq.num_computed
            needed = -(-(start + n) // BLOCK_SIZE) - len(seq.table)
            new = list(range(self.next_block, self.next_block + needed))
            self.next_block += needed
            seq.table += new
            chunks.append(ScheduledChunk(seq_id, seq.tokens[start:start + n], start, tuple(new)))
            marks = []
            for boundary in range(start + 1, min(start + n, seq.prompt_len) + 1):
                if boundary % BLOCK_SIZE == 0:  # a prompt block boundary: save the state there
                    seq.checkpoints[boundary] = self._slot()
                    marks.append((boundary - start, seq.checkpoints[boundary]))
            checkpoints.append(tuple(marks))
        tables = [self.seqs[seq_id].table for seq_id, _ in plan]
        inputs = build_step_inputs(chunks, tables, [GREEDY] * len(plan), BLOCK_SIZE, self.ctx.device,
                                   with_sampling=False)
        # The state layers' decode group: the leading one-row chunks without a checkpoint (the contract's).
        num_decodes = next((i for i, (n, marks) in enumerate(zip(lens, checkpoints)) if n > 1 or marks), len(plan))
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        slots = tuple(self.seqs[s].slot for s, _ in plan)
        state = StateMetadata(torch.tensor(slots), tuple(starts), num_decodes, tuple(checkpoints), slots)
        attn = dataclasses.replace(inputs.attn, state=state)
        with torch.no_grad():
            hidden = self.model(inputs.input_ids, attn.positions, self.caches, attn)  # (T, hidden)
            logits = self.model.compute_logits(hidden)  # (T, vocab) on rank 0
        for i, (seq_id, n) in enumerate(plan):
            seq = self.seqs[seq_id]
            seq.num_computed += n
            if logits is not None:
                seq.logits.append(logits[starts[i]:starts[i + 1]].clone())

    def results(self) -> dict[int, tuple[int, torch.Tensor]]:
        """Per sequence: ``(first position computed, logits (rows, vocab))`` (rank 0)."""
        return {i: (s.first_row, torch.cat(s.logits)) for i, s in self.seqs.items() if s.logits}


@dataclass(frozen=True)
class Scenario:
    """What to run: sequences ``(seq_id, tokens, prompt_len, arrive_step, prefix_of)`` and the prefill chunk length."""

    sequences: tuple[tuple[int, tuple[int, ...], int, int, int | None], ...]
    prefill_chunk: int
    chunk_size: int | None = None  # the DeltaNet layers' rows per chunk (None: the layer's default)


def run_scenario(model_dir: str, ctx: ParallelContext, scenario: Scenario) -> dict[int, tuple[int, torch.Tensor]]:
    """Continuous batching of ``scenario``: each step every running sequence past its prompt decodes one token
    (teacher-forced) and the others prefill ``prefill_chunk`` tokens, until every sequence has fed all its tokens."""
    harness = HybridHarness(model_dir, ctx, scenario.chunk_size)
    waiting = sorted(scenario.sequences, key=lambda s: s[3])
    running: list[int] = []
    step = 0
    while waiting or running:
        while waiting and waiting[0][3] <= step:
            seq_id, tokens, prompt_len, _, prefix_of = waiting.pop(0)
            harness.add(seq_id, tokens, prompt_len, prefix_of)
            running.append(seq_id)
        decodes, prefills = [], []
        for seq_id in running:
            seq = harness.seqs[seq_id]
            left = len(seq.tokens) - seq.num_computed
            if seq.num_computed >= seq.prompt_len:
                decodes.append((seq_id, 1))
            else:
                prefills.append((seq_id, min(scenario.prefill_chunk, seq.prompt_len - seq.num_computed, left)))
        plan = decodes + sorted(prefills, key=lambda c: c[1] > 1)  # a one-token prompt remainder joins the group
        if plan:
            harness.step(plan)
        running = [s for s in running if harness.seqs[s].num_computed < len(harness.seqs[s].tokens)]
        step += 1
    return harness.results()


def _rank_main(rank: int, tp_size: int, init_method: str, model_dir: str, scenarios: list[Scenario],
               out_path: str) -> None:
    torch.set_num_threads(1)
    ctx = init_distributed(rank, tp_size, init_method, "cpu", 60.0)
    try:
        results = [run_scenario(model_dir, ctx, s) for s in scenarios]
        if rank == 0:
            with open(out_path, "wb") as f:
                pickle.dump(results, f)
    finally:
        destroy_distributed()


def run_scenarios(model_dir: str, scenarios: list[Scenario], tp_size: int) -> list[dict[int, tuple[int, torch.Tensor]]]:
    """Every scenario at tensor-parallel degree ``tp_size`` (in this process at 1, gloo ranks otherwise); rank 0's results."""
    if tp_size == 1:
        return [run_scenario(model_dir, ParallelContext.single("cpu"), s) for s in scenarios]
    with tempfile.TemporaryDirectory() as tmp:
        out_path = str(Path(tmp) / "rank0.pkl")
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        spawn_ranks(_rank_main, (tp_size, f"tcp://127.0.0.1:{port}", model_dir, scenarios, out_path), nprocs=tp_size)
        with open(out_path, "rb") as f:
            return pickle.load(f)
