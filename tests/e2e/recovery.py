"""Killing ranks of a running server and the requests that see it, shared by the recovery tests of each layout."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import grpc

from tests.e2e.cluster import child_pids

PROMPTS = ["Once upon a time", "The dog", "Lily wanted to", "One day, a little bird", "Tom and Sue went to the park.",
           "The sun was", "A big red ball", "Mom said"]
MAX_TOKENS = 40


def _requests() -> list[tuple[str, dict]]:
    greedy = [(p, dict(temperature=0)) for p in PROMPTS]
    sampled = [(p, dict(temperature=0.9, top_p=0.95, seed=100 + i)) for i, p in enumerate(PROMPTS[:4])]
    return greedy + sampled


def _rank_pid(server_pid: int, rank: int) -> int:
    for pid in child_pids(server_pid):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        # each rank is `python -m worker.main --config <dir>/rank<R>.json` (launch/local_ranks.py)
        if b"worker.main" in cmdline and cmdline[cmdline.index(b"--config") + 1].endswith(f"/rank{rank}.json".encode()):
            return pid
    raise LookupError(f"rank {rank} of {server_pid} not found")


def _stream_all(client, requests, on_started: threading.Event, max_tokens: int = MAX_TOKENS) -> list[dict]:
    """Runs every request as a stream in its own thread; returns tokens, error and the longest gap."""
    results: list[dict] = [{} for _ in requests]
    started = threading.Barrier(len(requests) + 1)

    def run(i: int, prompt: str, sampling: dict) -> None:
        tokens, last, longest = [], time.monotonic(), 0.0
        try:
            for n, chunk in enumerate(client.generate_stream(prompt, max_tokens=max_tokens, ignore_eos=True,
                                                              **sampling)):
                now = time.monotonic()
                longest, last = max(longest, now - last), now
                tokens.extend(chunk.token_ids)
                if n == 1:
                    started.wait(60)
            results[i] = {"tokens": tokens, "longest_pause_s": longest}
        except grpc.RpcError as exc:
            results[i] = {"tokens": tokens, "error": exc}
            if started.n_waiting:
                started.abort()

    threads = [threading.Thread(target=run, args=(i, p, s)) for i, (p, s) in enumerate(requests)]
    for t in threads:
        t.start()
    try:
        started.wait(120)  # every stream has its first tokens
    except threading.BrokenBarrierError:
        pass
    on_started.set()
    for t in threads:
        t.join(300)
    return results


def _kill_during_load(cluster, rank: int, requests, max_tokens: int = MAX_TOKENS) -> list[dict]:
    """Streams ``requests``; kills ``rank`` with SIGKILL once every stream has its first tokens."""
    started = threading.Event()
    killer = threading.Thread(target=lambda: started.wait(300) and os.kill(_rank_pid(cluster.process.pid, rank),
                                                                          signal.SIGKILL))
    killer.start()
    results = _stream_all(cluster.client, requests, started, max_tokens)
    killer.join()
    return results
