"""Decode tokens/s of a 16-expert MoE at tp 2: expert-parallel (``--enable-expert-parallel``) against tensor-parallel.

The model is a random Mixtral built by ``transformers`` from a fixed seed (hidden 256, 4
layers, 8 heads over 4 KV heads, 16 experts of intermediate 512, top-2, vocab 512, float32).
The real server (``tpserve serve``, tests/e2e/cluster.py's launcher) serves it at
``--tensor-parallel-size 2`` twice, without and with ``--enable-expert-parallel``: with the
split, each rank computes every routed expert at half width; with the flag, only the experts
it holds (8 of 16), at full width. Each serving gets the same greedy requests (16-token
prompts, ``--max-tokens`` output tokens, ``ignore_eos``):

* ``streams_1``: one request alone;
* ``streams_16``: 16 requests at once.

Decode tokens/s is the sum over the streams of ``1 / TPOT`` (TPOT: a stream's time between
its first and last token over its tokens less one), so prefill is left out. The two layouts
run in ``--rounds`` interleaved rounds (tensor-parallel, then expert-parallel, each a fresh
server), because this shared host's speed drifts; the report keeps every round and the
median ratio. The greedy tokens of the two layouts are compared too (the same in float32,
up to ties of nearly equal logits).

Usage:

    python benchmarks/expert_parallel.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402
import torch  # noqa: E402

from benchmarks.peer_comparison import _stream, machine_description  # noqa: E402
from benchmarks.report import save_report  # noqa: E402
from tests.e2e.cluster import serve  # noqa: E402  (the launcher the tests use)
from tpserve.embedded_model import default_model_dir  # noqa: E402
from tpserve.v1 import generate_pb2_grpc  # noqa: E402

MODEL_CONFIG = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                    num_key_value_heads=4, num_local_experts=16, num_experts_per_tok=2, vocab_size=512,
                    max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
PROMPT_TOKENS = 16
LAYOUTS = {"tensor_parallel": (), "expert_parallel": ("--enable-expert-parallel",)}


def build_model(directory: Path, seed: int) -> Path:
    """Save the seeded random Mixtral and the embedded model's tokenizer into ``directory``."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    MixtralForCausalLM(MixtralConfig(**MODEL_CONFIG)).float().eval().save_pretrained(directory,
                                                                                      safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir() / name, directory / name)
    return directory


def prompts(seed: int, count: int) -> list[list[int]]:
    """``count`` seeded prompts of :data:`PROMPT_TOKENS` token ids."""
    rng = random.Random(seed)
    return [[rng.randrange(3, MODEL_CONFIG["vocab_size"]) for _ in range(PROMPT_TOKENS)] for _ in range(count)]


async def decode_run(target: str, batch: list[list[int]], max_tokens: int) -> dict:
    """Stream ``batch`` at once; decode tokens/s (sum of 1 / TPOT), median TPOT, and each stream's tokens."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        await _stream(stub, batch[0][:8], 4)  # warm the connection
        results = await asyncio.gather(*(_stream(stub, p, max_tokens) for p in batch))
    return {"streams": len(batch), "decode_tokens_per_s": sum(1.0 / r["tpot"] for r in results),
            "tpot_median_ms": statistics.median(r["tpot"] for r in results) * 1e3,
            "token_ids": [r["token_ids"] for r in results]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds (each layout once per round)")
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    parser.add_argument("--threads", type=int, default=1, help="OMP threads of each rank")
    parser.add_argument("--out", type=Path, default=None, help="directory for expert_parallel.json")
    args = parser.parse_args()

    report: dict = {"machine": machine_description(), "torch": torch.__version__, "threads_per_rank": args.threads,
                    "tensor_parallel_size": 2, "seed": args.seed, "max_tokens": args.max_tokens,
                    "prompt_tokens": PROMPT_TOKENS, "load_average_before": os.getloadavg(),
                    "model": {**MODEL_CONFIG, "architecture": "MixtralForCausalLM", "dtype": "float32"},
                    "rounds": []}
    batch = prompts(args.seed, 16)
    tokens: dict[str, dict[int, list[list[int]]]] = {}
    with tempfile.TemporaryDirectory(prefix="tpserve-ep-") as tmp:
        model_dir = build_model(Path(tmp), args.seed)
        for i in range(args.rounds):
            row: dict = {}
            for layout, flags in LAYOUTS.items():
                with serve(model_dir, 2, *flags, omp_threads=args.threads) as server:
                    assert server.client.model_info().enable_expert_parallel == bool(flags)
                    asyncio.run(decode_run(server.target, batch[:2], 8))  # warm the ranks
                    runs = {n: asyncio.run(decode_run(server.target, batch[:n], args.max_tokens)) for n in (1, 16)}
                for n, run in runs.items():
                    tokens.setdefault(layout, {})[n] = run.pop("token_ids")
                row[layout] = {f"streams_{n}": run for n, run in runs.items()}
                print(f"round {i + 1} {layout}: " + ", ".join(
                    f"{n} streams {run['decode_tokens_per_s']:.1f} tok/s (TPOT {run['tpot_median_ms']:.1f} ms)"
                    for n, run in runs.items()), flush=True)
            row["ratio_ep_over_tp"] = {
                key: row["expert_parallel"][key]["decode_tokens_per_s"] / row["tensor_parallel"][key]["decode_tokens_per_s"]
                for key in ("streams_1", "streams_16")}
            report["rounds"].append(row)
    report["load_average_after"] = os.getloadavg()
    report["median_ratio_ep_over_tp"] = {key: statistics.median(r["ratio_ep_over_tp"][key] for r in report["rounds"])
                                         for key in ("streams_1", "streams_16")}
    report["same_tokens"] = {f"streams_{n}": sum(a == b for a, b in zip(tokens["expert_parallel"][n],
                                                                        tokens["tensor_parallel"][n], strict=True))
                             for n in (1, 16)}
    print(f"expert-parallel / tensor-parallel decode tok/s (median of {args.rounds} rounds): "
          f"{report['median_ratio_ep_over_tp']}; streams with identical tokens: {report['same_tokens']}")
    if args.out:
        save_report(args.out, "expert_parallel.json", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
