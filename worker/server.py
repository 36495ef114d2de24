"""A worker rank's gRPC service: load the shard, size the KV cache, execute step plans.

The rank starts serving ``GetStatus`` at once and loads its shard on a background
thread, so the coordinator can tell "still loading" from "dead". It never decides
what runs: each ``StepPlan`` it receives is executed as it is, in arrival order, on
one thread (collectives need every rank to issue them in the same order): the step
socket's (worker/step_socket_server.py) for the coordinator of its own host, the
``Step`` stream's for one on another host.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field, replace

import grpc
import structlog

from tpserve.quantization import served_quantization
from tpserve.step_pb import ERRORS_ONLY, STEP_PROTOCOL, plan_from_pb, result_to_pb
from tpserve.v1 import worker_pb2 as pb
from tpserve.v1 import worker_pb2_grpc
from worker.lora_settings import LoRASettings
from worker.memory import CacheSizing, weight_bytes

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class WorkerOptions:
    """What a rank needs to come up.

    Attributes:
        model_dir: Hugging Face checkpoint directory.
        rank: this rank's global index, ``[0, world_size)`` (:attr:`world_size`: every rank,
            ``tensor_parallel_size * pipeline_parallel_size``).
        tensor_parallel_size: ranks per pipeline stage, the degree every layer is split over.
        init_method: torch.distributed rendezvous, e.g. ``tcp://127.0.0.1:29500``.
        device: "cpu", "cuda" or "auto".
        dtype: "auto", "float32", "bfloat16" or "float16".
        block_size: tokens per KV block.
        distributed_timeout_seconds: collective timeout.
        local_rank, local_world_size, node_rank: the rank's place on its host; its
            same-host peers are global ranks ``node_rank * local_world_size + [0, local_world_size)``.
            Local rank ``r`` computes on ``cuda:r`` (worker/device.py).
        cache: how to size the KV cache (worker/memory.py); its ``num_local_ranks``
            is replaced by ``local_world_size``.
        quantization: "int8" or "int4" (``--quantization``) or None (tpserve/quantization.py).
        kv_cache_dtype: ``--kv-cache-dtype``: "auto", "fp8" or "int8" (worker/kv_quant.py).
        draft_model_dir: ``--speculative-model``, or None.
        enforce_eager: no CUDA graphs (``--enforce-eager``).
        cuda_graph_sizes: the decode batch sizes to capture on CUDA; None: the default
            for ``cache.max_num_seqs`` (worker/cuda_graphs.py).
        cpu_omp_threads_bind: a CPU rank's cores (``--cpu-omp-threads-bind``; tpserve/cpu_binding.py).
        pipeline_parallel_size: stages (worker/pipeline.py).
        enable_expert_parallel: whole experts per rank (``--enable-expert-parallel``; worker/layers/moe.py).
        lora: ``--enable-lora``'s slot pool and adapters (worker/lora_adapters.py), or None.
    """

    model_dir: str
    rank: int
    tensor_parallel_size: int
    init_method: str
    device: str
    dtype: str
    block_size: int
    distributed_timeout_seconds: float
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    cache: CacheSizing = field(default_factory=CacheSizing)
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    draft_model_dir: str | None = None
    enforce_eager: bool = False
    cuda_graph_sizes: tuple[int, ...] | None = None
    cpu_omp_threads_bind: str = "auto"
    pipeline_parallel_size: int = 1
    enable_expert_parallel: bool = False
    lora: LoRASettings | None = None

    @property
    def world_size(self) -> int:
        """Every rank of the group: ``tensor_parallel_size * pipeline_parallel_size``."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


class WorkerServicer(worker_pb2_grpc.WorkerServiceServicer):
    """Serves one rank. ``on_fatal`` is called (once) when the rank can no longer serve."""

    def __init__(self, options: WorkerOptions, on_fatal: Callable[[str], None]) -> None:
        self.options = options
        self._on_fatal = on_fatal
        self._runner = None
        self._num_blocks_available = 0
        self._num_state_slots = 0  # hybrid models: state slots this rank holds (worker/memory.py cache_split)
        self._error = ""
        self._dtype = ""
        self._device = None  # torch.device, once resolved by load()
        self._num_threads = 0  # a CPU rank's intra-op threads, once load() has set them
        self._ready = threading.Event()

    @property
    def kv_caches(self) -> list:
        """This rank's block tensors (empty before InitCache): every layer's KV cache, and an 8-bit cache's
        scale pools (``ModelRunner.block_tensors``): the KV agent's view (worker/kv_transfer/agent.py)."""
        runner = self._runner
        return runner.block_tensors() if runner is not None else []

    @property
    def kv_codec(self) -> str:
        """What the cache's codes mean beyond their bytes (``ModelRunner.kv_codec``; "" before InitCache)."""
        runner = self._runner
        return runner.kv_codec if runner is not None and runner.num_blocks else ""

    def load(self) -> None:
        """Joins the process group, loads this rank's shard and sizes its KV cache (background thread)."""
        try:
            # torch is imported here, not at module import, so that the rank answers
            # GetStatus while the (slow) import and the load run.
            import torch

            from worker.device import bind_thread, resolve_device
            from worker.memory import cache_split
            from worker.model_runner import ModelRunner
            from worker.nccl_env import configure_nccl_env
            from worker.parallel_state import init_distributed
            from worker.pipeline_checks import check_pipeline_graphs

            opts = self.options
            device = resolve_device(opts.device, opts.local_rank, opts.local_world_size)
            self._device = device
            bind_thread(device)
            cpu_cores = "-"
            if device.type == "cpu":
                cpu_cores = self._place_on_cores(torch)
            self._num_threads = torch.get_num_threads() if device.type == "cpu" else 0
            if device.type == "cuda":
                configure_nccl_env()  # before the process group exists: NCCL reads it at creation
            check_pipeline_graphs(opts.pipeline_parallel_size, device.type, opts.enforce_eager)
            # Shared-memory collectives wherever ranks of the stage share a host: init_distributed
            # finds which do (one host: shared memory; several: two levels; a rank per host: gloo).
            ctx = init_distributed(opts.rank, opts.tensor_parallel_size, opts.init_method, device,
                                   opts.distributed_timeout_seconds, pp_size=opts.pipeline_parallel_size,
                                   enable_expert_parallel=opts.enable_expert_parallel)
            dtype = _resolve_dtype(opts.dtype, opts.model_dir, device)
            self._runner = ModelRunner(opts.model_dir, ctx, dtype, opts.block_size, quantization=opts.quantization,
                                       draft_model_dir=opts.draft_model_dir, kv_cache_dtype=opts.kv_cache_dtype,
                                       lora=opts.lora)
            self._dtype = str(dtype).removeprefix("torch.")
            cache = replace(opts.cache, num_local_ranks=opts.local_world_size)
            self._num_blocks_available, self._num_state_slots = cache_split(self._runner, cache)
            log.info("shard loaded", rank=opts.rank, world_size=opts.world_size, tp_rank=ctx.tp_rank,
                     tp_size=ctx.tp_size, pp_rank=ctx.pp_rank, pp_size=ctx.pp_size,
                     enable_expert_parallel=ctx.enable_expert_parallel, dtype=str(dtype),
                     quantization=served_quantization(self._runner.config.hf_config, opts.quantization) or "none",
                     weight_bytes=weight_bytes(self._runner.model),
                     device=str(device), num_kv_blocks_available=self._num_blocks_available,
                     num_state_slots_available=self._num_state_slots,
                     kv_cache_dtype=opts.kv_cache_dtype,  # the flag, as the coordinator's `serving` line says it
                     kv_cache_storage=str(self._runner.kv_cache_dtype).removeprefix("torch."),
                     all_reduce=ctx.all_reduce_path, threads=self._num_threads, cpu_cores=cpu_cores,
                     **self._int4_layout())
            self._ready.set()
        except Exception as exc:  # noqa: BLE001 - reported to the coordinator, then fatal
            self._error = f"rank {self.options.rank}: {type(exc).__name__}: {exc}"
            log.error("loading failed", error=self._error)
            self._on_fatal(self._error)

    def _int4_layout(self) -> dict[str, int]:
        """For an int4 model, how many of its weights the CPU kernel's tile layout holds (repacked at load on
        AMX-INT8 CPUs: worker/layers/int4_matmul.py), for the ``shard loaded`` line; else nothing."""
        if self._runner is None or self._runner.model.quantization != "int4" \
                or "int4" not in served_quantization(self._runner.config.hf_config, self.options.quantization):
            return {}  # no 4-bit layer (an 8-bit packed checkpoint is the same layer kind)
        from worker.layers.int4_matmul import tile_layout_layers

        return {"int4_tile_layout_layers": tile_layout_layers(self._runner.model)}

    def _place_on_cores(self, torch) -> str:
        """A CPU rank's threads and cores (tpserve/cpu_binding.py): its share of the cores this
        process may run on unless ``OMP_NUM_THREADS`` says otherwise, then its binding. Returns
        the cores for the log, as a cpulist, or why they were left to the kernel.

        Raises:
            ValueError: explicit core lists that do not fit this host (fatal: reported at start-up).
        """
        from tpserve.cpu_binding import bind_process, default_num_threads, format_cpulist, rank_binding

        opts = self.options
        allowed = os.sched_getaffinity(0)
        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(default_num_threads(opts.cpu_omp_threads_bind, opts.local_rank,
                                                      opts.local_world_size, allowed))
        binding = rank_binding(opts.cpu_omp_threads_bind, opts.local_rank, opts.local_world_size,
                               torch.get_num_threads(), allowed)
        if binding.cores is None:
            return f"unbound ({binding.reason})"
        bind_process(binding.cores)
        return format_cpulist(binding.cores)

    def bind_step_thread(self) -> None:
        """Make this rank's GPU the calling thread's current CUDA device (CUDA's is per thread)."""
        from worker.device import bind_thread

        if self._device is not None:
            bind_thread(self._device)

    def GetStatus(self, request: pb.GetStatusRequest, context: grpc.ServicerContext) -> pb.WorkerStatus:
        return pb.WorkerStatus(
            rank=self.options.rank,
            world_size=self.options.world_size,
            ready=self._ready.is_set(),
            num_kv_blocks_available=self._num_blocks_available,
            error=self._error,
            dtype=self._dtype,
            device="" if self._device is None else self._device.type,
            num_threads=self._num_threads,
            step_protocol=STEP_PROTOCOL,
            num_state_slots_available=self._num_state_slots,
            kv_bytes_per_block=0 if self._runner is None or not self._ready.is_set()
            else self._runner.kv_layout.bytes_per_block,
        )

    def InitCache(self, request: pb.InitCacheRequest, context: grpc.ServicerContext) -> pb.InitCacheResponse:
        if not self._ready.is_set():
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the shard is not loaded yet")
        if request.num_kv_blocks > self._num_blocks_available:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"num_kv_blocks={request.num_kv_blocks} exceeds this rank's {self._num_blocks_available}")
        # On a thread that ends with it. libgomp keeps an OpenMP team per thread that opens parallel
        # regions, until that thread exits, and once the teams' threads outnumber the cores it stops
        # spinning between regions and sleeps instead. A gRPC pool thread lives on: had InitCache run
        # on one and the Step stream on another, every one of a step's ~120 parallel regions would
        # pay a futex wake-up (the 95M model's rank step at one request: 24-27 ms against 12-14).
        with futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"init-cache-rank{self.options.rank}") as once:
            once.submit(self._init_cache, request.num_kv_blocks, request.num_state_slots,
                        request.num_host_blocks).result()
        return pb.InitCacheResponse()

    def _init_cache(self, num_kv_blocks: int, num_state_slots: int = 0, num_host_blocks: int = 0) -> None:
        """InitCache's work: the KV cache (a hybrid's state pool, the host tier's ``num_host_blocks``), and on
        CUDA the decode graphs."""
        self.bind_step_thread()  # a thread of its own: its current CUDA device is cuda:0 until told
        opts = self.options
        sizes: tuple[int, ...] = ()
        if self._device.type == "cuda" and not opts.enforce_eager:
            from worker.cuda_graphs import default_capture_sizes

            sizes = opts.cuda_graph_sizes or default_capture_sizes(opts.cache.max_num_seqs)
        started = time.monotonic()
        self._runner.init_kv_cache(num_kv_blocks, cuda_graph_sizes=sizes, max_model_len=opts.cache.max_model_len,
                                   num_state_slots=num_state_slots or None, num_host_blocks=num_host_blocks)
        if self._runner.host_tier is not None:
            log.info("kv host tier allocated", rank=opts.rank, blocks=num_host_blocks,
                     bytes=self._runner.host_tier.num_bytes)
        if self._runner.cuda_graph_sizes:
            log.info("decode graphs captured", rank=opts.rank, sizes=list(self._runner.cuda_graph_sizes),
                     seconds=round(time.monotonic() - started, 2))
        elif sizes:
            log.info("decode graphs off: no Triton decode kernel, a draft model, dynamic RoPE or latent attention",
                     rank=opts.rank)

    def PrepareGrammar(self, request: pb.PrepareGrammarRequest,
                       context: grpc.ServicerContext) -> pb.PrepareGrammarResponse:
        """Builds a grammar's matcher on this gRPC pool thread (llguidance releases the GIL), so
        that the step that first samples the request finds it built (docs/design/sampling.md, "Grammars compile in
        child processes")."""
        if not self._ready.is_set():
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the shard is not loaded yet")
        try:
            self._runner.prepare_grammar(request.grammar)
        except ValueError as exc:
            return pb.PrepareGrammarResponse(error=str(exc))
        return pb.PrepareGrammarResponse()

    def LoadLoRA(self, request: pb.LoadLoRARequest, context: grpc.ServicerContext) -> pb.LoadLoRAResponse:
        """Reads and checks a LoRA adapter into ``request.slot`` on this gRPC pool thread, beside the steps.

        Safe without a lock: the coordinator names a free slot, which no scheduled sequence uses
        until every rank has answered, so no step reads the rows written here (docs/design/models.md,
        "Adapters loaded while serving")."""
        if not self._ready.is_set():
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the shard is not loaded yet")
        lora = self._runner.lora
        if lora is None:
            return pb.LoadLoRAResponse(error="LoRA is not enabled (--enable-lora)")
        try:
            from_host = lora.load(request.slot, request.path)
        except ValueError as exc:
            return pb.LoadLoRAResponse(error=str(exc))
        log.info("lora adapter loaded", rank=self.options.rank, slot=request.slot, path=request.path,
                 from_host_memory=from_host)
        return pb.LoadLoRAResponse()

    def Step(self, request_iterator: Iterator[pb.StepPlan], context: grpc.ServicerContext) -> Iterator[pb.StepResult]:
        """Runs each plan and answers it; a stream opened with ``ERRORS_ONLY`` metadata (every rank
        but the sampling rank's, coordinator/worker_client.py) is answered only for a failed step.
        The coordinator's own host uses the step socket instead (tpserve/step_socket.py)."""
        # The whole stream runs on the gRPC pool thread that iterates this generator.
        self.bind_step_thread()
        answer_all = context is None or ERRORS_ONLY not in context.invocation_metadata()
        sent = None  # when the previous result went out: the wait for each plan is reported with its result
        for msg in request_iterator:
            result, failed = self.run_plan(msg, answer_all, sent)
            if result is not None:
                yield result
            if failed:
                return
            sent = time.perf_counter()

    def run_plan(self, msg: pb.StepPlan, answer_all: bool, sent: float | None) -> tuple[pb.StepResult | None, bool]:
        """Executes one plan: returns its answer (None for a success on an errors-only stream) and
        whether it failed. A failed step is fatal (``on_fatal``): a group that missed a collective
        cannot run another. ``sent``: when the previous answer went out (perf_counter), or None."""
        started = time.perf_counter()
        try:
            result = self._runner.execute(plan_from_pb(msg))
        except Exception as exc:  # noqa: BLE001 - a failed step poisons the group: report, then stop
            error = f"rank {self.options.rank}: step {msg.step_id} failed: {type(exc).__name__}: {exc}"
            log.error("step failed", error=error)
            self._on_fatal(error)
            return pb.StepResult(step_id=msg.step_id, error=error), True
        if not answer_all:
            return None, False
        return result_to_pb(replace(result, model_execute_time_s=time.perf_counter() - started,
                                    wait_time_s=started - (sent or started))), False


def _resolve_dtype(dtype: str, model_dir: str, device) -> "torch.dtype":  # noqa: F821
    """Resolve ``--dtype``.

    "auto" on CUDA: the checkpoint's half-precision dtype (float16 or bfloat16), and
    bfloat16 for a float32 checkpoint (decode streams every weight each step: half
    the bytes is half the time; bfloat16 keeps float32's exponent range, so no
    overflow where float16 could). On the CPU: float32, where half-precision
    matmuls are slow on most cores and the references are float32.
    """
    import torch

    from tpserve.model_config import ModelConfig

    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        dtype = ModelConfig.from_pretrained(model_dir).torch_dtype or "float32"
        if dtype not in ("float16", "bfloat16"):
            dtype = "bfloat16"
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
