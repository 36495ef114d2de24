"""One name, one meaning (docs/design/cluster.md, "Parallel sizes"): ``tp_size``/``tp_rank``,
``pp_size``/``pp_rank``, and ``world_size``
only ever ``tp_size * pp_size``.

The first tests check a tp 2 x pp 2 group's contexts, built by the code ``init_distributed`` builds
them with (:func:`worker.parallel_state.rank_context`), so no process group is needed. The last is a
static check over worker/: every attribute named ``world_size`` a class there defines is a property
whose value is a product (``tp_size * pp_size``), so no field or ``self.world_size = ...`` can hold a
tensor-parallel degree again; and the layers and models name no ``world_size`` at all (they are split
``tp_size`` ways).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from worker.parallel_state import ParallelContext, rank_context
from worker.pipeline import PipelineStage

WORKER = Path(__file__).resolve().parents[2] / "worker"


@pytest.mark.parametrize(("rank", "tp_rank", "pp_rank", "prev_rank", "next_rank"), [
    (0, 0, 0, None, 2),
    (1, 1, 0, None, 3),
    (2, 0, 1, 0, None),
    (3, 1, 1, 1, None),
])
def test_tp2_pp2_context_names_each_size_and_rank(rank, tp_rank, pp_rank, prev_rank, next_rank) -> None:
    ctx = rank_context(rank, tp_size=2, pp_size=2, device="cpu")
    assert (ctx.tp_size, ctx.pp_size, ctx.world_size) == (2, 2, 4)
    assert (ctx.tp_rank, ctx.pp_rank, ctx.global_rank) == (tp_rank, pp_rank, rank)
    assert (ctx.pp.prev_rank, ctx.pp.next_rank) == (prev_rank, next_rank)  # same tp rank, next/previous stage
    assert ctx.is_rank0 == (tp_rank == 0) and ctx.is_sampler == (rank == 2)  # tp rank 0 of the last stage
    assert not hasattr(ctx, "rank") and not hasattr(ctx.pp, "tp_size")  # one name per number


def test_one_stage_world_is_the_tensor_parallel_group() -> None:
    ctx = rank_context(3, tp_size=4, pp_size=1, device="cpu")
    assert (ctx.tp_rank, ctx.tp_size, ctx.pp_rank, ctx.pp_size, ctx.world_size) == (3, 4, 0, 1, 4)
    single = ParallelContext.single()
    assert (single.tp_rank, single.tp_size, single.pp_size, single.world_size) == (0, 1, 1, 1)


def test_bad_places_are_refused() -> None:
    with pytest.raises(ValueError, match=r"rank=4 is outside \[0, world_size=4\)"):
        rank_context(4, tp_size=2, pp_size=2, device="cpu")
    with pytest.raises(ValueError, match="tp_size=0"):
        rank_context(0, tp_size=0, pp_size=2, device="cpu")
    with pytest.raises(ValueError, match="pp_rank=2 is outside"):
        PipelineStage(pp_rank=2, pp_size=2, prev_rank=0)
    with pytest.raises(ValueError, match="a peer is needed"):
        PipelineStage(pp_rank=0, pp_size=2)  # a next stage but no rank to send to
    with pytest.raises(ValueError, match="tp_rank=2 is outside"):
        ParallelContext(tp_rank=2, tp_size=2, device=torch.device("cpu"))


def _world_size_definitions(tree: ast.Module) -> list[tuple[str, ast.AST]]:
    """(class name, node) for each way a class of ``tree`` defines an attribute named world_size."""
    found: list[tuple[str, ast.AST]] = []
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for node in ast.walk(cls):
            target = node.target if isinstance(node, ast.AnnAssign) else None
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                target = node.targets[0]
            named = (isinstance(target, ast.Name) and target.id == "world_size") or (
                isinstance(target, ast.Attribute) and target.attr == "world_size")
            if named or (isinstance(node, ast.FunctionDef) and node.name == "world_size"):
                found.append((cls.name, node))
    return found


def _is_product_property(node: ast.AST) -> bool:
    if not isinstance(node, ast.FunctionDef):
        return False
    is_property = any(isinstance(d, ast.Name) and d.id == "property" for d in node.decorator_list)
    returns = [n for n in ast.walk(node) if isinstance(n, ast.Return)]
    return is_property and len(returns) == 1 and isinstance(returns[0].value, ast.BinOp) and \
        isinstance(returns[0].value.op, ast.Mult)


def test_no_worker_attribute_named_world_size_holds_a_tp_degree() -> None:
    definitions: dict[str, list[str]] = {}
    for path in sorted(WORKER.rglob("*.py")):
        for cls, node in _world_size_definitions(ast.parse(path.read_text(encoding="utf-8"))):
            definitions.setdefault(f"{path.relative_to(WORKER.parent)}:{cls}", []).append(
                "product property" if _is_product_property(node) else f"line {node.lineno}: {ast.unparse(node)[:60]}")
    assert definitions == {"worker/parallel_state.py:ParallelContext": ["product property"],
                           "worker/server.py:WorkerOptions": ["product property"]}
    for folder in ("layers", "models"):
        for path in (WORKER / folder).rglob("*.py"):
            assert "world_size" not in path.read_text(encoding="utf-8"), f"{path}: layers are split tp_size ways"


def test_the_static_check_catches_a_tp_degree_named_world_size() -> None:
    # The check itself can fail: the pre-issue-42 ParallelContext (a world_size field) is caught.
    old = ast.parse("class ParallelContext:\n    rank: int\n    world_size: int\n")
    new = ast.parse("class C:\n    def __init__(self, n):\n        self.world_size = n\n")
    assert [c for c, n in _world_size_definitions(old) if not _is_product_property(n)] == ["ParallelContext"]
    assert [c for c, n in _world_size_definitions(new) if not _is_product_property(n)] == ["C"]
