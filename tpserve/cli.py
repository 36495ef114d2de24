"""The ``tpserve`` command's grammar: ``serve`` a model, ``generate`` from a server, ``info`` about it.

Every command's flags are parsed here (:func:`build_parser`), and the client commands run here
(:func:`run_client_command`); the console script itself is ``launch.cli:main``, which also runs
``serve`` (it starts the coordinator and the ranks, which this shared package never imports).

Scripts rely on these names and outputs (see README.md):
  tpserve serve [--model DIR] [--tensor-parallel-size N] [--port PORT] ...
  tpserve serve ... --nnodes M --node-rank R --master-addr HOST [--master-port P] [--headless]
  tpserve generate --target HOST:PORT [--max-tokens N] [--temperature T] [--top-k K]
                   [--top-p P] [--seed S] [--stop STR]... [--stream] [--json] PROMPT
``generate`` prints the completion (as it arrives with --stream), or with --json one
object {text, token_ids, finish_reason, usage{prompt_tokens, completion_tokens}}; on an
error it prints the gRPC status code name and the message to stderr and exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
from typing import TYPE_CHECKING

import grpc

from tpserve import __version__, generate_command
from tpserve.sampling_fields import FIELDS

if TYPE_CHECKING:
    from tpserve.config import ClusterConfig
from tpserve.bench import cli as bench_cli
from tpserve.help_format import ArgumentParser, HelpFormatter

_SERVE_FLAGS: dict[str, list[tuple[str, dict]]] = {
    # section -> (flag, argparse kwargs); dest is the config field name.
    "load": [
        ("--model", dict(help="Hugging Face checkpoint directory (default: the embedded model)")),
        ("--served-model-name", dict(help="name GetModelInfo reports (default: the directory's name)")),
        ("--dtype", dict(choices=("auto", "float32", "bfloat16", "float16"),
                         help="auto: float32 on the CPU (with the compiled kernels, a bfloat16 or float16 checkpoint's "
                              "projections, untied embedding and LM head are then kept in their 16 bits and widened "
                              "as read, with the same logits); on CUDA the checkpoint's half dtype, bfloat16 for "
                              "float32")),
        ("--device", dict(choices=("auto", "cpu", "cuda"),
                          help="where the ranks run; auto: CUDA where a GPU is visible")),
        ("--quantization", dict(choices=("int8", "int4", "fp8"),
                                help="int8: weight-only int8 linear layers (per-channel scales); int4: weight-only "
                                     "4-bit (symmetric, groups of 128 input columns, 32 where 128 does not divide "
                                     "a layer's input width; each rank's share of a layer split by its input "
                                     "columns must hold whole groups), both quantized at load time, activations in --dtype, and on a CPU "
                                     "with float32 activations and the compiled kernels the LM head int8 per row; fp8: an FP8 "
                                     "checkpoint's linear weights kept as e4m3 with their scales, converted in "
                                     "registers (without the flag an FP8 checkpoint is dequantized at load to "
                                     "--dtype). GPTQ, AWQ, compressed-tensors, FP8 and MXFP4 checkpoints need no "
                                     "flag: read from config.json (default: none, or the checkpoint's "
                                     "quantization_config)")),
        ("--enforce-eager", dict(action="store_true", help="CUDA: run every decode step eagerly, no CUDA graphs")),
        ("--cuda-graph-sizes", dict(type=int, nargs="+", help="CUDA: decode batch sizes to capture as graphs "
                                                              "(default 1 2 4 8 16 24 ... up to --max-num-seqs)")),
        ("--cpu-omp-threads-bind", dict(help="CPU ranks' cores (vLLM's VLLM_CPU_OMP_THREADS_BIND): auto gives each "
                                             "rank cores of its own where a host has two or more and their threads "
                                             "fit (a lone rank stays free), nobind "
                                             "leaves them to the kernel, 0-3|4-7 names each local rank's cores "
                                             "(default auto)")),
    ],
    "parallel": [
        ("--tensor-parallel-size", dict(type=int, help="number of worker ranks the model is split over")),
        ("--pipeline-parallel-size", dict(type=int, help="pipeline stages the layers are split into (default 1); "
                                                         "each stage has --tensor-parallel-size ranks (docs/cluster.md)")),
        ("--distributed-timeout-seconds", dict(type=float, help="collective timeout: a lost rank fails the step")),
        ("--nnodes", dict(type=int, help="hosts the tensor-parallel group spans (default 1)")),
        ("--node-rank", dict(type=int, help="this host's index in the group; 0 runs the coordinator")),
        ("--master-addr", dict(help="the leader host's name or address (with --nnodes > 1)")),
        ("--master-port", dict(type=int, help="the leader's node registry port (default 29500); the group also uses "
                                              "the next ports (docs/cluster.md)")),
        ("--cluster-secret-file", dict(help="secret shared by every host of the group: internal calls must carry it")),
        ("--headless", dict(action="store_true", help="run only this host's ranks, no public API (node-rank > 0)")),
        ("--enable-expert-parallel", dict(action="store_true", help="mixture-of-experts models: each rank holds "
                                                                    "num_experts / tensor-parallel-size whole experts "
                                                                    "instead of a slice of every expert (default off)")),
    ],
    "cache": [
        ("--block-size", dict(type=int, help="tokens per KV cache block")),
        ("--gpu-memory-utilization", dict(type=float, help="share of each GPU's memory a rank may use (default 0.9; "
                                                          "on the CPU it scales the KV cache's share of free RAM)")),
        ("--kv-cache-memory-bytes", dict(type=int, help="per-rank KV cache budget in bytes (default: from free memory)")),
        ("--num-gpu-blocks-override", dict(type=int, help="use exactly this many KV blocks (default: as many as "
                                                                      "the memory budget holds)")),
        ("--kv-cache-dtype", dict(choices=("auto", "fp8", "int8"),
                                  help="KV cache element type: auto is --dtype; fp8 (e4m3) and int8 store 1 byte "
                                       "per element and a 2-byte scale per token and KV head (keys less a per-channel "
                                       "offset calibrated at start-up): 2d/(d+2) times the blocks of a 16-bit cache "
                                       "(1.94x at head_dim 64)")),
        ("--enable-prefix-caching", dict(action=argparse.BooleanOptionalAction,
                                         help="reuse the KV blocks of shared prompt prefixes (default on)")),
        ("--kv-offloading-size", dict(type=float, help="GiB of host memory, summed over the ranks, for a second "
                                                       "tier of the prefix cache: blocks evicted from the KV cache "
                                                       "are kept there and copied back on a hit, and preempted "
                                                       "requests swap through it; needs prefix caching; not for "
                                                       "hybrid models (default: none)")),
        ("--num-cpu-blocks-override", dict(type=int, help="use exactly this many host-tier blocks per rank "
                                                          "(instead of --kv-offloading-size)")),
    ],
    "scheduler": [
        ("--max-num-seqs", dict(type=int, help="most sequences per step")),
        ("--max-num-batched-tokens", dict(type=int, help="token budget per step")),
        ("--max-model-len", dict(type=int, help="longest sequence in tokens (default: the model's)")),
        ("--max-queue-len", dict(type=int, help="most waiting requests before RESOURCE_EXHAUSTED")),
        ("--async-scheduling", dict(action=argparse.BooleanOptionalAction,
                                    help="plan each step before the previous step's result is back, so the ranks "
                                         "never wait for the coordinator (not with speculative decoding or "
                                         "pipeline stages; default: on without either for CUDA ranks, and for "
                                         "CPU ranks whose threads leave the coordinator a core of its own; off "
                                         "for CPU ranks that take every core, the default thread split)")),
        ("--num-scheduler-steps", dict(type=int, help="most decode steps one plan runs: while every running "
                                                      "request decodes and no waiting one could start (none "
                                                      "waits, or every --max-num-seqs slot is taken), the ranks "
                                                      "run this many steps in a row on their own samples, so the "
                                                      "coordinator's work comes once per that many tokens; a new "
                                                      "request waits for the plan's end (default 1; not with "
                                                      "speculative decoding, pipeline stages or "
                                                      "--async-scheduling)")),
        ("--priority-aging-seconds", dict(type=float, help="seconds of waiting worth one priority level, so that "
                                                           "no request waits forever behind more urgent ones; "
                                                           "0: strict priority (default 10)")),
    ],
    "lora": [
        ("--enable-lora", dict(action="store_true", help="serve LoRA adapters beside the base model (a request "
                                                         "names one by lora_name; CPU ranks only for now)")),
        ("--lora-modules", dict(nargs="+", metavar="NAME=PATH", help="the adapters served: a PEFT directory per "
                                                                      "name, each resident in a slot from start-up")),
        ("--max-loras", dict(type=int, help="adapter slots resident at once (default 1)")),
        ("--max-lora-rank", dict(type=int, help="largest adapter rank r the slots hold (default 16)")),
        ("--max-cpu-loras", dict(type=int, help="adapters kept in host memory after a read, so a reload is a "
                                                 "copy (default: --max-loras)")),
    ],
    "speculative": [
        ("--speculative-method", dict(choices=("ngram", "draft"), help="speculative decoding: ngram is prompt "
                                                                        "lookup, draft a small model (default: off)")),
        ("--speculative-model", dict(help="with --speculative-method draft: the draft model's checkpoint directory "
                                          "(same tokenizer)")),
        ("--num-speculative-tokens", dict(type=int, help="most tokens proposed per sequence per step")),
        ("--prompt-lookup-max", dict(type=int, help="longest n-gram looked up (ngram; default 5)")),
        ("--prompt-lookup-min", dict(type=int, help="shortest n-gram looked up (ngram; default 5)")),
        ("--speculative-disable-by-batch-size", dict(type=int, help="no proposals in a step of more sequences than "
                                                                    "this (default: always speculate)")),
    ],
    "kv_transfer": [
        ("--kv-transfer-config", dict(help="prefill/decode disaggregation, vLLM's JSON: {\"kv_connector\": "
                                           "\"NixlConnector\", \"kv_role\": \"kv_producer|kv_consumer|kv_both\", "
                                           "\"engine_id\": ..., \"kv_connector_extra_config\": {\"side_channel_host"
                                           "\": ..., \"side_channel_port\": ...}} (docs/cluster.md; default: off)")),
    ],
    "server": [
        ("--host", dict(help="address to bind (default 0.0.0.0)")),
        ("--port", dict(type=int, help="gRPC port (default 50051)")),
        ("--metrics-port", dict(type=int, help="Prometheus /metrics port (default: off)")),
        ("--worker-start-timeout-seconds", dict(type=float, help="how long every rank may take to load its shard")),
        ("--step-timeout-seconds", dict(type=float, help="a step that takes longer fails as a lost rank (a plan of "
                                                         "k steps, --num-scheduler-steps: k times this)")),
        ("--shutdown-grace-seconds", dict(type=float, help="on SIGTERM/SIGINT, time in-flight requests get to finish")),
        ("--worker-recovery-timeout-seconds", dict(
            type=float, help="restart a lost group (waiting for lost nodes to rejoin) and resume its requests "
                             "within this time; 0: exit")),
        ("--ssl-certfile", dict(help="PEM certificate chain: serve the public port over TLS")),
        ("--ssl-keyfile", dict(help="PEM private key of --ssl-certfile")),
        ("--ssl-ca-certs", dict(help="PEM CA bundle: require client certificates signed by it (mutual TLS)")),
        ("--api-key", dict(help="require 'authorization: Bearer KEY' on Generation calls (health stays open)")),
        ("--api-key-file", dict(help="file of accepted API keys, one per line")),
        ("--operator-api-key", dict(help="an operator's (a gateway's) key: also FlushCache, SubscribeKvEvents, "
                                         "server-wide loads and priorities below 0")),
        ("--operator-api-key-file", dict(help="file of operator API keys, one per line")),
        ("--max-kv-event-subscribers", dict(type=int, help="most SubscribeKvEvents streams at once")),
        ("--handshake-timeout-seconds", dict(type=float, help="close a connection that has not begun HTTP/2 within "
                                                               "this time (default 10)")),
        ("--max-connections", dict(type=int, help="connections the public port accepts at a time (default: the "
                                                  "open-file limit less 256)")),
        ("--health-port", dict(type=int, help="also serve gRPC health alone on this plaintext port, reachable "
                                              "while the public port is full (default: off)")),
        ("--stream-interval", dict(type=int, help="tokens a stream gathers per message (first and last go at once; "
                                                  "default 1: every step)")),
        ("--otlp-traces-endpoint", dict(help="send each request's trace spans to this OTLP/gRPC collector, e.g. "
                                             "http://localhost:4317 (needs the tracing extra; default: off)")),
    ],
}


class _ServeHelpFormatter(HelpFormatter):
    """``serve``'s flags default to None (so that ``--config`` can set them): their help shows the
    configuration's defaults (tpserve/config.py)."""

    def _default(self, action: argparse.Action) -> object:
        if action.dest not in _FIELDS:
            return action.default
        from tpserve.config import ClusterConfig

        config = ClusterConfig()
        for section, flags in _SERVE_FLAGS.items():
            if any(flag.lstrip("-").replace("-", "_") == action.dest for flag, _ in flags):
                return getattr(getattr(config, section), action.dest)
        return action.default


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="tpserve", description="Tensor-parallel LLM inference over gRPC.",
                                     formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"tpserve {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="start a coordinator and its worker ranks on this machine",
                                formatter_class=_ServeHelpFormatter)
    serve.add_argument("--config", help="YAML file with sections load/parallel/cache/scheduler/speculative/server; flags override it")
    serve.add_argument("--log-format", choices=("console", "json"), default="console",
                       help="console: readable lines; json: one JSON object per line, for log collectors")
    for section, flags in _SERVE_FLAGS.items():
        group = serve.add_argument_group(section)
        for flag, kwargs in flags:
            group.add_argument(flag, default=None, **kwargs)

    gen = commands.add_parser("generate", help="generate a completion from a running server",
                              formatter_class=HelpFormatter)
    gen.add_argument("--target", default="127.0.0.1:50051", help="server address HOST[:PORT] (port 50051 if none)")
    _add_sampling_flags(gen)
    structured = gen.add_mutually_exclusive_group()
    structured.add_argument("--json-schema", metavar="SCHEMA", help="the completion is JSON valid under this schema "
                                                                    "(JSON text, or @FILE)")
    structured.add_argument("--regex", help="the completion matches this regular expression")
    structured.add_argument("--choice", action="append", dest="choices", help="the completion is one of these "
                                                                             "(repeatable)")
    gen.add_argument("--stream", action="store_true", help="print text as it arrives")
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    gen.add_argument("--timeout", type=float, help="deadline in seconds")
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user message, rendered with the "
                                                           "model's chat template")
    gen.add_argument("--system", help="with --chat: a system message before it")
    gen.add_argument("--parse-special-tokens", action="store_true",
                     help="special-token spellings in the prompt text (</s>) are their tokens, not literal text")
    gen.add_argument("--cache-salt", help="reuse only prefix-cache entries of requests with this salt (and "
                     "the same API key); keeps prompts apart from other callers'")
    gen.add_argument("--lora", help="generate with this LoRA adapter (a name of the server's --lora-modules)")
    gen.add_argument("prompt", help="the prompt text (with --chat: the user's message)")
    _add_credential_flags(gen)

    info = commands.add_parser("info", help="print the served model's description as JSON",
                               formatter_class=HelpFormatter)
    info.add_argument("--target", default="127.0.0.1:50051", help="server address HOST[:PORT] (port 50051 if none)")
    _add_credential_flags(info)
    bench_cli.add_parser(commands)  # `tpserve bench`: flags in tpserve/bench/cli.py
    return parser


def run_client_command(args: argparse.Namespace) -> int:
    """Runs ``generate``, ``info`` or ``bench`` (parsed by :func:`build_parser`); returns the exit code,
    :data:`EXIT_STDOUT_CLOSED` without a word where the reader of stdout went away (``| head``).
    ``serve`` starts processes and runs in the launch package (launch/cli.py, the ``tpserve`` command)."""
    try:
        code = bench_cli.main(args) if args.command == "bench" else _run_call(args)
        sys.stdout.flush()  # here, not at exit: a reader gone by now raises below, not in the interpreter's flush
    except BrokenPipeError:
        return _stdout_closed()
    return code


#: What a client command exits with when its stdout's reader went away: 128 + SIGPIPE, as the shell reports
#: a tool SIGPIPE ended (``yes | head -1``), so ``set -o pipefail`` still sees that the output was cut.
EXIT_STDOUT_CLOSED = 128 + int(signal.SIGPIPE)


def _stdout_closed() -> int:
    """Python's recipe (the signal module's "Note on SIGPIPE"): stdout now writes to /dev/null, so that
    the interpreter's flush at exit raises no second BrokenPipeError ("Exception ignored ..."). Its
    ``sys.exit(1)`` would read as a failed call here (README: exit status 1); SIGPIPE itself stays
    ignored, as Python sets it: its default action would also kill the process on a gRPC socket a
    server closed."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_STDOUT_CLOSED


def _run_call(args: argparse.Namespace) -> int:
    """``generate`` or ``info``: the exit code, a failure reported in one line (2: bad flags or files, 1: the
    call failed)."""
    try:
        generate_command.checked_target(args.target)
        return generate_command.generate(args) if args.command == "generate" else _info(args)
    except generate_command.UsageError as exc:
        print(f"tpserve {args.command}: {exc}", file=sys.stderr)
        return 2
    except grpc.RpcError as exc:
        from tpserve.client import describe_rpc_error, with_default_port

        print(describe_rpc_error(exc, with_default_port(args.target), tls=generate_command.credentials(args).tls),
              file=sys.stderr)
        return 1
    except BrokenPipeError:
        raise  # stdout's reader is gone, not a file of ours: run_client_command ends quietly
    except OSError as exc:  # a credentials file
        print(f"tpserve {args.command}: {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def serve_config(args: argparse.Namespace) -> ClusterConfig:
    """The configuration ``tpserve serve`` runs with: the ``--config`` YAML, overridden by the flags given.

    Raises:
        ValueError: a value out of range or an inconsistent combination, naming the field.
        OSError: the YAML file cannot be read.
    """
    from tpserve.config import ClusterConfig

    overrides = {section: {flag.lstrip("-").replace("-", "_"): getattr(args, flag.lstrip("-").replace("-", "_"))
                           for flag, _ in flags} for section, flags in _SERVE_FLAGS.items()}
    return ClusterConfig.load_from(args.config, overrides)


def config_error(exc: Exception) -> str:
    """One line naming the flags: pydantic's own message lists the input dict and a documentation URL,
    and the configuration names its fields as the YAML does (``speculative.num_speculative_tokens``)."""
    if isinstance(exc, OSError) and exc.filename is not None:
        return f"{exc.filename}: {exc.strerror}"
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        return as_flags(str(exc))
    lines = []
    for error in errors():
        loc = [str(part) for part in error.get("loc", ()) if part != "__root__"]
        message = str(error.get("msg", "")).removeprefix("Value error, ")
        where = _FIELDS[loc[-1]] if loc and loc[-1] in _FIELDS else ".".join(loc)
        lines.append(as_flags(f"{where}: {message}" if where else message))
    return "; ".join(lines)


# configuration field -> its flag, for messages (a field is named like its flag; YAML keys are fields)
_FIELDS = {flag.lstrip("-").replace("-", "_"): flag for flags in _SERVE_FLAGS.values() for flag, _ in flags}


def as_flags(message: str) -> str:
    """``message`` with configuration fields written as flags: ``speculative: speculative_method=ngram needs
    num_speculative_tokens`` -> ``--speculative-method=ngram needs --num-speculative-tokens``."""
    message = re.sub(r"\[Errno \d+\] ", "", message)
    message = re.sub(r"^(?:" + "|".join(_SERVE_FLAGS) + r")[.:] ?", "", message)

    def flag(match: re.Match) -> str:
        name = match.group(1)
        # plain words (model, port, headless) only where they are clearly the field: name=value
        return _FIELDS[name] if "_" in name or match.group(2) else name

    return re.sub(r"(?<![\w./-])(" + "|".join(sorted(_FIELDS, key=len, reverse=True)) + r")(?![\w/])(=?)",
                  lambda m: flag(m) + m.group(2), message)


def _add_credential_flags(parser: argparse.ArgumentParser) -> None:
    from tpserve.client import Credentials

    Credentials.add_flags(parser)


def _add_sampling_flags(gen: argparse.ArgumentParser) -> None:
    """One flag per field of the sampling table (tpserve/sampling_fields.py), vLLM's names; unset: the server's
    default."""
    for spec in FIELDS:
        if not spec.cli:
            continue
        if spec.type is bool:
            gen.add_argument(spec.flag, action="store_true", help=spec.help)
        elif spec.type is list:
            gen.add_argument(spec.flag, type=spec.items, action="append", default=[], dest=spec.name, help=spec.help)
        elif spec.type is dict:
            gen.add_argument(spec.flag, action="append", default=[], dest=spec.name, metavar="TOKEN_ID=BIAS",
                             help=spec.help)
        else:
            gen.add_argument(spec.flag, type=spec.type, dest=spec.name, help=spec.help)


def _info(args: argparse.Namespace) -> int:
    from google.protobuf.json_format import MessageToDict

    from tpserve.client import Client

    with Client(args.target, credentials=generate_command.credentials(args)) as client:
        info = MessageToDict(client.model_info(), preserving_proto_field_name=True,
                             always_print_fields_with_no_presence=True)  # "quantization": "" says none
        print(json.dumps(info, indent=2))
    return 0


if __name__ == "__main__":  # the command moved with `serve`: say where, rather than exit silently
    sys.exit("tpserve.cli holds the commands' grammar; run `tpserve` or `python -m launch.cli`")
