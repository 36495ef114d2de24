"""The int8 LM head of ``--quantization int8|int4`` (worker/lm_head_int8.py) against the float32 head it replaced, in one run.

A seeded random Llama with a real vocabulary (32,000 tokens, Llama 2's and TinyLlama's) and a
small decoder (hidden 1,024, 8 layers: 0.16B parameters, a fifth of them the head, as in
Llama 3.2 1B or Qwen2.5 0.5B), float32, tp 1 in this process: for each of int4 and int8 one
``ModelRunner`` with the int8 head (the default) and one with the head left float32 (the
baseline: ``takes_int8_head`` patched to False while it loads). Each round times the bare
decode step (``ModelRunner.execute``, benchmarks/peer_comparison.py ``bare_steps``) of every
runner at batch 1 and 16, the runners in turn; the medians over rounds and the ratios within
each round's pair are reported, with the bytes each holds and what the head's rounding does to the
logits (16 random prompts' last-position logits, int8 head against float32 head on the same layers:
error over the logits' standard deviation, and how many greedy tokens agree).

    .venv/bin/python benchmarks/lm_head_int8.py --rounds 5 --out benchmarks/results

With ``--baseline-repo PATH`` (a checkout from before the int8 head, say ``git worktree add /tmp/base
8f88bea``) the same model is then served through ``tpserve serve`` by both trees, int4 and int8 each
(four servers up at once, every rank on both cores), and each round streams peer_comparison's ``single``
request (32 tokens in, 128 out) to each: the client's decode ms/token, the trees' ratio within a round.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from unittest import mock

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.peer_comparison import bare_runner, bare_steps, build_model, machine_description  # noqa: E402
from benchmarks.report import save_report  # noqa: E402
from worker.memory import weight_bytes  # noqa: E402

SHAPE = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
             num_key_value_heads=4, vocab_size=32000, max_position_embeddings=1024,
             tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def build_real_vocab_model(directory: Path, seed: int) -> Path:
    """:data:`SHAPE`'s seeded random model (peer_comparison's ``build_model``), its tokenizer widened to the
    vocabulary: the embedded model's 1,024-token BPE vocabulary plus ``<extra_i>`` entries up to 32,000, so that
    every id the model can sample decodes (tpserve's detokenizer) and llama.cpp's converter lists as many
    tokens as the embedding has rows (benchmarks/llama_cpp/build.sh ``vocab32k``)."""
    build_model(directory, seed, SHAPE)
    path = directory / "tokenizer.json"
    tokenizer = json.loads(path.read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab.update({f"<extra_{i}>": i for i in range(len(vocab), SHAPE["vocab_size"])})
    path.write_text(json.dumps(tokenizer))
    return directory


def _runner(model_dir: Path, quantization: str | None, int8_head: bool):
    if int8_head:
        return bare_runner(model_dir, quantization=quantization)
    with mock.patch("worker.loader.takes_int8_head", return_value=False):
        return bare_runner(model_dir, quantization=quantization)


def _last_logits(runner, prompts: list[list[int]]) -> torch.Tensor:
    """``(P, vocab)`` float32: each prompt's last-position logits (one prefill each; the runner's blocks from 0)."""
    from tpserve.step import NewSequence, SamplingParams, ScheduledChunk, StepPlan

    blocks = tuple(range(max(map(len, prompts)) // runner.block_size + 1))
    if runner.num_blocks < len(blocks):
        runner.init_kv_cache(len(blocks))
    rows = []
    for i, prompt in enumerate(prompts):
        runner.execute(StepPlan(10_000 + 2 * i, (NewSequence(99, SamplingParams(temperature=0)),),
                                (ScheduledChunk(99, tuple(prompt), 0, blocks),)))
        rows.append(runner.last_logits[0].clone())
        runner.execute(StepPlan(10_001 + 2 * i, (), (), finished_seq_ids=(99,)))
    return torch.stack(rows)


def bare_rounds(runners: dict, rounds: int, context: int, steps: int) -> dict[str, dict[int, list[float]]]:
    """Each runner's bare decode step in ms at batch 1 and 16, one value a round (``bare_steps``: ``steps`` steps
    from ``context`` positions on), the runners in turn, in reverse order every other round."""
    times: dict[str, dict[int, list[float]]] = {name: {1: [], 16: []} for name in runners}
    for rnd in range(rounds):
        order = list(runners) if rnd % 2 == 0 else list(reversed(runners))
        for name in order:
            for batch, seconds in bare_steps(runners[name], [1, 16], context, steps=steps).items():
                times[name][batch].append(seconds * 1e3)
        print(f"round {rnd}: " + ", ".join(f"{n} {times[n][1][-1]:.2f}/{times[n][16][-1]:.2f} ms" for n in runners),
              flush=True)
    return times


def speedup(baseline: list[float], candidate: list[float]) -> dict:
    """The within-round ratios ``baseline / candidate`` (times) and their median."""
    ratios = [b / c for b, c in zip(baseline, candidate, strict=True)]
    return {"median": round(statistics.median(ratios), 3), "rounds": [round(r, 3) for r in ratios]}


def finish(report: dict, out: Path | None, name: str) -> None:
    """Print the report's figures and save it under ``out`` (benchmarks/report.py) when given."""
    for key, value in report.items():
        if key not in ("what", "shape"):
            print(f"{key}: {value}")
    if out is not None:
        print(f"saved {save_report(out, name, report)}")


def served_ab(model_dir: Path, trees: dict[str, Path], flags: dict[str, tuple[str, ...]], rounds: int
              ) -> dict[str, list[float]]:
    """Client decode ms/token of peer_comparison's ``single`` through ``tpserve serve`` (tp 1, the rank's threads by
    the server's rule), one value a round per ``{flags name}_{tree name}``: a server of each tree (a checkout, run
    from its directory) with each set of flags, all up at once, warmed up, then ``rounds`` interleaved rounds (the
    order reversed every other round)."""
    from benchmarks.peer_comparison import _load, workloads
    from tests.e2e.cluster import serve

    here = os.getcwd()
    with contextlib.ExitStack() as stack:
        targets = {}
        for name, extra in flags.items():
            for tree, path in trees.items():
                os.chdir(path)  # ``serve`` runs ``python -m launch.cli`` from the working directory
                try:
                    targets[f"{name}_{tree}"] = stack.enter_context(serve(model_dir, 1, *extra, omp_threads=None)).target
                finally:
                    os.chdir(here)
        for target in targets.values():  # warm-up: another draw of the same shapes
            asyncio.run(_load(target, workloads(0, rounds + 1)["batch16"][:4]))
        tpot: dict[str, list[float]] = {name: [] for name in targets}
        for rnd in range(rounds):
            order = list(targets) if rnd % 2 == 0 else list(reversed(targets))
            for name in order:
                tpot[name].append(asyncio.run(_load(targets[name], workloads(0, rnd + 1)["single"]))["tpot_median_ms"])
            print(f"served round {rnd}: " + ", ".join(f"{n} {tpot[n][-1]:.2f}" for n in targets), flush=True)
    return tpot


def _served(model_dir: Path, baseline: Path, rounds: int) -> dict:
    """Client decode ms/token of ``single`` through ``tpserve serve``: this tree and ``baseline``, int4 and int8."""
    tpot = served_ab(model_dir, {"float32_head": baseline, "int8_head": REPO},
                     {q: ("--quantization", q) for q in ("int4", "int8")}, rounds)
    return {"baseline": str(baseline), "decode_ms_per_token": {n: round(statistics.median(v), 3) for n, v in tpot.items()},
            "speedup_int8_head": {q: speedup(tpot[f"{q}_float32_head"], tpot[f"{q}_int8_head"]) for q in ("int4", "int8")}}


def bare_step_parser(doc: str, name: str) -> argparse.ArgumentParser:
    """The flags of a bare-step A/B: ``--rounds``, ``--context``, ``--steps``, ``--out``, ``--name`` (default ``name``)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--context", type=int, default=64, help="positions before the timed steps")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--name", default=name)
    return parser


def main() -> None:
    parser = bare_step_parser(__doc__, "lm_head_int8.json")
    parser.add_argument("--baseline-repo", type=Path, default=None,
                        help="a checkout whose LM head is float32: serve both trees too (module docstring)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_real_vocab_model(Path(tmp) / "model", 0)
        runners = {f"{q}_{head}": _runner(model_dir, q, head == "int8_head")
                   for q in ("int4", "int8") for head in ("int8_head", "float32_head")}
        generator = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, SHAPE["vocab_size"], (32,), generator=generator).tolist() for _ in range(16)]
        logits = {name: _last_logits(r, prompts) for name, r in runners.items()}
        held = {name: weight_bytes(r.model) for name, r in runners.items()}
        times = bare_rounds(runners, args.rounds, args.context, args.steps)
        del runners  # the servers' ranks below need the memory
        served = None if args.baseline_repo is None else _served(model_dir, args.baseline_repo.resolve(), args.rounds)
    report: dict = {
        "what": __doc__.split("\n\n")[0], "machine": machine_description(), "torch": torch.__version__,
        "shape": SHAPE, "rounds": args.rounds, "context": args.context, "steps": args.steps,
        "weight_bytes": held,
        "head_rounding_logit_error": {},
        "decode_step_ms": {n: {b: round(statistics.median(v), 3) for b, v in t.items()} for n, t in times.items()},
        "speedup_int8_head": {},
    }
    for q in ("int4", "int8"):
        ours, base = logits[f"{q}_int8_head"], logits[f"{q}_float32_head"]
        std = base.std(dim=-1, keepdim=True)  # (P, 1)
        report["head_rounding_logit_error"][q] = {
            "rms_over_std": round(((ours - base) / std).pow(2).mean().sqrt().item(), 5),
            "max_over_std": round(((ours - base).abs() / std).max().item(), 5),
            "argmax_equal": f"{int((ours.argmax(-1) == base.argmax(-1)).sum())}/{len(prompts)}"}
        for batch in (1, 16):
            report["speedup_int8_head"][f"{q}_batch{batch}"] = speedup(times[f"{q}_float32_head"][batch],
                                                                       times[f"{q}_int8_head"][batch])
    if served is not None:
        report["served"] = served
    finish(report, args.out, args.name)


if __name__ == "__main__":
    main()
