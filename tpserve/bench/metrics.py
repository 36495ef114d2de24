"""Serving metrics measured by the client from a GenerateStream, with vLLM's definitions.

One request is a :class:`RequestRecord`: the send time and the arrival time of every
stream message ("chunk"), each relative to the send, plus the server's ``usage``.
From these, exactly as ``vllm bench serve`` computes them (vllm/benchmarks/serve.py,
``calculate_metrics``):

- TTFT: arrival of the first chunk - send.
- ITL, per token: a chunk carrying n tokens, t seconds after the previous chunk that
  carried tokens, gives n samples of t / n (chunks carrying no token add their time to the
  next one). With one token per chunk this is vLLM's ITL; under speculative decoding a
  chunk carries every token a step accepted, and a gap per chunk would be a latency per
  *step* (several tokens), not per token, so its mean would not be comparable with TPOT.
  The per-chunk gaps are kept as ``itl_per_message_ms`` (vLLM's per-chunk ITL), beside
  ``tokens_per_message`` (mean tokens per chunk carrying tokens).
- E2EL: arrival of the last chunk - send.
- TPOT: (E2EL - TTFT) / (output_len - 1), only for requests with output_len > 1, where
  output_len is the server's ``usage.completion_tokens``. For goodput a request with
  output_len <= 1 has TPOT 0 (vLLM's rule: it cannot miss a TPOT SLO).
- Throughputs divide by the benchmark's duration (first send to last completion):
  requests, output tokens, and input + output tokens per second; goodput is the
  requests per second that met every given SLO (metric <= SLO).
- Percentiles interpolate linearly between order statistics (numpy's default method).

Times are in seconds inside records and summaries' raw lists; the summary reports
milliseconds (``*_ms``), like vLLM's output. Nothing here touches the network.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Literal

SloName = Literal["ttft", "tpot", "e2el"]
SLO_NAMES: tuple[SloName, ...] = ("ttft", "tpot", "e2el")
PERCENTILES = (90.0, 99.0)


@dataclass
class RequestRecord:
    """One request as the client saw it. Times in seconds.

    ``status`` is the gRPC status code name ("OK" on success); a stream that ended
    without a finish_reason, or with finish_reason "abort", is a failure too.
    """

    index: int
    start_s: float  # send time, relative to the start of the benchmark
    max_tokens: int | None = None
    chunk_times_s: list[float] = field(default_factory=list)  # arrival of each chunk, relative to the send
    chunk_num_tokens: list[int] = field(default_factory=list)  # token ids carried by each chunk
    prompt_tokens: int = 0  # usage.prompt_tokens
    completion_tokens: int = 0  # usage.completion_tokens
    finish_reason: str | None = None
    status: str = "OK"
    error: str = ""

    def add_chunk(self, elapsed_s: float, num_tokens: int) -> None:
        """A stream message arrived ``elapsed_s`` seconds after the send, carrying ``num_tokens`` ids."""
        self.chunk_times_s.append(elapsed_s)
        self.chunk_num_tokens.append(num_tokens)

    def finish(self, finish_reason: str | None, prompt_tokens: int, completion_tokens: int) -> None:
        """The stream ended normally; the last message's finish_reason and usage."""
        self.finish_reason, self.prompt_tokens, self.completion_tokens = finish_reason, prompt_tokens, completion_tokens
        if finish_reason is None or finish_reason == "abort":
            self.fail("ABORTED_BY_SERVER" if finish_reason == "abort" else "INCOMPLETE_STREAM",
                      f"the stream ended with finish_reason {finish_reason}")

    def fail(self, status: str, error: str) -> None:
        self.status, self.error = status, error

    @property
    def success(self) -> bool:
        return self.status == "OK"

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times_s[0] if self.chunk_times_s else None

    @property
    def e2el_s(self) -> float | None:
        return self.chunk_times_s[-1] if self.chunk_times_s else None

    @property
    def message_itl_s(self) -> list[float]:
        """Every gap between consecutive chunks (one sample per chunk after the first, however many tokens)."""
        times = self.chunk_times_s
        return [later - earlier for earlier, later in zip(times, times[1:])]

    @property
    def itl_s(self) -> list[float]:
        """Per-token inter-token latencies (module docstring): one sample per token after the first chunk's."""
        samples: list[float] = []
        previous: float | None = None
        for elapsed, num_tokens in zip(self.chunk_times_s, self.chunk_num_tokens):
            if num_tokens <= 0:
                continue
            if previous is not None:
                samples += [(elapsed - previous) / num_tokens] * num_tokens
            previous = elapsed
        return samples

    @property
    def num_token_messages(self) -> int:
        """Chunks that carried at least one token."""
        return sum(n > 0 for n in self.chunk_num_tokens)

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; None when there is at most one."""
        if self.completion_tokens <= 1 or not self.chunk_times_s:
            return None
        return (self.e2el_s - self.ttft_s) / (self.completion_tokens - 1)

    def to_json_dict(self) -> dict:
        """The record with TTFT, TPOT and E2EL, as the result file stores it (seconds, to the microsecond).

        The ITLs are not repeated: they are the differences of consecutive ``chunk_times_s``.
        """
        def us(value: float | None) -> float | None:
            return None if value is None else round(value, 6)

        return {**asdict(self), "start_s": us(self.start_s), "chunk_times_s": [us(t) for t in self.chunk_times_s],
                "ttft_s": us(self.ttft_s), "tpot_s": us(self.tpot_s), "e2el_s": us(self.e2el_s)}


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear between order statistics like ``numpy.percentile``.

    Raises:
        ValueError: ``values`` is empty or q is outside [0, 100].
    """
    if not values:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution_ms(values_s: Sequence[float]) -> dict[str, float | None]:
    """mean, median, p90, p99 of values in seconds, reported in milliseconds (None when empty)."""
    keys = ["mean", "median", *(f"p{q:g}" for q in PERCENTILES)]
    if not values_s:
        return dict.fromkeys(keys)
    stats = [statistics.fmean(values_s), statistics.median(values_s), *(percentile(values_s, q) for q in PERCENTILES)]
    return {key: value * 1e3 for key, value in zip(keys, stats)}


def parse_goodput(items: Sequence[str]) -> dict[SloName, float]:
    """``["ttft:500", "tpot:50"]`` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds).

    Raises:
        ValueError: an item is not NAME:MS, the name is not ttft/tpot/e2el, or MS is negative.
    """
    slos: dict[SloName, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_NAMES:
            raise ValueError(f"--goodput takes NAME:MILLISECONDS with NAME in {'/'.join(SLO_NAMES)}, got {item!r}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if slos[name] < 0:
            raise ValueError(f"--goodput {item!r}: the SLO must be >= 0 ms")
    return slos


def meets_slos(record: RequestRecord, slos_ms: dict[SloName, float]) -> bool:
    """Whether a successful request met every SLO (metric <= SLO; TPOT counts as 0 with <= 1 token)."""
    measured_s = {"ttft": record.ttft_s, "tpot": record.tpot_s or 0.0, "e2el": record.e2el_s}
    return all(measured_s[name] * 1e3 <= slo for name, slo in slos_ms.items())


def first_messages(records: Sequence[RequestRecord]) -> dict[str, str]:
    """The first failed request's message for each status code (in request order): what the server said, which
    the counts alone do not (an INVALID_ARGUMENT names the field it refused)."""
    messages: dict[str, str] = {}
    for record in records:
        if not record.success:
            messages.setdefault(record.status, record.error)
    return messages


def summarize(records: Sequence[RequestRecord], duration_s: float, slos_ms: dict[SloName, float] | None = None) -> dict:
    """The benchmark's summary: counts, throughputs (per second of ``duration_s``), latency distributions.

    Raises:
        ValueError: ``duration_s`` is not positive.
    """
    if duration_s <= 0:
        raise ValueError(f"duration must be positive, got {duration_s} s")
    done = [r for r in records if r.success]
    total_input = sum(r.prompt_tokens for r in done)
    total_output = sum(r.completion_tokens for r in done)
    summary = {
        "num_requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "failures": dict(Counter(r.status for r in records if not r.success)),
        "failure_messages": first_messages(records),
        "duration_s": duration_s,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) / duration_s,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        "ttft_ms": distribution_ms([r.ttft_s for r in done]),
        "tpot_ms": distribution_ms([r.tpot_s for r in done if r.tpot_s is not None]),
        "itl_ms": distribution_ms([gap for r in done for gap in r.itl_s]),
        "itl_per_message_ms": distribution_ms([gap for r in done for gap in r.message_itl_s]),
        "tokens_per_message": (sum(sum(r.chunk_num_tokens) for r in done) / num_messages
                               if (num_messages := sum(r.num_token_messages for r in done)) else None),
        "e2el_ms": distribution_ms([r.e2el_s for r in done]),
    }
    if slos_ms:
        summary["goodput_slos_ms"] = dict(slos_ms)
        summary["request_goodput"] = sum(meets_slos(r, slos_ms) for r in done) / duration_s
    return summary
