"""The metric definitions against streams whose timestamps are known, with every value worked out by hand.

Three successful requests and three failures over a 2 s benchmark (times in seconds
from each request's send):

| request | chunks at           | tokens per chunk | completion_tokens | TTFT | ITL per token (ms) | per message | E2EL | TPOT                 |
| ------- | ------------------- | ---------------- | ----------------- | ---- | ------------------ | ----------- | ---- | -------------------- |
| a       | .100 .130 .170 .250 | 1 1 2 1          | 5                 | 100  | 30 20 20 80        | 30 40 80    | 250  | (250-100)/(5-1)=37.5 |
| b       | .050 .060           | 1 1              | 2                 | 50   | 10                 | 10          | 60   | (60-50)/(2-1)=10     |
| c       | .200                | 1                | 1                 | 200  | -                  | -           | 200  | none (0 for goodput) |

(a's third chunk carries 2 tokens 40 ms after the second: two per-token samples of 20 ms.)
"""

from __future__ import annotations

import random

import numpy
import pytest

from tpserve.bench.metrics import RequestRecord, distribution_ms, parse_goodput, percentile, summarize


def make(index: int, chunks: list[tuple[float, int]], prompt_tokens: int, completion_tokens: int) -> RequestRecord:
    record = RequestRecord(index=index, start_s=0.1 * index, max_tokens=8)
    for elapsed, num_tokens in chunks:
        record.add_chunk(elapsed, num_tokens)
    record.finish("length", prompt_tokens, completion_tokens)
    return record


def failed(index: int, status: str) -> RequestRecord:
    record = RequestRecord(index=index, start_s=0.0)
    record.fail(status, f"refused request {index}")
    return record


@pytest.fixture
def records() -> list[RequestRecord]:
    return [make(0, [(0.100, 1), (0.130, 1), (0.170, 2), (0.250, 1)], 10, 5),
            make(1, [(0.050, 1), (0.060, 1)], 20, 2),
            make(2, [(0.200, 1)], 30, 1),
            failed(3, "UNAVAILABLE"), failed(4, "RESOURCE_EXHAUSTED"), failed(5, "UNAVAILABLE")]


def test_per_request_metrics(records) -> None:
    a, b, c = records[:3]
    assert a.ttft_s == pytest.approx(0.100) and a.e2el_s == pytest.approx(0.250)
    assert a.itl_s == pytest.approx([0.030, 0.020, 0.020, 0.080])
    assert a.message_itl_s == pytest.approx([0.030, 0.040, 0.080])
    assert a.tpot_s == pytest.approx(0.0375)
    assert (b.ttft_s, b.e2el_s, b.tpot_s) == pytest.approx((0.050, 0.060, 0.010))
    assert c.tpot_s is None and c.itl_s == [] and c.ttft_s == c.e2el_s == pytest.approx(0.200)
    assert all(r.success for r in records[:3]) and not any(r.success for r in records[3:])


def test_summary(records) -> None:
    s = summarize(records, duration_s=2.0)
    assert (s["num_requests"], s["completed"], s["failed"]) == (6, 3, 3)
    assert s["failures"] == {"UNAVAILABLE": 2, "RESOURCE_EXHAUSTED": 1}
    assert s["failure_messages"] == {"UNAVAILABLE": "refused request 3", "RESOURCE_EXHAUSTED": "refused request 4"}
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (60, 8)
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["output_throughput"] == pytest.approx(4.0)
    assert s["total_token_throughput"] == pytest.approx(34.0)
    # TTFT [100, 50, 200]: p90 at rank 1.8 of [50, 100, 200] = 100 + 0.8 * 100.
    assert s["ttft_ms"] == pytest.approx({"mean": 350 / 3, "median": 100, "p90": 180, "p99": 198})
    # TPOT [37.5, 10] (c has one token): p90 = 10 + 0.9 * 27.5.
    assert s["tpot_ms"] == pytest.approx({"mean": 23.75, "median": 23.75, "p90": 34.75, "p99": 37.225})
    # ITL per token [30, 20, 20, 80, 10]: sorted [10, 20, 20, 30, 80], p90 at rank 3.6 = 30 + 0.6 * 50.
    assert s["itl_ms"] == pytest.approx({"mean": 32, "median": 20, "p90": 60, "p99": 78})
    # Per message [30, 40, 80, 10]: sorted [10, 30, 40, 80], p90 at rank 2.7 = 40 + 0.7 * 40.
    assert s["itl_per_message_ms"] == pytest.approx({"mean": 40, "median": 35, "p90": 68, "p99": 78.8})
    assert s["tokens_per_message"] == pytest.approx(8 / 7)  # 8 tokens in 7 messages
    assert s["e2el_ms"] == pytest.approx({"mean": 170, "median": 200, "p90": 240, "p99": 249})
    assert "request_goodput" not in s


def test_goodput(records) -> None:
    # a misses tpot (37.5 > 20); b meets both; c misses ttft (200 > 100): 1 good request in 2 s.
    assert summarize(records, 2.0, parse_goodput(["ttft:100", "tpot:20"]))["request_goodput"] == pytest.approx(0.5)
    # An SLO is met at equality: a's TTFT is exactly 100 ms, so a and b are good, c is not.
    assert summarize(records, 2.0, {"ttft": 100.0})["request_goodput"] == pytest.approx(1.0)
    # c's one token counts as TPOT 0, so only c meets tpot <= 1 ms; e2el <= 210 keeps it.
    assert summarize(records, 2.0, {"tpot": 1.0, "e2el": 210.0})["request_goodput"] == pytest.approx(0.5)
    assert summarize(records, 4.0, {"e2el": 100.0})["request_goodput"] == pytest.approx(0.25)  # only b


def test_parse_goodput_rejects_bad_items() -> None:
    assert parse_goodput(["e2el:1500", "ttft:0.5"]) == {"e2el": 1500.0, "ttft": 0.5}
    for bad in ("itl:5", "ttft", "ttft:fast", "tpot:-1"):
        with pytest.raises(ValueError, match="goodput"):
            parse_goodput([bad])


def test_streams_that_end_badly_are_failures() -> None:
    aborted = make(0, [(0.1, 1)], 3, 1)
    aborted.finish("abort", 3, 1)
    unfinished = RequestRecord(index=1, start_s=0.0)
    unfinished.add_chunk(0.1, 1)
    unfinished.finish(None, 0, 0)
    assert (aborted.status, unfinished.status) == ("ABORTED_BY_SERVER", "INCOMPLETE_STREAM")
    s = summarize([aborted, unfinished], 1.0)
    assert s["completed"] == 0 and s["ttft_ms"]["mean"] is None and s["failures"] == {
        "ABORTED_BY_SERVER": 1, "INCOMPLETE_STREAM": 1}


def test_percentile_matches_numpy() -> None:
    rng = random.Random(3)
    for size in (1, 2, 7, 100):
        values = [rng.expovariate(1.0) for _ in range(size)]
        for q in (0, 50, 90, 99, 100):
            assert percentile(values, q) == pytest.approx(float(numpy.percentile(values, q)))
    with pytest.raises(ValueError):
        percentile([], 50)
    assert distribution_ms([]) == {"mean": None, "median": None, "p90": None, "p99": None}


def test_bad_duration_is_refused(records) -> None:
    with pytest.raises(ValueError, match="duration"):
        summarize(records, 0.0)


def test_json_record_has_derived_metrics(records) -> None:
    row = records[0].to_json_dict()
    assert (row["ttft_s"], row["tpot_s"], row["e2el_s"]) == (0.1, 0.0375, 0.25)
    assert row["chunk_times_s"] == [0.1, 0.13, 0.17, 0.25] and row["chunk_num_tokens"] == [1, 1, 2, 1]
    assert (row["status"], row["completion_tokens"], row["prompt_tokens"]) == ("OK", 5, 10)


def test_itl_is_per_token_when_messages_carry_several() -> None:
    """Speculative decoding: 4 tokens per message every 24 ms is an ITL of 6 ms, equal to the TPOT
    (docs/design/observability.md, "Measurements say what they are"; it once reported 24 ms as "Inter-token Latency"
    beside a TPOT of 6 ms). A message without tokens
    (text held back, or the final usage) is no sample and its time goes to the next token."""
    record = make(0, [(0.100, 1), (0.124, 4), (0.148, 4), (0.160, 0), (0.172, 4), (0.180, 0)], 10, 13)
    assert record.itl_s == pytest.approx([0.006] * 12)
    assert record.tpot_s == pytest.approx((0.180 - 0.100) / 12)
    s = summarize([record], duration_s=1.0)
    assert s["itl_ms"]["mean"] == pytest.approx(6.0) and s["itl_per_message_ms"]["mean"] == pytest.approx(16.0)
    assert s["tokens_per_message"] == pytest.approx(13 / 4)
