"""Cluster configuration: one frozen, validated model per concern, loaded in one place.

Precedence, lowest first: field defaults < YAML file (``--config``) < command-line
flags. Flag names follow vLLM (``--tensor-parallel-size``, ``--max-num-seqs``,
``--max-num-batched-tokens``, ``--block-size``, ``--max-model-len``, ``--dtype``,
``--quantization``, ``--enforce-eager``, ``--cuda-graph-sizes``).
Validation errors are pydantic ``ValidationError`` (a ``ValueError``) naming the field.

No torch here: the coordinator reads this too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from tpserve.config_base import INT32_MAX, FrozenSection
from tpserve.config_file import read_config_file
from tpserve.cpu_binding import parse_bind
from tpserve.kv_transfer_config import KVTransferSection
from tpserve.kv_wire import is_loopback
from tpserve.leader_ports import check_port_clashes
from tpserve.lora_config import LoRAConfig
from tpserve.otlp_endpoint import check_otlp_endpoint
from tpserve.quantization import Quantization
from tpserve.speculative_config import SpeculativeConfig

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
Device = Literal["auto", "cpu", "cuda"]


class LoadConfig(FrozenSection):
    """What to serve.

    Attributes:
        model: Hugging Face checkpoint directory. None: the embedded default model.
        served_model_name: name reported by GetModelInfo; None: the directory's name.
        dtype: weight and activation dtype; "auto" is float32 on the CPU and, on
            CUDA, the checkpoint's half-precision ``torch_dtype`` (bfloat16 for a
            float32 checkpoint).
        device: "auto" is CUDA when available, else the CPU.
        quantization: "int4": weight-only 4-bit (group-wise, tpserve/quantization_int4.py), or
            "int8": weight-only int8 (per-output-channel symmetric scales,
            activations in ``dtype``) for every decoder linear layer, quantized from
            a float checkpoint at load time (vLLM's flag name). None: the weights as
            stored; a compressed-tensors int8 checkpoint is int8 either way
            (tpserve/quantization.py).
        enforce_eager: never replay decode steps from CUDA graphs (vLLM's flag); a
            no-op on the CPU.
        cuda_graph_sizes: the decode batch sizes captured as CUDA graphs, in
            sequences (worker/cuda_graphs.py); None: vLLM's 1, 2, 4, 8, 16, 24, ...
            up to the first that holds ``--max-num-seqs``.
        cpu_omp_threads_bind: the cores CPU ranks run on (vLLM's
            ``VLLM_CPU_OMP_THREADS_BIND``): "auto" gives each rank cores of its own, the
            last ones, where a host has two ranks or more and their threads fit (a lone
            rank stays free to move); "nobind" leaves them to the
            kernel; "0-3|4-7" names each local rank's cores (tpserve/cpu_binding.py).
    """

    model: str | None = None
    served_model_name: str | None = None
    dtype: Dtype = "auto"
    device: Device = "auto"
    quantization: Quantization | None = None
    enforce_eager: bool = False
    cuda_graph_sizes: tuple[Annotated[int, Field(ge=1, le=512)], ...] | None = Field(None, min_length=1)
    cpu_omp_threads_bind: str = "auto"

    @field_validator("cpu_omp_threads_bind")
    @classmethod
    def _check_bind(cls, value: str) -> str:
        parse_bind(value)  # a ValueError names what is wrong
        return value


class ParallelConfig(FrozenSection):
    """How the model is split, and over how many hosts (vLLM's and SGLang's flag names).

    Attributes:
        tensor_parallel_size: worker ranks per pipeline stage (Megatron-LM tensor parallelism).
        pipeline_parallel_size: pipeline stages the decoder layers are split into
            (tpserve/pipeline_split.py); the group has ``tensor_parallel_size *
            pipeline_parallel_size`` ranks (``world_size``), stage-major.
        distributed_timeout_seconds: a collective that waits longer than this fails
            the step instead of hanging it (a lost rank).
        nnodes: hosts the group spans; each runs ``world_size / nnodes``
            ranks (node n holds global ranks ``n*L .. n*L+L-1``: with pipeline stages,
            whole stages per host when ``nnodes`` divides ``pipeline_parallel_size``).
        node_rank: this host's index; 0 is the leader (coordinator + its ranks).
        master_addr: the leader's host name or address, as every host can reach it
            (required when ``nnodes > 1``).
        master_port: the leader's node registry port; the group also uses the next
            ports (see :mod:`launch.topology`).
        headless: run only this host's ranks, no public API (every ``node_rank > 0``).
        cluster_secret_file: a file holding a secret shared by every host of the
            group; the node registry and the ranks refuse internal calls without it
            (:mod:`tpserve.cluster_secret`). Recommended whenever ``nnodes > 1``.
        enable_expert_parallel: mixture-of-experts layers hold ``num_experts /
            tensor_parallel_size`` whole experts per rank instead of a slice of every
            expert (vLLM's ``--enable-expert-parallel``; worker/layers/moe.py); the
            expert-parallel group is the tensor-parallel group.
    """

    tensor_parallel_size: int = Field(1, ge=1, le=64)
    pipeline_parallel_size: int = Field(1, ge=1, le=64)
    distributed_timeout_seconds: float = Field(60.0, gt=0)
    nnodes: int = Field(1, ge=1, le=64)
    node_rank: int = Field(0, ge=0, le=INT32_MAX)
    master_addr: str | None = None
    master_port: int = Field(29500, ge=1, le=65535 - 2 - 64)
    headless: bool = False
    cluster_secret_file: str | None = None
    enable_expert_parallel: bool = False

    @property
    def world_size(self) -> int:
        """Every rank of the group: ``tensor_parallel_size * pipeline_parallel_size``."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @model_validator(mode="after")
    def _check_layout(self) -> ParallelConfig:
        if self.world_size % self.nnodes:
            ranks = f"tensor_parallel_size={self.tensor_parallel_size}" + (
                f" x pipeline_parallel_size={self.pipeline_parallel_size} = {self.world_size} ranks"
                if self.pipeline_parallel_size > 1 else "")
            raise ValueError(f"{ranks} is not divisible by nnodes={self.nnodes}")
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank={self.node_rank} must be < nnodes={self.nnodes}")
        if self.headless != (self.node_rank > 0):
            raise ValueError("headless is required on every node_rank > 0 and not allowed on node_rank 0 "
                             f"(got node_rank={self.node_rank}, headless={self.headless})")
        if self.nnodes > 1 and not self.master_addr:
            raise ValueError(f"master_addr is required with nnodes={self.nnodes}: the leader's host name or address")
        if self.master_addr is not None and ("/" in self.master_addr or self.master_addr.count(":") == 1):
            # Catches URLs such as Kubernetes' service links (tcp://10.0.0.7:29500) and host:port.
            raise ValueError(f"master_addr must be a host name or an address, got {self.master_addr!r}")
        return self


class CacheConfig(FrozenSection):
    """The paged KV cache; each rank sizes it as worker/memory.py says.

    Attributes:
        block_size: tokens per KV block.
        gpu_memory_utilization: share of a GPU's memory a rank may use (weights,
            activations and KV cache); on the CPU it scales the share of available
            RAM the KV cache takes. Used when neither of the next two is set.
        kv_cache_memory_bytes: per-rank memory budget for the KV cache, in bytes;
            None: sized from free memory.
        num_gpu_blocks_override: use exactly this many blocks (tests, capacity planning).
        enable_prefix_caching: share the KV blocks of common prompt prefixes between
            requests (vLLM's automatic prefix caching; coordinator/block_allocator.py).
        kv_cache_dtype: the cache's element type (vLLM's ``--kv-cache-dtype``): "auto" is
            the activations' dtype; "fp8" (float8 e4m3) and "int8" store 1 byte per element
            and a 2-byte scale per token and KV head (worker/kv_quant.py), so the same memory
            holds ``2d / (d + 2)`` times the blocks of a 16-bit cache (1.94x at head_dim 64).
        kv_offloading_size: GiB of host memory for the prefix cache's second tier, summed over
            the group's ranks (vLLM's ``--kv-offloading-size``): blocks the device pool evicts
            are kept there and copied back on a prefix hit, and preemption swaps through it
            (coordinator/kv_host_tier.py); None: no tier.
        num_cpu_blocks_override: exactly this many host-tier blocks (tests, capacity planning);
            takes precedence over ``kv_offloading_size``.
    """

    block_size: int = Field(16, ge=1, le=1024)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    kv_cache_memory_bytes: int | None = Field(None, gt=0, le=2**63 - 1)
    num_gpu_blocks_override: int | None = Field(None, ge=1, le=INT32_MAX)
    enable_prefix_caching: bool = True
    kv_cache_dtype: Literal["auto", "fp8", "int8"] = "auto"
    kv_offloading_size: float | None = Field(None, gt=0, le=2**20)
    num_cpu_blocks_override: int | None = Field(None, ge=1, le=INT32_MAX)

    @property
    def host_tier_on(self) -> bool:
        """Whether the prefix cache has a host tier."""
        return self.kv_offloading_size is not None or self.num_cpu_blocks_override is not None

    @model_validator(mode="after")
    def _check_host_tier(self) -> CacheConfig:
        if self.host_tier_on and not self.enable_prefix_caching:
            raise ValueError("--kv-offloading-size / --num-cpu-blocks-override keep prefix-cache blocks: they "
                             "need --enable-prefix-caching")
        return self


class SchedulerConfig(FrozenSection):
    """Continuous batching limits.

    Attributes:
        max_num_seqs: most sequences in one step.
        max_num_batched_tokens: token budget of one step (prefill chunks + decodes).
        max_model_len: longest sequence in tokens; None: the model's
            ``max_position_embeddings``. Larger than that is refused at start-up.
        max_queue_len: most requests waiting for admission; more get RESOURCE_EXHAUSTED.
        async_scheduling: plan step t+1 while step t runs, before its result (vLLM's
            ``--async-scheduling``): the ranks find their next plan waiting when a step
            ends instead of waiting for the coordinator's round trip (coordinator/scheduler.py).
            None (the default): on where it is supported and pays, that is without
            speculative decoding or pipeline stages, on CUDA ranks (vLLM's rule) and on CPU
            ranks that leave the coordinator a core of its own; off on CPU ranks that take
            every core (the default thread split), where the coordinator's work during a
            step takes a core from a rank's threads (benchmarks/README.md, step_overhead).
            True with speculative decoding or pipeline stages is refused.
        num_scheduler_steps: most decode steps one plan runs (vLLM's ``--num-scheduler-steps``):
            while every running sequence decodes and no waiting one could be admitted (none waits,
            or every slot is taken), the ranks run up to this many steps per plan, feeding their
            own samples, so the coordinator's work and round trip come once per that many tokens
            (coordinator/multi_step.py); an arriving request waits for the plan's end. 1 (the default): a plan per step. More than 1 not with
            speculative decoding, pipeline stages or ``async_scheduling`` (then off by default).
            Such a plan's timeout is k times ``ServerConfig.step_timeout_seconds``.
        priority_aging_seconds: seconds of waiting worth one priority level: a request's
            effective priority is ``priority - waited_s / priority_aging_seconds``, so no
            request waits forever behind a stream of more urgent ones; 0: strict priority
            (vLLM's order, no aging). coordinator/priority.py.
    """

    max_num_seqs: int = Field(64, ge=1, le=INT32_MAX)
    max_num_batched_tokens: int = Field(2048, ge=1, le=INT32_MAX)
    max_model_len: int | None = Field(None, ge=2, le=INT32_MAX)
    max_queue_len: int = Field(1024, ge=1, le=INT32_MAX)
    async_scheduling: bool | None = None
    num_scheduler_steps: int = Field(1, ge=1, le=1024)
    priority_aging_seconds: float = Field(10.0, ge=0, allow_inf_nan=False)  # coordinator.priority.DEFAULT_PRIORITY_AGING_S


class ServerConfig(FrozenSection):
    """The public gRPC endpoint and its neighbours.

    Attributes:
        host: address to bind.
        port: gRPC port.
        metrics_port: Prometheus /metrics HTTP port; None disables it.
        worker_start_timeout_seconds: how long every rank may take to load its shard.
        step_timeout_seconds: how long the coordinator waits for one step's results.
        shutdown_grace_seconds: on SIGTERM or SIGINT, how long in-flight requests
            may run to completion before the server stops (Kubernetes'
            terminationGracePeriodSeconds must be longer).
        worker_recovery_timeout_seconds: a lost rank (killed, crashed, or not
            answering) or, across hosts, a lost node makes the coordinator restart the
            whole group (waiting for lost nodes to join again) and resume every request
            by recompute, within this many seconds, else they fail with UNAVAILABLE and
            it exits 1; 0 fails them at once and exits 1 for the orchestrator to
            restart the group.
        ssl_certfile, ssl_keyfile: PEM certificate chain and key: the public port
            speaks TLS (both or neither).
        ssl_ca_certs: PEM CA bundle: clients must present a certificate it signed
            (mutual TLS).
        api_key, api_key_file: accepted tenant bearer keys (the file: one per line);
            Generation calls without one get UNAUTHENTICATED (coordinator/auth.py).
        operator_api_key, operator_api_key_file: accepted operator keys (a gateway's,
            an administrator's): they may also flush the prefix cache, subscribe to its
            events, read server-wide state and use priorities below 0 (coordinator/auth.py).
        max_kv_event_subscribers: most SubscribeKvEvents streams at once; one more gets
            RESOURCE_EXHAUSTED (coordinator/kv_events.py).
        handshake_timeout_seconds: a connection to the public port (or the health port) that
            has not sent the HTTP/2 preface and SETTINGS (and, with TLS, finished its
            handshake) within this many seconds is closed (gRPC's default: 120 s).
        max_connections: connections the public port accepts at a time; past it new ones are
            closed at once. None: what the open-file limit leaves after 256 descriptors for
            the server itself (launch/connection_limits.py).
        health_port: a second port serving only the gRPC health service (plaintext, its own
            small connection cap): probes and gateways get an answer while the public port
            is at its cap or speaks TLS. None: health on the public port only.
        stream_interval: tokens a stream gathers before it is sent (vLLM's and SGLang's
            ``--stream-interval``); its first and last messages go at once. 1 sends every
            step's tokens; more: fewer messages, less coordinator CPU per token
            (coordinator/output_collector.py).
        otlp_traces_endpoint: OTLP/gRPC collector to send each request's trace spans to
            (vLLM's ``--otlp-traces-endpoint``; coordinator/tracing.py): ``http://HOST:PORT``,
            ``https://HOST:PORT``, ``grpc://HOST:PORT`` or ``HOST:PORT`` (tpserve/otlp_endpoint.py);
            None: no tracing, at no cost. Needs the ``tracing`` extra.
    """

    host: str = "0.0.0.0"
    port: int = Field(50051, ge=0, le=65535)
    metrics_port: int | None = Field(None, ge=0, le=65535)
    worker_start_timeout_seconds: float = Field(600.0, gt=0)
    step_timeout_seconds: float = Field(120.0, gt=0)
    worker_recovery_timeout_seconds: float = Field(120.0, ge=0)
    shutdown_grace_seconds: float = Field(5.0, ge=0)
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_ca_certs: str | None = None
    api_key: str | None = None
    api_key_file: str | None = None
    operator_api_key: str | None = None
    operator_api_key_file: str | None = None
    max_kv_event_subscribers: int = Field(16, ge=0, le=INT32_MAX)
    stream_interval: int = Field(1, ge=1, le=INT32_MAX)
    handshake_timeout_seconds: float = Field(10.0, gt=0)
    max_connections: int | None = Field(None, ge=1, le=INT32_MAX)
    health_port: int | None = Field(None, ge=0, le=65535)
    otlp_traces_endpoint: Annotated[str, AfterValidator(check_otlp_endpoint)] | None = None

    @model_validator(mode="after")
    def _check_tls(self) -> ServerConfig:
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("--ssl-certfile and --ssl-keyfile go together")
        if self.ssl_ca_certs is not None and self.ssl_certfile is None:
            raise ValueError("--ssl-ca-certs (mutual TLS) needs --ssl-certfile and --ssl-keyfile")
        return self


class ClusterConfig(FrozenSection):
    """Everything ``tpserve serve`` needs, composed from the per-concern configs."""

    load: LoadConfig = LoadConfig()
    parallel: ParallelConfig = ParallelConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()
    server: ServerConfig = ServerConfig()
    lora: LoRAConfig = LoRAConfig()
    kv_transfer: KVTransferSection = KVTransferSection()

    @model_validator(mode="after")
    def _check_kv_transfer(self) -> ClusterConfig:
        """Refuses, in one line, what a KV transfer (tpserve/kv_transfer_config.py) cannot carry: pipeline stages
        (a block is one stage's), prefix caching off (the blocks handed over are the prefix cache's) and a draft
        model (its cache would have to move too). An 8-bit cache moves with its scale pools; replicas whose
        caches differ (storage type, key offsets) refuse each other's blocks at the pull (a local prefill)."""
        if self.kv_transfer.kv_transfer_config is None:
            return self
        refused = [why for refuse, why in (
            (self.parallel.pipeline_parallel_size > 1, "--pipeline-parallel-size 1"),
            (self.cache.enable_prefix_caching is False, "--enable-prefix-caching"),
            (self.speculative.speculative_method == "draft", "no --speculative-method draft")) if refuse]
        if refused:
            raise ValueError(f"--kv-transfer-config needs {', '.join(refused)} (the blocks handed over are the "
                             "prefix cache's, of one stage, without a draft's cache)")
        kv = self.kv_transfer.kv_transfer_config
        if self.parallel.nnodes > 1:  # the coordinator reaches every rank's agent at side_channel_host
            raise ValueError("--kv-transfer-config needs --nnodes 1 (every rank's KV agent listens on "
                             "kv_connector_extra_config.side_channel_host, one host's address)")
        if self.parallel.cluster_secret_file is None and not is_loopback(kv.side_channel_host):
            # Without the secret nothing authenticates a peer's reads (every tenant's K/V) or the K/V a peer
            # serves (a poisoned prefix cache): docs/design/security.md, "The KV side channel".
            raise ValueError(f"--kv-transfer-config's kv_connector_extra_config.side_channel_host "
                             f"{kv.side_channel_host} listens beyond loopback: give --cluster-secret-file (the same "
                             "secret on every replica of the pair), or side_channel_host 127.0.0.1")
        return self

    @model_validator(mode="after")
    def _check_lora(self) -> ClusterConfig:
        if self.lora.enable_lora and self.speculative.speculative_method is not None:
            raise ValueError("--enable-lora does not combine with --speculative-method (proposals are not "
                             "verified under the request's adapter yet)")
        return self

    @model_validator(mode="after")
    def _check_async_scheduling(self) -> ClusterConfig:
        if self.scheduler.async_scheduling is True and self.speculative.speculative_method is not None:
            raise ValueError("--async-scheduling does not combine with --speculative-method (a proposal needs "
                             "the tokens before it)")
        if self.scheduler.async_scheduling is True and self.parallel.pipeline_parallel_size > 1:
            raise ValueError("--async-scheduling needs --pipeline-parallel-size 1 (micro-batches already keep "
                             "every stage busy)")
        return self

    @model_validator(mode="after")
    def _check_multi_step(self) -> ClusterConfig:
        steps = self.scheduler.num_scheduler_steps
        if steps == 1:
            return self
        # Each flag with its own reason (one shared reason named proposals where none were involved).
        refused = [f"{flag} ({reason})" for flag, on, reason in (
            ("--speculative-method", self.speculative.speculative_method is not None,
             "a plan of several steps feeds each step the one token sampled before it, without proposals"),
            ("--pipeline-parallel-size > 1", self.parallel.pipeline_parallel_size > 1,
             "a plan of several steps feeds each rank's own samples on one stage, and the last stage samples "
             "what the first one needs"),
            ("--async-scheduling", self.scheduler.async_scheduling is True,
             "both run the ranks ahead of the coordinator: a plan of several steps on the ranks, async scheduling "
             "by planning a step before the last one's result; the scheduler does one or the other")) if on]
        if refused:
            raise ValueError(f"--num-scheduler-steps {steps} does not combine with {'; '.join(refused)}")
        return self

    @model_validator(mode="after")
    def _check_bind_lists(self) -> ClusterConfig:
        lists = parse_bind(self.load.cpu_omp_threads_bind)
        local_ranks = self.parallel.world_size // self.parallel.nnodes
        if isinstance(lists, tuple) and len(lists) != local_ranks:
            raise ValueError(f"cpu_omp_threads_bind={self.load.cpu_omp_threads_bind!r} names {len(lists)} core "
                             f"lists for {local_ranks} ranks per host: give one per rank, '|'-separated")
        return self

    @model_validator(mode="after")
    def _check_ports(self) -> ClusterConfig:
        check_port_clashes(self)  # two of the leader's ports on one number, named (tpserve/leader_ports.py)
        return self

    def async_scheduling_on(self, device: str, spare_core: bool = False) -> bool:
        """Whether the engine plans ahead (``SchedulerConfig.async_scheduling``) on ranks of ``device``
        ("cpu" or "cuda"): as given, else on without speculative decoding or pipeline stages
        (vLLM 0.14's default, with the same exclusions) on CUDA, and on the CPU where
        ``spare_core``: the ranks on the coordinator's host leave it a core of their own
        (:func:`launch.leader.coordinator_has_a_core`). vLLM keeps it off on its CPU backend;
        with a core of its own the coordinator's planning overlaps the step instead of taking a
        core from the ranks' threads (benchmarks/README.md, step_overhead: 15-30 % lower TPOT at
        tp 1 with one thread on two cores, none of it with two)."""
        if self.scheduler.async_scheduling is not None:
            return self.scheduler.async_scheduling
        return (device == "cuda" or (device == "cpu" and spare_core)) and self.speculative.speculative_method is None \
            and self.parallel.pipeline_parallel_size == 1 and self.scheduler.num_scheduler_steps == 1

    @classmethod
    def load_from(cls, yaml_path: str | Path | None = None, overrides: dict[str, dict[str, Any]] | None = None) -> ClusterConfig:
        """Builds the config from an optional YAML file and flag overrides.

        Args:
            yaml_path: a YAML mapping with the sections ``load``, ``parallel``,
                ``cache``, ``scheduler``, ``speculative``, ``server``.
            overrides: ``{section: {field: value}}`` from flags; ``None`` values
                mean "not given" and are ignored.

        Raises:
            ValueError: not YAML or not a mapping of sections (one line naming the file and, for a
                syntax error, the line and column), an unknown section or field, or a value out of range.
            OSError: the YAML file cannot be read.
        """
        data = read_config_file(yaml_path) if yaml_path is not None else {}
        for section, values in (overrides or {}).items():
            data.setdefault(section, {}).update({k: v for k, v in values.items() if v is not None})
        return cls.model_validate(data)


class RankConfig(FrozenSection):
    """What one worker rank runs with: the cluster's configuration and the rank's place in the group.

    The launcher (launch/local_ranks.py) writes it as JSON (:meth:`to_json`) and the rank reads
    it back with the same validation (:meth:`from_json`, worker/main.py): one object crosses the
    process boundary, not a flag list. A rank's same-host peers are the global ranks
    ``node_rank * local_world_size + [0, local_world_size)`` (launch/topology.py).

    Attributes:
        cluster: the whole cluster configuration, as the launching node validated it (by hand:
            the defaults when left out).
        model_dir: the checkpoint directory, resolved (the embedded model when
            ``cluster.load.model`` is None).
        rank, world_size: this global rank and the group's number of ranks, ``tensor_parallel_size *
            pipeline_parallel_size`` (``cluster.parallel.world_size``: the rank takes its tensor- and
            pipeline-parallel sizes from ``cluster.parallel``).
        local_rank, local_world_size, node_rank: the rank's place on its host.
        address: the gRPC address its WorkerService binds, e.g. ``unix:///tmp/tpserve-x/rank0-1.sock``.
        init_method: the torch.distributed rendezvous, e.g. ``tcp://10.0.0.7:29501``.
        log_format: "console" or "json", as ``--log-format``.

    Raises:
        ValueError: a rank outside ``[0, world_size)``, a local rank outside ``[0, local_world_size)``,
            or a ``world_size`` other than ``cluster.parallel.world_size``.
    """

    cluster: ClusterConfig = ClusterConfig()
    model_dir: str
    rank: int = Field(ge=0)
    world_size: int = Field(ge=1)
    local_rank: int = Field(ge=0)
    local_world_size: int = Field(ge=1)
    node_rank: int = Field(0, ge=0)
    address: str
    init_method: str
    log_format: Literal["console", "json"] = "console"

    @model_validator(mode="after")
    def _check_place(self) -> RankConfig:
        if self.world_size != self.cluster.parallel.world_size:
            par = self.cluster.parallel
            raise ValueError(f"world_size={self.world_size} must be tensor_parallel_size={par.tensor_parallel_size}"
                             f" x pipeline_parallel_size={par.pipeline_parallel_size} = {par.world_size}")
        if self.rank >= self.world_size:
            raise ValueError(f"rank={self.rank} must be < world_size={self.world_size}")
        if self.local_rank >= self.local_world_size:
            raise ValueError(f"local_rank={self.local_rank} must be < local_world_size={self.local_world_size}")
        return self

    def to_json(self) -> str:
        """The JSON text a rank reads back with :meth:`from_json`, without the tenants' and operators' API
        keys: the coordinator checks them, the ranks never do, and the file outlives a coordinator killed
        with SIGKILL (it is in a 0700 temporary directory that only a clean stop removes)."""
        return self.model_dump_json(indent=1, exclude={"cluster": {"server": {"api_key", "operator_api_key"}}})

    @classmethod
    def from_json(cls, text: str | bytes) -> RankConfig:
        """Parses and validates :meth:`to_json`'s text.

        Raises:
            pydantic.ValidationError: malformed JSON, an unknown or missing field, a value out of range.
        """
        return cls.model_validate_json(text)
