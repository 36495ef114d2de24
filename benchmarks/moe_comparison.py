"""tpserve against a plain ``transformers`` loop on a mixture-of-experts model, in one run.

The model is a random Mixtral of about 100M parameters in all (hidden 512, 7 layers, 8 heads,
4 KV heads, 8 experts of intermediate 1024, top-2, vocab 512, float32: 94.9M, of which 26.9M
are active per token) built by ``transformers`` from a fixed seed, so both systems serve the
same weights. Both get the same requests (prompts as token ids, greedy, ``ignore_eos``) on the
same cores, with benchmarks/peer_comparison.py's workloads and conventions:

* ``batch16``: 16 requests at once, 128 in / 128 out: output tokens/s;
* ``mixed``: 48 requests at once, prompt 16-256 and output 16-192 tokens (seeded): output
  tokens/s (``transformers`` runs static batches of 16 in arrival order, left-padded).

Both systems get ``--threads`` threads (default 1: the server's one rank and ``transformers``
alike). On this shared 2-core host a 2-thread run measures the neighbours more than the code:
whenever another process is busy, 2-thread OpenMP regions stall at their barriers, and a decode
step of 16 took transformers 411 ms at 2 threads against 75 ms at 1 in one probe (1.5-2.3 s
against 50-90 ms in another), and the tpserve rank's TPOT went from 32-37 ms to 340-380 ms
between two runs (benchmarks/README.md).

The machine's speed drifts, so ``batch16`` runs in ``--rounds`` interleaved rounds (tpserve,
then transformers, each round with prompts of its own) and its ratio is the median of the
within-round ratios; ``mixed`` runs once at the end. The server stays up for the whole run;
at the end its ``tpserve:moe_expert_tokens`` counters are read back: every layer routes the
same tokens, so each layer's sum over its experts must be the same even number (tokens x 2;
the tokens computed, which leaves out prompt tokens found in the prefix cache).

Usage:

    python benchmarks/moe_comparison.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import urllib.request
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.peer_comparison import Transformers, _load, machine_description, workloads  # noqa: E402
from benchmarks.report import save_report  # noqa: E402
from tests.e2e.cluster import serve  # noqa: E402  (the launcher the tests use)
from tpserve.embedded_model import default_model_dir  # noqa: E402

MODEL_CONFIG = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=7, num_attention_heads=8,
                    num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2, vocab_size=512,
                    max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
GOAL_VS_TRANSFORMERS = 2.0  # output tokens/s, batch16 and mixed: at least


def build_model(directory: Path, seed: int) -> tuple[Path, int, int]:
    """Save the seeded random Mixtral (and the embedded model's tokenizer); returns it, total and active parameters."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    model = MixtralForCausalLM(MixtralConfig(**MODEL_CONFIG)).float().eval()
    model.save_pretrained(directory, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir() / name, directory / name)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active = total - experts + experts * MODEL_CONFIG["num_experts_per_tok"] // MODEL_CONFIG["num_local_experts"]
    return directory, total, active


def expert_token_totals(metrics_port: int) -> dict[int, float]:
    """Per layer, the sum of ``tpserve:moe_expert_tokens_total`` over its experts, from /metrics."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    totals: dict[int, float] = defaultdict(float)
    for line in body.splitlines():
        if line.startswith("tpserve:moe_expert_tokens_total{"):
            labels, value = line.rsplit(" ", 1)
            layer = int(labels.split('layer="', 1)[1].split('"', 1)[0])
            totals[layer] += float(value)
    return dict(totals)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds of the batch16 runs")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree of the server")
    parser.add_argument("--threads", type=int, default=1, help="threads of the server's rank and of transformers")
    parser.add_argument("--out", type=Path, default=None, help="directory for moe_comparison.json")
    args = parser.parse_args()

    threads = args.threads
    torch.set_num_threads(threads)  # transformers'; the server's rank gets OMP_NUM_THREADS=threads
    loads = workloads(args.seed)
    report: dict = {"machine": machine_description(), "torch": torch.__version__, "threads": threads,
                    "seed": args.seed, "tensor_parallel_size": args.tp, "load_average_before": os.getloadavg(),
                    "model": {**MODEL_CONFIG, "architecture": "MixtralForCausalLM", "dtype": "float32"},
                    "rounds": []}
    with tempfile.TemporaryDirectory(prefix="tpserve-moe-") as tmp:
        model_dir, total, active = build_model(Path(tmp), args.seed)
        report["model"].update(total_parameters=total, active_parameters=active)
        with serve(model_dir, args.tp, omp_threads=threads) as server:
            asyncio.run(_load(server.target, workloads(args.seed, variant=args.rounds + 1)["batch16"][:4]))  # warm
            hf = Transformers(model_dir)
            for i in range(args.rounds):
                batch = workloads(args.seed, variant=i + 1)["batch16"]
                ours = asyncio.run(_load(server.target, batch))
                theirs = hf.output_tokens_per_s(batch)
                report["rounds"].append({"tpserve": ours, "transformers_output_tokens_per_s": theirs,
                                         "ratio": ours["output_tokens_per_s"] / theirs})
                print(f"round {i + 1}: batch16 tpserve {ours['output_tokens_per_s']:.1f} tok/s, "
                      f"transformers {theirs:.1f} tok/s", flush=True)
            ours = asyncio.run(_load(server.target, loads["mixed"]))
            theirs = hf.output_tokens_per_s(loads["mixed"])
            report["mixed"] = {"tpserve": ours, "transformers_output_tokens_per_s": theirs,
                               "ratio": ours["output_tokens_per_s"] / theirs}
            report["expert_tokens_per_layer"] = expert_token_totals(server.metrics_port)
    report["load_average_after"] = os.getloadavg()
    batch16 = statistics.median(r["ratio"] for r in report["rounds"])
    report["goals"] = [
        {"what": "tpserve / transformers tok/s, batch16", "ratio": round(batch16, 3),
         "rounds": [round(r["ratio"], 3) for r in report["rounds"]], "goal": f">= {GOAL_VS_TRANSFORMERS}",
         "met": batch16 >= GOAL_VS_TRANSFORMERS},
        {"what": "tpserve / transformers tok/s, mixed", "ratio": round(report["mixed"]["ratio"], 3),
         "goal": f">= {GOAL_VS_TRANSFORMERS}", "met": report["mixed"]["ratio"] >= GOAL_VS_TRANSFORMERS},
    ]
    for row in report["goals"]:
        print(f"{'MET ' if row['met'] else 'MISS'}  {row['what']}: {row['ratio']:.2f} (goal {row['goal']})")
    per_layer = set(report["expert_tokens_per_layer"].values())
    report["expert_tokens_consistent"] = len(per_layer) == 1 and len(report["expert_tokens_per_layer"]) == \
        MODEL_CONFIG["num_hidden_layers"] and next(iter(per_layer)) % 2 == 0
    print(f"expert tokens per layer (a sum over its 8 experts; tokens x 2): {sorted(per_layer)}, "
          f"consistent: {report['expert_tokens_consistent']}")
    if args.out:
        save_report(args.out, "moe_comparison.json", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
