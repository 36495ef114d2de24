"""Measure tpserve's default model from its saved files.

    python -m training.evaluate --model tpserve/default_model

Loads the model with ``transformers.LlamaForCausalLM.from_pretrained`` and the
tokenizer with ``tokenizers.Tokenizer.from_file`` (nothing from the training
code but the grammar), then reports:

* held-out perplexity per token: each held-out document (grammar seed
  ``corpus.HELDOUT_SEED``, never trained on) is encoded as ``<s> text </s>``
  and every token after ``<s>`` is predicted from the document so far;
* the perplexity of a unigram model on the same held-out tokens, estimated on
  the training split (``corpus.TRAIN_SEED``) with add-one smoothing over the
  whole vocabulary;
* checks of the files: tokenizer round trip (ASCII, accents, CJK, emoji),
  ``<s>`` added by the post-processor, no remote-code fields in
  ``config.json``, shapes that split for tensor-parallel degrees 1, 2 and 4,
  total size at most 8 MiB;
* greedy completions (temperature 0) of three prompts, ``--max-new-tokens``
  tokens at most.

``--json PATH`` also writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from training import corpus

PROMPTS = [
    "Once upon a time, there was a little girl named Lily.",
    "Tom and Mia met in the park.",
    "Sam and Zoe wanted to build a sand castle.",
]
CHAT_PROMPTS = ["Tell me a story about a cat", "Tell me a story about a girl named Mia.", "What does a cow say?",
                "What is two plus three?"]
MAX_BYTES = 8 * 1024 * 1024


def _settings(model_dir: Path) -> dict:
    log = model_dir / "training_log.json"
    if log.exists():
        return json.loads(log.read_text())["settings"]
    from training.train import Settings  # defaults of the training run

    return {"n_train_docs": Settings.n_train_docs, "n_heldout_docs": Settings.n_heldout_docs}


def encode_docs(tok, docs: list[str], eos_id: int) -> list[list[int]]:
    return [enc.ids + [eos_id] for enc in tok.encode_batch(docs)]


@torch.no_grad()
def model_nll(model, seqs: list[list[int]], batch: int) -> tuple[float, int]:
    """Sum of -log p over every token after the first of each sequence, and their count."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    total, count = 0.0, 0
    for b in range(0, len(order), batch):
        group = [seqs[i] for i in order[b:b + batch]]
        width = max(len(s) for s in group)
        # right padding: causal attention keeps the pads out of real positions
        x = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros(len(group), width - 1, dtype=torch.bool)
        for r, s in enumerate(group):
            x[r, :len(s)] = torch.tensor(s)
            mask[r, :len(s) - 1] = True
        logits = model(input_ids=x[:, :-1]).logits.float()
        nll = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="none").view_as(mask)
        total += nll[mask].double().sum().item()
        count += int(mask.sum())
    return total, count


def unigram_nll(train: list[list[int]], held: list[list[int]], vocab: int) -> tuple[float, int]:
    counts = torch.zeros(vocab, dtype=torch.float64)
    for s in train:
        counts += torch.bincount(torch.tensor(s[1:]), minlength=vocab).double()
    logp = torch.log((counts + 1) / (counts.sum() + vocab))
    total, count = 0.0, 0
    for s in held:
        total -= logp[torch.tensor(s[1:])].sum().item()
        count += len(s) - 1
    return total, count


def check_files(model_dir: Path, tok, config: dict) -> dict:
    from training.tokenizer import BOS_ID, check_round_trip

    check_round_trip(tok)
    assert tok.encode("hello").ids[0] == BOS_ID
    bad = [k for k in ("auto_map", "trust_remote_code", "custom_pipelines") if k in config]
    assert not bad, f"config.json needs remote code: {bad}"
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size"):
        assert config[k] % 4 == 0, (k, config[k])
    assert config["max_position_embeddings"] >= 512
    tc = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert tc["tokenizer_class"] == "PreTrainedTokenizerFast" and tc["add_bos_token"] and not tc["add_eos_token"]
    gc = json.loads((model_dir / "generation_config.json").read_text())
    assert (gc["bos_token_id"], gc["eos_token_id"]) == (1, 2)
    sizes = {p.name: p.stat().st_size for p in sorted(model_dir.iterdir()) if p.is_file()}
    total = sum(sizes.values())
    assert total <= MAX_BYTES, f"{total} bytes > 8 MiB"
    return {"files": sizes, "total_bytes": total}


def main() -> None:
    ap = argparse.ArgumentParser(description="Perplexity, unigram baseline, file checks and greedy samples.")
    ap.add_argument("--model", type=Path, default=Path("tpserve/default_model"))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--prompt", action="append", default=None,
                    help="a prompt to complete greedily (repeatable; default: three built-in prompts)")
    ap.add_argument("--max-chat-tokens", type=int, default=200, help="longest greedy chat answer")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)

    from tokenizers import Tokenizer
    from transformers import LlamaForCausalLM

    tok = Tokenizer.from_file(str(a.model / "tokenizer.json"))
    model = LlamaForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    config = json.loads((a.model / "config.json").read_text())
    eos = config["eos_token_id"]
    vocab = config["vocab_size"]
    assert tok.get_vocab_size() == vocab
    n_params = sum(p.numel() for p in model.parameters())
    files = check_files(a.model, tok, config)

    st = _settings(a.model)
    held = encode_docs(tok, corpus.generate(corpus.HELDOUT_SEED, st["n_heldout_docs"]), eos)
    # the unigram baseline is estimated on the base run's training split (a chat fine-tune's log,
    # chat_training_log.json, is not the one read here)
    train = encode_docs(tok, corpus.generate(corpus.TRAIN_SEED, st["n_train_docs"]), eos)
    m_nll, m_n = model_nll(model, held, a.batch)
    u_nll, u_n = unigram_nll(train, held, vocab)
    assert m_n == u_n
    ppl, uni = math.exp(m_nll / m_n), math.exp(u_nll / u_n)

    # chat: held-out exchanges (a grammar seed never trained on), and greedy answers to CHAT_PROMPTS
    chats = encode_docs(tok, corpus.generate_chats(corpus.CHAT_HELDOUT_SEED, st.get("n_heldout_chats", 300)), eos)
    c_nll, c_n = model_nll(model, chats, a.batch)
    chat_samples = []
    for p in CHAT_PROMPTS:
        rendered = f"{corpus.USER}{p}\n{corpus.ASSISTANT}".rstrip()  # what CHAT_TEMPLATE renders, after <s>
        ids = torch.tensor([tok.encode(rendered).ids])
        outs = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=a.max_chat_tokens, pad_token_id=eos)
        new = outs[0, ids.shape[1]:].tolist()
        finish = "stop" if new and new[-1] == eos else "length"
        chat_samples.append({"user": p, "answer": tok.decode(new, skip_special_tokens=True).strip(),
                             "tokens": len(new) - (finish == "stop"), "finish": finish})

    samples = []
    for p in a.prompt or PROMPTS:
        ids = torch.tensor([tok.encode(p).ids])
        outs = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=a.max_new_tokens, pad_token_id=eos)
        new = outs[0, ids.shape[1]:].tolist()
        finish = "stop" if new and new[-1] == eos else "length"
        if finish == "stop":
            new = new[:-1]
        whole = tok.decode(ids[0].tolist() + new)
        samples.append({"prompt": p, "completion": whole[len(p):], "tokens": len(new), "finish": finish})

    result = {
        "model": str(a.model), "parameters": n_params,
        "heldout_documents": len(held), "heldout_tokens": m_n,
        "train_documents": len(train), "train_tokens": sum(len(s) - 1 for s in train),
        "heldout_nll": round(m_nll / m_n, 4), "heldout_perplexity": round(ppl, 3),
        "unigram_nll": round(u_nll / u_n, 4), "unigram_perplexity": round(uni, 2),
        "unigram_over_model": round(uni / ppl, 1),
        "heldout_chat_exchanges": len(chats), "heldout_chat_tokens": c_n,
        "heldout_chat_nll": round(c_nll / c_n, 4), "heldout_chat_perplexity": round(math.exp(c_nll / c_n), 3),
        **files, "samples": samples, "chat_samples": chat_samples,
    }
    print(f"parameters:            {n_params:,}")
    print(f"held-out tokens:       {m_n:,} in {len(held)} documents")
    print(f"held-out perplexity:   {ppl:.3f}  (model)")
    print(f"unigram perplexity:    {uni:.2f}  (add-one, estimated on {result['train_tokens']:,} training tokens)")
    print(f"unigram / model:       {uni / ppl:.1f}x")
    print(f"files:                 {files['total_bytes']:,} bytes in all")
    print(f"held-out chat perplexity: {math.exp(c_nll / c_n):.3f}  ({c_n:,} tokens in {len(chats)} exchanges)")
    for s in samples:
        print(f"\n[{s['tokens']} tokens, {s['finish']}] {s['prompt']}|{s['completion']}")
    for s in chat_samples:
        print(f"\n[chat, {s['tokens']} tokens, {s['finish']}] User: {s['user']}\nAssistant: {s['answer']}")
    if a.json:
        a.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
