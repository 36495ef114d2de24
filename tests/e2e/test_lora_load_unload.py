"""LoRA adapters loaded, used, unloaded and reloaded while 16 other streams decode (coordinator/lora_admin.py).

One ``tpserve serve --enable-lora --max-loras 1`` at tp 2 with a tenant and an operator API
key, no adapter at start-up, a tiny Llama at stories260k's vocabulary and a seeded ``peft``
adapter (tests/worker/lora_checkpoints.py). While 16 greedy base-model streams decode, the
operator: is refused a corrupt adapter (INVALID_ARGUMENT naming the tensor); loads the
adapter, whose greedy tokens equal ``peft``'s merged model in ``transformers``; is refused a
second adapter (RESOURCE_EXHAUSTED: one slot) and the unload of an adapter a stream is using
(FAILED_PRECONDITION); unloads it (a request naming it is then NOT_FOUND); reloads it, and
the prompt computed before is no prefix-cache hit for the reloaded adapter (its blocks are
never served again) while a second request is one. A tenant's load is PERMISSION_DENIED.
``tpserve:lora_requests_total`` and ``tpserve:lora_generation_tokens_total`` count the
adapter's requests and tokens under ``lora_name="a"``, none of the base model's, and
``vllm:lora_requests_info`` lists ``a`` while a stream uses it. Last, rank 1
is killed: the restarted group (``--worker-recovery-timeout-seconds``) reads the adapter again,
and its tokens are still ``peft``'s. Then its directory is deleted under a stream using it and rank 1
is killed again: the adapter is dropped (the stream fails UNAVAILABLE naming it, a new request gets
NOT_FOUND), the base model serves on, and the adapter loads again from a copy into its freed slot.
Every stream's largest inter-token gap over the calls stays under 200 ms, or, on a loaded
host, three times the streams' own largest gap before the calls (the host's noise; as
tests/e2e/test_structured_output_limits.py): the adapter is read off the step loop.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from tests.e2e.cluster import rank_pids, serve
from tests.paths import STORIES_DIR, requires_stories
from tests.tiny_models import save_servable_model
from tests.worker.lora_checkpoints import ALL_TARGETS, AdapterSpec, save_adapter
from tpserve.client import Client, Credentials

pytestmark = [pytest.mark.e2e, requires_stories]

TENANT_KEY, OPERATOR_KEY = "tenant-key-1", "operator-key-1"
BLOCK_SIZE, MAX_TOKENS, NUM_STREAMS = 16, 8, 16
PROMPT = [1] + [(37 * i) % 500 + 5 for i in range(39)]  # 40 tokens: two whole blocks cacheable
STREAM_PROMPT = [1] + [(11 * i) % 500 + 7 for i in range(15)]
ADAPTER = AdapterSpec("a", 4, 8.0, ALL_TARGETS, seed=31)
#: Seconds: a quiet host's bound on a stream's gaps while the calls run.
QUIET_GAP_S = 0.2
#: Tokens each stream decodes before the calls: their largest gap is the host's noise.
LEAD_IN_TOKENS = 12


def _greedy(model: torch.nn.Module) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=MAX_TOKENS,
                             min_new_tokens=MAX_TOKENS, eos_token_id=None, pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


def _corrupt_copy(adapter_dir: Path, directory: Path) -> str:
    """``adapter_dir`` with layer 0's q_proj A one input column short; the tensor's name."""
    directory.mkdir()
    (directory / "adapter_config.json").write_text((adapter_dir / "adapter_config.json").read_text())
    tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
    name = next(n for n in tensors if "layers.0.self_attn.q_proj.lora_A" in n)
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    return name


def _lora_metrics(metrics_port: int) -> dict[str, float]:
    """The ``/metrics`` samples of the per-adapter counters, by ``name{labels}``."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    return {name: float(value) for name, _, value in (line.rpartition(" ") for line in body.splitlines())
            if name.startswith(("tpserve:lora_requests_total", "tpserve:lora_generation_tokens_total",
                                "vllm:lora_requests_info"))}


def _outcome(call: Callable[[], Any]) -> Any:
    try:
        return call()
    except grpc.RpcError as exc:
        return exc.code(), exc.details()


def _while_streaming(client: Client, calls: Callable[[], Any]) -> tuple[Any, list[float], float]:
    """Runs ``calls`` while NUM_STREAMS greedy base-model streams decode (each restarts when it ends).

    Returns:
        ``calls()``'s result, every stream's inter-token gaps (seconds) overlapping the calls' window,
        clipped to it, and the largest gap of any stream before the window (the host's noise).
    """
    arrivals: list[list[tuple[float, int]]] = [[] for _ in range(NUM_STREAMS)]  # (time, stream number) per stream
    done = threading.Event()

    def stream(i: int) -> None:
        number = 0
        while True:
            number += 1
            for response in client.generate_stream(STREAM_PROMPT, max_tokens=200, temperature=0, ignore_eos=True,
                                                   timeout_s=300):
                arrivals[i].extend((time.monotonic(), number) for _ in response.token_ids)
                if done.is_set():
                    return

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(NUM_STREAMS)]
    for thread in threads:
        thread.start()
    try:
        while min(len(a) for a in arrivals) < LEAD_IN_TOKENS:
            time.sleep(0.01)
        window_start = time.monotonic()
        result = calls()
        window_end = time.monotonic()
    finally:
        done.set()
        for thread in threads:
            thread.join()
    gaps, lead_in = [], [0.0]
    for times in arrivals:
        assert times[-1][0] > window_end, "a stream ended before the calls did"
        for (a, sa), (b, sb) in zip(times, times[1:]):
            if sa != sb:
                continue  # across two requests: a time to first token, not a stalled step
            if b >= window_start and a <= window_end:
                gaps.append(min(b, window_end) - max(a, window_start))
            elif b < window_start:
                lead_in.append(b - a)
    assert gaps, "no two tokens of one stream around the calls: nothing was measured"
    return result, gaps, max(lead_in)


def test_adapters_load_and_unload_while_streams_decode(tmp_path: Path) -> None:
    base_dir = save_servable_model("gqa_tied", tmp_path / "base", STORIES_DIR)
    want = _greedy(save_adapter(base_dir, ADAPTER, tmp_path / "a"))
    bad_tensor = _corrupt_copy(tmp_path / "a", tmp_path / "bad")
    save_adapter(base_dir, AdapterSpec("b", 2, 4.0, ("q_proj",), seed=32), tmp_path / "b")
    with serve(base_dir, 2, "--enable-lora", "--max-loras", "1", "--max-lora-rank", "8",
               "--block-size", str(BLOCK_SIZE), "--api-key", TENANT_KEY, "--operator-api-key", OPERATOR_KEY,
               "--worker-recovery-timeout-seconds", "60",
               credentials=Credentials(api_key=OPERATOR_KEY)) as cluster:
        operator = cluster.client
        tenant = Client(cluster.target, credentials=Credentials(api_key=TENANT_KEY))

        def generate(client: Client = operator) -> Any:
            return client.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, lora_name="a")

        def calls() -> dict[str, Any]:
            seen: dict[str, Any] = {"tenant_load": _outcome(lambda: tenant.load_lora_adapter("a", str(tmp_path / "a"))),
                                    "bad": _outcome(lambda: operator.load_lora_adapter("a", str(tmp_path / "bad"))),
                                    "load": operator.load_lora_adapter("a", str(tmp_path / "a")),
                                    "listed": operator.list_lora_adapters(),
                                    "tenant_list": _outcome(tenant.list_lora_adapters),
                                    "second": _outcome(lambda: operator.load_lora_adapter("b", str(tmp_path / "b"))),
                                    "first": generate(tenant)}
            seen["metrics_first"] = _lora_metrics(cluster.metrics_port)
            busy = operator.generate_stream(PROMPT, max_tokens=200, temperature=0, ignore_eos=True, lora_name="a")
            seen["busy_tokens"] = len(next(iter(busy)).token_ids)  # running under a
            seen["metrics_busy"] = _lora_metrics(cluster.metrics_port)
            seen["busy_unload"] = _outcome(lambda: operator.unload_lora_adapter("a"))
            busy.cancel()
            deadline = time.monotonic() + 30
            while operator.list_lora_adapters().adapters[0].num_requests and time.monotonic() < deadline:
                time.sleep(0.02)  # the cancelled stream's handler ends
            seen["unload"] = operator.unload_lora_adapter("a")
            seen["after_unload"] = _outcome(generate)
            seen["empty"] = operator.list_lora_adapters()
            seen["reload"] = operator.load_lora_adapter("a", str(tmp_path / "a"))
            seen["reloaded"], seen["again"] = generate(), generate()
            seen["metrics_end"] = _lora_metrics(cluster.metrics_port)
            return seen

        seen, gaps, lead_in_gap = _while_streaming(operator, calls)
        tenant.close()
        # A restarted group reads the adapters loaded while serving again (launch/recovery.py).
        os.kill(rank_pids(cluster.process.pid)[1], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while cluster.metric("tpserve:worker_restarts_total") < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        operator.wait_ready(60)
        seen["after_restart"] = operator.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True,
                                                  lora_name="a", timeout_s=60)
        # An adapter whose files are gone when the group restarts is dropped: its stream fails UNAVAILABLE naming
        # it, and the base model serves on (before: the restart failed, and the server exited).
        shutil.copytree(tmp_path / "a", tmp_path / "a_copy")
        lost = operator.generate_stream(PROMPT, max_tokens=200, temperature=0, ignore_eos=True, lora_name="a")
        lost_chunks = iter(lost)
        next(lost_chunks)  # running under a
        shutil.rmtree(tmp_path / "a")
        os.kill(rank_pids(cluster.process.pid)[1], signal.SIGKILL)
        seen["lost_stream"] = _outcome(lambda: list(lost_chunks))
        operator.wait_ready(60)
        seen["restarts"] = cluster.metric("tpserve:worker_restarts_total")
        seen["dropped"] = _outcome(generate)
        seen["base_after_drop"] = operator.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        seen["reload_after_drop"] = operator.load_lora_adapter("a", str(tmp_path / "a_copy"))  # its slot is free
        seen["reloaded_after_drop"] = generate()

    assert seen["tenant_load"][0] == grpc.StatusCode.PERMISSION_DENIED, seen["tenant_load"]
    assert seen["tenant_list"][0] == grpc.StatusCode.PERMISSION_DENIED, seen["tenant_list"]
    code, details = seen["bad"]
    assert code == grpc.StatusCode.INVALID_ARGUMENT and bad_tensor in details, (code, details)
    assert seen["load"] == 1  # the slot freed by the refused load
    assert [(a.name, a.slot, a.path) for a in seen["listed"].adapters] == [("a", 1, str(tmp_path / "a"))]
    assert seen["listed"].max_loras == 1
    assert seen["second"][0] == grpc.StatusCode.RESOURCE_EXHAUSTED, seen["second"]
    assert seen["first"].token_ids == want and seen["first"].usage.cached_prompt_tokens == 0
    assert seen["busy_unload"][0] == grpc.StatusCode.FAILED_PRECONDITION, seen["busy_unload"]
    assert seen["after_unload"][0] == grpc.StatusCode.NOT_FOUND, seen["after_unload"]
    assert "lora_name 'a' is not a served adapter" in seen["after_unload"][1]
    assert list(seen["empty"].adapters) == []
    assert seen["reload"] == 1
    assert seen["reloaded"].token_ids == want
    assert seen["reloaded"].usage.cached_prompt_tokens == 0  # the unloaded adapter's blocks are never served
    assert seen["after_restart"].token_ids == want  # not the base model's: the slot was read again
    code, details = seen["lost_stream"]
    assert code == grpc.StatusCode.UNAVAILABLE and "LoRA adapter 'a' could not be read again" in details, details
    assert seen["restarts"] == 2
    assert seen["dropped"][0] == grpc.StatusCode.NOT_FOUND, seen["dropped"]
    assert seen["base_after_drop"].token_ids == _greedy(AutoModelForCausalLM.from_pretrained(base_dir))
    assert seen["reload_after_drop"] == 1 and seen["reloaded_after_drop"].token_ids == want
    assert seen["again"].token_ids == want and seen["again"].usage.cached_prompt_tokens == 2 * BLOCK_SIZE
    # Per-adapter metrics: the 16 base-model streams are not counted under any adapter.
    requests, tokens = 'tpserve:lora_requests_total{lora_name="a"}', 'tpserve:lora_generation_tokens_total{lora_name="a"}'
    info = 'vllm:lora_requests_info{max_lora="1",running_lora_adapters="%s",waiting_lora_adapters=""}'
    assert {k: v for k, v in seen["metrics_first"].items() if not k.startswith("vllm")} == \
        {requests: 1.0, tokens: MAX_TOKENS}
    assert [k for k in seen["metrics_first"] if k.startswith("vllm")] == [info % ""]  # no adapter in use
    assert [k for k in seen["metrics_busy"] if k.startswith("vllm")] == [info % "a"]  # the router's LoRA affinity
    assert seen["metrics_end"].keys() == {requests, tokens, info % ""}  # one series per name, across its reload
    assert seen["metrics_end"][requests] == 4.0  # first, the cancelled stream, reloaded, again
    assert seen["metrics_end"][tokens] >= 3 * MAX_TOKENS + seen["busy_tokens"]
    bound = max(QUIET_GAP_S, 3 * lead_in_gap)
    assert max(gaps) < bound, (f"inter-token gap up to {max(gaps) * 1000:.0f} ms while adapters were loaded "
                               f"(bound {bound * 1000:.0f} ms; {lead_in_gap * 1000:.0f} ms before)")
