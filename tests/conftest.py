"""Fixtures for every test directory: the servers shared between tests of the same configuration."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from coordinator.tokenizer import Tokenizer
    from tests.e2e.cluster import SharedServers

#: Shared servers kept running at once (tests/e2e/cluster.py:SharedServers). Four hold every
#: shared configuration of today's suite, so each starts once; a tp-2 server holds about 0.6 GB.
MAX_SHARED_SERVERS = int(os.environ.get("TPSERVE_TEST_MAX_SHARED_SERVERS", "4"))

#: The session's pool, once a test has asked for it (for the summary line).
_pools: list[SharedServers] = []
#: The test processes' (started, requests, max running) under pytest-xdist, as each reports at its end.
_counts: list[tuple[int, int, int]] = []


@pytest.fixture(scope="session", autouse=True)
def _one_cpu_thread() -> Iterator[None]:
    """The test process's own torch work (references in ``transformers``, tiny models) on one thread: tiny
    matmuls on a shared CPU run ~20x faster on one thread than fighting over all of them, the more so with
    two test processes and their servers' ranks on two cores. Ranks get OMP_NUM_THREADS=1 of their own."""
    import torch

    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    """The embedded test model's tokenizer (tpserve/embedded_model.py), a fresh one for each test module (its
    memos start empty there, as tests that count memo hits expect)."""
    from coordinator.tokenizer import Tokenizer
    from tpserve.embedded_model import default_model_dir

    return Tokenizer.from_pretrained(default_model_dir())


@pytest.fixture(scope="module")
def stories_tokenizer() -> Tokenizer:
    """The stories260k checkpoint's tokenizer (SentencePiece BPE with byte fallback), one for each test module."""
    from coordinator.tokenizer import Tokenizer
    from tests.paths import STORIES_DIR

    return Tokenizer.from_pretrained(STORIES_DIR)


@pytest.fixture(scope="session")
def shared_servers() -> Iterator[SharedServers]:
    """``shared_servers.get(model, tensor_parallel_size, *flags)``: the running ``tpserve serve`` of that
    configuration, shared with every other test that asks for it (the rules: tests/e2e/cluster.py:SharedServers)."""
    from tests.e2e.cluster import SharedServers  # imports grpc: only for the tests that ask

    servers = SharedServers(MAX_SHARED_SERVERS)
    _pools.append(servers)
    try:
        yield servers
    finally:
        servers.close()


#: The longest test groups (module, or xdist_group name), longest first, from a serial run's durations: started
#: first under pytest-xdist so that none of them starts last and leaves the other test processes idle.
LONGEST_GROUPS = (
    "families", "tests.cluster.test_two_hosts", "tests.e2e.test_every_family_serving",
    "tests.worker.test_pipeline_runner", "tests.e2e.test_unicode_stream", "tests.e2e.test_security",
    "tests.e2e.test_pipeline_serving", "tests.e2e.test_gateway", "tests.e2e.test_recovery",
    "tests.e2e.test_shutdown_signals", "tests.e2e.test_spec_decode_serving", "tests.e2e.test_stories_serving",
    "tests.worker.test_tp_runner", "tests.bench.test_e2e", "tests.cluster.test_stream_move",
)


def _group(item: pytest.Item) -> str:
    marker = item.get_closest_marker("xdist_group")
    if marker is not None:
        return str(marker.args[0] if marker.args else marker.kwargs.get("name", "default"))
    return item.module.__name__ if item.module is not None else item.nodeid


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``--dist loadgroup``, pyproject.toml), a module's tests run in one test process, in
    order, so that its module-scoped servers start once; modules marked ``xdist_group(name)`` share one process
    (the model families, which run in one process group per degree). The longest groups go first."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(_group(item)))
    rank = {name: i for i, name in enumerate(LONGEST_GROUPS)}
    items.sort(key=lambda item: rank.get(_group(item), len(rank)))  # stable: each module keeps its order


def pytest_sessionfinish(session: pytest.Session) -> None:
    """In a pytest-xdist test process: hand this process's shared-server counts to the controller."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["shared_servers"] = [(s.num_started, s.num_requests, s.max_running) for s in _pools]


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:  # noqa: ARG001 - pytest-xdist's hook, on the controller
    _counts.extend(getattr(node, "workeroutput", {}).get("shared_servers", []))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """One line: how many shared servers started and how many requests for one they served (the saving)."""
    counts = _counts + [(s.num_started, s.num_requests, s.max_running) for s in _pools]
    if counts:
        terminalreporter.write_line(
            f"shared servers: {sum(c[0] for c in counts)} started for {sum(c[1] for c in counts)} requests "
            f"in {len(counts)} test process(es) (at most {max(c[2] for c in counts)} running at once in each)")
