"""Entry point of one worker rank: ``python -m worker.main --rank R --world-size N ...``.

Started by ``tpserve serve`` (tpserve/cluster.py), one process per rank. The rank serves
the internal WorkerService on ``--address`` (a unix socket by default), exits when its
parent (the coordinator) dies, and exits non-zero after a fatal error (a failed load or
step), so that nothing outlives the cluster and nothing lingers half-broken.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from concurrent import futures

import grpc

from tpserve.cluster_secret import ENV_VAR, SecretServerInterceptor
from tpserve.log import configure_logging
from tpserve.v1 import worker_pb2_grpc
from worker.memory import CacheSizing
from worker.server import WorkerOptions, WorkerServicer

#: Seconds between checks that the parent process is alive.
PARENT_POLL_SECONDS = 1.0
#: Seconds a fatal error is left for the coordinator to read before the rank exits.
FATAL_GRACE_SECONDS = 2.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m worker.main", description="One tpserve tensor-parallel worker rank.")
    parser.add_argument("--model", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True, help="every rank: tensor x pipeline parallel size")
    parser.add_argument("--pipeline-parallel-size", type=int, default=1,
                        help="stages; rank r is tensor-parallel rank r %% tp of stage r // tp (worker/pipeline.py)")
    # Placement on this host (tpserve/topology.py): the rank's same-host peers are the
    # global ranks node_rank * local_world_size + [0, local_world_size).
    parser.add_argument("--local-rank", type=int, default=None, help="index among this host's ranks (default: --rank)")
    parser.add_argument("--local-world-size", type=int, default=None,
                        help="ranks of the group on this host (default: --world-size)")
    parser.add_argument("--node-rank", type=int, default=0, help="this host's index in the group")
    parser.add_argument("--address", required=True, help="gRPC address to serve, e.g. unix:///tmp/tpserve/rank0.sock")
    parser.add_argument("--init-method", required=True, help="torch.distributed rendezvous, e.g. tcp://127.0.0.1:29500")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", choices=("int8",), default=None)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--cuda-graph-sizes", type=int, nargs="+", default=None,
                        help="decode batch sizes captured as CUDA graphs (default: worker/cuda_graphs.py's)")
    # KV cache sizing (worker/memory.py): explicit blocks, explicit bytes, or measured.
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    parser.add_argument("--num-gpu-blocks-override", type=int, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--num-speculative-tokens", type=int, default=0, help="0: no speculative decoding")
    parser.add_argument("--speculative-model", default=None, help="the draft model's checkpoint directory")
    parser.add_argument("--distributed-timeout-seconds", type=float, default=60.0)
    parser.add_argument("--log-format", choices=("console", "json"), default="console")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(args.log_format, rank=args.rank)
    options = WorkerOptions(
        model_dir=args.model, rank=args.rank, world_size=args.world_size, init_method=args.init_method,
        local_rank=args.rank if args.local_rank is None else args.local_rank,
        local_world_size=args.world_size if args.local_world_size is None else args.local_world_size,
        node_rank=args.node_rank, pipeline_parallel_size=args.pipeline_parallel_size,
        device=args.device, dtype=args.dtype, block_size=args.block_size, quantization=args.quantization,
        distributed_timeout_seconds=args.distributed_timeout_seconds,
        cache=CacheSizing(args.gpu_memory_utilization, args.max_num_batched_tokens, args.max_num_seqs,
                          args.max_model_len, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                          num_gpu_blocks_override=args.num_gpu_blocks_override,
                          num_speculative_tokens=args.num_speculative_tokens),
        draft_model_dir=args.speculative_model,
        enforce_eager=args.enforce_eager,
        cuda_graph_sizes=tuple(args.cuda_graph_sizes) if args.cuda_graph_sizes else None,
    )
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
    server.add_insecure_port(args.address)
    server.start()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    parent = os.getppid()
    threading.Thread(target=servicer.load, name="load", daemon=True).start()
    while not stop.wait(PARENT_POLL_SECONDS):
        if os.getppid() != parent:  # re-parented: the coordinator is gone
            break
    server.stop(grace=0.5)
    # Exit without waiting for a collective a dead peer will never finish.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code[0])


if __name__ == "__main__":
    sys.exit(main())
