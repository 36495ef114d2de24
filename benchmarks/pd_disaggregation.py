"""Prefill/decode disaggregation: what a KV transfer costs against recomputing the prompt, and decode
TPOT while long prompts arrive, co-located against disaggregated (issue 45; docs/design/cluster.md,
"Prefill/decode disaggregation").

The model is stories260k's weights under a config that allows 2,048 positions (its RoPE layers run
at any position; the text past 512 tokens is meaningless, the work is real), so that 1,500-token
prompts exist. Ranks run one thread each (``OMP_NUM_THREADS=1``).

1. ``transfer``: one prefill (``kv_producer``) and one decode (``kv_consumer``) replica, engine
   protocol direct. Per prompt length, fresh prompts of random words: the decode replica's time to
   its first token when it recomputes the prompt (no kv_transfer_params) against when it pulls
   the blocks (the prefill replica's hand-off first, not timed), and the pull's own figures from
   its metrics: blocks, bytes, ``tpserve:kv_transfer_seconds``, per transport.
2. ``tpot``: 16 greedy streams of 384 tokens (short prompts) while a 1,500-token prompt arrives every
   0.25 s (8 tokens each, sent whether the earlier ones finished or not), through ``smg`` over two co-located replicas (``round_robin``) against
   ``smg --pd-disaggregation`` over one prefill and one decode replica. TPOT is each stream's
   (last - first token) / (tokens - 1); ITL each gap. On a 2-core host every process shares the
   cores, so this records the mechanism, not a speed-up (benchmarks/gpu_check.sh runs it on a GPU).

    python benchmarks/pd_disaggregation.py --out benchmarks/results   (about 4 minutes)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import grpc
import openai
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from coordinator.tokenizer import Tokenizer  # noqa: E402
from tests.e2e.cluster import RunningCluster, serve  # noqa: E402
from tests.e2e.gateway import run_gateway, run_pd_gateway  # noqa: E402
from tests.e2e.pd import labelled, serve_role  # noqa: E402
from tests.paths import STORIES_DIR  # noqa: E402

WORDS = ("cat", "dog", "sun", "big", "red", "ran", "happy", "tree", "ball", "girl", "boy", "park", "blue", "jump",
         "play", "fish", "bird", "cake", "home", "rain", "moon", "star", "toy", "car", "hat", "box", "mom", "dad")
MAX_MODEL_LEN = 2048
LENGTHS = (128, 512, 1500)
STREAMS, STREAM_TOKENS, LONG_TOKENS, LONG_EVERY_S = 16, 384, 1500, 0.25


def long_context_model(into: Path) -> Path:
    """stories260k's files, its config allowing :data:`MAX_MODEL_LEN` positions."""
    into.mkdir(parents=True, exist_ok=True)
    for path in STORIES_DIR.iterdir():
        if path.name != "config.json":
            (into / path.name).symlink_to(path)
    config = json.loads((STORIES_DIR / "config.json").read_text())
    (into / "config.json").write_text(json.dumps({**config, "max_position_embeddings": MAX_MODEL_LEN}))
    return into


def prompt_ids(rng: random.Random, length: int) -> list[int]:
    """``length`` token ids that start with the BOS and share no first block with another call's."""
    return [1] + [rng.randrange(3, 500) for _ in range(length - 1)]


def first_token_s(replica: RunningCluster, ids: list[int], kv: str | None = None, max_tokens: int = 1) -> tuple[float, str]:
    """Seconds from sending a Generate to its first token, and the final kv_transfer_params_json."""
    request = vpb.GenerateRequest(request_id=f"b{time.monotonic_ns()}", tokenized=vpb.TokenizedInput(input_ids=ids),
                                  sampling_params=vpb.SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                     ignore_eos=True), stream=True)
    if kv is not None:
        request.kv_transfer_params_json = kv
    with grpc.insecure_channel(replica.target) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        started, first, last = time.perf_counter(), None, None
        for response in stub.Generate(request, timeout=120):
            first = first or time.perf_counter()
            last = response
    return first - started, last.complete.kv_transfer_params_json


def transfer_costs(prefill: RunningCluster, decode: RunningCluster, repeats: int, rng: random.Random) -> list[dict]:
    rows = []
    for length in LENGTHS:
        recompute, pulled, pull_s, blocks, nbytes = [], [], [], [], []
        for _ in range(repeats):
            recompute.append(first_token_s(decode, prompt_ids(rng, length))[0])
            ids = prompt_ids(rng, length)
            _, kv = first_token_s(prefill, ids, json.dumps({"do_remote_decode": True}))
            before = [labelled(decode, name, **labels) for name, labels in (
                ("tpserve:kv_transfer_seconds_sum", {"transport": "tcp"}),
                ("tpserve:kv_transfer_blocks_total", {"direction": "received", "transport": "tcp"}),
                ("tpserve:kv_transfer_bytes_total", {"direction": "received", "transport": "tcp"}))]
            pulled.append(first_token_s(decode, ids, kv)[0])
            after = [labelled(decode, name, **labels) for name, labels in (
                ("tpserve:kv_transfer_seconds_sum", {"transport": "tcp"}),
                ("tpserve:kv_transfer_blocks_total", {"direction": "received", "transport": "tcp"}),
                ("tpserve:kv_transfer_bytes_total", {"direction": "received", "transport": "tcp"}))]
            pull_s.append(after[0] - before[0])
            blocks.append(after[1] - before[1])
            nbytes.append(after[2] - before[2])
        row = {"prompt_tokens": length, "transport": "tcp", "blocks": statistics.median(blocks),
               "bytes": statistics.median(nbytes),
               "recompute_ttft_ms": 1000 * statistics.median(recompute),
               "transfer_ttft_ms": 1000 * statistics.median(pulled),
               "pull_ms": 1000 * statistics.median(pull_s),
               "pull_ms_per_block": 1000 * statistics.median(pull_s) / max(statistics.median(blocks), 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def text_of(tokenizer: Tokenizer, rng: random.Random, num_tokens: int) -> str:
    """Random words that encode to at most ``num_tokens`` tokens, as many as fit (the gateway takes text only)."""
    words = [rng.choice(WORDS) for _ in range(num_tokens)]
    low, high = 1, len(words)  # the longest prefix of words that fits
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if len(tokenizer.encode(" ".join(words[:mid]))) <= num_tokens else (low, mid - 1)
    return " ".join(words[:low])


def decode_under_long_prompts(base_url: str, model: str, tokenizer: Tokenizer, rng: random.Random) -> dict:
    """16 streams' TPOT and ITL while :data:`LONG_TOKENS`-token prompts arrive every :data:`LONG_EVERY_S`."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300)
    stop = threading.Event()
    shorts = [text_of(tokenizer, rng, 24) for _ in range(STREAMS)]
    longs = [text_of(tokenizer, rng, LONG_TOKENS) for _ in range(64)]

    def stream(i: int) -> list[float]:
        times = []
        out = client.completions.create(model=model, prompt=shorts[i], max_tokens=STREAM_TOKENS,
                                        temperature=0, stream=True, extra_body={"ignore_eos": True})
        for chunk in out:
            if chunk.choices and chunk.choices[0].text:
                times.append(time.perf_counter())
        return times

    def long_prompt(i: int) -> None:
        client.completions.create(model=model, prompt=longs[i % len(longs)], max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})

    def long_prompts(pool: ThreadPoolExecutor) -> int:
        """Arrivals every LONG_EVERY_S, whether the earlier ones finished or not."""
        sent = 0
        while not stop.wait(LONG_EVERY_S):
            pool.submit(long_prompt, sent)
            sent += 1
        return sent

    with ThreadPoolExecutor(STREAMS + 1) as pool, ThreadPoolExecutor(8) as arrivals_pool:
        arrivals = pool.submit(long_prompts, arrivals_pool)
        streams = list(pool.map(stream, range(STREAMS)))
        stop.set()
        num_long = arrivals.result()
    tpots = sorted((t[-1] - t[0]) / (len(t) - 1) for t in streams if len(t) > 1)
    gaps = sorted(b - a for t in streams for a, b in zip(t, t[1:]))
    pct = lambda xs, q: 1000 * xs[min(len(xs) - 1, int(q * len(xs)))]  # noqa: E731
    return {"tpot_ms_p50": pct(tpots, 0.5), "tpot_ms_p99": pct(tpots, 0.99), "itl_ms_p50": pct(gaps, 0.5),
            "itl_ms_p99": pct(gaps, 0.99), "long_prompts_during": num_long, "streams": len(tpots)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--gpu-memory-utilization", type=float, default=None,
                        help="passed to every replica (several replicas share one GPU)")
    args = parser.parse_args()
    flags = () if args.gpu_memory_utilization is None else ("--gpu-memory-utilization",
                                                            str(args.gpu_memory_utilization))
    rng = random.Random(45)
    result: dict = {"host_cpus": os.cpu_count(), "tp": args.tp, "max_model_len": MAX_MODEL_LEN}
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        model = long_context_model(Path(tmp) / "stories260k")
        name, tokenizer = model.name, Tokenizer.from_pretrained(model)
        prefill = stack.enter_context(serve_role(model, args.tp, "kv_producer", "p0", Path(tmp) / "p.log", *flags))
        decode = stack.enter_context(serve_role(model, args.tp, "kv_consumer", "d0", Path(tmp) / "d.log", *flags))
        result["transfer"] = transfer_costs(prefill, decode, args.repeats, rng)
        with run_pd_gateway([prefill.target], [decode.target], Path(tmp) / "smg-pd.log") as gateway:
            result["disaggregated"] = decode_under_long_prompts(gateway.base_url, name, tokenizer, rng)
            print("disaggregated", json.dumps(result["disaggregated"]), flush=True)
        stack.close()
        with ExitStack() as co:
            replicas = [co.enter_context(serve(model, args.tp, *flags, log_path=Path(tmp) / f"r{i}.log")) for i in range(2)]
            with run_gateway([r.target for r in replicas], Path(tmp) / "smg.log", "--policy", "round_robin") as gw:
                result["co_located"] = decode_under_long_prompts(gw.base_url, name, tokenizer, rng)
                print("co_located", json.dumps(result["co_located"]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"pd_disaggregation_tp{args.tp}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
