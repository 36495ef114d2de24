"""llama.cpp's ``llama-server`` as a peer for benchmarks/peer_comparison.py.

The binary and the float32 GGUF of the benchmark model come from benchmarks/llama_cpp/build.sh.
The server runs with its defaults except for what the comparison fixes: the thread count
(``-t``/``-tb``), 16 slots (``-np``, continuous batching is on by default) and a context of
1024 positions per slot (the model's ``max_position_embeddings``). Requests go to its
``/completion`` endpoint as token ids (a prompt given as numbers gets no BOS added), greedy
(``temperature`` 0), ``ignore_eos``, streamed as server-sent events, one event per token.

Only the standard library talks to it (``http.client`` in threads), so the benchmark needs no
HTTP client dependency.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import statistics
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.e2e.cluster import free_port


class LlamaServer:
    """A ``llama-server`` subprocess on 127.0.0.1; a context manager that stops it on exit.

    Args:
        binary: the ``llama-server`` executable.
        gguf: the model file.
        threads: ``-t`` and ``-tb`` (generation and batch threads).
        parallel: ``-np``, the number of slots (sequences decoded together).
        kv_f32: an fp32 KV cache (``-ctk f32 -ctv f32``) instead of the default f16, and flash
            attention off (``-fa off``: its CPU path rounds Q to f16, which moved this model's
            logprobs by ~5e-4 and flipped a greedy token at 17 of 128; off: within 1.4e-6 of
            transformers), for the check against transformers.
        positions_per_slot: each slot's context (``-c`` is this times ``parallel``).
        extra_args: more ``llama-server`` flags, e.g. ``("--no-repack",)``.

    Raises:
        RuntimeError: the server exits or is not healthy within ``start_timeout_s`` seconds
            (its log's tail is in the message).
    """

    def __init__(self, binary: Path, gguf: Path, *, threads: int = 2, parallel: int = 16, kv_f32: bool = False,
                 positions_per_slot: int = 1024, start_timeout_s: float = 180.0,
                 extra_args: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self.args = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port),
                     "-t", str(threads), "-tb", str(threads), "-np", str(parallel),
                     "-c", str(positions_per_slot * parallel)]
        if kv_f32:
            self.args += ["-ctk", "f32", "-ctv", "f32", "-fa", "off"]
        self.args += list(extra_args)
        self.parallel = parallel
        self.start_timeout_s = start_timeout_s
        self._log = tempfile.NamedTemporaryFile(prefix="llama-server-", suffix=".log", delete=False)  # noqa: SIM115 - closed in stop()
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> LlamaServer:
        self._proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"llama-server exited ({self._proc.returncode}): {self.log_tail()}")
            try:
                status, _ = self._request("GET", "/health", None, timeout=5)
                if status == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.5)
        self.__exit__(None, None, None)
        raise RuntimeError(f"llama-server not healthy after {self.start_timeout_s} s: {self.log_tail()}")

    def __exit__(self, *exc) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._log.close()

    def log_tail(self, chars: int = 2000) -> str:
        return Path(self._log.name).read_text(errors="replace")[-chars:]

    def _request(self, method: str, path: str, body: dict | None, timeout: float = 600):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(method, path, body=None if body is None else json.dumps(body),
                         headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    # -- requests ------------------------------------------------------------------------------

    def complete(self, prompt: list[int], max_tokens: int, n_probs: int = 0) -> dict:
        """One greedy completion, not streamed: the server's JSON answer (``tokens``, and with
        ``n_probs`` > 0 ``completion_probabilities``: each output token's ``id`` and ``logprob``,
        log-softmax of the raw logits).

        Raises:
            RuntimeError: a status other than 200.
        """
        status, data = self._request("POST", "/completion", {
            "prompt": prompt, "n_predict": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_tokens": True, "n_probs": n_probs, "cache_prompt": False})
        if status != 200:
            raise RuntimeError(f"llama-server /completion answered {status}: {data[:500]!r}")
        return json.loads(data)

    def stream(self, prompt: list[int], max_tokens: int) -> dict:
        """One streamed greedy request: its output token ids, TTFT and TPOT in seconds.

        TPOT is (last token's arrival - first's) / (tokens - 1), as for tpserve's streams. Tokens
        are counted by each event's ``tokens_predicted`` (under 16 concurrent streams events came
        with an empty ``tokens`` list), and ``token_ids`` lists the ids the events carried.

        Raises:
            RuntimeError: a status other than 200, or fewer or more tokens than asked.
        """
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        start = time.perf_counter()
        stamps, tokens, last, predicted = [], [], {}, 0
        try:
            conn.request("POST", "/completion", body=json.dumps({
                "prompt": prompt, "n_predict": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}),
                headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            if response.status != 200:
                raise RuntimeError(f"llama-server /completion answered {response.status}: {response.read()[:500]!r}")
            while line := response.readline():
                if not line.startswith(b"data: "):
                    continue
                event = json.loads(line[6:])
                tokens += event.get("tokens") or []
                if event.get("tokens_predicted", 0) > predicted:  # (arrival, tokens so far)
                    predicted = event["tokens_predicted"]
                    stamps.append((time.perf_counter(), predicted))
                if event.get("stop"):
                    last = event
                    break
        finally:
            conn.close()
        if predicted != max_tokens:
            raise RuntimeError(f"asked llama-server for {max_tokens} tokens, got {predicted} in the stream "
                               f"(its last event: stop_type {last.get('stop_type')!r}, "
                               f"tokens_predicted {last.get('tokens_predicted')})")
        (t0, n0), (t1, n1) = stamps[0], stamps[-1]
        tpot = (t1 - t0) / (n1 - n0) if n1 > n0 else float("nan")
        return {"token_ids": tokens, "tokens": predicted, "ttft": t0 - start, "tpot": tpot}

    def load(self, reqs: list[tuple[list[int], int]]) -> dict:
        """All of ``reqs`` at once (one thread each), as peer_comparison's ``_load`` does for tpserve."""
        self.stream(reqs[0][0][:8], 4)  # warm the connection path, as tpserve's load does

        async def run() -> tuple[float, list[dict]]:
            loop = asyncio.get_running_loop()
            with ThreadPoolExecutor(max_workers=len(reqs)) as pool:
                start = time.perf_counter()
                results = await asyncio.gather(*(loop.run_in_executor(pool, self.stream, p, n) for p, n in reqs))
                return time.perf_counter() - start, results

        wall, results = asyncio.run(run())
        return {"wall_s": wall, "output_tokens_per_s": sum(r["tokens"] for r in results) / wall,
                "tpot_median_ms": statistics.median(r["tpot"] for r in results) * 1e3,
                "ttft_median_ms": statistics.median(r["ttft"] for r in results) * 1e3}
