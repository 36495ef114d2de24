"""``tpserve serve``: one coordinator and its worker ranks, on one host or as the leader of several.

Start-up order:
  1. read the model's config.json and refuse a model that cannot be split at the
     asked tensor_parallel_size (before any process starts);
  2. bind the public gRPC port with the health service NOT_SERVING (so probes and
     clients get a clear UNAVAILABLE while the model loads);
  3. one host: the ranks' torch.distributed rendezvous is a file in the socket
     directory (no listener), and their collectives use the loopback interface.
     Several hosts (``--nnodes``): serve the node registry on ``--master-addr:
     --master-port`` (:mod:`tpserve.node_registry`) and wait, logging the missing
     ranks, until every headless node has joined and named its ranks' TCP
     addresses; then release them all and use ``master_port + 1`` as the rendezvous;
  4. start this host's ranks (``python -m worker.main``), each on a unix socket;
  5. wait until every rank of every host has loaded its shard; size the KV pool to
     the smallest rank's budget; start the engine; health SERVING.
Shutdown (SIGINT, SIGTERM, a rank's death, a node lost): health NOT_SERVING, fail or
finish in-flight RPCs, tell the other nodes to stop, stop every local rank, leave
no process behind; exit non-zero unless it was an orderly stop.
"""

from __future__ import annotations

import asyncio
import hashlib
import shutil
import signal
import tempfile
import time
from importlib import resources
from pathlib import Path

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

from coordinator.auth import ApiKeyInterceptor, read_api_keys
from coordinator.block_allocator import BlockAllocator, check_pool_holds_a_full_sequence
from coordinator.engine import Engine
from coordinator.errors import MAX_RECEIVE_MESSAGE_BYTES, ErrorInterceptor, TpserveError, UnavailableError
from coordinator.grammar_compiler import GrammarCompiler
from coordinator.metrics import Metrics
from coordinator.ngram_proposer import make_proposer
from coordinator.scheduler import Scheduler
from coordinator.server import GenerationServicer
from coordinator.tls import ServerCertificates
from coordinator.tokenizer import Tokenizer
from coordinator.vllm_engine_service import VllmEngineServicer
from coordinator.worker_client import WorkerGroup, WorkerGroupError
from tpserve import __version__
from tpserve.cluster_secret import AioSecretServerInterceptor, read_secret
from tpserve.config import ClusterConfig, ServerConfig
from tpserve.model_config import ModelConfig
from tpserve.netutil import PeerTimeout, host_port, interface_of, resolve
from tpserve.node_registry import SERVER_KEEPALIVE_OPTIONS, GroupSettings, NodeRegistry
from tpserve.ranks import WORKER_EXIT_SECONDS, LocalRanks
from tpserve.topology import GroupLayout, store_port
from tpserve.v1 import cluster_pb2_grpc
from tpserve.v1 import generate_pb2 as pb
from tpserve.v1 import generate_pb2_grpc

log = structlog.get_logger(__name__)

GENERATION_SERVICE = pb.DESCRIPTOR.services_by_name["Generation"].full_name
VLLM_ENGINE_SERVICE = vllm_engine_pb2.DESCRIPTOR.services_by_name["VllmEngine"].full_name
#: Seconds in-flight RPCs get to finish on shutdown (--shutdown-grace-seconds' default).
SHUTDOWN_GRACE_SECONDS = ServerConfig.model_fields["shutdown_grace_seconds"].default
#: Seconds the other nodes' streams get to carry the leader's goodbye.
NODES_GOODBYE_SECONDS = 2.0
#: Longest shutdown with the default grace: the RPC grace, the nodes' goodbye, then the ranks' SIGTERM grace.
#: Kubernetes' terminationGracePeriodSeconds must exceed it (tests/cluster/test_k8s.py).
DRAIN_SECONDS = SHUTDOWN_GRACE_SECONDS + NODES_GOODBYE_SECONDS + WORKER_EXIT_SECONDS
#: Seconds between "waiting for nodes" log lines.
WAITING_LOG_SECONDS = 10.0
#: Keepalive of the public port (docs/design.md, "Faults found by trying public bug
#: classes"): accept client pings at any rate, with or without calls in flight (gRPC's
#: defaults answer a client pinging every 10 s, as proxies and meshes do, with GOAWAY
#: too_many_pings after about 30 s, killing a stream still queued), and ping clients
#: every 20 s ourselves, so that a long silent stream keeps NAT and proxy mappings and a
#: vanished client is noticed within 40 s.
PUBLIC_KEEPALIVE_OPTIONS = [("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_ping_strikes", 0),
                            ("grpc.http2.min_ping_interval_without_data_ms", 1_000),
                            ("grpc.keepalive_time_ms", 20_000), ("grpc.keepalive_timeout_ms", 20_000)]
# Clients resolve a name (dns:///replicas:50051) once per connection: closing each
# connection after a while makes them re-resolve and find replicas added since.
# The grace lets a long generation stream finish on the old connection.
# SO_REUSEPORT off (gRPC turns it on by default on Linux): a second server started on a
# port already in use must fail to bind, not share the port and split the clients.
_PUBLIC_SERVER_OPTIONS = [("grpc.max_connection_age_ms", 300_000), ("grpc.max_connection_age_grace_ms", 3_600_000),
                          ("grpc.so_reuseport", 0), *PUBLIC_KEEPALIVE_OPTIONS,
                          ("grpc.max_receive_message_length", MAX_RECEIVE_MESSAGE_BYTES)]


#: Name GetModelInfo reports for the embedded model (its model card's name).
DEFAULT_MODEL_NAME = "tpserve-tiny-stories"


def default_model_dir() -> Path:
    """The model embedded in the tpserve package (see tpserve/default_model/README.md)."""
    return Path(str(resources.files("tpserve") / "default_model"))


class StartupError(RuntimeError):
    """The cluster cannot start with this configuration or model; the message says why."""


class Cluster:
    """A coordinator with its worker ranks. ``await Cluster(config).serve()`` runs until stopped.

    With ``--nnodes M > 1`` this is the leader (node 0) of a group whose other hosts run
    :class:`tpserve.headless.HeadlessNode`.

    Raises:
        StartupError: the model cannot be served with this configuration.
    """

    def __init__(self, config: ClusterConfig, log_format: str = "console") -> None:
        self.config = config
        self.log_format = log_format
        self.model_dir = Path(config.load.model) if config.load.model else default_model_dir()
        self.model_config = read_model_config(self.model_dir, config.parallel.tensor_parallel_size)
        if config.speculative.speculative_model is not None:
            draft = read_model_config(Path(config.speculative.speculative_model), config.parallel.tensor_parallel_size)
            if draft.vocab_size != self.model_config.vocab_size:
                raise StartupError(f"--speculative-model {config.speculative.speculative_model} has vocab_size="
                                   f"{draft.vocab_size}, the model {self.model_config.vocab_size}: a draft model "
                                   "must share the model's tokenizer")
        model_len = self.model_config.max_model_len  # max_position_embeddings, or as RoPE scaling extends it
        self.max_model_len = config.scheduler.max_model_len or model_len
        if self.max_model_len > model_len:
            raise StartupError(f"--max-model-len {self.max_model_len} exceeds the model's longest context {model_len} "
                               f"(max_position_embeddings={self.model_config.max_position_embeddings}, "
                               "extended by dynamic or yarn RoPE scaling)")
        self.tokenizer = Tokenizer.from_pretrained(self.model_dir)
        self.secret = read_group_secret(config)
        self.health = health.aio.HealthServicer()
        self.metrics = Metrics()
        self.layout = GroupLayout(config.parallel.tensor_parallel_size, config.parallel.nnodes, 0)
        self.ranks = LocalRanks(config, self.model_dir, self.layout, log_format)
        self.registry: NodeRegistry | None = None
        self.workers: WorkerGroup | None = None
        self.engine: Engine | None = None
        self._stop = asyncio.Event()
        self._exit_code = 0
        self._socket_dir = Path(tempfile.mkdtemp(prefix="tpserve-"))
        self._registry_server: grpc.aio.Server | None = None
        self._monitor_task: asyncio.Task | None = None
        self._liveness_task: asyncio.Task | None = None
        self._recovery: asyncio.Task | None = None
        self._launches = 0  # rank launches so far (each gets fresh socket names)
        self._group_interface: str | None = None  # nnodes > 1: the interface the group's collectives use
        self._dtype = ""  # resolved by the ranks
        self.port: int | None = None
        self.certificates: ServerCertificates | None = None  # with --ssl-certfile
        self.api_keys: ApiKeyInterceptor | None = None  # with --api-key / --api-key-file

    def stop(self, exit_code: int = 0) -> None:
        """Asks the cluster to shut down (safe from signal handlers and callbacks)."""
        self._exit_code = self._exit_code or exit_code
        self._stop.set()

    async def serve(self) -> int:
        """Runs until SIGINT/SIGTERM or a fatal error; returns the process exit code."""
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, self.stop)
        loop.add_signal_handler(signal.SIGHUP, self.reload)  # never the default: that kills without a drain
        server = self._build_server()
        cfg_server = self.config.server
        address = f"{cfg_server.host}:{cfg_server.port}"
        if cfg_server.ssl_certfile:
            try:
                self.certificates = ServerCertificates(cfg_server.ssl_certfile, cfg_server.ssl_keyfile,
                                                       cfg_server.ssl_ca_certs)
            except (OSError, ValueError) as exc:
                raise StartupError(f"TLS: {exc}") from exc
            self.port = _bind(server, address, self.certificates.credentials())
        else:
            self.port = _bind(server, address)
        if self.port == 0:
            await server.stop(None)  # an unstarted server left to the collector fails after the loop closed
            raise StartupError(f"--port {cfg_server.port}: cannot bind {address}, another process listens there; "
                               "stop it or choose another --port")
        # /metrics is bound before anything starts: a taken port stops the start-up with one line
        if cfg_server.metrics_port is not None:
            try:
                start_http_server(cfg_server.metrics_port, registry=self.metrics.registry)
            except OSError as exc:
                await server.stop(None)
                raise StartupError(f"--metrics-port {cfg_server.metrics_port}: cannot bind it ({exc.strerror}); stop "
                                   "the process that listens there or choose another --metrics-port") from None
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await server.start()
        log.info("listening", port=self.port, model=str(self.model_dir), tensor_parallel_size=self.world_size,
                 nnodes=self.layout.nnodes)
        engine_task = None
        try:
            ready = asyncio.create_task(self._start_group())
            stopped = asyncio.create_task(self._stop.wait())
            await asyncio.wait({ready, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if ready.done() and ready.exception() is None:
                engine_task = asyncio.create_task(self.engine.run())
                await self._set_health(health_pb2.HealthCheckResponse.SERVING)
                log.info("serving", **self._serving_fields())
                await self._stop.wait()
            elif ready.done():
                log.error("start-up failed", error=str(ready.exception()))
                self._exit_code = 1
            else:
                ready.cancel()
        finally:
            await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
            if self.engine is not None:
                self.engine.drain()
            await server.stop(self.config.server.shutdown_grace_seconds)
            await self.servicer.close()
            for task in (engine_task, self._monitor_task, self._liveness_task, self._recovery):
                if task is not None:
                    task.cancel()
            await self._stop_nodes()
            if self.workers is not None:
                await self.workers.close()
            self.ranks.stop()
            self.servicer.grammars.close()
            shutil.rmtree(self._socket_dir, ignore_errors=True)
            log.info("stopped", exit_code=self._exit_code)
        return self._exit_code

    def reload(self) -> None:
        """SIGHUP: read the API keys and the TLS files again (rotation without a restart).

        What fails to read or check is logged and left as it was; requests in flight and
        open connections are not touched. Keys given with ``--api-key`` alone do not change.
        """
        cfg = self.config.server
        if self.api_keys is not None:
            try:
                keys = read_api_keys(cfg.api_key, cfg.api_key_file)
                self.api_keys.set_keys(keys)
                log.info("API keys reloaded", num_keys=len(keys))
            except (OSError, ValueError) as exc:
                log.error("API keys not reloaded; the old ones stay", error=str(exc))
        if self.certificates is not None:
            try:
                files = self.certificates.reload()
                log.info("TLS certificates reloaded", certfile=cfg.ssl_certfile,
                         not_valid_after=f"{files.not_valid_after:%Y-%m-%d %H:%M:%S} UTC")
            except (OSError, ValueError) as exc:
                log.error("TLS certificates not reloaded; the old ones stay", error=str(exc))
        if self.api_keys is None and self.certificates is None:
            log.info("SIGHUP: no API keys or TLS certificates to reload")

    @property
    def world_size(self) -> int:
        return self.config.parallel.tensor_parallel_size

    def _build_server(self) -> grpc.aio.Server:
        cfg = self.config.server
        try:
            keys = read_api_keys(cfg.api_key, cfg.api_key_file)
        except (OSError, ValueError) as exc:
            raise StartupError(f"cannot read the API keys: {exc}") from exc
        # The key check runs first: an unauthenticated call never reaches validation.
        self.api_keys = ApiKeyInterceptor(keys) if keys else None
        interceptors = ([self.api_keys] if self.api_keys else []) + [ErrorInterceptor()]
        server = grpc.aio.server(interceptors=interceptors, options=_PUBLIC_SERVER_OPTIONS)
        # Structured output grammars compile in child processes, bounded in time (issue 20, fault 3).
        grammars = GrammarCompiler(self.model_dir, self.model_config.vocab_size)
        self.servicer = GenerationServicer(None, self.tokenizer, self._model_info(0), api_keys=bool(keys),
                                           grammars=grammars)
        generate_pb2_grpc.add_GenerationServicer_to_server(self.servicer, server)
        # The engine protocol a gateway (smg) routes, on the same port and engine.
        vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(VllmEngineServicer(self.servicer, self.model_dir), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection((GENERATION_SERVICE, VLLM_ENGINE_SERVICE, health.SERVICE_NAME,
                                             reflection.SERVICE_NAME), server)
        return server

    async def _set_health(self, status: int) -> None:
        for service in ("", GENERATION_SERVICE):
            await self.health.set(service, status)

    def _model_info(self, num_kv_blocks: int) -> pb.ModelInfo:
        cfg = self.config
        return pb.ModelInfo(
            model_name=cfg.load.served_model_name or (self.model_dir.name if cfg.load.model else DEFAULT_MODEL_NAME),
            max_model_len=self.max_model_len,
            vocab_size=self.model_config.vocab_size,
            tensor_parallel_size=self.world_size,
            dtype=self._dtype,
            eos_token_ids=sorted(self.tokenizer.eos_token_ids),
            num_kv_blocks=num_kv_blocks,
            block_size=cfg.cache.block_size,
            quantization=cfg.load.quantization or self.model_config.quantization or "",
            speculative_method=cfg.speculative.speculative_method or "",
            num_speculative_tokens=cfg.speculative.num_speculative_tokens or 0,
            enable_prefix_caching=cfg.cache.enable_prefix_caching,
            server_version=__version__,
        )

    def _serving_fields(self) -> dict[str, object]:
        """What is on, for the one ``serving`` log line: the model and how it is run, the KV cache, the
        features, the security of the public port and where the metrics are."""
        cfg, info = self.config, self.servicer.model_info
        spec = cfg.speculative
        server = cfg.server
        tls = "off" if not server.ssl_certfile else "mutual" if server.ssl_ca_certs else "on"
        return dict(
            model=str(self.model_dir), served_model_name=info.model_name, dtype=info.dtype,
            quantization=info.quantization or "none", tensor_parallel_size=self.world_size, nnodes=self.layout.nnodes,
            num_kv_blocks=info.num_kv_blocks, kv_cache_tokens=info.num_kv_blocks * info.block_size,
            max_model_len=self.max_model_len, enable_prefix_caching=cfg.cache.enable_prefix_caching,
            speculative_method=spec.speculative_method or "off",
            num_speculative_tokens=spec.num_speculative_tokens or 0,
            address=f"{server.host}:{self.port}", tls=tls, api_key="on" if self.api_keys is not None else "off",
            metrics_url=(f"http://localhost:{server.metrics_port}/metrics" if server.metrics_port is not None
                         else "off"),
            version=__version__,
        )

    # -- start-up ------------------------------------------------------------------------

    async def _start_group(self) -> None:
        """Gathers the group, starts this host's ranks, waits for every rank, starts the engine."""
        cfg = self.config
        timeout_s = cfg.server.worker_start_timeout_seconds
        deadline = time.monotonic() + timeout_s
        if self.layout.nnodes == 1:
            addresses, init_method, interface = self._local_endpoints()
        else:
            addresses = self._local_endpoints()[0]
            init_method, interface = await self._start_registry(deadline)
            self._group_interface = interface
            addresses.update(await self._wait_for_nodes(deadline))
        available = await self._launch_ranks(addresses, init_method, interface, deadline)
        num_blocks = cfg.cache.num_gpu_blocks_override or available
        if num_blocks > available:
            raise WorkerGroupError(f"--num-gpu-blocks-override {num_blocks} exceeds the {available} blocks a rank can hold")
        check_pool_holds_a_full_sequence(num_blocks, cfg.cache.block_size, self.max_model_len)
        await self.workers.start(num_blocks)
        self._dtype = self.workers.dtype
        # Dynamic NTK RoPE rotates a prompt's keys for the prompt's length once that passes max_position_embeddings
        # (worker/layers/rotary.py): equal prefixes of different prompts need not hold equal keys, so none are shared.
        scaling = self.model_config.rope_scaling or {}
        share_prefixes = cfg.cache.enable_prefix_caching and not (
            scaling.get("rope_type") == "dynamic" and self.max_model_len > self.model_config.max_position_embeddings)
        scheduler = Scheduler(BlockAllocator(num_blocks, cfg.cache.block_size),
                              cfg.scheduler.max_num_seqs, cfg.scheduler.max_num_batched_tokens,
                              enable_prefix_caching=share_prefixes,
                              proposer=make_proposer(cfg.speculative),
                              disable_speculation_above=cfg.speculative.speculative_disable_by_batch_size)
        self.metrics.kv_cache_total_blocks.set(num_blocks)
        self.metrics.kv_cache_free_blocks.set(num_blocks)
        self.engine = Engine(scheduler, self.workers, self.tokenizer, self.max_model_len, cfg.scheduler.max_queue_len,
                             self.metrics, on_fatal=lambda reason: self.stop(1), on_group_failure=self._group_failed)
        self.servicer.engine = self.engine
        self.servicer.model_info = self._model_info(num_blocks)
        self._liveness_task = asyncio.create_task(self._watch_liveness())

    def _local_endpoints(self) -> tuple[dict[int, str], str, str]:
        """Fresh unix socket addresses for this host's ranks, and a single-host rendezvous.

        Each launch gets new names (a restarted group must not meet its predecessor's
        sockets or rendezvous file). No network listener at all for the rendezvous (a
        TCPStore listens on every interface, whatever address it is given), and
        gloo's/NCCL's own sockets on the loopback interface: nothing of a one-host
        group is reachable from another host.
        """
        self._launches += 1
        tag = self._launches
        addresses = {rank: f"unix://{self._socket_dir}/rank{rank}-{tag}.sock" for rank in self.layout.node_ranks()}
        return addresses, f"file://{self._socket_dir}/rendezvous-{tag}", interface_of("127.0.0.1") or "lo"

    async def _launch_ranks(self, addresses: dict[int, str], init_method: str, interface: str | None,
                            deadline: float) -> int:
        """Starts this host's ranks and waits until every rank has loaded; returns the blocks all can hold."""
        self.ranks.start(addresses, init_method, interface)
        self._monitor_task = asyncio.create_task(self._monitor_ranks())
        self.workers = WorkerGroup([addresses[rank] for rank in range(self.world_size)],
                                   self.config.server.step_timeout_seconds, secret=self.secret)
        return await self.workers.wait_ready(max(deadline - time.monotonic(), 0.0))

    # -- recovery ------------------------------------------------------------------------

    def _can_recover(self) -> bool:
        return (self.config.server.worker_recovery_timeout_seconds > 0
                and self.engine is not None and not self.engine.dead and not self._stop.is_set())

    async def _recover(self, reason: str, resumed: int) -> None:
        """Restarts every rank and resumes the (suspended) requests by recompute, or fails
        them (UNAVAILABLE) and exits 1. ``resumed``: running sequences to recompute.

        With ``--nnodes`` > 1 a lost host (its registry link dropped, or one of its ranks
        failed) pauses the group rather than ending it: every rank on every host stops (a
        torch.distributed group is whole or nothing), the registry takes joins again, and
        once every node has joined (its pod or ``--headless`` process started again) all
        ranks start on a fresh rendezvous (a new rank 0 store)."""
        timeout_s = self.config.server.worker_recovery_timeout_seconds
        log.error("worker group lost; restarting it", reason=reason, timeout_s=timeout_s)
        started = time.monotonic()
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        for task in (self._monitor_task, self._liveness_task):
            if task is not None and task is not asyncio.current_task():
                task.cancel()
        await self.workers.close()
        await asyncio.to_thread(self.ranks.stop)  # survivors too: the group restarts whole
        try:
            addresses, init_method, interface = self._local_endpoints()
            deadline = started + timeout_s
            if self.layout.nnodes > 1:
                self.registry.reopen(reason)
                init_method, interface = self.registry.init_method, self._group_interface
                addresses.update(await self._wait_for_nodes(deadline, timeout_s))
            available = await asyncio.wait_for(self._launch_ranks(addresses, init_method, interface, deadline),
                                               max(deadline - time.monotonic(), 0.0))
            num_blocks = self.engine.scheduler.allocator.num_blocks
            if available < num_blocks:
                raise WorkerGroupError(f"the restarted ranks hold {available} KV blocks, the pool had {num_blocks}")
            await asyncio.wait_for(self.workers.start(num_blocks), max(deadline - time.monotonic(), 0.1))
        except (WorkerGroupError, asyncio.TimeoutError, OSError) as exc:
            message = f"the worker group was lost ({reason}) and could not be restarted within {timeout_s:g} s: {exc}"
            log.error("worker group recovery failed", error=message)
            self._recovery = None
            self.engine.fail_all(message, UnavailableError)
            return
        self._liveness_task = asyncio.create_task(self._watch_liveness())
        self.engine.resume(self.workers)
        self._recovery = None
        self.metrics.worker_restarts.inc()
        self.metrics.requests_resumed.inc(resumed)
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        log.info("worker group restarted", seconds=round(time.monotonic() - started, 3), requests_resumed=resumed)

    async def _start_registry(self, deadline: float) -> tuple[str, str | None]:
        """Serves the node registry on --master-addr:--master-port.

        Returns:
            The group's init_method and the network interface its collectives use.
        """
        par = self.config.parallel
        try:
            ip = await resolve(par.master_addr, max(deadline - time.monotonic(), 0.0), "--master-addr")
        except PeerTimeout as exc:
            raise StartupError(str(exc)) from None
        interceptors = [AioSecretServerInterceptor(self.secret)] if self.secret else []
        server = grpc.aio.server(options=SERVER_KEEPALIVE_OPTIONS, interceptors=interceptors)
        bound: str | None = ip
        if _bind(server, host_port(ip, par.master_port)) == 0:
            # The name resolves to an address this host does not hold (NAT): listen everywhere.
            log.warning("--master-addr is not an address of this host; the node registry listens on every interface",
                        master_addr=par.master_addr, resolved=ip)
            bound = None
            if _bind(server, f"0.0.0.0:{par.master_port}") == 0:
                raise StartupError(f"cannot bind the node registry on port {par.master_port} (--master-port)")
        init_method = f"tcp://{host_port(bound or par.master_addr, store_port(par.master_port))}"
        settings = GroupSettings(self.layout, config_sha256(self.model_dir), self.config.load.dtype,
                                 self.config.cache.block_size, self.config.load.quantization or "",
                                 draft_config_sha256(self.config), self.max_model_len)
        self.registry = NodeRegistry(settings, init_method, on_lost=self._group_failed)
        cluster_pb2_grpc.add_NodeRegistryServicer_to_server(self.registry, server)
        await server.start()
        self._registry_server = server
        log.info("node registry listening", address=host_port(bound or "0.0.0.0", par.master_port),
                 init_method=init_method)
        return init_method, interface_of(bound) if bound else None

    async def _wait_for_nodes(self, deadline: float, timeout_s: float | None = None) -> dict[int, str]:
        """Waits until every headless node has joined, logging the missing ranks; returns their addresses.
        ``timeout_s``: what the deadline was set from, for the error (default: --worker-start-timeout-seconds)."""
        registry = self.registry
        timeout_s = self.config.server.worker_start_timeout_seconds if timeout_s is None else timeout_s
        while registry.missing_nodes():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WorkerGroupError(f"nodes {registry.missing_nodes()} (ranks {registry.missing_ranks()}) did not "
                                       f"join within {timeout_s:g} s")
            log.warning("waiting for nodes", missing_nodes=registry.missing_nodes(),
                        missing_ranks=registry.missing_ranks())
            try:
                await asyncio.wait_for(registry.complete.wait(), min(remaining, WAITING_LOG_SECONDS))
            except asyncio.TimeoutError:
                pass
        remote = registry.seal()
        log.info("every node has joined", ranks=remote)
        return remote

    # -- failures and shutdown -----------------------------------------------------------

    async def _monitor_ranks(self) -> None:
        rank, code = await self.ranks.wait_first_exit()
        self._group_failed(f"rank {rank} exited with code {code}")

    async def _watch_liveness(self) -> None:
        """A rank alive but stuck (SIGSTOP, a hung kernel, a silent host) is a lost group too:
        its requests could only hang, so they fail with UNAVAILABLE at once."""
        self._group_failed(await self.workers.watch_liveness(), UnavailableError)

    def _group_failed(self, reason: str, error: type[TpserveError] = TpserveError) -> bool:
        """A rank or a node is lost. With --worker-recovery-timeout-seconds, restart the
        group (on every host) and resume the requests (returns True); otherwise fail the
        requests in flight at once and stop (exit 1; returns False)."""
        if self._recovery is not None:
            return True  # already restarting: the other detectors see the same loss
        if self._can_recover():
            # Hold the requests now, before anything else runs: the engine loop must
            # not schedule another step on the lost group.
            resumed = self.engine.suspend(reason)
            self._recovery = asyncio.create_task(self._recover(reason, resumed))
            return True
        log.error("worker group lost", reason=reason)
        if self.engine is not None and not self.engine.dead:
            self.engine.fail_all(reason, error)
        self.stop(1)
        return False

    async def _stop_nodes(self) -> None:
        if self.registry is not None:
            self.registry.shutdown("the leader stopped" if self._exit_code == 0 else "the group failed",
                                   failed=self._exit_code != 0)
        if self._registry_server is not None:
            await self._registry_server.stop(NODES_GOODBYE_SECONDS)


def read_group_secret(config: ClusterConfig) -> str | None:
    """The group's cluster secret (``--cluster-secret-file``), or None.

    Raises:
        StartupError: the file cannot be read or holds too short a secret.
    """
    path = config.parallel.cluster_secret_file
    if path is None:
        return None
    try:
        return read_secret(path)
    except (OSError, ValueError) as exc:
        raise StartupError(f"--cluster-secret-file: {exc}") from exc


def read_model_config(model_dir: Path, tensor_parallel_size: int) -> ModelConfig:
    """The checkpoint's config, checked to split at ``tensor_parallel_size``.

    Raises:
        StartupError: not a checkpoint directory, an unsupported architecture or
            quantization_config, or the model cannot be split.
    """
    if not (model_dir / "config.json").is_file():
        raise StartupError(f"{model_dir} is not a Hugging Face checkpoint directory (no config.json)")
    try:
        config = ModelConfig.from_pretrained(model_dir)  # also refuses an unsupported quantization_config
    except ValueError as exc:
        raise StartupError(f"cannot serve {model_dir}: {exc}") from exc
    try:
        config.check_tensor_parallel(tensor_parallel_size)
    except ValueError as exc:
        raise StartupError(f"cannot serve {model_dir} at --tensor-parallel-size {tensor_parallel_size}: {exc}") from exc
    return config


def draft_config_sha256(config: ClusterConfig) -> str:
    """SHA-256 (hex) of the draft model's config.json, or "" without ``--speculative-model``."""
    draft = config.speculative.speculative_model
    return "" if draft is None else config_sha256(Path(draft))


def config_sha256(model_dir: Path) -> str:
    """SHA-256 (hex) of a checkpoint's config.json: how the nodes of a group check they serve the same model."""
    return hashlib.sha256((model_dir / "config.json").read_bytes()).hexdigest()


def _bind(server: grpc.aio.Server, address: str, credentials: grpc.ServerCredentials | None = None) -> int:
    """The bound port, or 0 where ``address`` cannot be bound (grpc raises or returns 0, by version)."""
    try:
        if credentials is not None:
            return server.add_secure_port(address, credentials)
        return server.add_insecure_port(address)
    except RuntimeError:
        return 0
