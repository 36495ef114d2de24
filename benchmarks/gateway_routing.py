"""The gateway (smg, cache_aware) against direct round-robin, over the same two replicas
(docs/design/request-path.md, "The engine protocol a gateway routes").

Two tp-1 replicas of stories260k; the same workloads through both paths, interleaved
in rounds (the VM's speed drifts):

- ``multi-turn``: 16 sessions, each a prefix of its own (about 330 tokens) and 4 turns
  (each turn's prompt is the previous one plus a few words), 8 sessions at a time;
- ``no-sharing``: 64 unrelated prompts of about 350 tokens, 8 at a time.

Every request streams 16 tokens (greedy, ignore_eos). Direct: ``tpserve.client.Client``
over ``ipv4:`` both replicas with gRPC's ``round_robin``, text prompts. Gateway: the
``openai`` client's streaming ``/v1/completions``. TTFT is measured at the client (first
non-empty delta); throughput is output tokens over the workload's wall time.

    python benchmarks/gateway_routing.py --out benchmarks/results   (about 3 minutes)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.e2e.cluster import serve  # noqa: E402
from tests.e2e.gateway import model_with_chat_template, run_gateway  # noqa: E402
from tests.paths import STORIES_DIR  # noqa: E402
from tpserve.client import Client  # noqa: E402

WORDS = ("cat", "dog", "sun", "big", "red", "ran", "happy", "tree", "ball", "girl", "boy", "park", "blue", "jump",
         "play", "fish", "bird", "cake", "home", "rain", "moon", "star", "toy", "car", "hat", "box", "mom", "dad")
MAX_TOKENS = 16
CONCURRENCY = 8


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def multi_turn(seed: int) -> list[list[str]]:
    """16 sessions of 4 prompts each, each prompt extending the session's previous one."""
    rng = random.Random(seed)
    sessions = []
    for _ in range(16):
        text = words(rng, 150)
        sessions.append([text := text + " " + words(rng, 6) for _ in range(4)])
    return sessions


def no_sharing(seed: int) -> list[list[str]]:
    """64 one-turn sessions of unrelated prompts."""
    rng = random.Random(seed)
    return [[words(rng, 160)] for _ in range(64)]


def run_direct(client: Client, sessions: list[list[str]]) -> tuple[list[float], int, float]:
    def session(prompts: list[str]) -> list[tuple[float, int]]:
        out = []
        for prompt in prompts:
            start, first, tokens = time.perf_counter(), None, 0
            for message in client.generate_stream(prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True):
                if first is None and message.text:
                    first = time.perf_counter() - start
                tokens += len(message.token_ids)
            out.append((first, tokens))
        return out

    return _run(session, sessions)


def run_gateway_path(client: openai.OpenAI, model: str, sessions: list[list[str]]) -> tuple[list[float], int, float]:
    def session(prompts: list[str]) -> list[tuple[float, int]]:
        out = []
        for prompt in prompts:
            start, first, tokens = time.perf_counter(), None, 0
            for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                                   stream=True, extra_body={"ignore_eos": True}):
                if chunk.choices and chunk.choices[0].text:
                    first = first if first is not None else time.perf_counter() - start
                    tokens += 1  # one token per delta (no stop strings)
            out.append((first, tokens))
        return out

    return _run(session, sessions)


def _run(session, sessions) -> tuple[list[float], int, float]:
    start = time.perf_counter()
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        results = [r for rs in pool.map(session, sessions) for r in rs]
    wall = time.perf_counter() - start
    return [ttft for ttft, _ in results], sum(tokens for _, tokens in results), wall


def summary(ttfts: list[float], tokens: int, wall: float) -> dict:
    return {"ttft_p50_ms": 1000 * statistics.median(ttfts), "ttft_p90_ms": 1000 * statistics.quantiles(ttfts, n=10)[-1],
            "output_tok_per_s": tokens / wall, "requests": len(ttfts), "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="gateway-bench-"))
    model = model_with_chat_template(STORIES_DIR, tmp / "stories260k")
    rounds = []
    with ExitStack() as stack:
        replicas = [stack.enter_context(serve(model, 1, log_path=tmp / f"replica{i}.log")) for i in range(2)]
        gateway = stack.enter_context(run_gateway([r.target for r in replicas], tmp / "smg.log",
                                                  "--policy", "cache_aware"))
        direct = stack.enter_context(Client("ipv4:" + ",".join(r.target for r in replicas)))
        via = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        run_direct(direct, no_sharing(999)[:8])  # warm both paths (connections, tokenizers)
        run_gateway_path(via, model.name, no_sharing(998)[:8])
        for r in range(args.rounds):
            row = {}
            for name, workload in (("multi-turn", multi_turn), ("no-sharing", no_sharing)):
                # Fresh prompts per path and round: neither finds the other's prefixes cached.
                row[f"{name} direct"] = summary(*run_direct(direct, workload(100 * r + 1)))
                row[f"{name} gateway"] = summary(*run_gateway_path(via, model.name, workload(100 * r + 2)))
            rounds.append(row)
            print(json.dumps(row, indent=1), flush=True)
    result = {"rounds": rounds, "medians": {
        key: {metric: statistics.median(row[key][metric] for row in rounds) for metric in rounds[0][key]}
        for key in rounds[0]}}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gateway_routing.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result["medians"], indent=1))


if __name__ == "__main__":
    main()
