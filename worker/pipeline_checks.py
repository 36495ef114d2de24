"""Start-up refusals of what pipeline stages (``--pipeline-parallel-size`` > 1) do not support.

Each names the reason, so a group that cannot run with stages stops while it loads
instead of failing its first step:

* a family whose model class builds every layer on every rank
  (``CausalLM.supports_pipeline`` False: today Gemma 2 and 3, which have their own
  model class; every Llama-derived family splits);
* fewer decoder layers than stages (tpserve/pipeline_split.py);
* a draft model (``--speculative-model``): it would need every layer's hidden
  states on the ranks that propose; n-gram speculation is supported (the last
  stage verifies);
* CUDA graphs: a captured decode graph replays the whole model on one rank, so a
  CUDA rank with stages needs ``--enforce-eager`` (:func:`check_pipeline_graphs`).
"""

from __future__ import annotations

from tpserve.model_config import ModelConfig
from tpserve.pipeline_split import stage_layer_counts
from worker.models import model_class
from worker.pipeline import PipelineStage


def check_pipeline(config: ModelConfig, stage: PipelineStage, draft_model_dir: object | None) -> None:
    """Refuse a configuration stages cannot run (module docstring); nothing with one stage.

    Raises:
        ValueError: naming the reason.
    """
    pp = stage.pp_size
    if pp == 1:
        return
    if not model_class(config.architecture).supports_pipeline:
        raise ValueError(f"{config.architecture} does not support --pipeline-parallel-size {pp} "
                         "(its layers are not split into stages); use --pipeline-parallel-size 1")
    stage_layer_counts(config.num_hidden_layers, pp)  # raises: fewer layers than stages
    if draft_model_dir is not None:
        raise ValueError(f"--speculative-model is not supported with --pipeline-parallel-size {pp}: a draft model "
                         "runs on every rank; use n-gram speculation (--speculative-method ngram) instead")


def check_pipeline_graphs(pipeline_parallel_size: int, device_type: str, enforce_eager: bool) -> None:
    """Refuse CUDA graphs with stages: a CUDA rank of a pipelined group needs ``--enforce-eager``.

    Raises:
        ValueError: naming the reason.
    """
    if pipeline_parallel_size > 1 and device_type == "cuda" and not enforce_eager:
        raise ValueError(f"CUDA graphs are not supported with --pipeline-parallel-size {pipeline_parallel_size} "
                         "(a decode graph replays a whole model on one rank): pass --enforce-eager")
