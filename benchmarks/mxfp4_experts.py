"""gpt-oss-style MXFP4 experts on the CPU: held as exact 8-bit codes (worker/layers/moe_mxfp4.py) against
dequantized to float32 at load (the path before), in one run.

One mixture-of-experts layer of random MXFP4 experts (``--experts`` of ``--hidden`` x ``--intermediate``,
e8m0 exponents drawn around 2^-6, written to a safetensors file and read back through
``worker.dequantize.Mxfp4Source`` as the loader reads them): the grouped experts
(``worker.layers.moe_experts.grouped_experts_torch``, SwiGLU) over ``--top-k`` routed experts per token, at 1 and
16 tokens a step (each token routed to distinct experts, the same routing for both), float32 activations, the
median of ``--rounds`` interleaved rounds of 50 calls each, wall clock, ``--threads`` threads. Reported: ms per
call for each and float32 / codes (> 1: the codes are faster), the experts' bytes, and the largest output
difference (the weights are equal; only the summation order differs).

    python benchmarks/mxfp4_experts.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from worker.dequantize import Mxfp4Source, OpenFiles, Packed  # noqa: E402
from worker.kernels import cpu_kernels_available  # noqa: E402
from worker.layers.moe_experts import grouped_experts_torch  # noqa: E402


def experts(path: Path, num: int, rows: int, columns: int, generator: torch.Generator) -> Mxfp4Source:
    """Random MXFP4 ``(num, rows, columns / 32, 16)`` blocks and scales, as one virtual ``(num, columns, rows)``."""
    blocks = torch.randint(0, 256, (num, rows, columns // 32, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(118, 124, (num, rows, columns // 32), dtype=torch.uint8, generator=generator)
    save_file({"w_blocks": blocks, "w_scales": scales}, path)
    return Mxfp4Source(Packed("w_blocks", path, "w_scales", path), OpenFiles())


def timed(fn, calls: int = 50) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=1024)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not cpu_kernels_available():
        raise SystemExit("the compiled CPU kernels are needed (linear_w8)")
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    e, h, i = args.experts, args.hidden, args.intermediate
    with tempfile.TemporaryDirectory() as tmp:
        gate_up_src = experts(Path(tmp) / "gate_up.safetensors", e, 2 * i, h, generator)  # virtual (E, H, 2I)
        down_src = experts(Path(tmp) / "down.safetensors", e, h, i, generator)  # virtual (E, I, H)
        float_gate_up = gate_up_src[:, :, :].transpose(1, 2).contiguous()  # (E, 2I, H)
        float_down = down_src[:, :, :].transpose(1, 2).contiguous()  # (E, H, I)
        q_gate_up, s_gate_up = gate_up_src.read_w8((0, e), (0, 2 * i), (0, h))
        q_down, s_down = down_src.read_w8((0, e), (0, h), (0, i))
    result: dict = {"machine": f"{platform.machine()}, {torch.get_num_threads()} threads", "torch": torch.__version__,
                    "shape": {"experts": e, "hidden": h, "intermediate": i, "top_k": args.top_k},
                    "bytes": {"float32": (float_gate_up.numel() + float_down.numel()) * 4,
                              "codes": sum(t.numel() * t.element_size()
                                           for t in (q_gate_up, s_gate_up, q_down, s_down))},
                    "ms_per_call": {}, "float32_over_codes": {}, "max_abs_diff": {}}
    for tokens in (1, 16):
        x = torch.randn(tokens, h, generator=generator)
        ids = torch.stack([torch.randperm(e, generator=generator)[:args.top_k] for _ in range(tokens)])  # (T, k)
        weights = torch.softmax(torch.randn(tokens, args.top_k, generator=generator), dim=-1)

        def run_float() -> torch.Tensor:
            return grouped_experts_torch(x, float_gate_up, float_down, ids, weights)

        def run_codes() -> torch.Tensor:
            return grouped_experts_torch(x, q_gate_up, q_down, ids, weights, gate_up_scale=s_gate_up,
                                         down_scale=s_down)

        result["max_abs_diff"][tokens] = float((run_float() - run_codes()).abs().max())
        rounds: dict[str, list[float]] = {"float32": [], "codes": []}
        for _ in range(args.rounds):
            rounds["float32"].append(timed(run_float))
            rounds["codes"].append(timed(run_codes))
        medians = {name: statistics.median(values) for name, values in rounds.items()}
        result["ms_per_call"][tokens] = {name: round(v, 4) for name, v in medians.items()}
        result["float32_over_codes"][tokens] = round(medians["float32"] / medians["codes"], 3)
        print(f"{tokens} token(s): float32 {medians['float32']:.3f} ms, codes {medians['codes']:.3f} ms, "
              f"{medians['float32'] / medians['codes']:.2f}x", flush=True)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        (args.out / "mxfp4_experts.json").write_text(text + "\n")


if __name__ == "__main__":
    main()
