"""int4 products of 5-64 rows of x on a CPU without AMX-INT8: the dequantized rows' tiles against the float path, and int8.

Where AMX-INT8 is missing (or the kernel does not give the process its tiles: AMD CPUs, Ice Lake, a VM that hides
it), ``linear_int4`` takes 1-4 rows of x on its AVX512-VNNI path, and more rows (a decode step of several
sequences, a short prompt) on the float path, which widens every code once per 8 rows of x and loads x once per row
of W. Since this change, from 9 rows each row of W is dequantized once into L1 and multiplied by ``linear_f32``'s
tiles (cpu_linear_int4.cpp, ``use_int4_row_tiles``). Measured here: the 95M benchmark model's 120 projections (30
layers of q/k/v, o, gate/up and down at hidden 512, intermediate 1,536; random codes, groups of 128), one thread,
wall ms of one pass over all of them after one untimed pass, the three kernels interleaved, the median of
``--rounds`` rounds, at each row count: int4 with the tiles, int4 on the float path (``use_int4_row_tiles(False)``)
and ``linear_int8`` on int8 weights of the same shapes.

    .venv/bin/python benchmarks/int4_row_tiles.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.lm_head_int8 import finish  # noqa: E402
from benchmarks.peer_comparison import MODEL_CONFIG, machine_description  # noqa: E402

ROWS = (5, 8, 9, 12, 16, 32, 64)


def projections(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per projection of the 95M model: int4 codes ``(N, K / 2)`` uint8 and ``(N, K / 128, 2)`` float32 scales and
    offsets, int8 codes ``(N, K)`` and ``(N,)`` scales."""
    from worker.layers.int4_matmul import pack_codes

    h, i = MODEL_CONFIG["hidden_size"], MODEL_CONFIG["intermediate_size"]
    kv = h // MODEL_CONFIG["num_attention_heads"] * MODEL_CONFIG["num_key_value_heads"]
    shapes = [(h + 2 * kv, h), (h, h), (2 * i, h), (h, i)]
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(MODEL_CONFIG["num_hidden_layers"]):
        for n, k in shapes:
            codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
            so = torch.stack([torch.rand(n, k // 128, generator=gen) * 0.01,
                              torch.randn(n, k // 128, generator=gen) * 0.01], -1).contiguous()
            q8 = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
            out.append((pack_codes(codes), so, q8, torch.rand(n, generator=gen) * 0.01))
    return out


def one_pass_ms(layers: list, kind: str, rows: int) -> float:
    """Wall ms of one pass of ``kind`` (``row_tiles``, ``float_path``, ``int8``) over ``layers`` at ``rows`` rows of x,
    after an untimed pass."""
    ops = torch.ops.tpserve_cpu
    ops.use_int4_row_tiles(kind == "row_tiles")
    xs = {k: torch.randn(rows, k) for k in {q8.shape[1] for _, _, q8, _ in layers}}

    def run() -> None:
        for q, so, q8, s8 in layers:
            x = xs[q8.shape[1]]
            if kind == "int8":
                ops.linear_int8(x, q8, s8, None)
            else:
                ops.linear_int4(x, q, so, None)

    try:
        run()
        start = time.perf_counter()
        run()
        return (time.perf_counter() - start) * 1e3
    finally:
        ops.use_int4_row_tiles(True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--name", default="int4_row_tiles.json")
    args = parser.parse_args()
    import worker.kernels

    if not worker.kernels.cpu_kernels_available():
        raise SystemExit("the compiled CPU kernels are unavailable")
    amx = bool(torch.ops.tpserve_cpu.use_amx_int4(True))
    torch.set_num_threads(1)
    layers = projections()
    ms: dict[str, dict[int, float]] = {kind: {} for kind in ("row_tiles", "float_path", "int8")}
    for rows in ROWS:
        times: dict[str, list[float]] = {kind: [] for kind in ms}
        for rnd in range(args.rounds):
            for kind in (list(ms) if rnd % 2 == 0 else list(reversed(ms))):
                times[kind].append(one_pass_ms(layers, kind, rows))
        for kind in ms:
            ms[kind][rows] = round(statistics.median(times[kind]), 2)
        print(f"{rows} rows: " + ", ".join(f"{k} {ms[k][rows]:.2f} ms" for k in ms), flush=True)
    report = {
        "what": __doc__.split("\n\n")[0], "machine": machine_description(),
        "torch": torch.__version__, "amx_int8": amx, "threads": 1, "rounds": args.rounds,
        "projections_ms": ms,
        "float_path_over_row_tiles": {r: round(ms["float_path"][r] / ms["row_tiles"][r], 3) for r in ROWS},
        "int8_over_row_tiles": {r: round(ms["int8"][r] / ms["row_tiles"][r], 3) for r in ROWS},
    }
    finish(report, args.out, args.name)


if __name__ == "__main__":
    main()
