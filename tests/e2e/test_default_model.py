"""The embedded default model: served with no --model, token for token with ``transformers``.

It needs no ../shared: this is what a fresh clone on a machine with no model hub
serves. The reference is Hugging Face ``transformers`` greedy generation on the same
files, loaded the way any Hugging Face checkpoint is.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tpserve.embedded_model import DEFAULT_MODEL_NAME, default_model_dir

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.e2e

PROMPTS = ["Once upon a time", "The little dog", "Mia said, \"", "Seven plus two is", "In the garden"]
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def references() -> list[dict]:
    """transformers' greedy completions of PROMPTS: token ids (eos excluded), text, finish reason."""
    from tokenizers import Tokenizer

    model_dir = default_model_dir()
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    model = transformers.LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    raw_eos = json.loads((model_dir / "config.json").read_text())["eos_token_id"]
    eos = set(raw_eos if isinstance(raw_eos, list) else [raw_eos])
    out = []
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt).ids
        with torch.inference_mode():
            generated = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                       eos_token_id=list(eos), pad_token_id=list(eos)[0])
        completion = generated[0, len(ids):].tolist()
        finish = "length"
        if completion and completion[-1] in eos:
            completion, finish = completion[:-1], "stop"
        whole = tokenizer.decode(ids + completion, skip_special_tokens=True)
        text = whole[len(tokenizer.decode(ids, skip_special_tokens=True)):]
        out.append({"prompt": prompt, "token_ids": completion, "text": text, "finish_reason": finish})
    return out


def test_the_embedded_model_is_a_complete_checkpoint() -> None:
    model_dir = default_model_dir()
    names = {p.name for p in model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json", "README.md"} <= names
    assert sum(p.stat().st_size for p in model_dir.iterdir()) <= 8 * 1024**2


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_served_greedy_completions_match_transformers(references, tensor_parallel_size, shared_servers) -> None:
    cluster = shared_servers.get(None, tensor_parallel_size)
    info = cluster.client.model_info()
    assert info.model_name == DEFAULT_MODEL_NAME and info.tensor_parallel_size == tensor_parallel_size
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(
            lambda ref: cluster.client.generate(ref["prompt"], max_tokens=MAX_TOKENS, temperature=0), references))
    for ref, result in zip(references, results):
        assert result.token_ids == ref["token_ids"], ref["prompt"]
        assert result.text == ref["text"] and result.finish_reason == ref["finish_reason"]
    assert sum(len(r.token_ids) for r in results) > 3 * MAX_TOKENS  # real text, not an early eos


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_async_scheduling_is_on_by_default_where_the_ranks_leave_the_coordinator_a_core(
        tensor_parallel_size, shared_servers) -> None:
    """The shared servers' ranks have one thread each (OMP_NUM_THREADS=1): on this 2-core host tp 1
    leaves the coordinator a core (async on), tp 2 takes both (off)."""
    info = shared_servers.get(None, tensor_parallel_size).client.model_info()
    assert info.async_scheduling == (tensor_parallel_size < len(os.sched_getaffinity(0)))


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_cpu_ranks_run_on_cores_of_their_own(tensor_parallel_size, shared_servers) -> None:
    """--cpu-omp-threads-bind auto (the default): at tp 2 each rank of one thread (OMP_NUM_THREADS=1) runs
    on one core of its own, every thread of it, the last cores of those the server may use; a host's only
    rank, and ranks that outnumber the cores, are left to the kernel."""
    from tests.e2e.cluster import child_pids

    cluster = shared_servers.get(None, tensor_parallel_size)
    allowed = sorted(os.sched_getaffinity(0))
    per_rank = []
    for pid in child_pids(cluster.process.pid):
        threads = {int(tid): frozenset(os.sched_getaffinity(int(tid))) for tid in os.listdir(f"/proc/{pid}/task")}
        assert len(set(threads.values())) == 1, f"rank process {pid}'s threads are bound apart: {threads}"
        per_rank.append(next(iter(threads.values())))
    assert len(per_rank) == tensor_parallel_size
    if tensor_parallel_size == 1 or tensor_parallel_size > len(allowed):
        assert per_rank == [frozenset(allowed)] * tensor_parallel_size
    else:
        assert sorted(min(cores) for cores in per_rank) == allowed[len(allowed) - tensor_parallel_size:]
        assert all(len(cores) == 1 for cores in per_rank)
    assert os.sched_getaffinity(cluster.process.pid) == set(allowed)  # the coordinator is not bound


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_the_ranks_of_the_coordinators_host_step_over_their_socket(tensor_parallel_size, shared_servers) -> None:
    """Each rank holds a connected step socket (tpserve/step_socket.py: ``<its gRPC socket>.step``), and
    steps run: the plans come that way, not on the gRPC Step stream."""
    from tests.e2e.cluster import child_pids

    cluster = shared_servers.get(None, tensor_parallel_size)
    assert cluster.client.generate("Once upon a time", max_tokens=4, temperature=0).token_ids
    connected = {}  # inode -> path, of connected Unix sockets bound to a path (/proc/net/unix)
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if len(fields) == 8 and fields[5] == "03":
            connected[fields[6]] = fields[7]
    for pid in child_pids(cluster.process.pid):
        inodes = {os.readlink(f"/proc/{pid}/fd/{fd}")[8:-1] for fd in os.listdir(f"/proc/{pid}/fd")
                  if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:[")}
        assert any(connected.get(inode, "").endswith(".sock.step") for inode in inodes), f"rank process {pid}"


CHAT = [{"role": "user", "content": "Tell me a story about a cat"}]


def test_the_embedded_model_chats_in_the_story_voice(shared_servers) -> None:
    """`tpserve generate --chat`: the template renders as transformers renders it, and the answer is
    transformers' greedy answer token for token: a story about a cat that ends with end-of-sequence."""
    model_dir = default_model_dir()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    rendered = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert rendered == "<s>User: Tell me a story about a cat\nAssistant:"
    ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    model = transformers.LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.inference_mode():
        generated = model.generate(torch.tensor([ids]), max_new_tokens=300, do_sample=False, eos_token_id=2,
                                   pad_token_id=2)
    reference = generated[0, len(ids):].tolist()
    assert reference[-1] == 2, "the reference answer did not end"
    result = shared_servers.get(None, 1).client.generate(CHAT, max_tokens=300, temperature=0)
    assert result.usage.prompt_tokens == len(ids)
    assert result.token_ids == reference[:-1] and result.finish_reason == "stop"
    assert " cat named " in result.text and result.text.rstrip().endswith((".", "!", '"'))
