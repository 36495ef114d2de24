"""Weight-only int8 against float32 (and bfloat16): decode speed on the 95M shape, and quality, in one run.

Speed, on the 94.9M-parameter random Llama of benchmarks/peer_comparison.py (its model
builder and workloads; float32 checkpoint), for each configuration (``--dtype``,
``--quantization``): float32, int8 (float32 activations), bfloat16, int8 with bfloat16
activations:

* the bare worker step (``ModelRunner.execute`` of a decode step alone, tp 1, context
  160, median of 20): ms at batch 1 and output tok/s at batch 16;
* served through ``tpserve serve`` at tp 1 (unless ``--skip-serving``): decode ms/token
  of one request (32 in / 128 out) and output tok/s of 16 at once (128 in / 128 out).

Quality, for the same configurations on the embedded model (tpserve/default_model):
held-out perplexity per token as training/evaluate.py defines it (each held-out
document ``<s> text </s>``, every token after ``<s>`` predicted from the document so far),
computed by tpserve's own forward pass (``ModelRunner`` with ``prompt_logprobs``), so the
int8 figure is that of the int8 kernels, not of a simulation.

Every figure is also given as a ratio to float32 of the same run. Usage:

    python benchmarks/quantization.py --out benchmarks/results        # the recorded run (a quiet machine)
    python benchmarks/quantization.py --tiny --skip-serving           # a quick check that it runs (~1 min)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.peer_comparison import MODEL_CONFIG, _load, bare_steps, build_model, workloads  # noqa: E402
from tests.e2e.cluster import serve  # noqa: E402
from tpserve.embedded_model import default_model_dir  # noqa: E402
from benchmarks.report import save_report  # noqa: E402

#: name -> (--dtype, --quantization)
CONFIGS: dict[str, tuple[str, str | None]] = {
    "float32": ("float32", None),
    "int8": ("float32", "int8"),
    "int4": ("float32", "int4"),
    "bfloat16": ("bfloat16", None),
    "int8_bfloat16": ("bfloat16", "int8"),
}
#: --tiny: a small model of the same family, for checking that the benchmark runs.
TINY_CONFIG = {**MODEL_CONFIG, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def cpu_has_native_bf16() -> bool:
    """Whether the CPU computes in bfloat16 natively (AVX512-BF16 or AMX); else bf16 is emulated and slow."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


# -- speed ----------------------------------------------------------------------------------


def speed(model_dir: Path, dtype: str, quantization: str | None, loads: dict, serving: bool, context: int) -> dict:
    """Bare step at batch 1 and 16, and (``serving``) the served single and batch-16 workloads, tp 1."""
    bare = bare_steps(model_dir, [1, 16], context=context, dtype=_DTYPES[dtype], quantization=quantization)
    report = {"bare_decode_ms_batch1": bare[1] * 1e3, "bare_output_tokens_per_s_batch16": 16 / bare[16]}
    if serving:
        flags = ["--dtype", dtype, *(["--quantization", quantization] if quantization else [])]
        with serve(model_dir, 1, *flags, omp_threads=None) as cluster:
            asyncio.run(_load(cluster.target, loads["warm_up"]))  # prompts of their own: none is then cached
            single = asyncio.run(_load(cluster.target, loads["single"]))
            batch16 = asyncio.run(_load(cluster.target, loads["batch16"]))
        report.update(served_decode_ms_per_token=single["tpot_median_ms"],
                      served_output_tokens_per_s_16=batch16["output_tokens_per_s"])
    return report


# -- quality ---------------------------------------------------------------------------------


def heldout_documents(model_dir: Path, max_docs: int | None) -> list[list[int]]:
    """The held-out documents of training/evaluate.py, as token ids ``<s> text </s>``."""
    from tokenizers import Tokenizer

    from training import corpus
    from training.evaluate import _settings, encode_docs

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    eos = json.loads((model_dir / "config.json").read_text())["eos_token_id"]
    n = _settings(model_dir)["n_heldout_docs"]
    return encode_docs(tok, corpus.generate(corpus.HELDOUT_SEED, n), eos)[:max_docs]


def perplexity(model_dir: Path, docs: list[list[int]], dtype: str, quantization: str | None,
               token_budget: int = 2048, block_size: int = 16) -> tuple[float, int]:
    """Held-out perplexity per token through ``ModelRunner`` (tp 1) and the number of scored tokens.

    Each document is one sequence prefilled whole with ``prompt_logprobs=0``; rank 0
    returns ``log p(token | tokens before)`` for every position after the first.
    """
    from tpserve.step import NewSequence, SamplingParams, ScheduledChunk, StepPlan
    from worker.model_runner import ModelRunner
    from worker.parallel_state import ParallelContext

    runner = ModelRunner(model_dir, ParallelContext.single(), _DTYPES[dtype], block_size, quantization=quantization)
    longest = max(len(d) for d in docs)
    blocks_per_doc = -(-longest // block_size)
    max_docs_per_step = max(1, token_budget // longest)
    runner.init_kv_cache(max_docs_per_step * blocks_per_doc)
    scoring = SamplingParams(temperature=0.0, prompt_logprobs=0)
    nll, count, step_id = 0.0, 0, 0
    for start in range(0, len(docs), max_docs_per_step):
        batch = docs[start:start + max_docs_per_step]
        new = tuple(NewSequence(i, scoring, num_prompt_tokens=len(d), prompt_token_ids=tuple(d))
                    for i, d in enumerate(batch))
        chunks = tuple(ScheduledChunk(i, tuple(d), 0, tuple(range(i * blocks_per_doc, (i + 1) * blocks_per_doc)))
                       for i, d in enumerate(batch))
        result = runner.execute(StepPlan(step_id, new, chunks))
        runner.execute(StepPlan(step_id + 1, finished_seq_ids=tuple(range(len(batch)))))
        step_id += 2
        for scored in result.prompt_logprobs:
            nll -= sum(scored.logprobs)
            count += len(scored.logprobs)
    expected = sum(len(d) - 1 for d in docs)
    if count != expected:
        raise RuntimeError(f"scored {count} tokens, expected {expected}")
    return math.exp(nll / count), count


# -- the report ------------------------------------------------------------------------------


def ratios(report: dict) -> dict:
    """Every figure of every configuration divided by float32's."""
    base = report["configs"]["float32"]
    return {name: {key: round(value / base[key], 3) for key, value in figures.items()
                   if isinstance(value, float) and base.get(key)}
            for name, figures in report["configs"].items() if name != "float32"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="directory for quantization.json")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model of the same family: checks the script")
    parser.add_argument("--skip-serving", action="store_true", help="bare steps and perplexity only")
    parser.add_argument("--configs", nargs="+", choices=tuple(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--max-docs", type=int, default=None, help="held-out documents scored (default: all)")
    args = parser.parse_args()
    if "float32" not in args.configs:
        parser.error("--configs needs float32, the baseline of every ratio")

    torch.set_num_threads(os.cpu_count() or 1)  # what a tp-1 rank takes
    shape = TINY_CONFIG if args.tiny else MODEL_CONFIG
    loads = workloads(args.seed)
    loads["warm_up"] = workloads(args.seed, variant=1)["batch16"][:4]
    if args.tiny:
        loads = {"single": [(p[:8], 8) for p, _ in loads["single"]],
                 "batch16": [(p[:16], 8) for p, _ in loads["batch16"]],
                 "warm_up": [(p[:16], 8) for p, _ in loads["warm_up"]]}
    embedded = default_model_dir()
    docs = heldout_documents(embedded, 20 if args.tiny and args.max_docs is None else args.max_docs)
    report: dict = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.processor() or 'cpu'}",
                    "torch": torch.__version__, "native_bf16": cpu_has_native_bf16(), "seed": args.seed,
                    "model": {**shape, "checkpoint_dtype": "float32"}, "configs": {}}
    with tempfile.TemporaryDirectory(prefix="tpserve-quant-") as tmp:
        model_dir = build_model(Path(tmp), args.seed, shape)
        for name in args.configs:
            dtype, quantization = CONFIGS[name]
            figures = speed(model_dir, dtype, quantization, loads, not args.skip_serving,
                            context=16 if args.tiny else 160)
            ppl, tokens = perplexity(embedded, docs, dtype, quantization)
            figures.update(heldout_perplexity=ppl)
            report["heldout_tokens"] = tokens
            report["configs"][name] = figures
            print(f"{name}: {json.dumps({k: round(v, 3) for k, v in figures.items()})}", flush=True)
    report["vs_float32"] = ratios(report)
    for name, rel in report["vs_float32"].items():
        print(f"{name} / float32: {rel}")
    if args.out:
        save_report(args.out, "quantization.json", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
