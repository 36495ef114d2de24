"""PNG plots of a benchmark (matplotlib, Agg backend: no display needed).

- :func:`plot_run`: one load: the latency CDFs of TTFT, TPOT and ITL, and output tokens
  per second over time with the requests in flight.
- :func:`plot_sweep`: one point per request rate: output token throughput against p99
  TPOT (the curve that sizes a deployment: how much throughput a TPOT target allows),
  and p99 TTFT against the achieved request throughput (where queueing starts).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from tpserve.bench.metrics import RequestRecord
from tpserve.bench.runner import RunResult


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    return plt


def _cdf(axes, values_s: Sequence[float], title: str) -> None:
    if not values_s:
        axes.text(0.5, 0.5, "no samples", ha="center", va="center", transform=axes.transAxes)
    else:
        ordered = sorted(v * 1e3 for v in values_s)
        axes.step(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], where="post")
    axes.set(title=title, xlabel="ms", ylabel="fraction of samples", ylim=(0, 1.02))
    axes.grid(alpha=0.3)


def tokens_over_time(records: Sequence[RequestRecord], bucket_s: float) -> tuple[list[float], list[float], list[int]]:
    """Bucket start times (s), output tokens per second in each bucket, and requests in flight at each start."""
    done = [r for r in records if r.chunk_times_s]
    if not done:
        return [], [], []
    end = max(r.start_s + r.e2el_s for r in done)
    num_buckets = max(1, math.ceil(end / bucket_s))
    tokens = [0] * num_buckets
    for r in done:
        for t, n in zip(r.chunk_times_s, r.chunk_num_tokens):
            tokens[min(int((r.start_s + t) / bucket_s), num_buckets - 1)] += n
    starts = [i * bucket_s for i in range(num_buckets)]
    in_flight = [sum(r.start_s <= t < r.start_s + r.e2el_s for r in done) for t in starts]
    return starts, [n / bucket_s for n in tokens], in_flight


def plot_run(run: RunResult, path: str | Path, title: str) -> None:
    """Writes the four-panel PNG of one load to ``path``."""
    plt = _pyplot()
    done = [r for r in run.records if r.success]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    _cdf(axes[0][0], [r.ttft_s for r in done], "TTFT")
    _cdf(axes[0][1], [r.tpot_s for r in done if r.tpot_s is not None], "TPOT (excl. 1st token)")
    _cdf(axes[1][0], [gap for r in done for gap in r.itl_s], "ITL")
    duration = run.summary["duration_s"]
    bucket_s = 1.0 if duration >= 20 else max(duration / 20, 0.05)  # about 20 points at least
    starts, rates, in_flight = tokens_over_time(run.records, bucket_s)
    ax = axes[1][1]
    ax.step(starts, rates, where="post", label="output tokens/s")
    ax.set(title=f"Output tokens per second ({bucket_s:.2g} s buckets)", xlabel="time since start (s)",
           ylabel="tokens/s")
    ax.grid(alpha=0.3)
    twin = ax.twinx()
    twin.step(starts, in_flight, where="post", color="tab:orange", alpha=0.7, label="requests in flight")
    twin.set_ylabel("requests in flight")
    ax.legend(handles=ax.get_lines() + twin.get_lines(), loc="upper right", fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_sweep(runs: Sequence[RunResult], path: str | Path, title: str) -> None:
    """Writes the PNG of a request-rate sweep to ``path``: one point per run, labelled with its rate."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5))
    points = [(run, run.summary["tpot_ms"]["p99"], run.summary["ttft_ms"]["p99"]) for run in runs]
    for axes, x_of, y_of, xlabel, ylabel in (
            (left, lambda p: p[1], lambda p: p[0].summary["output_throughput"], "p99 TPOT (ms)",
             "output token throughput (tok/s)"),
            (right, lambda p: p[0].summary["request_throughput"], lambda p: p[2], "request throughput (req/s)",
             "p99 TTFT (ms)")):
        shown = [p for p in points if x_of(p) is not None and y_of(p) is not None]
        axes.plot([x_of(p) for p in shown], [y_of(p) for p in shown], marker="o")
        for p in shown:
            axes.annotate(f"{p[0].request_rate:g}/s", (x_of(p), y_of(p)), textcoords="offset points",
                          xytext=(4, 4), fontsize="small")
        axes.set(xlabel=xlabel, ylabel=ylabel)
        axes.grid(alpha=0.3)
    left.set_title("Throughput against p99 TPOT (labels: offered request rate)")
    right.set_title("p99 TTFT against achieved request throughput")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
