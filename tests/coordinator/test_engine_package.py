"""The engine's shape (issue 42): a small facade, small files, no private reach, no import circle.

The engine was a god object (26 methods, 544 lines) whose pipeline loop lived in another
module that reached into its private members and imported it back. These checks keep
coordinator/engine/ the way it was split: they read the source, so they fail on the
old layout (coordinator/engine.py <-> coordinator/micro_batches.py).
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from coordinator.engine import Engine, RequestOutput
from coordinator.request_output import RequestOutput as CanonicalRequestOutput

ROOT = Path(__file__).resolve().parents[2]
COORDINATOR = ROOT / "coordinator"


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Modules of the coordinator that ``path`` imports, at any depth (TYPE_CHECKING included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("coordinator"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("coordinator")}
    return found


def test_the_facade_has_at_most_12_methods_and_keeps_the_old_imports() -> None:
    methods = [name for name, member in vars(Engine).items()
               if inspect.isfunction(member) or isinstance(member, property)]
    assert len(methods) <= 12, methods
    assert {"generate", "abort_request", "run", "drain"} <= set(methods)
    assert RequestOutput is CanonicalRequestOutput


def test_no_engine_or_scheduler_file_is_over_500_lines() -> None:
    files = [*sorted((COORDINATOR / "engine").glob("*.py")), COORDINATOR / "scheduler.py",
             COORDINATOR / "spec_scheduling.py", COORDINATOR / "multi_step.py"]
    sizes = {path.name: len(path.read_text().splitlines()) for path in files}
    assert len(sizes) >= 8 and max(sizes.values()) < 500, sizes


def test_no_engine_module_reaches_into_another_objects_private_members() -> None:
    """``x._name`` only on ``self`` (or ``cls``), and no ``from m import _name``."""
    reaches = []
    for path in sorted((COORDINATOR / "engine").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                reaches.append(f"{path.name}:{node.lineno} .{node.attr}")
            if isinstance(node, ast.ImportFrom):
                reaches += [f"{path.name}:{node.lineno} {alias.name}" for alias in node.names
                            if alias.name.startswith("_")]
    assert reaches == []


def test_the_coordinator_has_no_import_circle() -> None:
    modules = {_module(path): path for path in COORDINATOR.rglob("*.py")}
    graph = {name: {dep for dep in _imports(path) if dep in modules and dep != name} for name, path in modules.items()}
    cycles, done, stack = [], set(), []

    def visit(name: str) -> None:
        if name in stack:
            cycles.append(stack[stack.index(name):] + [name])
            return
        if name in done:
            return
        stack.append(name)
        for dep in sorted(graph[name]):
            visit(dep)
        stack.pop()
        done.add(name)

    for name in sorted(graph):
        visit(name)
    assert cycles == []
