"""One rank's place in the pipeline (``--pipeline-parallel-size``), and the stage-to-stage activations.

A group of ``tp * pp`` ranks is ``pp`` stages of ``tp`` tensor-parallel ranks,
numbered stage-major (tpserve/pipeline_split.py: global rank ``stage * tp + tp_rank``).
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

    Attributes:
        stage: index in ``[0, num_stages)``.
        num_stages: ``pipeline_parallel_size``.
        tp_rank, tp_size: the rank's place in its stage's tensor-parallel group.
    """

    stage: int = 0
    num_stages: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    _pending: list = field(default_factory=list, compare=False, repr=False)  # the send in flight (0 or 1)

    def __post_init__(self) -> None:
        if not 0 <= self.stage < self.num_stages:
            raise ValueError(f"stage={self.stage} is outside [0, num_stages={self.num_stages})")

    @property
    def is_first(self) -> bool:
        """Embeds the step's tokens."""
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        """Holds the final norm and the LM head; samples."""
        return self.stage == self.num_stages - 1

    def layer_range(self, num_layers: int) -> tuple[int, int]:
        """``(start, end)`` global indices of this stage's decoder layers (tpserve/pipeline_split.py)."""
        return stage_layer_range(num_layers, self.num_stages, self.stage)

    def _peer(self, stage: int) -> int:
        return stage * self.tp_size + self.tp_rank

    def send_next(self, hidden: torch.Tensor) -> None:
        """Send ``hidden (T, hidden_size)`` to the same tensor-parallel rank of the next stage (no wait)."""
        self.wait_sends()
        work = dist.isend(hidden.contiguous(), dst=self._peer(self.stage + 1))
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
        dist.recv(hidden, src=self._peer(self.stage - 1))
        return hidden
