"""Int4 routed experts in the tile layout against the row-major layout and int8: one MoE layer's experts.

The shape of docs/design/models.md's "Int4 experts" figure: 16 experts, hidden 2048, expert width 768,
top-4, int4 groups of 128 (RTN's at these sizes). Random codes and scales (speed does not depend on
the values); :func:`~worker.layers.moe_experts.grouped_experts_torch` on

* ``int4``: the stacks repacked expert by expert into the tile layout
  (:func:`~worker.layers.int4_matmul.repack_tile_stack`, what loading does on an AMX-INT8 or AVX512-VNNI
  CPU): ``linear_int4`` per expert takes the tile kernel (AMX at every row count; VNNI up to 16 rows, then
  dequantized rows, and dequantize-and-matmul beyond 64);
* ``int4_rowmajor``: the same codes in the row-major layout (what ``use_int4_tiles(False)`` before
  loading keeps): the VNNI / row-major AMX GEMV paths (without AMX: VNNI, float, dequantized rows' tiles),
  and dequantize-and-matmul beyond 64 rows;
* ``int8``: int8 stacks with per-row scales (``--quantization int8``).

One thread, CPU seconds of the thread (``time.thread_time``), configurations interleaved call by call
(a busy host slows them alike), each timed call after one untimed call on the same weights (decode
reads the weights the previous step read). Reported: the median and the minimum over ``--rounds`` of
a decode token (1 row: 4 experts, a row each), 16 tokens, and a 512-token prefill (about 128 rows an
expert), and int4_rowmajor / int4 and int8 / int4 (> 1: the tile layout is faster).

    python benchmarks/moe_int4_experts.py --out benchmarks/results    # the recorded run
    python benchmarks/moe_int4_experts.py --rounds 3                  # a quick check that it runs
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.report import save_report  # noqa: E402
from worker.kernels import cpu_kernels_available  # noqa: E402
from worker.layers.int4_matmul import pack_codes, repack_tile_stack  # noqa: E402
from worker.layers.moe_experts import grouped_experts_torch  # noqa: E402

EXPERTS, HIDDEN, WIDTH, TOP_K, GROUP = 16, 2048, 768, 4, 128
TOKENS = {"decode_1": 1, "decode_16": 16, "prefill_512": 512}


def _int4_stack(rows: int, cols: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``(E, rows, cols / 2)`` uint8 row-major codes and ``(E, rows, cols / G, 2)`` float32 (scale, offset)."""
    q = torch.randint(0, 16, (EXPERTS * rows, cols), generator=gen)
    scale = torch.rand(EXPERTS, rows, cols // GROUP, generator=gen) * 0.01 + 0.001
    return pack_codes(q).reshape(EXPERTS, rows, cols // 2), torch.stack([scale, -8 * scale], 3)


def _stacks() -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """config -> (gate_up, down, gate_up_scale, down_scale)."""
    gen = torch.Generator().manual_seed(0)
    gate_up, gate_up_so = _int4_stack(2 * WIDTH, HIDDEN, gen)
    down, down_so = _int4_stack(HIDDEN, WIDTH, gen)
    tile_gate_up, tile_down = gate_up.clone(), down.clone()
    tile_gate_up_so, tile_down_so = repack_tile_stack(tile_gate_up, gate_up_so), repack_tile_stack(tile_down, down_so)
    int8_gate_up = torch.randint(-127, 128, (EXPERTS, 2 * WIDTH, HIDDEN), generator=gen, dtype=torch.int8)
    int8_down = torch.randint(-127, 128, (EXPERTS, HIDDEN, WIDTH), generator=gen, dtype=torch.int8)
    return {"int4": (tile_gate_up, tile_down, tile_gate_up_so, tile_down_so),
            "int4_rowmajor": (gate_up, down, gate_up_so, down_so),
            "int8": (int8_gate_up, int8_down, torch.full((EXPERTS, 2 * WIDTH), 1e-3),
                     torch.full((EXPERTS, HIDDEN), 1e-3))}


def _inputs(tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, generator=gen)
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(tokens)])  # (T, k)
    return x, ids, torch.rand(tokens, TOP_K, generator=gen)


def _time(stack: tuple[torch.Tensor, ...], x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> float:
    """Thread CPU seconds of one call, after an untimed call on the same weights."""
    gate_up, down, gate_up_scale, down_scale = stack
    for timed in (False, True):
        start = time.thread_time()
        grouped_experts_torch(x, gate_up, down, ids, weights, gate_up_scale=gate_up_scale, down_scale=down_scale)
        if timed:
            return time.thread_time() - start
    raise AssertionError("unreachable")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--out", type=Path, default=None, help="directory for the report")
    parser.add_argument("--name", default="moe_int4_experts.json", help="the report's file name")
    args = parser.parse_args()
    if not cpu_kernels_available() or not torch.ops.tpserve_cpu.int4_tiles_enabled():
        raise SystemExit("needs the compiled CPU kernels on an AMX-INT8 or AVX512-VNNI CPU (the tile layout)")
    torch.set_num_threads(1)
    stacks = _stacks()
    report: dict = {"shape": {"experts": EXPERTS, "hidden": HIDDEN, "width": WIDTH, "top_k": TOP_K, "group": GROUP},
                    "rounds": args.rounds, "threads": 1, "clock": "thread_time",
                    "int4_tiles_on": "AMX-INT8" if torch.ops.tpserve_cpu.use_amx_int4(True) else "AVX512-VNNI",
                    "host": {"cpu": platform.processor() or platform.machine(), "load_average": os.getloadavg()},
                    "recorded": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "results": {}}
    for case, tokens in TOKENS.items():
        inputs = _inputs(tokens)
        rounds = max(3, args.rounds // (8 if tokens > 16 else 1))
        times: dict[str, list[float]] = {name: [] for name in stacks}
        for _ in range(rounds):
            for name, stack in stacks.items():  # interleaved
                times[name].append(_time(stack, *inputs))
        result = {name: {"median_ms": 1e3 * statistics.median(t), "min_ms": 1e3 * min(t)} for name, t in times.items()}
        result["rowmajor_over_int4"] = result["int4_rowmajor"]["median_ms"] / result["int4"]["median_ms"]
        result["int8_over_int4"] = result["int8"]["median_ms"] / result["int4"]["median_ms"]
        report["results"][case] = result
        print(case, {k: (round(v["median_ms"], 3), round(v["min_ms"], 3)) if isinstance(v, dict) else round(v, 2)
                     for k, v in result.items()}, flush=True)
    if args.out is not None:
        print(save_report(args.out, args.name, report))


if __name__ == "__main__":
    main()
