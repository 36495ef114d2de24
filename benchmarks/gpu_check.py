"""The serving half of the GPU check (run by benchmarks/gpu_check.sh, after the ``gpu`` tests).

1. build a random Llama from a fixed seed with ``transformers``' layout: 1B-class
   (hidden 2048, 16 layers, 32 heads, 8 KV heads, intermediate 8192; the embedded
   model's 1,024-token tokenizer, so ~0.98B parameters, bfloat16) or, with
   ``--dry-run``, a tiny one;
2. load it in-process and run one prefill and one decode step under the profiler:
   which attention kernel ran (profiler names), and which SDPA backend PyTorch's
   dispatcher picks for the inputs tpserve passes (``torch._fused_sdp_choice``);
3. serve the embedded default model, then the random Llama, through the real
   gRPC path (``tpserve serve`` subprocesses), and measure on each: decode
   ms/token of one streamed request, output tok/s of 64 requests at once, the
   KV cache the server sized (blocks, tokens), the decode graphs its rank
   captured, and the HBM roofline (weight bytes / 4.8 TB/s, the H200's
   bandwidth) next to the decode time; then the random Llama once more with
   ``--enforce-eager`` at batch 1, for what the CUDA graphs save per token;
4. the step's fixed cost: client TPOT of 64 concurrent streams on the
   random Llama (CUDA graphs on) over its bare ``ModelRunner.execute`` decode step at
   64 sequences, replayed from a graph captured in-process
   (benchmarks/step_overhead_bare.py): the overlap goal is at most 1.2x.

Prints one summary and writes it as JSON (``--out``). Exit code 1 when a stage
fails (the summary says which); the stages after it still run.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from tpserve.client import Client  # noqa: E402
from tpserve.embedded_model import default_model_dir  # noqa: E402

#: H200 HBM3e bandwidth, bytes/s (NVIDIA's datasheet: 4.8 TB/s).
HBM_BYTES_PER_S = 4.8e12
LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8)
LLAMA_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)
SEED = 0
PROMPT = "Once upon a time"
_GRAPHS_LOGGED = re.compile(r"decode graphs captured.*")
_ATTENTION_NAME = re.compile(r"attention|attn|flash|fmha|sdpa|cudnn", re.IGNORECASE)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny model, few tokens: checks the script itself")
    parser.add_argument("--out", type=Path, help="write the summary as JSON here")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--start-timeout", type=float, default=300.0, help="seconds a server may take to be SERVING")
    return parser.parse_args()


def environment() -> dict:
    info = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        nccl = torch.cuda.nccl.version()  # a tuple in recent PyTorch, an int in older ones
        info.update(cuda=torch.version.cuda, gpu=torch.cuda.get_device_name(0), num_gpus=torch.cuda.device_count(),
                    nccl=".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl),
                    gpu_memory_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1))
    return info


def build_random_llama(out_dir: Path, dims: dict, device: str) -> Path:
    """A Llama checkpoint with N(0, 0.02) weights (unit norms) from ``SEED``, bfloat16, the default tokenizer."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**dims, architectures=["LlamaForCausalLM"], vocab_size=1024, max_position_embeddings=2048,
                         rms_norm_eps=1e-5,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, dtype="bfloat16")
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in LlamaForCausalLM(config).named_parameters()}
    generator = torch.Generator(device=device).manual_seed(SEED)
    tensors = {}
    for name, shape in sorted(shapes.items()):
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            value = torch.randn(shape, generator=generator, device=device).mul_(0.02)
            tensors[name] = value.to(torch.bfloat16).cpu().contiguous()
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(out_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir() / name, out_dir / name)
    return out_dir


def weight_bytes(model_dir: Path, dtype: torch.dtype) -> int:
    """Bytes of every weight of a checkpoint in ``dtype`` (what one decode step reads at least once)."""
    from safetensors import safe_open

    element = torch.empty((), dtype=dtype).element_size()
    total = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                numel = 1
                for size in f.get_slice(name).get_shape():
                    numel *= size
                total += numel * element
    return total


def attention_probe(model_dir: Path, device: str) -> dict:
    """One prefill and one decode step in-process: attention kernels seen by the profiler, SDPA choice."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend

    from tpserve.step import NewSequence, SamplingParams, ScheduledChunk, StepPlan
    from worker.model_runner import ModelRunner
    from worker.parallel_state import ParallelContext

    dev = torch.device("cuda", 0) if device == "cuda" else torch.device(device)
    runner = ModelRunner(model_dir, ParallelContext.single(dev), torch.bfloat16, block_size=16)
    runner.init_kv_cache(64)
    choices: list[str] = []
    original = F.scaled_dot_product_attention

    def recording_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        try:
            backend = torch._fused_sdp_choice(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                              scale=scale, enable_gqa=enable_gqa)
            choices.append(f"{SDPBackend(backend).name} q={tuple(q.shape)} mask={attn_mask is not None}")
        except Exception as exc:  # noqa: BLE001 - a probe must not change what it measures
            choices.append(f"unknown ({type(exc).__name__})")
        return original(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                        enable_gqa=enable_gqa)

    greedy = SamplingParams(temperature=0.0)
    prefill = StepPlan(0, tuple(NewSequence(i, greedy) for i in range(4)),
                       tuple(ScheduledChunk(i, tuple(range(3, 35)), 0, (2 * i, 2 * i + 1)) for i in range(4)))
    decode = StepPlan(1, scheduled=tuple(ScheduledChunk(i, (5,), 32, (8 + i,)) for i in range(4)))
    activities = [torch.profiler.ProfilerActivity.CPU]
    if dev.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    F.scaled_dot_product_attention = recording_sdpa
    try:
        runner.execute(prefill)
        with torch.profiler.profile(activities=activities) as prof:
            runner.execute(decode)
    finally:
        F.scaled_dot_product_attention = original
    kernels = sorted({e.key for e in prof.key_averages() if _ATTENTION_NAME.search(e.key)})
    del runner
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return {"sdpa_backend_chosen": sorted(set(choices)) or ["SDPA not called"], "attention_ops_and_kernels": kernels}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_and_measure(name: str, model_dir: Path | None, dtype: str, device: str, args: argparse.Namespace,
                      log_dir: Path, extra_flags: tuple[str, ...] = (), throughput: bool = True) -> dict:
    """Start ``tpserve serve``, measure batch-1 decode and (``throughput``) 64-at-once throughput, stop it
    (exit 0 expected). Records the decode graphs the ranks captured, from their log."""
    port = _free_port()
    cmd = [sys.executable, "-m", "launch.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--device", device, "--dtype", dtype, "--tensor-parallel-size", "1", "--max-num-seqs", str(args.concurrency),
           *extra_flags]
    if model_dir is not None:
        cmd += ["--model", str(model_dir)]
    log_path = log_dir / f"serve-{name}.log"
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
    result: dict = {"log": str(log_path)}
    try:
        with Client(f"127.0.0.1:{port}") as client:
            started = time.monotonic()
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"tpserve serve exited with {proc.returncode} while starting; see {log_path}")
                try:
                    client.wait_ready(timeout_s=2.0)
                    break
                except TimeoutError:
                    if time.monotonic() - started > args.start_timeout:
                        raise
            result["start_seconds"] = round(time.monotonic() - started, 1)
            info = client.model_info()
            result.update(dtype=info.dtype, num_kv_blocks=info.num_kv_blocks,
                          kv_cache_tokens=info.num_kv_blocks * info.block_size, max_model_len=info.max_model_len)
            decode_tokens = 16 if args.dry_run else 256
            client.generate(PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True)  # warm-up
            result["decode_ms_per_token_batch1"] = _decode_ms_per_token(client, decode_tokens)
            if throughput:
                max_tokens = 8 if args.dry_run else 128
                result["output_tokens_per_s_concurrent"] = _throughput(client, args.concurrency, max_tokens)
                result["concurrency"] = args.concurrency
                result["tpot_ms_concurrent"] = _concurrent_tpot_ms(client, args.concurrency, max_tokens)
            captured = _GRAPHS_LOGGED.search(log_path.read_text())
            result["cuda_graphs"] = captured.group(0) if captured else "none captured"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            result["exit_code"] = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            result["exit_code"] = "killed after 60 s"
    return result


def _decode_ms_per_token(client: Client, num_tokens: int) -> float:
    """One greedy stream: (time of the last token - time of the first) / (tokens after the first)."""
    arrivals: list[tuple[float, int]] = []
    for chunk in client.generate_stream(PROMPT, max_tokens=num_tokens, temperature=0.0, ignore_eos=True):
        if chunk.token_ids:
            arrivals.append((time.perf_counter(), len(chunk.token_ids)))
    total = sum(n for _, n in arrivals)
    return round((arrivals[-1][0] - arrivals[0][0]) * 1e3 / max(1, total - arrivals[0][1]), 3)


def _throughput(client: Client, concurrency: int, max_tokens: int) -> float:
    """``concurrency`` seeded sampled requests at once; completion tokens per wall-clock second."""
    counts = [0] * concurrency
    errors: list[str] = []
    barrier = threading.Barrier(concurrency + 1)

    def one(i: int) -> None:
        barrier.wait()
        try:
            result = client.generate(f"{PROMPT} {i}", max_tokens=max_tokens, temperature=0.8, seed=i, ignore_eos=True)
            counts[i] = result.usage.completion_tokens
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(f"request {i}: {exc}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    if errors:
        raise RuntimeError(f"{len(errors)} of {concurrency} requests failed, first: {errors[0]}")
    return round(sum(counts) / elapsed, 1)


def _concurrent_tpot_ms(client: Client, concurrency: int, max_tokens: int) -> float:
    """``concurrency`` seeded streams at once; mean over streams of (last - first token time) / (tokens - 1)."""
    tpots: list[float] = []
    errors: list[str] = []

    def one(i: int) -> None:
        first = last = 0.0
        count = 0
        try:
            for chunk in client.generate_stream(f"{PROMPT} {i}", max_tokens=max_tokens, temperature=0.8, seed=i,
                                                ignore_eos=True):
                if chunk.token_ids:
                    last = time.perf_counter()
                    first, count = first or last, count + len(chunk.token_ids)
            tpots.append((last - first) / max(count - 1, 1))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(f"stream {i}: {exc}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} of {concurrency} streams failed, first: {errors[0]}")
    return round(sum(tpots) / len(tpots) * 1e3, 3)


def bare_step_ms(model_dir: Path, device: str, concurrency: int, dry_run: bool) -> dict:
    """The bare decode step at ``concurrency`` sequences, in-process, with a CUDA graph of that size on CUDA:
    the mean over the positions the concurrent TPOT load decodes at (its prompt, then its output tokens)."""
    from tokenizers import Tokenizer

    from benchmarks.step_overhead_bare import _measure
    from worker.parallel_state import ParallelContext

    prompt_len = len(Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(f"{PROMPT} 0").ids)
    ctx = ParallelContext.single(torch.device("cuda", 0) if device == "cuda" else device)
    seconds = _measure(ctx, str(model_dir), [concurrency], 7 if dry_run else 127,
                       dtype="float32" if dry_run else "bfloat16", cuda_graphs=device == "cuda", prompt_len=prompt_len)
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"bare_step_ms": round(seconds[str(concurrency)] * 1e3, 3), "sequences": concurrency,
            "cuda_graphs": device == "cuda"}


def _stage(report: dict, name: str, fn, *args) -> None:
    started = time.monotonic()
    try:
        report[name] = fn(*args)
    except Exception as exc:  # noqa: BLE001 - a failed stage is reported, the others still run
        report[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        report["failed"].append(name)
    print(f"[gpu_check] {name}: {time.monotonic() - started:.1f} s", flush=True)


def main() -> int:
    args = parse_args()
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device (use --dry-run on a CPU machine)", file=sys.stderr)
        return 2
    report: dict = {"dry_run": args.dry_run, "failed": [], "environment": environment()}
    with tempfile.TemporaryDirectory(prefix="tpserve-gpu-check-") as tmp:
        tmp_dir = Path(tmp)
        llama_dir = tmp_dir / ("llama-tiny-random" if args.dry_run else "llama-1b-random")
        _stage(report, "build_random_llama", lambda: str(
            build_random_llama(llama_dir, LLAMA_TINY if args.dry_run else LLAMA_1B, device)))
        if "build_random_llama" not in report["failed"]:
            _stage(report, "attention", attention_probe, llama_dir, device)
        default_dtype = "float32" if args.dry_run else "auto"
        _stage(report, "serve_default_model", serve_and_measure, "default", None, default_dtype, device, args, tmp_dir)
        if "build_random_llama" not in report["failed"]:
            _stage(report, f"serve_{llama_dir.name}", serve_and_measure, llama_dir.name, llama_dir,
                   "float32" if args.dry_run else "bfloat16", device, args, tmp_dir)
            # The same model without CUDA graphs, batch 1 only: what the graphs save per token.
            _stage(report, f"serve_{llama_dir.name}_eager", serve_and_measure, f"{llama_dir.name}-eager", llama_dir,
                   "float32" if args.dry_run else "bfloat16", device, args, tmp_dir, ("--enforce-eager",), False)
            # With async scheduling: step t+1 is planned before t's result (the ranks never wait on the loop).
            _stage(report, f"serve_{llama_dir.name}_async", serve_and_measure, f"{llama_dir.name}-async", llama_dir,
                   "float32" if args.dry_run else "bfloat16", device, args, tmp_dir, ("--async-scheduling",))
        for name, model_dir, dtype in (("serve_default_model", default_model_dir(), torch.float32),
                                       *((f"serve_{llama_dir.name}{suffix}", llama_dir,
                                          torch.float32 if args.dry_run else torch.bfloat16)
                                         for suffix in ("", "_eager", "_async"))):
            stage = report.get(name, {})
            if "decode_ms_per_token_batch1" in stage:
                stage["weight_bytes"] = weight_bytes(model_dir, dtype)
                stage["hbm_roofline_ms_per_token"] = round(stage["weight_bytes"] / HBM_BYTES_PER_S * 1e3, 4)
                stage["decode_over_roofline"] = round(
                    stage["decode_ms_per_token_batch1"] / stage["hbm_roofline_ms_per_token"], 1)
        if "build_random_llama" not in report["failed"]:
            _stage(report, "bare_step", bare_step_ms, llama_dir, device, args.concurrency, args.dry_run)
            served, bare = report.get(f"serve_{llama_dir.name}", {}), report.get("bare_step", {})
            if "tpot_ms_concurrent" in served and "bare_step_ms" in bare:
                report["step_overhead"] = dict(bare, tpot_ms=served["tpot_ms_concurrent"], tpot_over_bare_step=round(
                    served["tpot_ms_concurrent"] / bare["bare_step_ms"], 2), goal=1.2)
            served_async = report.get(f"serve_{llama_dir.name}_async", {})
            if "tpot_ms_concurrent" in served_async and "bare_step_ms" in bare:
                report["step_overhead_async"] = dict(bare, tpot_ms=served_async["tpot_ms_concurrent"],
                                                     tpot_over_bare_step=round(served_async["tpot_ms_concurrent"]
                                                                               / bare["bare_step_ms"], 2), goal=1.2)
        graphs, eager = report.get(f"serve_{llama_dir.name}", {}), report.get(f"serve_{llama_dir.name}_eager", {})
        if "decode_ms_per_token_batch1" in graphs and "decode_ms_per_token_batch1" in eager:
            report["eager_over_graphs_batch1"] = round(
                eager["decode_ms_per_token_batch1"] / graphs["decode_ms_per_token_batch1"], 2)
        for name, log_name in (("serve_default_model", "default"), (f"serve_{llama_dir.name}", llama_dir.name),
                               (f"serve_{llama_dir.name}_eager", f"{llama_dir.name}-eager"),
                               (f"serve_{llama_dir.name}_async", f"{llama_dir.name}-async")):
            stage = report.get(name)
            if isinstance(stage, dict) and ("error" in stage or stage.get("exit_code") != 0):
                if "error" not in stage:
                    stage["error"] = f"tpserve serve exited with {stage.get('exit_code')} on SIGTERM"
                    report["failed"].append(name)
                log = tmp_dir / f"serve-{log_name}.log"
                stage["log_tail"] = log.read_text()[-4000:] if log.exists() else "(no log)"
    _print_summary(report)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2, default=str))
    return 1 if report["failed"] else 0


def _print_summary(report: dict) -> None:
    print("\n=== gpu_check summary" + (" (DRY RUN: CPU, tiny model; numbers mean nothing)" if report["dry_run"] else ""))
    print(json.dumps(report["environment"]))
    attention = report.get("attention", {})
    if "error" not in attention:
        print(f"attention: SDPA backend {attention.get('sdpa_backend_chosen')}")
        print(f"attention ops/kernels that ran: {attention.get('attention_ops_and_kernels')}")
    for name, stage in report.items():
        if not name.startswith("serve_"):
            continue
        if "error" in stage:
            print(f"{name}: FAILED {stage['error']}")
            continue
        print(f"{name}: dtype {stage['dtype']}, KV cache {stage['num_kv_blocks']} blocks = {stage['kv_cache_tokens']} "
              f"tokens, start {stage['start_seconds']} s; decode {stage['decode_ms_per_token_batch1']} ms/token at "
              f"batch 1 (HBM roofline {stage.get('hbm_roofline_ms_per_token')} ms, "
              f"{stage.get('decode_over_roofline')}x); "
              + (f"{stage['output_tokens_per_s_concurrent']} output tok/s at {stage['concurrency']} at once; "
                 if "output_tokens_per_s_concurrent" in stage else "")
              + f"{stage['cuda_graphs']}; exit code {stage['exit_code']}")
    for key, label in (("step_overhead", ""), ("step_overhead_async", " (--async-scheduling)")):
        overhead = report.get(key)
        if overhead:
            print(f"step overhead{label}: client TPOT {overhead['tpot_ms']} ms at {overhead['sequences']} streams over "
                  f"the bare decode step {overhead['bare_step_ms']} ms = {overhead['tpot_over_bare_step']}x (goal <= "
                  f"1.2; CUDA graphs {'on' if overhead['cuda_graphs'] else 'off'})")
    if "eager_over_graphs_batch1" in report:
        print(f"CUDA graphs: eager decode / graph decode at batch 1 = {report['eager_over_graphs_batch1']}x")
    for name in report["failed"]:
        print(f"FAILED stage {name}: {report[name]['error']}")
        print(report[name].get("traceback", ""))
        if "log_tail" in report[name]:
            print(f"--- its server's log (tail)\n{report[name]['log_tail']}")


if __name__ == "__main__":
    sys.exit(main())
