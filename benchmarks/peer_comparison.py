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
  process at batch 1 and 16, with the thread count a tp-1 rank gets: the mean of 127
  steps from 128 positions on, as a request of ``batch16`` decodes them (a client's TPOT
  is a mean over its tokens too, so occasional slow steps count in both).

Interleaved rounds: the machine's speed drifts (this VM's copy bandwidth moves between
14 and 25 GB/s from one minute to the next), so a ratio between numbers taken minutes
apart measures the drift. Both servers (tp 1 and tp 2) stay up for the whole run; each
of ``--rounds`` rounds measures the bandwidth, the bare step, transformers and both
servers on ``single`` and ``batch16`` back to back, and each goal's ratio is taken
within a round, then the median over rounds. ``mixed`` (minutes per system) runs once
at the end.

A second peer, llama.cpp's ``llama-server``, joins when ``--llama-server`` and
``--llama-gguf`` are given (benchmarks/llama_cpp/build.sh builds both): 2 threads, 16 slots,
continuous batching, otherwise its defaults (f16 KV cache). It is measured in every round
after tpserve and on ``mixed``, and before the rounds a check runs one request on transformers,
tpserve tp 1 and a second llama-server with an fp32 KV cache: the greedy token ids must be
identical, and llama.cpp's logprobs of them are compared with transformers' log-softmax.

It prints each ratio against the goals of the step-speed issue and writes the whole
report as JSON. Usage:

    python benchmarks/peer_comparison.py --out benchmarks/results
    python benchmarks/peer_comparison.py --llama-server PATH --llama-gguf PATH --out benchmarks/results
    python benchmarks/peer_comparison.py --quick --llama-server PATH --llama-gguf PATH   # ~3 minutes

``--quick``: one round, tp 1 only, transformers only in the check (tpserve against llama.cpp).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402
import torch  # noqa: E402

from tests.e2e.cluster import serve  # noqa: E402  (the launcher the tests use)
from tpserve.client import build_request  # noqa: E402
from tpserve.embedded_model import default_model_dir  # noqa: E402
from tpserve.v1 import generate_pb2_grpc  # noqa: E402
from benchmarks.report import save_report  # noqa: E402
from benchmarks.llama_cpp.server import LlamaServer  # noqa: E402

MODEL_CONFIG = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=8,
                    num_key_value_heads=4, vocab_size=512, max_position_embeddings=1024,
                    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
GOALS = {
    "decode_vs_roofline": 2.0,  # tp 1, batch 1: at most
    "server_overhead": 1.15,  # client TPOT / bare step: at most
    "tp2_vs_tp1_batch1": 1.1,  # decode ms/token: at most
    "tp2_vs_tp1_batch16": 0.9,  # throughput: at least
    "vs_transformers": 3.0,  # batch16 and mixed throughput: at least
    "vs_llama_cpp_single": 1.0,  # llama.cpp ms/token / tpserve tp 1 ms/token: at least
    "vs_llama_cpp_batch16": 1.2,  # tok/s: at least
    "vs_llama_cpp_mixed": 1.5,  # tok/s: at least
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


def workloads(seed: int, variant: int = 0) -> dict[str, list[tuple[list[int], int]]]:
    """Each workload's requests as (prompt token ids, output tokens), in arrival order.

    ``variant``: another draw of the same shapes (0: the recorded one). Each round of the
    benchmark and its warm-up get their own, so no prompt is ever served twice: a repeated
    prompt would be served from tpserve's prefix cache, and transformers has none.
    """
    rng = random.Random(seed if variant == 0 else f"{seed}/{variant}")

    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, MODEL_CONFIG["vocab_size"]) for _ in range(n)]

    return {
        "single": [(prompt(32), 128)],
        "batch16": [(prompt(128), 128) for _ in range(16)],
        "mixed": [(prompt(rng.randint(16, 256)), rng.randint(16, 192)) for _ in range(48)],
    }


# -- baselines -----------------------------------------------------------------------------


def interleaved_round(names: list[str], index: int, loads: dict[str, list[tuple[list[int], int]]],
                      run: Callable[[str, list[tuple[list[int], int]]], dict],
                      figures: tuple[str, ...] = ("single", "batch16")) -> dict[str, dict[str, dict]]:
    """Round ``index`` of an interleaved comparison: each of ``figures`` (a workload of ``loads``) on every system of
    ``names`` back to back, the order rotated by ``index`` so that no system always runs first (a host whose speed
    drifts slows every system of a round alike); ``run(name, requests)`` -> that system's figures."""
    order = names[index % len(names):] + names[:index % len(names)]
    result: dict[str, dict[str, dict]] = {name: {} for name in names}
    for figure in figures:
        for name in order:
            result[name][figure] = run(name, loads[figure])
    return result


def copy_bandwidth() -> float:
    """Bytes per second a 512 MiB tensor copy moves (read + write, STREAM's convention); best of 5."""
    src = torch.ones(128 * 1024**2)
    dst = torch.empty_like(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(5))
    return 2 * src.numel() * 4 / best


def _timed(fn, clock=time.perf_counter) -> float:
    start = clock()
    fn()
    return clock() - start


def bare_runner(model_dir: Path, dtype: torch.dtype = torch.float32, quantization: str | None = None):
    """A tp-1 ``ModelRunner`` in this process, for :func:`bare_steps`."""
    from worker.model_runner import ModelRunner
    from worker.parallel_state import ParallelContext

    return ModelRunner(model_dir, ParallelContext.single(), dtype, 16, quantization=quantization)


def bare_steps(model_dir: Path | object, batch_sizes: list[int], context: int, dtype: torch.dtype = torch.float32,
               quantization: str | None = None, steps: int = 20, mean: bool = False,
               clock=time.perf_counter) -> dict[int, float]:
    """Seconds of one ``ModelRunner.execute`` decode step at each batch size, tp 1.

    ``clock``: wall time by default; ``time.thread_time`` counts the step's CPU seconds on this
    thread only (one-thread runs on a host whose cores other work shares: the time spent waiting
    for a core is left out, a slower cache or memory is not).
    ``model_dir``: a checkpoint, or a runner from :func:`bare_runner` (reused between rounds).
    ``steps`` decode steps from ``context`` positions on, after 4 unmeasured ones; their median,
    or with ``mean`` their mean (the statistic of a client's TPOT: a request's decode time over
    its tokens).
    """
    from tpserve.step import NewSequence, SamplingParams, ScheduledChunk, StepPlan

    runner = model_dir if not isinstance(model_dir, Path) else bare_runner(model_dir, dtype, quantization)
    blocks_per_seq = (context + steps + 4) // 16 + 1
    if runner.num_blocks < max(batch_sizes) * blocks_per_seq:
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
        for i in range(steps + 4):
            step_id += 1
            plan = StepPlan(step_id, (), tuple(ScheduledChunk(s, (5,), context + i) for s in seqs))
            times.append(_timed(lambda: runner.execute(plan), clock))
        step_id += 1
        runner.execute(StepPlan(step_id, finished_seq_ids=tuple(seqs)))
        out[batch] = (statistics.fmean if mean else statistics.median)(times[4:])
    return out


# -- transformers ---------------------------------------------------------------------------


class Transformers:
    """The baseline: ``model.generate`` (greedy) in this process, static batches of at most 16."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def generate(self, batch: list[tuple[list[int], int]]) -> None:
        width = max(len(p) for p, _ in batch)
        new = max(n for _, n in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in batch])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
        with torch.inference_mode():
            self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                do_sample=False, pad_token_id=0)

    def greedy_reference(self, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
        """Greedy output token ids and each one's log-probability (log-softmax of the raw logits, float32)."""
        with torch.inference_mode():
            out = self.model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                                      do_sample=False, pad_token_id=0, output_logits=True,
                                      return_dict_in_generate=True)
        ids = out.sequences[0, len(prompt):].tolist()
        logprobs = [torch.log_softmax(logits[0].float(), -1)[i].item() for logits, i in zip(out.logits, ids)]
        return ids, logprobs

    def decode_ms_per_token(self, request: tuple[list[int], int]) -> float:
        """One request's decode time per token: a full run less a one-token run (its prefill)."""
        prompt, n = request
        first = _timed(lambda: self.generate([(prompt, 1)]))
        full = _timed(lambda: self.generate([(prompt, n)]))
        return (full - first) / (n - 1) * 1e3

    def output_tokens_per_s(self, reqs: list[tuple[list[int], int]]) -> float:
        """Requested output tokens over the wall time of static batches of 16 in arrival order."""
        wall = sum(_timed(lambda b=reqs[i:i + 16]: self.generate(b)) for i in range(0, len(reqs), 16))
        return sum(n for _, n in reqs) / wall


# -- tpserve --------------------------------------------------------------------------------


async def _stream(stub, prompt: list[int], max_tokens: int) -> dict:
    start = time.perf_counter()
    stamps, ids = [], []
    request = build_request(prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True)
    async for chunk in stub.GenerateStream(request):
        if chunk.token_ids:
            stamps.append(time.perf_counter())
            ids += chunk.token_ids
    tokens = len(ids)
    if tokens != max_tokens:
        raise RuntimeError(f"asked {max_tokens} tokens, got {tokens}")
    tpot = (stamps[-1] - stamps[0]) / (tokens - 1) if tokens > 1 else float("nan")
    return {"tokens": tokens, "token_ids": ids, "ttft": stamps[0] - start, "tpot": tpot}


async def _one(target: str, prompt: list[int], max_tokens: int) -> dict:
    async with grpc.aio.insecure_channel(target) as channel:
        return await _stream(generate_pb2_grpc.GenerationStub(channel), prompt, max_tokens)


def check_llama_cpp(args, hf: Transformers, target: str, request: tuple[list[int], int]) -> dict:
    """transformers, tpserve tp 1 and llama.cpp (fp32 KV cache) on one greedy request.

    Returns whether the three token sequences are identical and the largest |llama.cpp logprob -
    transformers logprob| over the output tokens.
    """
    prompt, n = request
    ref_ids, ref_logprobs = hf.greedy_reference(prompt, n)
    ours = asyncio.run(_one(target, prompt, n))["token_ids"]
    with LlamaServer(args.llama_server, args.llama_gguf, threads=args.llama_threads, kv_f32=True) as server:
        answer = server.complete(prompt, n, n_probs=1)
    theirs = answer["tokens"]
    probs = answer["completion_probabilities"]
    diffs = [abs(p["logprob"] - r) for p, r in zip(probs, ref_logprobs)] if theirs == ref_ids else []
    return {"output_tokens": n, "tpserve_equals_transformers": ours == ref_ids,
            "llama_cpp_equals_transformers": theirs == ref_ids,
            "first_difference": next((i for i, (a, b, c) in enumerate(zip(ref_ids, ours, theirs)) if not a == b == c),
                                     None),
            "llama_cpp_max_abs_logprob_diff": max(diffs) if diffs else None}


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


# -- the report -----------------------------------------------------------------------------


def round_ratios(r: dict) -> list[tuple[str, float, str, float]]:
    """(what, ratio, comparison, goal) for each goal measured within one round (of the systems it ran)."""
    t1 = r["tpserve_tp1"]
    t1_single, t1_b16 = t1["single"]["tpot_median_ms"], t1["batch16"]["output_tokens_per_s"]
    rows = [
        ("tp1 decode ms/token / roofline ms", t1_single / r["roofline_ms"], "<=", GOALS["decode_vs_roofline"]),
        ("tp1 client TPOT / bare step, batch 1", t1_single / r["bare_step_ms"]["1"], "<=",
         GOALS["server_overhead"]),
        ("tp1 client TPOT / bare step, batch 16", t1["batch16"]["tpot_median_ms"] / r["bare_step_ms"]["16"], "<=",
         GOALS["server_overhead"]),
    ]
    if "tpserve_tp2" in r:
        t2 = r["tpserve_tp2"]
        rows += [("tp2 / tp1 decode ms/token, batch 1", t2["single"]["tpot_median_ms"] / t1_single, "<=",
                  GOALS["tp2_vs_tp1_batch1"]),
                 ("tp2 / tp1 tok/s, 16 at once", t2["batch16"]["output_tokens_per_s"] / t1_b16, ">=",
                  GOALS["tp2_vs_tp1_batch16"])]
    if "transformers" in r:
        hf = r["transformers"]["batch16_output_tokens_per_s"]
        rows.append(("tp1 / transformers tok/s, batch16", t1_b16 / hf, ">=", GOALS["vs_transformers"]))
        if "tpserve_tp2" in r:
            rows.append(("tp2 / transformers tok/s, batch16", r["tpserve_tp2"]["batch16"]["output_tokens_per_s"] / hf,
                         ">=", GOALS["vs_transformers"]))
    if "llama_cpp" in r:
        lc = r["llama_cpp"]
        rows += [("tp1 / llama.cpp decode speed, batch 1 (their ms / ours)",
                  lc["single"]["tpot_median_ms"] / t1_single, ">=", GOALS["vs_llama_cpp_single"]),
                 ("tp1 / llama.cpp tok/s, 16 at once", t1_b16 / lc["batch16"]["output_tokens_per_s"], ">=",
                  GOALS["vs_llama_cpp_batch16"])]
    return rows


def verdicts(report: dict) -> list[dict]:
    """Each goal: the median of its per-round ratios (and each round's), or the mixed run's ratio; met or not."""
    rows = []
    per_round = [round_ratios(r) for r in report["rounds"]]
    for i, (what, _, op, goal) in enumerate(per_round[0]):
        values = [rr[i][1] for rr in per_round]
        rows.append((what, statistics.median(values), op, goal, values))
    mixed = report["mixed"]
    for tp in ("tp1", "tp2"):
        if f"tpserve_{tp}" in mixed and "transformers" in mixed:
            rows.append((f"{tp} / transformers tok/s, mixed",
                         mixed[f"tpserve_{tp}"]["output_tokens_per_s"] / mixed["transformers"], ">=",
                         GOALS["vs_transformers"], None))
    if "llama_cpp" in mixed:
        rows.append(("tp1 / llama.cpp tok/s, mixed",
                     mixed["tpserve_tp1"]["output_tokens_per_s"] / mixed["llama_cpp"]["output_tokens_per_s"], ">=",
                     GOALS["vs_llama_cpp_mixed"], None))
    return [dict(what=what, ratio=round(x, 3), goal=f"{op} {goal}", met=x <= goal if op == "<=" else x >= goal,
                 **({"rounds": [round(v, 3) for v in values]} if values else {}))
            for what, x, op, goal, values in rows]


def measure_round(model_dir_bytes: int, runner, hf: Transformers | None, targets: dict[int, str], loads: dict,
                  llama: LlamaServer | None = None) -> dict:
    """One round: the machine's baselines, then every system on the single and batch16 workloads.

    ``loads``: this round's own requests (:func:`workloads` with the round's variant). ``hf``
    None: transformers is not timed (``--quick``); ``llama``: llama.cpp is, after tpserve.
    """
    bandwidth = copy_bandwidth()
    r: dict = {"copy_bandwidth_gb_s": bandwidth / 1e9, "roofline_ms": model_dir_bytes / bandwidth * 1e3}
    # As many steps as a request decodes, from a context like batch16's, averaged like a client's TPOT.
    bare = bare_steps(runner, [1, 16], context=128, steps=127, mean=True)
    r["bare_step_ms"] = {str(b): t * 1e3 for b, t in bare.items()}
    if hf is not None:
        r["transformers"] = {"single_decode_ms_per_token": hf.decode_ms_per_token(loads["single"][0]),
                             "batch16_output_tokens_per_s": hf.output_tokens_per_s(loads["batch16"])}
    for tp, target in targets.items():
        r[f"tpserve_tp{tp}"] = {name: asyncio.run(_load(target, loads[name])) for name in ("single", "batch16")}
    if llama is not None:
        r["llama_cpp"] = {name: llama.load(loads[name]) for name in ("single", "batch16")}
    return r


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=None,
                        help="interleaved rounds of the single and batch16 runs (default 3; --quick: 1)")
    parser.add_argument("--out", type=Path, default=None, help="directory for the JSON report")
    parser.add_argument("--name", default="peer_comparison.json", help="the report's file name in --out")
    parser.add_argument("--llama-server", type=Path, default=None,
                        help="llama.cpp's llama-server binary (benchmarks/llama_cpp/build.sh): adds llama.cpp")
    parser.add_argument("--llama-gguf", type=Path, default=None,
                        help="the benchmark model as a float32 GGUF (benchmarks/llama_cpp/build.sh)")
    parser.add_argument("--llama-threads", type=int, default=None, help="llama-server -t/-tb (default: all cores)")
    parser.add_argument("--serve-args", default="",
                        help="extra `tpserve serve` flags for every tpserve server, e.g. \"--async-scheduling\"")
    parser.add_argument("--quick", action="store_true",
                        help="one round, tp 1 only, transformers only in the llama.cpp check")
    args = parser.parse_args()
    if (args.llama_server is None) != (args.llama_gguf is None):
        parser.error("--llama-server and --llama-gguf go together")
    rounds = args.rounds or (1 if args.quick else 3)

    threads = os.cpu_count() or 1
    args.llama_threads = args.llama_threads or threads
    torch.set_num_threads(threads)  # what a tp-1 rank takes, and what transformers gets
    loads = workloads(args.seed)
    report: dict = {"machine": machine_description(), "torch": torch.__version__, "threads": threads,
                    "seed": args.seed, "model": {**MODEL_CONFIG, "dtype": "float32"}, "rounds": [],
                    "quick": args.quick}
    with contextlib.ExitStack() as stack:
        model_dir = build_model(Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tpserve-peer-"))),
                                args.seed)
        extra = tuple(args.serve_args.split())
        report["serve_args"] = list(extra)
        targets = {1: stack.enter_context(serve(model_dir, 1, *extra, omp_threads=None)).target}
        if not args.quick:
            targets[2] = stack.enter_context(serve(model_dir, 2, *extra, omp_threads=None)).target
        report["weight_bytes"] = weight_bytes = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
        warm_up = workloads(args.seed, variant=rounds + 1)["batch16"][:4]
        for target in targets.values():  # first steps, allocations, connections
            asyncio.run(_load(target, warm_up))
        hf, runner = Transformers(model_dir), bare_runner(model_dir)
        llama = None
        if args.llama_server is not None:
            report["llama_cpp_check"] = check = check_llama_cpp(args, hf, targets[1], loads["single"][0])
            print(f"llama.cpp check: {check}", flush=True)
            llama = stack.enter_context(LlamaServer(args.llama_server, args.llama_gguf, threads=args.llama_threads))
            report["llama_cpp_server"] = {"args": llama.args[1:], "binary": str(args.llama_server)}
            llama.load(warm_up)
        for i in range(rounds):
            r = measure_round(weight_bytes, runner, None if args.quick else hf, targets,
                              workloads(args.seed, variant=i + 1), llama)
            report["rounds"].append(r)
            print(f"round {i + 1}: " + "; ".join(f"{w} {x:.2f}" for w, x, _, _ in round_ratios(r)), flush=True)
        report["mixed"] = {f"tpserve_tp{tp}": asyncio.run(_load(t, loads["mixed"])) for tp, t in targets.items()}
        if llama is not None:
            report["mixed"]["llama_cpp"] = llama.load(loads["mixed"])
        if not args.quick:
            report["mixed"]["transformers"] = hf.output_tokens_per_s(loads["mixed"])
    report["goals"] = verdicts(report)
    for row in report["goals"]:
        print(f"{'MET ' if row['met'] else 'MISS'}  {row['what']}: {row['ratio']:.2f} (goal {row['goal']})"
              + (f"  rounds {row['rounds']}" if "rounds" in row else ""))
    if args.out:
        save_report(args.out, args.name, report)
    return 0


def machine_description() -> str:
    """Architecture, cores, CPU model and its widest vector ISA as torch sees it."""
    model = "cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{platform.machine()}, {os.cpu_count()} cores, {model}, {torch.backends.cpu.get_cpu_capability()}"


if __name__ == "__main__":
    sys.exit(main())
