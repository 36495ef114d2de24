"""The ``tpserve`` command: ``serve`` a model, ``generate`` from a server, ``info`` about it.

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
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from tpserve import __version__

if TYPE_CHECKING:
    from tpserve.config import ClusterConfig
from tpserve.bench import cli as bench_cli

_SERVE_FLAGS: dict[str, list[tuple[str, dict]]] = {
    # section -> (flag, argparse kwargs); dest is the config field name.
    "load": [
        ("--model", dict(help="Hugging Face checkpoint directory (default: the embedded model)")),
        ("--served-model-name", dict(help="name GetModelInfo reports (default: the directory's name)")),
        ("--dtype", dict(choices=("auto", "float32", "bfloat16", "float16"),
                         help="auto: float32 on the CPU; on CUDA the checkpoint's half dtype, bfloat16 for float32")),
        ("--device", dict(choices=("auto", "cpu", "cuda"))),
        ("--quantization", dict(choices=("int8",), help="int8: weight-only int8 linear layers (per-channel scales, "
                                                        "activations in --dtype), quantized at load time")),
        ("--enforce-eager", dict(action="store_true", help="CUDA: run every decode step eagerly, no CUDA graphs")),
        ("--cuda-graph-sizes", dict(type=int, nargs="+", help="CUDA: decode batch sizes to capture as graphs "
                                                              "(default 1 2 4 8 16 24 ... up to --max-num-seqs)")),
    ],
    "parallel": [
        ("--tensor-parallel-size", dict(type=int, help="number of worker ranks the model is split over")),
        ("--distributed-timeout-seconds", dict(type=float, help="collective timeout: a lost rank fails the step")),
        ("--nnodes", dict(type=int, help="hosts the tensor-parallel group spans (default 1)")),
        ("--node-rank", dict(type=int, help="this host's index in the group; 0 runs the coordinator")),
        ("--master-addr", dict(help="the leader host's name or address (with --nnodes > 1)")),
        ("--master-port", dict(type=int, help="the leader's node registry port (default 29500); the group also uses "
                                              "the next ports (docs/cluster.md)")),
        ("--cluster-secret-file", dict(help="secret shared by every host of the group: internal calls must carry it")),
        ("--headless", dict(action="store_true", help="run only this host's ranks, no public API (node-rank > 0)")),
    ],
    "cache": [
        ("--block-size", dict(type=int, help="tokens per KV cache block")),
        ("--gpu-memory-utilization", dict(type=float, help="share of each GPU's memory a rank may use (default 0.9; "
                                                          "on the CPU it scales the KV cache's share of free RAM)")),
        ("--kv-cache-memory-bytes", dict(type=int, help="per-rank KV cache budget in bytes (default: from free memory)")),
        ("--num-gpu-blocks-override", dict(type=int, help="use exactly this many KV blocks")),
        ("--enable-prefix-caching", dict(action=argparse.BooleanOptionalAction,
                                         help="reuse the KV blocks of shared prompt prefixes (default on)")),
    ],
    "scheduler": [
        ("--max-num-seqs", dict(type=int, help="most sequences per step")),
        ("--max-num-batched-tokens", dict(type=int, help="token budget per step")),
        ("--max-model-len", dict(type=int, help="longest sequence in tokens (default: the model's)")),
        ("--max-queue-len", dict(type=int, help="most waiting requests before RESOURCE_EXHAUSTED")),
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
    "server": [
        ("--host", dict(help="address to bind (default 0.0.0.0)")),
        ("--port", dict(type=int, help="gRPC port (default 50051)")),
        ("--metrics-port", dict(type=int, help="Prometheus /metrics port (default: off)")),
        ("--worker-start-timeout-seconds", dict(type=float)),
        ("--step-timeout-seconds", dict(type=float)),
        ("--shutdown-grace-seconds", dict(type=float, help="on SIGTERM/SIGINT, time in-flight requests get to finish")),
        ("--worker-recovery-timeout-seconds", dict(
            type=float, help="restart a lost group (one host) and resume its requests within this time; 0: exit")),
        ("--ssl-certfile", dict(help="PEM certificate chain: serve the public port over TLS")),
        ("--ssl-keyfile", dict(help="PEM private key of --ssl-certfile")),
        ("--ssl-ca-certs", dict(help="PEM CA bundle: require client certificates signed by it (mutual TLS)")),
        ("--api-key", dict(help="require 'authorization: Bearer KEY' on Generation calls (health stays open)")),
        ("--api-key-file", dict(help="file of accepted API keys, one per line")),
    ],
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tpserve", description="Tensor-parallel LLM inference over gRPC.")
    parser.add_argument("--version", action="version", version=f"tpserve {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="start a coordinator and its worker ranks on this machine")
    serve.add_argument("--config", help="YAML file with sections load/parallel/cache/scheduler/speculative/server; flags override it")
    serve.add_argument("--log-format", choices=("console", "json"), default="console")
    for section, flags in _SERVE_FLAGS.items():
        group = serve.add_argument_group(section)
        for flag, kwargs in flags:
            group.add_argument(flag, default=None, **kwargs)

    gen = commands.add_parser("generate", help="generate a completion from a running server")
    gen.add_argument("--target", default="127.0.0.1:50051", help="server address HOST:PORT")
    gen.add_argument("--max-tokens", type=int)
    gen.add_argument("--temperature", type=float, help="0 is greedy (server default 1.0)")
    gen.add_argument("--top-k", type=int)
    gen.add_argument("--top-p", type=float)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--stop-token-id", type=int, action="append", default=[], dest="stop_token_ids")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--min-p", type=float)
    gen.add_argument("--repetition-penalty", type=float, help="> 1 discourages prompt and output tokens")
    gen.add_argument("--presence-penalty", type=float, help="in [-2, 2], on output tokens")
    gen.add_argument("--frequency-penalty", type=float, help="in [-2, 2], on output tokens, per occurrence")
    gen.add_argument("--logit-bias", action="append", default=[], metavar="TOKEN_ID=BIAS", help="repeatable")
    gen.add_argument("--min-tokens", type=int, help="no eos or stop token id before this many tokens")
    gen.add_argument("--include-stop-str-in-output", action="store_true")
    gen.add_argument("--logprobs", action="store_true", help="with --json: each token's log-probability")
    gen.add_argument("--top-logprobs", type=int, help="with --logprobs: the N most likely tokens too (0..20)")
    gen.add_argument("--prompt-logprobs", type=int, metavar="N",
                     help="with --json: each prompt token's log-probability and the N most likely (0..20)")
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
    gen.add_argument("--cache-salt", help="reuse only prefix-cache entries of requests with this salt (and "
                     "the same API key); keeps prompts apart from other callers'")
    gen.add_argument("prompt")
    _add_credential_flags(gen)

    info = commands.add_parser("info", help="print the served model's description as JSON")
    info.add_argument("--target", default="127.0.0.1:50051")
    _add_credential_flags(info)
    bench_cli.add_parser(commands)  # `tpserve bench`: flags in tpserve/bench/cli.py
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "bench":
        return bench_cli.main(args)
    try:
        return _generate(args) if args.command == "generate" else _info(args)
    except grpc.RpcError as exc:
        print(f"{exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
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


def _serve(args: argparse.Namespace) -> int:
    # Imported here: `tpserve generate` should not pay for the server's imports.
    from tpserve.cluster import Cluster, StartupError
    from tpserve.headless import HeadlessNode
    from tpserve.log import configure_logging

    configure_logging(args.log_format)
    try:
        config = serve_config(args)
        node_class = HeadlessNode if config.parallel.headless else Cluster
        node = node_class(config, log_format=args.log_format)
    except (StartupError, ValueError, OSError) as exc:
        print(f"tpserve serve: {_config_error(exc)}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(node.serve())
    except StartupError as exc:  # a peer that never came, or refused this node
        print(f"tpserve serve: {exc}", file=sys.stderr)
        return 1


def _config_error(exc: Exception) -> str:
    """One line per problem: pydantic's own message lists the input dict and a documentation URL."""
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        return str(exc)
    lines = []
    for error in errors():
        where = ".".join(str(part) for part in error.get("loc", ()) if part != "__root__")
        message = str(error.get("msg", "")).removeprefix("Value error, ")
        lines.append(f"{where}: {message}" if where else message)
    return "; ".join(lines)


def _add_credential_flags(parser: argparse.ArgumentParser) -> None:
    from tpserve.client import Credentials

    Credentials.add_flags(parser)


def _credentials(args: argparse.Namespace):
    from tpserve.client import Credentials

    return Credentials.from_flags(args)


def _generate(args: argparse.Namespace) -> int:
    from tpserve.client import FINISH_REASON_NAMES, Client, GenerateResult, Usage

    sampling = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                    seed=args.seed, stop=args.stop, stop_token_ids=args.stop_token_ids, ignore_eos=args.ignore_eos,
                    min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                    presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                    logit_bias=_logit_bias(args.logit_bias), min_tokens=args.min_tokens,
                    include_stop_str_in_output=args.include_stop_str_in_output, logprobs=args.logprobs,
                    top_logprobs=args.top_logprobs, regex=args.regex, choices=args.choices,
                    prompt_logprobs=args.prompt_logprobs, cache_salt=args.cache_salt,
                    json_schema=Path(args.json_schema[1:]).read_text() if (args.json_schema or "").startswith("@")
                    else args.json_schema)
    with Client(args.target, credentials=_credentials(args)) as client:
        if not args.stream:
            result = client.generate(_prompt(args), timeout_s=args.timeout, **sampling)
        else:
            text, token_ids, logprobs, last = [], [], [], None
            for chunk in client.generate_stream(_prompt(args), timeout_s=args.timeout, **sampling):
                if not args.json:
                    print(chunk.text, end="", flush=True)
                text.append(chunk.text)
                token_ids.extend(chunk.token_ids)
                logprobs.extend(chunk.logprobs)
                last = chunk
            result = GenerateResult(last.request_id, "".join(text), token_ids, FINISH_REASON_NAMES[last.finish_reason],
                                    Usage(last.usage.prompt_tokens, last.usage.completion_tokens,
                                          last.usage.cached_prompt_tokens), tuple(logprobs))
    if args.json:
        obj = result.to_json_dict()
        if args.logprobs:
            from google.protobuf.json_format import MessageToDict

            obj["logprobs"] = [MessageToDict(lp, preserving_proto_field_name=True) for lp in result.logprobs]
        if args.prompt_logprobs is not None and not args.stream:
            from google.protobuf.json_format import MessageToDict

            obj["prompt_logprobs"] = [MessageToDict(lp, preserving_proto_field_name=True)
                                      for lp in result.prompt_logprobs]
        print(json.dumps(obj, ensure_ascii=False))
    elif args.stream:
        print()
    else:
        print(result.text)
    return 0


def _prompt(args: argparse.Namespace) -> str | list[dict[str, str]]:
    """The prompt text, or with ``--chat`` the messages (an optional system one, then the user's)."""
    if not args.chat:
        return args.prompt
    system = [{"role": "system", "content": args.system}] if args.system else []
    return [*system, {"role": "user", "content": args.prompt}]


def _logit_bias(pairs: list[str]) -> dict[int, float]:
    """``["TOKEN_ID=BIAS", ...]`` as a dict (argparse exits with the message on a malformed pair)."""
    bias = {}
    for pair in pairs:
        token, sep, value = pair.partition("=")
        try:
            bias[int(token)] = float(value)
        except ValueError:
            raise SystemExit(f"tpserve generate: --logit-bias expects TOKEN_ID=BIAS, got {pair!r}") from None
        if not sep:
            raise SystemExit(f"tpserve generate: --logit-bias expects TOKEN_ID=BIAS, got {pair!r}")
    return bias


def _info(args: argparse.Namespace) -> int:
    from google.protobuf.json_format import MessageToDict

    from tpserve.client import Client

    with Client(args.target, credentials=_credentials(args)) as client:
        print(json.dumps(MessageToDict(client.model_info(), preserving_proto_field_name=True), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
