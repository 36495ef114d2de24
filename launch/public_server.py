"""The leader's public gRPC server: Generation and the engine protocol a gateway routes
(``vllm.grpc.engine.VllmEngine``) on one port, with health, reflection, TLS, API keys and
Prometheus' /metrics beside it.

It is bound before any rank starts, with the health service NOT_SERVING, so that probes and
clients get a clear UNAVAILABLE while the model loads (the ``liveness`` service answers SERVING all
along: the process is alive, :data:`LIVENESS_SERVICE`); :meth:`PublicServer.attach` hands it the
engine once the group is up. SIGHUP re-reads the API keys and the TLS files (:meth:`reload`).
"""

from __future__ import annotations

import gc
from pathlib import Path

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

from coordinator.auth import ApiKeyInterceptor, read_api_keys
from coordinator.cache_isolation import share_tenant_key
from coordinator.engine import Engine
from coordinator.errors import MAX_RECEIVE_MESSAGE_BYTES, ErrorCount, ErrorInterceptor
from coordinator.gc_policy import set_serving_gc_thresholds
from coordinator.grammar_compiler import GrammarCompiler
from coordinator.kv_transfer.connector import KVConnector
from coordinator.kv_transfer.metrics import KVTransferMetrics
from coordinator.kv_transfer.stream_moves import StreamMoves
from coordinator.metrics import Metrics
from coordinator.lora_registry import LoRARegistry
from coordinator.server import GenerationServicer
from coordinator.tls import ServerCertificates
from coordinator.tokenizer import Tokenizer
from coordinator.vllm_engine_service import VllmEngineServicer
from launch.connection_limits import (ConnectionWatch, connection_options, raise_nofile_limit,
                                      resolve_max_connections)
from launch.health_watch import PublicHealth
from launch.metrics_endpoint import start_metrics_server
from launch.reflection import enable_server_reflection
from launch.startup import StartupError, bind, read_group_secret
from tpserve import __version__
from tpserve.config import ClusterConfig
from tpserve.embedded_model import DEFAULT_MODEL_NAME
from tpserve.event_loop import running_loop_name
from tpserve.model_config import ModelConfig
from tpserve.quantization import served_quantization
from tpserve.sched_policy import policy_name
from tpserve.v1 import generate_pb2 as pb
from tpserve.v1 import generate_pb2_grpc

log = structlog.get_logger(__name__)

GENERATION_SERVICE = pb.DESCRIPTOR.services_by_name["Generation"].full_name
VLLM_ENGINE_SERVICE = vllm_engine_pb2.DESCRIPTOR.services_by_name["VllmEngine"].full_name
#: Keepalive of the public port (docs/design/faults.md, "Public
#: keepalive"): accept client pings at any rate, with or without calls in flight (gRPC's
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
#: The health service name that answers "alive" (Kubernetes' liveness probe: ``grpc: {port, service: liveness}``):
#: SERVING from the moment the port is bound until the process stops, through loading, a worker group's
#: restart and a drain, because only a process that cannot answer at all (its event loop wedged, which
#: the probe's timeout sees) is one a restart would help. A restart while the group recovers would throw
#: away the requests the leader holds for it. Readiness is the service "" (and Generation's name), NOT_SERVING
#: whenever the group cannot serve (:meth:`PublicServer.set_serving`).
LIVENESS_SERVICE = "liveness"
#: Connections the health port (--health-port) accepts at a time: probes and a gateway's checks
#: need a few; a flood there cannot take the descriptors the public port needs.
HEALTH_MAX_CONNECTIONS = 64


class PublicServer:
    """The public port of one leader.

    Args:
        config: the cluster configuration (its ``server`` section binds, secures and drains the port).
        model_dir: the served checkpoint.
        model_config: its checked config.
        max_model_len: the longest sequence served, in tokens, as resolved.
        tokenizer: the model's tokenizer.
        metrics: the coordinator's Prometheus metrics, served on ``--metrics-port``.
    """

    def __init__(self, config: ClusterConfig, model_dir: Path, model_config: ModelConfig, max_model_len: int,
                 tokenizer: Tokenizer, metrics: Metrics) -> None:
        self.config = config
        self.model_dir = model_dir
        self.model_config = model_config
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.health = health.aio.HealthServicer()
        self.servicer: GenerationServicer | None = None
        self.port: int | None = None
        self.metrics_port: int | None = None  # /metrics' bound port (--metrics-port 0: the one the system chose)
        self.certificates: ServerCertificates | None = None  # with --ssl-certfile
        self.api_keys: ApiKeyInterceptor | None = None  # with --api-key / --api-key-file
        self.dtype = ""  # resolved by the ranks
        self.max_connections = 0  # the public port's connection cap, once started
        self._server: grpc.aio.Server | None = None
        self._health_server: grpc.aio.Server | None = None  # with --health-port
        self.public_health = PublicHealth(self.health)  # the public port's: its watches end with the drain
        self._watch: ConnectionWatch | None = None
        self.kv_connector: KVConnector | None = None  # with --kv-transfer-config
        self.kv_control_key: str | None = None  # the group's, which its ranks' KV agents require (launch/leader.py)

    async def start(self, nnodes: int) -> None:
        """Builds the server, binds the public port (and /metrics), health NOT_SERVING, starts it.

        Raises:
            StartupError: unreadable API keys or TLS files, or a port another process holds.
        """
        cfg = self.config.server
        # Before anything opens a descriptor that counts against it (docs/design/faults.md, "Silent connections").
        nofile = raise_nofile_limit()
        self.max_connections = resolve_max_connections(cfg.max_connections, nofile["nofile_soft"])
        server = self._build()
        address = f"{cfg.host}:{cfg.port}"
        if cfg.ssl_certfile:
            try:
                self.certificates = ServerCertificates(cfg.ssl_certfile, cfg.ssl_keyfile, cfg.ssl_ca_certs)
            except (OSError, ValueError) as exc:
                raise StartupError(f"TLS: {exc}") from exc
            self.port = bind(server, address, self.certificates.credentials())
        else:
            self.port = bind(server, address)
        if self.port == 0:
            await server.stop(None)  # an unstarted server left to the collector fails after the loop closed
            raise StartupError(f"--port {cfg.port}: cannot bind {address}, another process listens there; "
                               "stop it or choose another --port")
        # /metrics is bound before anything starts: a taken port stops the start-up with one line. It
        # listens where the gRPC port does (--host): it shows the queue and the prefix cache's hit rate
        # of every tenant, which tenants are refused over gRPC (GetLoads is the operator's).
        if cfg.metrics_port is not None:
            try:
                self.metrics_port = start_metrics_server(cfg.metrics_port, cfg.host, self.metrics.registry)
            except OSError as exc:
                await server.stop(None)
                raise StartupError(f"--metrics-port {cfg.metrics_port}: cannot bind it ({exc.strerror}); stop "
                                   "the process that listens there or choose another --metrics-port") from None
        if cfg.health_port is not None:
            self._health_server = await self._start_health_port(cfg.host, cfg.health_port, server)
        await self.set_serving(False)
        await self.health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        await server.start()
        self._server = server
        self._watch = ConnectionWatch(self.port, self.max_connections, self.metrics)
        self._watch.start()
        log.info("listening", port=self.port, model=str(self.model_dir),
                 tensor_parallel_size=self.config.parallel.tensor_parallel_size,
                 pipeline_parallel_size=self.config.parallel.pipeline_parallel_size, nnodes=nnodes,
                 max_connections=self.max_connections, handshake_timeout_s=cfg.handshake_timeout_seconds,
                 health_port=cfg.health_port, **nofile)

    async def _start_health_port(self, host: str, port: int, public: grpc.aio.Server) -> grpc.aio.Server:
        """Serves the health service alone (the same answers as the public port's) on ``host:port``,
        plaintext, with its own small connection cap: a kubelet's gRPC probe (which speaks no TLS)
        and a gateway's checks reach it while the public port is at its cap.

        Raises:
            StartupError: another process holds the port (``public``, not started yet, is stopped).
        """
        cfg = self.config.server
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0), *PUBLIC_KEEPALIVE_OPTIONS,
                                          *connection_options(cfg.handshake_timeout_seconds, HEALTH_MAX_CONNECTIONS)])
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        if bind(server, f"{host}:{port}") == 0:
            await server.stop(None)
            await public.stop(None)
            raise StartupError(f"--health-port {port}: cannot bind {host}:{port}, another process listens there; "
                               "stop it or choose another --health-port")
        await server.start()
        return server

    def _build(self) -> grpc.aio.Server:
        cfg = self.config.server
        try:
            keys = read_api_keys(cfg.api_key, cfg.api_key_file)
            operator_keys = read_api_keys(cfg.operator_api_key, cfg.operator_api_key_file, "--operator-api-key-file")
        except (OSError, ValueError) as exc:
            raise StartupError(f"cannot read the API keys: {exc}") from exc
        # The key check runs first: an unauthenticated call never reaches validation.
        self.api_keys = ApiKeyInterceptor(keys, operator_keys) if keys or operator_keys else None
        errors = ErrorInterceptor(ErrorCount(self.metrics.rpc_errors))  # every status but OK: counted and logged
        interceptors = ([self.api_keys] if self.api_keys else []) + [errors]
        options = [*_PUBLIC_SERVER_OPTIONS, *connection_options(cfg.handshake_timeout_seconds, self.max_connections)]
        server = grpc.aio.server(interceptors=interceptors, options=options)
        # Structured output grammars compile in child processes, bounded in time (docs/design/sampling.md, "Grammars
        # compile in child processes").
        grammars = GrammarCompiler(self.model_dir, self.model_config.vocab_size)
        loras = LoRARegistry(self.config.lora.max_loras if self.config.lora.enable_lora else 0, self.config.lora.adapters)
        self.metrics.load.configure_lora(loras.max_loras, loras.in_use)  # vllm:lora_requests_info
        self.servicer = GenerationServicer(None, self.tokenizer, self.model_info(0),
                                           api_keys=self.api_keys is not None, grammars=grammars, keys=self.api_keys,
                                           loras=loras)
        generate_pb2_grpc.add_GenerationServicer_to_server(self.servicer, server)
        # The engine protocol a gateway (smg) routes, on the same port and engine.
        self.kv_connector = self._kv_connector()
        if self.kv_connector is not None:  # a moved tpserve.v1 stream carries its KV
            self.servicer.moves = StreamMoves(self.kv_connector, max(cfg.shutdown_grace_seconds, 1.0))
        vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(VllmEngineServicer(
            self.servicer, self.model_dir, cfg.max_kv_event_subscribers, self.kv_connector), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.public_health, server)
        # grpc.reflection.v1 and v1alpha (launch/reflection.py)
        enable_server_reflection((GENERATION_SERVICE, VLLM_ENGINE_SERVICE, health.SERVICE_NAME), server)
        return server

    async def move_streams_out(self) -> None:
        """Draining with a KV connector: every ``tpserve.v1`` stream ends now with its blocks held for the
        replica its client continues on (coordinator/kv_transfer/stream_moves.py)."""
        if self.servicer is not None and self.servicer.moves is not None and self.servicer.engine is not None:
            await self.servicer.moves.move_out(self.servicer.engine)

    async def kv_holds_ended(self) -> None:
        """Waits until every KV hold ended (pulled, or its ``hold_timeout_s``): the ranks must outlive them."""
        if self.kv_connector is not None:
            await self.kv_connector.holds_ended()

    def _kv_connector(self) -> KVConnector | None:
        """The prefill/decode hand-offs of ``--kv-transfer-config`` (coordinator/kv_transfer/), or None.
        With a cluster secret, tenant ids come from it, so a tenant has one namespace on every replica.

        Raises:
            StartupError: the cluster secret file cannot be read.
        """
        kv = self.config.kv_transfer.kv_transfer_config
        if kv is None:
            return None
        secret = read_group_secret(self.config)
        if secret is not None:
            share_tenant_key(secret)
        return KVConnector(kv, self.config.parallel.tensor_parallel_size, self.config.cache.block_size, secret,
                           KVTransferMetrics(self.metrics.registry), self.config.cache.kv_cache_dtype,
                           self.kv_control_key)

    def attach(self, engine: Engine, num_kv_blocks: int, dtype: str) -> None:
        """Serves ``engine`` from now on; GetModelInfo reports the pool and the ranks' dtype."""
        self.dtype = dtype
        self.servicer.engine = engine
        if self.kv_connector is not None:
            def blocks_freed() -> None:  # a hold that ends frees blocks between steps, when no step may follow:
                engine.gauges.update()  # the usage and saturation gauges show it now,
                engine.lifecycle.wakeup.set()  # and a request waiting for those blocks starts now
            self.kv_connector.on_blocks_freed = blocks_freed
        self.servicer.model_info = self.model_info(num_kv_blocks)
        freeze_startup_heap()
        set_serving_gc_thresholds()  # young collections every 50,000 allocations (coordinator/gc_policy.py)

    async def set_serving(self, serving: bool) -> None:
        """The health service's answer, for the whole server ("") and for Generation: readiness. The
        liveness service (:data:`LIVENESS_SERVICE`) is not changed: it stays SERVING."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", GENERATION_SERVICE):
            await self.health.set(service, status)

    def model_info(self, num_kv_blocks: int) -> pb.ModelInfo:
        """What GetModelInfo answers with a pool of ``num_kv_blocks`` (0 while the ranks load)."""
        servicer = getattr(self, "servicer", None)  # none yet for the first answer, built with it
        cfg, engine = self.config, None if servicer is None else servicer.engine
        state_slots = None if engine is None else engine.scheduler.state_slots  # hybrids
        return pb.ModelInfo(
            model_name=cfg.load.served_model_name or (self.model_dir.name if cfg.load.model else DEFAULT_MODEL_NAME),
            max_model_len=self.max_model_len,
            vocab_size=self.model_config.vocab_size,
            tensor_parallel_size=cfg.parallel.tensor_parallel_size,
            pipeline_parallel_size=cfg.parallel.pipeline_parallel_size,
            dtype=self.dtype,
            eos_token_ids=sorted(self.tokenizer.eos_token_ids),
            num_kv_blocks=num_kv_blocks,
            block_size=cfg.cache.block_size,
            quantization=served_quantization(self.model_config.hf_config, cfg.load.quantization),
            speculative_method=cfg.speculative.speculative_method or "",
            num_speculative_tokens=cfg.speculative.num_speculative_tokens or 0,
            enable_prefix_caching=cfg.cache.enable_prefix_caching,
            kv_cache_dtype=cfg.cache.kv_cache_dtype,
            server_version=__version__,
            async_scheduling=engine is not None and engine.scheduler.async_scheduling,
            enable_expert_parallel=cfg.parallel.enable_expert_parallel,
            num_state_slots=state_slots.num_live if state_slots is not None else 0,
            num_state_checkpoint_slots=state_slots.num_checkpoints if state_slots is not None else 0,
        )

    def serving_fields(self, nnodes: int) -> dict[str, object]:
        """What is on, for the one ``serving`` log line: the model and how it is run, the KV cache, the
        features, the security of the public port and where the metrics and the traces go."""
        cfg, info, engine = self.config, self.servicer.model_info, self.servicer.engine
        spec = cfg.speculative
        server = cfg.server
        tls = "off" if not server.ssl_certfile else "mutual" if server.ssl_ca_certs else "on"
        return dict(
            model=str(self.model_dir), served_model_name=info.model_name, dtype=info.dtype,
            quantization=info.quantization or "none", tensor_parallel_size=cfg.parallel.tensor_parallel_size,
            pipeline_parallel_size=cfg.parallel.pipeline_parallel_size,
            enable_expert_parallel=cfg.parallel.enable_expert_parallel, nnodes=nnodes,
            num_kv_blocks=info.num_kv_blocks, kv_cache_tokens=info.num_kv_blocks * info.block_size,
            num_state_slots=info.num_state_slots, num_state_checkpoint_slots=info.num_state_checkpoint_slots,
            kv_cache_dtype=info.kv_cache_dtype, kv_cache_layout=self.kv_cache_layout(),
            max_model_len=self.max_model_len, enable_prefix_caching=cfg.cache.enable_prefix_caching,
            speculative_method=spec.speculative_method or "off",
            num_speculative_tokens=spec.num_speculative_tokens or 0,
            async_scheduling="on" if engine is not None and engine.scheduler.async_scheduling else "off",
            num_scheduler_steps=engine.scheduler.num_scheduler_steps if engine is not None else 1,
            event_loop=running_loop_name(), sched_policy=policy_name(),
            address=f"{server.host}:{self.port}", tls=tls, api_key="on" if self.api_keys is not None else "off",
            operator_api_key="on" if server.operator_api_key or server.operator_api_key_file else "off",
            metrics_url=(f"http://{_url_host(server.host)}:{self.metrics_port}/metrics"
                         if self.metrics_port is not None else "off"),
            otlp_traces_endpoint=server.otlp_traces_endpoint or "off",
            version=__version__,
        )

    def kv_cache_layout(self) -> str:
        """What one token's cache holds in one layer on one rank, e.g. ``"latent:576"`` (DeepSeek V3: the
        latent and the RoPE key) or ``"per_head:2x8x128"`` (K and V of 8 heads of 128): the layout the
        ranks sized ``kv_cache_tokens`` from (tpserve/model_config.py's ``kv_cache_spec``)."""
        spec = self.model_config.kv_cache_spec(self.config.parallel.tensor_parallel_size)
        if spec.kind == "latent":
            return f"latent:{spec.elements_per_token}"
        return f"per_head:2x{spec.first[0]}x{spec.first[1]}"

    def reload(self) -> None:
        """SIGHUP: read the API keys and the TLS files again (rotation without a restart).

        What fails to read or check is logged and left as it was; requests in flight and
        open connections are not touched. Keys given with ``--api-key`` alone do not change.
        """
        cfg = self.config.server
        if self.api_keys is not None:
            try:
                keys = read_api_keys(cfg.api_key, cfg.api_key_file)
                operator_keys = read_api_keys(cfg.operator_api_key, cfg.operator_api_key_file,
                                              "--operator-api-key-file")
                self.api_keys.set_keys(keys, operator_keys)
                log.info("API keys reloaded", num_keys=len(keys), num_operator_keys=len(operator_keys))
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

    async def stop(self, grace_s: float) -> None:
        """Stops the port: in-flight RPCs get ``grace_s`` seconds, then the servicer's streams close."""
        if self._watch is not None:
            self._watch.stop()
        if self._server is not None:
            self.public_health.close()  # a health Watch would hold the stop for the whole grace
            await self._server.stop(grace_s)
        if self._health_server is not None:
            await self._health_server.stop(None)
        if self.servicer is not None:
            await self.servicer.close()

    def close_grammars(self) -> None:
        """Ends the structured-output compiler's child processes."""
        if self.servicer is not None:
            self.servicer.grammars.close()


def freeze_startup_heap() -> None:
    """Moves every object alive now (modules, the tokenizer, the engine: start-up's heap) out of
    the garbage collector's reach, as vLLM and SGLang do once serving starts.

    Serving allocates and frees a few objects per token (outputs, protobuf messages, futures);
    each full collection they trigger would otherwise walk the whole start-up heap again (about
    8% of the coordinator's CPU at 64 streams before this; benchmarks/coordinator_cpu.py).
    Objects frozen here are never collected, so only what lives for the process is frozen:
    a collection first frees start-up's garbage. Requests in flight are not frozen with it
    (none is: it runs before the health service says SERVING).
    """
    gc.collect()
    gc.freeze()


def _url_host(host: str) -> str:
    """Where a client on this machine reaches a port bound to ``host`` (``--host``): ``localhost`` for every
    interface, else the address itself (an IPv6 one in brackets)."""
    if host in ("", "0.0.0.0", "::"):
        return "localhost"
    return f"[{host}]" if ":" in host else host
