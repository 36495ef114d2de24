"""ngram speculative decoding against none, on a repetitive and a non-repetitive workload, in one run.

Two servers of the same model, one without speculation and one with
``--speculative-method ngram`` (flags below), both up at once and measured in turn
(``--repeats`` passes each, alternating; medians), get the same two workloads, built
from token ids so they need no tokenizer:

* **repetitive** (quoting the input, as a summary or an edit of a document does): a
  passage of the model's own greedy text (``--passage-len`` tokens from a story
  opening, generated once by the first server), then the passage again, cut in the
  middle; greedy, ``ignore_eos``. The model goes on quoting, and the proposer finds
  the quoted spans (and the loops small models fall into). Random token ids in a
  code-like layout were tried first: these small story models do not copy them.
* **non-repetitive**: random token ids, sampled at temperature 1 (seeded): n-grams
  rarely recur, so proposals are rare and mostly rejected; the per-sequence pause
  (coordinator/spec_decode.py) must keep this within 10 % of no speculation.

For each (workload, server): the requests one after another (decode ms per output
token at batch 1), then all at once (output tok/s). Reports speedup = off / on per
measure, the acceptance rate (accepted / proposed tokens, from the server's
``tpserve:spec_decode_*`` counters) and the mean tokens per verified proposal.

    python benchmarks/speculative_ngram.py --out benchmarks/results                 # embedded model
    python benchmarks/speculative_ngram.py --model ../shared/models/stories260k --out benchmarks/results
    python benchmarks/speculative_ngram.py --peer-model --num-requests 4 --max-tokens 64 --passage-len 64 \
        --out benchmarks/results                                         # the recorded run: the 95M model
    python benchmarks/speculative_ngram.py --num-requests 2 --max-tokens 32 --passage-len 40 --prompt-len 64  # runs?
    python benchmarks/speculative_ngram.py --speculative-model DIR          # a draft model instead of n-grams
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.e2e.cluster import serve  # noqa: E402  (the same launcher the tests use)
from benchmarks.report import save_report  # noqa: E402


OPENINGS = ("Once upon a time", "Tom had a red ball", "One day, a little girl", "The sun was hot",
            "Lily and Ben went to the park", "A big dog", "Mom said", "There was a small bird")


def quoting_prompts(client, num_requests: int, passage_len: int, vocab: int, text_openings: bool) -> list[list[int]]:
    """BOS, a greedy passage from a story opening, then its first half again (the model continues quoting).

    The openings are text (``text_openings``) for a model that embeds its tokenizer's
    every token (the embedded model, stories260k); otherwise (peer_comparison.py's random
    95M model carries a larger tokenizer than its 512 tokens) seeded token ids below ``vocab``.
    """
    rng = random.Random(1)
    prompts = []
    for i in range(num_requests):
        opening = OPENINGS[i % len(OPENINGS)] + " " * (i // len(OPENINGS))
        if not text_openings:
            opening = [1] + [rng.randrange(3, vocab) for _ in range(8)]
        passage = list(client.generate(opening, max_tokens=passage_len, temperature=0, ignore_eos=True).token_ids)
        prompts.append([1] + passage + passage[:passage_len // 2])
    return prompts


def random_prompt(rng: random.Random, vocab: int, length: int) -> list[int]:
    return [1] + [rng.randrange(3, vocab) for _ in range(length - 1)]


def spec_counters(metrics_port: int) -> dict[str, float]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r"^tpserve:spec_decode_(num_\w+?)_total (\S+)$", body, re.MULTILINE)}


def one_pass(client, requests: list[dict]) -> tuple[float, float]:
    """``requests`` one after another (decode ms per output token), then all at once (output tok/s)."""
    start, tokens = time.perf_counter(), 0
    for request in requests:
        tokens += len(client.generate(**request).token_ids)
    sequential = (time.perf_counter() - start) * 1e3 / max(tokens, 1)
    with ThreadPoolExecutor(len(requests)) as pool:
        start = time.perf_counter()
        results = list(pool.map(lambda r: client.generate(**r), requests))
        concurrent = sum(len(r.token_ids) for r in results) / (time.perf_counter() - start)
    return sequential, concurrent


def run_interleaved(clusters: dict, requests: list[dict], repeats: int) -> dict:
    """Passes of ``requests`` on each server in turn (off, on, on, off, ...); medians and counters per server.

    One pass varies by +-15 % or more on the shared 2-core machine (measured), more than
    the effect sought on the non-repetitive workload: alternating the servers pass by
    pass exposes both to the same moments of the machine, and the median drops outliers.
    """
    before = {name: spec_counters(c.metrics_port) for name, c in clusters.items()}
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in clusters}
    names = list(clusters)
    for r in range(repeats):  # ABBA: each server goes first in half the repeats, so order biases cancel
        for name in names if r % 2 == 0 else names[::-1]:
            runs[name].append(one_pass(clusters[name].client, requests))
    out = {}
    for name, cluster in clusters.items():
        after = spec_counters(cluster.metrics_port)
        delta = {key: after.get(key, 0.0) - before[name].get(key, 0.0) for key in after}
        proposed, accepted, drafts = (delta.get("num_draft_tokens", 0), delta.get("num_accepted_tokens", 0),
                                      delta.get("num_drafts", 0))
        sequential, concurrent = [r[0] for r in runs[name]], [r[1] for r in runs[name]]
        out[name] = {
            "sequential_ms_per_token": round(statistics.median(sequential), 3),
            "concurrent_tokens_per_s": round(statistics.median(concurrent), 1),
            "sequential_ms_per_token_runs": [round(x, 3) for x in sequential],
            "concurrent_tokens_per_s_runs": [round(x, 1) for x in concurrent],
            "num_drafts": drafts, "num_draft_tokens": proposed, "num_accepted_tokens": accepted,
            "acceptance_rate": round(accepted / proposed, 3) if proposed else None,
            "tokens_per_verified_proposal": round(1 + accepted / drafts, 3) if drafts else None,
        }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the embedded model)")
    parser.add_argument("--peer-model", action="store_true",
                        help="the 94.9M-parameter random Llama of peer_comparison.py (seed 0) instead of --model")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=120, help="non-repetitive prompts' length")
    parser.add_argument("--passage-len", type=int, default=80, help="repetitive prompts: 1.5 x this long")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--speculative-model", default=None,
                        help="compare --speculative-method draft with this draft model instead of ngram")
    parser.add_argument("--repeats", type=int, default=4, help="passes of each workload per server; medians")
    parser.add_argument("--out", type=Path, default=None, help="directory for the JSON result")
    args = parser.parse_args()
    model_name = Path(args.model).name if args.model else "default_model"
    if args.peer_model:
        from benchmarks.peer_comparison import build_model

        args.model, model_name = str(build_model(Path(tempfile.mkdtemp(prefix="tpserve-spec-")), 0)), "peer95m"

    config = Path(args.model) / "config.json" if args.model else Path(__file__).resolve().parents[1] / \
        "tpserve" / "default_model" / "config.json"
    model_config = json.loads(config.read_text())
    vocab = model_config["vocab_size"]
    from tokenizers import Tokenizer

    text_openings = Tokenizer.from_file(str(config.with_name("tokenizer.json"))).get_vocab_size() <= vocab
    if max(args.prompt_len, 1 + args.passage_len * 3 // 2) + args.max_tokens > model_config["max_position_embeddings"]:
        parser.error(f"prompts + --max-tokens must fit the model's {model_config['max_position_embeddings']} positions")
    rng = random.Random(0)
    workloads = {
        "repetitive": [],  # built by the first server (the model's own text)
        "non_repetitive": [dict(prompt=random_prompt(rng, vocab, args.prompt_len), max_tokens=args.max_tokens,
                                temperature=1.0, seed=i, ignore_eos=True) for i in range(args.num_requests)],
    }
    spec_flags = ["--speculative-method", "ngram", "--num-speculative-tokens", str(args.num_speculative_tokens),
                  "--prompt-lookup-max", str(args.prompt_lookup_max), "--prompt-lookup-min", str(args.prompt_lookup_min)]
    if args.speculative_model is not None:
        spec_flags = ["--speculative-method", "draft", "--speculative-model", args.speculative_model,
                      "--num-speculative-tokens", str(args.num_speculative_tokens)]
    report = {"benchmark": "speculative_ngram", "model": model_name,
              "tensor_parallel_size": args.tensor_parallel_size, "num_requests": args.num_requests,
              "prompt_len": args.prompt_len, "passage_len": args.passage_len, "max_tokens": args.max_tokens, "repeats": args.repeats,
              "speculative_flags": " ".join(spec_flags),
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "load_average_at_start": os.getloadavg(),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    results: dict[str, dict[str, dict]] = {}
    with contextlib.ExitStack() as stack:  # both servers up at once, measured in turn
        clusters = {setting: stack.enter_context(serve(args.model, args.tensor_parallel_size, *flags, omp_threads=None))
                    for setting, flags in (("off", []), ("on", spec_flags))}
        for cluster in clusters.values():
            cluster.client.generate([1, 5, 6, 7], max_tokens=4, temperature=0)  # warm-up
        workloads["repetitive"] = [dict(prompt=prompt, max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
                                   for prompt in quoting_prompts(clusters["off"].client, args.num_requests,
                                                                 args.passage_len, vocab, text_openings)]
        for name, requests in workloads.items():
            results[name] = run_interleaved(clusters, requests, args.repeats)
    for by_setting in results.values():
        off, on = by_setting["off"], by_setting["on"]
        by_setting["speedup"] = {
            "sequential": round(off["sequential_ms_per_token"] / on["sequential_ms_per_token"], 3),
            "concurrent": round(on["concurrent_tokens_per_s"] / off["concurrent_tokens_per_s"], 3)}
    report.update(results=results, load_average_at_end=os.getloadavg())
    print(json.dumps(report, indent=2))
    if args.out is not None:
        method = "draft" if args.speculative_model else "ngram"
        name = f"speculative_{method}_{model_name}.json"
        save_report(args.out, name, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
