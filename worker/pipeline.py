"""One rank's place in the pipeline (``--pipeline-parallel-size``), and the stage-to-stage activations.

A group of ``tp_size * pp_size`` ranks (``world_size``) is ``pp_size`` stages of ``tp_size`` tensor-parallel ranks,
numbered stage-major (tpserve/pipeline_split.py: global rank ``pp_rank * tp_size + tp_rank``).
Each stage holds a contiguous range of decoder layers; the first also the embedding,
the last the final norm, the LM head and the sampler.

Per step every rank receives the same plan and builds its own step inputs (token
ids, positions, slot mapping, block tables): only the residual stream crosses
stages. In these decoders a layer's output *is* the residual stream (``h + attn``,
then ``+ mlp``, the norm recomputed inside the next layer), so one ``(T, hidden)``
tensor per step goes from tensor-parallel rank ``i`` of stage ``s`` to rank ``i`` of
stage ``s + 1`` (point-to-point ``torch.distributed`` send/recv: gloo on the CPU and
across hosts, NCCL on GPUs). Every tensor-parallel rank holds the whole (all-reduced)
hidden state, so the pairs send in parallel and no stage needs a collective to
share what it received.

Sends are asynchronous (``isend``): a stage goes on to its next micro-batch while
the send drains; the previous send is waited for before the next one starts, so at
most one is in flight per rank and the tensor it sends stays alive until it is done.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tpserve.pipeline_split import stage_layer_range


@dataclass(frozen=True)
class PipelineStage:
    """This rank's stage.

    The rank's tensor-parallel coordinates live in :class:`~worker.parallel_state.ParallelContext`
    only; a stage knows just the global ranks it exchanges activations with.

    Attributes:
        pp_rank: this stage's index in ``[0, pp_size)``.
        pp_size: ``pipeline_parallel_size``, the number of stages.
        prev_rank, next_rank: global ranks of the same tensor-parallel rank in the previous
            and the next stage (``(pp_rank -/+ 1) * tp_size + tp_rank``); None at the ends.

    Raises:
        ValueError: ``pp_rank`` outside ``[0, pp_size)``, or a peer missing (or given) where
            a neighbouring stage exists (or does not).
    """

    pp_rank: int = 0
    pp_size: int = 1
    prev_rank: int | None = None
    next_rank: int | None = None
    _pending: list = field(default_factory=list, compare=False, repr=False)  # the send in flight (0 or 1)

    def __post_init__(self) -> None:
        if not 0 <= self.pp_rank < self.pp_size:
            raise ValueError(f"pp_rank={self.pp_rank} is outside [0, pp_size={self.pp_size})")
        if (self.prev_rank is None) != self.is_first or (self.next_rank is None) != self.is_last:
            raise ValueError(f"stage {self.pp_rank} of {self.pp_size} has prev_rank={self.prev_rank}, "
                             f"next_rank={self.next_rank}: a peer is needed exactly where a neighbouring stage is")

    @classmethod
    def of_rank(cls, rank: int, tp_size: int, pp_size: int) -> PipelineStage:
        """The stage of global ``rank`` in a stage-major group of ``pp_size`` stages of ``tp_size`` ranks.

        Raises:
            ValueError: ``rank`` outside ``[0, tp_size * pp_size)``.
        """
        if not 0 <= rank < tp_size * pp_size:
            raise ValueError(f"rank={rank} is outside [0, world_size={tp_size * pp_size})")
        pp_rank = rank // tp_size
        return cls(pp_rank=pp_rank, pp_size=pp_size,
                   prev_rank=rank - tp_size if pp_rank > 0 else None,
                   next_rank=rank + tp_size if pp_rank < pp_size - 1 else None)

    @property
    def is_first(self) -> bool:
        """Embeds the step's tokens."""
        return self.pp_rank == 0

    @property
    def is_last(self) -> bool:
        """Holds the final norm and the LM head; samples."""
        return self.pp_rank == self.pp_size - 1

    def layer_range(self, num_layers: int) -> tuple[int, int]:
        """``(start, end)`` global indices of this stage's decoder layers (tpserve/pipeline_split.py)."""
        return stage_layer_range(num_layers, self.pp_size, self.pp_rank)

    def send_next(self, hidden: torch.Tensor) -> None:
        """Send ``hidden (T, hidden_size)`` to the same tensor-parallel rank of the next stage (no wait)."""
        self.wait_sends()
        work = dist.isend(hidden.contiguous(), dst=self.next_rank)
        self._pending.append((work, hidden))

    def wait_sends(self) -> None:
        """Wait until the send in flight (if any) has left this rank."""
        while self._pending:
            work, _ = self._pending.pop()
            work.wait()

    def recv_prev(self, num_tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The previous stage's ``(num_tokens, hidden_size)`` hidden states for this step (blocks until they come).

        Raises:
            RuntimeError: the peer failed or the group's timeout passed (a lost rank).
        """
        hidden = torch.empty(num_tokens, hidden_size, dtype=dtype, device=device)
        dist.recv(hidden, src=self.prev_rank)
        return hidden
