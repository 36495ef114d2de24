"""Fixtures shared by end-to-end modules."""

from __future__ import annotations

import pytest

from tests.e2e.cluster import RunningCluster, SharedServers


@pytest.fixture(scope="session")
def default_tp2(shared_servers: SharedServers) -> RunningCluster:
    """The shared ``tpserve serve`` of the embedded model at tensor_parallel_size 2 (tests/conftest.py),
    for the modules whose tests leave it running (test_public_faults.py, test_fuzz_requests.py, ...)."""
    return shared_servers.get(None, 2)
