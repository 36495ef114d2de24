"""Rank-to-GPU mapping with ``torch.cuda`` mocked: one GPU per local rank, refusals naming the counts."""

from __future__ import annotations

import pytest
import torch

from tests.worker.cuda_mock import FakeCuda
from worker.device import bind_thread, resolve_device
from worker.nccl_env import NCCL_ENV_DEFAULTS, configure_nccl_env
from worker.parallel_state import init_distributed


@pytest.mark.parametrize("device", ["cuda", "auto"])
def test_each_local_rank_takes_its_own_gpu(monkeypatch: pytest.MonkeyPatch, device: str) -> None:
    FakeCuda(num_gpus=4).install(monkeypatch)
    assert [resolve_device(device, r, 4) for r in range(4)] == [torch.device("cuda", r) for r in range(4)]
    # Two hosts of two ranks each: global ranks 2 and 3 are local ranks 0 and 1 of host 1.
    assert [resolve_device(device, local, 2) for local in (0, 1)] == [torch.device("cuda", 0), torch.device("cuda", 1)]


@pytest.mark.parametrize("device", ["cuda", "auto"])
def test_more_ranks_than_visible_gpus_is_refused_naming_the_counts(monkeypatch: pytest.MonkeyPatch,
                                                                   device: str) -> None:
    FakeCuda(num_gpus=2).install(monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(ValueError, match=r"4 ranks on this host need one GPU each, but 2 are visible "
                                         r"\(CUDA_VISIBLE_DEVICES=0,1\)"):
        resolve_device(device, 0, 4)


def test_cuda_without_a_gpu_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeCuda(num_gpus=0).install(monkeypatch)
    with pytest.raises(ValueError, match="--device cuda, but no CUDA GPU is visible"):
        resolve_device("cuda", 0, 1)
    assert resolve_device("auto", 0, 2) == torch.device("cpu")  # auto falls back to the CPU


def test_local_rank_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match=r"local_rank=2 is outside \[0, num_local_ranks=2\)"):
        resolve_device("cpu", 2, 2)


def test_bind_thread_sets_the_device_only_for_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = FakeCuda().install(monkeypatch)
    bind_thread(torch.device("cpu"))
    bind_thread(torch.device("cuda", 1))
    assert [device for _, device in cuda.set_device_calls] == [torch.device("cuda", 1)]


def test_init_distributed_refuses_an_unindexed_cuda_device(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeCuda(num_gpus=2).install(monkeypatch)
    with pytest.raises(ValueError, match="indexed CUDA device"):
        init_distributed(3, 4, "tcp://127.0.0.1:1", "cuda", 10.0)  # no modulo guess: cuda:3 % 2 would share a GPU


def test_nccl_env_fills_in_only_what_is_unset() -> None:
    environ = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "PATH": "/bin"}
    added = configure_nccl_env(environ, dump_dir="/var/dumps")
    assert environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"  # the operator's choice stands
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in added
    assert environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and int(environ["TORCH_FR_BUFFER_SIZE"]) > 0
    assert environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == "/var/dumps/tpserve_nccl_trace_rank_"
    assert set(added) == set(NCCL_ENV_DEFAULTS) - {"TORCH_NCCL_ASYNC_ERROR_HANDLING"} | {"TORCH_NCCL_DEBUG_INFO_TEMP_FILE"}
    assert configure_nccl_env(environ) == {}  # idempotent


@pytest.mark.parametrize(("checkpoint", "device", "expected"), [
    ("float32", "cpu", torch.float32), ("bfloat16", "cpu", torch.float32),
    ("float32", "cuda", torch.bfloat16), ("bfloat16", "cuda", torch.bfloat16), ("float16", "cuda", torch.float16),
])
def test_auto_dtype(tmp_path, checkpoint: str, device: str, expected: torch.dtype) -> None:
    """--dtype auto: float32 on the CPU; half precision on CUDA, bfloat16 for a float32 checkpoint."""
    import json

    from worker.server import _resolve_dtype

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
        "max_position_embeddings": 64, "torch_dtype": checkpoint}))
    assert _resolve_dtype("auto", str(tmp_path), torch.device(device)) is expected
    assert _resolve_dtype("float32", str(tmp_path), torch.device(device)) is torch.float32
