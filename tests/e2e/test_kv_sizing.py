"""A KV pool smaller than one full sequence is refused at start-up, through a real ``tpserve serve``.

The embedded model: max_model_len 512, so one full sequence needs 32 blocks of 16.
The sizing rules themselves are tested without processes (tests/worker/test_memory.py);
every other e2e test serves with the pool sized from free memory.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.e2e.cluster import free_port

pytestmark = pytest.mark.e2e


def test_a_pool_smaller_than_one_full_sequence_is_refused_at_start_up() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "launch.cli", "serve", "--host", "127.0.0.1", "--port", str(free_port()),
         "--num-gpu-blocks-override", "31"], capture_output=True, text=True, timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 1, out.stderr[-2000:]
    assert "holds 496 tokens (31 blocks of 16)" in out.stdout + out.stderr
    assert "max_model_len=512" in out.stdout + out.stderr
    assert "num_kv_blocks_available=31" in out.stdout + out.stderr  # the flag reached the rank
