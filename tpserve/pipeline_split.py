"""How a model's decoder layers split into pipeline stages (``--pipeline-parallel-size``). No torch.

Rank numbering is stage-major: global rank ``r`` of a group of ``tp * pp`` ranks is
tensor-parallel rank ``r % tp`` of stage ``r // tp``. Stage 0 holds the embedding and
the first layers; the last stage the last layers, the final norm and the LM head, and
it is the only stage that samples (its tensor-parallel rank 0, global rank
``(pp - 1) * tp``, reports the tokens: :func:`sampling_rank`).

The split: ``L`` layers over ``P`` stages, ``L // P`` each; when ``P`` does not divide
``L`` the ``L % P`` extra layers go one each to the stages just before the last,
from the second-to-last backwards (the last stage already carries the final norm,
the LM head and the sampler). vLLM splits the same way (``get_pp_indices``). So 5
layers over 2 stages are ``[0, 3)`` and ``[3, 5)``; 10 over 4 are 2, 3, 3, 2.
"""

from __future__ import annotations


def stage_layer_counts(num_layers: int, pipeline_parallel_size: int) -> list[int]:
    """Layers per stage, stage order (see the module docstring for the rule).

    Raises:
        ValueError: ``pipeline_parallel_size < 1``, or fewer layers than stages (a stage
            would hold no layer).
    """
    pp = pipeline_parallel_size
    if pp < 1:
        raise ValueError(f"pipeline_parallel_size must be >= 1, got {pp}")
    if num_layers < pp:
        raise ValueError(f"num_hidden_layers={num_layers} cannot be split into pipeline_parallel_size={pp} stages: "
                         "every stage needs at least one layer")
    counts = [num_layers // pp] * pp
    for i in range(num_layers % pp):  # to the stages before the last, second-to-last first
        counts[-2 - i] += 1
    return counts


def stage_layer_range(num_layers: int, pipeline_parallel_size: int, stage: int) -> tuple[int, int]:
    """``(start, end)``: the global indices ``start <= i < end`` of the layers on ``stage``.

    Raises:
        ValueError: as :func:`stage_layer_counts`, or ``stage`` outside ``[0, pipeline_parallel_size)``.
    """
    counts = stage_layer_counts(num_layers, pipeline_parallel_size)
    if not 0 <= stage < pipeline_parallel_size:
        raise ValueError(f"stage={stage} is outside [0, pipeline_parallel_size={pipeline_parallel_size})")
    start = sum(counts[:stage])
    return start, start + counts[stage]


def sampling_rank(tensor_parallel_size: int, pipeline_parallel_size: int) -> int:
    """The global rank that samples and reports a step's tokens: rank 0 of the last stage."""
    return (pipeline_parallel_size - 1) * tensor_parallel_size
