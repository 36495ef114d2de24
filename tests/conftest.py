"""Fixtures for every test directory: the servers shared between tests of the same configuration."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.e2e.cluster import SharedServers

#: Shared servers kept running at once (tests/e2e/cluster.py:SharedServers). Four hold every
#: shared configuration of today's suite, so each starts once; a tp-2 server holds about 0.6 GB.
MAX_SHARED_SERVERS = int(os.environ.get("TPSERVE_TEST_MAX_SHARED_SERVERS", "4"))

#: The session's pool, once a test has asked for it (for the summary line).
_pools: list[SharedServers] = []


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


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """One line: how many shared servers started and how many requests for one they served (the saving)."""
    for servers in _pools:
        terminalreporter.write_line(f"shared servers: {servers.num_started} started for {servers.num_requests} "
                                    f"requests (max {servers.max_running} running at once)")
