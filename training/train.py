"""Train tpserve's default model from scratch on two CPU cores.

    python -m training.train --out tpserve/default_model

Everything is derived from the project's own code: the text comes from the
seeded grammar in ``corpus.py``, the tokenizer is trained on it
(``tokenizer.py``), and a small ``transformers.LlamaForCausalLM`` is trained on
it with AdamW, linear warm-up and cosine decay: the first three quarters of
the steps on windows of 256 tokens (cheaper per token), the rest on windows of
512 so that every position up to ``max_position_embeddings`` is trained. Every
window starts at a document's ``<s>``; no text is seen twice. Seeds are fixed
and torch runs deterministic algorithms on two threads, so the same command on
the same software gives the same model (two runs gave a bit-identical
``model.safetensors``). Not part of CI: it takes about 12 minutes on two CPU
cores (AMD EPYC); needs the ``train`` extra (matplotlib) for the loss curve.

Writes to ``--out``: ``config.json``, ``model.safetensors``,
``generation_config.json``, ``tokenizer.json``, ``tokenizer_config.json``,
``training_log.json`` (settings, losses, wall times) and ``loss_curve.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from training import corpus
from training.tokenizer import BOS_ID, EOS_ID, check_round_trip, tokenizer_config, train_tokenizer


@dataclasses.dataclass
class Settings:
    # data
    n_train_docs: int = 64_000
    n_heldout_docs: int = 1_000
    # chat exchanges (corpus.Grammar.chat) mixed at random places among the training documents;
    # 0 (the base run) trains on the stories alone; the chat fine-tune gives 2,500 (model card, "Chat")
    n_chat_docs: int = 0
    n_heldout_chats: int = 300
    # fine-tuning: start from this model directory (its weights and tokenizer) instead of a random
    # initialisation and a new tokenizer, on stories drawn with story_seed (fresh text, not the
    # windows the model was trained on)
    init_from: str = ""
    story_seed: int = corpus.TRAIN_SEED
    tokenizer_docs: int = 20_000
    vocab_size: int = 1024
    # model
    hidden_size: int = 128
    intermediate_size: int = 512
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    max_position_embeddings: int = 512
    rope_theta: float = 10000.0
    # optimisation
    seq_len: int = 512
    batch_size: int = 4
    # the first short_fraction of the steps use windows of short_seq_len
    # tokens (same tokens per step: batch_size * seq_len // short_seq_len
    # windows), which is cheaper per token; the rest use seq_len
    short_seq_len: int = 256
    short_fraction: float = 0.75
    steps: int = 2150
    lr: float = 4e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta2: float = 0.95
    grad_clip: float = 1.0
    init_std: float = 0.02
    # evaluation during training
    eval_every: int = 100
    eval_windows: int = 24
    seed: int = 1234
    threads: int = 2


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def set_determinism(seed: int, threads: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)


def pack(tok, docs: list[str]) -> tuple[torch.Tensor, list[int]]:
    """All docs as one stream ``<s> doc </s> <s> doc </s> ...`` and the doc starts."""
    stream: list[int] = []
    starts: list[int] = []
    for enc in tok.encode_batch(docs):
        ids = enc.ids
        assert ids[0] == BOS_ID
        starts.append(len(stream))
        stream.extend(ids)
        stream.append(EOS_ID)
    return torch.tensor(stream, dtype=torch.long), starts


def windows(starts: list[int], total: int, length: int, begin: int = 0, count: int | None = None) -> tuple[list[int], int]:
    """Up to ``count`` non-overlapping windows of ``length`` tokens at or after
    ``begin``, each starting at a document start; and where the last one ends."""
    out: list[int] = []
    end = begin
    for s in starts:
        if count is not None and len(out) == count:
            break
        if s >= end and s + length <= total:
            out.append(s)
            end = s + length
    return out, end


def phases(s: Settings) -> list[tuple[int, int, int]]:
    """(steps, windows per step, window length without the extra target token) per phase."""
    n_short = int(round(s.steps * s.short_fraction)) if s.short_seq_len else 0
    out = []
    if n_short:
        out.append((n_short, s.batch_size * s.seq_len // s.short_seq_len, s.short_seq_len))
    out.append((s.steps - n_short, s.batch_size, s.seq_len))
    return out


def lr_at(step: int, s: Settings) -> float:
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    p = (step - s.warmup_steps) / max(1, s.steps - s.warmup_steps)
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


def build_model(s: Settings):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=s.vocab_size,
        hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_hidden_layers,
        num_attention_heads=s.num_attention_heads,
        num_key_value_heads=s.num_key_value_heads,
        max_position_embeddings=s.max_position_embeddings,
        rope_theta=s.rope_theta,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        initializer_range=s.init_std,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=None,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config)
    # scaled init of the residual projections (GPT-2 style) for a stable start
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(1 / math.sqrt(2 * s.num_hidden_layers))
            layer.mlp.down_proj.weight.mul_(1 / math.sqrt(2 * s.num_hidden_layers))
    return model


@torch.no_grad()
def eval_loss(model, data: torch.Tensor, batch: int, head: int) -> tuple[float, float]:
    """Mean loss over all positions of the windows, and over their first ``head`` positions."""
    model.eval()
    total, total_head = 0.0, 0.0
    for i in range(0, len(data), batch):
        x = data[i:i + batch]
        logits = model(input_ids=x[:, :-1]).logits
        nll = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="none").view(len(x), -1)
        total += nll.sum().item()
        total_head += nll[:, :head].sum().item()
    model.train()
    n = data.shape[0] * (data.shape[1] - 1)
    return total / n, total_head / (data.shape[0] * head)


def plot(log: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    tl = log["train_loss"]
    k = 20  # running mean over k steps
    smooth = [sum(tl[max(0, i - k + 1):i + 1]) / (i + 1 - max(0, i - k + 1)) for i in range(len(tl))]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=100)
    ax.plot(range(1, len(tl) + 1), tl, color="tab:blue", alpha=0.25, lw=0.8, label="train (per step)")
    ax.plot(range(1, len(tl) + 1), smooth, color="tab:blue", lw=1.6, label=f"train ({k}-step mean)")
    ev = log["heldout_loss"]
    n = log["settings"]["seq_len"]
    ax.plot([e[0] for e in ev], [e[1] for e in ev], "o-", color="tab:orange", ms=3.5, lw=1.4,
            label=f"held-out, all {n} positions")
    head = log.get("heldout_loss_head")
    if head and log["heldout_head_positions"] != n:
        ax.plot([e[0] for e in head], [e[1] for e in head], "s-", color="tab:green", ms=3, lw=1.2,
                label=f"held-out, first {log['heldout_head_positions']} positions")
    st = log["settings"]
    if st.get("short_seq_len") and st.get("short_fraction"):
        switch = int(round(st["steps"] * st["short_fraction"]))
        ax.axvline(switch, color="gray", ls="--", lw=0.8)
        ax.text(switch, 0.97, f" windows of {st['seq_len']} from here\n (before: {st['short_seq_len']})",
                transform=ax.get_xaxis_transform(), va="top", fontsize=8, color="gray")
    ax.set_yscale("log")
    ticks = [t for t in (0.2, 0.3, 0.5, 0.7, 1, 2, 3, 5, 7) if min(tl + [e[1] for e in ev]) * 0.9 <= t]
    ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per token, log scale)")
    ax.set_title(f"{log['name']}: training loss")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    t_start = time.perf_counter()
    ap = argparse.ArgumentParser(description="Train tpserve's default model from scratch.")
    ap.add_argument("--out", required=True, type=Path, help="output directory (e.g. tpserve/default_model)")
    ap.add_argument("--name", default="tpserve-tiny-stories")
    for f in dataclasses.fields(Settings):
        ap.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args()
    s = Settings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Settings)})
    set_determinism(s.seed, s.threads)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)

    def say(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:7.1f}s] {msg}", flush=True)

    # 1. text and tokenizer
    train_docs = corpus.generate(s.story_seed, s.n_train_docs)
    held_docs = corpus.generate(corpus.HELDOUT_SEED, s.n_heldout_docs)
    chat_docs = corpus.generate_chats(corpus.CHAT_TRAIN_SEED, s.n_chat_docs)
    mix = random.Random(s.seed)
    for doc in chat_docs:  # each chat at a random place; the stories keep their order
        train_docs.insert(mix.randrange(len(train_docs) + 1), doc)
    say(f"generated {len(train_docs)} training documents ({len(chat_docs)} chats) and {len(held_docs)} held-out")
    if s.init_from:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(Path(s.init_from) / "tokenizer.json"))
    else:
        tok = train_tokenizer(train_docs[:s.tokenizer_docs], s.vocab_size)
    check_round_trip(tok)
    tok.save(str(out / "tokenizer.json"))
    template = corpus.CHAT_TEMPLATE if s.n_chat_docs else None
    (out / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(s.max_position_embeddings, template), indent=2) + "\n")
    train_stream, train_starts = pack(tok, train_docs)
    held_stream, held_starts = pack(tok, held_docs)
    # each phase takes fresh windows from the stream: no text is seen twice
    gen = torch.Generator().manual_seed(s.seed)
    plan: list[tuple[list[int], int]] = []  # per step: window starts, window length + 1
    begin = 0
    for n_steps, per_step, length in phases(s):
        ws, begin = windows(train_starts, len(train_stream), length + 1, begin, n_steps * per_step)
        if len(ws) < n_steps * per_step:
            raise SystemExit(f"the training stream runs out of windows of {length + 1}: raise --n-train-docs")
        ws = [ws[i] for i in torch.randperm(len(ws), generator=gen).tolist()]
        plan += [(ws[i * per_step:(i + 1) * per_step], length + 1) for i in range(n_steps)]
    L = s.seq_len + 1
    held_w, _ = windows(held_starts, len(held_stream), L, 0, s.eval_windows)
    held = torch.stack([held_stream[w:w + L] for w in held_w])
    head = s.short_seq_len or s.seq_len  # held-out loss is also logged over the first `head` positions
    tokens_trained = sum(len(ws) * (n - 1) for ws, n in plan)
    say(f"tokenizer: {tok.get_vocab_size()} tokens; training stream {len(train_stream):,} tokens, "
        f"of which {begin:,} used ({tokens_trained:,} predicted); phases {phases(s)}")

    # 2. model
    if s.init_from:
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM.from_pretrained(s.init_from, dtype=torch.float32)
    else:
        model = build_model(s)
    n_params = sum(p.numel() for p in model.parameters())
    say(f"model: {n_params:,} parameters")
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": s.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=s.lr, betas=(0.9, s.beta2), eps=1e-8, foreach=True)

    log = {"name": args.name, "settings": dataclasses.asdict(s), "parameters": n_params,
           "train_loss": [], "heldout_loss": [], "heldout_loss_head": [], "heldout_head_positions": head,
           "lr": [], "loadavg_1min": []}
    t_train = time.perf_counter()
    cpu_train = time.process_time()
    load_before = os.getloadavg()
    model.train()
    for step in range(s.steps):
        if step % s.eval_every == 0:
            ev, ev_head = eval_loss(model, held, s.batch_size, head)
            log["heldout_loss"].append([step, round(ev, 5)])
            log["heldout_loss_head"].append([step, round(ev_head, 5)])
            log["loadavg_1min"].append([step, round(os.getloadavg()[0], 2)])
            say(f"step {step:5d}  held-out loss {ev:.4f} (first {head} positions {ev_head:.4f})")
        lr = lr_at(step, s)
        for g in opt.param_groups:
            g["lr"] = lr
        batch, n = plan[step]
        x = torch.stack([train_stream[w:w + n] for w in batch])
        logits = model(input_ids=x[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        log["train_loss"].append(round(loss.item(), 5))
        log["lr"].append(lr)
        if step % 10 == 0:
            el = time.perf_counter() - t_train
            say(f"step {step:5d}  loss {loss.item():.4f}  lr {lr:.2e}  "
                f"seq {n - 1}  {sum(len(b) * (m - 1) for b, m in plan[:step + 1]) / el:,.0f} tok/s")
    ev, ev_head = eval_loss(model, held, s.batch_size, head)
    log["heldout_loss"].append([s.steps, round(ev, 5)])
    log["heldout_loss_head"].append([s.steps, round(ev_head, 5)])
    train_seconds = time.perf_counter() - t_train
    train_cpu_seconds = time.process_time() - cpu_train
    load_after = os.getloadavg()
    say(f"step {s.steps:5d}  held-out loss {ev:.4f} (first {head} positions {ev_head:.4f})  "
        f"(training loop {train_seconds:.0f}s)")

    # 3. save
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID)
    model.save_pretrained(out, safe_serialization=True)
    log["lr"] = log["lr"][:: max(1, s.steps // 200)]
    log["training_loop_seconds"] = round(train_seconds, 1)
    log["training_loop_cpu_seconds"] = round(train_cpu_seconds, 1)  # both threads together
    log["tokens_trained"] = tokens_trained
    # 1-minute load average of the machine before and after the loop: >2 on
    # two cores means other processes shared them and the wall time is inflated
    log["loadavg_1min_before_after"] = [round(load_before[0], 2), round(load_after[0], 2)]
    log["wall_seconds"] = round(time.perf_counter() - t_start, 1)
    log["hardware"] = {"cpu": _cpu_name(), "torch_threads": torch.get_num_threads(),
                       "os_cpu_count": os.cpu_count()}
    log["software"] = {"python": platform.python_version(), "torch": torch.__version__,
                       "transformers": __import__("transformers").__version__,
                       "tokenizers": __import__("tokenizers").__version__}
    log["command"] = " ".join(["python", "-m", "training.train", *sys.argv[1:]])
    if not args.no_plot:
        plot(log, out / "loss_curve.png")
    log["wall_seconds"] = round(time.perf_counter() - t_start, 1)
    (out / "training_log.json").write_text(json.dumps(log, separators=(",", ":")) + "\n")
    for p in out.iterdir():  # safetensors writes 0600; the files are meant to be shared
        p.chmod(0o644)
    say(f"saved to {out}; wall time {log['wall_seconds']:.0f}s")


if __name__ == "__main__":
    main()
