"""The step protocol between the coordinator and the worker ranks, as plain data.

Data flow (see ARCHITECTURE.md, "The request path"):

    coordinator.Scheduler.schedule() -> StepPlan --(gRPC, proto/tpserve/v1/worker.proto)-->
    every worker rank: ModelRunner.execute(StepPlan) -> StepResult (rank 0 carries tokens)
    --> coordinator.Scheduler.update(plan, result)

A plan is a *delta* (vLLM v1 style): a sequence's sampling parameters travel once,
when it is new; afterwards each step names only the tokens to feed and the KV
blocks added to its block table. Workers keep a per-sequence block table and
drop it when the sequence is named in ``finished_seq_ids``.

Order of application on a worker, fixed so every rank agrees:
  1. drop every sequence in ``finished_seq_ids`` (its blocks are the coordinator's
     to reuse from the next step on);
  2. register every ``NewSequence`` (a preempted sequence comes back this way,
     with ``start_position`` 0 and its whole block table in ``new_block_ids``);
  3. for each ``ScheduledChunk`` in order: append ``new_block_ids`` to the
     sequence's block table, then write the K/V of ``token_ids`` at positions
     ``start_position ..`` and attend over positions ``0 .. start_position + len(token_ids) - 1``;
  4. for each chunk with ``sample=True``, in plan order, sample one token from the
     logits of its last position.

This module imports no torch: the coordinator uses it too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: Unsigned 64-bit range of a sampling seed.
SEED_MODULUS = 1 << 64


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How a worker turns one row of logits into a token.

    Attributes:
        temperature: softmax temperature, >= 0. ``0`` means greedy (argmax).
        top_k: keep the ``top_k`` most likely tokens; ``0`` disables the filter.
        top_p: nucleus sampling (Holtzman et al. 2019, arXiv:1904.09751): keep the
            smallest set of most likely tokens whose probability sum reaches
            ``top_p``; in (0, 1], ``1.0`` disables the filter.
        seed: unsigned 64-bit seed. The noise used for the token at absolute
            position ``p`` depends only on ``(seed, p)``, so a request samples the
            same tokens whatever else shares its batch, and after a preemption.

    Raises:
        ValueError: a value is outside the range above.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.seed < SEED_MODULUS:
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")

    @property
    def greedy(self) -> bool:
        """True when the token is the argmax of the logits."""
        return self.temperature == 0.0


@dataclass(frozen=True, slots=True)
class NewSequence:
    """A sequence the workers have not seen (or dropped after a preemption)."""

    seq_id: int
    sampling: SamplingParams


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """The tokens one sequence contributes to this step's flat batch.

    Attributes:
        seq_id: the sequence.
        token_ids: tokens fed this step: a prompt chunk (prefill) or the last
            sampled token (decode). Never empty.
        start_position: absolute position of ``token_ids[0]``; equals the number
            of the sequence's tokens already in the KV cache.
        new_block_ids: KV block ids appended to the sequence's block table before
            the step. Block ``i`` of the table holds positions
            ``[i * block_size, (i + 1) * block_size)``.
        sample: whether to sample the token that follows ``token_ids[-1]``
            (False for a prefill chunk that is not the prompt's last).
    """

    seq_id: int
    token_ids: tuple[int, ...]
    start_position: int
    new_block_ids: tuple[int, ...] = ()
    sample: bool = True

    @property
    def num_tokens(self) -> int:
        """Number of tokens this chunk adds to the step's batch."""
        return len(self.token_ids)


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One step for every worker rank; see the module docstring for its order."""

    step_id: int
    new_seqs: tuple[NewSequence, ...] = ()
    scheduled: tuple[ScheduledChunk, ...] = ()
    finished_seq_ids: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        """Tokens in the step's flat batch (prefill and decode together)."""
        return sum(chunk.num_tokens for chunk in self.scheduled)

    @property
    def num_samples(self) -> int:
        """Number of tokens the step samples (chunks with ``sample=True``)."""
        return sum(1 for chunk in self.scheduled if chunk.sample)


@dataclass(frozen=True, slots=True)
class StepResult:
    """What rank 0 returns for a step.

    Attributes:
        step_id: the plan's ``step_id``.
        sampled_token_ids: one token per chunk with ``sample=True``, in plan order.
            Empty on ranks other than 0.
    """

    step_id: int
    sampled_token_ids: tuple[int, ...] = field(default_factory=tuple)
