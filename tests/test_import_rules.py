"""Who may import whom (docs/design/request-path.md, "Layout"), checked on the source and on a running headless node.

- ``coordinator`` imports no torch, no worker and no launch (it schedules; it never touches tensors);
- ``worker`` imports neither the coordinator nor launch (ranks execute plans; they decide nothing);
- ``tpserve``, the shared ground (step protocol, config, model config, client, logging, stubs), imports
  none of coordinator, worker and launch, and no torch (the coordinator imports it);
- ``launch`` is therefore the only package that imports the coordinator, and a headless node, which runs
  no coordinator, imports no coordinator module at all.

Every import counts, at any depth of the module (in functions, ``TYPE_CHECKING`` blocks, ``try``), relative
ones resolved, and ``importlib.import_module("...")`` / ``__import__("...")`` with a literal name.
"""

from __future__ import annotations

import ast
import functools
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("coordinator", "launch", "tpserve", "worker")
#: package -> top-level modules it must not import
FORBIDDEN = {
    "coordinator": {"torch", "worker", "launch"},
    "worker": {"coordinator", "launch"},
    "tpserve": {"coordinator", "worker", "launch", "torch"},
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def imports_of(path: Path) -> set[str]:
    """Every module the file ``path`` imports, as absolute dotted names."""
    return imports_in(path.read_text(), _module_name(path), is_package=path.name == "__init__.py")


def imports_in(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every module ``source``, the text of ``module``, imports, as absolute dotted names."""
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                prefix = ".".join(parts[:len(parts) - node.level + 1])
                name = f"{prefix}.{node.module}" if node.module else prefix
            else:
                name = node.module
            found.add(name)
            found.update(f"{name}.{alias.name}" for alias in node.names if alias.name != "*")
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if called in ("import_module", "__import__"):
                found.add(node.args[0].value)
    return found


def _sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def test_the_checker_sees_lazy_relative_and_dynamic_imports() -> None:
    """The checker itself: violations hidden in a function, behind TYPE_CHECKING, relative or through
    import_module are all found."""
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n"
              "def f():\n    from coordinator.engine import Engine\n    from .config import ClusterConfig\n"
              "    from . import log\n    import importlib\n    importlib.import_module('launch.leader')\n")
    found = imports_in(source, "tpserve.probe")
    assert {"torch", "coordinator.engine", "tpserve.config", "tpserve.log", "launch.leader"} <= found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_follow_the_rules(package: str) -> None:
    broken = {}
    for path in _sources(package):
        bad = sorted(name for name in imports_of(path) if name.split(".")[0] in FORBIDDEN[package])
        if bad:
            broken[str(path.relative_to(ROOT))] = bad
    assert not broken, f"{package} imports what it must not: {broken}"


def _closure(start: str) -> set[str]:
    """The repository modules ``start`` reaches through imports (any depth, lazy ones included)."""
    files = {_module_name(path): path for package in PACKAGES for path in (ROOT / package).rglob("*.py")}
    seen, todo = set(), [start]
    while todo:
        module = todo.pop()
        if module in seen or module not in files:
            continue
        seen.add(module)
        for name in imports_of(files[module]):
            # `from pkg import mod` names a module too; parents of a module run their __init__
            parts = name.split(".")
            todo.extend(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return seen


def test_the_headless_node_module_reaches_no_coordinator_module() -> None:
    reached = _closure("launch.headless")
    assert "launch.local_ranks" in reached and "tpserve.config" in reached  # the walk does follow imports
    assert not sorted(m for m in reached if m.split(".")[0] in ("coordinator", "worker"))


def test_only_launch_imports_the_coordinator() -> None:
    importers = {package for package in ("tpserve", "worker", "launch") for path in _sources(package)
                 if any(name.split(".")[0] == "coordinator" for name in imports_of(path))}
    assert importers == {"launch"}


def test_a_headless_node_imports_no_coordinator_module_when_it_runs() -> None:
    """``tpserve serve --headless`` through the console script's own code path, until it gives up on a leader
    that never answers: then no ``coordinator`` module (and no torch) may be loaded in that process."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: nothing listens there
    probe = f"""
import json, sys
from launch.cli import main
code = main(["serve", "--headless", "--nnodes", "2", "--node-rank", "1", "--tensor-parallel-size", "2",
             "--master-addr", "127.0.0.1", "--master-port", "{port}", "--worker-start-timeout-seconds", "1"])
print(json.dumps({{"code": code, "modules": sorted(m for m in sys.modules if m.split(".")[0] in
                  ("coordinator", "worker", "torch", "launch"))}}))
"""
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=ROOT)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["code"] == 1 and "node 1: the leader" in done.stderr, done.stderr  # gave up on the leader
    assert "launch.headless" in result["modules"]  # the node did run
    leaked = [m for m in result["modules"] if m.split(".")[0] in ("coordinator", "worker", "torch")]
    assert not leaked, f"a headless node loaded {leaked}"


# --- No test module imports another; no runtime module imports another module's private name -------------


def _is_test_module(module: str) -> bool:
    """A test module: its last part starts with ``test_`` (pytest collects it). Helpers that tests share live
    in modules that do not (tests/coordinator/fakes.py, tests/e2e/cluster.py, tests/tiny_models.py, conftest.py)."""
    return module.rpartition(".")[2].startswith("test_")


def imported_test_modules(source: str, module: str) -> list[str]:
    """The test modules that ``source`` (the text of test module or helper ``module``) imports, sorted."""
    found = set()
    for name in imports_in(source, module):
        parts = name.split(".")
        # `from tests.coordinator.test_x import helper` names tests.coordinator.test_x.helper: any part counts
        found.update(".".join(parts[:i + 1]) for i, part in enumerate(parts)
                     if part.startswith("test_") and parts[0] == "tests")
    return sorted(found - {module})


def private_imports_in(source: str, module: str, is_package: bool = False) -> list[str]:
    """``from X import _y`` in ``source`` (the text of ``module``) where X is another module: neither
    ``module`` itself nor a package that holds it (a package's private submodules and names are its own)."""
    package = module if is_package else module.rpartition(".")[0]
    own = {module} | {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)}
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            parts = package.split(".")
            prefix = ".".join(parts[:len(parts) - node.level + 1])
            name = f"{prefix}.{node.module}" if node.module else prefix
        else:
            name = node.module or ""
        for alias in node.names:
            if alias.name.startswith("_") and not alias.name.startswith("__") and name not in own:
                found.append(f"{name}.{alias.name}")
    return sorted(found)


def test_the_checker_finds_a_test_module_imported_by_another() -> None:
    """Synthetic violations, absolute, relative and lazy: each is caught; a helper module is not one."""
    source = ("from tests.coordinator.test_engine_overlap import _engine\n"
              "def f():\n    from .test_abort_races import ScriptedGroup\n"
              "from tests.coordinator import test_spec_decode\n"
              "from tests.coordinator.fakes import FakeRankGroup\nfrom tests.e2e.cluster import SharedServers\n")
    assert imported_test_modules(source, "tests.coordinator.test_probe") == [
        "tests.coordinator.test_abort_races", "tests.coordinator.test_engine_overlap",
        "tests.coordinator.test_spec_decode"]
    assert imported_test_modules("from tests.coordinator.fakes import FakeRankGroup\n",
                                    "tests.coordinator.test_probe") == []


def test_no_test_module_imports_another_test_module() -> None:
    broken = {}
    for path in sorted((ROOT / "tests").rglob("*.py")):
        bad = imported_test_modules(path.read_text(), _module_name(path))
        if bad:
            broken[str(path.relative_to(ROOT))] = bad
    assert not broken, f"test modules imported by other modules (move the helpers to a non-test module): {broken}"


def test_the_checker_finds_a_private_name_imported_from_another_module() -> None:
    source = ("from coordinator.engine import Engine, _drain\n"
              "def f():\n    from .scheduler import _Waiting\n"
              "from coordinator.metrics import Metrics\nfrom coordinator.probe import _own\n"
              "from coordinator import _package_private\n")
    assert private_imports_in(source, "coordinator.probe") == ["coordinator.engine._drain",
                                                               "coordinator.scheduler._Waiting"]
    assert private_imports_in("from . import _lib\n", "worker.kernels.triton") == []  # its own package's
    assert private_imports_in("from .cpu import _lib\n", "worker.kernels", is_package=True) == [
        "worker.kernels.cpu._lib"]
    assert private_imports_in("from worker.kernels.cpu import _lib\n", "worker.kernels.triton") == [
        "worker.kernels.cpu._lib"]


@pytest.mark.parametrize("package", PACKAGES)
def test_no_runtime_module_imports_another_modules_private_name(package: str) -> None:
    broken = {}
    for path in _sources(package):
        bad = private_imports_in(path.read_text(), _module_name(path), is_package=path.name == "__init__.py")
        if bad:
            broken[str(path.relative_to(ROOT))] = bad
    assert not broken, f"{package} imports other modules' private names: {broken}"
