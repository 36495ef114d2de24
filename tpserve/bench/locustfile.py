"""A Locust user for tpserve's gRPC API: distributed load with TTFT, TPOT and E2EL per request.

Run it with Locust's own command, giving it this file (README.md, "Distributed load"):

    LOCUSTFILE=$(python -c "import tpserve.bench; print(tpserve.bench.LOCUSTFILE)")
    locust -f "$LOCUSTFILE" --headless --master --expect-workers 2 \\
        --host 127.0.0.1:50051 -u 32 -r 8 -t 5m --csv run        # on one machine
    locust -f "$LOCUSTFILE" --worker --master-host MASTER          # on each load machine

Each user sends one GenerateStream after another (``-u`` is the concurrency), times the
stream's messages as ``tpserve bench`` does (metrics.py: vLLM's definitions) and fires
Locust request events, all with request_type "grpc", which the master aggregates
across workers like any other request:

- "TTFT": response time = TTFT, length = prompt tokens;
- "TPOT": response time = TPOT (only for requests with more than one output token);
- "E2EL": one per request: response time = E2EL (time to failure for a failed request),
  length = completion tokens; a failure carries its gRPC status code name, so
  Locust's failure table counts failures by status code.

The "Aggregated" row mixes the three, so read the named rows. On the master, the
TTFT samples received from each worker are logged at exit, to spot a worker that
sent nothing. Workload options (``--dataset``, ``--input-len``, ...) are set on the
master, which passes them to the workers; each also reads ``LOCUST_<NAME>`` from the
environment. ``--host`` is the server's HOST:PORT.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections import Counter

import grpc
import grpc.experimental.gevent as grpc_gevent

grpc_gevent.init_gevent()  # before any channel: grpc's C core must yield to gevent, or one stream blocks a worker

from locust import User, constant, events, task  # noqa: E402  (after init_gevent)

from tpserve.bench.datasets import SampleRequest, load_jsonl, random_request  # noqa: E402
from tpserve.bench.metrics import RequestRecord  # noqa: E402
from tpserve.bench.runner import close_record  # noqa: E402
from tpserve.client import Client, build_request  # noqa: E402
from tpserve.v1 import generate_pb2_grpc  # noqa: E402

logger = logging.getLogger(__name__)
REQUEST_TYPE = "grpc"
_ttft_samples_by_worker: Counter[str] = Counter()


@events.init_command_line_parser.add_listener
def _add_options(parser) -> None:
    def option(flag: str, **kwargs) -> None:
        parser.add_argument(flag, env_var="LOCUST_" + flag.lstrip("-").replace("-", "_").upper(), **kwargs)

    option("--dataset", choices=("random", "jsonl"), default="random",
           help="tpserve: random token-id prompts, or a JSONL file of {prompt, max_tokens}")
    option("--dataset-path", default="", help="tpserve: the JSONL file, readable on every worker")
    option("--input-len", type=int, default=128, help="tpserve: random prompt length, tokens")
    option("--output-len", type=int, default=128, help="tpserve: max_tokens (random prompts, JSONL lines without one)")
    option("--range-ratio", type=float, default=0.0, help="tpserve: lengths uniform in [len*(1-r), len*(1+r)]")
    option("--temperature", type=float, default=0.0, help="tpserve: 0 is greedy")
    option("--ignore-eos", action="store_true", default=False, help="tpserve: generate max_tokens past end-of-sequence")
    option("--request-timeout", type=float, default=600.0, help="tpserve: deadline of each request, seconds")


@events.worker_report.add_listener
def _count_worker_ttft(client_id: str, data: dict) -> None:
    # On the master: each report carries the worker's samples since its previous report.
    for entry in data.get("stats", []):
        if entry["method"] == REQUEST_TYPE and entry["name"] == "TTFT":
            _ttft_samples_by_worker[client_id] += entry["num_requests"]


@events.quitting.add_listener
def _log_worker_ttft(environment, **kwargs) -> None:
    if _ttft_samples_by_worker:
        logger.info("tpserve: TTFT samples per worker: %s", json.dumps(dict(_ttft_samples_by_worker)))


def target_of(host: str | None) -> str:
    """Locust's --host as a gRPC target: HOST:PORT (a leading grpc:// or http:// is dropped).

    Raises:
        ValueError: no host was given.
    """
    if not host:
        raise ValueError("give the tpserve server as --host HOST:PORT")
    return host.split("://", 1)[-1].rstrip("/")


class _Workload:
    """Draws one request at a time from the options' dataset (one per process; model info fetched once)."""

    _cache: dict[tuple, _Workload] = {}

    def __init__(self, options, target: str) -> None:
        self.options = options
        if options.dataset == "jsonl":
            self.rows = load_jsonl(options.dataset_path, options.output_len)
        else:
            with Client(target) as client:
                info = client.model_info()
            self.vocab_size, self.eos_ids = info.vocab_size, list(info.eos_token_ids)

    @classmethod
    def get(cls, options, target: str) -> _Workload:
        key = (target, options.dataset, options.dataset_path, options.output_len)
        if key not in cls._cache:
            cls._cache[key] = cls(options, target)
        return cls._cache[key]

    def draw(self, rng: random.Random) -> SampleRequest:
        o = self.options
        if o.dataset == "jsonl":
            return rng.choice(self.rows)
        return random_request(rng, self.vocab_size, o.input_len, o.output_len, o.range_ratio, self.eos_ids)


class TpserveUser(User):
    """Sends GenerateStream requests back to back and reports TTFT, TPOT and E2EL to Locust."""

    wait_time = constant(0)

    def on_start(self) -> None:
        target = target_of(self.host)
        self.options = self.environment.parsed_options
        self.workload = _Workload.get(self.options, target)
        self.rng = random.Random()
        self.channel = grpc.insecure_channel(target)
        self.stub = generate_pb2_grpc.GenerationStub(self.channel)

    def on_stop(self) -> None:
        self.channel.close()

    @task
    def generate(self) -> None:
        sample = self.workload.draw(self.rng)
        request = build_request(sample.prompt, max_tokens=sample.max_tokens, temperature=self.options.temperature,
                                ignore_eos=self.options.ignore_eos)
        record = RequestRecord(index=0, start_s=0.0, max_tokens=sample.max_tokens)
        sent = time.perf_counter()
        last = None
        try:
            for message in self.stub.GenerateStream(request, timeout=self.options.request_timeout):
                record.add_chunk(time.perf_counter() - sent, len(message.token_ids))
                last = message
            close_record(record, last)
        except grpc.RpcError as exc:
            record.fail(exc.code().name, exc.details() or "")
        self.report(record, time.perf_counter() - sent)

    def report(self, record: RequestRecord, elapsed_s: float) -> None:
        """Fires the request's Locust events (milliseconds; see the module docstring)."""
        fire = self.environment.events.request.fire
        if record.ttft_s is not None:
            fire(request_type=REQUEST_TYPE, name="TTFT", response_time=record.ttft_s * 1e3,
                 response_length=record.prompt_tokens, exception=None, context={})
        if record.success and record.tpot_s is not None:
            fire(request_type=REQUEST_TYPE, name="TPOT", response_time=record.tpot_s * 1e3,
                 response_length=record.completion_tokens, exception=None, context={})
        e2el_s = record.e2el_s if record.success else elapsed_s
        fire(request_type=REQUEST_TYPE, name="E2EL", response_time=e2el_s * 1e3,
             response_length=record.completion_tokens, exception=None if record.success else record.status,
             context={})
