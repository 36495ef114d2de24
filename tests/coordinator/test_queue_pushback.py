"""A full queue's RESOURCE_EXHAUSTED carries the queue's pushback (coordinator/request_table.py,
coordinator/pushback.py): the oldest waiting sequence's wait so far, for one sample and for ``n``."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from coordinator.errors import ResourceExhaustedError
from coordinator.request_table import RequestTable


def test_full_queue_refusal_carries_the_oldest_wait() -> None:
    now = time.monotonic()
    waiting = [SimpleNamespace(arrival_s=now - 2.5), SimpleNamespace(arrival_s=now - 0.5)]
    table = RequestTable()
    table.check_queue(1, waiting, max_queue_len=3)  # a place left: no refusal
    with pytest.raises(ResourceExhaustedError, match="the queue is full") as one:
        table.check_queue(1, waiting, max_queue_len=2)
    assert 2500 <= one.value.retry_pushback_ms < 3500
    with pytest.raises(ResourceExhaustedError, match="n=2 samples") as n:
        table.reserve(table.open("r", num_samples=2), waiting, max_queue_len=3)
    assert 2500 <= n.value.retry_pushback_ms < 3500

