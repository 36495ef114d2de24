"""``--enable-lora``'s flags (tpserve/lora_config.py): parsed, checked, and refused in one line where they do not combine."""

from __future__ import annotations

import pytest

from tpserve.cli import build_parser, serve_config
from tpserve.config import ClusterConfig
from tpserve.lora_config import LoRAConfig
from worker.lora_adapters import check_lora_supported


def test_flags_give_names_their_slots_in_order() -> None:
    args = build_parser().parse_args(["serve", "--enable-lora", "--lora-modules", "sql=/a/sql", "chat=/b/chat",
                                      "--max-loras", "3", "--max-lora-rank", "32"])
    lora = serve_config(args).lora
    assert lora.adapters == (("sql", "/a/sql"), ("chat", "/b/chat"))
    assert lora.slot_of() == {"sql": 1, "chat": 2}
    assert (lora.max_loras, lora.max_lora_rank) == (3, 32)
    assert serve_config(build_parser().parse_args(["serve"])).lora == LoRAConfig()  # off by default
    assert lora.max_cpu_loras is None  # default: --max-loras adapters kept in host memory
    args = build_parser().parse_args(["serve", "--enable-lora", "--max-loras", "2", "--max-cpu-loras", "6"])
    assert serve_config(args).lora.max_cpu_loras == 6


@pytest.mark.parametrize(("fields", "message"), [
    ({"lora_modules": ("a=/x",)}, "lora_modules needs enable_lora"),
    ({"enable_lora": True, "lora_modules": ("a=/x", "a=/y"), "max_loras": 2}, "names 'a' twice"),
    ({"enable_lora": True, "lora_modules": ("a=/x", "b=/y")}, "lora_modules has 2 adapters; max_loras=1"),
    ({"enable_lora": True, "lora_modules": ("/x",)}, "lora_modules entry '/x' is not name=path"),
    ({"enable_lora": True, "max_lora_rank": 0}, "greater than or equal to 1"),
    ({"enable_lora": True, "max_loras": 4, "max_cpu_loras": 2}, "max_cpu_loras=2 must be >= max_loras=4"),
])
def test_bad_lora_flags_are_refused(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LoRAConfig(**fields)


def test_lora_with_speculative_decoding_is_refused() -> None:
    with pytest.raises(ValueError, match="--enable-lora does not combine with --speculative-method"):
        ClusterConfig(lora={"enable_lora": True}, speculative={"speculative_method": "ngram",
                                                                "num_speculative_tokens": 2})


@pytest.mark.parametrize(("device", "draft", "pp", "message"), [
    ("cuda", False, 1, "--enable-lora is not supported on CUDA yet"),
    ("cpu", True, 1, "not supported with speculative decoding"),
    ("cpu", False, 2, "not supported with --pipeline-parallel-size > 1"),
])
def test_worker_refuses_what_lora_does_not_combine_with(device: str, draft: bool, pp: int, message: str) -> None:
    with pytest.raises(ValueError, match=message) as error:
        check_lora_supported(device, draft, pp)
    assert "\n" not in str(error.value)
    check_lora_supported("cpu", False, 1)  # the served combination
