"""Fixtures shared by end-to-end modules."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.cluster import RunningCluster, serve


@pytest.fixture(scope="session")
def default_tp2() -> Iterator[RunningCluster]:
    """One ``tpserve serve`` of the embedded model at tensor_parallel_size 2, shared by the
    modules whose tests leave it running (test_public_faults.py, test_fuzz_requests.py):
    one start-up instead of one per module keeps the e2e suite within its time budget."""
    with serve(None, 2) as running:
        yield running
