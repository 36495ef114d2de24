"""The gateway admits healthy replicas at once (docs/design/request-path.md, "KV event stream answers at once").

smg 1.13 subscribes to every worker's KV events when it registers it and vetoes a worker whose
subscription has not answered within 2 s, or whose stream then goes quiet: before
``SubscribeKvEvents`` answered at once and kept a quiet stream alive, its first 40 s in front of
two replicas logged 16 subscribe failures and 7 vetoes, and the first request took 4.6 s.
The gateway here runs with its default routing policy (cache_aware, the one that subscribes).
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from statistics import median

import openai
import pytest

from tests.e2e.cluster import serve
from tests.e2e.gateway import run_gateway
from tests.paths import STORIES_DIR, requires_stories

pytestmark = [pytest.mark.e2e, requires_stories]

WATCH_S = 20.0
#: What smg 1.13 logs when it gives up on a worker's subscription or vetoes a worker.
REFUSALS = ("Failed to subscribe to KV events", "vetoed", "did not answer within")


def test_two_replicas_are_admitted_without_a_veto_and_the_first_request_is_fast(tmp_path):
    with ExitStack() as stack:
        replicas = [stack.enter_context(serve(STORIES_DIR, 1, log_path=tmp_path / f"replica{i}.log"))
                    for i in range(2)]
        started = time.monotonic()
        gateway = stack.enter_context(run_gateway([r.target for r in replicas], tmp_path / "smg.log"))
        client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused", max_retries=0, timeout=60)

        def complete() -> float:
            begin = time.perf_counter()
            out = client.completions.create(model=STORIES_DIR.name, prompt="Once upon a time", max_tokens=8,
                                            temperature=0)
            assert out.choices[0].finish_reason == "length"
            return time.perf_counter() - begin

        first = complete()
        later = [complete() for _ in range(9)]
        time.sleep(max(0.0, WATCH_S - (time.monotonic() - started)))  # the first 20 s of the gateway's life
        log = (tmp_path / "smg.log").read_text(errors="replace")
    refusals = [line for line in log.splitlines() if any(marker in line for marker in REFUSALS)]
    assert not refusals, "\n".join(refusals[:10])
    # the first request as fast as the tenth, within a factor of 2 (plus 50 ms for a cold tokenizer cache)
    assert first <= 2 * median(later[-5:]) + 0.05, (first, later)
