"""The printed summary table and the JSON result file of ``tpserve bench``.

The table follows ``vllm bench serve``'s layout and wording, so numbers read the same
way; the file holds the parameters, the summary and every request's measurements:

    {"parameters": {...}, "runs": [{"request_rate": R, "summary": {...},
                                    "requests": [RequestRecord.to_json_dict(), ...]}, ...]}

with one run per request rate (one, unless ``--sweep-request-rate``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

from tpserve.bench.runner import RunResult

_WIDTH = 50
_SECTIONS = (("ttft_ms", "TTFT", "Time to First Token"),
             ("tpot_ms", "TPOT", "Time per Output Token (excl. 1st token)"),
             ("itl_ms", "ITL", "Inter-token Latency (per token)"),
             ("e2el_ms", "E2EL", "End-to-end Latency"))


def _line(label: str, value: object) -> str:
    if isinstance(value, float):
        value = f"{value:.2f}"
    return f"{label:<40}{'-' if value is None else value:<10}"


def format_summary(summary: dict, request_rate: float, burstiness: float, max_concurrency: int | None) -> str:
    """The summary as the table printed at the end of a run."""
    lines = [f"{' Serving Benchmark Result ':=^{_WIDTH}}",
             _line("Traffic request rate (req/s):", "inf" if math.isinf(request_rate) else f"{request_rate:g}"),
             _line("Burstiness factor:", f"{burstiness:g}" + (" (Poisson process)" if burstiness == 1 else "")),
             _line("Maximum request concurrency:", max_concurrency),
             _line("Successful requests:", summary["completed"]),
             _line("Failed requests:", summary["failed"])]
    for code, count in sorted(summary["failures"].items()):
        lines.append(_line(f"  failed with {code}:", count))
        message = summary.get("failure_messages", {}).get(code)
        if message:  # one line: the server's message may hold newlines
            lines.append(f"    first message: {' '.join(message.split())}")
    lines += [_line("Benchmark duration (s):", summary["duration_s"]),
              _line("Total input tokens:", summary["total_input_tokens"]),
              _line("Total generated tokens:", summary["total_output_tokens"]),
              _line("Request throughput (req/s):", summary["request_throughput"])]
    if "request_goodput" in summary:
        slos = " ".join(f"{name}<={ms:g}ms" for name, ms in summary["goodput_slos_ms"].items())
        lines.append(_line("Request goodput (req/s):", summary["request_goodput"]) + f" [{slos}]")
    lines += [_line("Output token throughput (tok/s):", summary["output_throughput"]),
              _line("Total token throughput (tok/s):", summary["total_token_throughput"])]
    for key, short, title in _SECTIONS:
        lines.append(f"{title:-^{_WIDTH}}")
        for stat, value in summary[key].items():
            label = {"mean": "Mean", "median": "Median"}.get(stat, stat.upper())
            lines.append(_line(f"{label} {short} (ms):", value))
        if key == "itl_ms":  # several tokens per message under speculative decoding: say how many
            lines.append(_line("Mean tokens per message:", summary.get("tokens_per_message")))
            lines.append(_line("Mean ITL per message (ms):", summary.get("itl_per_message_ms", {}).get("mean")))
    lines.append("=" * _WIDTH)
    return "\n".join(line.rstrip() for line in lines)


def format_sweep(runs: Sequence[RunResult]) -> str:
    """One line per request rate: what the sweep found, side by side."""
    header = ("rate (req/s)", "req/s", "output tok/s", "p99 TTFT (ms)", "p99 TPOT (ms)", "failed")
    rows = [header] + [(f"{run.request_rate:g}", f"{s['request_throughput']:.2f}", f"{s['output_throughput']:.1f}",
                        _ms(s["ttft_ms"]["p99"]), _ms(s["tpot_ms"]["p99"]), str(s["failed"]))
                       for run in runs for s in [run.summary]]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in rows)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def result_dict(parameters: dict, runs: Sequence[RunResult]) -> dict:
    """The JSON result: parameters, then each run's summary and per-request records."""
    return {"parameters": parameters,
            "runs": [{"request_rate": json_rate(run.request_rate), "summary": run.summary,
                      "requests": [record.to_json_dict() for record in run.records]} for run in runs]}


def write_result(path: str | Path, parameters: dict, runs: Sequence[RunResult]) -> None:
    """Writes :func:`result_dict` as JSON (creating the parent directory)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Compact: a run holds one time per chunk of every request.
    path.write_text(json.dumps(result_dict(parameters, runs), separators=(",", ":")) + "\n", encoding="utf-8")


def json_rate(rate: float) -> float | str:
    """A request rate for JSON, which has no infinity: "inf" is what the flag takes."""
    return "inf" if math.isinf(rate) else rate
