"""tpserve against a plain ``transformers`` loop, and against the machine's memory roofline, in one run.

The model is a 94.9M-parameter random Llama (hidden 512, 30 layers, 8 heads, 4 KV
heads, intermediate 1536, vocab 512, float32) built by ``transformers`` from a fixed
seed, so every system serves the same weights. Every system gets the same requests
(prompts as token ids, greedy, ``ignore_eos``) on the same cores:

* ``single``: one request, 32 prompt tokens, 128 output tokens: decode ms/token;
* ``batch16``: 16 requests at once, 128 in / 128 out: output tokens/s;
* ``mixed``: 48 requests at once, prompt 16-256 and output 16-192 tokens (seeded):
  output tokens/s (``transformers`` runs static batches of 16 in arrival order,
  left-padded, each batch until its longest output; only requested tokens count).

Baselines measured in the same run:

* the memory roofline of one decode step: the weights' bytes over the machine's copy
  bandwidth (STREAM's convention: bytes read + bytes written by a 512 MiB copy);
* the bare worker step: ``ModelRunner.execute`` of a decode step timed alone in this
  process at batch 1 and 16, with the thread count a tp-1 rank gets.

It prints each ratio against the goals of the step-speed issue and writes the whole
report as JSON. Usage:

    python benchmarks/peer_comparison.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402
import torch  # noqa: E402

from tests.e2e.cluster import serve  # noqa: E402  (the launcher the tests use)
from tpserve.client import build_request  # noqa: E402
from tpserve.cluster import default_model_dir  # noqa: E402
from tpserve.v1 import generate_pb2_grpc  # noqa: E402

MODEL_CONFIG = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=8,
                    num_key_value_heads=4, vocab_size=512, max_position_embeddings=1024,
                    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
GOALS = {
    "decode_vs_roofline": 2.0,  # tp 1, batch 1: at most
    "server_overhead": 1.15,  # client TPOT / bare step: at most
    "tp2_vs_tp1_batch1": 1.1,  # decode ms/token: at most
    "tp2_vs_tp1_batch16": 0.9,  # throughput: at least
    "vs_transformers": 3.0,  # batch16 and mixed throughput: at least
}


# -- the workload --------------------------------------------------------------------------


def build_model(directory: Path, seed: int, config: dict | None = None) -> Path:
    """Save the seeded random model (and the embedded model's tokenizer, for detokenization).

    ``config``: ``LlamaConfig`` arguments; None: :data:`MODEL_CONFIG` (benchmarks/quantization.py
    passes a smaller shape for its quick check).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**(config or MODEL_CONFIG))).float().eval()
    model.save_pretrained(directory, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir() / name, directory / name)
    return directory


def workloads(seed: int) -> dict[str, list[tuple[list[int], int]]]:
    """Each workload's requests as (prompt token ids, output tokens), in arrival order."""
    rng = random.Random(seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, MODEL_CONFIG["vocab_size"]) for _ in range(n)]

    return {
        "single": [(prompt(32), 128)],
        "batch16": [(prompt(128), 128) for _ in range(16)],
        "mixed": [(prompt(rng.randint(16, 256)), rng.randint(16, 192)) for _ in range(48)],
    }


# -- baselines -----------------------------------------------------------------------------


def copy_bandwidth() -> float:
    """Bytes per second a 512 MiB tensor copy moves (read + write, STREAM's convention); best of 5."""
    src = torch.ones(128 * 1024**2)
    dst = torch.empty_like(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(5))
    return 2 * src.numel() * 4 / best


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bare_steps(model_dir: Path, batch_sizes: list[int], context: int, dtype: torch.dtype = torch.float32,
               quantization: str | None = None) -> dict[int, float]:
    """Seconds of one ``ModelRunner.execute`` decode step at each batch size (median of 20), tp 1."""
    from tpserve.step import NewSequence, SamplingParams, ScheduledChunk, StepPlan
    from worker.model_runner import ModelRunner
    from worker.parallel_state import ParallelContext

    runner = ModelRunner(model_dir, ParallelContext.single(), dtype, 16, quantization=quantization)
    blocks_per_seq = context // 16 + 4
    runner.init_kv_cache(max(batch_sizes) * blocks_per_seq)
    out: dict[int, float] = {}
    step_id = 0
    for batch in batch_sizes:
        seqs = range(batch)
        prefill = tuple(ScheduledChunk(s, tuple(range(3, 3 + context)), 0,
                                       tuple(range(s * blocks_per_seq, (s + 1) * blocks_per_seq))) for s in seqs)
        step_id += 1
        runner.execute(StepPlan(step_id, tuple(NewSequence(s, SamplingParams(temperature=0)) for s in seqs), prefill))
        times = []
        for i in range(24):
            step_id += 1
            plan = StepPlan(step_id, (), tuple(ScheduledChunk(s, (5,), context + i) for s in seqs))
            times.append(_timed(lambda: runner.execute(plan)))
        step_id += 1
        runner.execute(StepPlan(step_id, finished_seq_ids=tuple(seqs)))
        out[batch] = statistics.median(times[4:])
    return out


# -- transformers ---------------------------------------------------------------------------


def run_transformers(model_dir: Path, loads: dict) -> dict:
    """The same workloads through ``model.generate`` (greedy, static batches of at most 16)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def generate(batch: list[tuple[list[int], int]]) -> None:
        width = max(len(p) for p, _ in batch)
        new = max(n for _, n in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in batch])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=0)

    (prompt, n), = loads["single"]
    generate([(prompt, 1)])  # warm-up
    first = _timed(lambda: generate([(prompt, 1)]))
    full = _timed(lambda: generate([(prompt, n)]))
    report = {"single_decode_ms_per_token": (full - first) / (n - 1) * 1e3}
    for name in ("batch16", "mixed"):
        reqs = loads[name]
        wall = sum(_timed(lambda b=reqs[i:i + 16]: generate(b)) for i in range(0, len(reqs), 16))
        report[f"{name}_output_tokens_per_s"] = sum(n for _, n in reqs) / wall
    return report


# -- tpserve --------------------------------------------------------------------------------


async def _stream(stub, prompt: list[int], max_tokens: int) -> dict:
    start = time.perf_counter()
    stamps, tokens = [], 0
    request = build_request(prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True)
    async for chunk in stub.GenerateStream(request):
        if chunk.token_ids:
            stamps.append(time.perf_counter())
            tokens += len(chunk.token_ids)
    if tokens != max_tokens:
        raise RuntimeError(f"asked {max_tokens} tokens, got {tokens}")
    tpot = (stamps[-1] - stamps[0]) / (tokens - 1) if tokens > 1 else float("nan")
    return {"tokens": tokens, "ttft": stamps[0] - start, "tpot": tpot}


async def _load(target: str, reqs: list[tuple[list[int], int]]) -> dict:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        await _stream(stub, reqs[0][0][:8], 4)  # warm the connection
        start = time.perf_counter()
        results = await asyncio.gather(*(_stream(stub, p, n) for p, n in reqs))
        wall = time.perf_counter() - start
    return {"wall_s": wall, "output_tokens_per_s": sum(r["tokens"] for r in results) / wall,
            "tpot_median_ms": statistics.median(r["tpot"] for r in results) * 1e3,
            "ttft_median_ms": statistics.median(r["ttft"] for r in results) * 1e3}


def run_tpserve(model_dir: Path, tp: int, loads: dict) -> dict:
    report = {}
    with serve(model_dir, tp, omp_threads=None) as cluster:
        asyncio.run(_load(cluster.target, loads["batch16"][:4]))  # warm-up: first steps, allocations
        for name in ("single", "batch16", "mixed"):
            report[name] = asyncio.run(_load(cluster.target, loads[name]))
    report["single_decode_ms_per_token"] = report["single"]["tpot_median_ms"]
    for name in ("batch16", "mixed"):
        report[f"{name}_output_tokens_per_s"] = report[name]["output_tokens_per_s"]
    return report


# -- the report -----------------------------------------------------------------------------


def verdicts(r: dict) -> list[tuple[str, float, str, float, bool]]:
    """(what, measured ratio, comparison, goal, met) for each goal."""
    t1, t2, hf = r["tpserve_tp1"], r["tpserve_tp2"], r["transformers"]
    rows = [
        ("tp1 decode ms/token / roofline ms", t1["single_decode_ms_per_token"] / r["roofline_ms"], "<=",
         GOALS["decode_vs_roofline"]),
        ("tp1 client TPOT / bare step, batch 1", t1["single"]["tpot_median_ms"] / r["bare_step_ms"]["1"], "<=",
         GOALS["server_overhead"]),
        ("tp1 client TPOT / bare step, batch 16", t1["batch16"]["tpot_median_ms"] / r["bare_step_ms"]["16"], "<=",
         GOALS["server_overhead"]),
        ("tp2 / tp1 decode ms/token, batch 1", t2["single_decode_ms_per_token"] / t1["single_decode_ms_per_token"],
         "<=", GOALS["tp2_vs_tp1_batch1"]),
        ("tp2 / tp1 tok/s, 16 at once", t2["batch16_output_tokens_per_s"] / t1["batch16_output_tokens_per_s"], ">=",
         GOALS["tp2_vs_tp1_batch16"]),
    ]
    for name in ("batch16", "mixed"):
        for tp, rep in (("tp1", t1), ("tp2", t2)):
            rows.append((f"{tp} / transformers tok/s, {name}",
                         rep[f"{name}_output_tokens_per_s"] / hf[f"{name}_output_tokens_per_s"], ">=",
                         GOALS["vs_transformers"]))
    return [(what, ratio, op, goal, ratio <= goal if op == "<=" else ratio >= goal) for what, ratio, op, goal in rows]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="directory for peer_comparison.json")
    parser.add_argument("--skip-transformers", action="store_true", help="(debugging) leave out the baseline")
    args = parser.parse_args()

    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)  # what a tp-1 rank takes, and what transformers gets
    loads = workloads(args.seed)
    report: dict = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.processor() or 'cpu'}",
                    "torch": torch.__version__, "threads": threads, "seed": args.seed,
                    "model": {**MODEL_CONFIG, "dtype": "float32"}}
    with tempfile.TemporaryDirectory(prefix="tpserve-peer-") as tmp:
        model_dir = build_model(Path(tmp), args.seed)
        weight_bytes = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
        bandwidth = copy_bandwidth()
        report.update(weight_bytes=weight_bytes, copy_bandwidth_gb_s=bandwidth / 1e9,
                      roofline_ms=weight_bytes / bandwidth * 1e3)
        print(f"roofline: {weight_bytes / 1e6:.0f} MB at {bandwidth / 1e9:.1f} GB/s = {report['roofline_ms']:.1f} ms",
              flush=True)
        bare = bare_steps(model_dir, [1, 16], context=160)
        report["bare_step_ms"] = {str(b): s * 1e3 for b, s in bare.items()}
        print(f"bare step: {report['bare_step_ms']}", flush=True)
        if not args.skip_transformers:
            report["transformers"] = run_transformers(model_dir, loads)
            print(f"transformers: {report['transformers']}", flush=True)
        for tp in (1, 2):
            report[f"tpserve_tp{tp}"] = run_tpserve(model_dir, tp, loads)
            print(f"tpserve tp {tp}: {report[f'tpserve_tp{tp}']}", flush=True)
    if not args.skip_transformers:
        report["goals"] = [dict(what=w, ratio=round(x, 3), goal=f"{op} {g}", met=m) for w, x, op, g, m in verdicts(report)]
        for row in report["goals"]:
            print(f"{'MET ' if row['met'] else 'MISS'}  {row['what']}: {row['ratio']:.2f} (goal {row['goal']})")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "peer_comparison.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
