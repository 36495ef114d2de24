"""Entry point of one worker rank: ``python -m worker.main --config RANK.json``.

Started by ``tpserve serve`` (launch/local_ranks.py), one process per rank. Everything the rank
needs is one :class:`tpserve.config.RankConfig`, the cluster configuration the launcher
validated plus the rank's place in the group, as JSON; the rank validates it again with the
same pydantic models and maps it to :class:`worker.server.WorkerOptions` in one place
(:func:`worker_options`). The rank serves the internal WorkerService on the config's
``address`` (a unix socket by default), exits when its parent (the coordinator) dies, and
exits non-zero after a fatal error (a failed load or step), so that nothing outlives the
cluster and nothing lingers half-broken.

Debugging one rank by hand: take a rank's file while ``tpserve serve`` runs (its directory
is logged as ``config_dir`` with "ranks started"; edit ``address`` and ``init_method`` to
fresh names), or write a lone rank's, where every cluster setting left out takes its default::

    {"model_dir": "tpserve/default_model", "rank": 0, "world_size": 1, "local_rank": 0,
     "local_world_size": 1, "address": "unix:///tmp/rank0.sock", "init_method": "file:///tmp/rendezvous"}

then run ``python -m worker.main --config rank0.json`` (``--config -`` reads it from stdin) and
drive it with ``coordinator.worker_client.WorkerGroup(["unix:///tmp/rank0.sock"], 60)``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from concurrent import futures
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import structlog

from tpserve.cluster_secret import ENV_VAR, SecretServerInterceptor
from tpserve.config import RankConfig
from tpserve.kv_transfer_config import side_channel_bind_error
from tpserve.kv_wire import KV_CONTROL_KEY_ENV
from tpserve.log import configure_logging
from tpserve.sched_policy import policy_name, set_policy
from tpserve.step_socket import socket_path
from tpserve.v1 import worker_pb2_grpc
from worker.lora_settings import LoRASettings
from worker.memory import CacheSizing
from worker.server import WorkerOptions, WorkerServicer
from worker.step_socket_server import StepSocketServer

if TYPE_CHECKING:
    from worker.kv_transfer.agent import KVAgent

log = structlog.get_logger(__name__)

#: Seconds between checks that the parent process is alive.
PARENT_POLL_SECONDS = 1.0
#: Seconds a fatal error is left for the coordinator to read before the rank exits.
FATAL_GRACE_SECONDS = 2.0


def read_config(argv: list[str] | None = None) -> RankConfig:
    """The rank's configuration, from the JSON file ``--config`` names (``-``: stdin).

    Raises:
        SystemExit: no ``--config``, an unreadable file, or a configuration that does not
            validate (argparse prints the reason, naming the field, and exits 2).
    """
    parser = argparse.ArgumentParser(prog="python -m worker.main",
                                     description="One tpserve tensor-parallel worker rank (started by `tpserve "
                                                 "serve`; see this module's docstring to run one by hand).")
    parser.add_argument("--config", required=True, metavar="FILE",
                        help="the rank's tpserve.config.RankConfig as JSON; - reads it from stdin")
    args = parser.parse_args(argv)
    try:
        text = sys.stdin.read() if args.config == "-" else Path(args.config).read_text(encoding="utf-8")
        return RankConfig.from_json(text)
    except OSError as exc:
        parser.error(f"--config {args.config}: {exc.strerror}")
    except ValueError as exc:  # pydantic's ValidationError names each field
        parser.error(f"--config {args.config}: {exc}")


def worker_options(config: RankConfig) -> WorkerOptions:
    """The rank's WorkerOptions: the one place a cluster setting becomes a worker setting."""
    cluster = config.cluster
    load, cache, scheduler, spec = cluster.load, cluster.cache, cluster.scheduler, cluster.speculative
    return WorkerOptions(
        model_dir=config.model_dir, rank=config.rank, init_method=config.init_method,
        tensor_parallel_size=cluster.parallel.tensor_parallel_size,
        local_rank=config.local_rank, local_world_size=config.local_world_size, node_rank=config.node_rank,
        pipeline_parallel_size=cluster.parallel.pipeline_parallel_size,
        enable_expert_parallel=cluster.parallel.enable_expert_parallel,
        device=load.device, dtype=load.dtype, block_size=cache.block_size, quantization=load.quantization,
        kv_cache_dtype=cache.kv_cache_dtype,
        distributed_timeout_seconds=cluster.parallel.distributed_timeout_seconds,
        cache=CacheSizing(cache.gpu_memory_utilization, scheduler.max_num_batched_tokens, scheduler.max_num_seqs,
                          scheduler.max_model_len, kv_cache_memory_bytes=cache.kv_cache_memory_bytes,
                          num_gpu_blocks_override=cache.num_gpu_blocks_override,
                          num_speculative_tokens=spec.num_speculative_tokens or 0,
                          enable_prefix_caching=cache.enable_prefix_caching),
        draft_model_dir=spec.speculative_model,
        enforce_eager=load.enforce_eager,
        cuda_graph_sizes=load.cuda_graph_sizes,
        cpu_omp_threads_bind=load.cpu_omp_threads_bind,
        lora=LoRASettings(cluster.lora.max_loras, cluster.lora.max_lora_rank,
                          tuple(path for _, path in cluster.lora.adapters),
                          cluster.lora.max_cpu_loras) if cluster.lora.enable_lora else None,
    )


def start_kv_agent(config: RankConfig, servicer: WorkerServicer, secret: str | None,
                   control_key: str | None = None) -> KVAgent | None:
    """The rank's KV agent on ``side_channel_port + rank`` when ``--kv-transfer-config`` is set, else None
    (worker/kv_transfer/agent.py). ``control_key``: the group's, which its coordinator's holds and pulls prove.

    Raises:
        OSError: the port cannot be bound.
        ValueError: the transport cannot be made (nixl without the package).
    """
    kv = config.cluster.kv_transfer.kv_transfer_config
    if kv is None:
        return None
    # Here, not at module import: torch loads on the load thread while the rank already answers GetStatus.
    from worker.kv_transfer.agent import KVAgent
    from worker.kv_transfer.transport import make_transport

    transport = make_transport(kv.transport, config.rank, config.world_size, secret)
    agent = KVAgent(kv.side_channel_host, kv.side_channel_port + config.rank, config.rank, config.world_size, secret,
                    lambda: servicer.kv_caches, transport, lambda: servicer.kv_codec, control_key)
    agent.start()
    return agent


def main(argv: list[str] | None = None) -> int:
    if policy_name() == "batch":  # inherited from the coordinator: a rank's threads run under SCHED_OTHER
        set_policy("other")      # (tpserve/sched_policy.py), set before the rank starts any thread of its own
    config = read_config(argv)
    configure_logging(config.log_format, rank=config.rank)
    options = worker_options(config)
    stop = threading.Event()
    exit_code = [0]

    def on_fatal(_: str) -> None:
        exit_code[0] = 1
        # Leave the coordinator time to read the error through GetStatus or Step.
        threading.Timer(FATAL_GRACE_SECONDS, stop.set).start()

    servicer = WorkerServicer(options, on_fatal)
    secret = os.environ.pop(ENV_VAR, None)  # set by the launcher with --cluster-secret-file
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4),
                         interceptors=[SecretServerInterceptor(secret)] if secret else [], options=[
        ("grpc.max_send_message_length", 64 * 1024**2), ("grpc.max_receive_message_length", 64 * 1024**2)])
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(servicer, server)
    server.add_insecure_port(config.address)
    server.start()
    path = socket_path(config.address)  # the coordinator's own host: steps over a plain socket
    step_server = None
    if path is not None:
        try:
            step_server = StepSocketServer(servicer, path, secret)
            step_server.start()
        except OSError as exc:  # e.g. a path over the 108 bytes of a Unix socket name: gRPC's Step serves
            log.warning("no step socket: steps go over the gRPC stream", path=path, error=str(exc))

    control_key = os.environ.pop(KV_CONTROL_KEY_ENV, None)  # the launcher's, for this launch only
    try:
        agent = start_kv_agent(config, servicer, secret, control_key)
    except OSError as exc:  # the launcher checked the address first (launch/startup.py): taken since
        kv = config.cluster.kv_transfer.kv_transfer_config
        assert kv is not None  # an agent is started only with a KV transfer config
        log.error("kv side channel cannot listen", error=side_channel_bind_error(
            kv.side_channel_host, kv.side_channel_port, config.rank, exc))
        server.stop(grace=0)
        if step_server is not None:
            step_server.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    parent = os.getppid()
    threading.Thread(target=servicer.load, name="load", daemon=True).start()
    while not stop.wait(PARENT_POLL_SECONDS):
        if os.getppid() != parent:  # re-parented: the coordinator is gone
            break
    if step_server is not None:
        step_server.close()
    if agent is not None:
        agent.close()
    server.stop(grace=0.5)
    # Exit without waiting for a collective a dead peer will never finish.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code[0])


if __name__ == "__main__":
    sys.exit(main())
