"""``tpserve bench``: load a running server and report vLLM's serving metrics.

    tpserve bench --target HOST:PORT [--dataset random|jsonl] [--num-prompts N]
                  [--request-rate R | --sweep-request-rate 1,2,4,inf] [--burstiness B]
                  [--max-concurrency C] [--goodput ttft:MS tpot:MS e2el:MS]
                  [--result-file out.json] [--plot out.png]

Prints one summary table per load (see report.py); exits 0 when the run completed
(failed requests are counted in the table and the file, by status code), 1 when the
server is not reachable or every request failed, 2 on bad arguments (a file that cannot be
read among them: the dataset and TLS files are read before the server is called), 130 on
Ctrl-C (after the table of the requests that had ended, when the load had begun). Flag
names follow ``vllm bench serve`` (its ``--random-*`` and ``--dataset-name`` spellings are
accepted).
"""

from __future__ import annotations

import argparse
import datetime
import math
import platform
import sys

import grpc

from tpserve.client import Credentials


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Registers the ``bench`` subcommand and its flags on the ``tpserve`` parser's subcommands."""
    from tpserve.help_format import HelpFormatter

    bench = commands.add_parser("bench", help="load a running server and report TTFT, TPOT, ITL, E2EL, throughput",
                                description="Load a running server and report vLLM's serving metrics.",
                                formatter_class=HelpFormatter)
    bench.add_argument("--target", default="127.0.0.1:50051", help="server address HOST[:PORT] (port 50051 if none)")
    Credentials.add_flags(bench)
    work = bench.add_argument_group("workload")
    work.add_argument("--dataset", "--dataset-name", choices=("random", "jsonl"), default="random",
                      help="random token-id prompts, or a JSONL file of {prompt, max_tokens}")
    work.add_argument("--dataset-path", help="the JSONL file (--dataset jsonl)")
    # 200, not vLLM's 1000: a load of the defaults finishes in about a minute on the embedded model
    work.add_argument("--num-prompts", type=int, default=200, help="requests per load")
    work.add_argument("--input-len", "--random-input-len", type=int, default=128, help="random prompt length, tokens")
    work.add_argument("--output-len", "--random-output-len", type=int, default=128,
                      help="max_tokens of random prompts, and of JSONL lines that give none")
    work.add_argument("--range-ratio", "--random-range-ratio", type=float, default=0.0,
                      help="random lengths are uniform in [len*(1-r), len*(1+r)]")
    work.add_argument("--seed", type=int, default=0, help="seeds the prompts, the arrivals and sampling")
    work.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    work.add_argument("--ignore-eos", action="store_true", help="generate max_tokens even past end-of-sequence")
    load = bench.add_argument_group("arrivals")
    load.add_argument("--request-rate", type=float, default=math.inf,
                      help="requests per second, Poisson arrivals; inf sends all at once")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="gamma shape of the gaps: 1 is Poisson, < 1 burstier, > 1 more even")
    load.add_argument("--max-concurrency", type=int, help="most requests in flight at once")
    load.add_argument("--sweep-request-rate", metavar="R1,R2,...",
                      help="one load per rate (e.g. 1,2,4,8,inf); --plot then draws throughput against p99 TPOT")
    load.add_argument("--num-warmups", type=int, default=0, help="unmeasured requests sent one by one first")
    load.add_argument("--request-timeout", type=float, help="deadline of each request, seconds")
    load.add_argument("--ready-check-timeout-sec", type=float, default=60.0,
                      help="how long to wait for the server to report SERVING")
    out = bench.add_argument_group("results")
    out.add_argument("--goodput", nargs="+", default=[], metavar="NAME:MS",
                     help="SLOs (ttft, tpot, e2el in ms) for goodput: requests per second meeting all of them")
    out.add_argument("--result-file", help="JSON: parameters, summary and every request's measurements")
    out.add_argument("--plot", help="PNG: latency CDFs and tokens/s over time (a sweep: throughput vs p99 TPOT)")
    out.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    return bench


def parse_rates(text: str) -> list[float]:
    """"1,2,inf" -> [1.0, 2.0, inf].

    Raises:
        ValueError: an item is not a positive number or inf.
    """
    try:
        rates = [float(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise ValueError(f"--sweep-request-rate takes comma-separated numbers or inf, got {text!r}") from None
    if not rates or any(not rate > 0 for rate in rates):
        raise ValueError(f"--sweep-request-rate needs rates > 0, got {text!r}")
    return rates


def main(args: argparse.Namespace) -> int:
    """Runs ``tpserve bench`` with parsed arguments; returns the exit status."""
    from tpserve.client import with_default_port

    args.target = with_default_port(args.target)
    try:
        return _bench(args)
    except ValueError as exc:
        print(f"tpserve bench: {exc}", file=sys.stderr)
        return 2
    except (grpc.RpcError, TimeoutError) as exc:
        detail = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.RpcError) else str(exc)
        print(f"tpserve bench: {args.target}: {detail}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        raise  # stdout's reader is gone, not a file of ours: tpserve.cli ends quietly
    except OSError as exc:  # the dataset, a TLS file (as tpserve generate says it)
        print(f"tpserve bench: {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C before the load: nothing measured to show
        return EXIT_INTERRUPTED


#: Ctrl-C's exit status: 128 + SIGINT, as the shell reports a command SIGINT ended (tpserve generate's too).
EXIT_INTERRUPTED = 130


def _check_load_flags(args: argparse.Namespace, rates: list[float]) -> None:
    """The load's flags that need nothing of the server, checked before the wait for it (a bad --request-rate was
    refused only after --ready-check-timeout-sec of an absent server; a negative --temperature ran the whole
    load, every request refused).

    Raises:
        ValueError: the first bad flag, named with its range.
    """
    checks = [("--request-rate", all(rate > 0 for rate in rates), "> 0 (or inf)", args.request_rate),
              ("--burstiness", math.isfinite(args.burstiness) and args.burstiness > 0, "a finite number > 0",
               args.burstiness),
              ("--temperature", math.isfinite(args.temperature) and args.temperature >= 0, "a finite number >= 0",
               args.temperature),
              ("--max-concurrency", args.max_concurrency is None or args.max_concurrency >= 1, ">= 1",
               args.max_concurrency),
              ("--request-timeout", args.request_timeout is None or args.request_timeout > 0, "> 0 seconds",
               args.request_timeout),
              ("--ready-check-timeout-sec", args.ready_check_timeout_sec > 0, "> 0 seconds",
               args.ready_check_timeout_sec)]
    for flag, ok, expect, value in checks:
        if not ok:
            raise ValueError(f"{flag} must be {expect}, got {value:g}")


def _bench(args: argparse.Namespace) -> int:
    from tpserve.bench import datasets, metrics, plot, report, runner
    from tpserve.client import Client, check_target

    try:
        check_target(args.target)
    except ValueError as exc:
        raise ValueError(f"--target {exc}") from None
    slos = metrics.parse_goodput(args.goodput)
    rates = parse_rates(args.sweep_request_rate) if args.sweep_request_rate else [args.request_rate]
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.seed < 0 or args.num_warmups < 0:
        raise ValueError("--seed and --num-warmups must be >= 0")
    if args.dataset == "jsonl" and not args.dataset_path:
        raise ValueError("--dataset jsonl needs --dataset-path")
    _check_load_flags(args, rates)
    # Files first: a typo in a path should not cost the whole --ready-check-timeout-sec of an absent server.
    requests = datasets.jsonl_requests(args.dataset_path, args.num_prompts, args.output_len) \
        if args.dataset == "jsonl" else []
    credentials = Credentials.from_flags(args)
    with Client(args.target, credentials=credentials) as client:  # reads the TLS files
        client.wait_ready(timeout_s=args.ready_check_timeout_sec)
        info = client.model_info()
    if args.dataset == "random":
        high = datasets.length_range(args.input_len, args.range_ratio)[1]
        if high >= info.max_model_len:
            raise ValueError(f"random prompts up to {high} tokens do not fit max_model_len {info.max_model_len}")
        requests = datasets.random_requests(args.num_prompts, args.seed, info.vocab_size, args.input_len,
                                            args.output_len, args.range_ratio, list(info.eos_token_ids))
    # Every flag but the bearer key: result files get shared (benchmarks/results), keys must not.
    parameters = {key: value for key, value in vars(args).items() if key not in ("command", "func", "api_key")}
    parameters.update(request_rate=report.json_rate(args.request_rate),
                      request_rates=[report.json_rate(rate) for rate in rates],
                      model=info.model_name, tensor_parallel_size=info.tensor_parallel_size, dtype=info.dtype,
                      max_model_len=info.max_model_len, machine=f"{platform.machine()} {platform.node()}",
                      date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    runs = []
    for rate in rates:
        config = runner.LoadConfig(request_rate=rate, burstiness=args.burstiness, max_concurrency=args.max_concurrency,
                                   seed=args.seed, temperature=args.temperature, ignore_eos=args.ignore_eos,
                                   request_timeout_s=args.request_timeout, num_warmups=args.num_warmups,
                                   slos_ms=slos, show_progress=not args.disable_tqdm)
        try:
            run = runner.run(args.target, requests, config, credentials)
        except runner.LoadInterrupted as interrupted:  # what was measured is shown; no file is written
            print(report.format_summary(interrupted.run.summary, rate, args.burstiness, args.max_concurrency),
                  flush=True)
            print(f"tpserve bench: interrupted: the table counts the {len(interrupted.run.records)} of "
                  f"{len(requests)} requests that had ended", file=sys.stderr)
            return EXIT_INTERRUPTED
        print(report.format_summary(run.summary, rate, args.burstiness, args.max_concurrency), flush=True)
        runs.append(run)
    if len(runs) > 1:
        print(report.format_sweep(runs))
    title = f"{info.model_name}, tp {info.tensor_parallel_size}, {args.dataset} {len(requests)} prompts"
    if args.result_file:
        report.write_result(args.result_file, parameters, runs)
    if args.plot:
        if len(runs) > 1:
            plot.plot_sweep(runs, args.plot, f"Request-rate sweep: {title}")
        else:
            plot.plot_run(runs[0], args.plot, f"{title}, request rate {rates[0]:g}/s")
    return 0 if any(run.summary["completed"] for run in runs) else 1
